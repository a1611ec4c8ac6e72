"""The shape-invariant mode (infer/kernels/shape_invariant.py): greedy speculative decoding bit-identical to vanilla.

Without the mode, bitwise equality does not hold here for fp32 (every row differs, ~1e-6: MKL's gemv vs gemm) and
holds or not for bf16 depending on the model and the context length (sdpa); `python -m eval.invariance` measures it.
These tests assert only what the mode promises, not what the default path happens to do.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from infer.generate import generate_speculative, generate_vanilla
from infer.kernels import cpu_linear
from infer.kernels.shape_invariant import (
    NAME,
    blocked_linear,
    install,
    invariant_attention,
    rows_of,
    shape_invariant,
    uninstall,
)
from infer.proposers import DraftModelProposer, PromptLookupProposer
from infer.sampling import SamplingParams
from models.target import TargetModel
from tests.conftest import tiny_llama

# repeated phrases: prompt lookup drafts a mix of right and wrong tokens
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [40, 41, 42, 43, 44, 45, 40, 41, 42, 43], [11, 3, 11, 3, 11]]
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=20)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def target(request):
    return TargetModel(tiny_llama(seed=0).to(request.param))


@pytest.fixture(scope="module")
def noisy_draft():
    """The target's fp32 weights with noise on the head: a draft model that is right about half the time."""
    draft = tiny_llama(seed=0)
    with torch.no_grad():
        noise = torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(1))
        draft.lm_head.weight.add_(0.3 * draft.lm_head.weight.std() * noise)
    return draft


def record_logits(model):
    """Every forward's (input_ids, position_ids, attention_mask, logits) of batch row 0, and the hook's handle."""
    calls = []

    def hook(module, args, kwargs, out):
        calls.append((kwargs["input_ids"][0], kwargs.get("position_ids"), kwargs.get("attention_mask"), out.logits[0]))

    return calls, model.register_forward_hook(hook, with_kwargs=True)


def vanilla_rows(calls, prompt: list[int]) -> dict[int, torch.Tensor]:
    """Batch-1 vanilla: a prefill of prompt[:-1], then one call per token; the logits by the scored token's position."""
    return {len(prompt) - 1 + i: logits[-1] for i, (_, _, _, logits) in enumerate(calls[1:])}


def verify_rows(calls, sequence: list[int]) -> dict[int, torch.Tensor]:
    """Verify forwards: the logits of every node on the final sequence's path (the node and all its ancestors hold
    the sequence's tokens at their positions), by position. Rejected nodes and their subtrees are left out."""
    seq = torch.tensor(sequence)
    rows = {}
    for ids, positions, mask, logits in calls[1:]:
        n = ids.shape[0]
        pos = positions[0]
        ok = (pos < len(sequence)) & (ids == seq[pos.clamp(max=len(sequence) - 1)])
        ancestors = mask[0, 0, :, -n:] == 0  # [n, n] ancestor-or-self
        on_path = (~ancestors | ok[None, :]).all(1)
        rows.update({int(pos[j]): logits[j] for j in on_path.nonzero()[:, 0].tolist()})
    return rows


PROPOSERS = {
    "lookup-chain": lambda draft: PromptLookupProposer(num_draft=4),
    "lookup-tree": lambda draft: PromptLookupProposer(num_draft=3, num_candidates=3),
    "draft-chain": lambda draft: DraftModelProposer(draft, k=3),
}


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("name", sorted(PROPOSERS))
def test_speculative_logits_are_bitwise_vanilla_in_the_mode(target, noisy_draft, name, rows):
    """Greedy speculative tokens equal vanilla's, and every position's logits are bitwise equal to vanilla's."""
    accepted, rejected = 0, 0
    with shape_invariant(target.model, rows=rows):
        for prompt in PROMPTS:
            calls, handle = record_logits(target.model)
            vanilla = generate_vanilla(target, [prompt], PARAMS).tokens[0]
            expected = vanilla_rows(calls, prompt)
            calls.clear()
            spec = generate_speculative(target, PROPOSERS[name](noisy_draft), [prompt], PARAMS)
            handle.remove()
            assert spec.tokens[0] == vanilla
            got = verify_rows(calls, prompt + vanilla)
            assert set(expected) <= set(got)  # every position vanilla scored was verified once on the path
            for pos, logits in expected.items():
                assert torch.equal(got[pos], logits), f"position {pos}: max |Δ| {(got[pos] - logits).abs().max()}"
            accepted += sum(spec.stats.accepted_at_depth)
            rejected += sum(spec.stats.attempted_at_depth) - sum(spec.stats.accepted_at_depth)
    assert accepted > 0 and rejected > 0  # the drafts were a mix of right and wrong


