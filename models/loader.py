"""What loading a drafter checkpoint needs before its family is known: the method its ``drafters`` block names, and
the target it runs on (with a jointly trained target's changes applied).

The drafter itself is loaded by `infer.families.load_drafter`, which maps the method to the family's class: families
declare themselves beside their proposers (infer/), and models/ imports nothing above it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from models.checkpoint import TARGET_DIR, read_checkpoint
from models.target import TargetConfig, TargetModel


def checkpoint_method(path: str | Path) -> str:
    """The method that wrote the checkpoint at ``path`` (reads config.json only)."""
    return read_checkpoint(path)[1].method


def load_target(path: str | Path, cfg: TargetConfig, workload: str = "serve", **policy) -> TargetModel:
    """The target a drafter checkpoint runs on: ``cfg`` as given, with the joint-training changes the checkpoint
    carries applied (a full target replaces the weights; a LoRA adapter is merged, so decoding pays nothing for it).
    ``workload`` and ``policy`` (prepare, acceptance) go to `TargetModel.from_config`'s precision choice."""
    info = read_checkpoint(path)[1]
    changed = Path(path) / TARGET_DIR
    if info.target_weights == "full":
        full = dataclasses.replace(cfg, name_or_path=str(changed), mode="frozen", lora_rank=0)
        return TargetModel.from_config(full, workload, **policy)
    target = TargetModel.from_config(dataclasses.replace(cfg, mode="frozen", lora_rank=0), workload, **policy)
    if info.target_weights == "lora":
        from peft import PeftModel  # only joint checkpoints pay peft's import time

        merged = PeftModel.from_pretrained(target.hf_model, str(changed)).merge_and_unload()
        chosen = target.precision
        target = TargetModel(merged, aux_layer_ids=target.aux_layer_ids, name_or_path=cfg.name_or_path)
        target.precision = chosen
    return target
