"""The verify-runtime report of any drafter: the end of every recipe, or on demand for any checkpoint of any family.

    python -m eval.report --drafter DIR [--config report.yaml] [report.prompts=8 ...]
    drafters report --drafter DIR [...]
    python train/eagle3.py report --drafter DIR [--config recipe.yaml] [...]   # also train/medusa.py, train/mtp.py

Measures, on held-out prompts (``eval.prompts``; every answer stops at the target's EOS) and in one process with
interleaved runs (``eval.measure``): vanilla decoding, HF ``generate``, prompt lookup, the drafter in the settings its
family declares (``infer.family``; the families are listed in ``infer.families``: e.g. EAGLE-3's chain and EAGLE-2
tree, Medusa's chain and static tree, MTP's chain, reuse past D and top-k tree), the drafters named in ``compare``
the same way, and (when given) a small draft model with the chain and tree settings; writes ``report.json`` +
``report.md`` with rows for all prompts and for each category. The report never names a family: it reads their
declarations. What it measures is set by `eval.report_config.ReportConfig`, which also builds the prompt set.

The recipe entry points pass what only train/ can build (the ``eval_data`` samples of ``prompt_source=eval_data``),
so this module needs nothing from train/ (DESIGN.md §2).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eval.batch_sizing import BatchSizing, size_batch_policy
from eval.cost_curve import ChainSizing, TreeSizing, heldout_acceptance, size_chain, size_tree, tree_name, vanilla_check
from eval.measure import Candidate, MeasurePlan, measure_plan
from eval.report_config import DATASTORE_MAX_NGRAM, ReportConfig, ReportOnlyConfig, report_prompts
from eval.report_md import write_report
from infer.batch_policy import BatchAwareProposer
from infer.datastore import Datastore
from infer.families import FAMILIES, family_of, load_drafter
from infer.family import ChainSizer, DrafterFamily
from infer.forward_cost import quiet_routing
from infer.hybrid import HybridProposer
from infer.pricing import ChainAcceptance
from infer.proposer import Proposer
from infer.proposers import DraftModelProposer, PromptLookupProposer
from infer.serving import ready_targets, serving_targets
from infer.tree_search import DynamicTreeConfig
from models.checkpoint import read_checkpoint
from models.config import parse_cli
from models.draft_model import cut_target
from models.loader import load_target
from models.target import TargetConfig, TargetModel
from models.tokenizer import load_tokenizer, stop_ids


def candidates(
    drafters: list[torch.nn.Module],
    cfg: ReportConfig,
    sizers: list[ChainSizer] | None = None,
    target: TargetModel | None = None,
    log: Callable[[str], None] = print,
    families: tuple[DrafterFamily, ...] = FAMILIES,
    datastore: Datastore | None = None,
    tree_sizing: TreeSizing | None = None,
) -> list[Candidate]:
    """The report's proposers: for each drafter the settings its family declares (``infer.family``; the family is
    looked up in ``families``), then the draft model's. ``sizers[i](make, longest) -> k`` picks drafter i's chain
    length on this machine (the last one sizes the draft model's chain; None, or chain_from_cost_curve off: the
    longest). ``target``: where the undistilled draft-model cut comes from. ``datastore``: prompt lookup and the
    hybrid drafting from it too, as rows of their own beside the plain ones. ``tree_sizing``: where the hybrid wraps
    the tree it sized, the hybrid is priced on its costs (``cfg.hybrid_priced``, `infer.pricing`). The hybrid wraps
    ``cfg.hybrid_tree`` where one is given, else the sized tree ``cfg.hybrid_shallower`` levels shallower."""

    def longest(make: Callable[[int], Proposer], k: int) -> int:
        return k

    sizers = sizers if sizers is not None and cfg.chain_from_cost_curve else [longest] * (len(drafters) + 1)
    out = []
    for i, (drafter, size) in enumerate(zip(drafters, sizers)):
        fam = family_of(drafter, families)
        settings = fam.report_proposers(drafter, cfg, size)
        if i > 0 and cfg.compare_settings:
            settings = settings[: cfg.compare_settings]
        for s in settings:
            out.append(Candidate(fam.method, s.setting, s.make, s.spec))
        if i == 0 and cfg.hybrid_lookup and settings:
            learned = settings[-1]  # the tree, where the family has one: lookup nodes join a tree best
            alone = cfg.hybrid_alone_match
            priced = cfg.hybrid_priced and tree_sizing is not None and learned.setting == tree_name(tree_sizing.tree)
            price = tree_sizing.price() if priced else None
            own = None
            if cfg.hybrid_tree:
                k, depth, total = cfg.hybrid_tree
                own = dataclasses.replace(cfg, chain_k=0, tree_top_k=k, tree_depth=depth, tree_total_tokens=total)
            elif cfg.hybrid_shallower and learned.setting == cfg.tree_name and cfg.tree_depth > 2:
                own = dataclasses.replace(cfg, chain_k=0, tree_depth=max(2, cfg.tree_depth - cfg.hybrid_shallower))
            if own is not None:
                learned = fam.report_proposers(drafter, own, longest)[-1]
                if learned.setting != own.tree_name:
                    raise ValueError(f"report.hybrid_tree is an EAGLE-2 tree: {fam.method} drafts none")
                if price is not None:  # a round drafts one forward per level (the sync, then an expand per level)
                    price = dataclasses.replace(price, draft_ms=price.draft_ms * own.tree_depth / cfg.tree_depth)
            n = cfg.hybrid_priced_lookup if priced else cfg.hybrid_lookup
            # one tally per row, shared by its calls: later answers are priced from what earlier ones taught it
            tally, tally_ds = ChainAcceptance(), ChainAcceptance()

            def make(learned=learned, n=n, alone=alone, price=price, tally=tally) -> Proposer:
                # no cap beyond the sized setting's own: the union holds at most its nodes plus n
                return HybridProposer(
                    learned.make(), num_draft=n, budget=1 << 10, alone_match=alone, price=price, chain_acceptance=tally
                )

            setting = f"{learned.setting} + lookup {n}" + (f", alone at {alone}-gram matches" if alone else "")
            setting += ", priced" if price is not None else ""
            out.append(Candidate(f"{fam.method} + prompt lookup", setting, make, learned.spec))
            if datastore is not None:

                def make_ds(learned=learned, n=n, alone=alone, price=price, tally=tally_ds) -> Proposer:
                    return HybridProposer(
                        learned.make(),
                        num_draft=n,
                        budget=1 << 10,
                        alone_match=alone,
                        datastore=datastore,
                        price=price,
                        chain_acceptance=tally,
                    )

                method = f"{fam.method} + prompt lookup + datastore"
                out.append(Candidate(method, f"{setting}, {_datastore_setting(datastore)}", make_ds, learned.spec))
    if datastore is not None:
        setting = f"chain 10, {_datastore_setting(datastore)}"
        out.append(
            Candidate("prompt lookup + datastore", setting, lambda: PromptLookupProposer(10, datastore=datastore))
        )
    draft, how = baseline_draft_model(cfg, target, log)
    if draft is not None:
        draft = draft.to(next(drafters[0].parameters()).device).eval()
        name = f"{DRAFT_MODEL} ({draft.config.num_hidden_layers} layers, {how})"
        if cfg.chain_k:
            dk = sizers[-1](lambda n: DraftModelProposer(draft, k=n), cfg.chain_k)
            out.append(Candidate(name, f"chain {dk}", lambda: DraftModelProposer(draft, k=dk)))
        if cfg.tree_total_tokens and cfg.draft_model_tree:
            tree = cfg.tree
            out.append(Candidate(name, cfg.tree_name, lambda: DraftModelProposer(draft, tree=tree)))
    return out


def _datastore_setting(datastore: Datastore) -> str:
    return f"datastore {datastore.num_draft} after a {datastore.min_ngram}-gram match"


def baseline_draft_model(cfg: ReportConfig, target: TargetModel | None, log: Callable[[str], None] = print):
    """(the draft model, "distilled" / "not distilled") of ``cfg.draft_model``, or (None, "") when it is null."""
    if cfg.draft_model is None:
        return None, ""
    if cfg.draft_model != "cut" and (Path(cfg.draft_model) / "config.json").exists():
        from transformers import AutoModelForCausalLM

        dtype = target.dtype if target is not None else torch.float32  # drafters run in the served dtype
        return AutoModelForCausalLM.from_pretrained(cfg.draft_model, dtype=dtype), "distilled"
    if target is None:
        raise ValueError("the undistilled draft-model cut needs the target")
    layers = min(cfg.draft_model_layers, target.num_layers - 1)
    if layers < 1:
        log(f"report: the target has {target.num_layers} layer(s), no smaller cut to draft with; no draft-model rows")
        return None, ""
    if cfg.draft_model != "cut":
        log(f"report: no draft model at {cfg.draft_model}; measuring the undistilled cut of the target instead")
    return cut_target(target, layers), "not distilled"


DRAFT_MODEL = "draft model"
"""The small draft-model baseline's name in rows (its setting follows in brackets)."""

