"""The one timing loop: τ, speedup and greedy identity of proposers against vanilla (``report.json`` + ``report.md``).

Recipes' reports and the quick start call `measure` and `write_report`. Schema (shared by all recipes)::

    {"method": "eagle3", "target": "<name_or_path>", "prompt_set": "...", "created": "...", "machine": "...",
     "results": [{"proposer": "eagle3", "setting": "chain 5", "category": "all", "temperature": 0.0,
                  "batch_size": 1, "tau": 3.1, "speedup": 2.2, "tokens_per_s": ..., "vanilla_tokens_per_s": ...,
                  "alpha": [...], "greedy_identical": 1.0, "divergences": [...], "prompts": 16,
                  "max_new_tokens": 128, "lossy": false}, ...]}

Conventions (DESIGN.md §4): every answer stops at the target's EOS / stop ids (a token after a stop is never
emitted, so never counted); τ counts the bonus token; speedup is tokens/s over the faster of our vanilla loop and
HF ``generate`` measured in the same run, with all methods interleaved prompt by prompt; at T = 0 every prompt's
output is compared with vanilla, and a divergence is reported with the target's top-2 logit gap (a numerical tie
or a bug, ``eval.lossless``). Prompt lookup is always measured beside the drafter, so copy-heavy output (which
flatters every drafter) is visible. Rows are given for all prompts and for each category.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from infer.certificate import Certifier
from infer.forward_cost import quiet_routing  # the serving path the precision policy times (``prepare``)
from infer.generate import (
    VANILLA_LOOPS,
    GenerationStats,
    SpecConfig,
    depth_tallies,
    generate_speculative,
    generate_vanilla,
    vanilla_steps,
)
from infer.kernels.cpu_linear import install as install_cpu_linear
from infer.kernels.cpu_linear import uninstall as uninstall_cpu_linear
from infer.proposer import Proposer
from infer.proposers import PromptLookupProposer
from infer.sampling import SamplingParams
from models.acceptance import acceptance_rates
from models.precision import choose, machine, redecide
from models.target import TargetModel
from models.timing import clock, interleaved


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


def stop_ids(tokenizer, model) -> tuple[int, ...]:
    """EOS of the tokenizer and of the model's generation config (a list for chat models such as Llama-3)."""
    eos = model.generation_config.eos_token_id
    ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    return tuple(sorted(i for i in ids if i is not None))


def prepare_target(target: TargetModel, log: Callable[[str], None] = print) -> None:
    """On the CPU, route the target's small-row matmuls to the layout measured faster here (infer/kernels/
    cpu_linear.py); vanilla, HF generate and every proposer then run the same target."""
    if target.device.type == "cpu":
        install_cpu_linear(target.model, log)


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


def alpha_of(stats: list[GenerationStats]) -> list[float]:
    """Per-depth acceptance α_k aggregated over generate calls (DESIGN.md §4)."""
    return acceptance_rates(*depth_tallies(stats))


class _Tally:
    """Tokens, seconds, stats and identity counts of one method at one (T, bs), split by category."""

    def __init__(self) -> None:
        self.by_cat: dict[str, dict] = {}

    def add(
        self,
        cat: str,
        tokens: int,
        seconds: float,
        stats: GenerationStats | None,
        same=0,
        compared=0,
        div=None,
        prompt_tokens: float | None = None,
    ):
        t = self.by_cat.setdefault(
            cat, {"tokens": 0, "s": 0.0, "stats": [], "same": 0, "compared": 0, "div": [], "calls": []}
        )
        t["tokens"] += tokens
        t["s"] += seconds
        if stats is not None:
            t["stats"].append(stats)
            if prompt_tokens is not None:  # τ against prompt length (the leaderboard's plot)
                t["calls"].append([prompt_tokens, stats.new_tokens, stats.rounds])
        t["same"] += same
        t["compared"] += compared
        t["div"] += div or []

    def merged(self, cat: str) -> dict:
        if cat != "all":
            return self.by_cat[cat]
        out = {"tokens": 0, "s": 0.0, "stats": [], "same": 0, "compared": 0, "div": [], "calls": []}
        for t in self.by_cat.values():
            for k in out:
                out[k] = out[k] + t[k]
        return out


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


