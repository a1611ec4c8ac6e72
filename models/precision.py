"""One precision decision per machine, target and workload, made by timing that workload (DESIGN.md §7).

Which dtype is fastest depends on the work, not on one matmul. On an AMX Xeon a 2048² GEMM runs ~6x faster in bf16,
yet SmolLM2's one-token decode step costs the same in both dtypes (it is bound by memory traffic and per-op overhead);
only at the verify sizes of speculation (4-16 rows) does bf16 pull ahead. On CPUs without native bf16 instructions
bf16 is emulated and ~100x slower everywhere. So each workload is measured on the target's own layer shapes:

- ``serve``: one decode forward after a 128-token prefix at 1 … 8 and 16 rows (vanilla's step and the verify sizes
  of chains and trees), batch 1. The choice maximises speculation's predicted speedup over the fastest vanilla of
  any dtype (`serving_choice`); the dtype of that fastest vanilla is kept as ``vanilla_dtype``, the baseline.
- ``distill``: one decode forward of a batch of 32 rows (self-distillation's batched answerer); most tokens/s wins.
- ``train``: forward + backward of a one-layer model of the target's shapes on 2 × 128 tokens (an EAGLE-3 / MTP
  drafter is one such layer and the head), fp32 against bf16 autocast; the faster wins.

The probe is the target's architecture built from its HF config with 1 and 8 decoder layers (random weights);
a full forward is extrapolated as ``t1 + (L - 1) · (t8 - t1) / 7``, each time the fastest of 7 calls. ``prepare(model)`` installs the kernel
routing the server will use (``infer.kernels.cpu_linear``), so fp32 is timed the way it is served. Curves are cached
per machine (CPU model, flags, threads, torch) and target shape in ``$DRAFTERS_PRECISION_CACHE`` (default
``~/.cache/drafters/precision``), so a machine measures once. An explicit dtype always wins and is reported as the
user's choice; ``$DRAFTERS_CPU_BF16`` = fast / slow forces the automatic answer (the suite runs every bf16 path
that way on any CPU). On CUDA the answer is bf16 where the GPU supports it, without timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

WORKLOADS = ("serve", "distill", "train")
CPU_BF16_ENV = "DRAFTERS_CPU_BF16"
"""Forces the automatic answer of every workload: "fast" → bf16, "slow" → fp32, without measuring."""
CACHE_ENV = "DRAFTERS_PRECISION_CACHE"
FLAGS_THAT_MATTER = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
SERVE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 16)
DISTILL_BATCH = 32
TRAIN_SHAPE = (2, 128)
PREFIX = 128
PROBE_LAYERS = 8
"""The deeper probe's layers: the per-layer cost is (t8 - t1) / 7, so timing noise is multiplied by (L - 1) / 7."""
EMULATED = 3.0
"""bf16 slower than fp32 by this factor at one row is emulated arithmetic: its larger shapes are not timed."""
TIE = 0.03
"""Predicted speeds within 3 % are a tie, which goes to fp32 (exact arithmetic, one dtype for vanilla and verify)."""
DEFAULT_ACCEPTANCE = (0.6, 0.5, 0.45, 0.4, 0.4, 0.4, 0.4)
"""Conditional acceptance per draft depth assumed for serving when the drafter's own is not known yet: about what a
trained EAGLE-3 reaches on its own data (the shipped one's held-out TTT accuracy is 0.45 / 0.38 / 0.36 / 0.33)."""
CURVES_VERSION = 1
LOCK_WAIT_S = 600.0
"""How long a process waits for another one's measurement before taking over (it may have died)."""


# --------------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------------


