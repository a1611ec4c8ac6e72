"""The verify-runtime report of any drafter (end of every recipe, or on demand for any checkpoint).

Measures, on held-out prompts (``eval.prompts``; every answer stops at the target's EOS) and in one process with
interleaved runs (``eval.measure``): vanilla decoding, HF ``generate``, prompt lookup, the drafter (EAGLE-3: a chain
and an EAGLE-2 dynamic tree; Medusa: a chain of its heads' top-1 and the static tree stored with it; MTP:
the chain of its modules, reuse past D and a per-depth top-k tree), the drafters
named in ``compare`` the same way, and (when given) a small draft model with the chain and tree settings; writes
``report.json`` + ``report.md`` with rows for all prompts and for each category.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eval.cost_curve import size_chain
from eval.measure import Candidate, MeasuredPrompt, measure, prepare_target, stop_ids, write_report
from eval.prompts import CATEGORIES, builtin_prompts, encode_turns, load_prompt_file
from infer.eagle3_proposer import Eagle3Proposer
from infer.generate import SpecConfig, generate_vanilla
from infer.medusa_proposer import MedusaProposer
from infer.mtp_proposer import MTPProposer
from infer.proposers import DraftModelProposer
from infer.sampling import SamplingParams
from infer.tree_search import DynamicTreeConfig
from models.checkpoint import read_checkpoint
from models.config import parse_cli
from models.eagle3 import Eagle3Drafter
from models.loader import load_drafter, load_target
from models.medusa import MedusaDrafter
from models.mtp import MTPDrafter
from models.target import TargetConfig, TargetModel, load_tokenizer
from train.data import build_dataset
from train.joint import quality_note

Drafter = Eagle3Drafter | MedusaDrafter | MTPDrafter

PROMPT_SOURCES = ("builtin", "stdlib", "eval_data")


@dataclass
class ReportConfig:
    """What the closing report measures."""

    enabled: bool = True
    """Run the report at the end of training (the ``report`` mode runs it regardless)."""
    prompt_source: str = "builtin"
    """"builtin": the categories below (eval/prompts.py; needs a chat template); "stdlib": held-out files of the
    standard-library corpus continued as raw text (targets without a chat template); "eval_data": the eval_data
    samples, each cut before its first loss token. ``prompts_path`` overrides all three."""
    prompts_path: str | None = None
    """A jsonl of Spec-Bench ({question_id, category, turns}) or HumanEval ({task_id, prompt}) rows to measure
    instead (every turn of a multi-turn question is one measured prompt, after the target's own earlier answers)."""
    categories: list[str] = field(default_factory=lambda: ["chat", "code"])
    """Built-in categories for prompt_source "builtin": chat, code (HumanEval), copy, long."""
    prompts: int = 16
    """Prompts per category (builtin) or in all (other sources; a file: its first N rows)."""
    prompt_tokens: int = 64
    """eval_data prompts of raw text (loss on every token): the first prompt_tokens tokens of each sample."""
    max_new_tokens: int = 128
    """Cap on tokens per answer; answers stop earlier at the target's EOS."""
    chain_k: int = 5
    """Drafts per round of the chain setting (0 leaves the chain out); the longest chain tried when
    chain_from_cost_curve is on. MTP: its D modules always make a chain; chain_k > D adds a row that reuses the
    last module for depths D+1 … chain_k."""
    chain_from_cost_curve: bool = True
    """Pick each chain's length (1..chain_k) on the machine that runs the report, from a pilot run's acceptance and
    step costs and the verify-cost curve measured there (eval.cost_curve.size_chain); off: exactly chain_k."""
    tree_top_k: int = 4
    """EAGLE-2 dynamic tree: children per node and frontier width (EAGLE-2 default 10; ≤ 16-node trees on a CPU)."""
    tree_depth: int = 5
    """EAGLE-2 dynamic tree depth."""
    tree_total_tokens: int = 16
    """Tree nodes per verify forward, root included (0 leaves the tree out)."""
    mtp_top_k: int = 2
    """MTP drafters' tree: the chain plus the next top_k - 1 candidates of every depth as leaves (1 + D·top_k
    nodes); 1 leaves it out."""
    draft_model: str | None = None
    """Small draft model (HF causal LM sharing the tokenizer) measured beside the drafter; missing path: skipped."""
    typical_acceptance: bool = False
    """Also measure each Medusa drafter's chain with Medusa's typical acceptance (lossy: such rows are labelled
    "(lossy)" and have no identity check)."""
    compare: list[str] = field(default_factory=list)
    """Other drafter checkpoints (any method) measured in the same run, e.g. the shipped EAGLE-3 beside Medusa."""
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    """Batch sizes to measure."""
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    """Sampling temperatures to measure (0 = greedy, with the token-identity check)."""
    drafter_dir: str | None = None
    """``report`` mode without --drafter: checkpoint to measure (default: train.output_dir of the --config recipe)."""
    output_dir: str | None = None
    """``report`` mode: where report.json / report.md go (default: the drafter's folder)."""

    def __post_init__(self) -> None:
        if self.prompt_source not in PROMPT_SOURCES:
            raise ValueError(f"prompt_source must be one of {PROMPT_SOURCES}, got {self.prompt_source!r}")
        if any(c not in CATEGORIES for c in self.categories) or not self.categories:
            raise ValueError(f"categories must be a non-empty list of {CATEGORIES}, got {self.categories}")
        if self.prompts < 1 or self.max_new_tokens < 1 or self.prompt_tokens < 1:
            raise ValueError("prompts, prompt_tokens and max_new_tokens must be >= 1")
        if self.chain_k < 0 or self.tree_total_tokens < 0 or (self.tree_total_tokens and self.tree_total_tokens < 2):
            raise ValueError("chain_k must be >= 0 and tree_total_tokens 0 or >= 2")
        if self.chain_k == 0 and self.tree_total_tokens == 0:
            raise ValueError("the report needs a chain (chain_k > 0) or a tree (tree_total_tokens > 0)")
        if self.mtp_top_k < 1:
            raise ValueError("mtp_top_k must be >= 1")
        if any(b < 1 for b in self.batch_sizes) or any(t < 0 for t in self.temperatures):
            raise ValueError("batch sizes must be >= 1 and temperatures >= 0")

    @property
    def tree(self) -> DynamicTreeConfig:
        return DynamicTreeConfig(top_k=self.tree_top_k, depth=self.tree_depth, total_tokens=self.tree_total_tokens)

    @property
    def tree_name(self) -> str:
        return f"EAGLE-2 k{self.tree_top_k} d{self.tree_depth} n{self.tree_total_tokens}"


def report_prompts(
    cfg: ReportConfig, tokenizer, target: TargetModel, eval_set=None
) -> tuple[list[MeasuredPrompt], str]:
    """The measured prompts (token ids + category) and a one-line description of the prompt set."""
    if cfg.prompts_path or cfg.prompt_source == "builtin":
        if cfg.prompts_path:
            chosen, name = load_prompt_file(cfg.prompts_path, cfg.prompts), f"file {cfg.prompts_path}"
        else:
            chosen = [p for c in cfg.categories for p in builtin_prompts(c, cfg.prompts)]
            name = "built-in " + ", ".join(f"{c} ({sum(p.category == c for p in chosen)})" for c in cfg.categories)
        if not tokenizer.chat_template:
            raise ValueError("chat prompts need a tokenizer with a chat template; use report.prompt_source=stdlib")
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens)
        eos = stop_ids(tokenizer, target.model)
        turns = encode_turns(chosen, tokenizer, lambda ids: generate_vanilla(target, [ids], params, eos).tokens[0])
        return [MeasuredPrompt(ids, p.category) for p, _, ids in turns], name
    if cfg.prompt_source == "stdlib":
        from eval.stdlib_corpus import heldout_prompts

        ids = [p["prompt_ids"] for p in heldout_prompts(tokenizer, n=cfg.prompts)]
        return [MeasuredPrompt(i, "stdlib") for i in ids], "held-out standard-library files (raw text)"
    if eval_set is None:
        raise ValueError("report.prompt_source='eval_data' needs an eval_data section")
    prompts = []
    for sample in eval_set:
        first = next((i for i, m in enumerate(sample["loss_mask"]) if m), 0)
        # chat: everything before the first assistant token; raw text (every token a target): a fixed-length head
        cut = first if first > 1 else cfg.prompt_tokens
        if len(sample["input_ids"]) > cut:
            prompts.append(MeasuredPrompt(list(sample["input_ids"][:cut]), "eval_data"))
        if len(prompts) == cfg.prompts:
            break
    return prompts, "eval_data samples cut before their first loss token"


