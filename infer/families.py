"""The drafter families this project ships, as one explicit list, and what shared code does with it.

Each family declares its `infer.family.DrafterFamily` value in its own module, beside its proposer; `FAMILIES` below
names them, in one place above them (no family registers itself on import, and no family module imports this one).
Shared code reads the declarations only, through `lookup(method)`, `family_of(drafter)` and `load_drafter(path)`:
the report (eval/report.py: the rows of every drafter, labelled with the family's method) and every loader of a
checkpoint of any family. Each takes ``families`` (default: the shipped list), so a family declared elsewhere (a
test's toy family, one being developed) is used by passing ``FAMILIES + (its FAMILY,)``; adding one to the project
adds one entry here.

Why in infer/ and not in models/: a declaration names proposers (infer/), and models/ imports nothing above it, so the
one loader that returns any family's drafter lives here too; ``models.loader`` keeps what needs no family (the method
a checkpoint names, the target it runs on).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from infer import eagle3_proposer, medusa_proposer, mtp_proposer
from infer.family import DrafterFamily
from models.loader import checkpoint_method
from models.target import TargetModel

FAMILIES: tuple[DrafterFamily, ...] = (eagle3_proposer.FAMILY, medusa_proposer.FAMILY, mtp_proposer.FAMILY)
"""The shipped families, each declared in its proposer's module."""


def _methods(families: tuple[DrafterFamily, ...]) -> list[str]:
    methods = [f.method for f in families]
    taken = sorted({m for m in methods if methods.count(m) > 1})
    if taken:
        raise ValueError(f"two families declare the method {taken[0]!r}; each method names one family")
    return sorted(methods)


def lookup(method: str, families: tuple[DrafterFamily, ...] = FAMILIES) -> DrafterFamily:
    """The family of ``families`` whose method is ``method``; ValueError naming the known methods otherwise."""
    known = _methods(families)
    for fam in families:
        if fam.method == method:
            return fam
    raise ValueError(
        f"unknown drafter method {method!r}; known: {known} (a new family declares an infer.family.DrafterFamily "
        "beside its proposer and is added to infer.families.FAMILIES)"
    )


def family_of(drafter: torch.nn.Module, families: tuple[DrafterFamily, ...] = FAMILIES) -> DrafterFamily:
    """The family whose drafter class ``drafter`` is an instance of (ValueError for a class no family declares)."""
    known = _methods(families)
    for fam in families:
        if isinstance(drafter, fam.drafter_class):
            return fam
    raise ValueError(f"no drafter family has the class {type(drafter).__name__}; known: {known}")


def recipe_family(recipe: dict, families: tuple[DrafterFamily, ...] = FAMILIES) -> DrafterFamily:
    """The family whose ``recipe_section`` is a key of ``recipe`` (a training recipe's parsed YAML); ValueError
    naming the sections the families declare otherwise."""
    found = [f for f in families if f.recipe_section is not None and f.recipe_section in recipe]
    if len(found) != 1:
        sections = " / ".join(f.recipe_section for f in families if f.recipe_section is not None)
        which = "no" if not found else "more than one"
        raise ValueError(f"{which} {sections} section: each drafter family's recipe has its own one")
    return found[0]


def load_drafter(
    path: str | Path, target: TargetModel, tokenizer: Any = None, families: tuple[DrafterFamily, ...] = FAMILIES
) -> torch.nn.Module:
    """The drafter saved at ``path``, as its family's class, checked against ``target`` before its weights are read.
    The family comes from the ``method`` of the checkpoint's ``drafters`` block."""
    method = checkpoint_method(path)
    try:
        fam = lookup(method, families)
    except ValueError as e:
        raise ValueError(f"{Path(path) / 'config.json'}: {e}") from None
    return fam.drafter_class.from_pretrained(path, target, tokenizer)
