"""Export drafters to the formats serving engines load unchanged (key maps: REFERENCE.md, "EAGLE-3").

- SGLang / vLLM (``LlamaForCausalLMEagle3``): a LlamaConfig with one hidden layer plus ``draft_vocab_size``,
  ``target_hidden_size`` and ``eagle_config``; weights ``fc.weight``, ``midlayer.*``, ``norm.weight``,
  ``lm_head.weight``, ``d2t`` (int64), ``t2d`` (bool); no ``embed_tokens`` (the engines share the target's).
  vLLM renames ``midlayer.`` → ``layers.0.`` itself; SGLang fuses q/k/v and gate/up on load.
- speculators (``Eagle3Speculator``): the same weights with the layer under ``layers.0.``, the layer shape in
  ``transformer_layer_config`` and the verifier and proposal in ``speculators_config``.

Medusa heads (key maps: REFERENCE.md, "Medusa"):

- vLLM (``model_type: "medusa"``): ``blocks.{h}.layers.{j}.{weight,bias}`` and ``lm_heads.{h}.weight``; config
  ``num_heads``, ``num_hidden_layers``, ``medusa_fc_bias``, ``original_lm_head``, ``truncated_vocab_size``.
- original Medusa / TensorRT-LLM's converter: ``medusa_lm_head.safetensors`` with ``{h}.{l}.linear.{weight,bias}``
  and ``{h}.{L}.weight`` (the head's lm_head after its L blocks); config ``medusa_num_heads``, ``medusa_num_layers``.

Both carry one lm_head per head: a shared-head drafter writes the target's head under every head (the engines load
the heads from the drafter folder, not from the target).

MTP modules (key maps: REFERENCE.md, "MTP"); the shared parts (embedding, final norm, head) are copied in, since
these layouts carry them per module:

- DeepSeek-V3 / GLM: module k as decoder layer N + k (N = the target's layer count):
  ``model.layers.{N+k}.{enorm,hnorm,eh_proj,embed_tokens,shared_head.norm,shared_head.head}`` plus the block's own
  keys; config = the target's with ``num_nextn_predict_layers`` = D. The file holds the MTP layers only: put it
  beside the target's shards and add its keys to the index.
- Qwen3-Next: one module as ``mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}`` and ``mtp.layers.0.*``;
  config ``mtp_num_hidden_layers`` 1, ``mtp_use_dedicated_embeddings`` false (the engines reuse that one module for
  every further draft). Qwen3-Next's RMSNorms scale by (1 + w), so every norm weight is written as w - 1.

Aux-layer ids are written in the engines' "before layer k" convention (ours + 1, see models/target.py).
Each format is a pair of pure functions (config dict, state dict) so tests can check key names and shapes on a
meta-device model, and a ``save_*`` that writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.eagle3 import Eagle3Drafter
from models.medusa import MedusaDrafter
from models.mtp import MTPDrafter
from models.target import to_before_layer_ids

DEFAULT_SPECULATIVE_TOKENS = 5
"""Chain length advertised in the speculators proposal method (engines let the user override it)."""


def _llama_fields(drafter: Eagle3Drafter) -> dict:
    cfg = drafter.config
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        # both spellings: transformers 4.x engines read rope_theta / rope_scaling, 5.x reads rope_parameters
        "rope_theta": cfg.rope_parameters["rope_theta"],
        "rope_scaling": None if cfg.rope_parameters["rope_type"] == "default" else dict(cfg.rope_parameters),
        "rope_parameters": dict(cfg.rope_parameters),
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": _dtype_name(drafter),
    }


def _dtype_name(drafter: Eagle3Drafter) -> str:
    return str(drafter.fc.weight.dtype).removeprefix("torch.")


def _aux_before_layer_ids(drafter: Eagle3Drafter) -> list[int]:
    if drafter.target_info is None:
        raise ValueError("the drafter has no target_info; aux-layer ids are unknown")
    return to_before_layer_ids(drafter.target_info.aux_layer_ids)


# ------------------------------------------------------------------------------------ SGLang / vLLM
def sglang_config(drafter: Eagle3Drafter) -> dict:
    """config.json for SGLang / vLLM (``LlamaForCausalLMEagle3``)."""
    cfg = drafter.config
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_fields(drafter),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": _aux_before_layer_ids(drafter),
            "use_aux_hidden_state": True,
        },
    }


def sglang_state_dict(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """Our module names are the engine keys; only the frozen embedding is left out."""
    if drafter.feature_norm is not None:
        raise ValueError("norm_before_fc drafters have no key in the LlamaForCausalLMEagle3 format")
    return drafter.trainable_state_dict()


def save_sglang(drafter: Eagle3Drafter, out_dir: str | Path) -> Path:
    """Write an SGLang / vLLM-loadable directory; returns it."""
    return _write(out_dir, sglang_config(drafter), sglang_state_dict(drafter))


# ------------------------------------------------------------------------------------- speculators
def speculators_config(drafter: Eagle3Drafter, speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> dict:
    """config.json of the speculators format (``Eagle3Speculator``)."""
    cfg = drafter.config
    info = drafter.target_info
    layer = {"architectures": ["LlamaForCausalLM"], **_llama_fields(drafter)}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": _aux_before_layer_ids(drafter),
        "torch_dtype": _dtype_name(drafter),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {  # target_info is set: _aux_before_layer_ids above refuses a drafter without one
                "name_or_path": info.target_name,
                "architectures": info.target_architectures or ["LlamaForCausalLM"],
            },
        },
    }


def speculators_state_dict(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """Same tensors as the SGLang export with the decoder layer under ``layers.0.``."""
    return {
        ("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v
        for k, v in sglang_state_dict(drafter).items()
    }


def save_speculators(
    drafter: Eagle3Drafter, out_dir: str | Path, speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
) -> Path:
    """Write a speculators-format directory; returns it."""
    return _write(out_dir, speculators_config(drafter, speculative_tokens), speculators_state_dict(drafter))


def _write(
    out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor], weights_name: str = "model.safetensors"
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        str(out / weights_name),
        metadata={"format": "pt"},
    )
    return out


# ------------------------------------------------------------------------------------------------ Medusa
def _medusa_heads(drafter: MedusaDrafter) -> list[torch.Tensor]:
    # copies: a shared head is one tensor, and safetensors refuses several names for one storage
    return [drafter.output_head(k).weight.detach().clone() for k in range(drafter.config.num_heads)]


def medusa_vllm_config(drafter: MedusaDrafter) -> dict:
    cfg = drafter.config
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "truncated_vocab_size": cfg.vocab_size,
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": False,
        "torch_dtype": str(drafter.output_head(0).weight.dtype).removeprefix("torch."),
    }


def _medusa_state(drafter: MedusaDrafter, block_key: str, head_key: str) -> dict[str, torch.Tensor]:
    """The heads' tensors under an engine's names: ``block_key`` formats (head, layer, weight|bias), ``head_key``
    formats (head, number of layers)."""
    out = {}
    for h, block in enumerate(drafter.blocks):
        for j, res in enumerate(block):
            out[block_key.format(h, j, "weight")] = res.linear.weight
            out[block_key.format(h, j, "bias")] = res.linear.bias
    for h, weight in enumerate(_medusa_heads(drafter)):
        out[head_key.format(h, drafter.config.num_layers)] = weight
    return out


def medusa_vllm_state_dict(drafter: MedusaDrafter) -> dict[str, torch.Tensor]:
    return _medusa_state(drafter, "blocks.{}.layers.{}.{}", "lm_heads.{}.weight")


def save_medusa_vllm(drafter: MedusaDrafter, out_dir: str | Path) -> Path:
    """Write a vLLM Medusa directory; returns it."""
    return _write(out_dir, medusa_vllm_config(drafter), medusa_vllm_state_dict(drafter))


def medusa_original_config(drafter: MedusaDrafter) -> dict:
    cfg = drafter.config
    info = drafter.target_info
    return {
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": info.target_name if info is not None else None,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
    }


def medusa_original_state_dict(drafter: MedusaDrafter) -> dict[str, torch.Tensor]:
    return _medusa_state(drafter, "{}.{}.linear.{}", "{}.{}.weight")


def save_medusa_original(drafter: MedusaDrafter, out_dir: str | Path) -> Path:
    """Write the original Medusa layout (config.json + medusa_lm_head.safetensors); returns the directory."""
    tensors = medusa_original_state_dict(drafter)
    return _write(out_dir, medusa_original_config(drafter), tensors, "medusa_lm_head.safetensors")


# ------------------------------------------------------------------------------------------------ MTP
def mtp_deepseek_config(drafter: MTPDrafter) -> dict:
    config = drafter.target.config.get_text_config().to_dict()
    config["num_nextn_predict_layers"] = drafter.config.num_modules
    return config


def mtp_deepseek_state_dict(drafter: MTPDrafter) -> dict[str, torch.Tensor]:
    target, N = drafter.target, drafter.target.num_layers
    out = {}
    for k, layer in enumerate(drafter.layers):
        prefix = f"model.layers.{N + k}."
        out.update({prefix + name: w for name, w in layer.state_dict().items() if not name.startswith("block.")})
        out.update({prefix + name: w for name, w in layer.block.state_dict().items()})
        # copies: each layer owns its tensors in this layout (safetensors refuses aliased ones)
        out[prefix + "embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
        out[prefix + "shared_head.norm.weight"] = target.final_norm.weight.detach().clone()
        out[prefix + "shared_head.head.weight"] = target.lm_head.weight.detach().clone()
    return out


def save_mtp_deepseek(drafter: MTPDrafter, out_dir: str | Path) -> Path:
    return _write(out_dir, mtp_deepseek_config(drafter), mtp_deepseek_state_dict(drafter), "model-mtp.safetensors")


def mtp_qwen3_next_config(drafter: MTPDrafter) -> dict:
    config = drafter.target.config.get_text_config().to_dict()
    config.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    return config


def mtp_qwen3_next_state_dict(drafter: MTPDrafter, module: int = 0) -> dict[str, torch.Tensor]:
    """Module ``module`` (0-based) of the drafter: the layout holds one (pass which one explicitly for D > 1)."""
    layer = drafter.layers[module]
    out = {
        "mtp.fc.weight": layer.eh_proj.weight,
        "mtp.pre_fc_norm_embedding.weight": layer.enorm.weight,
        "mtp.pre_fc_norm_hidden.weight": layer.hnorm.weight,
        "mtp.norm.weight": drafter.target.final_norm.weight,
        **{f"mtp.layers.0.{name}": w for name, w in layer.block.state_dict().items()},
    }
    return {k: (w - 1 if "norm" in k.split(".")[-2] else w) for k, w in out.items()}  # enorm, q_norm, …


def save_mtp_qwen3_next(drafter: MTPDrafter, out_dir: str | Path, module: int | None = None) -> Path:
    """``module`` must be given when the drafter has more than one (the layout has room for one)."""
    if module is None:
        if drafter.config.num_modules > 1:
            raise ValueError(
                f"the Qwen3-Next layout holds one MTP module and this drafter has {drafter.config.num_modules}: "
                "pass module=<0-based index>"
            )
        module = 0
    return _write(out_dir, mtp_qwen3_next_config(drafter), mtp_qwen3_next_state_dict(drafter, module))
