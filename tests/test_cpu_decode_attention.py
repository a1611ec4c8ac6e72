"""The CPU one-pass decode attention (infer/kernels/cpu_decode_attention.py) against HF's SDPA function: every layout
the answerer's cache hands it (prefix views of a buffer with spare slots, grouped heads, masked holes, a first block
with nothing visible), its fallbacks, and greedy decoding with and without it.

Which loops run depends on the host: with AVX512-BF16, a bf16 cache's scores at head sizes 64 and 128 take the bf16
dot products; with AVX-512, the other sizes that are multiples of 16 take the fp32 intrinsics; elsewhere the portable
loops run. `test_every_instruction_path_equals_sdpa` builds the kernel with those extensions compiled out too, so
every path a host might take is tested on whatever host runs the suite (a host cannot run what it lacks, so the
paths compile out, never in)."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from infer.continuous import decode_continuous
from infer.kernels import cpu_decode_attention as cda
from infer.sampling import SamplingParams
from models.target import TargetModel
from tests.conftest import tiny_llama


class _Module(torch.nn.Module):
    """What HF's SDPA function reads from the attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _case(B, Hq, Hkv, S, D, dtype, seed=0, spare=23):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, S + spare, D, generator=g).to(dtype)[:, :, :S]  # a prefix view, as SlackCache hands out
    v = torch.randn(B, Hkv, S + spare, D, generator=g).to(dtype)[:, :, :S]
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    allowed = torch.rand(B, 1, 1, S, generator=g) > 0.3
    allowed[..., -1] = True  # the query's own slot
    allowed[0, ..., : min(S - 1, 70)] = False  # row 0: its first block (and more) holds only holes
    return q, k, v, allowed