SizedChain = tuple[str, Callable[[int], Proposer], ChainSizing]
"""A chain sized on this machine: the proposer's name, how to build it at a length, and its sizing."""


@dataclass
class ReportPlan:
    """What a report measures, decided before any timed run: the targets read and made ready once, the prompts,
    every candidate (the drafters' settings, the sized chains' neighbours, the batch-aware row), HF's assisted peers,
    the grid, and the sizings the report's checks compare with the measured rows."""

    method: str
    """The measured drafter's family (the report's title)."""
    measurement: MeasurePlan
    """The served target, vanilla's target (or None), prompts, stop ids, candidates, HF peers, temperatures, batch
    sizes, max_new_tokens, repeats, the fp32-certificate flag and the drafters' dtype: `eval.measure.measure_plan`."""
    prompt_set: str
    """The prompt set in words."""
    measured: list[Candidate]
    """The drafters' own settings (the sized chains' owners among them)."""
    chains: list[SizedChain] = field(default_factory=list)
    tree_sizing: TreeSizing | None = None
    batch_sizing: BatchSizing | None = None


def plan_report(
    target: TargetModel,
    drafter: torch.nn.Module,
    tokenizer,
    cfg: ReportConfig,
    drafter_dir: str | Path,
    eval_set: Sequence[dict] | None = None,
    log: Callable[[str], None] = print,
    families: tuple[DrafterFamily, ...] = FAMILIES,
) -> ReportPlan:
    """Read the checkpoint's held-out acceptance and the serving choice, build the prompts, make the targets ready
    (`ready_targets`, before sizing: the cost curve must see what the measurement will run), size the tree and the
    chains on this machine, and gather the candidates (`run_report` documents the arguments)."""
    method = family_of(drafter, families).method  # before any compute: an undeclared drafter class fails here
    prior, _ = heldout_acceptance(drafter_dir)
    target, vanilla_target = serving_targets(target, prior, log)
    prompts, prompt_set = report_prompts(cfg, tokenizer, target, eval_set)
    if not prompts:
        raise ValueError(f"report: the prompt set ({prompt_set}) gave no prompts")
    drafters = [drafter.to(target.device).eval()]
    drafters += [load_drafter(path, target, tokenizer, families).eval() for path in cfg.compare]
    log(
        f"report: {len(prompts)} prompts ({prompt_set}), up to {cfg.max_new_tokens} new tokens (stop at EOS), "
        f"T {cfg.temperatures}, bs {cfg.batch_sizes}"
    )
    eos = stop_ids(tokenizer, target.model)
    ids = [p.ids for p in prompts]
    ready_targets(target, vanilla_target, ids, cfg.batch_sizes, cfg.max_new_tokens, log)
    tree_sizing, make_tree, unsized = None, None, cfg
    if cfg.chain_from_cost_curve and cfg.tree_total_tokens:
        cfg, tree_sizing, make_tree = _sized_tree(target, drafters, cfg, ids, eos, log, vanilla_target, families)
    chains: list[SizedChain] = []

    def sizer(folder: str | Path | None, proposer: str, temperature: float = 0.0, into=chains) -> ChainSizer:
        # the checkpoint's held-out acceptance is a greedy figure: a prior for greedy pilots only
        prior, samples = heldout_acceptance(folder) if folder is not None and temperature == 0.0 else (None, 0)

        def size(make: Callable[[int], Proposer], longest: int) -> int:
            sized = size_chain(
                target, make, ids, longest, eos, log, prior, samples, baseline=vanilla_target, temperature=temperature
            )
            into.append((proposer, make, sized))
            return sized.k

        return size

    folders = [drafter_dir, *cfg.compare, None]  # the last sizes the draft model: no checkpoint prior
    names = [family_of(d, families).method for d in drafters] + ["draft model"]
    datastore = None
    if cfg.datastore:
        datastore = Datastore.from_conversations(
            cfg.datastore,
            tokenizer,
            num_draft=cfg.datastore_draft,
            min_ngram=cfg.datastore_match,
            max_ngram=DATASTORE_MAX_NGRAM,
        )
        log(f"report: datastore of {len(datastore):,} answer tokens from {len(cfg.datastore)} folder(s)")
    sizers = [sizer(f, n) for f, n in zip(folders, names)]
    measured = candidates(drafters, cfg, sizers, target, log, families, datastore, tree_sizing)
    only_at: dict[str, frozenset[float]] = {}
    if cfg.chain_from_cost_curve and any(t != 0.0 for t in cfg.temperatures):
        # every other temperature sizes its own chains and tree: a setting chosen at one temperature and not at
        # another runs only where it was chosen (the neighbours, the grid and the batch sweep stay T = 0's)
        by_temperature = {0.0: measured}
        # a draft model measured greedily only (`draft_model_sampled` off) is neither loaded nor sized again
        above_zero = unsized if cfg.draft_model_sampled else dataclasses.replace(unsized, draft_model=None)
        for temp in (t for t in cfg.temperatures if t != 0.0):
            sized_cfg, sized_tree = above_zero, None
            if above_zero.tree_total_tokens:
                sized_cfg, sized_tree, _ = _sized_tree(
                    target, drafters, above_zero, ids, eos, log, vanilla_target, families, temp
                )
            at_t = [sizer(f, n, temp, []) for f, n in zip(folders, names)]
            by_temperature[temp] = candidates(drafters, sized_cfg, at_t, target, log, families, datastore, sized_tree)
        measured, only_at = _per_temperature(by_temperature, cfg.temperatures)
    neighbours = _chain_neighbours(measured, chains) if cfg.chain_neighbours else []
    if cfg.tree_grid and tree_sizing is not None:
        neighbours += _tree_grid(measured, tree_sizing, make_tree)
    batch_sizing, auto = _batch_auto(cfg, measured, chains, target, vanilla_target, ids, eos, log)
    hf_assisted = _hf_peers(cfg, target, log)
    everything = _unique(measured, neighbours + auto, only_at)
    measurement = MeasurePlan(
        target,
        everything,
        prompts,
        eos,
        temperatures=tuple(cfg.temperatures),
        max_new_tokens=cfg.max_new_tokens,
        batch_sizes=tuple(cfg.batch_sizes),
        hf_assisted=hf_assisted,
        fp32_certificate=cfg.fp32_certificate,
        vanilla_target=vanilla_target,
        drafter_dtype=_dtype_of(drafters[0]),
        batch_repeats=cfg.batch_repeats,
        greedy_only=frozenset() if cfg.draft_model_sampled else _draft_model_methods(measured, hf_assisted),
        only_at=only_at,
    )
    return ReportPlan(method, measurement, prompt_set, measured, chains, tree_sizing, batch_sizing)


