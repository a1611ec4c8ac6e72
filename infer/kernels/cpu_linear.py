"""Small-row linear layers on the CPU, with the fastest of four matmul layouts chosen by measurement.

Decode and verification multiply a few rows (1 token, or a draft tree of 2–16) by every weight matrix of the target.
On this project's CPU (AMD EPYC, AVX2, 2 threads, MKL) ``F.linear`` with 2–4 rows cost ~2x one row (one row takes a
bandwidth-bound gemv, several rows a gemm that reads the weight less efficiently). Measured on SmolLM2's 49,152 x 576
head: F.linear 9.1 ms at 1 row and 19.2–19.7 ms at 2–4 rows; ``x @ Wᵀ`` with Wᵀ contiguous 4.9 ms at 1 row;
``W @ xᵀ`` 5.1–5.2 ms at 2–4 rows. Other CPUs differ, so `install` times the three layouts for every weight shape of
the model and row-count bucket, then routes each inference call (no grad) to the winner; training calls stay on
F.linear. Three details decide whether the routing pays inside a model (SmolLM2 target step with 4 tokens: 91 ms with
F.linear, 65 ms routed without them, 52 ms with them; 1 token 46 ms):

- operands and results are made row-major: an elementwise op keeps the transposed layout of a ``W @ xᵀ`` result, and
  MKL's gemm with a column-major [K, m] right operand ran ~4x slower (580 vs 124 µs for 576 x 1536 at 4 rows);
- rows are zero-padded up to their bucket: 3, 6 or 12 rows measured slower than 4, 8 or 16;
- layouts are timed on more weight copies than the L3 cache holds, so each call streams its weight from memory as
  it does in a 538 MB model (one warm copy favoured layouts that lose inside the model).

The fourth layout hands the weight to oneDNN once in its own blocked layout (``packed``), where ``F.linear`` lets
oneDNN (bf16) or MKL (fp32) take the plain weight on every call. On the 2-core AVX-512-BF16 EPYC, SmolLM2's 1536 x 576
weight streamed from memory (the median of a pass over 40 copies): bf16 71.5 → 43.0 µs at 1 row, 72.4 → 46.5 at 4, 96.5
→ 72.6 at 16, 243.7 → 207.7 at 96 (bit-identical results); fp32 219 → 74 µs at 1 row and 1,231 → 519 at 128. bf16
layers are routed as fp32 ones are, and the buckets reach 128 rows for batched decoding (self-distillation).

All layouts compute the same dot products; only the summation order inside the library differs (~1e-7 relative in
fp32), which is the rounding-level difference DESIGN.md §7 already allows between vanilla decoding and tree
verification. Vanilla decoding and HF generate run through the same routed modules, so the baseline gains as much as
it can.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from infer.kernels.shape_invariant import rows_of
from models.timing import best_of

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
"""Row counts timed; a call with m rows uses the choice of the smallest bucket >= m (more rows: F.linear). 32 to 128
are batched decoding (self-distillation, 96 rows by default): measured on the AVX2 EPYC, ``W @ xᵀ`` ran SmolLM2's
1536 x 576 fp32 weight at 53 / 65 GFLOP/s against F.linear's 36 / 47 at 32 / 64 rows."""
PAD_UP_TO = 16
"""Up to this bucket a call's rows are zero-padded to the bucket (odd small row counts measured slower); above it
only where the bucket's choice says ``@<rows>``: padding 33 rows to 64 would double the work."""


LAYOUTS = ("linear", "w_x", "x_wt", "packed")
"""``F.linear(x, W)``; ``(W @ xᵀ)ᵀ``; ``x @ Wᵀ`` with Wᵀ kept contiguous (a transposed copy of W, made once); oneDNN's
matmul on W reordered once into its blocked layout (``packed``, where oneDNN can pack the weight's dtype: `packs`)."""
PACK_ROWS = 64
"""The row count oneDNN lays the packed weight out for; measured here, a weight packed for 96 rows ran 1 to 64 rows as
fast as one packed for each (within 3 %)."""


COLD_BYTES = 64 << 20
"""Weight bytes cycled through while timing: more than the L3 cache, so each timed call streams its weight from
memory as it does inside a model (a single warm copy favours layouts that are slower in the model)."""
MAX_COPIES = 256


