"""MTP modules (models/mtp.py) and MTP self-speculation (infer/mtp_proposer.py): causality of each depth, checkpoint
round trip (an old one without input_signal included), greedy identity in the verify runtime, and drafts equal to the
teacher-forced forward's argmax on the target signal each drafter names."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from infer.families import family_of, load_drafter
from infer.generate import generate_speculative, generate_vanilla
from infer.mtp_proposer import MTPProposer
from infer.proposer import TargetSignal
from infer.sampling import SamplingParams
from models.mtp import INPUT_SIGNALS, MTPDrafter
from models.target import TargetOutput
from train.features import attention_masks

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [11, 3, 4],
    [9],  # one token: no signal before the first verify round
    [40, 41, 42, 43, 44, 45, 46, 40, 41, 42, 43, 44, 45, 46, 40, 41, 42],
]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)
SETTINGS = {"chain": {}, "reuse": {"k": 4}, "tree": {"top_k": 3}, "reuse-tree": {"k": 3, "top_k": 2}}


@pytest.fixture(scope="module")
def drafter(tiny_target):
    torch.manual_seed(0)
    return MTPDrafter.from_target(tiny_target, num_modules=2, block_init="random")


@pytest.fixture(scope="module")
def scaled_norm_target():
    """The tiny target with a final norm that is not the identity scale. With unit weights hnorm(final_norm(x)) equals
    hnorm(x) up to eps, so no test could tell the two signals apart; real targets' final norms are far from 1."""
    from models.target import TargetModel
    from tests.conftest import tiny_llama

    target = TargetModel(tiny_llama(seed=0))
    torch.manual_seed(2)
    with torch.no_grad():
        target.final_norm.weight.uniform_(0.1, 3.0)
    return target


@pytest.fixture(scope="module", params=INPUT_SIGNALS)
def each_signal(request, scaled_norm_target):
    """(input_signal, a drafter reading it, on `scaled_norm_target`)."""
    torch.manual_seed(0)
    drafter = MTPDrafter.from_target(scaled_norm_target, 2, block_init="random", input_signal=request.param)
    return request.param, drafter


def h0(out: TargetOutput, input_signal: str) -> torch.Tensor:
    """The target signal a drafter's first module reads, spelled out here rather than through the code under test."""
    return out.last_hidden if input_signal == "last_hidden" else out.pre_norm_last


def test_depth_k_sees_no_token_beyond_t_plus_k(tiny_target, drafter):
    """Depth k (0-based) at position i reads token i+k+1 at most: changing token i+k+2 leaves it unchanged and
    changes position i+1 (so the check can fail)."""
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (2, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    allowed, positions, _ = attention_masks(batch)
    with torch.no_grad():
        pre = tiny_target(ids).pre_norm_last
        base = drafter.hidden_states(pre, ids, positions, allowed)
        i = 4
        for k in range(drafter.config.num_modules):
            changed = ids.clone()
            changed[:, i + k + 2] = (changed[:, i + k + 2] + 1) % 97
            out = drafter.hidden_states(pre, changed, positions, allowed)[k]
            assert torch.equal(out[:, : i + 1], base[k][:, : i + 1])
            assert not torch.allclose(out[:, i + 1], base[k][:, i + 1])


def test_fresh_blocks_copy_the_last_layer(tiny_target):
    d = MTPDrafter.from_target(tiny_target, num_modules=2)
    want = tiny_target.decoder_layers[-1].state_dict()
    for layer in d.layers:
        got = layer.block.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_blocks_copied_from_a_lora_target_carry_its_adapter_merged():
    """Joint mode wraps the target in peft before the modules are built: the copy must hold the layer's effective
    weights under plain names (base + B·A·scale), so the copied block computes what the wrapped layer computes."""
    from models.target import TargetModel
    from tests.conftest import tiny_llama

    target = TargetModel(tiny_llama(seed=0), mode="joint", lora_rank=4)
    layer = target.decoder_layers[-1]
    torch.manual_seed(3)
    with torch.no_grad():  # a trained adapter (peft starts lora_B at zero, which would hide a missed merge)
        for name, p in layer.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    block = MTPDrafter.from_target(target, num_modules=1).layers[0].block
    assert not any("lora" in k or "base_layer" in k for k in block.state_dict())
    x = torch.randn(1, 5, target.hidden_size)
    rope = target.model.base_model.model.model.rotary_emb(x, torch.arange(5)[None])
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    want = layer(x, attention_mask=mask, position_embeddings=rope)
    got = block(x, attention_mask=mask, position_embeddings=rope)
    torch.testing.assert_close(got, want)
    base = target.model.base_model.model.model.layers[-1].self_attn.q_proj.base_layer.weight
    assert not torch.allclose(block.self_attn.q_proj.weight, base)  # the adapter is in the copy


def test_checkpoint_round_trip_is_bit_exact(tiny_target, drafter, tmp_path):
    drafter.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path, tiny_target)
    assert isinstance(loaded, MTPDrafter) and loaded.config == drafter.config
    assert loaded.config.input_signal == "last_hidden"  # new drafters read what the engines feed
    a, b = drafter.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(k.startswith(("rotary", "embed", "lm_head")) for k in a)  # shared parts are the target's