def run_report(
    target: TargetModel,
    drafter: torch.nn.Module,
    tokenizer,
    cfg: ReportConfig,
    out_dir: str | Path,
    eval_set: Sequence[dict] | None = None,
    notes: str = "",
    log: Callable[[str], None] = print,
    drafter_dir: str | Path | None = None,
    families: tuple[DrafterFamily, ...] = FAMILIES,
) -> list[dict]:
    """Measure ``drafter`` (of any family in ``families``) and ``cfg.compare`` and write report.json / report.md
    into ``out_dir``; returns the result rows. ``eval_set``: tokenised samples (``input_ids``, ``loss_mask``) for
    ``prompt_source=eval_data``. ``drafter_dir``: the drafter's checkpoint folder (default ``out_dir``), whose
    held-out acceptance anchors the chain sizing. Plan (`plan_report`), measure (`eval.measure.measure_plan`), then
    the checks and the files."""
    started = time.perf_counter()  # wall time of the phases, for the log: where a report's minutes go
    plan = plan_report(target, drafter, tokenizer, cfg, drafter_dir or out_dir, eval_set, log, families)
    planned = time.perf_counter()
    log(f"report: planned (prompts, serving targets, sizing) in {(planned - started) / 60:.1f} min")
    rows = measure_plan(plan.measurement, log)
    log(f"report: measured in {(time.perf_counter() - planned) / 60:.1f} min")
    checks = report_checks(plan, rows, log)
    served = plan.measurement.target
    write_report(
        out_dir,
        plan.method,
        str(served.name_or_path),
        rows,
        prompt_set=plan.prompt_set,
        notes=notes.strip(),
        checks=checks,
        precision=served.precision.as_dict(),
    )
    log(f"report written to {out_dir}/report.md")
    return rows