@torch.inference_mode()
def choose_layouts(weight: torch.Tensor, reps: int = 3) -> tuple[str, ...]:
    """Per bucket, the fastest way to multiply that many rows: a layout (another layout must beat F.linear by 5 %),
    or ``"<layout>@<rows>"``: zero-pad up to a larger bucket and use its layout, where that is faster still (by 5 %).
    One token is the vanilla step, so this makes vanilla as fast as the machine allows: measured here on an EPYC
    with avx512, SmolLM2's fp32 step took 43 ms at 1 row and 31 ms at 2 rows before rows were padded up."""
    # at most MAX_COPIES: a tiny test model's weights would need thousands to fill COLD_BYTES (minutes of timing);
    # SmolLM2's smallest weight (192 x 576) needs 152
    n = min(MAX_COPIES, max(1, -(-COLD_BYTES // (weight.numel() * weight.element_size()))))
    copies = [weight.clone() for _ in range(n)]
    transposed = [w.t().contiguous() for w in copies]
    packed = [pack(w) for w in copies] if packs(weight.dtype) else []
    out = []
    for m in BUCKETS:
        x = torch.randn(m, weight.shape[1], dtype=weight.dtype)
        calls = {
            "linear": lambda x=x: [F.linear(x, w) for w in copies],
            "w_x": lambda x=x: [torch.mm(w, x.t()).t().contiguous() for w in copies],
            "x_wt": lambda x=x: [torch.mm(x, wt) for wt in transposed],
        }
        if packed:
            calls["packed"] = lambda x=x: [packed_matmul(x, p) for p in packed]
        times = {name: best_of(fn, reps).best for name, fn in calls.items()}
        best = min(times, key=times.get)
        chosen = best if times[best] < 0.95 * times["linear"] else "linear"
        out.append((chosen, times[chosen]))
    return lower_envelope(out)


def lower_envelope(per_bucket: list[tuple[str, float]]) -> tuple[str, ...]:
    """(layout, seconds) per bucket → the choice per bucket: m rows cost at most what any larger bucket costs (pad
    with zero rows), so a bucket takes a larger one's layout as ``"<layout>@<rows>"`` where that is 5 % faster."""
    choice = []
    for i, (layout, seconds) in enumerate(per_bucket):
        j = min(range(i, len(per_bucket)), key=lambda j: per_bucket[j][1])
        faster = j != i and per_bucket[j][1] < 0.95 * seconds
        choice.append(f"{per_bucket[j][0]}@{BUCKETS[j]}" if faster else layout)
    return tuple(choice)


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack a weight of ``dtype`` here: bf16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, which an
    AVX2-only CPU lacks (its reorder raises there), so the layout is not timed for bf16 on such a CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] reordered once into oneDNN's blocked layout (an opaque tensor for `packed_matmul`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x`` [m, K] (row-major) times the packed weight's transpose: [m, N]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class WeightCache(dict):
    """A routed module's copies of its weight in other layouts (Wᵀ, the packed weight), by name: (weight version,
    tensor). A deep copy of the module (a replica in another dtype) starts without them and builds its own: an opaque
    oneDNN tensor cannot be copied, and a replica's weights are new tensors anyway."""

    def __deepcopy__(self, memo: dict) -> WeightCache:
        return WeightCache()


def _cached(module: nn.Linear, name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``make(weight)`` kept on the module, rebuilt whenever the weight changed in place (its version counter moved)
    or was replaced."""
    w = module.weight
    # a weight made under inference_mode (a proposer's fused snapshot built inside a decode) has no version counter;
    # it can only change in place inside inference_mode, which no caller does to weights, so its storage names it
    version = (w.data_ptr(), None if w.is_inference() else w._version)
    cache = module.__dict__.get("_drafters_weights")
    if cache is None:  # not setdefault: that would build an empty cache on every call of the decode loop
        cache = module.__dict__["_drafters_weights"] = WeightCache()
    if name not in cache or cache[name][0] != version:
        cache[name] = (version, make(w.detach()))
    return cache[name][1]


def _prepare_layouts(module: nn.Linear, layouts: tuple[str, ...]) -> None:
    """Build the weight copies ``layouts`` route to now rather than at the first call: a proposer's drafter snapshot
    is made per generate call, and its ~6 packs (~3 ms each on the 2-core EPYC) landed inside the timed decode."""
    used = {lay.partition("@")[0] for lay in layouts}
    if "packed" in used:
        _cached(module, "packed", pack)
    if "x_wt" in used:
        _cached(module, "wt", _transpose)


def _transpose(weight: torch.Tensor) -> torch.Tensor:
    """Wᵀ, contiguous: the ``x_wt`` layout's copy."""
    return weight.t().contiguous()


def small_rows_linear(module: nn.Linear, x: torch.Tensor, layouts: tuple[str, ...]) -> torch.Tensor:
    """``module(x)`` with the layout measured fastest for x's row count (inference only)."""
    rows = x.numel() // x.shape[-1]
    if torch.is_grad_enabled() or rows > BUCKETS[-1]:
        return F.linear(x, module.weight, module.bias)
    bucket = next(i for i, b in enumerate(BUCKETS) if rows <= b)
    layout, _, pad = layouts[bucket].partition("@")
    if layout == "linear" and not pad:
        return F.linear(x, module.weight, module.bias)
    # Row-major operands and results: an elementwise op keeps a transposed layout, and MKL's gemm with a column-major
    # [K, m] right operand runs ~4x slower than with a row-major one (measured: 580 vs 124 µs for 576x1536, 4 rows).
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    padded = int(pad) if pad else (BUCKETS[bucket] if BUCKETS[bucket] <= PAD_UP_TO else rows)
    if rows < padded:
        # Zero rows up to the bucket: MKL's kernels for odd row counts (3, 6, 12) measured slower than for the next
        # bucket (a 3-token target step 57 ms vs 4 tokens 51 ms); each output row is still its own dot products.
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    if layout == "linear":
        y = F.linear(flat, module.weight)[:rows]
    elif layout == "w_x":
        y = torch.mm(module.weight, flat.t()).t()[:rows].contiguous()
    elif layout == "packed":
        y = packed_matmul(flat, _cached(module, "packed", pack))[:rows]
    else:
        y = torch.mm(flat, _cached(module, "wt", _transpose))[:rows]
    if module.bias is not None:
        y = y + module.bias
    return y.reshape(*x.shape[:-1], module.weight.shape[0])


ROUTED_DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes whose layers are routed (fp16 matmuls on the CPU are not this project's serving path)."""

MEASURED: dict[tuple[tuple[int, int], torch.dtype], tuple[str, ...]] = {}
"""Layout choice per (weight shape, dtype) measured in this process (proposers build a fresh drafter snapshot per
generate call, which would otherwise time the same shapes again on every call)."""


def install(model: nn.Module, log=print) -> dict[tuple[int, int], tuple[str, ...]]:
    """Time the layouts for each weight shape of ``model``'s fp32 and bf16 CPU Linear layers and route their inference
    calls accordingly. Returns the choice per shape and bucket. A second call on the same model returns the first
    call's choices without timing again."""
    if getattr(model, "_drafters_cpu_linear", None) is not None:
        return model._drafters_cpu_linear
    if rows_of(model) is not None:  # routing now would replace the mode's blocked forwards
        raise RuntimeError("install cpu_linear before the shape-invariant mode, which wraps the forwards it finds")
    choices: dict[tuple[int, int], tuple[str, ...]] = {}
    for module in model.modules():
        if not isinstance(module, nn.Linear) or module.weight.device.type != "cpu":
            continue
        if module.weight.dtype not in ROUTED_DTYPES:
            continue
        shape = tuple(module.weight.shape)
        if shape not in choices:
            key = (shape, module.weight.dtype)
            if key not in MEASURED:  # timing depends on the shape only: a new model (or drafter snapshot) reuses it
                MEASURED[key] = choose_layouts(module.weight.detach())
            choices[shape] = MEASURED[key]
        layouts = choices[shape]
        if any(lay != "linear" for lay in layouts):
            module.forward = types.MethodType(lambda self, x, u=layouts: small_rows_linear(self, x, u), module)
            _prepare_layouts(module, layouts)
    model._drafters_cpu_linear = choices
    routed = {s: c for s, c in choices.items() if any(lay != "linear" for lay in c)}
    described = "; ".join(
        f"{s[0]}x{s[1]} " + " ".join(f"{b}:{lay}" for b, lay in zip(BUCKETS, c)) for s, c in routed.items()
    )
    log(f"cpu linear (rows:layout): {described or 'F.linear everywhere, the fastest here'}")
    return choices


def uninstall(model: nn.Module) -> None:
    """Back to plain F.linear everywhere (undoes `install`)."""
    if rows_of(model) is not None:
        raise RuntimeError("uninstall the shape-invariant mode first: it wraps the routed forwards")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.__dict__.pop("forward", None)
    model.__dict__.pop("_drafters_cpu_linear", None)
    for module in model.modules():
        module.__dict__.pop("_drafters_weights", None)
