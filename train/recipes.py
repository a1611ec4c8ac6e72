"""The shipped families' training entry scripts, as one explicit list: what tools that take any recipe need of the
script behind it (its config class, its ``main``, its held-out evaluation), beside the family's declaration.

A recipe's family is the one whose ``recipe_section`` the YAML has (`infer.families.recipe_family`); `entry_of` gives
that family's entry here. Tools above train/ (the quick start, scripts/data_scaling.py) use these and name no
family. The list sits above the entry scripts (none of them imports this module), as `infer.families.FAMILIES` sits
above the proposers; adding a family with a training recipe adds one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator

from infer import eagle3_proposer, medusa_proposer, mtp_proposer
from infer.families import recipe_family
from infer.family import DrafterFamily
from models.target import TargetModel
from train import eagle3, medusa, mtp

ROOT = Path(__file__).resolve().parents[1]

Acceptance = tuple[list[float], list[list[list[int]]], list[list[int]] | None]
HeldoutAcceptance = Callable[[Accelerator, TargetModel, torch.nn.Module, Any, Any, int], Acceptance]
"""(accelerator, target, drafter, held-out set, recipe config, pad id) → teacher-forced top-1 agreement per draft
position on the held-out set, as the training run logs it (``eval/acc``), each held-out sample's hits and positions
per draft position (`train.schedule.SampleHits.total`), which pair two drafters' evaluations, and each sample's
greedy chains replayed on those hits (`train.schedule.SampleHits.walked`; None for a family whose evaluation does
not replay them: Medusa's and MTP's)."""


def _acceptance(result: dict, walked: bool) -> Acceptance:
    return result["eval/acc"], result["per_sample"], result["walked"] if walked else None


@dataclass(frozen=True)
class TrainingEntry:
    """One family's training entry script (train/<method>.py), as tools that take any recipe use it."""

    family: DrafterFamily
    """The family the script trains (its ``recipe_section`` tells its recipes)."""
    config_class: type
    """The recipe's config dataclass: ``models.config.parse_cli(config_class, ["--config", YAML, ...])``."""
    main: Callable[[list[str]], None]
    """The script's ``main(["--config", YAML, *overrides])``: trains one run into ``train.output_dir``."""
    heldout_acceptance: HeldoutAcceptance
    """The script's held-out evaluation, per draft position."""


def _mtp_acceptance(accelerator, target, drafter, eval_set, cfg: mtp.MTPRecipeConfig, pad_id: int):
    tc, ranks = cfg.train, cfg.mtp.tree_ranks
    return _acceptance(mtp.evaluate(accelerator, target, drafter, eval_set, tc, ranks, pad_id, per_sample=True), False)


TRAINING: tuple[TrainingEntry, ...] = (
    TrainingEntry(
        eagle3_proposer.FAMILY,
        eagle3.Eagle3RecipeConfig,
        eagle3.main,
        lambda *args: _acceptance(eagle3.evaluate(*args, per_sample=True), True),
    ),
    TrainingEntry(
        medusa_proposer.FAMILY,
        medusa.MedusaRecipeConfig,
        medusa.main,
        lambda *args: _acceptance(medusa.evaluate(*args, per_sample=True), False),
    ),
    TrainingEntry(mtp_proposer.FAMILY, mtp.MTPRecipeConfig, mtp.main, _mtp_acceptance),
)
"""The shipped families that train from a recipe."""

QUICK_START_RECIPE = ROOT / "recipes" / "smollm2-135m" / "eagle3.yaml"
"""The recipe ``drafters quickstart`` trains a short run of: the family of the shipped drafter, on the reference
target."""


def entry_of(recipe_path: str | Path, entries: tuple[TrainingEntry, ...] = TRAINING) -> TrainingEntry:
    """The training entry of the recipe at ``recipe_path`` (the family whose section its YAML has); SystemExit naming
    the sections otherwise."""
    recipe = yaml.safe_load(Path(recipe_path).read_text())
    try:
        fam = recipe_family(recipe if isinstance(recipe, dict) else {}, tuple(e.family for e in entries))
    except ValueError as e:
        raise SystemExit(f"{recipe_path}: {e}") from None
    return next(e for e in entries if e.family is fam)