def _batch_auto(
    cfg: ReportConfig,
    measured: list[Candidate],
    chains: list[SizedChain],
    target: TargetModel,
    vanilla_target: TargetModel | None,
    ids: list[list[int]],
    eos: tuple[int, ...],
    log: Callable[[str], None],
) -> tuple[BatchSizing | None, list[Candidate]]:
    """The batch-aware row (``report.batch_auto``): the first drafter's sized chain with its length chosen per batch
    size (`size_batch_policy`), and that sizing; (None, []) where the report measures no batch above 1 or sized no
    chain."""
    if not (cfg.batch_auto and any(b > 1 for b in cfg.batch_sizes) and chains):
        return None, []
    name, make, sized = chains[0]  # the first drafter's chain
    owner = _owner(measured, name, sized.k)
    if owner is None:
        return None, []
    sizes = tuple(sorted({1, *cfg.batch_sizes}))
    sizing = size_batch_policy(target, make, ids, sized.alpha, max(sized.rates), sizes, eos, log, vanilla_target)
    policy = sizing.policy
    # a batch the policy leaves off decodes with the faster vanilla there (a bf16 copy at batch 1 on CPUs whose bf16
    # gemv is faster while fp32 verifies a tree for less)
    off = {b: vanilla_target if f else None for b, f in sizing.baseline_faster.items()}
    auto = Candidate(
        owner.proposer,
        f"auto ({policy.words()})",
        lambda make=make, policy=policy, off=off: BatchAwareProposer(make, policy, off),
        owner.spec,
    )
    return sizing, [auto]


