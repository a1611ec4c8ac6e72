"""The cost curves the precision policy (`models.precision`) decides from: each workload timed on a probe of the
target, dtype by dtype, and the curves cached per machine and target shape.

The probe is the target's architecture built from its HF config at full depth (random weights), in each dtype.
Its decode forwards are timed through the serving path the caller hands in as ``prepare`` (`ServingPath`;
``infer.forward_cost.quiet_routing``): it installs the kernel routing the server uses (``infer.kernels.cpu_linear``)
and times the forward the runtime runs (`infer.forward_cost.forward_timings`: the faster vanilla loop's step at one
row, the verify forward over a chain above it), the function the report's cost curve and vanilla check time with,
so the policy and the report read the same t(n). Without a serving path (a caller below the runtime) the bare HF
forward is timed. Each size is the fastest of 7 calls, the dtypes timed in turn at each size (`race`). A cache file
is written by one process only (ranks of one launch wait for it) and a cached serving curve is re-checked at one size
when it is read (`cached_curves`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from models.logits_to_keep import last_positions
from models.timing import RETRIES, Timing, best_of, gemm_seconds, steady

SERVE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 16)
DISTILL_BATCH = 32
TRAIN_SHAPE = (2, 128)
PREFIX = 128
"""Prompt tokens of the modelled request (and the cache every decode step is timed after)."""
PREFILL_CHUNK = 32
"""Prefill is timed on this many tokens and scaled linearly (it is GEMM-bound): emulated bf16 stays seconds."""
PREFILL = 0
"""Curve key of the prefill of the modelled prompt (serve: PREFIX tokens; distill: a batch of them)."""
EMULATED = 3.0
"""bf16 slower than fp32 by this factor at one size is out of the race: its larger sizes are not timed, and a bf16
512² GEMM that far behind rules out timing a (GEMM-bound) training step in bf16, which would take minutes."""
STALE = 1.25
"""A cached serving curve is re-checked at one size each time it is read (`_stale`): a fresh time this many x off the cached
one, or an order of the dtypes that flipped, means the cache was written on a busy or just-booted host (seen: fp32
t(1) 68.6 ms cached minutes after boot, 30.1 ms on the quiet host), so the curves are measured again."""
LOCK_WAIT_S = 600.0
"""How long a process waits for another one's measurement before taking over (it may have died)."""
GEMM = -512
"""Curve key of a 512² GEMM (ms), timed before a training step: it tells in a second whether bf16 GEMMs are emulated."""

Curves = dict[str, dict[int, float]]
"""dtype → key → a value (ms, or the spread of that timing)."""


class ServingPath(Protocol):
    """How the server runs a target, handed in by a caller that knows the runtime (``models/`` imports nothing above
    it): ``infer.forward_cost.quiet_routing``."""

    def __call__(self, model: nn.Module) -> object:
        """Install on ``model`` the kernel routing the server uses."""

    def forward_ms(self, model: nn.Module, rows: int, prefix: int, batch: int = 1) -> Timing:
        """Milliseconds of the forward the runtime runs for ``rows`` new tokens per sequence after a ``prefix``-token
        cache, on ``batch`` sequences."""


# --------------------------------------------------------------------------------------------------
# The race
# --------------------------------------------------------------------------------------------------


def _keys(workload: str) -> tuple[int, ...]:
    if workload == "serve":
        return (PREFILL, *SERVE_ROWS)
    return (PREFILL, DISTILL_BATCH) if workload == "distill" else (0,)


def _as_timing(value: float | Timing) -> Timing:
    """A timer's answer as a `Timing` (a test's timer may answer a plain number of ms: one sample, no spread)."""
    return value if isinstance(value, Timing) else Timing((float(value),))


def race(
    workload: str, dtypes: Sequence[str], time_one: Callable[[str, int], float | Timing]
) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """(dtype → key → ms, dtype → key → spread), the dtypes timed in turn at each key (`models.timing.steady`:
    measured again while wider than its ``MAX_SPREAD``, at most ``RETRIES`` more times). fp32 is always
    complete; another dtype leaves the race at the first key where it is ``EMULATED`` x behind fp32 (its curve then
    ends there)."""
    # decode sizes first, prefill last and never a reason to leave: it is paid once per request, and a dtype slow at
    # prefill may still win on a long answer (bf16 on this project's AVX2 EPYC)
    keys = (GEMM, 0) if workload == "train" else (*[k for k in _keys(workload) if k != PREFILL], PREFILL)
    out: dict[str, dict[int, float]] = {d: {} for d in dtypes}
    spread: dict[str, dict[int, float]] = {d: {} for d in dtypes}
    racing = list(dtypes)
    for key in keys:
        for d in list(racing):
            timing = steady(lambda d=d, key=key: _as_timing(time_one(d, key)), retries=RETRIES)
            out[d][key], spread[d][key] = timing.best, timing.spread
            if d != "float32" and key != PREFILL and out[d][key] > EMULATED * out["float32"][key]:
                racing.remove(d)
    return out, spread