def fp32_pass(
    target: TargetModel,
    candidates: list[Candidate],
    prompts: list[MeasuredPrompt],
    eos_ids: tuple[int, ...],
    batch_sizes: tuple[int, ...],
    max_new_tokens: int,
    log: Callable[[str], None] = print,
) -> dict[tuple[int, str], _Tally]:
    """The certificate pass of a target served below fp32: vanilla and every lossless candidate at T = 0 once more
    on an fp32 copy of the target, each compared with fp32 vanilla. Where rounding is ~1e-7 the outputs must be
    token-identical; a divergence here is certified against an fp64 replay. Keyed by (batch size, candidate)."""
    t0 = time.perf_counter()
    target32 = fp32_copy(target, lambda m: None)
    certifier = Certifier(target32.model)
    out: dict[tuple[int, str], _Tally] = {}
    for bs in batch_sizes:
        for bi, batch in enumerate(batches_of(prompts, bs)):
            cat, ids = batch[0].category, [p.ids for p in batch]
            params = _greedy_params(0.0, max_new_tokens, bi)
            ref = generate_vanilla(target32, ids, params, eos_ids)
            for c in candidates:
                if c.lossy:
                    continue
                res = generate_speculative(target32, c.make(), ids, params, eos_ids, spec=c.spec)
                where = {"batch": bi, "category": cat, "prompts": [p.name for p in batch]}
                same, div = identity(certifier, ids, ref.tokens, res.tokens, where)
                out.setdefault((bs, c.key), _Tally()).add(cat, 0, 0.0, None, same, len(batch), div)
    log(f"fp32 certificate pass: {time.perf_counter() - t0:.0f} s (report.fp32_certificate=false skips it)")
    return out


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
    """Run vanilla, HF generate (bs 1) and every candidate on the same prompts; return result rows.

    ``batch_repeats``: at batch sizes above 1, decode each batch this many times, every method once per repeat in
    turn (a batch of cycled prompts is one call per method, and one call's timing on a shared host moved by 20 %
    here). Rows then pool the repeats and carry ``vanilla_repeat_spread``: the widest (max - min) / mean of
    vanilla's tokens/s over the repeats of one batch, the noise band a speedup there is read against.

    ``vanilla_target``: the target in the dtype vanilla is fastest in, when that is not the served one
    (`serving_targets`): vanilla and HF generate run on both, greedy identity is judged against the served dtype's
    vanilla, and speedup is over the fastest of the four. ``drafter_dtype``: what the rows say the drafters ran in
    (default the served dtype).

    ``hf_assisted``: name → extra ``generate`` kwargs (e.g. ``prompt_lookup_num_tokens``, ``assistant_model``),
    timed at bs 1 beside the rest (HF reports no τ, so those rows have ``tau`` None). ``fp32_certificate``: where
    the target is served below fp32, re-run T = 0 in fp32 (`fp32_pass`) for ``greedy_identical_fp32``."""
    if not prompts:
        raise ValueError("no prompts to measure: the prompt set is empty")
    prepare_target(target, log)
    if vanilla_target is not None:
        prepare_target(vanilla_target, log)
        generate_vanilla(vanilla_target, [prompts[0].ids], SamplingParams(max_new_tokens=4))
    for t in (target, vanilla_target):  # a report chose before its sizing; a direct call chooses here
        if t is not None and 1 in batch_sizes and not t.vanilla_loop_ms:
            choose_vanilla_loop(t, [p.ids for p in prompts], max_new_tokens / 2, log)
    if include_prompt_lookup:
        candidates = [Candidate("prompt lookup", "chain 10", lambda: PromptLookupProposer(num_draft=10))] + candidates
    warm = SamplingParams(max_new_tokens=4)
    for bs in batch_sizes:  # one-off costs (allocator, first kernels, first touch of a batch's buffers) untimed
        ids = [p.ids for p in batches_of(prompts, bs)[0]] if bs > 1 else [prompts[0].ids]
        if bs > 1:  # the first batch-64 call would otherwise pay for pages every later call reuses
            generate_vanilla(target, ids, warm, eos_ids)
            if vanilla_target is not None:
                generate_vanilla(vanilla_target, ids, warm, eos_ids)
        for c in candidates:
            generate_speculative(target, c.make(), ids, warm, eos_ids)
    t = clock(target.device)
    generate_vanilla(target, [prompts[0].ids], SamplingParams(max_new_tokens=8))
    step_s = (clock(target.device) - t) / 8
    hf_assisted = hf_assisted or {}
    served = str(target.dtype).removeprefix("torch.")
    machine_words = machine(device=target.device.type).words()
    certify_fp32 = fp32_certificate and 0.0 in temperatures and target.dtype != torch.float32
    if batch_repeats < 1:
        raise ValueError(f"batch_repeats must be >= 1, got {batch_repeats}")
    reps = {bs: batch_repeats if bs > 1 else 1 for bs in batch_sizes}
    calls = len(temperatures) * sum(reps[bs] * (2 + len(candidates)) + len(hf_assisted) for bs in batch_sizes)
    calls += 2 * len(temperatures) * sum(reps.values()) if vanilla_target is not None else 0
    calls += (1 + len(candidates)) * len(batch_sizes) if certify_fp32 else 0
    log(
        f"measure: {len(prompts)} prompts x {calls} generate calls of up to {max_new_tokens} tokens, target in "
        f"{served}; vanilla step {step_s * 1000:.0f} ms → at most "
        f"~{estimate_minutes(step_s, len(prompts), calls, max_new_tokens):.0f} min (answers that stop at EOS take less)"
    )
    fp32 = fp32_pass(target, candidates, prompts, eos_ids, batch_sizes, max_new_tokens, log) if certify_fp32 else {}
    certifier = Certifier(target.model)
    others: list[Certifier] = []

    def certifier_other() -> Certifier:
        if not others:
            others.append(Certifier(vanilla_target.model))
        return others[0]

    rows: list[dict] = []
    cats = sorted({p.category for p in prompts})
    # progress within the run, with time left: one step is one batch decoded by vanilla and every method in turn
    steps = len(temperatures) * sum(len(batches_of(prompts, bs)) * reps[bs] for bs in batch_sizes)
    bar = tqdm(total=steps, desc="measure: batches (vanilla + every method)", unit="batch")
    for temp in temperatures:
        for bs in batch_sizes:
            batches = batches_of(prompts, bs)
            van, hf, van_other, hf_other = _Tally(), _Tally(), _Tally(), _Tally()
            acc = {c.key: _Tally() for c in candidates}
            assisted = {name: _Tally() for name in hf_assisted} if bs == 1 else {}
            repeat_tps: dict[int, list[float]] = {}  # batch → vanilla's tokens/s per repeat
            for rep_bi in range(len(batches) * reps[bs]):
                bi = rep_bi % len(batches)  # repeats after the whole round of batches: every method once per repeat
                batch = batches[bi]
                cat, ids = batch[0].category, [p.ids for p in batch]
                where = {"batch": bi, "category": cat, "prompts": [p.name for p in batch]}
                params = _greedy_params(temp, max_new_tokens, bi)
                ref = generate_vanilla(target, ids, params, eos_ids)
                van.add(cat, sum(map(len, ref.tokens)), ref.stats.total_s, ref.stats)
                repeat_tps.setdefault(bi, []).append(sum(map(len, ref.tokens)) / ref.stats.total_s)
                if vanilla_target is not None:
                    other = generate_vanilla(vanilla_target, ids, params, eos_ids)
                    van_other.add(cat, sum(map(len, other.tokens)), other.stats.total_s, other.stats)
                if bs == 1:
                    toks, s = hf_generate(target.model, ids[0], params, eos_ids)
                    hf.add(cat, len(toks), s, None)
                    if vanilla_target is not None:
                        toks, s = hf_generate(vanilla_target.model, ids[0], params, eos_ids)
                        hf_other.add(cat, len(toks), s, None)
                    for name, kw in hf_assisted.items():
                        toks, s = hf_generate(target.model, ids[0], params, eos_ids, **kw)
                        same, div = identity(certifier, ids, ref.tokens, [toks], where) if params.greedy else (0, [])
                        assisted[name].add(cat, len(toks), s, None, same, int(params.greedy), div)
                for c in candidates:
                    proposer = c.make()
                    res = generate_speculative(target, proposer, ids, params, eos_ids, spec=c.spec)
                    # a call the proposer left without drafts may have run vanilla's loop on the faster dtype's copy
                    # (the batch-aware policy): it is judged against that copy's vanilla, in that dtype
                    other_dtype = vanilla_target is not None and proposer.vanilla_target is vanilla_target
                    judge, reference = (certifier_other(), other.tokens) if other_dtype else (certifier, ref.tokens)
                    same, div = identity(judge, ids, reference, res.tokens, where) if params.greedy else (0, [])
                    compared = len(batch) if params.greedy else 0
                    prompt_tokens = sum(map(len, ids)) / len(ids)
                    tokens = sum(map(len, res.tokens))
                    acc[c.key].add(cat, tokens, res.stats.total_s, res.stats, same, compared, div, prompt_tokens)
                bar.set_postfix_str(f"T {temp:g}, batch size {bs}, {cat}", refresh=False)
                bar.update()
            for cat in ["all", *cats] if len(cats) > 1 else ["all"]:
                v, h = van.merged(cat), hf.merged(cat)
                vanilla_tps = v["tokens"] / v["s"]
                hf_tps = h["tokens"] / h["s"] if h["s"] else None
                baselines = {served: max(vanilla_tps, hf_tps or 0.0)}
                if vanilla_target is not None:
                    vo, ho = van_other.merged(cat), hf_other.merged(cat)
                    other_tps = max(vo["tokens"] / vo["s"], ho["tokens"] / ho["s"] if ho["s"] else 0.0)
                    baselines[str(vanilla_target.dtype).removeprefix("torch.")] = other_tps
                vanilla_dtype = max(baselines, key=baselines.get)
                base = baselines[vanilla_dtype]
                n_prompts = sum(len(b) for b in batches if cat in ("all", b[0].category))
                # one vanilla step (a target forward over one token per row), the t_target(1) of DESIGN.md §4
                vanilla_rounds = max(1, sum(s.rounds for s in v["stats"]))
                vanilla_step = sum(s.verify_s for s in v["stats"]) / vanilla_rounds
                # predictions are over the faster of the two dtypes' vanilla steps, as the measured speedup is
                baseline_step = vanilla_step
                if vanilla_target is not None:
                    rounds = max(1, sum(s.rounds for s in vo["stats"]))
                    baseline_step = min(vanilla_step, sum(s.verify_s for s in vo["stats"]) / rounds)
                common = {
                    "category": cat,
                    "temperature": temp,
                    "batch_size": bs,
                    "dtype": served,
                    "drafter_dtype": drafter_dtype or served,
                    "vanilla_dtype": vanilla_dtype,
                    "vanilla_tokens_per_s_by_dtype": baselines,
                    "machine": machine_words,
                    "vanilla_new_tokens": v["tokens"],
                    "vanilla_tokens_per_s": base,
                    "our_vanilla_tokens_per_s": vanilla_tps,
                    "hf_generate_tokens_per_s": hf_tps,
                    "vanilla_mean_answer_tokens": v["tokens"] / (n_prompts * reps[bs]),
                    "batch_repeats": reps[bs],
                    "vanilla_repeat_spread": max(
                        ((max(t) - min(t)) / (sum(t) / len(t)) for t in repeat_tps.values() if len(t) > 1),
                        default=None,
                    ),
                    # at batch 1: which of our two vanilla loops ran, and what their one-token forwards cost
                    "vanilla_loop": target.vanilla_loop if bs == 1 else "masked",
                    "vanilla_loop_ms": target.vanilla_loop_ms if bs == 1 else {},
                    "prompts": n_prompts,
                    "max_new_tokens": max_new_tokens,
                    # where vanilla's time goes: the forward per step, sampling and bookkeeping per step, prefill
                    "vanilla_ms": {
                        "forward": 1e3 * vanilla_step,
                        "bookkeeping": 1e3 * sum(s.bookkeeping_s for s in v["stats"]) / vanilla_rounds,
                        "prefill_total": 1e3 * sum(s.prefill_s for s in v["stats"]),
                        "total": 1e3 * v["s"],
                    },
                }
                named = [(c.proposer, c.setting, acc[c.key], c) for c in candidates]
                named += [(name, "HF generate", tally, None) for name, tally in assisted.items()]
                for proposer, setting, tally, c in named:
                    m = tally.merged(cat)
                    row = {
                        "proposer": proposer,
                        "setting": setting,
                        **common,
                        "new_tokens": m["tokens"],
                        "tokens_per_s": m["tokens"] / m["s"],
                        "speedup": (m["tokens"] / m["s"]) / base,
                        **_evidence(m, fp32.get((bs, c.key)) if c else None, cat, temp, served, c),
                        "lossy": bool(c and c.lossy),
                        # HF's assisted generation reports no rounds: no τ, α or step costs for those rows
                        "tau": None,
                        "alpha": [],
                        "predicted_speedup": None,
                        "step_ms": None,
                        "per_call": m["calls"],  # [mean prompt tokens, new tokens, rounds] per generate call
                    }
                    if m["stats"]:
                        merged = GenerationStats(
                            new_tokens=sum(s.new_tokens for s in m["stats"]),
                            row_forwards=sum(s.row_forwards for s in m["stats"]),
                            rounds=sum(s.rounds for s in m["stats"]),
                            draft_s=sum(s.draft_s for s in m["stats"]),
                            verify_s=sum(s.verify_s for s in m["stats"]),
                            bookkeeping_s=sum(s.bookkeeping_s for s in m["stats"]),
                        )
                        row["tau"] = merged.tau
                        row["alpha"] = alpha_of(m["stats"])
                        row["accepted_at_depth"], row["attempted_at_depth"] = depth_tallies(m["stats"])
                        # every target forward of a row, drafted or not: the unconditional acceptance's denominator
                        row["verify_steps"] = merged.row_forwards
                        row["predicted_speedup"] = merged.predicted_speedup(baseline_step)
                        row["step_ms"] = {k: 1e3 * x for k, x in merged.step_costs().items()} | {
                            "vanilla": 1e3 * baseline_step
                        }
                    rows.append(row)
                    _log_row(log, row)
    bar.close()
    return rows


