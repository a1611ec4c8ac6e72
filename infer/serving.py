"""How the verify runtime serves a target on this machine: its kernel routing, its dtype, its batch-1 vanilla loop.

`prepare_target` installs the CPU small-row matmul routing (infer/kernels/cpu_linear.py) on a target before anything
times or decodes with it; `choose_vanilla_loop` times our two batch-1 vanilla loops and keeps the faster;
`ready_targets` does both, the one place a measurement makes its targets ready; `serving_targets` applies the
precision policy's serving choice (the served dtype, and vanilla in its own fastest dtype). These sit here rather than
beside `models.target.TargetModel` because models/ imports nothing of ours (DESIGN.md §2) and the routing and the
loops are infer/'s; the target's stop ids need neither and live in models/ (`models.tokenizer.stop_ids`).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable

import torch

from infer.forward_cost import quiet_routing
from infer.generate import VANILLA_LOOPS, vanilla_steps
from infer.kernels.cpu_decode_attention import serve_shared_heads
from infer.kernels.cpu_linear import install as install_cpu_linear
from infer.kernels.cpu_linear import uninstall as uninstall_cpu_linear
from models.precision import choose, redecide
from models.target import TargetModel
from models.timing import interleaved


def prepare_target(target: TargetModel, log: Callable[[str], None] = print) -> None:
    """On the CPU, route the target's small-row matmuls to the layout measured faster here (infer/kernels/
    cpu_linear.py) and let its draft verification read grouped key / value heads in place (`serve_shared_heads`;
    one-token forwards unchanged); vanilla, HF generate and every proposer then run the same target."""
    if target.device.type == "cpu":
        install_cpu_linear(target.model, log)
        serve_shared_heads(target.hf_model)


def loop_context(contexts: list[list[int]], answer_tokens: float) -> list[int]:
    """A context as long as a vanilla loop's mean one over ``contexts`` (its prompts) with answers of
    ``answer_tokens`` on average: the mean prompt plus half the mean answer, cut from the prompts' own tokens (the cost
    of a forward depends on the length, not the tokens)."""
    mean = statistics.mean(map(len, contexts)) + answer_tokens / 2
    pool = [t for c in contexts for t in c]
    return (pool * (1 + int(mean) // len(pool)))[: max(2, round(mean))]


LOOP_REPS = 9
"""Interleaved timings per batch-1 vanilla loop (`choose_vanilla_loop`); the fastest of each is compared."""


def choose_vanilla_loop(
    target: TargetModel, contexts: list[list[int]], answer_tokens: float, log: Callable[[str], None] = print
) -> dict[str, float]:
    """Time both batch-1 vanilla loops' one-token forward (`infer.generate.vanilla_steps`) in turn after the loops'
    mean context (`loop_context`), and set ``target.vanilla_loop`` to the faster: DESIGN.md §4's strongest vanilla
    at batch 1. Returns (and keeps as ``target.vanilla_loop_ms``) ms by loop. On the AVX-512-BF16 EPYC in bf16 the
    masked loop's forward took 36 against 41 ms for the plain one; on the AVX2 EPYC in fp32 plain was faster."""
    context = loop_context(contexts, answer_tokens)
    steps = vanilla_steps(target, context)
    times = interleaved({name: steps[name] for name in VANILLA_LOOPS}, LOOP_REPS, target.device)
    ms = {name: 1e3 * t.best for name, t in times.items()}
    target.vanilla_loop, target.vanilla_loop_ms = min(ms, key=ms.get), ms
    dtype = str(target.dtype).removeprefix("torch.")
    log(
        f"vanilla at batch 1 ({dtype}): the {target.vanilla_loop} loop, one-token forward "
        + " against ".join(f"{name} {t:.1f} ms" for name, t in sorted(ms.items(), key=lambda kv: kv[1]))
        + f" after {len(context)} tokens"
    )
    return ms


def dtype_copy(target: TargetModel, dtype: torch.dtype, log: Callable[[str], None] = print) -> TargetModel:
    """The same target in ``dtype`` (the fp32 certificate pass, vanilla in its fastest dtype), with its own kernel
    routing (`prepare_target`)."""
    replica = copy.deepcopy(target)
    uninstall_cpu_linear(replica.model)  # routes were chosen (or skipped) for the served dtype
    replica = replica.to(dtype)
    replica.vanilla_loop, replica.vanilla_loop_ms = "plain", {}  # a choice made in another dtype does not carry
    prepare_target(replica, log)
    return replica


def fp32_copy(target: TargetModel, log: Callable[[str], None] = print) -> TargetModel:
    """The same target in fp32, for the certificate pass."""
    return dtype_copy(target, torch.float32, log)


def serving_targets(
    target: TargetModel, acceptance: list[float] | None = None, log: Callable[[str], None] = print
) -> tuple[TargetModel, TargetModel | None]:
    """(the target to speculate with, vanilla's target in its fastest dtype or None when that is the same dtype).

    The serving choice of the precision policy (`models.precision.choose`, cached per machine) says which dtype
    speculation pays most in and which dtype vanilla is fastest in. A target loaded with a serving choice keeps its
    curves and is decided again from them for the drafter's ``acceptance`` (`models.precision.redecide`): timing
    twice in one process could state two serving dtypes that differ by noise. A target whose dtype the policy chose
    for another workload (a training run's target) is converted to the serving dtype; one the user chose keeps it.
    Either way the baseline is vanilla in its own fastest dtype (DESIGN.md §4: the strongest vanilla). One line
    states the served dtype and why."""
    loaded = target.precision
    if loaded.workload == "serve" and loaded.curves:
        serve = redecide(loaded, acceptance) if acceptance else loaded
    else:
        serve = choose("serve", target.config, target.device.type, acceptance=acceptance, prepare=quiet_routing)
    converted, dtype = "", str(target.dtype).removeprefix("torch.")
    if loaded.source != "user" and dtype != serve.dtype:
        converted = f" (the target, loaded in {dtype} for {loaded.workload}, runs converted)"
        target = dtype_copy(target, getattr(torch, serve.dtype), log)
    if loaded.source != "user":
        target.precision = serve
    log(target.precision.line() + converted)
    served = str(target.dtype).removeprefix("torch.")
    if serve.vanilla_dtype is None or serve.vanilla_dtype == served:
        return target, None
    log(f"vanilla is fastest in {serve.vanilla_dtype} here: the baseline runs there")
    return target, dtype_copy(target, getattr(torch, serve.vanilla_dtype), log)


def ready_targets(
    target: TargetModel,
    vanilla_target: TargetModel | None,
    contexts: list[list[int]],
    batch_sizes: tuple[int, ...] | list[int],
    max_new_tokens: int,
    log: Callable[[str], None] = print,
    keep_chosen: bool = False,
) -> None:
    """Make the targets ready to be timed, the one place that does: the routed CPU kernels (`prepare_target`) and,
    where batch 1 is measured, the batch-1 vanilla loop timed faster here (`choose_vanilla_loop`, after
    ``contexts`` with answers of half ``max_new_tokens``). A report calls it before its sizing, whose cost curve must
    see what the measurement will run; ``keep_chosen``: a loop chosen earlier stands (a direct `measure` call)."""
    for t in (target, vanilla_target):
        if t is None:
            continue
        prepare_target(t, log)
        if 1 in batch_sizes and not (keep_chosen and t.vanilla_loop_ms):
            choose_vanilla_loop(t, contexts, max_new_tokens / 2, log)