def test_batched_rows_equal_single_rows_in_the_mode(target):
    """Rows of a batch (left padding, holes after uneven acceptance) decode as they do alone."""
    with shape_invariant(target.model):
        singles = [generate_vanilla(target, [p], PARAMS).tokens[0] for p in PROMPTS]
        assert generate_vanilla(target, PROMPTS, PARAMS).tokens == singles
        assert generate_speculative(target, PromptLookupProposer(num_draft=4), PROMPTS, PARAMS).tokens == singles


def test_invariant_attention_is_attention():
    """Same function as sdpa up to fp32 rounding: GQA, a batch of 2, a tree mask with holes, more keys than a chunk."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    B, n, S, D = 2, 5, 150, 16
    q, k, v = torch.randn(B, 4, n, D), torch.randn(B, 2, S, D), torch.randn(B, 2, S, D)
    allowed = torch.rand(B, n, S) < 0.6
    allowed[:, :, -n:] = torch.eye(n, dtype=torch.bool) | (torch.rand(n, n) < 0.5).tril()
    mask = torch.zeros(B, 1, n, S).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    out, _ = invariant_attention(module, q, k, v, mask, scaling=D**-0.5)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=D**-0.5)
    assert out.shape == ref.shape == (B, n, 4, D)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_blocked_linear_rows_do_not_depend_on_the_others():
    torch.manual_seed(0)
    w, x = torch.randn(80, 48), torch.randn(2, 7, 48)
    f = lambda b: F.linear(b, w)
    with torch.no_grad():
        together = blocked_linear(x, f, rows=4)  # 14 rows: blocks of 4, the last padded
        alone = torch.stack([blocked_linear(r[None], f, rows=4)[0] for r in x.reshape(-1, 48)])
    assert torch.equal(together.reshape(-1, 80), alone)
    torch.testing.assert_close(together, F.linear(x, w))
    x.requires_grad_(True)  # training calls run unchanged, with gradients
    blocked_linear(x, f, rows=4).sum().backward()
    assert x.grad is not None


def test_install_composes_with_cpu_linear_and_uninstall_restores(monkeypatch):
    """Installed after cpu_linear's routing, the mode wraps the routed forwards (and stays invariant); uninstall
    restores them and the attention implementation; cpu_linear after the mode is refused."""
    model = tiny_llama(seed=3)
    target = TargetModel(model)
    monkeypatch.setattr(cpu_linear, "MEASURED", {})
    monkeypatch.setattr(cpu_linear, "choose_layouts", lambda w, reps=3: ("x_wt", "w_x", "w_x", "x_wt", "w_x"))
    cpu_linear.install(model, log=lambda m: None)
    routed = model.lm_head.__dict__["forward"]
    install(model, rows=4)
    try:
        assert rows_of(model) == 4 and model.config._attn_implementation == NAME
        with pytest.raises(RuntimeError, match="already installed"):
            install(model)
        prompt = PROMPTS[0]
        calls, handle = record_logits(model)
        vanilla = generate_vanilla(target, [prompt], PARAMS).tokens[0]
        expected = vanilla_rows(calls, prompt)
        calls.clear()
        assert generate_speculative(target, PromptLookupProposer(num_draft=4), [prompt], PARAMS).tokens[0] == vanilla
        handle.remove()
        got = verify_rows(calls, prompt + vanilla)
        assert all(torch.equal(got[p], logits) for p, logits in expected.items())
    finally:
        uninstall(model)
    assert rows_of(model) is None and model.config._attn_implementation == "sdpa"
    assert model.lm_head.__dict__["forward"] is routed
    cpu_linear.uninstall(model)

    with shape_invariant(model), pytest.raises(RuntimeError, match="shape-invariant"):
        cpu_linear.install(model, log=lambda m: None)
    assert "forward" not in model.lm_head.__dict__
