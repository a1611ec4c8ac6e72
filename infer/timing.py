"""The one clock every measurement reads: wall time after the device has finished its queued work.

CUDA (and other accelerators) run kernels asynchronously: ``time.perf_counter()`` right after a forward returns
measures how long the launches took, not the forward. Every timer in ``infer/`` and ``eval/`` therefore reads
`clock`, which first waits for the device, so draft / verify / bookkeeping splits, the cost curve and the
speedups built on them mean the same on a GPU as on a CPU (where the wait is a no-op).
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Wait until ``device`` has finished every queued kernel (nothing to wait for on the CPU)."""
    if device is None:
        return
    # the decode loop reads the clock several times a step: no torch.device construction for the usual argument
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu":
        return
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "xpu":
        torch.xpu.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def clock(device: torch.device | str | None = None) -> float:
    """Seconds (``perf_counter``) after ``device``'s queued work is done: take two and subtract."""
    synchronize(device)
    return time.perf_counter()


def timed(fn, device: torch.device | str | None = None) -> float:
    """Seconds one call of ``fn()`` takes on ``device``, its queued kernels included."""
    start = clock(device)
    fn()
    return clock(device) - start