def _evidence(m: dict, fp32: _Tally | None, cat: str, temp: float, served: str, c: Candidate | None) -> dict:
    """A row's lossless evidence: greedy identity in the served dtype, its divergences split into explained by that
    dtype's rounding and unexplained (must be 0), and greedy identity in fp32 (the certificate pass, or the run
    itself when served in fp32). None where nothing was compared (T > 0)."""
    if temp != 0.0 or not m["compared"] or (c is not None and c.lossy):
        return {
            "greedy_identical": None,
            "greedy_identical_fp32": None,
            "explained_divergences": None,
            "unexplained_divergences": None,
            "divergences": [],
            "fp32_divergences": [],
        }
    f = fp32.merged(cat) if fp32 is not None else None
    if served == "float32":
        identical_fp32, fp32_div = m["same"] / m["compared"], []
    elif f is not None and f["compared"]:
        identical_fp32, fp32_div = f["same"] / f["compared"], f["div"]
    else:  # skipped (report.fp32_certificate=false), lossy, or an outside peer's row
        identical_fp32, fp32_div = None, []
    explained = sum(d["explained"] for d in m["div"])
    return {
        "greedy_identical": m["same"] / m["compared"],
        "greedy_identical_fp32": identical_fp32,
        "explained_divergences": explained,
        "unexplained_divergences": len(m["div"]) - explained + sum(not d["explained"] for d in fp32_div),
        "divergences": m["div"],
        "fp32_divergences": fp32_div,
    }