# --------------------------------------------------------------------------------------------------
# The probe and its timers
# --------------------------------------------------------------------------------------------------


def _probe(config, layers: int, dtype: torch.dtype, prepare: ServingPath | None) -> nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = config.__class__.from_dict(config.to_dict())
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    if prepare is not None:
        prepare(model)
    return model


def _timing_ms(fn: Callable[[], object], reps: int = 7) -> Timing:
    """``reps`` calls after one warm-up, in ms (`models.timing.best_of`; the policy reads the best); a warm-up over
    half a second (an emulated dtype) is followed by one timed call only."""
    return _scaled(best_of(fn, reps, slow_s=0.5), 1e3)


def _scaled(t: Timing, factor: float) -> Timing:
    return Timing(tuple(x * factor for x in t.samples))


@torch.no_grad()
def _decode_ms(model: nn.Module, rows: int, batch: int, vocab: int) -> Timing:
    """One bare HF forward of ``rows`` new tokens per sequence after a ``PREFIX``-token cache (trimmed back after
    each): timed only where no serving path is given (`curve_timer`); the served forward is the runtime's."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(vocab, (batch, PREFIX), generator=g)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=last_positions(1, PREFIX))
    new = torch.randint(vocab, (batch, rows), generator=g)
    positions = torch.arange(PREFIX, PREFIX + rows).expand(batch, rows)

    def step():
        model(input_ids=new, position_ids=positions, cache=cache, use_cache=True)
        cache.crop(-rows)  # transformers 5: a negative count of tokens to drop

    return _timing_ms(step)


def _train_ms(model: nn.Module, dtype: torch.dtype, vocab: int) -> Timing:
    """Forward + backward of ``TRAIN_SHAPE`` tokens, under bf16 autocast when ``dtype`` is bf16 (weights stay fp32)."""
    model.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, TRAIN_SHAPE, generator=g)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    return _timing_ms(step, reps=3)


def measure_curves(
    workload: str, config, dtypes: Sequence[str], prepare: ServingPath | None = None
) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """(dtype → key → ms, dtype → key → spread) of ``workload`` for a full target of ``config`` (`race`)."""
    return race(workload, dtypes, curve_timer(workload, config, prepare))


def curve_timer(workload: str, config, prepare: ServingPath | None = None) -> Callable[[str, int], Timing]:
    """``time_one(dtype, key) -> Timing`` (ms) of ``workload`` for a full target of ``config``, on a probe of the
    target's full depth in that dtype (built once per dtype). Decode forwards go through ``prepare.forward_ms`` (the
    runtime's forward); without a serving path, the bare HF forward (`_decode_ms`). No extrapolation from shallower
    probes: ``t1 + (L - 1)(t8 - t1) / 7`` weighs the 1-layer time by -4.1 on a 30-layer target, so a disturbed call
    of the small probe made a larger forward look cheaper (measured: fp32 t(2) 227 against t(4) 197 ms on SmolLM2,
    each with a 1-4 % spread, where the runtime's forward timed in turn gave 163 and 178)."""
    text = config.get_text_config()
    vocab = text.vocab_size
    probes: dict[str, nn.Module] = {}

    def probe(name: str) -> nn.Module:
        if name not in probes:
            probes[name] = _probe(text, text.num_hidden_layers, getattr(torch, name), prepare)
        return probes[name]

    def time_one(name: str, key: int) -> Timing:
        dtype = getattr(torch, name)
        if key == GEMM:
            return _scaled(gemm_seconds(dtype), 1e3)
        if workload == "train":  # one drafter-sized layer and the head, as trained; autocast over fp32 weights
            return _train_ms(_probe(text, 1, torch.float32, None), dtype, vocab)
        if key == PREFILL:
            tokens = PREFIX * (DISTILL_BATCH if workload == "distill" else 1)
            return _scaled(_prefill_ms(probe(name), vocab), tokens / PREFILL_CHUNK)
        batch, rows = (DISTILL_BATCH, 1) if workload == "distill" else (1, key)
        if prepare is None:
            return _decode_ms(probe(name), rows, batch, vocab)
        return prepare.forward_ms(probe(name), rows, PREFIX, batch)

    return time_one


@torch.no_grad()
def _prefill_ms(model: nn.Module, vocab: int) -> Timing:
    """One uncached forward of ``PREFILL_CHUNK`` tokens (only the last position's logits, as a prefill keeps)."""
    ids = torch.randint(vocab, (1, PREFILL_CHUNK), generator=torch.Generator().manual_seed(0))
    return _timing_ms(lambda: model(input_ids=ids, logits_to_keep=last_positions(1, PREFILL_CHUNK)), reps=3)


# --------------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------------


def cached_curves(
    workload: str, config, dtypes: Sequence[str], prepare: ServingPath | None, path: Path, refresh: bool = False
) -> tuple[Curves, Curves, str]:
    """(curves, spreads, source) of ``workload`` for a full target of ``config``: read from the cache file ``path``, or
    measured (`measure_curves`) where there is none, ``refresh`` asks, or a cached serving curve no longer describes
    this host at ``CHECK_ROWS`` (`_stale`; source "measured again (the cache was stale: …)")."""
    if refresh:
        path.unlink(missing_ok=True)
    found, spread, source = _measure_once(path, lambda: measure_curves(workload, config, dtypes, prepare))
    # ranks of one launch must make one choice: each re-timing on its own could disagree, so only one process
    # (no WORLD_SIZE above 1) re-checks
    # serving only: a training run's autocast choice must stay the one its other runs (and resumes) made
    if source == "cached" and workload == "serve" and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        key = CHECK_ROWS
        time_one = curve_timer(workload, config, prepare)
        fresh = {d: _as_timing(time_one(d, key)).best for d in dtypes if key in found.get(d, {})}
        stale = _stale(found, fresh, key)
        if stale:
            path.unlink(missing_ok=True)
            found, spread, _ = _measure_once(path, lambda: measure_curves(workload, config, dtypes, prepare))
            source = f"measured again (the cache was stale: {stale})"
    return found, spread, source


CHECK_ROWS = 1
"""The size a cached serving curve is re-timed at when it is read: the one-token step vanilla decoding runs."""


def _stale(cached: dict[str, dict[int, float]], fresh: dict[str, float], key: int) -> str:
    """Why ``cached`` no longer describes this host at ``key`` ("" while it does): a dtype's fresh time is ``STALE``
    x off the cached one, or the fastest dtype there changed."""
    for d, ms in fresh.items():
        old = cached[d][key]
        if not 1 / STALE <= ms / old <= STALE:
            return f"{d} t({key}) {old:.1f} ms cached, {ms:.1f} ms now"
    if len(fresh) > 1 and min(fresh, key=fresh.get) != min(fresh, key=lambda d: cached[d][key]):
        return f"the fastest dtype at t({key}) is now {min(fresh, key=fresh.get)}"
    return ""


def _read_cache(path: Path) -> tuple[Curves, Curves] | None:
    """(curves, spreads) of a cache file, or None where there is none to read."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent or half-written by a crash: measure again

    def keyed(by_dtype: dict) -> Curves:
        return {d: {int(m): float(v) for m, v in c.items()} for d, c in by_dtype.items()}

    return keyed(raw["curves"]), keyed(raw.get("spread", {}))


def _measure_once(path: Path, measure: Callable[[], tuple[Curves, Curves]]) -> tuple[Curves, Curves, str]:
    """(curves, spreads, source): the cached ones, or measured now by one process only: ranks of one
    ``accelerate launch`` on this machine must make the same choice, so whoever takes the lock measures and the others
    wait for its file."""
    cached = _read_cache(path)
    if cached is not None:
        return *cached, "cached"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_suffix(".lock")
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        deadline = time.time() + LOCK_WAIT_S
        while time.time() < deadline and lock.exists():
            time.sleep(0.2)
        cached = _read_cache(path)
        if cached is not None:
            return *cached, "cached"
        lock.unlink(missing_ok=True)  # the measuring process died: measure here
        return _measure_once(path, measure)
    try:
        curves, spread = measure()
        _write_cache(path, curves, spread)
    finally:
        lock.unlink(missing_ok=True)
    return curves, spread, "measured"


def _write_cache(path: Path, curves: Curves, spread: Curves | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")

    def keyed(by_dtype: Curves) -> dict:
        return {d: {str(m): v for m, v in c.items()} for d, c in by_dtype.items()}

    tmp.write_text(json.dumps({"curves": keyed(curves), "spread": keyed(spread or {})}))
    os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
