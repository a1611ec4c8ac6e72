"""Batch-aware sizing: the chain length for each batch size, chosen from costs measured at that batch size.

As the batch grows the target forward turns compute-bound (B·(k + 1) tokens cost about (k + 1) times B), so the best
chain length shrinks and then reaches 0. `size_batch_policy` times, at every batch size, the verify curve, vanilla's
own loop on the batch's rows and a short pilot of the longest chain, and switches a length on only where it promises
`AUTO_MARGIN` over vanilla. `infer.batch_policy.BatchAwareProposer` serves the policy it returns; the timings are
the cost curve's (`eval.cost_curve.step_costs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from eval.cost_curve import SIZING_REPS, best_chain_length, step_costs
from infer.batch_policy import BatchPolicy
from infer.generate import generate_speculative, generate_vanilla
from infer.proposer import Proposer, TargetSignal
from infer.sampling import SamplingParams
from models.target import TargetModel
from models.timing import monotone

AUTO_MARGIN = 0.10
"""The predicted gain a batch's chain must promise over vanilla to be switched on: the report's sizing check found
the chosen settings' predictions within about this of the measured speedups, so a smaller promise may be a loss."""
BATCH_PILOT_TOKENS = 16
"""Tokens of the short pilot that times the draft step and bookkeeping at each batch size."""


@dataclass
class BatchSizing:
    """How the batch-aware policy was chosen: per batch size, the costs measured there and the predicted speedup of
    every chain length (acceptance per position is a row's, the same at every batch size)."""

    policy: BatchPolicy
    alpha: list[float]
    by_batch: dict[int, dict]
    """batch size → verify_ms (by tokens per row), vanilla_ms and vanilla_dtype (the faster vanilla there),
    draft_step_ms, overhead_ms, predicted_speedup (by chain length) and the chosen length k."""
    baseline_faster: dict[int, bool]
    """Whether the baseline dtype's vanilla was the faster at that batch size: a batch the policy leaves off is then
    decoded there (`infer.batch_policy.BatchAwareProposer`'s ``vanilla_targets``)."""

    def account(self) -> str:
        parts = []
        for b, m in sorted(self.by_batch.items()):
            pred = " ".join(f"{k}:{x:.2f}" for k, x in m["predicted_speedup"].items())
            parts.append(
                f"bs {b}: vanilla {m['vanilla_ms']:.0f} ms ({m['vanilla_dtype']}), verify {m['verify_ms'][2]:.0f}..{max(m['verify_ms'].values()):.0f}"
                f" ms, draft step {m['draft_step_ms']:.1f} ms, predicted {pred} → "
                + ("off" if m["k"] == 0 else f"chain {m['k']}")
            )
        return (
            f"batch policy {self.policy.words()} (α {' '.join(f'{a:.2f}' for a in self.alpha)}; on only where the "
            f"predicted speedup is >= {1 + AUTO_MARGIN:.2f}x): " + "; ".join(parts)
        )


def batch_length(
    alpha: list[float],
    draft_step_s: float,
    verify_s: dict[int, float],
    overhead_s: float,
    vanilla_step_s: float,
    longest: int | None = None,
) -> tuple[int, dict[int, float]]:
    """(chain length, predicted speedup by length) at one batch size: the best of `best_chain_length`'s rates over
    vanilla's among lengths up to ``longest`` (a smaller batch's length: lengths never grow with the batch), or 0
    (off) where even that best promises less than ``1 + AUTO_MARGIN``."""
    _, rates = best_chain_length(alpha, draft_step_s, verify_s, overhead_s)
    predicted = {k: r * vanilla_step_s for k, r in rates.items()}
    allowed = [k for k in predicted if longest is None or k <= longest]
    if not allowed:
        return 0, predicted
    best = max(allowed, key=predicted.get)
    return (best if predicted[best] >= 1 + AUTO_MARGIN else 0), predicted