def _additive(allowed, dtype):
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def test_the_kernel_builds():
    assert cda.available(), "the C++ kernel did not build on this host (see the logged warning)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [(3, 9, 3, 130, 64), (2, 4, 2, 7, 128), (4, 6, 6, 64, 48), (2, 8, 1, 1, 64)],
    ids=["grouped-64", "short-128", "no-groups-generic-dim", "one-slot"],
)
@pytest.mark.parametrize("mask_kind", ["additive", "bool", "none"])
def test_equals_sdpa(dtype, shape, mask_kind):
    B, Hq, Hkv, S, D = shape
    q, k, v, allowed = _case(B, Hq, Hkv, S, D, dtype)
    mask = {"additive": _additive(allowed, dtype), "bool": allowed, "none": None}[mask_kind]
    module = _Module(Hq // Hkv)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, 0.0, D**-0.5, is_causal=False)
    out, none = cda.decode_attention(module, q, k, v, mask, 0.0, D**-0.5)
    assert none is None and out.shape == ref.shape == (B, 1, Hq, D) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    else:  # both keep fp32 inside and round once: at most a unit or two in the last place of bf16
        assert (out.float() - ref.float()).abs().max() <= 2 * 2**-8 * ref.float().abs().max()


@pytest.mark.parametrize(
    "without",
    [
        (),
        pytest.param(("avx512bf16",), marks=pytest.mark.integration),
        pytest.param(("avx512f",), marks=pytest.mark.integration),
    ],
    ids=["this-host", "no-avx512bf16", "no-avx512"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_left_padded_row_skips_its_masked_blocks_and_answers_the_same(dtype, without, monkeypatch):
    """Rows padded on the left, as a batch of unequal contexts is: the blocks before a row's first readable slot are
    not read (NaN there does not reach the output), and the output is bitwise the one with zeros there, and SDPA's;
    in this host's build and in the builds of hosts without AVX512-BF16 or AVX-512 (integration tier)."""
    if without:
        build = cda._module(without)
        assert build is not None, f"the kernel did not build without {without}"
        monkeypatch.setattr(cda, "_module", lambda: build)
    B, Hq, Hkv, S, D = 4, 9, 3, 300, 64
    q, k, v, _ = _case(B, Hq, Hkv, S, D, dtype, seed=3)
    allowed = torch.ones(B, 1, 1, S, dtype=torch.bool)
    for row, pad in enumerate((0, 64, 150, 299)):  # none; one whole block; two blocks and part of a third; all but one
        allowed[row, ..., :pad] = False
    mask = _additive(allowed, torch.float32)
    module = _Module(Hq // Hkv)
    zero_k, zero_v = k.clone(), v.clone()
    nan_k, nan_v = k.clone(), v.clone()
    for row, pad in enumerate((0, 64, 150, 299)):
        whole = pad // 64 * 64  # the masked blocks the kernel skips
        zero_k[row, :, :pad] = zero_v[row, :, :pad] = 0.0
        nan_k[row, :, :whole] = nan_v[row, :, :whole] = float("nan")
        nan_k[row, :, whole:pad] = nan_v[row, :, whole:pad] = 0.0
    zeros, _ = cda.decode_attention(module, q, zero_k, zero_v, mask, 0.0, D**-0.5)
    nans, _ = cda.decode_attention(module, q, nan_k, nan_v, mask, 0.0, D**-0.5)
    assert torch.equal(nans, zeros)
    ref, _ = sdpa_attention_forward(module, q, zero_k, zero_v, mask.to(dtype), 0.0, D**-0.5, is_causal=False)
    if dtype == torch.float32:
        torch.testing.assert_close(zeros, ref, atol=2e-6, rtol=1e-5)
    else:
        assert (zeros.float() - ref.float()).abs().max() <= 2 * 2**-8 * ref.float().abs().max()


@pytest.mark.integration  # two more builds of the kernel (~20 s each)
@pytest.mark.parametrize("without", [("avx512bf16",), ("avx512f",)], ids=["no-avx512bf16", "no-avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_instruction_path_equals_sdpa(without, dtype, monkeypatch):
    """The kernel as a host without AVX512-BF16 (the fp32 intrinsics) or without AVX-512 (the portable loops)
    compiles it, against SDPA, grouped and not, at head sizes 64, 128 and 48."""
    build = cda._module(without)
    assert build is not None, f"the kernel did not build without {without}"
    monkeypatch.setattr(cda, "_module", lambda: build)
    for B, Hq, Hkv, S, D in [(3, 9, 3, 130, 64), (2, 4, 2, 7, 128), (4, 6, 6, 64, 48), (2, 8, 1, 70, 64)]:
        q, k, v, allowed = _case(B, Hq, Hkv, S, D, dtype)
        mask = _additive(allowed, dtype)
        module = _Module(Hq // Hkv)
        ref, _ = sdpa_attention_forward(module, q, k, v, mask, 0.0, D**-0.5, is_causal=False)
        out, _ = cda.decode_attention(module, q, k, v, mask, 0.0, D**-0.5)
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
        else:
            assert (out.float() - ref.float()).abs().max() <= 2 * 2**-8 * ref.float().abs().max()


def test_one_mask_row_broadcast_over_the_batch():
    q, k, v, allowed = _case(3, 6, 2, 40, 64, torch.float32)
    mask = _additive(allowed[:1], torch.float32)  # [1, 1, 1, S], as HF builds for an unpadded batch
    module = _Module(3)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, 0.0, 0.125, is_causal=False)
    torch.testing.assert_close(cda.decode_attention(module, q, k, v, mask, 0.0, 0.125)[0], ref, atol=2e-6, rtol=1e-5)


def test_a_mask_of_another_width_is_refused_as_sdpa_refuses_it():
    q, k, v, allowed = _case(2, 6, 2, 40, 64, torch.float32)
    mask = _additive(torch.cat([allowed, torch.ones(2, 1, 1, 5, dtype=torch.bool)], -1), torch.float32)
    module = _Module(3)
    with pytest.raises(RuntimeError):
        sdpa_attention_forward(module, q, k, v, mask, 0.0, 0.125, is_causal=False)
    with pytest.raises(RuntimeError, match="mask"):
        cda.decode_attention(module, q, k, v, mask, 0.0, 0.125)


@pytest.mark.parametrize("case", ["mask-per-head", "sliding-window", "dropout"])
def test_what_the_kernel_lacks_goes_to_sdpa(case, monkeypatch):
    def refuse(*args):
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(cda, "one_query_attention", refuse)
    q, k, v, allowed = _case(2, 6, 2, 40, 64, torch.float32)
    mask, kwargs, dropout = _additive(allowed, torch.float32), {}, 0.0
    if case == "mask-per-head":
        mask = mask.expand(2, 6, 1, 40).clone()
        mask[:, 1:, :, :3] = torch.finfo(torch.float32).min
    elif case == "sliding-window":
        kwargs = {"sliding_window": 16}
    else:
        dropout = 0.5
    module = _Module(3)
    torch.manual_seed(0)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, dropout, 0.125, is_causal=False, **kwargs)
    torch.manual_seed(0)
    assert torch.equal(cda.decode_attention(module, q, k, v, mask, dropout, 0.125, is_causal=False, **kwargs)[0], ref)


def test_longer_queries_go_to_sdpa_unchanged():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 5, 64, generator=g)
    k, v = torch.randn(2, 2, 9, 64, generator=g), torch.randn(2, 2, 9, 64, generator=g)
    mask = _additive(torch.ones(2, 1, 5, 9, dtype=torch.bool).tril(4), torch.float32)
    module = _Module(2)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, 0.0, 0.125)
    assert torch.equal(cda.decode_attention(module, q, k, v, mask, 0.0, 0.125)[0], ref)


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cda.ENV_VAR, "0")
    model = tiny_llama()
    with cda.one_pass_decode(model) as on:
        assert not on and model.config._attn_implementation == "sdpa"


def test_switched_on_only_for_a_cpu_model_on_sdpa_where_the_kernel_builds(monkeypatch):
    eager = tiny_llama()
    eager.set_attn_implementation("eager")
    with cda.one_pass_decode(eager) as on:  # another implementation keeps its own numerics everywhere
        assert not on and eager.config._attn_implementation == "eager"

    class OnCuda:  # a CUDA model, simulated: only its device and config are read
        device = torch.device("cuda")
        config = tiny_llama().config

    with cda.one_pass_decode(OnCuda()) as on:
        assert not on
    monkeypatch.setattr(cda, "_module", lambda: None)  # a host where the build failed
    model = tiny_llama()
    with cda.one_pass_decode(model) as on:
        assert not on and model.config._attn_implementation == "sdpa"


def test_a_failed_build_leaves_sdpa_and_says_why(monkeypatch, caplog):
    import torch.utils.cpp_extension as ext

    def no_compiler(**kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(ext, "load_inline", no_compiler)
    assert cda._module.__wrapped__() is None  # the uncached build
    assert "could not be built (no compiler here)" in caplog.text


def test_the_mask_rows_follow_the_mask_object():
    first = _additive(torch.rand(3, 1, 1, 20) > 0.5, torch.bfloat16)
    second = torch.rand(3, 1, 1, 20) > 0.5
    rows = cda._mask_rows(first, 3)
    assert cda._mask_rows(first, 3) is rows  # every layer of one forward: built once
    assert torch.equal(rows, first[:, 0, 0].float())
    fresh = cda._mask_rows(second, 3)  # the next forward's mask: built again
    assert torch.equal(fresh == 0, second[:, 0, 0]) and cda._mask_rows(None, 3).numel() == 0


def test_continuous_decoding_attends_through_it_and_gives_the_same_tokens(monkeypatch):
    target = TargetModel(tiny_llama(layers=2, seed=3))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 17, 1, 40, 9, 23, 3)]
    params = SamplingParams(max_new_tokens=24)

    def run() -> tuple[dict[int, list[int]], set[str]]:
        queue, done, seen = list(enumerate(prompts)), {}, set()

        def on_done(key, tokens):
            seen.add(target.model.config._attn_implementation)
            done[key] = tokens

        submit = lambda n: [queue.pop(0) for _ in range(min(n, len(queue)))]  # noqa: E731
        decode_continuous(target, submit, on_done, params, eos_ids=(), batch_size=3, refill=1)
        return done, seen

    fused, seen = run()
    assert seen == {cda.NAME} and target.model.config._attn_implementation == "sdpa"  # restored after the loop
    monkeypatch.setenv(cda.ENV_VAR, "0")
    plain, seen = run()
    assert seen == {"sdpa"}
    assert fused == plain and len(plain) == len(prompts)


def _draft_case(B, Hq, Hkv, q, S, D, dtype, seed=0):
    """A verified draft's attention call: ``q`` query rows after a cache of ``S`` slots (a prefix view of a buffer
    with spare slots), each row reading the cache and a tree's ancestors; the mask shared over heads."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, S + q + 9, D, generator=g).to(dtype)[:, :, : S + q]
    v = torch.randn(B, Hkv, S + q + 9, D, generator=g).to(dtype)[:, :, : S + q]
    query = torch.randn(B, Hq, q, D, generator=g).to(dtype)
    allowed = torch.rand(B, 1, q, S + q, generator=g) > 0.2
    allowed[..., S:] = torch.ones(q, q, dtype=torch.bool).tril() & (torch.rand(B, 1, q, q, generator=g) > 0.3)
    allowed[..., S:] |= torch.eye(q, dtype=torch.bool)  # every node reads itself
    return query, k, v, allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 9, 3, 4, 300, 64), (3, 4, 2, 13, 37, 32), (2, 8, 1, 2, 5, 16)])
@pytest.mark.parametrize("mask_kind", ["additive", "bool"])
@pytest.mark.parametrize("route", ["decode", "verify"])
def test_a_masked_grouped_draft_reads_the_heads_in_place_and_equals_sdpa(dtype, shape, mask_kind, route, monkeypatch):
    B, Hq, Hkv, q, S, D = shape
    query, k, v, allowed = _draft_case(B, Hq, Hkv, q, S, D, dtype)
    mask = _additive(allowed, dtype) if mask_kind == "additive" else allowed
    module = _Module(Hq // Hkv)
    ref, _ = sdpa_attention_forward(module, query, k, v, mask, 0.0, D**-0.5)

    import transformers.integrations.sdpa_attention as hf_sdpa

    def no_copies(*args):
        raise AssertionError("the grouped heads were copied (repeat_kv)")

    monkeypatch.setattr(hf_sdpa, "repeat_kv", no_copies)
    monkeypatch.setattr(cda, "sdpa_attention_forward", no_copies)
    call = cda.decode_attention if route == "decode" else cda.verify_attention
    out, none = call(module, query, k, v, mask, 0.0, D**-0.5)
    assert none is None and out.shape == ref.shape == (B, q, Hq, D) and out.dtype == dtype
    assert torch.equal(out, ref)  # the same kernel and summation order, only the copies gone


def test_the_verify_route_leaves_every_other_call_to_hf(monkeypatch):
    def refuse(*args):
        raise AssertionError("served by the shared-heads route or the kernel")

    monkeypatch.setattr(cda, "shared_heads_attention", refuse)
    monkeypatch.setattr(cda, "one_query_attention", refuse)
    g = torch.Generator().manual_seed(2)
    one = torch.randn(2, 6, 1, 32, generator=g)  # a decoding step, vanilla's included
    k, v = torch.randn(2, 2, 11, 32, generator=g), torch.randn(2, 2, 11, 32, generator=g)
    mask = _additive(torch.rand(2, 1, 1, 11, generator=g) > 0.3, torch.float32)
    prefill = torch.randn(2, 6, 11, 32, generator=g)  # unmasked: HF's own causal path, which shares the heads
    equal_heads = torch.randn(2, 2, 4, 32, generator=g)  # no groups: nothing to copy
    for query, m, groups in ((one, mask, 3), (one, None, 3), (prefill, None, 3), (equal_heads, mask[..., :1, :], 1)):
        if query.shape[2] > 1 and m is not None:
            m = m.expand(2, 1, query.shape[2], 11)
        module = _Module(groups)
        ref, _ = sdpa_attention_forward(module, query, k, v, m, 0.0, 0.125)
        assert torch.equal(cda.verify_attention(module, query, k, v, m, 0.0, 0.125)[0], ref)
    monkeypatch.setenv(cda.ENV_VAR, "0")  # the A/B switch turns the route off as well
    query, k, v, allowed = _draft_case(1, 4, 2, 3, 8, 16, torch.float32)
    module = _Module(2)
    ref, _ = sdpa_attention_forward(module, query, k, v, allowed, 0.0, 0.25)
    assert torch.equal(cda.verify_attention(module, query, k, v, allowed, 0.0, 0.25)[0], ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_served_target_verifies_a_draft_as_hf_sdpa_does(dtype):
    from infer.generate import DecodeState, prefill, verify_tree
    from infer.tree import chain

    prompt = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(4)).tolist()

    def verify(target: TargetModel) -> torch.Tensor:
        state = DecodeState([prompt], SamplingParams(max_new_tokens=8), (), "cpu")
        prefill(target, state)
        tokens = torch.cat([state.roots[:, None], torch.tensor([[5, 17, 3, 88]])], 1)
        return verify_tree(target, state, chain(tokens)).logits

    hf = TargetModel(tiny_llama(layers=2, seed=5).to(dtype))
    served = TargetModel(tiny_llama(layers=2, seed=5).to(dtype))
    assert cda.serve_shared_heads(served.model) and served.model.config._attn_implementation == cda.VERIFY_NAME
    assert torch.equal(verify(served), verify(hf))
    with cda.one_pass_decode(served.model) as on:  # the answerer's kernel switches in from the served route and back
        assert on == cda.available()
    assert served.model.config._attn_implementation == cda.VERIFY_NAME


def test_prepare_target_serves_the_shared_heads_on_the_cpu_only():
    from infer.serving import prepare_target

    target = TargetModel(tiny_llama(layers=1))
    prepare_target(target, log=lambda msg: None)
    assert target.model.config._attn_implementation == cda.VERIFY_NAME
    eager = tiny_llama(layers=1)
    eager.set_attn_implementation("eager")
    assert not cda.serve_shared_heads(eager) and eager.config._attn_implementation == "eager"

    class OnCuda:  # a CUDA model, simulated: only its device and config are read
        device = torch.device("cuda")
        config = tiny_llama(layers=1).config

    assert not cda.serve_shared_heads(OnCuda())