def test_a_checkpoint_saved_before_input_signal_loads_as_pre_norm(tiny_target, drafter, tmp_path):
    """Modules saved before the field existed were trained on the pre-norm output: they must keep reading it (the
    new default would feed them another input), and their proposer and family declare that signal."""
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["input_signal"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    old = load_drafter(tmp_path, tiny_target)
    assert old.config.input_signal == "pre_norm"
    assert MTPProposer(old).signal is TargetSignal.PRE_NORM and family_of(old).signal(old) is TargetSignal.PRE_NORM
    assert MTPProposer(drafter).signal is TargetSignal.LAST_HIDDEN


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_token_identical_to_vanilla(tiny_target, drafter, setting, batch):
    prompts = PROMPTS[:1] if batch == 1 else PROMPTS[1:4]
    expected = [generate_vanilla(tiny_target, [p], GREEDY).tokens[0] for p in prompts]
    res = generate_speculative(tiny_target, MTPProposer(drafter, **SETTINGS[setting]), prompts, GREEDY)
    assert res.tokens == expected


def test_tree_shape(tiny_target, drafter):
    proposer = MTPProposer(drafter, k=3, top_k=2)
    ctx = PROMPTS[0]
    proposer.begin([ctx])
    proposer.observe(proposer.signal.of(tiny_target(torch.tensor([ctx[:-1]]))), torch.tensor([len(ctx) - 1]))
    tree = proposer.propose([ctx], GREEDY, torch.Generator())
    assert tree.tokens.shape == (1, 7)
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 1, 3, 3]  # chain node, then its sibling, per depth


def test_drafts_equal_the_teacher_forced_forward(scaled_norm_target, each_signal):
    """Every round's chain (with reuse past D) equals the argmax of the training-path forward run over the context
    followed by the drafts, fed the target signal the drafter names: the proposer reads that signal (fed the other
    one, some round's drafts differ: the check can fail), and the incremental per-depth caches compute exactly what
    training computes. Greedy output equals vanilla for both signals."""
    tiny_target = scaled_norm_target
    input_signal, drafter = each_signal
    other = next(s for s in INPUT_SIGNALS if s != input_signal)
    proposer = MTPProposer(drafter, k=3)
    assert proposer.signal is TargetSignal(input_signal)
    rounds = []
    propose = proposer.propose

    def record(contexts, params, generator):
        tree = propose(contexts, params, generator)
        rounds.append((list(contexts[0]), tree.tokens[0].tolist()))
        return tree

    proposer.propose = record
    res = generate_speculative(tiny_target, proposer, [PROMPTS[3]], GREEDY)
    assert res.tokens == generate_vanilla(tiny_target, [PROMPTS[3]], GREEDY).tokens
    assert len(rounds) > 3

    def teacher_forced(ctx: list[int], tokens: list[int], signal: str) -> list[int]:
        L = len(ctx) - 1
        ids = torch.tensor([ctx + tokens[1:]])
        T = ids.shape[1]
        with torch.no_grad():
            seen = h0(tiny_target(torch.tensor([ctx[:-1]])), signal)
            hidden = torch.cat([seen, seen.new_zeros(1, T - L, seen.shape[-1])], 1)  # later positions are never read
            allowed = torch.ones(T, T, dtype=torch.bool).tril()[None]
            want = []
            for j in range(1, 4):
                step_ids = F.pad(ids[:, j:], (0, j))[:, :T]
                hidden = drafter.module_step(proposer.module_of(j), hidden, step_ids, torch.arange(T)[None], allowed)[0]
                want.append(int(drafter.logits(hidden[0, L - 1]).argmax()))
        return want

    for ctx, tokens in rounds:
        assert tokens[1:] == teacher_forced(ctx, tokens, input_signal)
    assert any(tokens[1:] != teacher_forced(ctx, tokens, other) for ctx, tokens in rounds)


def test_engine_exports_are_refused_for_a_llama_target(drafter, tmp_path):
    """vLLM and SGLang build their own MTP block (DeepSeek's MLA + MoE layer, Qwen3-Next's layer) and route a draft
    to it only for deepseek_v3 / qwen3_next targets: a Llama target's modules are refused with that reason, and
    nothing is written (the layouts themselves are tested on such targets in tests/test_export_engines_mtp.py)."""
    from models.mtp_export import mtp_deepseek_refusal, mtp_qwen3_next_refusal, save_mtp_deepseek, save_mtp_qwen3_next

    for save, refusal, family in (
        (save_mtp_deepseek, mtp_deepseek_refusal, "deepseek_v3"),
        (save_mtp_qwen3_next, mtp_qwen3_next_refusal, "qwen3_next"),
    ):
        why = refusal(drafter)
        assert f"is for {family} targets only" in why and "LlamaDecoderLayer" in why
        assert "serve in drafters' own runtime" in why
        with pytest.raises(ValueError, match="serve in drafters' own runtime"):
            save(drafter, tmp_path / family)
        assert not (tmp_path / family).exists()


@pytest.mark.parametrize("setting", ["chain", "tree"])
def test_sampling_runs_with_draft_distributions(tiny_target, drafter, setting):
    """T = 1: sampled chains carry their q (a distribution per drafted node), trees are one-hot (q is None)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    proposer = MTPProposer(drafter, **SETTINGS[setting])
    ctx = PROMPTS[0]
    proposer.begin([ctx])
    proposer.observe(proposer.signal.of(tiny_target(torch.tensor([ctx[:-1]]))), torch.tensor([len(ctx) - 1]))
    tree = proposer.propose([ctx], params, torch.Generator().manual_seed(0))
    if setting == "chain":
        q = tree.draft_probs[0, :-1]
        assert torch.allclose(q.sum(-1), torch.ones(q.shape[0]))
        assert bool((q[torch.arange(q.shape[0]), tree.tokens[0, 1:]] > 0).all())  # each draft was drawn from its q
    else:
        assert tree.draft_probs is None
    res = generate_speculative(tiny_target, MTPProposer(drafter, **SETTINGS[setting]), [ctx], params)
    assert len(res.tokens[0]) == 12 and all(0 <= t < 97 for t in res.tokens[0])