@dataclass
class Machine:
    """What a reader needs to place a number: device, CPU model (or GPU), the flags that matter, threads, torch."""

    device: str
    name: str
    flags: list[str]
    threads: int
    torch: str

    @property
    def kind(self) -> str:
        """ "cuda", "amx" (AMX + AVX-512-BF16), "avx512_bf16" (without AMX) or "no native bf16"."""
        if self.device == "cuda":
            return "cuda"
        if "amx_bf16" in self.flags:
            return "amx"
        return "avx512_bf16" if "avx512_bf16" in self.flags else "no native bf16"

    @property
    def native_bf16(self) -> bool:
        return self.kind != "no native bf16"

    def words(self) -> str:
        """ "AMD EPYC 7B13 (avx2, avx512f; no native bf16), 2 threads, torch 2.13.0+cpu"."""
        if self.device == "cuda":
            return f"{self.name}, torch {self.torch}"
        flags = ", ".join(self.flags) or "no vector flags read"
        kind = "" if self.native_bf16 else "; no native bf16"
        return f"{self.name} ({flags}{kind}), {self.threads} threads, torch {self.torch}"

    def as_dict(self) -> dict:
        return {**asdict(self), "kind": self.kind, "words": self.words()}


def machine(cpuinfo: str | None = None, device: str = "cpu") -> Machine:
    """This machine (``cpuinfo`` replaces /proc/cpuinfo in tests)."""
    if device == "cuda":
        return Machine("cuda", torch.cuda.get_device_name(0), [], torch.get_num_threads(), torch.__version__)
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")]
    words = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), None)
    present = set(words) if words is not None else set(cpuinfo.split())
    flags = [f for f in FLAGS_THAT_MATTER if f in present]
    name = names[0] if names else (platform.processor() or platform.machine())
    return Machine("cpu", name, flags, torch.get_num_threads(), torch.__version__)


def forced_bf16() -> bool | None:
    """``$DRAFTERS_CPU_BF16``: True ("fast"), False ("slow") or None (unset: measure)."""
    forced = os.environ.get(CPU_BF16_ENV, "").strip().lower()
    if forced in ("fast", "slow"):
        return forced == "fast"
    if forced:
        raise ValueError(f"${CPU_BF16_ENV} must be 'fast', 'slow' or unset (measure), got {forced!r}")
    return None


# --------------------------------------------------------------------------------------------------
# The choice
# --------------------------------------------------------------------------------------------------


@dataclass
class PrecisionChoice:
    """The dtype of one workload, where it came from, and the measurement behind it."""

    workload: str
    dtype: str
    """"float32" or "bfloat16" (for ``train``: the autocast dtype; "float32" means no autocast)."""
    source: str
    """"user" (an explicit setting), "measured", "cached" (measured before on this machine), "forced"
    ($DRAFTERS_CPU_BF16), "flags" (no native bf16: not timed), "cuda" or "checkpoint" (the checkpoint's dtype)."""
    reason: str
    vanilla_dtype: str | None = None
    """``serve``: the dtype of the fastest vanilla step, the baseline of every speedup (may differ from ``dtype``)."""
    curves: dict[str, dict[int, float]] = field(default_factory=dict)
    """dtype → rows → milliseconds of the workload (``train``: row key 0)."""
    machine: dict = field(default_factory=dict)

    def line(self) -> str:
        """The one line every entry point prints: "precision (serve): bfloat16, measured: …"."""
        return f"precision ({self.workload}): {self.dtype}, {self.source}: {self.reason}"

    def as_dict(self) -> dict:
        return {**asdict(self), "curves": {d: {str(m): ms for m, ms in c.items()} for d, c in self.curves.items()}}


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """Tokens per verify step of a chain of k drafts with conditional acceptance α_i: 1 + Σ_i Π_{j≤i} α_j (bonus
    token included; Leviathan et al. 2023, for a chain)."""
    total, p = 1.0, 1.0
    for a in list(acceptance)[:k]:
        p *= a
        total += p
    return total


