"""One loader for every drafter checkpoint: the ``drafters`` block names the class (models/checkpoint.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from models.checkpoint import TARGET_DIR, read_checkpoint
from models.eagle3 import Eagle3Drafter
from models.medusa import MedusaDrafter
from models.mtp import MTPDrafter
from models.target import TargetConfig, TargetModel


def checkpoint_method(path: str | Path) -> str:
    """The method that wrote the checkpoint at ``path`` (reads config.json only)."""
    return read_checkpoint(path)[1].method


def load_drafter(path: str | Path, target: TargetModel, tokenizer=None) -> Eagle3Drafter | MedusaDrafter | MTPDrafter:
    """The drafter saved at ``path``, as its own class, checked against ``target`` before its weights are read."""
    method = checkpoint_method(path)
    if method == "eagle3":
        return Eagle3Drafter.from_pretrained(path, target, tokenizer)
    if method == "medusa":
        return MedusaDrafter.from_pretrained(path, target, tokenizer)
    if method == "mtp":
        return MTPDrafter.from_pretrained(path, target, tokenizer)
    raise ValueError(f"{path}: no loader for method {method!r}")


def load_target(path: str | Path, cfg: TargetConfig) -> TargetModel:
    """The target a drafter checkpoint runs on: ``cfg`` as given, with the joint-training changes the checkpoint
    carries applied (a full target replaces the weights; a LoRA adapter is merged, so decoding pays nothing for it)."""
    info = read_checkpoint(path)[1]
    changed = Path(path) / TARGET_DIR
    if info.target_weights == "full":
        return TargetModel.from_config(dataclasses.replace(cfg, name_or_path=str(changed), mode="frozen", lora_rank=0))
    target = TargetModel.from_config(dataclasses.replace(cfg, mode="frozen", lora_rank=0))
    if info.target_weights == "lora":
        from peft import PeftModel  # only joint checkpoints pay peft's import time

        merged = PeftModel.from_pretrained(target.hf_model, str(changed)).merge_and_unload()
        target = TargetModel(merged, aux_layer_ids=target.aux_layer_ids, name_or_path=cfg.name_or_path)
    return target
