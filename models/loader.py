"""One loader for every drafter checkpoint: the ``drafters`` block names the class (models/checkpoint.py)."""

from __future__ import annotations

from pathlib import Path

from models.checkpoint import read_checkpoint
from models.eagle3 import Eagle3Drafter
from models.medusa import MedusaDrafter
from models.target import TargetModel


def checkpoint_method(path: str | Path) -> str:
    """The method that wrote the checkpoint at ``path`` (reads config.json only)."""
    return read_checkpoint(path)[1].method


def load_drafter(path: str | Path, target: TargetModel, tokenizer=None) -> Eagle3Drafter | MedusaDrafter:
    """The drafter saved at ``path``, as its own class, checked against ``target`` before its weights are read."""
    method = checkpoint_method(path)
    if method == "eagle3":
        return Eagle3Drafter.from_pretrained(path, target, tokenizer)
    if method == "medusa":
        return MedusaDrafter.from_pretrained(path, target, tokenizer)
    raise ValueError(f"{path}: no loader for method {method!r}")
