"""EAGLE-3 drafter: shapes per target architecture, the TTT unroll against the inference path, draft vocabulary."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from models.eagle3 import Eagle3Drafter, FusedStep
from models.eagle3_config import Eagle3Config
from models.target import TargetModel
from train.draft_vocab import build_draft_vocab, count_loss_tokens, coverage

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=300,
)
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"head_dim": 8}),
}


def make_target(arch: str = "llama", seed: int = 0) -> TargetModel:
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    return TargetModel(model_cls(config_cls(**TINY, **extra)).eval(), aux_layer_ids=[0, 1, 2])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_from_target_copies_shape_rope_and_frozen_embedding(arch):
    target = make_target(arch)
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=40)
    cfg, tcfg = drafter.config, target.config
    assert cfg.hidden_size == tcfg.hidden_size and cfg.target_hidden_size == tcfg.hidden_size
    assert cfg.head_dim == (ARCHS[arch][2].get("head_dim") or tcfg.hidden_size // tcfg.num_attention_heads)
    assert cfg.max_position_embeddings == 300
    assert cfg.rope_parameters == dict(tcfg.rope_parameters)
    assert drafter.fc.weight.shape == (32, 3 * 32)
    assert drafter.midlayer.self_attn.q_proj.weight.shape == (cfg.num_attention_heads * cfg.head_dim, 64)
    assert drafter.lm_head.weight.shape == (40, 32)
    assert torch.equal(drafter.embed_tokens.weight, target.embed_tokens.weight)
    assert not drafter.embed_tokens.weight.requires_grad
    assert drafter.embed_tokens.weight.data_ptr() != target.embed_tokens.weight.data_ptr()  # a copy, not a view
    # one forward over real target features runs and gives draft-vocab logits
    ids = torch.randint(0, 96, (2, 9))
    feats = target(ids).aux_hidden
    allowed = torch.ones(9, 9, dtype=torch.bool).tril().expand(2, 9, 9)
    logits = drafter(feats, ids, torch.arange(9).expand(2, 9), allowed, ttt_steps=3)
    assert len(logits) == 3 and logits[0].shape == (2, 9, 40)


def test_config_validation():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.from_target(LlamaConfig(**TINY), draft_vocab_size=97)
    with pytest.raises(ValueError, match="multiple"):
        Eagle3Config.from_target(LlamaConfig(**TINY), draft_vocab_size=8, num_key_value_heads=3)


def _inference_chain(drafter, feats, ids, t, depth):
    """Logits at depth ``depth`` for context pairs 0..t, computed the way the runtime does (KV cache + step)."""
    T = t + 1
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    out = drafter.step(drafter.project_features(feats[:, :T]), ids[:, 1 : T + 1], torch.arange(T)[None], causal)
    keys, values, hidden, logits = out.keys, out.values, out.hidden[:, -1:], out.logits[:, -1]
    for d in range(1, depth + 1):  # node at depth d: token ids[t + 1 + d], parent = previous output
        S = keys.shape[2]
        allowed = torch.ones(1, 1, S + 1, dtype=torch.bool)
        out = drafter.step(hidden, ids[:, t + 1 + d : t + 2 + d], torch.tensor([[t + d]]), allowed, keys, values)
        keys, values, hidden, logits = out.keys, out.values, out.hidden, out.logits[:, -1]
    return logits


def test_ttt_unroll_equals_inference_path():
    """Step i of the unroll at position t must equal a depth-i node drafted after context pairs 0..t."""
    target = make_target("llama")
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=96)
    torch.manual_seed(3)
    for p in drafter.parameters():  # norm weights away from 1 so every path is exercised
        if p.requires_grad:
            p.data.add_(0.1 * torch.randn_like(p))
    T = 12
    ids = torch.randint(0, 96, (1, T))
    feats = target(ids).aux_hidden
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        ttt = drafter(feats, ids, torch.arange(T)[None], allowed, ttt_steps=4)
        for t in (0, 3, 6):
            for i in range(4):
                ref = _inference_chain(drafter, feats, ids, t, i)
                torch.testing.assert_close(ttt[i][:, t], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_step_equals_module_step(arch):
    """The runtime's fused snapshot (q/k/v and gate/up fused, norm weights folded) computes what ``step`` computes:
    batch 2, several new tokens, a cache with holes, grouped-query attention, non-unit norm weights."""
    target = make_target(arch)
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=64)
    torch.manual_seed(4)
    for p in drafter.parameters():
        if p.requires_grad:
            p.data.add_(0.3 * torch.randn_like(p))
    fused = FusedStep(drafter)
    B, S, m, H = 2, 7, 3, drafter.config.hidden_size
    kv = (B, drafter.config.num_key_value_heads, S, drafter.config.head_dim)
    past_k, past_v = torch.randn(kv), torch.randn(kv)
    allowed = torch.rand(B, m, S + m) < 0.7
    allowed[..., S:] = torch.eye(m, dtype=torch.bool)  # every query sees itself
    args = (torch.randn(B, m, H), torch.randint(0, 96, (B, m)), torch.randint(0, 250, (B, m)), allowed, past_k, past_v)
    with torch.no_grad():
        want, got = drafter.step(*args), fused.step(*args)
    for name in ("hidden", "logits", "keys", "values"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5, msg=name)
    assert got.logits.argmax(-1).eq(want.logits.argmax(-1)).all()
    torch.testing.assert_close(fused.logits(args[0]), drafter.compute_logits(args[0]), rtol=1e-5, atol=1e-5)


def test_ttt_respects_sample_boundaries():
    """With a block-diagonal mask, the second sample's logits do not depend on the first sample's tokens."""
    target = make_target("llama")
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=96)
    T, cut = 10, 4
    seg = torch.tensor([0] * cut + [1] * (T - cut))
    allowed = ((seg[:, None] == seg[None]) & torch.ones(T, T, dtype=torch.bool).tril())[None]
    pos = torch.cat([torch.arange(cut), torch.arange(T - cut)])[None]
    feats = torch.randn(1, T, 96)
    ids = torch.randint(0, 96, (1, T))
    feats2, ids2 = feats.clone(), ids.clone()
    feats2[:, :cut] = torch.randn(1, cut, 96)
    ids2[:, :cut] = torch.randint(0, 96, (1, cut))
    with torch.no_grad():
        a = drafter(feats, ids, pos, allowed, 2)
        b = drafter(feats2, ids2, pos, allowed, 2)
    torch.testing.assert_close(a[0][:, cut:], b[0][:, cut:])
    torch.testing.assert_close(a[1][:, cut:], b[1][:, cut:])


# ----------------------------------------------------------------------------------- draft vocabulary
def test_draft_vocab_counts_only_loss_tokens_and_maps_ids():
    samples = [
        {"input_ids": [5, 5, 5, 7, 9, 9], "loss_mask": [0, 1, 1, 1, 1, 1]},
        {"input_ids": [3, 3, 3, 3, 9], "loss_mask": [0, 0, 0, 0, 1]},  # token 3 is never a target
    ]
    counts = count_loss_tokens(samples, vocab_size=12)
    assert counts[3] == 0 and counts[5] == 2 and counts[9] == 3 and counts[7] == 1
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size=2)
    used = torch.arange(2) + d2t
    assert used.tolist() == [5, 9]  # the two most frequent, ascending
    assert t2d.nonzero().flatten().tolist() == [5, 9]
    assert coverage(counts, t2d) == pytest.approx(5 / 6)


def test_draft_vocab_pads_with_smallest_unseen_ids():
    counts = torch.zeros(10, dtype=torch.long)
    counts[[4, 8]] = torch.tensor([3, 1])
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size=5)
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 4, 8]
    assert int(t2d.sum()) == 5 and d2t.dtype == torch.int64


def test_draft_vocab_ties_are_deterministic():
    counts = torch.tensor([1, 2, 2, 2, 0, 2])
    d2t, _ = build_draft_vocab(counts, draft_vocab_size=3)
    assert (torch.arange(3) + d2t).tolist() == [1, 2, 3]


def test_set_draft_vocab_maps_draft_ids_to_target_ids():
    drafter = Eagle3Drafter.from_target(make_target(), draft_vocab_size=3)
    counts = torch.zeros(96, dtype=torch.long)
    counts[[10, 50, 90]] = 1
    drafter.set_draft_vocab(*build_draft_vocab(counts, 3))
    assert drafter.draft_to_target.tolist() == [10, 50, 90]
    with pytest.raises(ValueError):
        drafter.set_draft_vocab(torch.zeros(4, dtype=torch.long), torch.zeros(96, dtype=torch.bool))


def test_a_rebuilt_vocabulary_keeps_trained_rows_and_maps_the_target_rows_of_new_ones():
    target = make_target()
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=40)
    old_counts, new_counts = torch.zeros(96, dtype=torch.long), torch.zeros(96, dtype=torch.long)
    old_counts[10:50], new_counts[30:90] = 1, 1
    drafter.set_draft_vocab(*build_draft_vocab(old_counts, 40))
    # a "trained" head that is an exact linear map A of the target's rows: new rows must come out through A
    rows_of = target.lm_head.weight.detach()
    A = torch.randn(32, 32, generator=torch.Generator().manual_seed(3)) / 6
    with torch.no_grad():
        drafter.lm_head.weight.copy_(rows_of[10:50] @ A)
        drafter.fc.weight.normal_()
    new = drafter.with_draft_vocab(*build_draft_vocab(new_counts, 60), target)

    assert new.config.draft_vocab_size == 60 and new.lm_head.weight.shape == (60, 32)
    assert new.draft_to_target.tolist() == list(range(30, 90))
    assert torch.equal(new.lm_head.weight[:20], drafter.lm_head.weight[20:40])  # ids 30..49: the trained rows
    torch.testing.assert_close(new.lm_head.weight[20:], rows_of[50:90] @ A, rtol=1e-3, atol=1e-3)
    for name, value in drafter.state_dict().items():
        if not name.startswith(("lm_head", "d2t", "t2d")):
            assert torch.equal(new.state_dict()[name], value), name
    assert drafter.draft_to_target.tolist() == list(range(10, 50))  # the source drafter is left as it was