def serving_choice(
    curves: dict[str, dict[int, float]], acceptance: Sequence[float] = DEFAULT_ACCEPTANCE
) -> tuple[str, str, float, int]:
    """(serve dtype, vanilla dtype, predicted speedup, chain length) from per-dtype step-cost curves.

    Vanilla runs in the dtype of the cheapest one-row step; speculation's predicted speedup in dtype d with a chain
    of k is E_k · t_vanilla(1) / t_d(k + 1), over the fastest vanilla of any dtype. The dtype with the best chain
    serves; when nothing predicts a gain, or the best dtypes tie within ``TIE``, the choice falls back to vanilla's
    dtype (fp32 on a tie of dtypes). Draft cost is left out: it scales with the dtype much as the target does."""
    vanilla_dtype = min(curves, key=lambda d: (curves[d][1], d != "float32"))
    v = curves[vanilla_dtype][1]
    best: dict[str, tuple[float, int]] = {}
    for d, c in curves.items():
        options = [
            (expected_tokens(acceptance, k) * v / c[k + 1], k) for k in range(1, len(acceptance) + 1) if k + 1 in c
        ]
        if options:
            best[d] = max(options)
    if not best:
        return vanilla_dtype, vanilla_dtype, 1.0, 0
    top = max(best, key=lambda d: best[d][0])
    if "float32" in best and best["float32"][0] * (1 + TIE) >= best[top][0]:
        top = "float32"
    if best[top][0] <= 1.0:
        return vanilla_dtype, vanilla_dtype, 1.0, 0
    return top, vanilla_dtype, best[top][0], best[top][1]


def _fastest(curves: dict[str, dict[int, float]], rows: int) -> str:
    """The dtype with the cheapest workload, fp32 on a tie within ``TIE``."""
    top = min(curves, key=lambda d: curves[d][rows])
    if "float32" in curves and curves["float32"][rows] <= curves[top][rows] * (1 + TIE):
        return "float32"
    return top


def _curve_words(curves: dict[str, dict[int, float]], rows: Sequence[int]) -> str:
    short = {"float32": "fp32", "bfloat16": "bf16"}
    return "; ".join(
        f"{short.get(d, d)} " + ", ".join(f"t({m}) {c[m]:.1f}" for m in rows if m in c) + " ms"
        for d, c in curves.items()
    )


def decide(
    workload: str, curves: dict[str, dict[int, float]], acceptance: Sequence[float] = DEFAULT_ACCEPTANCE
) -> tuple[str, str | None, str]:
    """(dtype, vanilla dtype or None, reason in words) of ``workload`` from its measured curves."""
    if workload == "serve":
        dtype, vanilla, speedup, k = serving_choice(curves, acceptance)
        why = _curve_words(curves, (1, 2, 4, 8, 16))
        if k == 0:
            return dtype, vanilla, f"{why}; no chain predicts a gain over vanilla in {vanilla}"
        also = "" if dtype == vanilla else f" (vanilla is fastest in {vanilla}: the baseline runs there)"
        return dtype, vanilla, f"{why}; chain {k} predicts {speedup:.2f}x over the fastest vanilla in {dtype}{also}"
    rows = DISTILL_BATCH if workload == "distill" else 0
    dtype = _fastest(curves, rows)
    unit = f"one decode step of {DISTILL_BATCH} rows" if workload == "distill" else "a training step (fwd + bwd)"
    return dtype, None, f"{unit}: " + ", ".join(f"{d} {c[rows]:.1f} ms" for d, c in curves.items())


