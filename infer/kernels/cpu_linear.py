"""Small-row linear layers on the CPU, with the faster of two fp32 matmul layouts chosen by measurement.

Decode and verification multiply a few rows (1 token, or a draft tree of 2–16) by every weight matrix of the target.
On this project's CPU (AMD EPYC, AVX2, 2 threads, MKL) ``F.linear`` with 2–4 rows cost ~2x one row, because one row
takes a bandwidth-bound gemv and several rows a gemm that reads the weight less efficiently; ``W @ xᵀ`` (the same
products, weight as the left operand) cost ~0.7x of that at 2–4 rows, and for the 49k-row head even at one row
(docs/decisions.md). Other CPUs differ, so `install` times both layouts for every weight shape of the model and
every row-count bucket, then routes each inference call (no grad) to the winner; training calls stay on F.linear.

Both layouts compute the same dot products; only the summation order inside MKL differs (~1e-7 relative), which is
the rounding-level difference DESIGN.md §7 already allows between vanilla decoding and tree verification.
"""

from __future__ import annotations

import time
import types

import torch
import torch.nn.functional as F
from torch import nn

BUCKETS = (1, 2, 4, 8, 16)
"""Row counts timed; a call with m rows uses the choice of the smallest bucket >= m (more rows: F.linear)."""


def _best_seconds(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def choose_layouts(weight: torch.Tensor, reps: int = 5) -> tuple[bool, ...]:
    """Per bucket: True when ``W @ xᵀ`` beat ``F.linear`` by more than 5 % for that many rows (fp32, CPU)."""
    out = []
    for m in BUCKETS:
        x = torch.randn(m, weight.shape[1], dtype=weight.dtype)
        linear = _best_seconds(lambda x=x: F.linear(x, weight), reps)
        left = _best_seconds(lambda x=x: torch.mm(weight, x.t()), reps)
        out.append(left < 0.95 * linear)
    return tuple(out)


def small_rows_linear(module: nn.Linear, x: torch.Tensor, use_left: tuple[bool, ...]) -> torch.Tensor:
    """``module(x)`` with the layout measured faster for x's row count (inference only)."""
    rows = x.numel() // x.shape[-1]
    if torch.is_grad_enabled() or rows > BUCKETS[-1]:
        return F.linear(x, module.weight, module.bias)
    bucket = next(i for i, b in enumerate(BUCKETS) if rows <= b)
    if not use_left[bucket]:
        return F.linear(x, module.weight, module.bias)
    y = torch.mm(module.weight, x.reshape(rows, x.shape[-1]).t()).t()
    if module.bias is not None:
        y = y + module.bias
    return y.reshape(*x.shape[:-1], module.weight.shape[0])


def install(model: nn.Module, log=print) -> dict[tuple[int, int], tuple[bool, ...]]:
    """Time both layouts for each weight shape of ``model``'s fp32 CPU Linear layers and route their inference
    calls accordingly. Returns the choice per shape (all False: nothing changes). A second call on the same model
    returns the first call's choices without timing again."""
    if getattr(model, "_drafters_cpu_linear", None) is not None:
        return model._drafters_cpu_linear
    choices: dict[tuple[int, int], tuple[bool, ...]] = {}
    for module in model.modules():
        if not isinstance(module, nn.Linear) or module.weight.device.type != "cpu":
            continue
        if module.weight.dtype != torch.float32:
            continue
        shape = tuple(module.weight.shape)
        if shape not in choices:
            choices[shape] = choose_layouts(module.weight.detach())
        use_left = choices[shape]
        if any(use_left):
            module.forward = types.MethodType(lambda self, x, u=use_left: small_rows_linear(self, x, u), module)
    model._drafters_cpu_linear = choices
    routed = {s: c for s, c in choices.items() if any(c)}
    log(
        "cpu linear: W @ xT for "
        + (
            ", ".join(f"{s[0]}x{s[1]} at rows {[b for b, u in zip(BUCKETS, c) if u]}" for s, c in routed.items())
            or "none"
        )
    )
    return choices


def uninstall(model: nn.Module) -> None:
    """Back to plain F.linear everywhere (undoes `install`)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.__dict__.pop("forward", None)
    model.__dict__.pop("_drafters_cpu_linear", None)
