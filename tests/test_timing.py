"""The one clock and timer (models/timing.py): it must wait for the device, or GPU timings count kernel launches only;
best-of timings keep their spread; the GEMM probe leaves the caller's random stream alone; a cost curve's monotone fit
removes what noise added."""

from __future__ import annotations

import time

import pytest
import torch

from models.timing import Timing, best_of, clock, gemm_seconds, interleaved, monotone, steady, synchronize, timed


def test_cpu_clock_is_wall_time_and_timed_calls_once():
    calls = []
    seconds = timed(lambda: (calls.append(1), time.sleep(0.02)), "cpu")
    assert calls == [1] and 0.02 <= seconds < 0.5
    synchronize(None)  # nothing to wait for
    a = clock(torch.device("cpu"))
    assert clock() >= a


def test_a_timing_keeps_its_best_and_its_spread():
    t = Timing((0.012, 0.010, 0.011, 0.020, 0.011))
    assert t.best == 0.010 and t.median == 0.011 and t.spread == pytest.approx(0.1)
    assert Timing((0.5,)).spread == 0.0


def test_best_of_warms_up_untimed_and_stops_after_one_call_when_slow():
    calls = []
    t = best_of(lambda: calls.append(1), reps=4, warmup=2)
    assert len(calls) == 6 and len(t.samples) == 4
    slow = []
    t = best_of(lambda: (slow.append(1), time.sleep(0.02)), reps=5, slow_s=0.01)
    assert len(slow) == 2 and len(t.samples) == 1 and t.best >= 0.02


def test_interleaved_times_the_calls_in_turn_within_each_repetition():
    order = []
    times = interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, reps=3)
    assert order == ["a", "b"] * 4 and {k: len(t.samples) for k, t in times.items()} == {"a": 3, "b": 3}


def test_a_wide_timing_is_measured_again_with_its_calls_pooled_and_bounded():
    """A busy host's attempt (wide) is measured again; the calls are pooled, so a later attempt slowed throughout
    (tight but slow) cannot replace a faster best; a host busy every time stops after the retries."""
    attempts = iter([Timing((10.0, 15.0, 16.0)), Timing((14.0, 14.1, 14.2)), Timing((10.0, 10.2, 10.3))])
    t = steady(lambda: next(attempts), max_spread=0.10, retries=2)
    assert t.best == 10.0 and len(t.samples) == 9 and t.spread == pytest.approx(0.4)  # keeping the tightest: 14.0
    calls = []
    t = steady(lambda: (calls.append(1), Timing((1.0, 2.0, 3.0)))[1], max_spread=0.10, retries=2)
    assert len(calls) == 3 and t.best == 1.0 and t.spread == pytest.approx(1.0)
    assert len(steady(lambda: Timing((1.0, 1.01)), retries=2).samples) == 2  # tight at once: measured once


def test_the_gemm_probe_leaves_the_callers_random_stream_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    t = gemm_seconds(torch.float32, n=64, reps=2)
    assert torch.equal(torch.rand(3), expected) and len(t.samples) == 2 and t.best > 0


def test_the_best_gemm_rate_is_the_fastest_shapes(monkeypatch):
    import models.timing as timing

    seconds = {(8, 8, 8): 1.0, (4, 8, 16): 0.5}  # 1,024 FLOP in 1 s; 1,024 FLOP in 0.5 s
    monkeypatch.setattr(timing, "gemm_seconds", lambda dtype, reps, shape: Timing((seconds[shape],)))
    assert timing.best_gemm_rate(torch.float32, tuple(seconds)) == (2048.0, (4, 8, 16))
    assert gemm_seconds(torch.float32, reps=1, shape=(3, 5, 7)).best > 0  # a non-square shape runs


def test_the_monotone_fit_takes_the_lower_envelope():
    """Noise only adds time to a best-of timing: a 2-row forward timed below a 1-row one lowers the 1-row cost, and
    a spike at 5 rows is removed instead of carried to 6-8 rows (a running maximum would carry it)."""
    noisy = {1: 41.5, 2: 30.7, 5: 108.3, 8: 67.7}
    fit = monotone(noisy)
    assert fit == {1: 30.7, 2: 30.7, 5: 67.7, 8: 67.7} and list(fit) == [1, 2, 5, 8]
    clean = {1: 40.0, 2: 43.0, 4: 64.0}
    assert monotone(clean) == clean


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