def choose(
    workload: str,
    config=None,
    device: str = "cpu",
    *,
    acceptance: Sequence[float] | None = None,
    prepare: Callable[[nn.Module], object] | None = None,
    timer: Callable[[str, str, int], float] | None = None,
    cpuinfo: str | None = None,
    cache_dir: str | Path | None = None,
    refresh: bool = False,
) -> PrecisionChoice:
    """The automatic dtype of ``workload`` for a target with HF ``config`` on ``device``.

    ``timer(workload, dtype, rows) -> ms`` and ``cpuinfo`` replace the machine in tests; otherwise the probe
    model of ``config`` is timed (`measure_curves`) and the curves are cached (``cache_dir`` / ``$DRAFTERS_PRECISION
    _CACHE``; ``refresh`` measures again). ``acceptance``: the drafter's conditional acceptance per depth, when known
    (serve)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    acceptance = tuple(acceptance or DEFAULT_ACCEPTANCE)
    if device == "cuda":
        where = machine(device="cuda")
        if torch.cuda.is_bf16_supported():
            return PrecisionChoice(
                workload, "bfloat16", "cuda", "bf16 on a GPU that supports it", "bfloat16", {}, where.as_dict()
            )
        return PrecisionChoice(workload, "float32", "cuda", "this GPU has no bf16", "float32", {}, where.as_dict())
    where = machine(cpuinfo)
    vanilla = "float32" if workload == "serve" else None
    forced = forced_bf16()
    if forced is not None:
        dtype = "bfloat16" if forced else "float32"
        return PrecisionChoice(
            workload,
            dtype,
            "forced",
            f"${CPU_BF16_ENV}={os.environ[CPU_BF16_ENV]}",
            vanilla and dtype,
            {},
            where.as_dict(),
        )
    dtypes = ["float32", "bfloat16"] if where.native_bf16 else ["float32"]
    source = "measured"
    if timer is not None:
        curves = {d: {m: timer(workload, d, m) for m in _rows(workload)} for d in dtypes}
    else:
        if config is None:
            raise ValueError("the precision choice measures the target's layer shapes: pass its HF config")
        path = _cache_path(workload, config, where, cache_dir)
        if refresh:
            path.unlink(missing_ok=True)
        curves, source = _measure_once(path, lambda: measure_curves(workload, config, dtypes, prepare))
    curves = _drop_emulated(curves)
    dtype, vanilla, reason = decide(workload, curves, acceptance)
    if not where.native_bf16:
        reason += f" (bf16 not timed: {where.name} has no avx512_bf16 / amx_bf16, so bf16 is emulated, ~100x slower)"
        source = "flags" if source == "measured" else source
    return PrecisionChoice(workload, dtype, source, reason, vanilla, curves, where.as_dict())


def user_choice(workload: str, dtype: str, setting: str) -> PrecisionChoice:
    """An explicit setting (``target.dtype=float32``, ``train.mixed_precision=bf16``), reported as the user's."""
    return PrecisionChoice(
        workload, dtype, "user", f"set by {setting}", dtype if workload == "serve" else None, {}, machine().as_dict()
    )


def _rows(workload: str) -> tuple[int, ...]:
    return SERVE_ROWS if workload == "serve" else ((DISTILL_BATCH,) if workload == "distill" else (0,))


