"""The report's settings (`ReportConfig`, and `ReportOnlyConfig` for ``drafters report`` without a recipe) and the
prompt set they select (`report_prompts`). `eval.report` measures what they say.

``ReportConfig`` inherits each shipped family's own report settings (``DrafterFamily.report_options``, listed in
``infer.families``), so a recipe sets them under ``report:`` beside the generic ones and this module never names a
family. It imports nothing of train/: a recipe's ``eval_data`` samples are passed in (DESIGN.md §2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from eval.measure import MeasuredPrompt
from eval.prompts import CATEGORIES, builtin_prompts, encode_turns, load_prompt_file
from infer.families import FAMILIES
from infer.generate import generate_vanilla
from infer.sampling import SamplingParams
from infer.tree_search import DynamicTreeConfig
from models.target import TargetConfig, TargetModel
from models.tokenizer import stop_ids

PROMPT_SOURCES = ("builtin", "stdlib", "eval_data")
DEFAULT_PROMPTS = 16
DATASTORE_MAX_NGRAM = 8
"""The longest n-gram a report's datastore indexes: longer matches were right more often on the held-out answers."""
"""Prompts per built-in category (and of the stdlib / eval_data sources) when ``report.prompts`` is None."""
FAMILY_OPTIONS = tuple(fam.report_options for fam in FAMILIES if fam.report_options is not None)
"""The shipped families' own report settings (``DrafterFamily.report_options``), whose fields ReportConfig takes."""