def _draft_model_methods(measured: list[Candidate], hf_assisted: dict[str, dict]) -> frozenset[str]:
    """The draft-model baseline's candidates and HF's assisted generation with it (`ReportConfig.draft_model_sampled`)."""
    ours = {c.key for c in measured if c.proposer.startswith(DRAFT_MODEL)}
    return frozenset(ours | {name for name, kw in hf_assisted.items() if "assistant_model" in kw})


def _hf_peers(cfg: ReportConfig, target: TargetModel, log: Callable[[str], None]) -> dict[str, dict]:
    """HF's own assisted generation (``report.hf_assisted``): name → extra ``generate`` kwargs."""
    assisted: dict[str, dict] = {}
    if cfg.hf_assisted:
        assisted["HF prompt lookup (10)"] = dict(prompt_lookup_num_tokens=10, max_matching_ngram_size=2)
        draft, how = baseline_draft_model(cfg, target, log)
        if draft is not None and cfg.hf_assisted_draft_model:
            assisted[f"HF assisted (draft model, {how})"] = dict(assistant_model=draft.to(target.device).eval())
    return assisted


def report_checks(plan: ReportPlan, rows: list[dict], log: Callable[[str], None] = print) -> dict:
    """The report's checks beside the rows: each sizing's prediction against the measured speedup, the batch policy,
    and the vanilla check (our batch-1 loop against its bare forward)."""
    checks = {}
    if plan.chains:
        checks["sizing"] = _sizing_check(rows, plan.measured, plan.chains)
    sized = plan.tree_sizing
    if sized is not None:
        found = _tree_owner(plan.measured, sized)
        owner = found.proposer if found is not None else None
        checks["tree_sizing"] = {
            "setting": tree_name(sized.tree),
            "pilot_tau": sized.tau,
            "predicted_speedup": {n: sized.predicted_speedup(n) for n in sized.rates},
            "predicted_speedup_by_pilot_prompt": {
                n: [r * sized.vanilla_step_s for r in rates] for n, rates in sized.per_prompt.items()
            },
            "measured_speedup": {
                r["setting"]: r["speedup"]
                for r in rows
                if r["proposer"] == owner
                and r["setting"] in sized.rates
                and r["temperature"] == 0.0
                and r["batch_size"] == 1
                and r["category"] == "all"
            },
            "verify_ms": {n: 1e3 * t for n, t in sized.verify_s.items()},
            "draft_and_bookkeeping_ms": {n: [1e3 * d, 1e3 * b] for n, (d, b) in sized.round_s.items()},
            "vanilla_step_ms": 1e3 * sized.vanilla_step_s,
            "summary": f"{sized.account()}; verify ms "
            + " ".join(f"{n}:{1e3 * t:.0f}" for n, t in sized.verify_s.items())
            + ".",
        }
    if plan.batch_sizing is not None:
        checks["batch_policy"] = {
            "policy": {str(b): k for b, k in plan.batch_sizing.policy.lengths.items()},
            "by_batch": {str(b): m for b, m in plan.batch_sizing.by_batch.items()},
            "summary": plan.batch_sizing.account() + ".",
        }
    first = next((r for r in rows if r["temperature"] == 0.0 and r["batch_size"] == 1 and r["category"] == "all"), None)
    if first is not None:
        m = plan.measurement
        checks["vanilla_check"] = vanilla_check(m.target, [p.ids for p in m.prompts], first)
        log(f"vanilla check: {checks['vanilla_check']['summary']}")
    return checks


