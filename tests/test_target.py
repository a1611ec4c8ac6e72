"""Tests for models/target.py (and the tokenizer helpers of models/tokenizer.py) on tiny random Llama / Qwen2 /
Qwen3 / Mistral targets (no hub access)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from models.logits_to_keep import last_positions
from models.target import (
    AUX_LAYER_CONVENTION,
    TargetConfig,
    TargetModel,
    TargetOutput,
    _first_tensor,
    default_aux_layer_ids,
    from_before_layer_ids,
    to_before_layer_ids,
)
from models.tokenizer import load_tokenizer, tokenizer_fingerprint

VOCAB, HIDDEN, LAYERS = 96, 32, 4
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    "mistral": (MistralConfig, MistralForCausalLM, {"head_dim": 8}),
}


def tiny_model(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    return model_cls(config_cls(**TINY, **extra)).eval()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding on the second row exercises the 2D mask path
    return ids, mask


# --- features match HF ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_features_and_logits_match_hf(arch: str) -> None:
    hf = tiny_model(arch)
    ids, mask = batch()
    aux_ids = [2, 0, 1]  # unsorted on purpose: aux_hidden must follow the given order
    target = TargetModel(hf, aux_layer_ids=aux_ids)
    out = target(ids, attention_mask=mask)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)

    assert isinstance(out, TargetOutput)
    assert out.aux_hidden.shape == (2, 7, 3 * HIDDEN)
    expected = torch.cat([ref.hidden_states[k + 1] for k in aux_ids], dim=-1)
    torch.testing.assert_close(out.aux_hidden, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-6, rtol=0)
    # last_hidden is the final-norm output, which HF puts in hidden_states[-1].
    torch.testing.assert_close(out.last_hidden, ref.hidden_states[-1], atol=1e-6, rtol=0)
    torch.testing.assert_close(target.final_norm(out.pre_norm_last), out.last_hidden, atol=1e-6, rtol=0)
    assert out.past_key_values is None


def test_last_layer_aux_is_pre_norm_and_capture_off() -> None:
    target = TargetModel(tiny_model(), aux_layer_ids=[LAYERS - 1])
    ids, _ = batch()
    out = target(ids)
    # Aux id N-1 is the raw layer output (pre-norm), unlike HF hidden_states[N] which is post-norm.
    torch.testing.assert_close(out.aux_hidden, out.pre_norm_last, atol=0, rtol=0)
    off = target(ids, capture_aux=False)
    assert off.aux_hidden is None
    torch.testing.assert_close(off.logits, out.logits, atol=0, rtol=0)


def test_kv_cache_continuation_matches_full_forward() -> None:
    target = TargetModel(tiny_model("qwen3"))
    ids, _ = batch()
    full = target(ids)
    pre = target(ids[:, :4], use_cache=True)
    assert pre.past_key_values is not None
    rest = target(ids[:, 4:], past_key_values=pre.past_key_values, use_cache=True)
    torch.testing.assert_close(rest.logits, full.logits[:, 4:], atol=1e-5, rtol=0)
    torch.testing.assert_close(rest.aux_hidden, full.aux_hidden[:, 4:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_of_the_last_positions_read_contiguous_rows(arch: str) -> None:
    """``logits_to_keep`` = n gives the full forward's last n logits, and the head reads a contiguous tensor: a
    strided ``[:, -n:, :]`` view makes torch copy the head's weight once per row (`models/logits_to_keep.py`)."""
    target = TargetModel(tiny_model(arch))
    ids, mask = batch()
    seen = []
    hook = target.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    try:
        full = target(ids, attention_mask=mask)
        for n in (1, 3):
            kept = target(ids, attention_mask=mask, logits_to_keep=n)
            torch.testing.assert_close(kept.logits, full.logits[:, -n:], atol=1e-6, rtol=0)
    finally:
        hook.remove()
    assert seen == [True, True, True]
    assert last_positions(2, 7).tolist() == [5, 6]
    with pytest.raises(ValueError, match="last 8 of 7"):
        last_positions(8, 7)


def test_first_tensor_handles_tuple_and_tensor_layer_outputs() -> None:
    h = torch.randn(2, 3)
    assert _first_tensor(h) is h
    assert _first_tensor((h, None)) is h


# --- aux-layer ids ---------------------------------------------------------------------------------


def test_default_aux_ids_and_conventions() -> None:
    assert default_aux_layer_ids(32) == [1, 15, 28]
    assert to_before_layer_ids([1, 15, 28]) == [2, 16, 29]
    assert from_before_layer_ids([2, 16, 29]) == [1, 15, 28]
    # Default equals EAGLE/vLLM's "before layer" [2, N//2, N-3] for every N where that is valid.
    for n in range(4, 80):
        assert to_before_layer_ids(default_aux_layer_ids(n)) == [2, n // 2, n - 3]
    assert default_aux_layer_ids(1) == [0, 0, 0]
    assert default_aux_layer_ids(2) == [0, 0, 1]
    assert default_aux_layer_ids(3) == [0, 1, 2]
    with pytest.raises(ValueError, match="embedding output"):
        from_before_layer_ids([0, 2, 3])
    with pytest.raises(ValueError, match="num_layers"):
        default_aux_layer_ids(0)
    assert AUX_LAYER_CONVENTION == "output_of_layer_0based"


def test_target_model_properties_and_default_ids() -> None:
    hf = tiny_model()
    target = TargetModel(hf)
    assert target.aux_layer_ids == default_aux_layer_ids(LAYERS) == [1, 1, 0]
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (LAYERS, HIDDEN, VOCAB)
    assert target.config is hf.config
    assert target.embed_tokens is hf.model.embed_tokens
    assert target.final_norm is hf.model.norm
    assert target.lm_head is hf.lm_head
    assert target.device == torch.device("cpu") and target.dtype == torch.float32
    assert target(batch()[0]).aux_hidden.shape == (2, 7, 3 * HIDDEN)


def test_aux_ids_out_of_range_and_unsupported_arch() -> None:
    with pytest.raises(ValueError, match="out of range"):
        TargetModel(tiny_model(), aux_layer_ids=[0, 1, LAYERS])
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=32))
    with pytest.raises(ValueError, match="unsupported target architecture GPT2LMHeadModel"):
        TargetModel(gpt2)


