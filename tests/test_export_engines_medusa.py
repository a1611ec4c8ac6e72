"""Medusa engine exports (vLLM's layout and the original FasterDecoding one) against what the loaders read: config
keys and values, weight names, shapes, dtypes, and the heads' outputs once loaded.

No engine is installed here, so each test replays the loader's reading rules (cited by file; the commits read are
listed in docs/exports.md) on the written folder, and rebuilds the engine's heads where their computation is short.

Sources (stored snapshots read for this file):
  vLLM   vllm/config/speculative.py, model_executor/models/medusa.py, transformers_utils/configs/medusa.py,
         v1/worker/gpu_model_runner.py
  FasterDecoding/Medusa medusa/model/medusa_model.py; TensorRT-LLM tensorrt_llm/models/medusa/weight.py,
         examples/medusa/convert_checkpoint.py
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig

from models.medusa import MedusaDrafter
from models.medusa_export import (
    FASTERDECODING_HEADS,
    medusa_original_refusal,
    medusa_original_state_dict,
    save_medusa_original,
    save_medusa_vllm,
)
from models.target import TargetModel
from tests.conftest import tiny_llama

V, H = 97, 32


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


@pytest.fixture(scope="module")
def named_target():
    """A Llama target with a hub-style name (the original layout's base_model_name_or_path)."""
    return TargetModel(tiny_llama(seed=0), name_or_path="org/tiny-llama")


def _medusa(tiny_target, heads: int, layers: int, shared: bool = False, seed: int = 0) -> MedusaDrafter:
    drafter = MedusaDrafter.from_target(tiny_target, num_heads=heads, num_layers=layers, shared_head=shared)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return drafter


def vllm_medusa_config(config: dict) -> dict:
    """vllm/transformers_utils/configs/medusa.py, MedusaConfig.from_pretrained: any key with "num" and "heads" becomes
    num_heads, any with "num" and "layers" num_hidden_layers; truncated_vocab_size defaults to vocab_size."""
    config = dict(config)
    for k in list(config):
        if "num" in k:
            if "heads" in k:
                config["num_heads"] = config.pop(k)
            elif "layers" in k:
                config["num_hidden_layers"] = config.pop(k)
    config.setdefault("truncated_vocab_size", config["vocab_size"])
    return config


def test_vllm_medusa_export_holds_what_vllm_loads(named_target, tmp_path):
    drafter = _medusa(named_target, heads=3, layers=2, shared=True)
    out = save_medusa_vllm(drafter, tmp_path / "vllm")
    config = vllm_medusa_config(json.loads((out / "config.json").read_text()))
    # model_type selects vLLM's MedusaConfig and the "medusa" method (speculative.py); the model is built from these
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"], config["hidden_size"]) == (3, 2, H)
    # medusa.py: ResidualBlock's Linear has a bias only with medusa_fc_bias; original_lm_head true = one ParallelLMHead
    # named lm_head, handed to every head; load_weights asserts truncated_vocab_size == vocab_size unless a token_map
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is True
    assert config["truncated_vocab_size"] == config["vocab_size"] == V
    state = load_file(str(out / "model.safetensors"))
    want = {f"blocks.{h}.layers.{j}.weight": (H, H) for h in range(3) for j in range(2)}
    want |= {f"blocks.{h}.layers.{j}.bias": (H,) for h in range(3) for j in range(2)}
    want |= {"lm_head.weight": (V, H)}  # the shared head once: Medusa.named_parameters() with original_lm_head
    assert _shapes(state) == want  # every parameter loaded, nothing left over
    assert all(v.dtype == torch.float32 for v in state.values())
    assert torch.equal(state["blocks.2.layers.1.bias"], drafter.blocks[2][1].linear.bias)
    assert torch.equal(state["lm_head.weight"], named_target.lm_head.weight)
    assert '"num_speculative_tokens": 3' in (out / "README.md").read_text()


def test_a_bf16_medusa_drafter_writes_the_shared_head_in_bf16(named_target, tmp_path):
    """A shipped drafter is bf16 while the target it loads on may be fp32: the head is written in the drafter's dtype
    (the engines cast to their serving dtype on load), once."""
    drafter = _medusa(named_target, heads=3, layers=1, shared=True).to(torch.bfloat16)
    assert named_target.lm_head.weight.dtype == torch.float32
    out = save_medusa_vllm(drafter, tmp_path / "vllm")
    state = load_file(str(out / "model.safetensors"))
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    assert torch.equal(state["lm_head.weight"], named_target.lm_head.weight.to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


class _VllmMedusa(nn.Module):
    """vllm/model_executor/models/medusa.py, as the config builds it: ``num_heads`` ResidualBlocks of
    ``num_hidden_layers`` Linear layers (bias from ``medusa_fc_bias``), each ``x = x + SiLU(layer(x))``, then one
    ParallelLMHead per head over ``truncated_vocab_size`` ids, or with ``original_lm_head`` one named ``lm_head`` that
    every head uses."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, bias = config["hidden_size"], config["medusa_fc_bias"]
        # blocks.{h}.layers.{j} and lm_heads.{h}: the names vLLM's load_weights looks the checkpoint's tensors up by
        self.blocks = nn.ModuleList(nn.Module() for _ in range(config["num_heads"]))
        for block in self.blocks:
            block.layers = nn.ModuleList(
                nn.Linear(hidden, hidden, bias=bias) for _ in range(config["num_hidden_layers"])
            )
        if config["original_lm_head"]:
            self.lm_head = nn.Linear(hidden, config["truncated_vocab_size"], bias=False)
            self._shared = True
        else:
            self.lm_heads = nn.ModuleList(
                nn.Linear(hidden, config["truncated_vocab_size"], bias=False) for _ in range(config["num_heads"])
            )
            self._shared = False

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Medusa.load_weights: a name among the parameters is loaded; with original_lm_head, ``lm_heads.0.weight``
        stands for ``lm_head.weight``; anything else is dropped. Every parameter must be loaded (strict here)."""
        params, loaded = dict(self.named_parameters()), {}
        for name, tensor in state.items():
            if name in params:
                loaded[name] = tensor
            elif self._shared and name == "lm_heads.0.weight":
                loaded["lm_head.weight"] = tensor
        assert loaded.keys() == params.keys(), sorted(set(params) ^ set(loaded))
        self.load_state_dict(loaded, strict=True)

    def heads(self) -> list[nn.Module]:
        return [self.lm_head] * len(self.blocks) if self._shared else list(self.lm_heads)

    def forward(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for block, lm_head in zip(self.blocks, self.heads()):
            x = hidden_states
            for layer in block.layers:
                x = x + nn.functional.silu(layer(x))
            out.append(lm_head(x))
        return out


@pytest.mark.parametrize("shared", [False, True])
def test_vllm_medusa_heads_compute_ours_on_the_hidden_state_vllm_feeds(named_target, tmp_path, shared):
    """vLLM feeds Medusa the target model's output (v1/worker/gpu_model_runner.py propose_draft_token_ids:
    ``target_hidden_states=hidden_states`` for method medusa), and its LlamaModel.forward returns the output of the
    final norm: the hidden state our heads read in training (TargetOutput.last_hidden). Head k's top-1 is the k-th
    draft after the target's own next token (v1/spec_decode/medusa.py: ``logit.argmax`` per head, in head order),
    the token t+2+k our head k is trained on."""
    drafter = _medusa(named_target, heads=3, layers=2, shared=shared)
    out = save_medusa_vllm(drafter, tmp_path / "vllm")
    vllm = _VllmMedusa(vllm_medusa_config(json.loads((out / "config.json").read_text())))
    vllm.load_weights(load_file(str(out / "model.safetensors")))
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fed = named_target.hf_model(ids, output_hidden_states=True).hidden_states[-1]  # LlamaModel's output (normed)
        trained_on = named_target(ids).last_hidden
        assert torch.equal(fed, trained_on)
        for k, logits in enumerate(vllm(fed)):
            torch.testing.assert_close(logits, drafter.head_logits(k, trained_on), rtol=0, atol=1e-6)


class _FasterDecodingResBlock(nn.Module):
    """medusa_model.py's ResBlock: x + SiLU(Linear(x)) (its parameter names are what the .pt keys address)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + torch.nn.functional.silu(self.linear(x))


def _fasterdecoding_heads(num_layers: int) -> nn.ModuleList:
    """MedusaModelABC.__init__ after its MEDUSA-v0.1 from_pretrained branch: medusa_num_heads forced to 5 and
    ``[ResBlock(hidden)] * medusa_num_layers``, one module repeated, then Linear(hidden, vocab, bias=False)."""
    return nn.ModuleList(
        nn.Sequential(*([_FasterDecodingResBlock(H)] * num_layers), nn.Linear(H, V, bias=False))
        for _ in range(FASTERDECODING_HEADS)
    )


def trtllm_medusa_reads(state: dict, num_medusa_heads: int, num_medusa_layers: int) -> dict:
    """tensorrt_llm/models/medusa/weight.py, load_medusa_hf: for the flag-given head count and depth it indexes
    {h}.{l}.linear.weight, {h}.{l}.linear.bias and {h}.{num_medusa_layers}.weight (KeyError when absent)."""
    out = {}
    for h in range(num_medusa_heads):
        for j in range(num_medusa_layers):
            out[f"{h}.{j}.linear.weight"] = state[f"{h}.{j}.linear.weight"]
            out[f"{h}.{j}.linear.bias"] = state[f"{h}.{j}.linear.bias"]
        out[f"{h}.{num_medusa_layers}.weight"] = state[f"{h}.{num_medusa_layers}.weight"]
    return out


def test_original_medusa_export_is_what_fasterdecoding_and_tensorrt_llm_open(named_target, tmp_path):
    drafter = _medusa(named_target, heads=3, layers=1)
    out = save_medusa_original(drafter, tmp_path / "orig")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "medusa_lm_head.pt"]
    config = json.loads((out / "config.json").read_text())
    # MedusaConfig fields; no model_type, so AutoConfig fails and the loader takes its MEDUSA-v0.1 branch, which
    # opens base_model_name_or_path and then medusa_lm_head.pt beside the config
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 1)
    assert config["base_model_name_or_path"] == "org/tiny-llama" and "model_type" not in config
    with pytest.raises(ValueError):
        AutoConfig.from_pretrained(out)
    state = torch.load(out / "medusa_lm_head.pt", weights_only=True)  # plain tensors: the safe unpickler reads it
    assert _shapes(state) == {"0.0.linear.weight": (H, H), "0.0.linear.bias": (H,), "0.1.weight": (V, H)} | {
        f"{h}.{k}": s
        for h in (1, 2)
        for k, s in (("0.linear.weight", (H, H)), ("0.linear.bias", (H,)), ("1.weight", (V, H)))
    }
    heads = _fasterdecoding_heads(config["medusa_num_layers"])
    missing, unexpected = heads.load_state_dict(state, strict=False)  # medusa_model.py loads with strict=False
    assert not unexpected and {k.split(".")[0] for k in missing} == {"3", "4"}  # 5 heads built, 3 trained
    hidden = torch.randn(4, H)
    with torch.no_grad():
        for k in range(3):
            torch.testing.assert_close(heads[k](hidden), drafter.head_logits(k, hidden))
    trtllm = trtllm_medusa_reads(state, num_medusa_heads=3, num_medusa_layers=1)
    assert all(torch.equal(trtllm[k], state[k]) for k in trtllm)
    with pytest.raises(KeyError):  # the converter's default --num_medusa_heads 4 asks for a head that is not there
        trtllm_medusa_reads(state, num_medusa_heads=4, num_medusa_layers=1)
    readme = (out / "README.md").read_text()
    assert "--num_medusa_heads 3 --num_medusa_layers 1" in readme and "medusa_choices" in readme
    assert medusa_original_refusal(drafter) is None


def test_original_medusa_layout_refused_where_fasterdecoding_cannot_build_the_heads(named_target, tmp_path):
    """medusa_model.py builds `[ResBlock(hidden)] * medusa_num_layers` (one module repeated), always 5 heads (loaded
    with strict=False), and only for llama / mistral bases: those drafters get the reason and no folder."""
    deep = _medusa(named_target, heads=2, layers=2)
    state = medusa_original_state_dict(deep)  # what the layout would hold
    heads = _fasterdecoding_heads(2)
    heads.load_state_dict(state, strict=False)
    hidden = torch.randn(4, H)
    with torch.no_grad():  # the shared ResBlock ends up holding block 1's weights for both layers
        assert not torch.allclose(heads[0](hidden), deep.head_logits(0, hidden))
    many = _medusa(named_target, heads=6, layers=1)
    qwen = _medusa(named_target, heads=2, layers=1)
    qwen.target_info = dataclasses.replace(qwen.target_info, target_architectures=["Qwen2ForCausalLM"])
    for drafter, why in (
        (deep, "cannot build 2 ResBlocks per head: it builds `[ResBlock(hidden)] * medusa_num_layers`"),
        (many, "cannot build 6 heads: it builds 5 whatever the config says and loads with strict=False"),
        (qwen, "serves llama and mistral bases only (it raises otherwise); this target is ['Qwen2ForCausalLM']"),
    ):
        assert why in medusa_original_refusal(drafter) and "serve in vLLM (export-vllm)" in medusa_original_refusal(
            drafter
        )
        with pytest.raises(ValueError, match=re.escape(why)):
            save_medusa_original(drafter, tmp_path / "refused")
        assert not (tmp_path / "refused").exists()
        assert save_medusa_vllm(drafter, tmp_path / f"vllm-{id(drafter)}").exists()  # vLLM builds them all
    five = _medusa(named_target, heads=5, layers=1)
    assert medusa_original_refusal(five) is None and save_medusa_original(five, tmp_path / "five").exists()
    nameless = _medusa(named_target, heads=2, layers=1)
    nameless.target_info = None
    with pytest.raises(ValueError, match="base_model_name_or_path"):
        save_medusa_original(nameless, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    assert (save_medusa_original(nameless, tmp_path / "y", base_model_name_or_path="org/base") / "config.json").exists()