def _log_row(log: Callable[[str], None], row: dict) -> None:
    tau = "–" if row["tau"] is None else f"{row['tau']:.2f}"
    gi = row["greedy_identical"]
    log(
        f"T={row['temperature']} bs={row['batch_size']} [{row['category']}] {row['proposer']} ({row['setting']}): "
        f"τ {tau}, {row['tokens_per_s']:.1f} tok/s, speedup {row['speedup']:.2f}x"
        + (f", greedy identical {gi:.2f}" if gi is not None else "")
    )


DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def evidence_words(r: dict) -> str:
    """A row's lossless evidence in words: "bf16 0.31 (11 diverged: 11 within bf16 rounding, 0 unexplained);
    fp32 1.00"."""
    if r["lossy"]:
        return "lossy (typical acceptance): no identity claim"
    if r["greedy_identical"] is None:
        return "–"
    dt = DTYPE_SHORT.get(r["dtype"], r["dtype"])
    words = f"{dt} {r['greedy_identical']:.2f}"
    if r["divergences"]:
        words += (
            f" ({len(r['divergences'])} diverged: {r['explained_divergences']} within {dt} rounding, "
            f"{len(r['divergences']) - r['explained_divergences']} unexplained)"
        )
    if r["dtype"] != "float32":
        fp32 = "not run" if r["greedy_identical_fp32"] is None else f"{r['greedy_identical_fp32']:.2f}"
        unexplained_fp32 = sum(not d["explained"] for d in r["fp32_divergences"])
        words += f"; fp32 {fp32}" + (f" ({unexplained_fp32} unexplained)" if unexplained_fp32 else "")
    return words


