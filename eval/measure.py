"""The one timing loop: τ, speedup and greedy identity of proposers against vanilla, as result rows.

Recipes' reports, the benchmark and the quick start call `measure` (a report through its plan, `eval.report`), and
write the rows with `eval.report_md.write_report`. `measure` warms up, runs the one interleaved timing loop that fills
tallies (`CellTallies`, plain counts and seconds), and turns the tallies into rows with `rows_from_tallies`, a pure
function (no timing, no model call).

Conventions (DESIGN.md §4): every answer stops at the target's EOS / stop ids (a token after a stop is never
emitted, so never counted); τ counts the bonus token; speedup is tokens/s over the faster of our vanilla loop and
HF ``generate`` measured in the same run, with all methods interleaved prompt by prompt; at T = 0 every prompt's
output is compared with vanilla, and a divergence is reported with the target's top-2 logit gap (a numerical tie
or a bug, ``eval.lossless``). Prompt lookup is always measured beside the drafter, so copy-heavy output (which
flatters every drafter) is visible. Rows are given for all prompts and for each category.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from eval.rows import LOOKUP_ROW, CellTallies, RowContext, Tally, rows_from_tallies
from infer.certificate import Certifier
from infer.generate import (
    SpecConfig,
    generate_speculative,
    generate_vanilla,
)
from infer.proposer import Proposer
from infer.proposers import PromptLookupProposer
from infer.sampling import SamplingParams
from infer.serving import fp32_copy, ready_targets
from models.precision import machine
from models.target import TargetModel
from models.timing import clock


@dataclass
class Candidate:
    proposer: str
    """Name in the report, e.g. "eagle3"."""
    setting: str
    """Tree setting in words, e.g. "chain 5" or "EAGLE-2 k4 d5 n16"."""
    make: Callable[[], Proposer]
    """Builds a fresh proposer (one per generate call)."""
    spec: SpecConfig | None = None

    @property
    def key(self) -> str:
        return f"{self.proposer} / {self.setting}"

    @property
    def lossy(self) -> bool:
        """Typical acceptance (Medusa) changes the output distribution; such rows carry no identity evidence."""
        return self.spec is not None and self.spec.accept == "typical"


@dataclass
class MeasuredPrompt:
    ids: list[int]
    category: str = "all"
    name: str = ""
    """Where it came from (a Spec-Bench question_id and turn, a HumanEval task id), named in divergences."""


def hf_generate(model, prompt: list[int], params: SamplingParams, eos_ids: tuple[int, ...], **assist):
    """HF ``generate`` on one prompt with the same stop ids and sampling; (new tokens, seconds)."""
    kw = dict(max_new_tokens=params.max_new_tokens, eos_token_id=list(eos_ids) or None, pad_token_id=0)
    if params.greedy:
        kw["do_sample"] = False
    else:
        kw.update(do_sample=True, temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
    device = next(model.parameters()).device
    t = clock(device)
    out = model.generate(torch.tensor([prompt], device=device), **kw, **assist)
    seconds = clock(device) - t
    new = out[0, len(prompt) :].tolist()
    stop = next((i for i, tok in enumerate(new) if tok in eos_ids), None)
    return (new if stop is None else new[: stop + 1]), seconds


def identity(
    certifier: Certifier, prompts: list[list[int]], reference: list[list[int]], got: list[list[int]], where: dict
) -> tuple[int, list[dict]]:
    """How many rows of ``got`` equal vanilla's ``reference``, and each divergence with its certificate
    (`infer.certificate`), labelled with ``where`` (batch, category) and the row."""
    same, divergences = 0, []
    for j, (prompt, ref, out) in enumerate(zip(prompts, reference, got)):
        if out == ref:
            same += 1
            continue
        divergences.append({**where, "row": j, **certifier.compare(prompt, ref, out).as_dict()})
    return same, divergences


def estimate_minutes(step_s: float, prompts: int, calls_per_prompt: int, max_new_tokens: int) -> float:
    """Upper bound of a report's length: every call runs to max_new_tokens at the vanilla step time."""
    return step_s * prompts * calls_per_prompt * max_new_tokens / 60


def batches_of(prompts: list[MeasuredPrompt], bs: int) -> list[list[MeasuredPrompt]]:
    """Batches of ``bs`` prompts that never mix categories, so each category's rows come from its own prompts. A
    category with fewer prompts than ``bs`` is cycled to fill one batch (its prompts repeat), so that a row labelled
    batch 64 was decoded 64 rows at a time."""
    out = []
    for cat in sorted({p.category for p in prompts}):
        mine = [p for p in prompts if p.category == cat]
        if len(mine) < bs:
            out.append([mine[i % len(mine)] for i in range(bs)])
        else:
            out += [mine[i : i + bs] for i in range(0, len(mine), bs)]
    return out


