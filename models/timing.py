"""The one clock and the one timer every measurement reads: wall time after the device has finished its queued work,
best-of repeated calls with their spread, the GEMM-rate probe, and the monotone fit of a cost curve.

CUDA (and other accelerators) run kernels asynchronously: ``time.perf_counter()`` right after a forward returns
measures how long the launches took, not the forward. Every timer in ``models/``, ``infer/`` and ``eval/`` therefore
reads `clock`, which first waits for the device, so draft / verify / bookkeeping splits, the cost curve, the
precision policy and the speedups built on them mean the same on a GPU as on a CPU (where the wait is a no-op).

It sits at the bottom of the house (``models/``) because the precision policy, which imports nothing above
``models/``, times forwards with it as the cost curve, the dtype curves and the invariance table do.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Wait until ``device`` has finished every queued kernel (nothing to wait for on the CPU)."""
    if device is None:
        return
    # the decode loop reads the clock several times a step: no torch.device construction for the usual argument
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu":
        return
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "xpu":
        torch.xpu.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def clock(device: torch.device | str | None = None) -> float:
    """Seconds (``perf_counter``) after ``device``'s queued work is done: take two and subtract."""
    synchronize(device)
    return time.perf_counter()


def timed(fn: Callable[[], object], device: torch.device | str | None = None) -> float:
    """Seconds one call of ``fn()`` takes on ``device``, its queued kernels included."""
    start = clock(device)
    fn()
    return clock(device) - start


@dataclass(frozen=True)
class Timing:
    """Repeated timings of one call, in seconds."""

    samples: tuple[float, ...]

    @property
    def best(self) -> float:
        """The fastest call: on a shared machine the least disturbed one (noise only ever adds time)."""
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(median - best) / best: how far a typical call sits above the least disturbed one. 0 for one sample; a
        wide spread says the host was busy while this was measured, and the best is then less certain too."""
        return self.median / self.best - 1.0 if self.best > 0 else 0.0


def best_of(
    fn: Callable[[], object],
    reps: int,
    device: torch.device | str | None = None,
    warmup: int = 1,
    slow_s: float | None = None,
) -> Timing:
    """``reps`` timed calls of ``fn()`` after ``warmup`` untimed ones (the first call selects kernels and allocates).
    ``slow_s``: a warm-up slower than this is followed by one timed call only (an emulated dtype takes seconds a call,
    and one call already says it is out of the race)."""
    start = clock(device)
    for _ in range(warmup):
        fn()
    if slow_s is not None and warmup and clock(device) - start > slow_s:
        reps = 1
    return Timing(tuple(timed(fn, device) for _ in range(reps)))


MAX_SPREAD = 0.10
"""A timing whose median sits more than 10 % above its best was taken while the host was busy: `steady` and
`interleaved` measure it again, at most ``RETRIES`` more times, pooling the calls of every attempt."""
RETRIES = 2


def steady(measure: Callable[[], Timing], max_spread: float = MAX_SPREAD, retries: int = RETRIES) -> Timing:
    """``measure()`` again while its spread exceeds ``max_spread``, at most ``retries`` more times, the attempts' calls
    pooled: the best can only fall (keeping the tightest attempt instead could keep one the host slowed throughout),
    and the spread is that of all calls (bounded: a host busy throughout still gets an answer, its spread says how
    good)."""
    kept = measure()
    for _ in range(retries):
        if kept.spread <= max_spread:
            break
        kept = Timing(kept.samples + measure().samples)
    return kept


def interleaved(
    calls: dict,
    reps: int,
    device: torch.device | str | None = None,
    warmup: int = 1,
    max_spread: float = MAX_SPREAD,
    retries: int = 0,
) -> dict[object, Timing]:
    """``reps`` timings of each of ``calls`` (key → callable), taken in turn within every repetition so that machine
    noise hits every call alike, after ``warmup`` untimed rounds. ``retries``: the calls whose spread exceeds
    ``max_spread`` are timed again (in turn among themselves) up to that many times, their calls pooled (`steady`)."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    out = _in_turn(calls, reps, device)
    for _ in range(retries):
        wide = {key: fn for key, fn in calls.items() if out[key].spread > max_spread}
        if not wide:
            break
        for key, again in _in_turn(wide, reps, device).items():
            out[key] = Timing(out[key].samples + again.samples)
    return out


def _in_turn(calls: dict, reps: int, device: torch.device | str | None) -> dict[object, Timing]:
    times: dict[object, list[float]] = {key: [] for key in calls}
    for _ in range(reps):
        for key, fn in calls.items():
            times[key].append(timed(fn, device))
    return {key: Timing(tuple(t)) for key, t in times.items()}


def gemm_seconds(dtype: torch.dtype, n: int = 512, reps: int = 5, shape: tuple[int, int, int] | None = None) -> Timing:
    """Timings of one n × n GEMM in ``dtype`` (CPU), or of an (m, k, n) = ``shape`` one (m × k by k × n), after one
    warm-up. The operands come from the probe's own random generator: a probe must not move the caller's random
    stream (a model built after it would get other weights)."""
    m, k, cols = shape or (n, n, n)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(k, cols, generator=g).to(dtype)
    return best_of(lambda: a @ b, reps)


def gemm_gflops(seconds: float, n: int) -> float:
    """The rate of an n × n GEMM that took ``seconds``: 2n³ floating-point operations."""
    return 2 * n**3 / seconds / 1e9


def best_gemm_rate(dtype: torch.dtype, shapes: tuple[tuple[int, int, int], ...], reps: int = 3) -> tuple[float, tuple]:
    """(FLOP/s, shape) of the fastest of ``shapes`` (each (m, k, n), its median of ``reps``): a machine's GEMM rate
    for a kind of work. One shape is not enough: oneDNN picks its kernel by shape, and on a CPU with AMX a 1024²
    bf16 GEMM ran at half the rate of a 2048² one or of a model's own 512-row projection (docs/decisions.md)."""
    rates = {s: 2 * s[0] * s[1] * s[2] / gemm_seconds(dtype, reps=reps, shape=s).median for s in shapes}
    shape = max(rates, key=rates.get)
    return rates[shape], shape


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """The highest non-decreasing curve (in the key, e.g. rows per forward) at or below ``curve``: each value becomes
    the least of itself and every larger key's. A forward over more rows does the same work and more, and best-of
    timings err only upwards (a disturbed call is slower, never faster), so a larger size timed below a smaller one
    says the smaller one was disturbed: its true cost is at most the larger's. A running maximum would instead carry
    one disturbed size (a spike) to every size above it."""
    out, low = {}, float("inf")
    for key in sorted(curve, reverse=True):
        low = min(low, curve[key])
        out[key] = low
    return {key: out[key] for key in sorted(curve)}