def method_of(drafter: Drafter) -> str:
    if isinstance(drafter, Eagle3Drafter):
        return "eagle3"
    return "mtp" if isinstance(drafter, MTPDrafter) else "medusa"


def candidates(
    drafters: list[Drafter], cfg: ReportConfig, size=None, log: Callable[[str], None] = print
) -> list[Candidate]:
    """The report's proposers for each drafter (and the draft model); ``size(make) -> k`` picks a chain length
    (None: chain_k, or a Medusa drafter's number of heads when fewer)."""
    out = []

    def chain_k(make, longest: int) -> int:
        return size(make, longest) if size is not None and cfg.chain_from_cost_curve else longest

    for drafter in drafters:
        if isinstance(drafter, Eagle3Drafter):
            if cfg.chain_k:
                k = chain_k(lambda n, d=drafter: Eagle3Proposer(d, k=n), cfg.chain_k)
                out.append(Candidate("eagle3", f"chain {k}", lambda d=drafter, k=k: Eagle3Proposer(d, k=k)))
            if cfg.tree_total_tokens:
                out.append(Candidate("eagle3", cfg.tree_name, lambda d=drafter: Eagle3Proposer(d, tree=cfg.tree)))
            continue
        if isinstance(drafter, MTPDrafter):  # self-speculation: the D modules' chain, reuse past D, top-k tree
            D = drafter.config.num_modules
            out.append(Candidate("mtp", f"chain {D}", lambda d=drafter: MTPProposer(d)))
            if cfg.chain_k > D:  # acceptance decays with reuse, so it is a row of its own
                name = f"chain {cfg.chain_k} (module {D} reused)"
                out.append(Candidate("mtp", name, lambda d=drafter: MTPProposer(d, k=cfg.chain_k)))
            if cfg.mtp_top_k > 1:
                name = f"top-{cfg.mtp_top_k} tree n{1 + D * cfg.mtp_top_k}"
                out.append(Candidate("mtp", name, lambda d=drafter: MTPProposer(d, top_k=cfg.mtp_top_k)))
            continue
        heads = drafter.config.num_heads
        if cfg.chain_k:
            k = chain_k(lambda n, d=drafter: MedusaProposer(d, k=n), min(cfg.chain_k, heads))
            out.append(Candidate("medusa", f"chain {k}", lambda d=drafter, k=k: MedusaProposer(d, k=k)))
            if cfg.typical_acceptance:
                typical = SpecConfig(accept="typical")
                make = lambda d=drafter, k=k: MedusaProposer(d, k=k)  # noqa: E731
                out.append(Candidate("medusa", f"chain {k}, typical acceptance", make, typical))
        paths = [tuple(p) for p in drafter.config.tree_paths]
        if paths:
            name = f"static tree n{len(paths) + 1}"
            out.append(Candidate("medusa", name, lambda d=drafter, p=paths: MedusaProposer(d, paths=p)))
    if cfg.draft_model:
        if not (Path(cfg.draft_model) / "config.json").exists():
            log(f"report: no draft model at {cfg.draft_model}; its rows are left out")
            return out
        from transformers import AutoModelForCausalLM

        device = next(drafters[0].parameters()).device
        draft = AutoModelForCausalLM.from_pretrained(cfg.draft_model, dtype=torch.float32).to(device)
        if cfg.chain_k:
            dk = chain_k(lambda n: DraftModelProposer(draft, k=n), cfg.chain_k)
            out.append(Candidate("draft model", f"chain {dk}", lambda: DraftModelProposer(draft, k=dk)))
        if cfg.tree_total_tokens:
            out.append(Candidate("draft model", cfg.tree_name, lambda: DraftModelProposer(draft, tree=cfg.tree)))
    return out


