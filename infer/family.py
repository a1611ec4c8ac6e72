"""Drafter families: what each family declares in one place of its own, so that shared code never names one.

A family (EAGLE-3, Medusa, MTP, or one added later, e.g. Hydra heads) declares a `DrafterFamily` in its own module,
beside its proposer, and registers it there:

- ``drafter_class`` (models/): its ``method`` is the name the family's checkpoints carry in their ``drafters`` block
  (written at save time, read back here), and ``from_pretrained(path, target, tokenizer)`` loads one;
- ``signal(drafter)``: the target signal that drafter's proposers read (`infer.proposer.TargetSignal`): one for every
  drafter of most families, read from the drafter where its own config chooses it;
- ``report_proposers(drafter, settings, size)``: the proposer settings a report measures for one drafter of the
  family (a chain, a tree, ...; `ProposerSetting`), from the generic report settings (`ReportSettings`; a family that
  reads more of ``eval.report.ReportConfig`` says which field, in a protocol of its own module) and ``size``, which
  picks a chain's length on the machine that measures (`ChainSizer`).

Shared code reads the declarations only, through `lookup(method)` and `family_of(drafter)`: `load_drafter` (any
checkpoint → its family's class) and the report (eval/report.py: the rows of every drafter, labelled with the
family's method). A family added later edits no shared file: it calls `register` in its own module.

Why here and not in models/: a declaration names proposers (infer/), and models/ imports nothing above it, so the
one loader that returns any family's drafter lives here too; ``models.loader`` keeps what needs no family (the
method a checkpoint names, the target it runs on). The three shipped families are imported at the end of this
module, so whatever reads the registry knows them.
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
from models.loader import checkpoint_method
from models.target import TargetModel

ChainSizer = Callable[[Callable[[int], Proposer], int], int]
"""``size(make, longest) -> k``: the chain length to measure, in 1..longest; ``make(n)`` builds the family's proposer
with an n-long chain (the report times a pilot of it: eval.cost_curve.size_chain; with sizing off it returns
``longest``)."""


class ReportSettings(Protocol):
    """The report settings every family may read (fields of eval.report.ReportConfig, documented there)."""

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

    @property
    def method(self) -> str:
        return self.drafter_class.method


FAMILIES: dict[str, DrafterFamily] = {}
"""Registered families by method name."""


def register(family: DrafterFamily) -> DrafterFamily:
    """Make ``family`` known to the loader and the report (a second family under a taken method name is refused)."""
    known = FAMILIES.get(family.method)
    if known is not None and known.drafter_class is not family.drafter_class:
        raise ValueError(f"method {family.method!r} is taken by {known.drafter_class.__name__}")
    FAMILIES[family.method] = family
    return family


def lookup(method: str) -> DrafterFamily:
    """The family registered under ``method``; ValueError naming the known methods otherwise."""
    if method not in FAMILIES:
        raise ValueError(
            f"unknown drafter method {method!r}; known: {sorted(FAMILIES)} (a new family declares an "
            "infer.family.DrafterFamily and registers it with infer.family.register)"
        )
    return FAMILIES[method]


def family_of(drafter: torch.nn.Module) -> DrafterFamily:
    """The family whose drafter class ``drafter`` is an instance of (ValueError for a class no family declares)."""
    for fam in FAMILIES.values():
        if isinstance(drafter, fam.drafter_class):
            return fam
    raise ValueError(f"no registered drafter family has the class {type(drafter).__name__}; known: {sorted(FAMILIES)}")


def load_drafter(path: str | Path, target: TargetModel, tokenizer: Any = None) -> torch.nn.Module:
    """The drafter saved at ``path``, as its family's class, checked against ``target`` before its weights are read.
    The family comes from the ``method`` of the checkpoint's ``drafters`` block."""
    method = checkpoint_method(path)
    try:
        fam = lookup(method)
    except ValueError as e:
        raise ValueError(f"{Path(path) / 'config.json'}: {e}") from None
    return fam.drafter_class.from_pretrained(path, target, tokenizer)


# the shipped families declare and register themselves in their proposer modules
from infer import eagle3_proposer, medusa_proposer, mtp_proposer  # noqa: E402, F401