def _greedy_params(temp: float, max_new_tokens: int, batch_index: int) -> SamplingParams:
    return SamplingParams(temperature=temp, max_new_tokens=max_new_tokens, seed=batch_index)


@dataclass(frozen=True)
class Replay:
    """One T = 0 answer that differed from vanilla's, to decode again in fp32 from where it first differed."""

    key: str
    """The candidate (`Candidate.key`)."""
    category: str
    batch_size: int
    prefix: tuple[int, ...]
    """The prompt and vanilla's answer up to the first differing token (the shorter answer where one output is a
    prefix of the other)."""
    start: int
    """Where in the answer the replay begins (the first differing token's index)."""
    budget: int
    """Tokens left of the answer's cap after the prefix."""
    where: dict = field(hash=False, compare=False)
    """Where the divergence was seen (batch, category, prompt names, row)."""


def replays_of(
    key: str, category: str, bs: int, prompts: list[list[int]], reference: list[list[int]], got: list[list[int]],
    divergences: list[dict], max_new_tokens: int,
) -> list[Replay]:  # fmt: skip
    """The `Replay` of each divergence `identity` found in one batch (``row`` indexes ``prompts``)."""
    out = []
    for d in divergences:
        j = d["row"]
        at = d["position"] if d["position"] is not None else min(len(reference[j]), len(got[j]))
        where = {k: d[k] for k in ("batch", "category", "prompts", "row") if k in d}
        prefix = tuple(prompts[j] + reference[j][:at])
        out.append(Replay(key, category, bs, prefix, at, max(1, max_new_tokens - at), where))
    return out


def fp32_replay(
    target: TargetModel,
    candidates: list[Candidate],
    replays: list[Replay],
    eos_ids: tuple[int, ...],
    log: Callable[[str], None] = print,
) -> dict[tuple[int, str], Tally]:
    """The certificate of a target served below fp32, spent where it is needed: every answer that differed from
    vanilla at T = 0 is decoded again on an fp32 copy of the target from its first differing token, by vanilla and by
    the candidate (the rows of one candidate and batch size together, at most that many at a time). Where rounding
    is ~1e-7 the two continuations must be token-identical; a divergence here is certified against an fp64 replay.
    An answer identical in the served dtype needs no replay. Keyed by (batch size, candidate); a repeat of the same
    divergence (batch repeats) is replayed once."""
    unique = list(dict.fromkeys(replays))
    if not unique:
        return {}
    t0 = time.perf_counter()
    target32 = fp32_copy(target, lambda m: None)
    certifier = Certifier(target32.model)
    by_key = {c.key: c for c in candidates}
    groups: dict[tuple[int, str], list[Replay]] = {}
    for r in unique:
        groups.setdefault((r.batch_size, r.key), []).append(r)
    out: dict[tuple[int, str], Tally] = {}
    for (bs, key), jobs in groups.items():
        c = by_key[key]
        for i in range(0, len(jobs), bs):
            part = jobs[i : i + bs]
            ids = [list(j.prefix) for j in part]
            params = SamplingParams(temperature=0.0, max_new_tokens=max(j.budget for j in part))
            ref = generate_vanilla(target32, ids, params, eos_ids)
            res = generate_speculative(target32, c.make(), ids, params, eos_ids, spec=c.spec)
            for job, prefix, a, b in zip(part, ids, ref.tokens, res.tokens):
                same, div = identity(certifier, [prefix], [a], [b], job.where)
                for d in div:  # where the answer was seen, and positions counted in the whole answer
                    d["row"] = job.where["row"]
                    d["position"] = None if d["position"] is None else d["position"] + job.start
                out.setdefault((bs, key), Tally()).add(job.category, 0, 0.0, None, same, 1, div)
    log(
        f"fp32 replay of {len(unique)} divergent answers from their first differing token: "
        f"{time.perf_counter() - t0:.0f} s (report.fp32_certificate=false skips it)"
    )
    return out