def _per_temperature(
    by_temperature: dict[float, list[Candidate]], temperatures: Sequence[float]
) -> tuple[list[Candidate], dict[str, frozenset[float]]]:
    """The candidates of every temperature's sizing as one list (T = 0's first, each key once: a setting chosen at
    several temperatures is measured at each) and the keys not measured at every temperature of the report, with
    those they run at (`MeasurePlan.only_at`)."""
    merged: dict[str, Candidate] = {}
    runs_at: dict[str, set[float]] = {}
    for temp, cands in by_temperature.items():
        for c in cands:
            merged.setdefault(c.key, c)
            runs_at.setdefault(c.key, set()).add(temp)
    every = set(temperatures)
    return list(merged.values()), {k: frozenset(t) for k, t in runs_at.items() if not every <= t}


def _unique(measured: list[Candidate], extra: list[Candidate], only_at: dict[str, frozenset[float]]) -> list[Candidate]:
    """``measured`` and the ``extra`` candidates (neighbours, grid, batch-aware row; measured at every temperature)
    with each key once: an extra that some temperature's sizing also chose is measured at every temperature, its
    restriction in ``only_at`` lifted (two candidates of one key would add to one tally)."""
    keys = {c.key for c in measured}
    for c in extra:
        only_at.pop(c.key, None)
    return measured + [c for c in extra if c.key not in keys]


def _dtype_of(module: torch.nn.Module) -> str:
    """The dtype of a drafter's weights (the first floating-point parameter)."""
    first = next((p for p in module.parameters() if p.is_floating_point()), None)
    return "float32" if first is None else str(first.dtype).removeprefix("torch.")


