"""Optimiser, learning-rate schedule and precision choice shared by the drafter recipes."""

from __future__ import annotations

import math

import torch
from torch import nn

from models.target import cpu_bf16_is_fast


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


def mixed_precision(choice: str) -> str:
    """Accelerate's ``mixed_precision`` for "auto" / "bf16" / "fp32": "auto" is bf16 on CUDA and on CPUs where
    `cpu_bf16_is_fast` measures bf16 faster, else fp32."""
    if choice == "bf16":
        return "bf16"
    if choice == "fp32":
        return "no"
    if torch.cuda.is_available():
        return "bf16"
    return "bf16" if cpu_bf16_is_fast() else "no"