@dataclass
class ReportConfig(*FAMILY_OPTIONS):
    """What the closing report measures. Every family reads the generic settings below
    (``infer.family.ReportSettings``); a setting only one family reads is a field of that family's
    ``report_options``, which this class inherits (documented and checked there)."""

    enabled: bool = True
    """Run the report at the end of training (the ``report`` mode runs it regardless)."""
    prompt_source: str = "builtin"
    """"builtin": the categories below (eval/prompts.py; needs a chat template); "stdlib": held-out files of the
    standard-library corpus continued as raw text (targets without a chat template); "eval_data": the eval_data
    samples, each cut before its first loss token (a recipe's ``report`` mode, or the samples passed to
    `run_report`). ``prompts_path`` overrides all three."""
    prompts_path: str | None = None
    """A jsonl of Spec-Bench ({question_id, category, turns}) or HumanEval ({task_id, prompt}) rows to measure
    instead (every turn of a multi-turn question is one measured prompt, after the target's own earlier answers)."""
    categories: list[str] = field(default_factory=lambda: ["chat", "code"])
    """Built-in categories for prompt_source "builtin": chat, code (HumanEval), copy, long."""
    prompts: int | None = None
    """Prompts per category (builtin) or in all (other sources; a file: its first N rows). None: a prompt file is
    measured whole, the other sources give 16."""
    prompt_tokens: int = 64
    """eval_data prompts of raw text (loss on every token): the first prompt_tokens tokens of each sample."""
    max_new_tokens: int = 128
    """Cap on tokens per answer; answers stop earlier at the target's EOS."""
    chain_k: int = 5
    """Drafts per round of the chain setting (0 leaves the chain out); the longest chain tried when
    chain_from_cost_curve is on. A family may cap it (Medusa: its number of heads) or add a row past its own depth
    (MTP: chain_k > D reuses the last module)."""
    chain_from_cost_curve: bool = True
    """Pick each chain's length (1..chain_k) on the machine that runs the report, from a pilot run's acceptance
    (shrunk toward the checkpoint's held-out acceptance) and step costs and the verify-cost curve measured there
    (eval.cost_curve.size_chain), and the EAGLE-2 tree among eval.cost_curve.TREE_GRID (size_tree); the chosen chain's
    neighbours are measured too, predicted and measured speedup side by side. Off: exactly chain_k and the tree_*
    fields."""
    tree_top_k: int = 4
    """EAGLE-2 dynamic tree: children per node and frontier width (EAGLE-2 default 10; ≤ 16-node trees on a CPU)."""
    tree_depth: int = 5
    """EAGLE-2 dynamic tree depth."""
    tree_total_tokens: int = 16
    """Tree nodes per verify forward, root included (0 leaves the tree out)."""
    draft_model: str | None = "cut"
    """The small draft-model baseline, in every report unless null: a folder of a distilled draft model (HF causal
    LM sharing the tokenizer, e.g. what train/draft_model.py writes); "cut", or a folder that does not exist yet: the
    target's first ``draft_model_layers`` layers with its norm and head, not distilled (labelled so)."""
    draft_model_layers: int = 2
    """Layers of the undistilled cut (models/draft_model.py)."""
    draft_model_tree: bool = True
    """The draft model in the EAGLE-2 tree setting too, beside its chain (off: the chain only)."""
    draft_model_sampled: bool = True
    """The draft-model baseline (its rows and HF's assisted generation with it) at T > 0 too; off: at T = 0 only."""
    fp32_certificate: bool = True
    """Where the target is served below fp32, decode every T = 0 divergence of a lossless method again on an fp32 copy
    of the target from its first differing token (eval.measure.fp32_replay)."""
    hf_assisted: bool = False
    """Also time HF's own assisted generation at batch 1, the outside peer: ``prompt_lookup_num_tokens=10`` and, when
    the report has a draft model and ``hf_assisted_draft_model``, ``assistant_model`` (rows without τ: HF reports no
    rounds)."""
    hf_assisted_draft_model: bool = True
    """HF's assisted generation with the draft model as ``assistant_model`` among the HF peers (off: HF's prompt
    lookup only; the draft model's own rows still place that baseline)."""
    hybrid_lookup: int = 10
    """The hybrid row (infer/hybrid.py): the drafter's last setting (its tree where it has one) with prompt lookup's
    chain of up to this many tokens merged into each verify; 0 leaves the row out."""
    hybrid_priced: bool = True
    """Where the hybrid wraps the tree the report sized, each step keeps the nodes most likely to be accepted, as many
    as give the most expected tokens per ms on the sizing's verify curve and its pilot's draft and bookkeeping time
    (infer/pricing.py; off: the tree and the chain whole, a weak match's first 2 tokens)."""
    hybrid_priced_lookup: int = 15
    """The lookup chain's length where the hybrid is priced: a step verifies only as much of it as pays, so it may
    reach the verify curve's 16-node step, which a whole chain of 15 beside a tree would overrun."""
    hybrid_alone_match: int = 3
    """The hybrid's steps where every row's lookup match is at least this many tokens verify the lookup chain alone,
    without running the drafter (infer/hybrid.py; 0: never)."""
    hybrid_tree: list[int] = field(default_factory=list)
    """[top_k, depth, total_tokens]: the EAGLE-2 tree the hybrid wraps instead of the tree sized for the tree alone
    (priced, on the sized tree's costs, its drafting scaled by depth; a family without EAGLE-2 trees is refused);
    empty: the sized tree, ``hybrid_shallower`` levels shallower."""
    hybrid_shallower: int = 1
    """Where ``hybrid_tree`` is empty, the hybrid wraps the sized tree this many levels shallower (its depth at least
    2; 0: the sized tree as it is). The lookup chain gives the hybrid depth, so a shallower tree serves it as well for
    a drafter forward less a round (docs/decisions.md, "Drafting costs leave the timed decode; the hybrid's tree a level
    shallower by default")."""
    datastore: list[str] = field(default_factory=list)
    """Folders of the target's own conversations (``messages`` shards, e.g. the target-written training tiers) whose
    answers make a datastore (infer/datastore.py): where set, two more rows, prompt lookup drafting from the
    datastore where the context's own match is short, and the hybrid with the datastore's chain (empty: neither)."""
    datastore_match: int = 3
    """The shortest n-gram of the context's tail the datastore answers for (n up to ``DATASTORE_MAX_NGRAM``). On the
    target-written tier's held-out answers its continuation was accepted for 0.36 tokens a draft after a 2-gram match,
    0.55 after a 3-gram and 1.06 after a 4-gram or longer; on a tuning file prompt lookup's τ rose by 13 % with 3-gram
    matches and 6 tokens, as with 2-gram matches and 10 (docs/decisions.md, "A datastore of the target's own text")."""
    datastore_draft: int = 6
    """Tokens of the datastore's continuation drafted (a longer chain costs verify nodes it rarely fills)."""
    compare: list[str] = field(default_factory=list)
    """Other drafter checkpoints (any family) measured in the same run, e.g. the shipped EAGLE-3 beside Medusa."""
    compare_settings: int = 0
    """How many of each compared drafter's settings are measured: its family's first N (a family lists its chain
    first); 0: every one. The measured drafter always runs all of its own."""
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    """Batch sizes to measure (a category with fewer prompts than a batch size is cycled to fill one batch)."""
    batch_repeats: int = 1
    """Every method decodes each batch this many times in turn (`eval.measure.measure`), at every batch size: one
    call per method is one timing, and rows then say vanilla's spread over the repeats."""
    batch_auto: bool = True
    """Where batch_sizes goes past 1: also the batch-aware row (infer/batch_policy.py), the first drafter's sized
    chain with its length chosen per batch size from the cost curve measured at that batch size, switched off where
    it does not promise ``eval.batch_sizing.AUTO_MARGIN`` over vanilla (needs chain_from_cost_curve and chain_k)."""
    chain_neighbours: bool = True
    """Measure each sized chain's neighbours (k - 1, k + 1) too, predicted beside measured speedup."""
    tree_grid: bool = False
    """Where the tree is sized (chain_from_cost_curve), measure every other setting of the grid too: the check of
    the tree sizing, each setting's predicted beside its measured speedup (a full file costs a few minutes more per
    setting)."""
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
        if (self.prompts is not None and self.prompts < 1) or self.max_new_tokens < 1 or self.prompt_tokens < 1:
            raise ValueError("prompts, prompt_tokens and max_new_tokens must be >= 1")
        if self.chain_k < 0 or self.tree_total_tokens < 0 or (self.tree_total_tokens and self.tree_total_tokens < 2):
            raise ValueError("chain_k must be >= 0 and tree_total_tokens 0 or >= 2")
        if self.chain_k == 0 and self.tree_total_tokens == 0:
            raise ValueError("the report needs a chain (chain_k > 0) or a tree (tree_total_tokens > 0)")
        if self.compare_settings < 0:
            raise ValueError("compare_settings must be >= 0 (0: every setting)")
        if not 1 <= self.datastore_match <= DATASTORE_MAX_NGRAM or self.datastore_draft < 1:
            raise ValueError(f"datastore_match must be in 1..{DATASTORE_MAX_NGRAM} and datastore_draft >= 1")
        if self.hybrid_lookup < 0 or self.hybrid_priced_lookup < 1 or not 0 <= self.hybrid_alone_match <= 3:
            raise ValueError("hybrid_lookup must be >= 0, hybrid_priced_lookup >= 1 and hybrid_alone_match in 0..3")
        if self.hybrid_shallower < 0:
            raise ValueError(f"hybrid_shallower must be >= 0, got {self.hybrid_shallower}")
        if self.hybrid_tree:
            if len(self.hybrid_tree) != 3:
                raise ValueError(f"hybrid_tree is [top_k, depth, total_tokens], got {self.hybrid_tree}")
            DynamicTreeConfig(*self.hybrid_tree)  # its own checks
        if any(b < 1 for b in self.batch_sizes) or any(t < 0 for t in self.temperatures):
            raise ValueError("batch sizes must be >= 1 and temperatures >= 0")
        for options in FAMILY_OPTIONS:
            if "__post_init__" in vars(options):
                options.__post_init__(self)

    @property
    def tree(self) -> DynamicTreeConfig:
        return DynamicTreeConfig(top_k=self.tree_top_k, depth=self.tree_depth, total_tokens=self.tree_total_tokens)

    @property
    def tree_name(self) -> str:
        return f"EAGLE-2 k{self.tree_top_k} d{self.tree_depth} n{self.tree_total_tokens}"


