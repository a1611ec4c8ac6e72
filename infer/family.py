"""Drafter family types: what a family declares so that shared code never names one.

A family (EAGLE-3, Medusa, MTP, or one added later, e.g. Hydra heads) declares one `DrafterFamily` value in its own
module, beside its proposer (``FAMILY = DrafterFamily(...)``):

- ``drafter_class`` (models/): its ``method`` is the name the family's checkpoints carry in their ``drafters`` block
  (written at save time, read back by `infer.families.load_drafter`), and ``from_pretrained(path, target, tokenizer)``
  loads one;
- ``signal(drafter)``: the target signal that drafter's proposers read (`infer.proposer.TargetSignal`): one for every
  drafter of most families, read from the drafter where its own config chooses it;
- ``report_proposers(drafter, settings, size)``: the proposer settings a report measures for one drafter of the
  family (a chain, a tree, ...; `ProposerSetting`), from the report settings (the generic `ReportSettings`, and
  the family's own) and ``size``, which picks a chain's length on the machine that measures (`ChainSizer`);
- ``report_options`` (optional): a dataclass of the report settings only this family reads, e.g. MTP's tree width;
  ``eval.report_config.ReportConfig`` takes its fields (a recipe sets them under ``report:``) and runs its checks;
- ``step_timings`` (optional): the family's draft step timed by code path, which the cost curve prints beside the
  verify curve;
- ``engine_exports(drafter)`` (optional): the serving engines' folders of one drafter, each written or refused with
  the reason (`models.export.EngineExport`, the layouts in the family's ``models/<family>_export.py``); ``drafters
  publish`` writes them all from the checkpoint;
- ``chain(drafter, k)`` (optional): the family's greedy chain of k drafts, which tools that measure one setting of
  any drafter build (the quick start, the data-scaling curve of a run's snapshots);
- ``recipe_section`` and ``estimate`` (optional): the key of the family's own section in a training recipe (how a
  tool tells a recipe's family), and the family's share of a run's size from that section (`models.sizing`), which
  ``drafters estimate`` adds to the target's.

This module holds the types only and imports no family; the one list of the shipped families is
`infer.families.FAMILIES`, above the family modules. Nothing registers itself on import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from infer.generate import SpecConfig
from infer.proposer import Proposer, TargetSignal
from infer.tree_search import DynamicTreeConfig
from models.export import EngineExport
from models.sizing import DrafterSizes, RunSizes
from models.target import TargetModel

ChainSizer = Callable[[Callable[[int], Proposer], int], int]
"""``size(make, longest) -> k``: the chain length to measure, in 1..longest; ``make(n)`` builds the family's proposer
with an n-long chain (the report times a pilot of it: eval.cost_curve.size_chain; with sizing off it returns
``longest``)."""


class ReportSettings(Protocol):
    """The report settings every family may read (fields of eval.report_config.ReportConfig, documented there)."""

    chain_k: int
    """Drafts per round of the chain setting (0: no chain row); the longest chain sizing may pick."""
    tree_total_tokens: int
    """Tree nodes per verify forward, root included (0: no tree row)."""

    @property
    def tree(self) -> DynamicTreeConfig:
        """The EAGLE-2 dynamic tree of the report (for families that build one)."""
        ...

    @property
    def tree_name(self) -> str:
        """That tree in words, e.g. "EAGLE-2 k4 d5 n16"."""
        ...


@dataclass(frozen=True)
class ProposerSetting:
    """One proposer setting a report measures for a drafter: the words of its row and how to build its proposer."""

    setting: str
    """The setting in words, e.g. "chain 5" or "static tree n9" (the report's "setting" column)."""
    make: Callable[[], Proposer]
    """Builds a fresh proposer (one per generate call)."""
    spec: SpecConfig | None = None
    """Accept-rule settings (None: the lossless default), e.g. Medusa's typical acceptance."""


def no_engine_exports(drafter: Any) -> list[EngineExport]:
    """A family that serves in drafters' own runtime only (a toy, one being developed) has no engine folder."""
    return []


class Drafter(Protocol):
    """What shared code needs of a family's drafter class (an ``nn.Module``)."""

    method: ClassVar[str]
    """The family's method name, written into every checkpoint's ``drafters`` block."""

    @classmethod
    def from_pretrained(cls, path: str | Path, target: TargetModel, tokenizer: Any = None) -> torch.nn.Module:
        """The checkpoint at ``path``, checked against ``target`` (and its tokenizer) before its weights are read."""
        ...


@dataclass(frozen=True)
class DrafterFamily:
    """One drafter family's declaration (see the module docstring)."""

    drafter_class: type[Drafter]
    """The drafter ``nn.Module`` class: its ``method`` and ``from_pretrained``."""
    signal: Callable[[Any], TargetSignal]
    """drafter → the target signal its proposers read (a function of the drafter: a family may let each drafter
    choose, as its config says)."""
    report_proposers: Callable[[Any, ReportSettings, ChainSizer], list[ProposerSetting]]
    """(drafter, report settings, chain sizer) → the proposer settings the report measures for that drafter."""
    report_options: type | None = None
    """A dataclass of the report settings only this family reads (each field documented, every one with a default;
    its ``__post_init__``, if any, checks them): ``eval.report_config.ReportConfig`` inherits its fields. None: the family
    reads the generic settings only."""
    step_timings: Callable[[Any, TargetModel, int, int], dict[str, float]] | None = None
    """(drafter, target, cached context tokens, repetitions) → seconds of one draft step by code path (e.g. the
    module against a fused step), for ``python -m eval.cost_curve_cli --drafter``. None: the cost curve times no draft
    step for the family."""
    engine_exports: Callable[[Any], list[EngineExport]] = no_engine_exports
    """drafter → its serving engines' folders, each with its writer or the reason it is refused (`drafters publish`
    writes every one that is not refused and names the refused ones with their reasons)."""
    chain: Callable[[Any, int], Proposer] | None = None
    """(drafter, k) → a proposer drafting a chain of k tokens, for tools that measure one chain of any drafter (the
    quick start, scripts/data_scaling.py). None: those tools refuse the family's drafters."""
    recipe_section: str | None = None
    """The key of the family's own section in its training recipes (e.g. the drafter's or the heads' settings):
    tools that read a recipe find its family by it. None: the family has no training recipe."""
    estimate: Callable[[dict, RunSizes], DrafterSizes] | None = None
    """(the recipe's ``recipe_section`` mapping, the run's shared sizes) → the family's share of a training run
    (trained parameters, FLOPs per token, memory, feature cache), for ``drafters estimate``. None: not sized."""

    @property
    def method(self) -> str:
        return self.drafter_class.method
