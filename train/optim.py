"""Optimiser, learning-rate schedule and precision choice shared by the drafter recipes."""

from __future__ import annotations

import math

import torch
from torch import nn

from models.precision import PrecisionChoice, choose, cpu_bf16_is_fast, user_choice
from models.target import TargetConfig


def adamw(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    lr_scales: dict[nn.Module, float] | None = None,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; norms and biases (1-D) never decay. ``lr_scales``: sub-modules whose
    parameters train at ``lr_scale`` times the schedule's rate (kept by `set_lr`)."""
    scale_of = {id(p): s for m, s in (lr_scales or {}).items() for p in m.parameters()}
    groups = []
    for scale in sorted({scale_of.get(id(p), 1.0) for p in model.parameters()}):
        params = [p for p in model.parameters() if p.requires_grad and scale_of.get(id(p), 1.0) == scale]
        for decayed in (True, False):
            chosen = [p for p in params if (p.dim() >= 2) == decayed]
            if chosen:
                wd = weight_decay if decayed else 0.0
                groups.append({"params": chosen, "weight_decay": wd, "lr_scale": scale, "lr": lr * scale})
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, peak_lr: float, min_lr_ratio: float = 0.0) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up to ``peak_lr``, cosine to min_lr_ratio·peak."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group to ``lr`` times its ``lr_scale`` (1 unless set, e.g. Medusa-2's heads at 4x the target's)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def mixed_precision(choice: str, target: TargetConfig | None = None) -> tuple[str, PrecisionChoice]:
    """Accelerate's ``mixed_precision`` for "auto" / "bf16" / "fp32", and the choice with its reason. "auto" asks the
    precision policy for the training workload on ``target``'s layer shapes (bf16 autocast where a training step of
    them measures faster); without a target, the flags-and-matmul test (`cpu_bf16_is_fast`)."""
    if choice in ("bf16", "fp32"):
        dtype = "bfloat16" if choice == "bf16" else "float32"
        made = user_choice("train", dtype, f"train.mixed_precision={choice}")
    elif target is not None:
        from transformers import AutoConfig

        from models.reference import resolve_target

        config = AutoConfig.from_pretrained(
            resolve_target(target.name_or_path), trust_remote_code=target.trust_remote_code
        )
        made = choose("train", config, "cuda" if torch.cuda.is_available() else "cpu")
    else:
        fast = torch.cuda.is_available() or cpu_bf16_is_fast()
        made = PrecisionChoice("train", "bfloat16" if fast else "float32", "measured", "bf16 on CUDA or a 512² matmul")
    return ("bf16" if made.dtype == "bfloat16" else "no"), made