@dataclass
class ReportOnlyConfig:
    """``python -m eval.report`` / ``drafters report`` without a recipe: a target and the report settings."""

    target: TargetConfig | None = None
    """Target to measure against (None: the checkpoint's target_name and aux ids)."""
    report: ReportConfig = field(default_factory=ReportConfig)


def report_prompts(
    cfg: ReportConfig, tokenizer, target: TargetModel, eval_set: Sequence[dict] | None = None
) -> tuple[list[MeasuredPrompt], str]:
    """The measured prompts (token ids + category) and a one-line description of the prompt set."""
    if cfg.prompts_path or cfg.prompt_source == "builtin":
        if cfg.prompts_path:
            chosen, name = load_prompt_file(cfg.prompts_path, cfg.prompts), f"file {cfg.prompts_path}"
            name += f" ({len(chosen)} questions{'' if cfg.prompts is None else f', the first {cfg.prompts}'})"
        else:
            chosen = [p for c in cfg.categories for p in builtin_prompts(c, cfg.prompts or DEFAULT_PROMPTS)]
            name = "built-in " + ", ".join(f"{c} ({sum(p.category == c for p in chosen)})" for c in cfg.categories)
        if not tokenizer.chat_template:
            raise ValueError("chat prompts need a tokenizer with a chat template; use report.prompt_source=stdlib")
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens)
        eos = stop_ids(tokenizer, target.model)
        turns = encode_turns(chosen, tokenizer, lambda ids: generate_vanilla(target, [ids], params, eos).tokens[0])
        return [MeasuredPrompt(ids, p.category, f"{p.question_id} turn {t + 1}") for p, t, ids in turns], name
    if cfg.prompt_source == "stdlib":
        from eval.stdlib_corpus import heldout_prompts

        ids = [p["prompt_ids"] for p in heldout_prompts(tokenizer, n=cfg.prompts or DEFAULT_PROMPTS)]
        return [MeasuredPrompt(i, "stdlib") for i in ids], "held-out standard-library files (raw text)"
    if eval_set is None:
        raise ValueError(
            "report.prompt_source='eval_data' needs eval_data samples: run the recipe's own report mode "
            "(python train/<method>.py report --config RECIPE) with an eval_data section"
        )
    prompts = []
    for sample in eval_set:
        first = next((i for i, m in enumerate(sample["loss_mask"]) if m), 0)
        # chat: everything before the first assistant token; raw text (every token a target): a fixed-length head
        cut = first if first > 1 else cfg.prompt_tokens
        if len(sample["input_ids"]) > cut:
            prompts.append(MeasuredPrompt(list(sample["input_ids"][:cut]), "eval_data"))
        if len(prompts) == (cfg.prompts or DEFAULT_PROMPTS):
            break
    return prompts, "eval_data samples cut before their first loss token"