def _divergence_lines(rows: list[dict]) -> list[str]:
    """Every unexplained divergence by prompt, position, both tokens, the replayed gap and the band."""
    out = []
    for r in rows:
        if r["category"] != "all" and any(x["category"] == "all" for x in rows):
            continue  # the "all" rows hold every divergence once
        for d in r["divergences"] + r["fp32_divergences"]:
            if d["explained"]:
                continue
            prompt = d["prompts"][d["row"]] if d.get("prompts") else f"batch {d['batch']} row {d['row']}"
            gap = "none (one output is a prefix of the other)" if d["gap"] is None else f"{d['gap']:.4g}"
            band = "–" if d["band"] is None else f"{d['band']:.3g}"
            out.append(
                f"- {r['proposer']} ({r['setting']}), T {r['temperature']}, bs {r['batch_size']}, {d['served_dtype']}: "
                f"prompt {prompt or d['batch']}, position {d['position']}, vanilla token {d['vanilla_token']} vs "
                f"{d['candidate_token']}, gap {gap} in {d['replay_dtype']} (band {band})"
            )
    return out


def write_report(
    out_dir: str | Path,
    method: str,
    target_name: str,
    rows: list[dict],
    prompt_set: str = "",
    notes: str = "",
    checks: dict | None = None,
    precision: dict | None = None,
) -> None:
    """``report.json`` (schema above; ``checks`` such as the vanilla check go in as they are; ``precision``: the
    serving choice's `PrecisionChoice.as_dict`) and ``report.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = rows[0]["machine"] if rows else ""
    where = machine(device="cuda" if torch.cuda.is_available() and "cuda" in device.lower() else "cpu").as_dict()
    report = {
        "method": method,
        "target": target_name,
        "prompt_set": prompt_set,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": where,
        "precision": precision,
        **(checks or {}),
        "results": rows,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# {method} report",
        "",
        f"Target: `{target_name}`. Prompts: {prompt_set}. Machine: {where['words']}.",
        "",
        precision_words(rows, precision),
        "",
        *([notes, ""] if notes else []),
        "| category | proposer | setting | T | bs | dtype | τ | speedup | predicted | tokens/s | vanilla tokens/s "
        "(dtype) | α | greedy identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tau = "–" if r["tau"] is None else f"{r['tau']:.2f}"
        pred = "–" if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.2f}x"
        lines.append(
            f"| {r['category']} | {r['proposer']}{' (lossy)' if r['lossy'] else ''} | {r['setting']} | "
            f"{r['temperature']} | {r['batch_size']} | {_short(r['dtype'])} | {tau} | {r['speedup']:.2f}x | {pred} | "
            f"{r['tokens_per_s']:.1f} | {r['vanilla_tokens_per_s']:.1f} ({_short(r['vanilla_dtype'])}) | "
            f"{' '.join(f'{a:.2f}' for a in r['alpha'][:8])} | {evidence_words(r)} |"
        )
    lines += [
        "",
        "**Greedy identity** (T = 0) compares every answer with vanilla's. Where one diverges, the common prefix is "
        "replayed one precision up (fp32 for bf16, fp64 for fp32): a divergence is *within rounding* when the two "
        "tokens' exact logit gap is inside the served dtype's rounding band there (twice the served dtype's own "
        "error on that gap plus 2 ulps at that logit magnitude; `infer/certificate.py`), and *unexplained* "
        "otherwise, which would be a bug. Below fp32, the same methods and prompts are also run in fp32, where they "
        "must be identical.",
    ]
    unexplained = _divergence_lines(rows)
    lines += ["", "Unexplained divergences:", "", *unexplained] if unexplained else []
    for name, check in (checks or {}).items():
        if isinstance(check, dict) and "summary" in check:
            lines += ["", f"**{name.replace('_', ' ').capitalize()}**: {check['summary']}"]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _short(dtype: str) -> str:
    return DTYPE_SHORT.get(dtype, dtype)


def precision_words(rows: list[dict], precision: dict | None) -> str:
    """The report's precision sentence: the dtypes of target, drafters and the vanilla baseline, and why."""
    served = sorted({_short(r["dtype"]) for r in rows})
    drafters = sorted({_short(r["drafter_dtype"]) for r in rows})
    vanilla = sorted({_short(r["vanilla_dtype"]) for r in rows})
    words = f"**Precision**: target served in {', '.join(served)}, drafters in {', '.join(drafters)}; the vanilla "
    words += f"baseline (the fastest of our loop and HF generate) ran in {', '.join(vanilla)}"
    if vanilla != served:
        words += " (speculation runs in another dtype than the fastest vanilla: identity is judged in the served dtype)"
    loop = next((r for r in rows if r["batch_size"] == 1 and r["vanilla_loop_ms"]), None)
    if loop is not None:
        ms = loop["vanilla_loop_ms"]
        words += (
            f"; at batch 1 our vanilla ran its {loop['vanilla_loop']} loop, timed faster here in {_short(loop['dtype'])}"
            f" (one-token forward: {', '.join(f'{name} {t:.1f} ms' for name, t in ms.items())})"
        )
    if precision:
        how = {"user": "the user", "cached": "the precision policy, measured earlier on this machine"}
        words += f". Chosen by {how.get(precision['source'], 'the precision policy, ' + precision['source'])}: "
        words += precision["reason"]
    return words + "."
