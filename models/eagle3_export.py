"""EAGLE-3 engine exports: SGLang / vLLM (``LlamaForCausalLMEagle3``) and speculators (``Eagle3Speculator``);
the shared writing machinery is `models.export`, the list of refusals docs/exports.md.

EAGLE-3 aux-layer ids. Ours mean "output of layer k", 0-based (models/target.py). Both engines capture, in the
target's ``LlamaModel.forward``, the residual stream entering layer i (``hidden_states + residual`` before layer i
runs, i.e. the output of layer i - 1), and concatenate the captures in layer order. What each reads:

- SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` (model_runner.py) and hands the list to
  ``set_eagle3_layers_to_capture``, which captures before layer ``k + 1`` (models/llama.py): that list holds our
  after-layer ids, as SpecForge writes it.
- vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids`` first and captures before those layers as given
  (v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config``; models/llama.py): that list holds
  before-layer ids, ours + 1. Without it vLLM falls back to ``eagle_config``'s list, read the same way, so the
  top-level key must be written. The speculators format has only the top-level key (vLLM's converter copies it).

Ids out of ascending order are refused: the engines would hand ``fc`` the features in layer order, not in the order
it was trained on. A tap on the last layer or a repeated id makes the engines capture fewer features than ``fc``
reads, which fails at load (a shape error), not silently.

EAGLE-3 (key maps: REFERENCE.md, "EAGLE-3"):

- SGLang / vLLM (``LlamaForCausalLMEagle3``): a LlamaConfig with one hidden layer plus ``draft_vocab_size``,
  ``target_hidden_size``, ``norm_before_residual`` false and the aux-layer ids as above; weights ``fc.weight``,
  ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 offsets), ``t2d`` (bool); no ``embed_tokens``
  (the engines share the target's).
- speculators (``Eagle3Speculator``): the same weights with the layer under ``layers.0.``, the layer shape in
  ``transformer_layer_config``, the before-layer ids at top level and the verifier and proposal in
  ``speculators_config``.

"""

from __future__ import annotations

from pathlib import Path

import torch

from models.eagle3 import Eagle3Drafter
from models.export import EngineExport, refusal_of, write_folder
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


def _aux_after_layer_ids(drafter: Eagle3Drafter) -> list[int]:
    """The drafter's taps, ours: "output of layer k", 0-based (what SGLang's ``eagle_config`` list means)."""
    if drafter.target_info is None:
        raise ValueError("the drafter has no target_info; aux-layer ids are unknown")
    ids = list(drafter.target_info.aux_layer_ids)
    if ids != sorted(ids):
        raise ValueError(
            f"aux-layer ids {ids} are not in ascending order: SGLang and vLLM capture the taps while walking the "
            "target's layers and concatenate them in layer order (LlamaModel.forward), so fc would read its features "
            f"in the order {sorted(ids)}, not the order it was trained on"
        )
    return ids


def _aux_before_layer_ids(drafter: Eagle3Drafter) -> list[int]:
    """The same taps as vLLM names them: "before layer k + 1" (the residual stream entering that layer)."""
    return to_before_layer_ids(_aux_after_layer_ids(drafter))


# ------------------------------------------------------------------------------------ SGLang / vLLM
def sglang_config(drafter: Eagle3Drafter) -> dict:
    """config.json for SGLang / vLLM (``LlamaForCausalLMEagle3``); the aux-layer ids in each engine's meaning."""
    cfg = drafter.config
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_fields(drafter),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # the layer keeps h (not hidden_norm(h)) as its residual; vLLM's llama_eagle3.py reads this, default false
        "norm_before_residual": False,
        # vLLM (v1/worker/gpu_model_runner.py, _get_eagle3_aux_layers_from_config) reads this key first and captures
        # the input of each listed layer: before-layer ids, ours + 1
        "eagle_aux_hidden_state_layer_ids": _aux_before_layer_ids(drafter),
        # SGLang (model_runner.py) hands this list to set_eagle3_layers_to_capture, which adds 1 itself (models/llama.py):
        # after-layer ids, ours as they are (SpecForge writes the same)
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": _aux_after_layer_ids(drafter),
            "use_aux_hidden_state": True,
        },
    }


