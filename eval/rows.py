"""The rows of a measurement, from what its timing loop counted: a pure step (no timing, no model).

`eval.measure.time_cell` fills one `CellTallies` per (temperature, batch size): per method and category the tokens,
seconds and loop counters of its generate calls and the identity counts against vanilla. `rows_from_tallies` turns
one into result rows (DESIGN.md §4): τ (bonus included) and α from the loops' counters, speedup over the fastest
vanilla baseline measured (our loop or HF ``generate``, in either dtype), the predicted speedup over the faster
vanilla step, and the lossless evidence. Kept apart so that row building is tested on hand-made tallies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import torch

from infer.stats import GenerationStats, depth_tallies
from models.acceptance import acceptance_rates


class Method(Protocol):
    """What a row says of the method it measured (`eval.measure.Candidate` is one; this module cannot import it,
    eval.measure imports this one)."""

    proposer: str
    setting: str

    @property
    def key(self) -> str: ...

    @property
    def lossy(self) -> bool: ...


LOOKUP_ROW = ("prompt lookup", "chain 10")
"""(proposer, setting) of the prompt lookup row every measurement includes (`eval.measure.measure_plan`): the
reference the report states each row's ratio to."""


def alpha_of(stats: list[GenerationStats]) -> list[float]:
    """Per-depth acceptance α_k aggregated over generate calls (DESIGN.md §4)."""
    return acceptance_rates(*depth_tallies(stats))