def _sized_tree(
    target,
    drafters,
    cfg: ReportConfig,
    ids,
    eos,
    log,
    baseline: TargetModel | None = None,
    families=FAMILIES,
    temperature: float = 0.0,
) -> tuple[ReportConfig, TreeSizing | None, Callable[[DynamicTreeConfig], Proposer] | None]:
    """``cfg`` with the EAGLE-2 tree chosen on this machine (`size_tree`, its pilot at ``temperature``) from the first
    drafter whose family measures the report's dynamic tree, how it was chosen, and the maker of that drafter's
    proposer for any setting; unchanged and None when none does (their trees are their own: static, top-k)."""
    for drafter in drafters:
        fam = family_of(drafter, families)

        def make(tree: DynamicTreeConfig, fam=fam, drafter=drafter) -> Proposer:
            settings = dataclasses.replace(
                cfg, chain_k=0, tree_top_k=tree.top_k, tree_depth=tree.depth, tree_total_tokens=tree.total_tokens
            )
            chosen = [
                s for s in fam.report_proposers(drafter, settings, lambda m, k: k) if s.setting == tree_name(tree)
            ]
            return chosen[0].make()

        probe = dataclasses.replace(cfg, chain_k=0)
        if any(s.setting == cfg.tree_name for s in fam.report_proposers(drafter, probe, lambda m, k: k)):
            sized = size_tree(target, make, ids, eos, log=log, baseline=baseline, temperature=temperature)
            tree = sized.tree
            chosen = dataclasses.replace(
                cfg, tree_top_k=tree.top_k, tree_depth=tree.depth, tree_total_tokens=tree.total_tokens
            )
            return chosen, sized, make
    return cfg, None, None


def _tree_grid(
    measured: list[Candidate], sized: TreeSizing, make: Callable[[DynamicTreeConfig], Proposer]
) -> list[Candidate]:
    """Every setting of the sized grid but the chosen one, on the chosen one's proposer, so that the report shows
    each setting's measured speedup beside its prediction."""
    owner = _tree_owner(measured, sized)
    if owner is None:
        return []
    grid = [g for g in sized.grid if g != sized.tree]
    return [Candidate(owner.proposer, tree_name(g), lambda g=g: make(g), owner.spec) for g in grid]


def _tree_owner(measured: list[Candidate], sized: TreeSizing) -> Candidate | None:
    """The candidate whose tree was sized: the first drafter measuring the chosen setting (drafters come first)."""
    return next((c for c in measured if c.setting == tree_name(sized.tree)), None)


def _owner(measured: list[Candidate], name: str, k: int) -> Candidate | None:
    """The candidate a sizing chose: proposer ``name`` (the draft model's carries its layers in brackets), chain k."""
    return next((c for c in measured if c.proposer.startswith(name) and c.setting == f"chain {k}"), None)


def _chain_neighbours(measured: list[Candidate], chains) -> list[Candidate]:
    """The chain lengths next to each sized one (k - 1, k + 1 within the sized range), so that the report shows
    measured beside predicted speedup around the choice."""
    out = []
    for name, make, sized in chains:
        owner = _owner(measured, name, sized.k)
        if owner is None:
            continue
        for n in (sized.k - 1, sized.k + 1):
            if n in sized.rates and not any(c.proposer == owner.proposer and c.setting == f"chain {n}" for c in out):
                out.append(Candidate(owner.proposer, f"chain {n}", lambda make=make, n=n: make(n), owner.spec))
    return out


def _sizing_check(rows: list[dict], measured: list[Candidate], chains) -> dict:
    """Predicted (from the pilot and the verify curve) and measured speedup of each sized chain and its neighbours
    (T = 0, bs 1, all prompts), and the chosen setting's relative error."""
    table, words = [], []
    for name, _, sized in chains:
        owner = _owner(measured, name, sized.k)
        if owner is None:
            continue
        for n in sorted(sized.rates):
            row = next(
                (
                    r
                    for r in rows
                    if r["proposer"] == owner.proposer
                    and r["setting"] == f"chain {n}"
                    and r["temperature"] == 0.0
                    and r["batch_size"] == 1
                    and r["category"] == "all"
                ),
                None,
            )
            if row is None:
                continue
            entry = {
                "proposer": owner.proposer,
                "setting": f"chain {n}",
                "chosen": n == sized.k,
                "predicted_speedup": sized.predicted_speedup(n),
                "measured_speedup": row["speedup"],
                "verify_ms": {m: 1e3 * t for m, t in sized.verify_s.items()},
                "vanilla_step_ms": 1e3 * sized.vanilla_step_s,
                "account": sized.account(),
            }
            table.append(entry)
            words.append(
                f"{owner.proposer} chain {n}{' (chosen)' if n == sized.k else ''}: predicted "
                f"{entry['predicted_speedup']:.2f}x, measured {entry['measured_speedup']:.2f}x"
            )
    chosen = [e for e in table if e["chosen"]]
    errors = [abs(e["predicted_speedup"] / e["measured_speedup"] - 1) for e in chosen if e["measured_speedup"]]
    summary = "; ".join(words) + (f". Chosen settings' prediction error: {max(errors):.0%} at most" if errors else "")
    return {"chains": table, "summary": summary + "."}


