"""One precision decision per machine, target and workload, made by timing that workload (DESIGN.md §7).

Which dtype is fastest depends on the work, not on one matmul or on CPU flags. On an AMX Xeon a 2048² GEMM runs ~6x
faster in bf16, yet SmolLM2's one-token decode step costs the same in both dtypes (bound by memory traffic and
per-op overhead); only at the verify sizes of speculation (4-16 rows) does bf16 pull ahead. On this project's AVX2
EPYC, without native bf16 instructions, a bf16 512² GEMM is ~100x slower than fp32, yet SmolLM2's one-token bf16
step is faster than fp32's (half the bytes to read) while its prefill is far slower. So each workload is measured
on the target's own layer shapes, in both dtypes, on every CPU:

- ``serve``: one decode forward after a 128-token prefix at 1 … 8 and 16 rows (vanilla's step and the verify sizes
  of chains and trees) and the prefill of a 128-token prompt, batch 1. The choice maximises speculation's predicted
  speedup over the fastest vanilla of any dtype on a 128-token prompt with a 128-token answer (`serving_choice`);
  the dtype of that fastest vanilla is kept as ``vanilla_dtype``, the baseline.
- ``distill``: the prefill and one decode step of a batch of 32 (self-distillation's batched answerer); the most
  answer tokens/s wins.
- ``train``: forward + backward of a one-layer model of the target's shapes on 2 × 128 tokens (an EAGLE-3 / MTP
  drafter is one such layer and the head), fp32 against bf16 autocast, after a 512² GEMM in each dtype (a bf16
  GEMM ``EMULATED`` x behind ends bf16's race there: the step would take minutes and lose).

The curves are timed on a full-depth probe of the target, through the runtime's own forward where the caller hands it
in (`models.precision_curves`). They are cached per machine (CPU model, flags, threads, torch) and target shape in
``$DRAFTERS_PRECISION_CACHE`` (default ``~/.cache/drafters/precision``), so a machine measures once. An explicit dtype
always wins and is reported as the user's choice;
``$DRAFTERS_CPU_BF16`` = fast / slow forces the automatic answer (the suite runs every bf16 path that way on any
CPU). On CUDA the answer is bf16 where the GPU supports it, without timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from models.acceptance import expected_tokens
from models.precision_curves import (
    DISTILL_BATCH,
    GEMM,
    PREFILL,
    PREFIX,
    ServingPath,
    cached_curves,
    race,
)
from models.timing import gemm_seconds, monotone

WORKLOADS = ("serve", "distill", "train")
CPU_BF16_ENV = "DRAFTERS_CPU_BF16"
"""Forces the automatic answer of every workload: "fast" → bf16, "slow" → fp32, without measuring."""
CACHE_ENV = "DRAFTERS_PRECISION_CACHE"
FLAGS_THAT_MATTER = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
ANSWER = 128
"""Answer tokens of the modelled request: a decision weighs prefill against decoding by this mix."""
TIE = 0.03
"""Predicted speeds within 3 % are a tie, which goes to fp32 (exact arithmetic, one dtype for vanilla and verify)."""
DEFAULT_ACCEPTANCE = (0.6, 0.5, 0.45, 0.4, 0.4, 0.4, 0.4)
"""Conditional acceptance per draft depth assumed for serving when the drafter's own is not known yet: about what a
trained EAGLE-3 reaches on its own data (the shipped one's held-out TTT accuracy is 0.45 / 0.38 / 0.36 / 0.33)."""
CURVES_VERSION = 3
"""3: the runtime's forward routes bf16 layers too, and to oneDNN's packed weights (infer/kernels/cpu_linear.py);
2: serving curves timed through the runtime's forward on a full-depth probe; 1: extrapolated from 1 and 8 layers."""


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
    """"user" (an explicit setting), "measured", "cached" (measured before on this machine; serve re-checks t(1)),
    "measured again (the cache was stale: …)", "forced" ($DRAFTERS_CPU_BF16) or "cuda"."""
    reason: str
    vanilla_dtype: str | None = None
    """``serve``: the dtype of the fastest vanilla step, the baseline of every speedup (may differ from ``dtype``)."""
    curves: dict[str, dict[int, float]] = field(default_factory=dict)
    """dtype → rows → milliseconds of the workload (``train``: row key 0), as measured (best of its calls); a serving
    decision reads them fitted monotone in the rows (`fitted`)."""
    machine: dict = field(default_factory=dict)
    spread: dict[str, dict[int, float]] = field(default_factory=dict)
    """dtype → key → the spread of that timing (`models.timing.Timing.spread`), after re-measuring it while it was
    wider than `models.timing.MAX_SPREAD`; the reason states the widest."""

    def line(self) -> str:
        """The one line every entry point prints: "precision (serve): bfloat16, measured: …"."""
        return f"precision ({self.workload}): {self.dtype}, {self.source}: {self.reason}"

    def as_dict(self) -> dict:
        def keyed(by_dtype: dict[str, dict[int, float]]) -> dict:
            return {d: {str(m): v for m, v in c.items()} for d, c in by_dtype.items()}

        return {**asdict(self), "curves": keyed(self.curves), "spread": keyed(self.spread)}


def fitted(curve: dict[int, float]) -> dict[int, float]:
    """A serving curve with its decode rows made non-decreasing (`models.timing.monotone`; the prefill key stays as
    measured): a forward over more rows is never cheaper than one over fewer, so a 2-token verify timed below the
    1-token step lowers the step to it (the baseline gets the cheaper shape) instead of crediting speculation with it.
    Seen on a shared host: fp32 t(1) 41.5, t(2) 30.7, t(5) 108.3, t(8) 67.7 ms, from which the policy had predicted
    chain 1 at 1.81x and measured 1.11x."""
    rows = monotone({m: ms for m, ms in curve.items() if m > 0})
    return {m: rows.get(m, ms) for m, ms in curve.items()}


def serving_choice(
    curves: dict[str, dict[int, float]], acceptance: Sequence[float] = DEFAULT_ACCEPTANCE
) -> tuple[str, str, float, int]:
    """(serve dtype, vanilla dtype, predicted speedup, chain length) from per-dtype cost curves.

    The modelled request is a ``PREFIX``-token prompt and an ``ANSWER``-token answer. Vanilla in dtype d costs
    prefill_d + ANSWER · t_d(1); speculation with a chain of k costs prefill_d + ANSWER / E_k · t_d(k + 1). Vanilla
    runs in its cheapest dtype, and speculation's predicted speedup is over that, whichever dtype it runs in. The
    dtype with the best chain serves; when nothing predicts a gain, or the best dtypes tie within ``TIE``, the choice
    falls back to vanilla's dtype (fp32 on a tie of dtypes). Draft cost is left out: it scales with the dtype much
    as the target does. The decode rows are read `fitted`, so timing noise that makes a larger verify look cheaper
    than a smaller one moves neither the dtype nor the chain."""

    curves = {d: fitted(c) for d, c in curves.items()}

    def prefill(d: str) -> float:
        return curves[d].get(PREFILL, 0.0)

    vanilla_cost = {d: prefill(d) + ANSWER * c[1] for d, c in curves.items()}
    vanilla_dtype = min(curves, key=lambda d: (vanilla_cost[d], d != "float32"))
    v = vanilla_cost[vanilla_dtype]
    best: dict[str, tuple[float, int]] = {}
    for d, c in curves.items():
        options = [
            (v / (prefill(d) + ANSWER / expected_tokens(acceptance, k) * c[k + 1]), k)
            for k in range(1, len(acceptance) + 1)
            if k + 1 in c
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


def distill_tokens_per_s(curve: dict[int, float]) -> float:
    """Answer tokens/s of a batch of ``DISTILL_BATCH`` ``PREFIX``-token prompts answered with ``ANSWER`` tokens."""
    return DISTILL_BATCH * ANSWER / (curve.get(PREFILL, 0.0) + ANSWER * curve[DISTILL_BATCH]) * 1e3


def _pick(score: dict[str, float]) -> str:
    """The dtype with the highest score, fp32 on a tie within ``TIE``."""
    top = max(score, key=score.get)
    if "float32" in score and score["float32"] * (1 + TIE) >= score[top]:
        return "float32"
    return top


def _curve_words(curves: dict[str, dict[int, float]], rows: Sequence[int]) -> str:
    short = {"float32": "fp32", "bfloat16": "bf16"}
    out = []
    for d, c in curves.items():
        parts = [f"prefill({PREFIX}) {c[PREFILL]:.0f}"] if PREFILL in c else []
        parts += [f"t({m}) {c[m]:.1f}" for m in rows if m in c]
        out.append(f"{short.get(d, d)} " + ", ".join(parts) + " ms")
    return "; ".join(out)


def _fit_words(curves: dict[str, dict[int, float]]) -> str:
    """What the monotone fit changed, in words ("" where the curves were monotone already)."""
    short = {"float32": "fp32", "bfloat16": "bf16"}
    changed = []
    for d, c in curves.items():
        fit = fitted(c)
        changed += [f"{short.get(d, d)} t({m}) {c[m]:.1f} -> {fit[m]:.1f}" for m in c if fit[m] != c[m]]
    if not changed:
        return ""
    return "; read fitted non-decreasing in rows (a larger forward timed cheaper: " + ", ".join(changed) + " ms)"


def _spread_words(spread: dict[str, dict[int, float]] | None) -> str:
    """The widest spread of the timings behind a choice, in words ("" where none was recorded)."""
    widest = [(s, d, k) for d, by_key in (spread or {}).items() for k, s in by_key.items()]
    if not widest or max(widest)[0] == 0:
        return ""  # one call per timing (a test's timer, an emulated dtype): no spread to state
    s, d, k = max(widest)
    what = {GEMM: "the 512² GEMM", PREFILL: "the prefill", 0: "the training step"}.get(k, f"t({k})")
    return f"; timing spread (median over best) at most {s:.0%} ({d} {what})"


def decide(
    workload: str,
    curves: dict[str, dict[int, float]],
    acceptance: Sequence[float] = DEFAULT_ACCEPTANCE,
    skipped: dict[str, str] | None = None,
    spread: dict[str, dict[int, float]] | None = None,
) -> tuple[str, str | None, str]:
    """(dtype, vanilla dtype or None, reason in words) of ``workload`` from its measured curves. ``skipped``: dtypes
    left out of the race, with why (a measurement that showed them far behind); ``spread``: each timing's spread,
    the widest of which the reason states."""
    left_out = "".join(f"; {d} not timed further: {why}" for d, why in (skipped or {}).items())
    left_out += _spread_words(spread)
    if workload == "serve":
        dtype, vanilla, speedup, k = serving_choice(curves, acceptance)
        why = _curve_words(curves, (1, 2, 4, 8, 16)) + _fit_words(curves) + left_out
        if k == 0:
            return dtype, vanilla, f"{why}; no chain predicts a gain over vanilla in {vanilla}"
        also = "" if dtype == vanilla else f" (vanilla is fastest in {vanilla}: the baseline runs there)"
        request = f"a {PREFIX}-token prompt and {ANSWER}-token answer"
        return (
            dtype,
            vanilla,
            f"{why}; for {request}, chain {k} predicts {speedup:.2f}x over the fastest vanilla in {dtype}{also}",
        )
    if workload == "distill":
        rates = {d: distill_tokens_per_s(c) for d, c in curves.items()}
        words = ", ".join(f"{d} {r:.0f} answer tokens/s" for d, r in rates.items())
        return (
            _pick(rates),
            None,
            f"{_curve_words(curves, (DISTILL_BATCH,))}: {words} at batch {DISTILL_BATCH}{left_out}",
        )
    rates = {d: 1.0 / c[0] for d, c in curves.items()}
    words = ", ".join(f"{d} {c[0]:.1f} ms" for d, c in curves.items())
    return _pick(rates), None, f"a training step (fwd + bwd): {words}{left_out}"


def choose(
    workload: str,
    config=None,
    device: str = "cpu",
    *,
    acceptance: Sequence[float] | None = None,
    prepare: ServingPath | None = None,
    timer: Callable[[str, str, int], float] | None = None,
    cpuinfo: str | None = None,
    cache_dir: str | Path | None = None,
    refresh: bool = False,
) -> PrecisionChoice:
    """The automatic dtype of ``workload`` for a target with HF ``config`` on ``device``.

    ``timer(workload, dtype, key) -> ms`` and ``cpuinfo`` replace the machine in tests (key: a row count, or
    ``PREFILL``, or 0 for the training step, or -512 for the 512² GEMM); otherwise the probe model of ``config`` is
    timed (`models.precision_curves.cached_curves`), its decode forwards through ``prepare`` (`ServingPath`: the runtime's forward), and
    the curves are cached (``cache_dir`` / ``$DRAFTERS_PRECISION_CACHE``; ``refresh`` measures again).
    ``acceptance``: the drafter's conditional acceptance per depth, when known (serve). bf16 is
    timed on every CPU (never assumed slow: on this project's AVX2 EPYC a bf16 512² GEMM is ~100x slower than fp32,
    yet SmolLM2's one-token bf16 step is faster than fp32's); a size where it is ``EMULATED`` x behind
    (`models.precision_curves`) ends its race."""
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
        env = f"${CPU_BF16_ENV}={os.environ[CPU_BF16_ENV]}"
        return PrecisionChoice(workload, dtype, "forced", env, vanilla and dtype, {}, where.as_dict())
    source = "measured"
    if timer is not None:
        found, spread = race(workload, ["float32", "bfloat16"], lambda d, key: timer(workload, d, key))
    else:
        if config is None:
            raise ValueError("the precision choice measures the target's layer shapes: pass its HF config")
        path = _cache_path(workload, config, where, cache_dir)
        found, spread, source = cached_curves(workload, config, ["float32", "bfloat16"], prepare, path, refresh)
    curves, skipped = _complete(found)
    dtype, vanilla, reason = decide(workload, curves, acceptance, skipped, spread)
    return PrecisionChoice(workload, dtype, source, reason, vanilla, found, where.as_dict(), spread)


def redecide(choice: PrecisionChoice, acceptance: Sequence[float]) -> PrecisionChoice:
    """``choice`` (a measured or cached serving choice) decided again for a drafter's own ``acceptance``, from the
    same curves: no second timing, so one process cannot state two serving dtypes that differ by timing noise."""
    curves, skipped = _complete(choice.curves)
    dtype, vanilla, reason = decide(choice.workload, curves, tuple(acceptance), skipped, choice.spread)
    return replace(choice, dtype=dtype, vanilla_dtype=vanilla, reason=reason)


def user_choice(workload: str, dtype: str, setting: str) -> PrecisionChoice:
    """An explicit setting (``target.dtype=float32``, ``train.mixed_precision=bf16``), reported as the user's."""
    return PrecisionChoice(
        workload, dtype, "user", f"set by {setting}", dtype if workload == "serve" else None, {}, machine().as_dict()
    )


def _complete(found: dict[str, dict[int, float]]) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    """(the dtypes timed at every key, stripped of the GEMM probe; why each other one left the race)."""
    full = set(found["float32"])
    curves = {d: {k: v for k, v in c.items() if k != GEMM} for d, c in found.items() if set(c) == full}
    skipped = {}
    for d, c in found.items():
        if d in curves:
            continue
        key = max(c, key=lambda k: c[k] / found["float32"][k])
        what = {GEMM: "a 512² GEMM", PREFILL: f"prefill of {PREFIX} tokens"}.get(key, f"t({key})")
        skipped[d] = f"{what} took {c[key]:.1f} ms against fp32's {found['float32'][key]:.1f}"
    return curves, skipped


def cpu_bf16_is_fast(timer=None) -> bool:
    """Whether a 512² bf16 matmul beats fp32 by 1.25x here: the quick test used only for a choice no workload can be
    measured for (nothing to take layer shapes from). Timed on every CPU, whatever its flags; ``$DRAFTERS_CPU_BF16``
    forces the answer; ``timer(dtype) -> seconds`` replaces the machine in tests."""
    forced = forced_bf16()
    if forced is not None:
        return forced
    timer = timer or (lambda dtype: gemm_seconds(dtype).best)
    return timer(torch.bfloat16) * 1.25 <= timer(torch.float32)


# --------------------------------------------------------------------------------------------------
# The cache key
# --------------------------------------------------------------------------------------------------


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