@dataclass
class MeasurePlan:
    """What one measurement runs, on targets already made ready (`ready_targets`): the methods, the prompts, the
    grid of temperatures and batch sizes, and what the rows say about precision."""

    target: TargetModel
    """The target speculation runs on (the served dtype)."""
    candidates: list[Candidate]
    prompts: list[MeasuredPrompt]
    eos_ids: tuple[int, ...]
    temperatures: tuple[float, ...] = (0.0,)
    max_new_tokens: int = 128
    batch_sizes: tuple[int, ...] = (1,)
    include_prompt_lookup: bool = True
    """Measure prompt lookup (chain 10) first, beside every report's methods (copy-heavy output made visible)."""
    hf_assisted: dict[str, dict] = field(default_factory=dict)
    """Name → extra HF ``generate`` kwargs (``prompt_lookup_num_tokens``, ``assistant_model``), timed at bs 1."""
    fp32_certificate: bool = True
    """Where the target is served below fp32, decode every T = 0 divergence again in fp32 from where it began
    (`fp32_replay`)."""
    vanilla_target: TargetModel | None = None
    """The target in the dtype vanilla is fastest in, when that is not the served one (`serving_targets`)."""
    drafter_dtype: str | None = None
    """What the rows say the drafters ran in (None: the served dtype)."""
    batch_repeats: int = 1
    """At batch sizes above 1, how many times every method decodes each batch in turn."""
    greedy_only: frozenset[str] = frozenset()
    """Candidate keys and HF peer names measured at T = 0 only (their T > 0 rows are left out, not estimated)."""

    only_at: dict[str, frozenset[float]] = field(default_factory=dict)
    """Candidate keys measured at these temperatures only: a setting sized for some temperatures and not others."""

    def runs(self, name: str, temp: float) -> bool:
        """Whether the method ``name`` (a candidate's key or an HF peer's name) is measured at ``temp``."""
        if name in self.only_at and temp not in self.only_at[name]:
            return False
        return temp == 0.0 or name not in self.greedy_only

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("no prompts to measure: the prompt set is empty")
        if self.batch_repeats < 1:
            raise ValueError(f"batch_repeats must be >= 1, got {self.batch_repeats}")

    def repeats(self, bs: int) -> int:
        return self.batch_repeats