def run_report(
    target: TargetModel,
    drafter: Drafter,
    tokenizer,
    cfg: ReportConfig,
    out_dir: str | Path,
    eval_set=None,
    notes: str = "",
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Measure ``drafter`` (and ``cfg.compare``) and write report.json / report.md into ``out_dir``; returns the
    result rows."""
    prompts, prompt_set = report_prompts(cfg, tokenizer, target, eval_set)
    if not prompts:
        raise ValueError(f"report: the prompt set ({prompt_set}) gave no prompts")
    drafters = [drafter.to(target.device).eval()]
    drafters += [load_drafter(path, target, tokenizer).eval() for path in cfg.compare]
    log(
        f"report: {len(prompts)} prompts ({prompt_set}), up to {cfg.max_new_tokens} new tokens (stop at EOS), "
        f"T {cfg.temperatures}, bs {cfg.batch_sizes}"
    )
    eos = stop_ids(tokenizer, target.model)
    prepare_target(target, log)  # before sizing: the cost curve must see the kernels the measurement uses
    sizing = []

    def size(make, longest: int) -> int:
        sized = size_chain(target, make, [p.ids for p in prompts], longest, eos, log)
        sizing.append(sized.account())
        return sized.k

    rows = measure(
        target,
        candidates(drafters, cfg, size, log),
        prompts,
        eos,
        temperatures=tuple(cfg.temperatures),
        max_new_tokens=cfg.max_new_tokens,
        batch_sizes=tuple(cfg.batch_sizes),
        log=log,
    )
    if sizing:
        notes = f"{notes} Chains sized on this machine: " + "; ".join(sizing) + "."
    method = method_of(drafter)
    write_report(out_dir, method, str(target.name_or_path), rows, prompt_set=prompt_set, notes=notes.strip())
    log(f"report written to {out_dir}/report.md")
    return rows


@dataclass
class ReportOnlyConfig:
    target: TargetConfig | None = None
    """Target to measure against (None: the checkpoint's target_name and aux ids)."""
    report: ReportConfig = field(default_factory=ReportConfig)


def report_main(argv: list[str], recipe_cls: type) -> None:
    """``report --drafter DIR [--config FILE] [overrides]``: measure any checkpoint (any method) with the verify
    runtime. ``--config`` reads a recipe of ``recipe_cls`` (its target, eval_data and report sections)."""
    args, drafter_dir = list(argv), None
    if "--drafter" in args:
        i = args.index("--drafter")
        drafter_dir, args = args[i + 1], args[:i] + args[i + 2 :]
    recipe = any(a == "--config" or a.startswith("--config=") for a in args)
    cfg = parse_cli(recipe_cls if recipe else ReportOnlyConfig, args)
    drafter_dir = drafter_dir or cfg.report.drafter_dir or (cfg.train.output_dir if recipe else None)
    if drafter_dir is None:
        raise SystemExit("report mode needs --drafter DIR (or --config with train.output_dir / report.drafter_dir)")
    _, info = read_checkpoint(drafter_dir)
    target_cfg = cfg.target or TargetConfig(name_or_path=info.target_name)
    if target_cfg.aux_layer_ids is None and info.aux_layer_ids:
        target_cfg.aux_layer_ids = info.aux_layer_ids
    tokenizer = load_tokenizer(target_cfg.name_or_path)
    target = load_target(drafter_dir, target_cfg)  # with the changes of a jointly trained target applied
    drafter = load_drafter(drafter_dir, target, tokenizer)
    eval_set = build_dataset(cfg.eval_data, tokenizer)[0] if recipe and cfg.eval_data is not None else None
    notes = joint_notes(drafter_dir)
    run_report(target, drafter, tokenizer, cfg.report, cfg.report.output_dir or drafter_dir, eval_set, notes=notes)


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
