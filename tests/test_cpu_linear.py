"""The CPU small-row linear routing (infer/kernels/cpu_linear.py)."""

import copy

import torch

from infer.generate import generate_speculative, generate_vanilla
from infer.kernels import cpu_linear
from infer.proposers import DraftModelProposer
from infer.sampling import SamplingParams
from tests.conftest import tiny_llama


def test_both_layouts_agree_and_routing_follows_the_measured_choice():
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 80, bias=True)
    for layout in cpu_linear.LAYOUTS:
        for rows in (1, 3, 8, 16, 40):
            x0 = torch.randn(2, rows, 48) if rows % 2 == 0 else torch.randn(rows, 48)
            # also a column-major input, as an elementwise op after a w_x layer produces
            for x in (x0, x0.reshape(-1, 48).t().contiguous().t()):
                with torch.no_grad():
                    routed = cpu_linear.small_rows_linear(lin, x, (layout,) * len(cpu_linear.BUCKETS))
                    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
                assert routed.shape == plain.shape and routed.is_contiguous()
                torch.testing.assert_close(routed, plain, rtol=1e-5, atol=1e-6)
    # the transposed copy follows in-place weight updates (a target trained between two reports)
    with torch.no_grad():
        lin.weight.mul_(2.0)
        x = torch.randn(2, 48)
        torch.testing.assert_close(
            cpu_linear.small_rows_linear(lin, x, ("x_wt",) * 5), torch.nn.functional.linear(x, lin.weight, lin.bias)
        )
    # a weight made under inference_mode (a proposer's fused snapshot built inside a decode) has no version counter:
    # the transposed copy is keyed by its storage, inside and outside inference_mode, and follows a replaced weight
    with torch.inference_mode():
        made = torch.nn.Linear(48, 80, bias=False)
        made.weight = torch.nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
    assert made.weight.is_inference()
    x = torch.randn(2, 48)
    for ctx in (torch.inference_mode, torch.no_grad):
        with ctx():
            torch.testing.assert_close(cpu_linear.small_rows_linear(made, x, ("x_wt",) * 5), x @ made.weight.t())
    with torch.inference_mode():
        made.weight = torch.nn.Parameter(made.weight * 3.0, requires_grad=False)
        torch.testing.assert_close(cpu_linear.small_rows_linear(made, x, ("x_wt",) * 5), x @ made.weight.t())
    # with grad enabled the plain path runs (training is never rerouted): gradients flow as usual
    x = torch.randn(3, 48, requires_grad=True)
    cpu_linear.small_rows_linear(lin, x, ("w_x",) * len(cpu_linear.BUCKETS)).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_a_row_count_takes_a_larger_buckets_kernel_where_that_is_faster():
    """One row padded to two where two rows measured faster (the vanilla step on an avx512 EPYC: 43 vs 31 ms), and
    the padded call gives the plain result row for row."""
    times = [("x_wt", 0.043), ("w_x", 0.031), ("w_x", 0.045), ("w_x", 0.039), ("linear", 0.05)]
    assert cpu_linear.lower_envelope(times) == ("w_x@2", "w_x", "w_x@8", "w_x", "linear")
    assert cpu_linear.lower_envelope([("x_wt", 0.030), ("w_x", 0.0295)] + times[2:])[:2] == ("x_wt", "w_x")  # noise
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 80, bias=True)
    for layouts in (("w_x@2",) * 5, ("linear@4",) * 5, ("x_wt@16",) * 5):
        for x in (torch.randn(1, 48), torch.randn(1, 3, 48)):
            with torch.no_grad():
                routed = cpu_linear.small_rows_linear(lin, x, layouts)
            assert routed.shape == (*x.shape[:-1], 80)
            torch.testing.assert_close(routed, torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_install_measures_once_and_keeps_greedy_decoding_identical(tiny_target, tiny_draft, monkeypatch):
    """Forced routing (as if the other layouts were measured faster): vanilla and speculative greedy outputs are the
    same tokens as before; a second install does not time again."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    params = SamplingParams(max_new_tokens=20)
    cpu_linear.uninstall(tiny_target.model)  # a measure() in an earlier test may have installed its own choice
    before = generate_vanilla(tiny_target, [prompt], params).tokens
    forced = ("x_wt", "w_x", "w_x", "linear", "w_x")
    monkeypatch.setattr(cpu_linear, "MEASURED", {})  # no choice measured by an earlier test
    monkeypatch.setattr(cpu_linear, "choose_layouts", lambda w, reps=5: forced)
    choices = cpu_linear.install(tiny_target.model, log=lambda m: None)
    assert choices and all(c == forced for c in choices.values())
    monkeypatch.setattr(cpu_linear, "choose_layouts", lambda w, reps=5: (_ for _ in ()).throw(AssertionError))
    assert cpu_linear.install(tiny_target.model, log=lambda m: None) is choices
    other = tiny_llama(seed=5)  # another model of the same shapes (a fresh drafter snapshot) reuses the measurement
    assert cpu_linear.install(other, log=lambda m: None) == choices
    try:
        assert generate_vanilla(tiny_target, [prompt], params).tokens == before
        spec = generate_speculative(tiny_target, DraftModelProposer(tiny_draft, k=3), [prompt], params)
        assert spec.tokens == before
    finally:  # tiny_target is shared by other tests: restore the plain modules
        cpu_linear.uninstall(tiny_target.model)


def test_the_packed_layout_in_both_dtypes_follows_its_weight_and_is_dropped_by_uninstall():
    """oneDNN's packed weight: the plain result in fp32 and bf16 up to rounding, for batched rows too (a bucket of
    128), rebuilt when the weight changes in place, and gone after `uninstall`."""
    torch.manual_seed(0)
    packed = ("packed",) * len(cpu_linear.BUCKETS)
    # bf16 only where oneDNN packs it (AVX-512 or AVX-NE-CONVERT); the other branch is simulated below, on every host
    dtypes = [(torch.float32, 1e-5)] + [(torch.bfloat16, 1e-2)] * cpu_linear.packs(torch.bfloat16)
    for dtype, tol in dtypes:
        lin = torch.nn.Linear(64, 96, bias=True).to(dtype)
        for rows in (1, 4, 96):
            x = torch.randn(rows, 64, dtype=dtype)
            with torch.no_grad():
                routed = cpu_linear.small_rows_linear(lin, x, packed)
                plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
            assert routed.dtype == dtype and routed.shape == plain.shape
            torch.testing.assert_close(routed.float(), plain.float(), rtol=tol, atol=tol)
        with torch.no_grad():
            lin.weight.mul_(-2.0)
            x = torch.randn(3, 64, dtype=dtype)
            torch.testing.assert_close(
                cpu_linear.small_rows_linear(lin, x, packed).float(),
                torch.nn.functional.linear(x, lin.weight, lin.bias).float(),
                rtol=tol,
                atol=tol,
            )
    model = torch.nn.Sequential(lin)
    model._drafters_cpu_linear = {}
    assert "packed" in lin.__dict__["_drafters_weights"]
    replica = copy.deepcopy(model)  # a replica in another dtype (the fp32 certificate) copies none of it
    assert not replica[0].__dict__["_drafters_weights"] and torch.equal(replica[0].weight, lin.weight)
    cpu_linear.uninstall(model)
    assert "_drafters_weights" not in lin.__dict__


def test_install_routes_bf16_layers(monkeypatch):
    """bf16 layers are measured and routed as fp32 ones are (fp16 ones are left alone)."""
    monkeypatch.setattr(cpu_linear, "MEASURED", {})
    # x_wt: a layout every CPU runs in bf16 (packing bf16 needs AVX-512, see below)
    monkeypatch.setattr(cpu_linear, "choose_layouts", lambda w, reps=3: ("x_wt",) * len(cpu_linear.BUCKETS))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16).bfloat16(), torch.nn.Linear(16, 8).half())
    choices = cpu_linear.install(model, log=lambda m: None)
    assert list(choices) == [(16, 8)]
    assert "forward" in model[0].__dict__ and "forward" not in model[1].__dict__
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(
            model[0](x).float(),
            torch.nn.functional.linear(x, model[0].weight, model[0].bias).float(),
            rtol=1e-2,
            atol=1e-2,
        )
    cpu_linear.uninstall(model)


def test_install_builds_the_weight_copies_its_routes_read_before_the_first_call(monkeypatch):
    """The packed weight and Wᵀ exist once `install` returns (a proposer's drafter snapshot is routed outside the
    timed decode and would otherwise pack inside it), each only where a bucket routes to it, and are not rebuilt by
    the first call."""
    monkeypatch.setattr(cpu_linear, "MEASURED", {})
    fp32_packs = cpu_linear.packs(torch.float32)
    plain = ("linear",) * len(cpu_linear.BUCKETS)
    by_shape = {
        (16, 8): ("packed@2",) * len(cpu_linear.BUCKETS) if fp32_packs else plain,  # no oneDNN: nothing to pack
        (8, 16): ("linear", "x_wt", *("linear",) * 6),
        (4, 8): plain,
    }
    monkeypatch.setattr(cpu_linear, "choose_layouts", lambda w, reps=3: by_shape[tuple(w.shape)])
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    cpu_linear.install(model, log=lambda m: None)
    built = [set(m.__dict__.get("_drafters_weights", {})) for m in model]
    assert built == [{"packed"} if fp32_packs else set(), {"wt"}, set()]
    copies = [dict(m.__dict__.get("_drafters_weights", {})) for m in model]
    with torch.no_grad():
        y = model(torch.randn(2, 8))
    assert y.shape == (2, 4)
    for m, before in zip(model, copies):
        after = m.__dict__.get("_drafters_weights", {})
        assert all(after[name][1] is copy_[1] for name, copy_ in before.items())
    cpu_linear.uninstall(model)


def test_a_cpu_that_cannot_pack_bf16_times_the_other_layouts_only(monkeypatch):
    """On an AVX2-only CPU oneDNN's bf16 reorder raises: `packs` says no there, and the bf16 race leaves the packed
    layout out (its pack is never called) while fp32 keeps it."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not cpu_linear.packs(torch.bfloat16) and cpu_linear.packs(torch.float32)

    def refuse(weight):
        raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq")

    monkeypatch.setattr(cpu_linear, "pack", lambda w: refuse(w) if w.dtype == torch.bfloat16 else torch.zeros(()))
    monkeypatch.setattr(cpu_linear, "packed_matmul", lambda x, p: torch.zeros(x.shape[0], 8, dtype=x.dtype))
    monkeypatch.setattr(cpu_linear, "MAX_COPIES", 2)
    chosen = cpu_linear.choose_layouts(torch.randn(8, 16).bfloat16(), reps=1)
    assert len(chosen) == len(cpu_linear.BUCKETS) and not any(c.startswith("packed") for c in chosen)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert cpu_linear.packs(torch.bfloat16)
