"""Verify-cost curve: what one target forward over n draft tokens costs, next to what a draft step costs.

Sizing a tree needs these numbers, not FLOPs: at batch 1 on a CPU a forward is dominated by per-op dispatch and
weight reads, and the marginal cost of one more verified token decides whether a deeper tree pays. Speculative
decoding wins ``τ · t(1) / (t_draft + t(n) + bookkeeping)`` per round, so the curve ``t(n) / t(1)`` and the draft
step cost bound what any drafter can reach.

The report sizes its settings on the machine it runs on from these timings: a chain's length (`size_chain`, a
pilot's acceptance shrunk toward the checkpoint's held-out one), the EAGLE-2 tree among `TREE_GRID` (`size_tree`),
and the chain length per batch size (`eval.batch_sizing`); `vanilla_check` asks whether the baseline is at its best.
The curve on its own, with a drafter's draft step beside it, is the command line `python -m eval.cost_curve_cli`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from infer import forward_cost
from infer.generate import VANILLA_LOOPS, generate_speculative, generate_vanilla, vanilla_steps
from infer.pricing import VerifyPrice
from infer.proposer import Proposer, TargetSignal
from infer.sampling import SamplingParams
from infer.serving import loop_context
from infer.stats import GenerationStats, depth_tallies
from infer.tree_search import DynamicTreeConfig
from models.acceptance import expected_tokens
from models.target import TargetModel
from models.timing import monotone, timed


def best_chain_length(
    alpha: list[float], draft_step_s: float, verify_s: dict[int, float], overhead_s: float = 0.0
) -> tuple[int, dict[int, float]]:
    """The chain length k maximising tokens per second, E(k) / (k·t_draft + t_verify(k + 1) + overhead), over the k
    for which α and the verify cost of k + 1 tokens are known (Sequoia's rule for chains). Returns (k, rate by k)."""
    rates = {
        k: expected_tokens(alpha, k) / (k * draft_step_s + verify_s[k + 1] + overhead_s)
        for k in range(1, len(alpha) + 1)
        if k + 1 in verify_s
    }
    if not rates:
        raise ValueError("need acceptance for depth 1 and the verify cost of 2 tokens at least")
    return max(rates, key=rates.get), rates


PRIOR_WEIGHT = 100
"""Pseudo-attempts the checkpoint's held-out acceptance is worth at each depth, at most. It is measured on more
positions than any pilot (64 held-out samples of a few hundred tokens), but under teacher forcing on training-like
data, not in served decoding on the report's prompts; so it anchors a small pilot and a pilot of a few hundred
attempts per depth overrides it."""

PILOT_PROMPTS, PILOT_TOKENS = 6, 96
"""The pilot run that sizes a chain or a tree: 6 prompts (`pilot_prompts`: spread over the file, one per Spec-Bench
family where the file lists its families in blocks) x up to 96 tokens. A 2 x 64 pilot gave α 0.26 0.42 0.10 1.00
0.00 on the shipped EAGLE-3, i.e. noise, and picked chain 1 on a flat verify curve; a pilot of a file's first 4
prompts read four MT-Bench questions only and overshot the measured τ of the tree it chose (2.58 against 2.23)."""


def pilot_params(temperature: float, index: int) -> SamplingParams:
    """A pilot call's sampling: `PILOT_TOKENS` at ``temperature``, its draws seeded by the prompt's ``index`` (every
    setting of a sizing decodes each pilot prompt from the same seed)."""
    return SamplingParams(temperature=temperature, max_new_tokens=PILOT_TOKENS, seed=index)


def _at(temperature: float) -> str:
    return "" if temperature == 0.0 else f" at T = {temperature:g}"


def pilot_prompts(prompts: list[list[int]], n: int = PILOT_PROMPTS) -> list[list[int]]:
    """``n`` prompts spread evenly over ``prompts`` (every one where there are no more than ``n``). Spec-Bench files
    list their families in blocks of equal size, so the file's first prompts are one family's and the spread takes
    one of each; a shuffled file gives a spread as good as any other."""
    if len(prompts) <= n:
        return list(prompts)
    return [prompts[i * len(prompts) // n] for i in range(n)]


def pilot_context(prompts: list[list[int]]) -> list[int]:
    """The context a sizing times its verify curve after: the pilot prompt of median length. Attention's share of a
    forward grows with the context, so a file's first prompt (a one-line question where the file opens with chat,
    a document where it opens with summaries) would time a step the run rarely takes."""
    pilot = sorted(pilot_prompts(prompts), key=len)
    return pilot[(len(pilot) - 1) // 2]


def paired_choice(per_prompt: dict[str, list[float]]) -> str:
    """The setting a sizing keeps, from each setting's predicted rate on each pilot prompt (settings in order of
    cost, smallest first; every list over the same prompts). The smallest setting is kept unless a larger one's
    paired gain over it, ``rate_larger / rate_kept - 1`` per prompt, has a mean above one standard error of that
    mean; a setting that clears the bar becomes the one kept, and the next larger is judged against it. A pilot of a
    few prompts cannot separate settings whose rates differ by a few per cent (a pooled 1.59x against 1.55x was
    measured 1.12x against a better smaller tree), and a larger tree costs more where the pilot erred."""
    names = list(per_prompt)
    kept = names[0]
    for name in names[1:]:
        gains = [b / a - 1.0 for a, b in zip(per_prompt[kept], per_prompt[name])]
        if len(gains) < 2:
            if gains and gains[0] > 0:
                kept = name
            continue
        mean = statistics.fmean(gains)
        if mean > statistics.stdev(gains) / len(gains) ** 0.5:
            kept = name
    return kept


def shrunk_alpha(
    accepted: list[int], attempted: list[int], prior: list[float] | None, prior_samples: int
) -> list[float]:
    """Per-depth acceptance α_k from a pilot's counts, shrunk toward a prior (beta-binomial posterior mean):
    ``(accepted_k + w · prior_k) / (attempted_k + w)`` with ``w = min(prior_samples, PRIOR_WEIGHT)``. Depths past the
    prior take its last value; without a prior (or ``prior_samples`` 0) it is the pilot's own rate."""
    w = min(prior_samples, PRIOR_WEIGHT) if prior else 0
    out = []
    for k, (acc, att) in enumerate(zip(accepted, attempted)):
        p = prior[min(k, len(prior) - 1)] if prior else 0.0
        out.append((acc + w * p) / (att + w) if att + w else 0.0)
    return out


def heldout_acceptance(drafter_dir: str | Path) -> tuple[list[float] | None, int]:
    """(per-depth held-out acceptance, samples it was measured on) recorded with a checkpoint: the ``drafters``
    block's ``heldout_acceptance`` / ``heldout_samples`` where the training run wrote them at save, else the last
    ``eval/acc`` of the folder's train_log.jsonl with ``train.eval_samples`` of its recipe.yaml. (None, 0) when the
    folder has neither (a drafter trained elsewhere): the pilot then sizes alone."""
    folder = Path(drafter_dir)
    config = folder / "config.json"
    block = json.loads(config.read_text()).get("drafters", {}) if config.exists() else {}
    if block.get("heldout_acceptance"):
        return [float(a) for a in block["heldout_acceptance"]], int(block.get("heldout_samples", 0))
    log = folder / "train_log.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    last = next((r["eval/acc"] for r in reversed(rows) if r.get("eval/acc")), None)
    if last is None:
        return None, 0
    recipe = folder / "recipe.yaml"
    samples = 64  # TrainConfig.eval_samples' default
    if recipe.exists():
        samples = int((yaml.safe_load(recipe.read_text()) or {}).get("train", {}).get("eval_samples", samples))
    return [float(a) for a in last], samples


@dataclass
class ChainSizing:
    """How a chain length was chosen on this machine (printed in the report beside the measured rows)."""

    k: int
    alpha: list[float]
    """Per-depth acceptance used (pilot shrunk toward the checkpoint's held-out acceptance)."""
    pilot_attempts: list[int]
    prior: list[float] | None
    prior_samples: int
    draft_step_s: float
    overhead_s: float
    verify_s: dict[int, float]
    rates: dict[int, float]
    """Predicted tokens/s by chain length."""
    vanilla_step_s: float
    """The vanilla loop's step (a plain cached one-token forward), timed beside the verify curve: the denominator
    of the predicted speedup. Both are read through `fitted_costs`: no verify below vanilla's step, none below a
    smaller one."""

    def predicted_speedup(self, k: int) -> float | None:
        return self.rates[k] * self.vanilla_step_s if k in self.rates else None

    def account(self) -> str:
        prior = (
            f"held-out α {' '.join(f'{a:.2f}' for a in self.prior)} over {self.prior_samples} samples, weight "
            f"{min(self.prior_samples, PRIOR_WEIGHT)}; "
            if self.prior
            else "no held-out prior (none in the checkpoint, or a pilot above T = 0); "
        )
        return (
            f"chain length {self.k} of 1..{max(self.rates)} ({prior}pilot attempts by depth "
            f"{' '.join(map(str, self.pilot_attempts))}; α used {' '.join(f'{a:.2f}' for a in self.alpha)}; draft "
            f"step {1e3 * self.draft_step_s:.1f} ms; vanilla step {1e3 * self.vanilla_step_s:.0f} ms; verify ms "
            f"{' '.join(f'{n}:{1e3 * t:.0f}' for n, t in self.verify_s.items())}; predicted speedup by k "
            f"{' '.join(f'{i}:{self.predicted_speedup(i):.2f}' for i in self.rates)})"
        )


def size_chain(
    target: TargetModel,
    make: Callable[[int], Proposer],
    prompts: list[list[int]],
    max_k: int,
    eos_ids: tuple[int, ...],
    log: Callable[[str], None] = print,
    prior: list[float] | None = None,
    prior_samples: int = 0,
    baseline: TargetModel | None = None,
    temperature: float = 0.0,
) -> ChainSizing:
    """Pick a proposer's chain length on this machine: a pilot run at ``max_k`` (`PILOT_PROMPTS` prompts,
    `PILOT_TOKENS` tokens) gives per-depth acceptance counts, draft-step and bookkeeping costs; the counts are shrunk
    toward the checkpoint's held-out acceptance ``prior`` (`shrunk_alpha`); `step_costs` times t_verify(n) for
    n = 1..max_k + 1 and vanilla's step here and now, read through `fitted_costs`; the length with the best predicted
    rate wins (`best_chain_length`). ``baseline``: vanilla's target in another dtype (`infer.serving.serving_targets`);
    the predicted speedup is then over the faster vanilla step of the two, as the measurement's is. ``temperature``:
    the pilot's (`pilot_params`), so that a chain is sized for the temperature it will serve."""
    stats = [
        generate_speculative(target, make(max_k), [p], pilot_params(temperature, i), eos_ids).stats
        for i, p in enumerate(pilot_prompts(prompts))
    ]
    rounds = max(1, sum(s.rounds for s in stats))
    acc, att = depth_tallies(stats, max_k)
    alpha = shrunk_alpha(acc, att, prior, prior_samples)
    draft_step = sum(s.draft_s for s in stats) / rounds / max_k
    overhead = sum(s.bookkeeping_s for s in stats) / rounds
    aux = make(1).signal is TargetSignal.AUX
    context = pilot_context(prompts)
    curve, vanilla_step = step_costs(target, context, tuple(range(1, max_k + 2)), SIZING_REPS, aux)
    curve, vanilla_step = fitted_costs(curve, _fastest_vanilla(vanilla_step, baseline, context))
    k, rates = best_chain_length(alpha, draft_step, curve, overhead)
    sizing = ChainSizing(k, alpha, att, prior, prior_samples, draft_step, overhead, curve, rates, vanilla_step)
    log(f"cost curve{_at(temperature)}: {sizing.account()}")
    return sizing


TREE_GRID = (
    DynamicTreeConfig(top_k=2, depth=3, total_tokens=4),
    DynamicTreeConfig(top_k=3, depth=4, total_tokens=8),
    DynamicTreeConfig(top_k=4, depth=5, total_tokens=12),
    DynamicTreeConfig(top_k=4, depth=5, total_tokens=16),
    DynamicTreeConfig(top_k=6, depth=6, total_tokens=24),
)
"""EAGLE-2 settings a report chooses among: 4 to 24 nodes, the range where this project's CPUs verify for < 2 plain
steps (DESIGN.md §5); larger trees only pay where the verify curve stays flat further (a GPU: 60 nodes)."""


def tree_name(tree: DynamicTreeConfig) -> str:
    return f"EAGLE-2 k{tree.top_k} d{tree.depth} n{tree.total_tokens}"


@dataclass
class TreeSizing:
    """How a dynamic tree was chosen on this machine: a pilot per setting, rated on the verify curve."""

    tree: DynamicTreeConfig
    tau: dict[str, float]
    """Pilot τ by setting name."""
    rates: dict[str, float]
    """Predicted tokens/s by setting name: τ / (draft + verify(n) + bookkeeping) per round."""
    vanilla_step_s: float
    verify_s: dict[int, float]
    """The verify-cost curve the settings were rated on (seconds by node count)."""
    per_prompt: dict[str, list[float]]
    """Predicted tokens/s by setting name on each pilot prompt: what `paired_choice` judged."""
    grid: tuple[DynamicTreeConfig, ...]
    """The settings judged, smallest first."""
    round_s: dict[str, tuple[float, float]] = field(default_factory=dict)
    """(draft, bookkeeping) seconds per pilot round by setting name."""

    def predicted_speedup(self, name: str) -> float | None:
        return self.rates[name] * self.vanilla_step_s if name in self.rates else None

    def price(self) -> VerifyPrice:
        """The chosen tree's costs as `infer.pricing` reads them: the verify curve, its pilot's draft and bookkeeping
        time per round."""
        draft, bookkeeping = self.round_s[tree_name(self.tree)]
        return VerifyPrice({n: 1e3 * s for n, s in self.verify_s.items()}, 1e3 * draft, 1e3 * bookkeeping)

    def account(self) -> str:
        return (
            f"tree {tree_name(self.tree)}, the smallest no larger one beat by more than the pilot's spread (pilot τ / "
            "predicted speedup "
            + ", ".join(f"{n}: {self.tau[n]:.2f} / {self.predicted_speedup(n):.2f}" for n in self.rates)
            + ")"
        )


def size_tree(
    target: TargetModel,
    make: Callable[[DynamicTreeConfig], Proposer],
    prompts: list[list[int]],
    eos_ids: tuple[int, ...],
    grid: tuple[DynamicTreeConfig, ...] = TREE_GRID,
    log: Callable[[str], None] = print,
    baseline: TargetModel | None = None,
    temperature: float = 0.0,
) -> TreeSizing:
    """Pick an EAGLE-2 tree (top-k, depth, total tokens) on this machine: for each setting of ``grid``, a pilot of
    `PILOT_PROMPTS` x `PILOT_TOKENS` gives τ and the draft and bookkeeping cost per round, and one verify curve over
    the grid's node counts (`step_costs`, read through `fitted_costs`) its verify time here. The settings are judged
    smallest first, each pilot prompt's predicted tokens/s paired across them (`paired_choice`): a larger tree wins
    only where its gain clears the pilot's own spread. ``baseline`` and ``temperature``: as in `size_chain`. τ of a
    whole tree is pooled over every round of the pilot, so it is steadier than the per-depth rates a chain is sized
    from."""
    signal = make(grid[0]).signal
    sizes = tuple(sorted({1, *(g.total_tokens for g in grid)}))
    context = pilot_context(prompts)
    curve, vanilla_step = step_costs(target, context, sizes, SIZING_REPS, signal is TargetSignal.AUX)
    curve, vanilla_step = fitted_costs(curve, _fastest_vanilla(vanilla_step, baseline, context))
    taus, rates, per_prompt, round_s = {}, {}, {}, {}
    grid = tuple(sorted(grid, key=lambda g: (g.total_tokens, g.depth, g.top_k)))
    for tree in grid:
        stats = [
            generate_speculative(target, make(tree), [p], pilot_params(temperature, i), eos_ids).stats
            for i, p in enumerate(pilot_prompts(prompts))
        ]
        name, verify = tree_name(tree), curve[tree.total_tokens]
        taus[name], rates[name] = tree_rate(stats, verify)
        per_prompt[name] = [tree_rate([s], verify)[1] for s in stats]
        rounds = max(1, sum(s.rounds for s in stats))
        round_s[name] = (sum(s.draft_s for s in stats) / rounds, sum(s.bookkeeping_s for s in stats) / rounds)
    best = paired_choice(per_prompt)
    tree = next(g for g in grid if tree_name(g) == best)
    sizing = TreeSizing(tree, taus, rates, vanilla_step, curve, per_prompt, grid, round_s)
    log(f"cost curve{_at(temperature)}: {sizing.account()}")
    return sizing


def tree_rate(stats: list[GenerationStats], verify_s: float) -> tuple[float, float]:
    """(τ, predicted tokens/s) of a tree's pilot runs: τ pooled over their rounds, and τ over a round's cost, its
    measured draft and bookkeeping time plus ``verify_s`` for the tree's nodes."""
    rounds = max(1, sum(s.rounds for s in stats))
    tau = sum(s.new_tokens for s in stats) / max(1, sum(s.row_forwards for s in stats))
    return tau, tau / (sum(s.draft_s + s.bookkeeping_s for s in stats) / rounds + verify_s)


@torch.inference_mode()
def verify_costs(target: TargetModel, context: list[int], sizes: tuple[int, ...], reps: int, aux: bool) -> dict:
    """Seconds of ``verify_tree`` over a chain of n nodes after ``context`` (the fastest of ``reps``); the cache is
    cut back after each call so every call sees the same context length."""
    return step_costs(target, context, sizes, reps, aux, vanilla=False)[0]


def fitted_costs(verify_s: dict[int, float], vanilla_step_s: float) -> tuple[dict[int, float], float]:
    """The costs a sizing rates settings on: the verify curve made non-decreasing in nodes, with vanilla's step below
    its first point (`models.timing.monotone` over vanilla at 0 nodes, then the curve). Best-of timings err only
    upwards, so a larger forward timed cheaper than a smaller one lowers the smaller; and where verifying n tokens
    costs less than vanilla's step, vanilla is credited with that cost too: speculation gains no speedup from the
    shape alone (the vanilla check reports such a shape from the raw curve)."""
    both = monotone({0: vanilla_step_s, **verify_s})
    return {n: both[n] for n in verify_s}, both[0]


def _fastest_vanilla(served_step: float, baseline: TargetModel | None, context: list[int]) -> float:
    """The served dtype's vanilla step, or vanilla's in the baseline's dtype where that is faster."""
    if baseline is None:
        return served_step
    return min(served_step, vanilla_step_cost(baseline, context, SIZING_REPS))


def step_costs(
    target: TargetModel,
    context: list[int],
    sizes: tuple[int, ...],
    reps: int,
    aux: bool,
    vanilla: bool = True,
    rows: int = 1,
) -> tuple[dict[int, float], float | None]:
    """(`verify_costs`, the vanilla loop's step), timed in turn in one loop (`infer.forward_cost.forward_timings`, the
    function the precision policy times its serving curves with), so the two see the same machine. ``rows``: the
    batch, every row holding ``context`` (the cost of a forward depends on the shapes, not the tokens); verify only
    (``vanilla=False``): vanilla's loop at a batch is timed on the real rows (`eval.batch_sizing.vanilla_loop_step`).
    Vanilla's step at batch 1 is the one-token forward of the loop ``target.vanilla_loop`` names
    (`infer.serving.choose_vanilla_loop`), in its own cache. It differs from t_verify(1), which adds the tree mask and
    the KV bookkeeping: on SmolLM2 the verify path cost 107 against 97 ms for the plain loop in fp32 on the AVX2 EPYC,
    and 36 against 41 ms in bf16 on the AVX-512-BF16 one, where the masked loop is chosen (docs/decisions.md, "The
    vanilla check compares like with like")."""
    if vanilla and rows > 1:
        raise ValueError("step_costs times vanilla's step at batch 1 only; use vanilla_loop_step at a batch")
    loops = (target.vanilla_loop,) if vanilla else ()
    times = forward_cost.forward_timings(target, context, sizes, reps, aux, rows, loops)
    # the least disturbed call of each size: on a shared host bursts hit some sizes more than others within one
    # loop (verify 2:161 against vanilla 100 ms in a burst, 87 against 86 outside it), and a ratio of medians carried
    # them into the sizing; the measured run averages the disturbance over all methods alike. A size whose calls
    # spread wider than MAX_SPREAD was timed again (`interleaved`'s retries)
    curve = {n: times[n].best for n in sizes}
    return curve, times[target.vanilla_loop].best if vanilla else None


def vanilla_step_cost(target: TargetModel, context: list[int], reps: int, loop: str | None = None) -> float:
    """Seconds of one cached one-token forward of the batch-1 vanilla loop ``loop`` (default the target's own), the
    fastest of ``reps`` (`infer.forward_cost.forward_timings`): the statistic `step_costs` takes for the verify curve
    it is compared with (a median here against minima there made 2-4-token verifies look faster than one token on a
    bf16 host, 35.5 against 41.9 ms)."""
    loop = loop or target.vanilla_loop
    return forward_cost.forward_timings(target, context, (), reps, loops=(loop,))[loop].best


SIZING_REPS = 7
"""Timings per size of a sizing's cost curve (the fastest of them; the host of this project's machines moves ~5-20 %
over minutes)."""
NOISE = 0.05
"""Relative difference below which two timings on this machine are called equal (repeated medians moved ~2-4 %)."""


CHECK_TOKENS = 16
"""Tokens per vanilla-loop run of the vanilla check (each run is timed in turn with as many bare forwards)."""


@torch.inference_mode()
def vanilla_check(target: TargetModel, contexts: list[list[int]], row: dict, reps: int = 7) -> dict:
    """Is the baseline at its best here? Two questions, each answered with the same statistic on both sides:

    - Loop overhead: ``reps`` runs of the vanilla loop (`CHECK_TOKENS` tokens, its mask, positions, sampling and
      bookkeeping), each timed in turn with as many bare one-token forwards of the same loop; the medians per step are
      compared. The measured run's mean step (``row``, a bs-1, T = 0 row of `eval.measure.measure`) is given beside
      them: it carries the host's load over the whole run, so against a minimum it read 22-31 % "slow" on a bf16 host
      where the A/B here finds the loop within noise.
    - Kernel shape: no verify of 2-8 tokens may run faster than the fastest one-token forward of either batch-1 loop
      (minima of ``reps``); if one did, speculation would gain from the shape alone.

    Everything is timed after a context as long as the measured loop's mean one (`infer.serving.loop_context`); timed
    after the first prompt alone, a short one, the check had called a loop over long RAG and summarisation prompts
    28 % slow."""
    context = loop_context(contexts, row["vanilla_mean_answer_tokens"])
    steps = {loop: vanilla_step_cost(target, context, reps, loop) for loop in VANILLA_LOOPS}
    fastest = min(steps.values())
    # the loop starts CHECK_TOKENS / 2 short of the context, so its steps see it on average
    start = context[: max(2, len(context) - CHECK_TOKENS // 2)]
    bare = vanilla_steps(target, context)[target.vanilla_loop]
    params = SamplingParams(max_new_tokens=CHECK_TOKENS)
    loop_runs, bare_runs = [], []
    for _ in range(reps):
        stats = generate_vanilla(target, [start], params, ()).stats  # no stop ids: every run makes CHECK_TOKENS
        loop_runs.append((stats.verify_s + stats.bookkeeping_s) / stats.rounds)
        bare_runs.append(statistics.mean(timed(bare, target.device) for _ in range(CHECK_TOKENS)))
    loop, forward = statistics.median(loop_runs), statistics.median(bare_runs)
    curve = verify_costs(target, context, (1, 2, 3, 4, 6, 8), reps, aux=False)
    measured = (row["vanilla_ms"]["forward"] + row["vanilla_ms"]["bookkeeping"]) / 1e3
    faster = {n: t for n, t in curve.items() if n > 1 and t < (1 - NOISE) * fastest}
    loop_ok = loop <= (1 + NOISE) * forward
    words = (
        f"after {len(context)} tokens (the measured loop's mean context), the {target.vanilla_loop} loop's step "
        f"{1e3 * loop:.1f} ms against its bare one-token forward {1e3 * forward:.1f} ms (medians of {reps} runs of "
        f"{CHECK_TOKENS} tokens, timed in turn): "
        + ("within noise" if loop_ok else f"{loop / forward - 1:.0%} overhead (the loop is not at its best)")
        + "; fastest one-token forward by loop "
        + ", ".join(f"{name} {1e3 * t:.1f} ms" for name, t in steps.items())
        + f"; verify ms by tokens {' '.join(f'{n}:{1e3 * t:.1f}' for n, t in curve.items())}: "
        + (
            "no verify shape is faster than one token"
            if not faster
            else "FASTER than one token at "
            + ", ".join(f"{n} tokens" for n in faster)
            + " (vanilla is not at its best)"
        )
        + f". The measured run's mean step was {1e3 * measured:.1f} ms (forward {row['vanilla_ms']['forward']:.1f} + "
        f"sampling and bookkeeping {row['vanilla_ms']['bookkeeping']:.1f}; the host's load over the run included). "
        f"Prefill took {row['vanilla_ms']['prefill_total'] / max(1e-9, row['vanilla_ms']['total']):.0%} of vanilla's "
        "wall time (it counts in every method's tokens/s alike)."
    )
    return {
        "loop": target.vanilla_loop,
        "loop_step_ms": 1e3 * loop,
        "bare_forward_ms": 1e3 * forward,
        "measured_step_ms": 1e3 * measured,
        "fastest_forward_ms": 1e3 * fastest,
        "forward_ms_by_loop": {name: 1e3 * t for name, t in steps.items()},
        "verify_ms": {n: 1e3 * t for n, t in curve.items()},
        "loop_within_noise": loop_ok,
        "verify_faster_than_vanilla": sorted(faster),
        "summary": words,
    }