def sglang_state_dict(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """Our module names are the engine keys; only the frozen embedding is left out."""
    if drafter.feature_norm is not None:
        raise ValueError("norm_before_fc drafters have no key in the LlamaForCausalLMEagle3 format")
    return drafter.trainable_state_dict()


def _sglang_readme(drafter: Eagle3Drafter) -> str:
    info = drafter.target_info
    return f"""
# EAGLE-3 drafter: SGLang / vLLM (`LlamaForCausalLMEagle3`)

Target: `{info.target_name if info else "?"}`; aux layers: outputs of layers {_aux_after_layer_ids(drafter)} (0-based),
written as `eagle_config.eagle_aux_hidden_state_layer_ids` {_aux_after_layer_ids(drafter)} (SGLang adds 1 itself) and
top-level `eagle_aux_hidden_state_layer_ids` {_aux_before_layer_ids(drafter)} (vLLM: the layers whose input it takes).

- SGLang: `--speculative-algorithm EAGLE3 --speculative-draft-model-path <this folder>
  --speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 32`
- vLLM: `--speculative-config '{{"method": "eagle3", "model": "<this folder>", "num_speculative_tokens": 5}}'`
  (name the method: vLLM guesses "eagle3" only from a model path that contains that word).

Both engines share the target's embedding (none is stored here) and map draft ids to target ids with `d2t`
(offsets: target = draft + d2t[draft]). See docs/exports.md in the drafters repository.
"""


def save_sglang(drafter: Eagle3Drafter, out_dir: str | Path) -> Path:
    """Write an SGLang / vLLM-loadable directory; returns it."""
    return write_folder(out_dir, sglang_config(drafter), sglang_state_dict(drafter), readme=_sglang_readme(drafter))


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
        # vLLM's speculators converter copies this key to the top level, where its model runner reads it as the
        # layers whose input it captures: before-layer ids, ours + 1
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


def eagle3_engine_exports(drafter: Eagle3Drafter) -> list[EngineExport]:
    """The EAGLE-3 engine folders of a trained drafter: SGLang / vLLM and speculators (one refusal covers both: they
    hold the same tensors and the same aux-layer ids)."""
    why = refusal_of(lambda: (sglang_config(drafter), sglang_state_dict(drafter)))
    if why is not None:
        return [EngineExport("export-sglang", None, why), EngineExport("export-speculators", None, why)]
    ids = _aux_after_layer_ids(drafter)
    return [
        EngineExport(
            "export-sglang",
            lambda out: save_sglang(drafter, out),
            f"SGLang / vLLM `LlamaForCausalLMEagle3`: the drafter's layer, fc, norm, head, d2t and t2d; taps after "
            f"layers {ids} (SGLang's eagle_config) = before layers {_aux_before_layer_ids(drafter)} (vLLM's top level)",
        ),
        EngineExport(
            "export-speculators",
            lambda out: save_speculators(drafter, out),
            "speculators `Eagle3Speculator` (vLLM converts it itself): the same tensors with the layer under "
            f"`layers.0.`, taps before layers {_aux_before_layer_ids(drafter)}",
        ),
    ]


def save_speculators(
    drafter: Eagle3Drafter, out_dir: str | Path, speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
) -> Path:
    """Write a speculators-format directory; returns it."""
    readme = """
# EAGLE-3 drafter: speculators format (`Eagle3Speculator`)

vLLM: `--speculative-config '{"model": "<this folder>", "num_speculative_tokens": 5}'` (vLLM recognises the
format by `speculators_model_type` and converts it itself; the verifier is named in `speculators_config`).
"""
    return write_folder(
        out_dir, speculators_config(drafter, speculative_tokens), speculators_state_dict(drafter), readme=readme
    )