# --- modes -------------------------------------------------------------------------------------------


def test_frozen_mode_has_no_trainable_params_and_stays_eval() -> None:
    target = TargetModel(tiny_model().train())
    assert not any(p.requires_grad for p in target.parameters())
    target.train()  # a training loop toggling modes must not switch the frozen target to train
    assert not target.model.training


def test_joint_full_mode_trains_everything() -> None:
    target = TargetModel(tiny_model(), mode="joint")
    assert all(p.requires_grad for p in target.parameters())
    assert target.model.training
    out = target(batch()[0])
    out.aux_hidden.sum().backward()
    assert target.decoder_layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # raised inside peft
def test_joint_lora_trains_only_lora_params() -> None:
    hf = tiny_model()
    ids, mask = batch()
    with torch.no_grad():
        base_logits = hf(input_ids=ids, attention_mask=mask).logits
    target = TargetModel(hf, mode="joint", lora_rank=4, aux_layer_ids=[0, 1, 2])
    trainable = [n for n, p in target.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # Every default projection got an adapter (A and B) in every layer.
    assert len(trainable) == LAYERS * 7 * 2
    assert target.num_layers == LAYERS and target.lm_head is target.hf_model.lm_head
    out = target(ids, attention_mask=mask)
    # LoRA B starts at zero, so the adapted target initially equals the base model.
    torch.testing.assert_close(out.logits, base_logits, atol=1e-6, rtol=0)
    out.logits.sum().backward()
    assert all(p.grad is not None for n, p in target.named_parameters() if "lora_B" in n)
    assert all(p.grad is None for n, p in target.named_parameters() if "lora_" not in n)


# --- loading through TargetConfig ----------------------------------------------------------------------


def test_load_saved_model_through_config(tmp_path: Path) -> None:
    hf = tiny_model("mistral")
    hf.save_pretrained(tmp_path)
    cfg = TargetConfig(name_or_path=str(tmp_path), dtype="float32", device="cpu", aux_layer_ids=[0, 2, 3])
    target = TargetModel.from_config(cfg)
    assert target.name_or_path == str(tmp_path)
    assert target.aux_layer_ids == [0, 2, 3]
    assert not any(p.requires_grad for p in target.parameters())
    ids, mask = batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(target(ids, attention_mask=mask).logits, ref, atol=1e-6, rtol=0)

    half = TargetModel.from_config(TargetConfig(name_or_path=str(tmp_path), dtype="bfloat16", device="cpu"))
    assert half.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name_or_path": ""}, "name_or_path"),
        ({"dtype": "fp16"}, "dtype must be one of"),
        ({"device": "tpu"}, "device must be one of"),
        ({"attn_implementation": "fast"}, "attn_implementation"),
        ({"mode": "train"}, "mode must be one of"),
        ({"lora_rank": -1, "mode": "joint"}, "lora_rank must be"),
        ({"lora_rank": 8}, "needs mode='joint'"),
        ({"lora_rank": 8, "mode": "joint", "lora_alpha": 0}, "lora_alpha"),
        ({"lora_dropout": 1.5}, "lora_dropout"),
        ({"lora_rank": 8, "mode": "joint", "lora_target_modules": []}, "lora_target_modules"),
        ({"aux_layer_ids": []}, "non-empty"),
        ({"aux_layer_ids": [1, -1, 3]}, "non-negative"),
    ],
)
def test_invalid_config_raises(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TargetConfig(**{"name_or_path": "some/model", **kwargs})


# --- tokenizer fingerprint ---------------------------------------------------------------------------------


def tiny_tokenizer(words: list[str], eos: str = "</s>") -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", "<pad>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token=eos, pad_token="<pad>"
    )


def test_tokenizer_fingerprint_stable_and_discriminating(tmp_path: Path) -> None:
    a = tiny_tokenizer(["def", "return", "x"])
    fp = tokenizer_fingerprint(a)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert tokenizer_fingerprint(tiny_tokenizer(["def", "return", "x"])) == fp
    a.save_pretrained(tmp_path)
    assert tokenizer_fingerprint(load_tokenizer(str(tmp_path))) == fp  # survives a save / load round trip
    assert tokenizer_fingerprint(tiny_tokenizer(["def", "return", "y"])) != fp
    assert tokenizer_fingerprint(tiny_tokenizer(["def", "return", "x"], eos="<pad>")) != fp
