"""EAGLE-3 checkpoints: our own format (bit-exact round trip, target checks) and the engine exports.

The engine maps are REFERENCE.md's (Llama-3.1-8B shapes), checked on a meta-device drafter: no weights needed.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from models.checkpoint import TargetInfo
from models.eagle3 import Eagle3Drafter
from models.eagle3_config import Eagle3Config, read_checkpoint_config
from models.eagle3_export import (
    save_sglang,
    save_speculators,
    sglang_config,
    sglang_state_dict,
    speculators_config,
    speculators_state_dict,
)
from models.target import AUX_LAYER_CONVENTION, TargetModel, default_aux_layer_ids

LLAMA_31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
# REFERENCE.md: the keys and shapes SGLang / vLLM load for Llama-3.1-8B
SGLANG_8B = {
    "fc.weight": (4096, 12288),
    "midlayer.hidden_norm.weight": (4096,),
    "midlayer.input_layernorm.weight": (4096,),
    "midlayer.post_attention_layernorm.weight": (4096,),
    "midlayer.self_attn.q_proj.weight": (4096, 8192),
    "midlayer.self_attn.k_proj.weight": (1024, 8192),
    "midlayer.self_attn.v_proj.weight": (1024, 8192),
    "midlayer.self_attn.o_proj.weight": (4096, 4096),
    "midlayer.mlp.gate_proj.weight": (14336, 4096),
    "midlayer.mlp.up_proj.weight": (14336, 4096),
    "midlayer.mlp.down_proj.weight": (4096, 14336),
    "norm.weight": (4096,),
    "lm_head.weight": (32000, 4096),
    "d2t": (32000,),
    "t2d": (128256,),
}


@pytest.fixture(scope="module")
def meta_8b() -> Eagle3Drafter:
    cfg = Eagle3Config.from_target(LlamaConfig(**LLAMA_31_8B), draft_vocab_size=32000)
    info = TargetInfo(
        "meta-llama/Llama-3.1-8B-Instruct",
        128256,
        4096,
        32,
        None,
        method=Eagle3Drafter.method,
        aux_layer_ids=default_aux_layer_ids(32),
        target_architectures=["LlamaForCausalLM"],
    )
    with torch.device("meta"):
        return Eagle3Drafter(cfg, info)


def test_sglang_vllm_keys_shapes_and_config_match_reference(meta_8b):
    state = sglang_state_dict(meta_8b)
    assert {k: tuple(v.shape) for k, v in state.items()} == SGLANG_8B
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert not any("embed_tokens" in k for k in state)
    cfg = sglang_config(meta_8b)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    expected = dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        vocab_size=128256,
        draft_vocab_size=32000,
        tie_word_embeddings=False,
        target_hidden_size=4096,
        rope_theta=500000.0,
    )
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["rope_scaling"]["rope_type"] == "llama3"  # the target's rope survives the export
    # taps on the outputs of layers 1, 15, 28 of Llama-3.1-8B (= HF hidden-state indices 2, 16, 29, REFERENCE.md):
    # SGLang reads eagle_config as after-layer ids and adds 1 itself; vLLM reads the top-level key as before-layer ids
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "use_aux_hidden_state": True}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]


def test_speculators_keys_and_config(meta_8b):
    state = speculators_state_dict(meta_8b)
    expected = {k.replace("midlayer.", "layers.0."): v for k, v in SGLANG_8B.items()}
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    cfg = speculators_config(meta_8b)
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["transformer_layer_config"]["hidden_size"] == 4096
    assert cfg["draft_vocab_size"] == 32000 and cfg["target_hidden_size"] == 4096
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["proposal_methods"][0]["speculative_tokens"] >= 1
    assert spec["verifier"] == {
        "name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
        "architectures": ["LlamaForCausalLM"],
    }
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]


def _tiny_target(vocab=64, layers=4, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return TargetModel(LlamaForCausalLM(cfg).eval(), aux_layer_ids=[0, 1, 2], name_or_path="tiny-target")


@pytest.fixture(scope="module")
def trained_like(tmp_path_factory):
    """A tiny drafter with non-default weights and a non-trivial draft vocabulary, saved in our format."""
    target = _tiny_target()
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=16)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    used = torch.sort(torch.randperm(64)[:16]).values
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[used] = True
    drafter.set_draft_vocab(used - torch.arange(16), t2d)
    out = tmp_path_factory.mktemp("ckpt")
    drafter.save_pretrained(out)
    return target, drafter, out


def test_own_format_round_trips_bit_exactly(trained_like):
    target, drafter, path = trained_like
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((path / "config.json").read_text())
    block = config["drafters"]
    assert block["method"] == "eagle3" and block["version"] == 1 and block["target_name"] == "tiny-target"
    assert block["target_vocab_size"] == 64 and block["aux_layer_ids"] == [0, 1, 2]
    assert block["aux_layer_convention"] == AUX_LAYER_CONVENTION and "tokenizer_fingerprint" in block
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("embed_tokens") for k in f.keys())
    loaded = Eagle3Drafter.from_pretrained(path, target)
    before, after = drafter.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k
    assert loaded.config == drafter.config and loaded.target_info == drafter.target_info


def test_loading_places_the_drafter_in_its_targets_dtype_with_fp32_rotary(trained_like):
    """Served in a bf16 target's dtype, as the other families and the engines serve a drafter: every weight is the
    checkpoint's rounded to bf16, the rotary frequencies stay fp32, and a draft step agrees with the fp32 one to bf16
    rounding; the training path continues from fp32 weights."""
    target, drafter, path = trained_like
    bf16_target = TargetModel(
        _tiny_target().model.to(torch.bfloat16), aux_layer_ids=[0, 1, 2], name_or_path="tiny-target"
    )
    served = Eagle3Drafter.from_pretrained(path, bf16_target)
    fp32 = Eagle3Drafter.from_pretrained(path, target)
    for (name, p), q in zip(served.named_parameters(), fp32.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q.to(torch.bfloat16)), name
    assert served.d2t.dtype == torch.long and served.t2d.dtype == torch.bool and torch.equal(served.d2t, drafter.d2t)
    assert served.rotary.inv_freq.dtype == torch.float32 and torch.equal(served.rotary.inv_freq, fp32.rotary.inv_freq)

    torch.manual_seed(2)
    m, slots = 3, 5
    hidden, ids = torch.randn(1, m, 32), torch.randint(0, 64, (1, m))
    positions = torch.arange(slots, slots + m)[None] + 200  # far along, where bf16 angles would have drifted
    allowed = torch.ones(1, m, slots + m, dtype=torch.bool)
    keys, values = torch.randn(1, 2, slots, 8), torch.randn(1, 2, slots, 8)
    with torch.inference_mode():
        a = fp32.step(hidden, ids, positions, allowed, keys, values)
        b = served.step(hidden.bfloat16(), ids, positions, allowed, keys.bfloat16(), values.bfloat16())
    assert b.logits.dtype == torch.bfloat16
    assert torch.allclose(b.logits.float(), a.logits, atol=0.1 * a.logits.abs().max().item())
    assert torch.allclose(b.keys.float(), a.keys, atol=0.05 * a.keys.abs().max().item())
    assert (
        float(served.fc.weight.detach().float().sub(fp32.fc.weight.detach()).abs().max()) > 0
    )  # it did round: the test can fail

    assert Eagle3Drafter.from_pretrained(path, bf16_target).float().fc.weight.dtype == torch.float32


def test_loading_refuses_a_mismatching_target_before_reading_weights(trained_like, tmp_path):
    _, _, path = trained_like
    # only the config: a check that needed weights would fail with a file error instead of the mismatch
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="vocab size"):
        Eagle3Drafter.from_pretrained(tmp_path, _tiny_target(vocab=80))
    with pytest.raises(ValueError, match="aux layers"):
        Eagle3Drafter.from_pretrained(tmp_path, TargetModel(_tiny_target().model, aux_layer_ids=[1, 2, 3]))
    with pytest.raises(ValueError, match="decoder layers"):
        Eagle3Drafter.from_pretrained(tmp_path, TargetModel(_tiny_target(layers=5).model, aux_layer_ids=[0, 1, 2]))
    cfg, info = read_checkpoint_config(tmp_path)
    assert cfg.draft_vocab_size == 16 and info.aux_layer_ids == [0, 1, 2]


def test_loading_refuses_another_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def tok(words):
        t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="a"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="a")

    target = _tiny_target()
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=8, tokenizer=tok(["a", "b", "c"]))
    drafter.save_pretrained(tmp_path)
    Eagle3Drafter.from_pretrained(tmp_path, target, tokenizer=tok(["a", "b", "c"]))
    with pytest.raises(ValueError, match="tokenizer fingerprint"):
        Eagle3Drafter.from_pretrained(tmp_path, target, tokenizer=tok(["a", "c", "b"]))


def test_engine_exports_written_from_a_real_drafter(trained_like, tmp_path):
    _, drafter, _ = trained_like
    sg = save_sglang(drafter, tmp_path / "sglang")
    with safe_open(str(sg / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for k, v in sglang_state_dict(drafter).items():
        assert torch.equal(tensors[k], v), k
    assert set(tensors) == set(sglang_state_dict(drafter))
    # the engine config is a valid HF LlamaConfig (what SGLang / vLLM parse it with)
    hf = LlamaConfig.from_pretrained(sg)
    assert hf.num_hidden_layers == 1 and hf.draft_vocab_size == 16 and hf.architectures == ["LlamaForCausalLMEagle3"]
    sp = save_speculators(drafter, tmp_path / "spec")
    with safe_open(str(sp / "model.safetensors"), "pt") as f:
        assert "layers.0.self_attn.q_proj.weight" in f.keys() and "d2t" in f.keys()
    assert (
        json.loads((sp / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    )
