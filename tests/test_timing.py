"""The one clock (infer/timing.py): it must wait for the device, or GPU timings count kernel launches only."""

from __future__ import annotations

import time

import pytest
import torch

from infer.timing import clock, synchronize, timed


def test_cpu_clock_is_wall_time_and_timed_calls_once():
    calls = []
    seconds = timed(lambda: (calls.append(1), time.sleep(0.02)), "cpu")
    assert calls == [1] and 0.02 <= seconds < 0.5
    synchronize(None)  # nothing to wait for
    a = clock(torch.device("cpu"))
    assert clock() >= a


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_clock_waits_for_queued_kernels():
    """A chain of large matmuls returns to Python long before the GPU finishes: the unsynchronised launch time must
    be a small part of what `timed` measures, and `timed` must agree with an explicit synchronize-and-time."""
    x = torch.randn(4096, 4096, device="cuda")
    work = lambda: [x @ x for _ in range(50)]  # noqa: E731
    work()
    torch.cuda.synchronize()
    t = time.perf_counter()
    work()
    launch_only = time.perf_counter() - t
    synced = timed(work, "cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    work()
    torch.cuda.synchronize()
    reference = time.perf_counter() - t
    assert launch_only < 0.5 * synced
    assert synced == pytest.approx(reference, rel=0.3)