def report_main(
    argv: list[str],
    recipe_cls: type | None = None,
    eval_set: Callable[[Any, Any], Sequence[dict] | None] | None = None,
) -> None:
    """``--drafter DIR [--config FILE] [overrides]``: measure any checkpoint (any family) with the verify runtime.

    ``--config`` reads a `ReportOnlyConfig` file, or (from a recipe entry point, ``recipe_cls`` given) a recipe of
    ``recipe_cls``: its target and report sections, and its ``train.output_dir`` as the default checkpoint.
    ``eval_set(recipe, tokenizer)``: that recipe's eval_data samples for ``prompt_source=eval_data``, built by the
    entry point (data building lives in train/) and only when that source is measured."""
    args, drafter_dir = list(argv), None
    if "--drafter" in args:
        i = args.index("--drafter")
        drafter_dir, args = args[i + 1], args[:i] + args[i + 2 :]
    recipe = recipe_cls is not None and any(a == "--config" or a.startswith("--config=") for a in args)
    cfg = parse_cli(recipe_cls if recipe else ReportOnlyConfig, args)
    drafter_dir = drafter_dir or cfg.report.drafter_dir or (cfg.train.output_dir if recipe else None)
    if drafter_dir is None:
        raise SystemExit("report mode needs --drafter DIR (or --config with train.output_dir / report.drafter_dir)")
    _, info = read_checkpoint(drafter_dir)
    target_cfg = cfg.target or TargetConfig(name_or_path=info.target_name)  # dtype "fastest": the policy's
    if target_cfg.aux_layer_ids is None and info.aux_layer_ids:
        target_cfg.aux_layer_ids = info.aux_layer_ids
    tokenizer = load_tokenizer(target_cfg.name_or_path)
    # with the changes of a jointly trained target applied; dtype chosen for serving, with the drafter's acceptance
    target = load_target(drafter_dir, target_cfg, prepare=quiet_routing, acceptance=info.heldout_acceptance or None)
    drafter = load_drafter(drafter_dir, target, tokenizer)
    rc = cfg.report
    wants_samples = recipe and eval_set is not None and rc.prompt_source == "eval_data" and not rc.prompts_path
    samples = eval_set(cfg, tokenizer) if wants_samples else None
    out = rc.output_dir or drafter_dir
    run_report(target, drafter, tokenizer, rc, out, samples, notes=joint_notes(drafter_dir), drafter_dir=drafter_dir)


def quality_note(before: dict, after: dict) -> str:
    """The report's sentence on a jointly trained target's quality guard (both dicts from train.joint.quality:
    ``eval/lm_loss``, ``eval/agreement``), so the target's change stands next to τ."""
    return (
        f"Target quality on held-out answers, before → after joint training: LM loss {before['eval/lm_loss']:.4f}"
        f" → {after['eval/lm_loss']:.4f}, top-1 agreement with the original {before['eval/agreement']:.4f}"
        f" → {after['eval/agreement']:.4f}."
    )


def joint_notes(drafter_dir: str | Path) -> str:
    """The quality-guard sentence of a jointly trained checkpoint, from the training log in its folder (empty when
    there is none), so a report re-measured later still states the target's change next to τ."""
    log = Path(drafter_dir) / "train_log.jsonl"
    if not log.exists():
        return ""
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    before = next((r for r in rows if "before/lm_loss" in r), None)
    after = next((r for r in reversed(rows) if "eval/lm_loss" in r), None)
    if before is None or after is None:
        return ""
    return quality_note({f"eval/{k.split('/')[1]}": v for k, v in before.items() if "/" in k}, after)


if __name__ == "__main__":
    report_main(sys.argv[1:])
