"""Optimiser, learning-rate schedule and precision choice shared by the drafter recipes."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch import nn


def adamw(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; norms and biases (1-D) never decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, peak_lr: float, min_lr_ratio: float = 0.0) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up to ``peak_lr``, cosine to min_lr_ratio·peak."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def cpu_bf16_is_fast(cpu_flags: str | None = None, timer=None) -> bool:
    """Whether bf16 matmuls beat fp32 on this CPU, by measurement (DESIGN.md §7: never assume).

    CPUs without native bf16 instructions (no ``avx512_bf16`` / ``amx_bf16`` in /proc/cpuinfo) emulate it ~100x
    slower, so they are ruled out without timing. Otherwise a 512² matmul is timed in both dtypes (~10 ms) and bf16
    must be at least 1.25x faster. ``cpu_flags`` and ``timer(dtype) -> seconds`` replace the machine in tests.
    """
    if cpu_flags is None:
        try:
            cpu_flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    if "avx512_bf16" not in cpu_flags and "amx_bf16" not in cpu_flags:
        return False
    timer = timer or _matmul_seconds
    return timer(torch.bfloat16) * 1.25 <= timer(torch.float32)


def _matmul_seconds(dtype: torch.dtype, n: int = 512, reps: int = 5) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # first call: one-off kernel selection
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return best


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