def _drop_emulated(curves: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """Without a dtype measured only at its first point (``measure_curves`` stops timing emulated bf16 there)."""
    return {d: c for d, c in curves.items() if all(m in c for m in curves["float32"])}


# --------------------------------------------------------------------------------------------------
# The measurement
# --------------------------------------------------------------------------------------------------


def _probe(config, layers: int, dtype: torch.dtype, prepare) -> nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = config.__class__.from_dict(config.to_dict())
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    if prepare is not None:
        prepare(model)
    return model


def _best_ms(fn: Callable[[], object], reps: int = 7) -> float:
    """The fastest of ``reps`` calls after one warm-up: on a shared machine the minimum is the least disturbed."""
    fn()  # one-off kernel selection and allocation
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


@torch.no_grad()
def _decode_ms(model: nn.Module, rows: int, batch: int, vocab: int) -> float:
    """One forward of ``rows`` new tokens per sequence after a ``PREFIX``-token cache (trimmed back after each)."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(vocab, (batch, PREFIX), generator=g)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)
    new = torch.randint(vocab, (batch, rows), generator=g)
    positions = torch.arange(PREFIX, PREFIX + rows).expand(batch, rows)

    def step():
        model(input_ids=new, position_ids=positions, cache=cache, use_cache=True)
        cache.crop(-rows)  # transformers 5: a negative count of tokens to drop

    return _best_ms(step)


def _train_ms(model: nn.Module, dtype: torch.dtype, vocab: int) -> float:
    """Forward + backward of ``TRAIN_SHAPE`` tokens, under bf16 autocast when ``dtype`` is bf16 (weights stay fp32)."""
    model.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, TRAIN_SHAPE, generator=g)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    return _best_ms(step, reps=3)


def measure_curves(
    workload: str, config, dtypes: Sequence[str], prepare: Callable[[nn.Module], object] | None = None
) -> dict[str, dict[int, float]]:
    """dtype → rows → ms of ``workload`` for a full target of ``config``, from probes with 1 and ``PROBE_LAYERS``
    layers. The dtypes are timed in turn at each size, so a machine that slows down for a while (a shared host)
    slows both alike instead of deciding the comparison."""
    text = config.get_text_config()
    layers, vocab = text.num_hidden_layers, text.vocab_size
    if workload == "train":  # one drafter-sized layer and the head, as trained; autocast over fp32 weights
        model = _probe(text, 1, torch.float32, None)
        return {name: {0: _train_ms(model, getattr(torch, name), vocab)} for name in dtypes}
    deep = min(PROBE_LAYERS, layers)
    probes = {name: [_probe(text, n, getattr(torch, name), prepare) for n in (1, deep)] for name in dtypes}
    out: dict[str, dict[int, float]] = {name: {} for name in dtypes}
    for rows in _rows(workload):
        batch, m = (DISTILL_BATCH, 1) if workload == "distill" else (1, rows)
        for name in list(probes):
            t1, tn = (_decode_ms(p, m, batch, vocab) for p in probes[name])
            per_layer = (tn - t1) / (deep - 1) if deep > 1 else 0.0
            out[name][rows] = t1 + (layers - 1) * max(per_layer, 0.0)
            fp32 = out.get("float32", {}).get(rows)
            if name != "float32" and fp32 is not None and out[name][rows] > EMULATED * fp32:
                del probes[name]  # emulated: ~100x slower, its larger shapes would take minutes and decide nothing
    return out


def _signature(config) -> dict:
    text = config.get_text_config()
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    sig = {k: getattr(text, k, None) for k in keys}
    sig.update(kv=getattr(text, "num_key_value_heads", None), vocab=text.vocab_size)
    return sig


def _cache_path(workload: str, config, where: Machine, cache_dir: str | Path | None) -> Path:
    root = Path(cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "drafters" / "precision")
    key = {"v": CURVES_VERSION, "workload": workload, "target": _signature(config), "machine": asdict(where)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"{workload}-{digest}.json"


def _read_cache(path: Path) -> dict[str, dict[int, float]] | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent or half-written by a crash: measure again
    return {d: {int(m): float(ms) for m, ms in c.items()} for d, c in raw["curves"].items()}


def _measure_once(path: Path, measure: Callable[[], dict]) -> tuple[dict[str, dict[int, float]], str]:
    """The cached curves, or measured now by one process only: ranks of one ``accelerate launch`` on this machine
    must make the same choice, so whoever takes the lock measures and the others wait for its file."""
    curves = _read_cache(path)
    if curves is not None:
        return curves, "cached"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_suffix(".lock")
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        deadline = time.time() + LOCK_WAIT_S
        while time.time() < deadline and lock.exists():
            time.sleep(0.2)
        curves = _read_cache(path)
        if curves is not None:
            return curves, "cached"
        lock.unlink(missing_ok=True)  # the measuring process died: measure here
        return _measure_once(path, measure)
    try:
        curves = measure()
        _write_cache(path, curves)
    finally:
        lock.unlink(missing_ok=True)
    return curves, "measured"


def _write_cache(path: Path, curves: dict[str, dict[int, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"curves": {d: {str(m): v for m, v in c.items()} for d, c in curves.items()}}))
    os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one


def cpu_bf16_is_fast(cpu_flags: str | None = None, timer=None) -> bool:
    """Whether a 512² bf16 matmul beats fp32 by 1.25x here: the quick flag-and-matmul test used only for a choice no
    workload can be measured for (nothing to take layer shapes from). CPUs without native bf16 are ruled out without
    timing; ``$DRAFTERS_CPU_BF16`` forces the answer."""
    forced = forced_bf16()
    if forced is not None:
        return forced
    if not machine(cpu_flags).native_bf16:
        return False
    timer = timer or _matmul_seconds
    return timer(torch.bfloat16) * 1.25 <= timer(torch.float32)


def _matmul_seconds(dtype: torch.dtype, n: int = 512, reps: int = 5) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return _best_ms(lambda: a @ b, reps) / 1e3