@torch.no_grad()
def measure(
    target: TargetModel,
    candidates: list[Candidate],
    prompts: list[MeasuredPrompt],
    eos_ids: tuple[int, ...],
    temperatures: tuple[float, ...] = (0.0,),
    max_new_tokens: int = 128,
    batch_sizes: tuple[int, ...] = (1,),
    include_prompt_lookup: bool = True,
    hf_assisted: dict[str, dict] | None = None,
    fp32_certificate: bool = True,
    vanilla_target: TargetModel | None = None,
    drafter_dtype: str | None = None,
    batch_repeats: int = 1,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Run vanilla, HF generate (bs 1) and every candidate on the same prompts; return result rows. The targets are
    made ready here (`ready_targets`, keeping a batch-1 loop chosen earlier); the rest is `measure_plan`.

    ``batch_repeats``: decode each batch this many times, every method once per repeat in
    turn (a batch of cycled prompts is one call per method, and one call's timing on a shared host moved by 20 %
    here). Rows then pool the repeats and carry ``vanilla_repeat_spread``: the widest (max - min) / mean of
    vanilla's tokens/s over the repeats of one batch, the noise band a speedup there is read against.

    ``vanilla_target``: the target in the dtype vanilla is fastest in, when that is not the served one
    (`serving_targets`): vanilla and HF generate run on both, greedy identity is judged against the served dtype's
    vanilla, and speedup is over the fastest of the four. ``drafter_dtype``: what the rows say the drafters ran in
    (default the served dtype).

    ``hf_assisted``: name → extra ``generate`` kwargs (e.g. ``prompt_lookup_num_tokens``, ``assistant_model``),
    timed at bs 1 beside the rest (HF reports no τ, so those rows have ``tau`` None). ``fp32_certificate``: where
    the target is served below fp32, decode every T = 0 divergence again in fp32 from where it began (`fp32_replay`)."""
    plan = MeasurePlan(
        target,
        candidates,
        prompts,
        eos_ids,
        tuple(temperatures),
        max_new_tokens,
        tuple(batch_sizes),
        include_prompt_lookup,
        hf_assisted or {},
        fp32_certificate,
        vanilla_target,
        drafter_dtype,
        batch_repeats,
    )
    ids = [p.ids for p in prompts]
    ready_targets(target, vanilla_target, ids, plan.batch_sizes, max_new_tokens, log, keep_chosen=True)
    return measure_plan(plan, log)


@torch.no_grad()
def measure_plan(plan: MeasurePlan, log: Callable[[str], None] = print) -> list[dict]:
    """`measure` on ready targets: warm-up, the one interleaved timing loop (one `CellTallies` per temperature and
    batch size, `time_cell`), and the rows of each (`rows_from_tallies`)."""
    candidates = list(plan.candidates)
    if plan.include_prompt_lookup:
        candidates.insert(0, Candidate(*LOOKUP_ROW, lambda: PromptLookupProposer(num_draft=10)))
    _warm_up(plan, candidates)
    target, temperatures = plan.target, plan.temperatures
    certify_fp32 = plan.fp32_certificate and 0.0 in temperatures and target.dtype != torch.float32
    _announce(plan, candidates, log)
    served = str(target.dtype).removeprefix("torch.")
    judges = Judges(target, plan.vanilla_target)
    words = machine(device=target.device.type).words()
    other = None if plan.vanilla_target is None else str(plan.vanilla_target.dtype).removeprefix("torch.")
    # progress within the run, with time left: one step is one batch decoded by vanilla and every method in turn
    steps = len(temperatures) * sum(len(batches_of(plan.prompts, bs)) * plan.repeats(bs) for bs in plan.batch_sizes)
    bar = tqdm(total=steps, desc="measure: batches (vanilla + every method)", unit="batch")
    cells, replays = [], []
    for temp in temperatures:
        for bs in plan.batch_sizes:
            cells.append(time_cell(plan, candidates, temp, bs, judges, bar, replays))
    bar.close()
    fp32 = fp32_replay(target, candidates, replays, plan.eos_ids, log) if certify_fp32 else None
    rows: list[dict] = []
    for cell in cells:
        bs = cell.batch_size
        context = RowContext(
            served=served,
            drafter_dtype=plan.drafter_dtype or served,
            other_dtype=other,
            machine=words,
            max_new_tokens=plan.max_new_tokens,
            vanilla_loop=target.vanilla_loop if bs == 1 else "masked",
            vanilla_loop_ms=target.vanilla_loop_ms if bs == 1 else {},
        )
        for row in rows_from_tallies(cell, candidates, context, fp32):
            _log_row(log, row)
            rows.append(row)
    return rows


def _warm_up(plan: MeasurePlan, candidates: list[Candidate]) -> None:
    """One-off costs (allocator, first kernels, first touch of a batch's buffers) paid before any timed call."""
    target, other, first = plan.target, plan.vanilla_target, plan.prompts[0].ids
    warm = SamplingParams(max_new_tokens=4)
    if other is not None:
        generate_vanilla(other, [first], warm)
    for bs in plan.batch_sizes:
        ids = [p.ids for p in batches_of(plan.prompts, bs)[0]] if bs > 1 else [first]
        if bs > 1:  # the first batch-64 call would otherwise pay for pages every later call reuses
            generate_vanilla(target, ids, warm, plan.eos_ids)
            if other is not None:
                generate_vanilla(other, ids, warm, plan.eos_ids)
        for c in candidates:
            generate_speculative(target, c.make(), ids, warm, plan.eos_ids)


def _announce(plan: MeasurePlan, candidates: list[Candidate], log: Callable[[str], None]) -> None:
    """One line: how many generate calls the run makes and an upper bound of its length from one vanilla step."""
    target, temperatures, batch_sizes = plan.target, plan.temperatures, plan.batch_sizes
    t = clock(target.device)
    generate_vanilla(target, [plan.prompts[0].ids], SamplingParams(max_new_tokens=8))
    step_s = (clock(target.device) - t) / 8
    reps = {bs: plan.repeats(bs) for bs in batch_sizes}
    calls = sum(
        reps[bs] * (2 + sum(plan.runs(c.key, t) for c in candidates))
        + sum(plan.runs(name, t) for name in plan.hf_assisted) * (bs == 1)
        for t in temperatures
        for bs in batch_sizes
    )
    calls += 2 * len(temperatures) * sum(reps.values()) if plan.vanilla_target is not None else 0
    n, new = len(plan.prompts), plan.max_new_tokens
    log(
        f"measure: {n} prompts x {calls} generate calls of up to {new} tokens, target in "
        f"{str(target.dtype).removeprefix('torch.')}; vanilla step {step_s * 1000:.0f} ms → at most "
        f"~{estimate_minutes(step_s, n, calls, new):.0f} min (answers that stop at EOS take less)"
    )


class Judges:
    """The greedy-identity certifiers: the served target's, and (made on first use) vanilla's other dtype's."""

    def __init__(self, target: TargetModel, vanilla_target: TargetModel | None) -> None:
        self.served, self._vanilla_target, self._other = Certifier(target.model), vanilla_target, None

    def other(self) -> Certifier:
        if self._other is None:
            self._other = Certifier(self._vanilla_target.model)
        return self._other


def time_cell(
    plan: MeasurePlan,
    candidates: list[Candidate],
    temp: float,
    bs: int,
    judges: Judges,
    bar: tqdm,
    replays: list[Replay],
) -> CellTallies:
    """Every batch decoded by vanilla (both dtypes), HF generate and its assisted peers (bs 1) and every candidate in
    turn, the round of batches repeated `MeasurePlan.repeats` times; T = 0 outputs compared with vanilla's, each
    candidate's divergence added to ``replays`` (for `fp32_replay`)."""
    target, other_target, eos_ids = plan.target, plan.vanilla_target, plan.eos_ids
    batches = batches_of(plan.prompts, bs)
    cell = CellTallies(temp, bs, plan.repeats(bs), {})
    for b in batches:
        cell.prompts[b[0].category] = cell.prompts.get(b[0].category, 0) + len(b)
    candidates = [c for c in candidates if plan.runs(c.key, temp)]
    assisted = {name: kw for name, kw in plan.hf_assisted.items() if plan.runs(name, temp)} if bs == 1 else {}
    cell.methods = {c.key: Tally() for c in candidates}
    cell.assisted = {name: Tally() for name in assisted}
    for rep_bi in range(len(batches) * cell.repeats):
        bi = rep_bi % len(batches)  # repeats after the whole round of batches: every method once per repeat
        batch = batches[bi]
        cat, ids = batch[0].category, [p.ids for p in batch]
        where = {"batch": bi, "category": cat, "prompts": [p.name for p in batch]}
        params = _greedy_params(temp, plan.max_new_tokens, bi)
        ref = generate_vanilla(target, ids, params, eos_ids)
        cell.vanilla.add(cat, sum(map(len, ref.tokens)), ref.stats.total_s, ref.stats)
        cell.repeat_tokens_per_s.setdefault(bi, []).append(sum(map(len, ref.tokens)) / ref.stats.total_s)
        if other_target is not None:
            other = generate_vanilla(other_target, ids, params, eos_ids)
            cell.vanilla_other.add(cat, sum(map(len, other.tokens)), other.stats.total_s, other.stats)
        if bs == 1:
            toks, s = hf_generate(target.model, ids[0], params, eos_ids)
            cell.hf.add(cat, len(toks), s)
            if other_target is not None:
                toks, s = hf_generate(other_target.model, ids[0], params, eos_ids)
                cell.hf_other.add(cat, len(toks), s)
            for name, kw in assisted.items():
                toks, s = hf_generate(target.model, ids[0], params, eos_ids, **kw)
                same, div = identity(judges.served, ids, ref.tokens, [toks], where) if params.greedy else (0, [])
                cell.assisted[name].add(cat, len(toks), s, None, same, int(params.greedy), div)
        for c in candidates:
            proposer = c.make()
            res = generate_speculative(target, proposer, ids, params, eos_ids, spec=c.spec)
            # a call the proposer left without drafts may have run vanilla's loop on the faster dtype's copy (the
            # batch-aware policy): it is judged against that copy's vanilla, in that dtype
            other_dtype = other_target is not None and proposer.vanilla_target is other_target
            judge, reference = (judges.other(), other.tokens) if other_dtype else (judges.served, ref.tokens)
            same, div = identity(judge, ids, reference, res.tokens, where) if params.greedy else (0, [])
            if not c.lossy:
                replays += replays_of(c.key, cat, bs, ids, reference, res.tokens, div, plan.max_new_tokens)
            compared = len(batch) if params.greedy else 0
            prompt_tokens = sum(map(len, ids)) / len(ids)
            tokens = sum(map(len, res.tokens))
            cell.methods[c.key].add(cat, tokens, res.stats.total_s, res.stats, same, compared, div, prompt_tokens)
        bar.set_postfix_str(f"T {temp:g}, batch size {bs}, {cat}", refresh=False)
        bar.update()
    return cell


def _log_row(log: Callable[[str], None], row: dict) -> None:
    tau = "–" if row["tau"] is None else f"{row['tau']:.2f}"
    gi = row["greedy_identical"]
    log(
        f"T={row['temperature']} bs={row['batch_size']} [{row['category']}] {row['proposer']} ({row['setting']}): "
        f"τ {tau}, {row['tokens_per_s']:.1f} tok/s, speedup {row['speedup']:.2f}x"
        + (f", greedy identical {gi:.2f}" if gi is not None else "")
    )