def paired_ratio_gain(
    ours: list[tuple[int, int]], base: list[tuple[int, int]], draws: int = 4000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """How far a ratio of sums over prompts (τ = new tokens / forwards, α1 = accepted / attempted at depth 1) of one
    drafter lies above another's on the same prompts: ``ours[i]`` and ``base[i]`` are (numerator, denominator) of
    prompt i. Returns (gain, low, high), the interval the ``level`` percentiles of the gain over ``draws`` resamplings
    of the prompts, both drafters' counts resampled together (a paired bootstrap). Pairing is what makes a small
    file decisive: a prompt both drafters find easy moves both sums, so only their difference spreads the
    interval."""
    return _paired_bootstrap(ours, base, lambda a, b: a - b, draws, level, seed)


def paired_speedup(
    ours: list[list[float]], base: list[list[float]], draws: int = 4000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """One method's throughput over another's on the same generate calls: ``ours[i]`` and ``base[i]`` are
    [new tokens, seconds] of call i (a row's ``timed``), so the figure is (Σ tokens / Σ seconds) over (Σ tokens /
    Σ seconds), as a row's speedup is. Returns (ratio, low, high): the ``level`` interval of a paired bootstrap over
    the calls (`paired_ratio_gain`), which says whether a file of this size resolves the difference."""
    return _paired_bootstrap(ours, base, lambda a, b: a / b.clamp(min=1e-12), draws, level, seed)


def _paired_bootstrap(ours, base, statistic, draws: int, level: float, seed: int) -> tuple[float, float, float]:
    """``statistic(ours' ratio of sums, base's)`` on the pairs as given and its ``level`` percentile interval over
    ``draws`` resamplings of the pairs (both sides resampled together)."""
    if len(ours) != len(base) or not ours:
        raise ValueError(f"paired counts need the same prompts on both sides: {len(ours)} against {len(base)}")
    a = torch.tensor(ours, dtype=torch.float64)
    b = torch.tensor(base, dtype=torch.float64)

    def ratio(x: torch.Tensor) -> torch.Tensor:  # [..., n, 2] -> [...]: the sums' ratio (no denominator: 0)
        s = x.sum(-2)
        return torch.where(s[..., 1] > 0, s[..., 0] / s[..., 1].clamp(min=1e-12), torch.zeros_like(s[..., 0]))

    picks = torch.randint(len(ours), (draws, len(ours)), generator=torch.Generator().manual_seed(seed))
    spread = statistic(ratio(a[picks]), ratio(b[picks]))
    low, high = torch.quantile(spread, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return float(statistic(ratio(a), ratio(b))), float(low), float(high)


@dataclass
class CategoryTally:
    """What one method's generate calls in one category added up to."""

    tokens: int = 0
    """New tokens emitted."""
    seconds: float = 0.0
    """Wall time of those calls."""
    stats: list[GenerationStats] = field(default_factory=list)
    """Our loops' counters, one per call (none for HF ``generate``, which reports no rounds)."""
    same: int = 0
    """Rows token-identical to vanilla's (T = 0)."""
    compared: int = 0
    """Rows compared with vanilla's (T = 0)."""
    divergences: list[dict] = field(default_factory=list)
    """Each row that differed, with its certificate (`identity`)."""
    calls: list[list[float]] = field(default_factory=list)
    """[mean prompt tokens, new tokens, rounds] per call: τ against prompt length (the leaderboard's plot)."""
    timed: list[list[float]] = field(default_factory=list)
    """[new tokens, seconds] per call, in the timing loop's order (the same for every method of a cell): the pairs
    of `paired_speedup`."""


@dataclass
class Tally:
    """One method at one (temperature, batch size), by category."""

    by_category: dict[str, CategoryTally] = field(default_factory=dict)

    def add(
        self,
        category: str,
        tokens: int,
        seconds: float,
        stats: GenerationStats | None = None,
        same: int = 0,
        compared: int = 0,
        divergences: list[dict] | None = None,
        prompt_tokens: float | None = None,
    ) -> None:
        t = self.by_category.setdefault(category, CategoryTally())
        t.tokens += tokens
        t.seconds += seconds
        t.timed.append([tokens, seconds])
        if stats is not None:
            t.stats.append(stats)
            if prompt_tokens is not None:
                t.calls.append([prompt_tokens, stats.new_tokens, stats.rounds])
        t.same += same
        t.compared += compared
        t.divergences += divergences or []

    def merged(self, category: str) -> CategoryTally:
        """One category's tally, or every category's summed for "all"; empty where the method made no call (HF
        ``generate`` at batch sizes above 1)."""
        if category != "all":
            return self.by_category.get(category, CategoryTally())
        out = CategoryTally()
        for t in self.by_category.values():
            for f in dataclasses.fields(CategoryTally):
                setattr(out, f.name, getattr(out, f.name) + getattr(t, f.name))
        return out


@dataclass
class CellTallies:
    """What the timing loop counted at one (temperature, batch size): the input of `rows_from_tallies`."""

    temperature: float
    batch_size: int
    repeats: int
    """Times every batch was decoded (`MeasurePlan.batch_repeats` above batch 1)."""
    prompts: dict[str, int]
    """Prompts per category in one round of batches (a category cycled to fill a batch counts its repeats)."""
    vanilla: Tally = field(default_factory=Tally)
    """Our vanilla loop on the served target."""
    hf: Tally = field(default_factory=Tally)
    """HF ``generate`` on the served target (bs 1)."""
    vanilla_other: Tally = field(default_factory=Tally)
    """Our vanilla loop in vanilla's fastest dtype (with a `MeasurePlan.vanilla_target`)."""
    hf_other: Tally = field(default_factory=Tally)
    methods: dict[str, Tally] = field(default_factory=dict)
    """By `Candidate.key`."""
    assisted: dict[str, Tally] = field(default_factory=dict)
    """HF's assisted peers by name (bs 1)."""
    repeat_tokens_per_s: dict[int, list[float]] = field(default_factory=dict)
    """Batch index → vanilla's tokens/s in each repeat."""


@dataclass
class RowContext:
    """What rows say beside the tallies: the dtypes, the machine, the batch's vanilla loop."""

    served: str
    """The served target's dtype, e.g. "bfloat16"."""
    drafter_dtype: str
    other_dtype: str | None
    """Vanilla's other target's dtype (`MeasurePlan.vanilla_target`), None without one."""
    machine: str
    max_new_tokens: int
    vanilla_loop: str
    """Which of our vanilla loops ran (batch 1: the one timed faster; above: the masked one)."""
    vanilla_loop_ms: dict[str, float]


def rows_from_tallies(
    cell: CellTallies,
    candidates: list[Method],
    context: RowContext,
    fp32: dict[tuple[int, str], Tally] | None = None,
) -> list[dict]:
    """The result rows of one (temperature, batch size): for all prompts and (with more than one category) each
    category, one row per candidate and HF-assisted peer the cell measured (`cell.methods`). Pure: counts and seconds
    in, rows out (no timing, no model). ``fp32``: the certificate's tallies by (batch size, candidate key)
    (`eval.measure.fp32_replay`: each divergence decoded again in fp32 from where it began; a key absent: nothing of
    that candidate diverged), None where no certificate ran."""
    cats = sorted(cell.prompts)
    rows = []
    for cat in ["all", *cats] if len(cats) > 1 else ["all"]:
        common, base, baseline_step, base_timed = _common_fields(cell, cat, context)
        named = [(c.proposer, c.setting, cell.methods[c.key], c) for c in candidates if c.key in cell.methods]
        named += [(name, "HF generate", tally, None) for name, tally in cell.assisted.items()]
        for proposer, setting, tally, c in named:
            m = tally.merged(cat)
            certificate = None if fp32 is None or c is None else fp32.get((cell.batch_size, c.key), Tally())
            row = {
                "proposer": proposer,
                "setting": setting,
                **common,
                "new_tokens": m.tokens,
                "tokens_per_s": m.tokens / m.seconds,
                "speedup": (m.tokens / m.seconds) / base,
                # the speedup's paired 95 % interval over the calls (vanilla's in the same loop); None for a method
                # whose calls do not pair with the baseline's (HF generate's, at batch sizes above 1)
                "speedup_interval": (
                    list(paired_speedup(m.timed, base_timed)[1:]) if len(m.timed) == len(base_timed) else None
                ),
                "timed": m.timed,  # [new tokens, seconds] per call: any two rows of a cell pair (`paired_speedup`)
                **_evidence(m, certificate, cat, cell.temperature, context.served, c),
                "lossy": bool(c and c.lossy),
                # HF's assisted generation reports no rounds: no τ, α or step costs for those rows
                "tau": None,
                "alpha": [],
                "predicted_speedup": None,
                "step_ms": None,
                "per_call": m.calls,  # [mean prompt tokens, new tokens, rounds] per generate call
            }
            if m.stats:
                row |= _round_fields(m.stats, baseline_step)
            rows.append(row)
    return rows


def _tokens_per_s(t: CategoryTally) -> float | None:
    return t.tokens / t.seconds if t.seconds else None


def _common_fields(cell: CellTallies, cat: str, context: RowContext) -> tuple[dict, float, float, list[list[float]]]:
    """The fields every row of (cell, category) shares (the baselines, vanilla's costs, the precision), the
    baseline tokens/s speedups are over, the vanilla step predictions are over, and the baseline's calls."""
    v, h = cell.vanilla.merged(cat), cell.hf.merged(cat)
    vanilla_tps = v.tokens / v.seconds
    hf_tps = _tokens_per_s(h)
    fastest = {context.served: max((v, h), key=lambda t: _tokens_per_s(t) or 0.0)}
    if context.other_dtype is not None:
        vo, ho = cell.vanilla_other.merged(cat), cell.hf_other.merged(cat)
        fastest[context.other_dtype] = max((vo, ho), key=lambda t: _tokens_per_s(t) or 0.0)
    baselines = {dtype: _tokens_per_s(t) for dtype, t in fastest.items()}
    vanilla_dtype = max(baselines, key=baselines.get)
    base = baselines[vanilla_dtype]
    n_prompts = sum(n for c, n in cell.prompts.items() if cat in ("all", c))
    # one vanilla step (a target forward over one token per row), the t_target(1) of DESIGN.md §4
    vanilla_rounds = max(1, sum(s.rounds for s in v.stats))
    vanilla_step = sum(s.verify_s for s in v.stats) / vanilla_rounds
    # predictions are over the faster of the two dtypes' vanilla steps, as the measured speedup is
    baseline_step = vanilla_step
    if context.other_dtype is not None:
        rounds = max(1, sum(s.rounds for s in vo.stats))
        baseline_step = min(vanilla_step, sum(s.verify_s for s in vo.stats) / rounds)
    spreads = ((max(t) - min(t)) / (sum(t) / len(t)) for t in cell.repeat_tokens_per_s.values() if len(t) > 1)
    common = {
        "category": cat,
        "temperature": cell.temperature,
        "batch_size": cell.batch_size,
        "dtype": context.served,
        "drafter_dtype": context.drafter_dtype,
        "vanilla_dtype": vanilla_dtype,
        "vanilla_tokens_per_s_by_dtype": baselines,
        "machine": context.machine,
        "vanilla_new_tokens": v.tokens,
        "vanilla_tokens_per_s": base,
        "our_vanilla_tokens_per_s": vanilla_tps,
        "hf_generate_tokens_per_s": hf_tps,
        "vanilla_mean_answer_tokens": v.tokens / (n_prompts * cell.repeats),
        "batch_repeats": cell.repeats,
        "vanilla_repeat_spread": max(spreads, default=None),
        # at batch 1: which of our two vanilla loops ran, and what their one-token forwards cost
        "vanilla_loop": context.vanilla_loop,
        "vanilla_loop_ms": context.vanilla_loop_ms,
        "prompts": n_prompts,
        "max_new_tokens": context.max_new_tokens,
        # where vanilla's time goes: the forward per step, sampling and bookkeeping per step, prefill
        "vanilla_ms": {
            "forward": 1e3 * vanilla_step,
            "bookkeeping": 1e3 * sum(s.bookkeeping_s for s in v.stats) / vanilla_rounds,
            "prefill_total": 1e3 * sum(s.prefill_s for s in v.stats),
            "total": 1e3 * v.seconds,
        },
    }
    return common, base, baseline_step, fastest[vanilla_dtype].timed


def _round_fields(stats: list[GenerationStats], baseline_step: float) -> dict:
    """τ, α, the depth tallies, the verify steps and the predicted speedup and step costs of our loop's calls."""
    merged = GenerationStats(
        new_tokens=sum(s.new_tokens for s in stats),
        row_forwards=sum(s.row_forwards for s in stats),
        rounds=sum(s.rounds for s in stats),
        draft_s=sum(s.draft_s for s in stats),
        verify_s=sum(s.verify_s for s in stats),
        bookkeeping_s=sum(s.bookkeeping_s for s in stats),
    )
    accepted, attempted = depth_tallies(stats)
    return {
        "tau": merged.tau,
        "alpha": alpha_of(stats),
        "predicted_speedup": merged.predicted_speedup(baseline_step),
        "step_ms": {k: 1e3 * x for k, x in merged.step_costs().items()} | {"vanilla": 1e3 * baseline_step},
        "accepted_at_depth": accepted,
        "attempted_at_depth": attempted,
        # every target forward of a row, drafted or not: the unconditional acceptance's denominator
        "verify_steps": merged.row_forwards,
    }


def _evidence(m: CategoryTally, fp32: Tally | None, cat: str, temp: float, served: str, c: Method | None) -> dict:
    """A row's lossless evidence: greedy identity in the served dtype, its divergences split into explained by that
    dtype's rounding and unexplained (must be 0), and, below fp32, the fp32 replay of each divergence from where it
    began (``fp32_replays`` answers, ``fp32_replays_identical`` of them token-identical to fp32 vanilla; None where
    no certificate ran). None where nothing was compared (T > 0)."""
    if temp != 0.0 or not m.compared or (c is not None and c.lossy):
        return {
            "greedy_identical": None,
            "greedy_identical_fp32": None,
            "fp32_replays": None,
            "fp32_replays_identical": None,
            "explained_divergences": None,
            "unexplained_divergences": None,
            "divergences": [],
            "fp32_divergences": [],
        }
    replays = identical = None
    fp32_div: list[dict] = []
    if served == "float32":  # the run itself is the fp32 evidence
        identical_fp32 = m.same / m.compared
    elif fp32 is not None:
        f = fp32.merged(cat)
        replays, identical, fp32_div = f.compared, f.same, f.divergences
        identical_fp32 = f.same / f.compared if f.compared else None
    else:  # skipped (report.fp32_certificate=false), or an outside peer's row
        identical_fp32 = None
    explained = sum(d["explained"] for d in m.divergences)
    return {
        "greedy_identical": m.same / m.compared,
        "greedy_identical_fp32": identical_fp32,
        "fp32_replays": replays,
        "fp32_replays_identical": identical,
        "explained_divergences": explained,
        "unexplained_divergences": len(m.divergences) - explained + sum(not d["explained"] for d in fp32_div),
        "divergences": m.divergences,
        "fp32_divergences": fp32_div,
    }