def vanilla_loop_step(target: TargetModel, rows: list[list[int]], eos_ids: tuple[int, ...]) -> float:
    """Seconds per step (forward, sampling, bookkeeping; prefill excluded) of the vanilla loop decoding ``rows``
    together for `BATCH_PILOT_TOKENS` tokens (the rows that stop early leave the batch, as in the measurement)."""
    stats = generate_vanilla(target, rows, SamplingParams(max_new_tokens=BATCH_PILOT_TOKENS), eos_ids).stats
    return (stats.verify_s + stats.bookkeeping_s) / max(1, stats.rounds)


def size_batch_policy(
    target: TargetModel,
    make: Callable[[int], Proposer],
    prompts: list[list[int]],
    alpha: list[float],
    max_k: int,
    batch_sizes: tuple[int, ...],
    eos_ids: tuple[int, ...],
    log: Callable[[str], None] = print,
    baseline: TargetModel | None = None,
) -> BatchSizing:
    """The chain length for each batch size (0: off), from measurements at that batch size B: the draft step and
    bookkeeping of a short pilot (`BATCH_PILOT_TOKENS`) of the longest chain over the prompts cycled to fill B rows;
    the verify-cost curve over B rows that each hold the first prompt (`step_costs`, made non-decreasing); and
    vanilla's own loop on the B rows (`vanilla_loop_step`). They are rated with the per-position acceptance ``alpha``
    (a chain sizing's, pilot shrunk toward the checkpoint's held-out acceptance) by `batch_length`: a length is
    switched on only where its predicted speedup is at least ``1 + AUTO_MARGIN``, and `BatchPolicy` keeps a length
    from growing with the batch. ``baseline``: vanilla's target in another dtype (`infer.serving.serving_targets`),
    whose loop is timed at every batch size too: the prediction is over the faster of the two vanilla steps there, as
    the measured speedup is."""
    aux = make(1).signal is TargetSignal.AUX
    by_batch, lengths, baseline_faster = {}, {}, {}
    longest = None  # the previous batch size's length: the margin is judged on the length the policy will serve
    for b in sorted(set(batch_sizes)):
        rows = [prompts[i % len(prompts)] for i in range(b)]
        pilot = SamplingParams(max_new_tokens=BATCH_PILOT_TOKENS)
        stats = generate_speculative(target, make(max_k), rows, pilot, eos_ids).stats
        rounds = max(1, stats.rounds)
        draft_step, overhead = stats.draft_s / rounds / max_k, stats.bookkeeping_s / rounds
        reps = SIZING_REPS if b <= 4 else 3  # a batch-64 forward is ~10x a batch-1 one here
        curve, _ = step_costs(target, prompts[0], tuple(range(1, max_k + 2)), reps, aux, vanilla=False, rows=b)
        curve = monotone(curve)  # vanilla here is its whole loop step (sampling included): the curve alone is fitted
        # vanilla's own loop on the same rows, in each dtype: what a call left off costs there. One forward timed on
        # one replicated prompt picked bf16 at batch 4 here where the loop on the real rows ran faster in fp32
        vanilla = vanilla_loop_step(target, rows, eos_ids)
        other = vanilla_loop_step(baseline, rows, eos_ids) if baseline is not None else None
        baseline_faster[b] = other is not None and other < vanilla
        vanilla = min(vanilla, other) if other is not None else vanilla
        lengths[b], predicted = batch_length(alpha, draft_step, curve, overhead, vanilla, longest)
        longest = lengths[b]
        by_batch[b] = {
            "verify_ms": {n: 1e3 * t for n, t in curve.items()},
            "vanilla_ms": 1e3 * vanilla,
            "vanilla_dtype": str((baseline if baseline_faster[b] else target).dtype).removeprefix("torch."),
            "draft_step_ms": 1e3 * draft_step,
            "overhead_ms": 1e3 * overhead,
            "predicted_speedup": predicted,
            "k": lengths[b],
        }
    sizing = BatchSizing(BatchPolicy(lengths), list(alpha), by_batch, baseline_faster)
    for b, m in by_batch.items():
        m["k"] = sizing.policy.lengths[b]  # after the policy's monotone cap
    log(f"cost curve: {sizing.account()}")
    return sizing
