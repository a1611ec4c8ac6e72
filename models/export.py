"""Export drafters to the folders serving engines load, or refuse with the reason (docs/exports.md has the engine
sources read, the launch flags and the full list of refusals).

Every ``save_*`` writes ``config.json``, the weights and a ``README.md`` saying which engine loads the folder and
with which flags, or writes nothing and raises ValueError with the reason. Each format is also a pair of pure
functions (config dict, state dict) so tests can check key names, shapes and dtypes on a meta-device model.

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

Medusa heads (REFERENCE.md, "Medusa"); both layouts carry one lm_head per head (a shared-head drafter writes the
target's head under every head: the engines load the heads from the drafter folder, not from the target):

- vLLM (``model_type: "medusa"``): ``blocks.{h}.layers.{j}.{weight,bias}`` and ``lm_heads.{h}.weight``.
- original Medusa (FasterDecoding) and TensorRT-LLM's converter: ``medusa_lm_head.pt`` (a torch pickle: FasterDecoding
  opens nothing else; TensorRT-LLM prefers it) with ``{h}.{l}.linear.{weight,bias}`` and ``{h}.{L}.weight``; config
  ``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``. TensorRT-LLM takes the head count from
  ``--num_medusa_heads`` (default 4) and the depth from ``--num_medusa_layers``, never from the config: the README
  written beside the weights gives the command. Refused (`medusa_original_refusal`) where FasterDecoding's loader
  cannot build the heads as trained: more than one ResBlock per head (it builds ``[ResBlock] * L``, one module
  repeated), more than five heads (it builds five, loads with ``strict=False`` and drops the rest), a base that is
  not Llama or Mistral (its ``MedusaModel.from_pretrained`` raises).

MTP modules (REFERENCE.md, "MTP"). vLLM and SGLang build their own MTP block and route a draft to it only for the
target families below, so these layouts are written only for targets of that family (refused otherwise: a Llama
target's MTP modules serve in drafters' own runtime, infer/mtp_proposer.py):

- DeepSeek-V3 (``model_type: deepseek_v3``): module k as decoder layer N + k,
  ``model.layers.{N+k}.{enorm,hnorm,eh_proj,embed_tokens,shared_head.norm,shared_head.head}`` plus the block's keys in
  the checkpoint layout (experts one by one); config = the target's with ``num_nextn_predict_layers``, in
  ``model-mtp.safetensors``. SGLang loads one module only, so a drafter with D > 1 must say how many to write;
  `mtp_engine_exports` (what training writes) takes the first module then, and says so.
- Qwen3-Next (``model_type: qwen3_next``): one module as ``mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}``
  and ``mtp.layers.0.*``, plus ``model.embed_tokens.weight`` and ``lm_head.weight`` (vLLM loads both from the draft
  checkpoint). Qwen3-Next's norms scale by (1 + w): transformers already stores the target's norms (the block's and
  the final one) that way, so only our own enorm / hnorm (which scale by w) are written as w - 1.

Both engines (and transformers) feed an MTP module the target's output after the final norm, so only modules trained
on that signal (``MTPConfig.input_signal`` "last_hidden", the default) are written; a "pre_norm" drafter is refused
with the reason, so a published folder is fed in the engine what it was trained on (docs/exports.md has the sources).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

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


def _write(
    out_dir: str | Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    weights_name: str = "model.safetensors",
    readme: str | None = None,
) -> Path:
    """config.json, the weights (safetensors, or a torch pickle when ``weights_name`` ends in .pt) and README.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # copies: views of one storage (a shared head, fused experts) must not alias in the file
    tensors = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}
    if weights_name.endswith(".pt"):
        torch.save(tensors, out / weights_name)
    else:
        save_file(tensors, str(out / weights_name), metadata={"format": "pt"})
    if readme is not None:
        (out / "README.md").write_text(readme.strip() + "\n")
    return out


def _refuse(reason: str | None) -> None:
    if reason is not None:
        raise ValueError(reason)


class EngineExport(NamedTuple):
    """One engine folder of a trained drafter: written, or refused with the reason. A tuple so that a caller may
    unpack it (``for folder, write, what in ...``) as training does."""

    folder: str
    """The folder's name inside a checkpoint or a published folder, e.g. "export-sglang"."""
    write: Callable[[Path], Path] | None
    """Writes the folder at the path given and returns it; None when the layout refuses this drafter."""
    what: str
    """What the folder holds (written) or why there is none (refused), in words for a log or a model card."""


def _refusal_of(build: Callable[[], object]) -> str | None:
    """The reason a layout refuses a drafter: every builder here raises ValueError with it, or returns."""
    try:
        build()
    except ValueError as e:
        return str(e)
    return None


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
    return _write(out_dir, sglang_config(drafter), sglang_state_dict(drafter), readme=_sglang_readme(drafter))


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
    why = _refusal_of(lambda: (sglang_config(drafter), sglang_state_dict(drafter)))
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
    return _write(
        out_dir, speculators_config(drafter, speculative_tokens), speculators_state_dict(drafter), readme=readme
    )


# ------------------------------------------------------------------------------------------------ Medusa
FASTERDECODING_HEADS = 5
"""Heads FasterDecoding's loader builds whatever the config says (medusa/model/medusa_model.py, the MEDUSA-v0.1
branch of MedusaModelABC.from_pretrained: ``base_model_config.medusa_num_heads = 5``)."""
FASTERDECODING_BASES = ("LlamaForCausalLM", "MistralForCausalLM")
"""FasterDecoding's MedusaModel.from_pretrained accepts model_type llama or mistral only."""


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
    n = drafter.config.num_heads
    readme = f"""
# Medusa heads: vLLM (`model_type: medusa`)

vLLM: `--speculative-config '{{"model": "<this folder>", "num_speculative_tokens": {n}}}'` (the method is found from
`model_type`). `num_speculative_tokens` must be at most {n}: vLLM sets the head count to it
(MedusaConfig.num_lookahead_tokens) and a head without weights fails the load. vLLM drafts a top-1 chain with the
heads, not Medusa's tree.
"""
    return _write(out_dir, medusa_vllm_config(drafter), medusa_vllm_state_dict(drafter), readme=readme)


def medusa_original_refusal(drafter: MedusaDrafter, base_model_name_or_path: str | None = None) -> str | None:
    """Why the original layout cannot hold these heads (None: FasterDecoding's loader builds them as trained).

    FasterDecoding (medusa/model/medusa_model.py): ``MedusaModel.from_pretrained`` raises unless the base's model_type
    is llama or mistral; the MEDUSA-v0.1 branch of ``MedusaModelABC.from_pretrained`` sets ``medusa_num_heads = 5``
    and loads the heads with ``strict=False``; ``MedusaModelABC.__init__`` builds ``[ResBlock(hidden)] *
    medusa_num_layers``, one module repeated."""
    cfg, info = drafter.config, drafter.target_info
    if not (base_model_name_or_path or (info.target_name if info else None)):
        return (
            "the original Medusa layout needs base_model_name_or_path (FasterDecoding's loader opens the base model "
            "from it) and this drafter names no target: pass base_model_name_or_path=..."
        )
    served = "; these heads serve in vLLM (export-vllm) and in drafters' own runtime"
    if cfg.num_layers > 1:
        return (
            f"FasterDecoding cannot build {cfg.num_layers} ResBlocks per head: it builds `[ResBlock(hidden)] * "
            f"medusa_num_layers`, one module repeated, so the {cfg.num_layers} distinct blocks of each head would "
            f"load as block {cfg.num_layers - 1} repeated{served}"
        )
    if cfg.num_heads > FASTERDECODING_HEADS:
        return (
            f"FasterDecoding cannot build {cfg.num_heads} heads: it builds {FASTERDECODING_HEADS} whatever the config "
            f"says and loads with strict=False, so heads {FASTERDECODING_HEADS}..{cfg.num_heads - 1} would be "
            f"dropped{served}"
        )
    archs = info.target_architectures if info else []
    if archs and not set(archs) & set(FASTERDECODING_BASES):
        return (
            f"FasterDecoding serves llama and mistral bases only (it raises otherwise); this target is {archs}{served}"
        )
    return None


def medusa_original_config(drafter: MedusaDrafter, base_model_name_or_path: str | None = None) -> dict:
    """FasterDecoding's MedusaConfig (no ``model_type``: with one, its loader takes the folder for a whole model).
    Refused (ValueError) with `medusa_original_refusal`'s reason."""
    _refuse(medusa_original_refusal(drafter, base_model_name_or_path))
    cfg, info = drafter.config, drafter.target_info
    return {
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": base_model_name_or_path or info.target_name,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
    }


def medusa_original_state_dict(drafter: MedusaDrafter) -> dict[str, torch.Tensor]:
    """The key map alone (no refusal): ``{h}.{l}.linear.{weight,bias}`` and ``{h}.{L}.weight``."""
    return _medusa_state(drafter, "{}.{}.linear.{}", "{}.{}.weight")


def _medusa_original_readme(drafter: MedusaDrafter, base: str) -> str:
    cfg, info = drafter.config, drafter.target_info
    n, layers = cfg.num_heads, cfg.num_layers
    dtype = str(drafter.output_head(0).weight.dtype).removeprefix("torch.")
    fd = (  # medusa_original_refusal passed: one ResBlock per head, at most five heads, a llama / mistral base
        "FasterDecoding loads it exactly. It always builds 5 heads: "
        + (f"heads {n}..4 stay untrained, so use `medusa_choices` no deeper than {n}. " if n < 5 else "")
        + f"`base_model_name_or_path` (`{base}`) must resolve on the serving machine."
    )
    joint = ""
    if info is not None and info.target_weights:
        joint = (
            f"\nThe target was trained jointly (`target_weights: {info.target_weights}`): serve the changed target "
            "(the drafter checkpoint's `target/`, merged), not the original base.\n"
        )
    return f"""
# Medusa heads: original layout (FasterDecoding/Medusa, TensorRT-LLM)

{n} heads x {layers} ResBlock(s), `medusa_lm_head.pt` (a torch pickle of plain tensors: `torch.load(...,
weights_only=True)` reads it): `{{h}}.{{l}}.linear.weight|bias` and `{{h}}.{layers}.weight` (head h's lm_head).

TensorRT-LLM (TensorRT engine workflow, `examples/medusa`): the converter takes the head count and depth from its
flags, never from `config.json` (`--num_medusa_heads` defaults to 4):

    python examples/medusa/convert_checkpoint.py --model_dir <target> --medusa_model_dir <this folder> \\
        --num_medusa_heads {n} --num_medusa_layers {layers} --dtype {dtype} --output_dir <tllm checkpoint>
    trtllm-build --checkpoint_dir <tllm checkpoint> --output_dir <engine> --speculative_decoding_mode medusa

then run with `--medusa_choices` of depth at most {n}.

FasterDecoding (`medusa.model.medusa_model.MedusaModel.from_pretrained(<this folder>)`): {fd}
{joint}"""


def save_medusa_original(
    drafter: MedusaDrafter, out_dir: str | Path, base_model_name_or_path: str | None = None
) -> Path:
    """Write the original Medusa layout: config.json, ``medusa_lm_head.pt`` (what FasterDecoding's loader opens;
    TensorRT-LLM's converter prefers it too) and a README with the TensorRT-LLM flags (``--num_medusa_heads N
    --num_medusa_layers L``: the converter does not read them from the config). Writes nothing and raises ValueError
    with `medusa_original_refusal`'s reason where FasterDecoding cannot build the heads as trained or the base model
    is unknown. Returns the directory."""
    config = medusa_original_config(drafter, base_model_name_or_path)
    readme = _medusa_original_readme(drafter, config["base_model_name_or_path"])
    return _write(out_dir, config, medusa_original_state_dict(drafter), "medusa_lm_head.pt", readme)


def medusa_engine_exports(drafter: MedusaDrafter) -> list[EngineExport]:
    """The Medusa engine folders of a trained drafter: vLLM always, the original layout where FasterDecoding builds
    the heads as trained (`medusa_original_refusal`)."""
    cfg = drafter.config
    heads = f"{cfg.num_heads} heads x {cfg.num_layers} ResBlock(s), one lm_head per head"
    exports = [EngineExport("export-vllm", lambda out: save_medusa_vllm(drafter, out), f"vLLM `medusa`: {heads}")]
    why = medusa_original_refusal(drafter)
    if why is None:
        write = lambda out: save_medusa_original(drafter, out)  # noqa: E731
        exports.append(EngineExport("export-medusa", write, f"FasterDecoding / TensorRT-LLM original layout: {heads}"))
    else:
        exports.append(EngineExport("export-medusa", None, why))
    return exports


# ------------------------------------------------------------------------------------------------ MTP
SIGNAL_NOTE = """
The module was trained on the target's output after the final norm (`input_signal: last_hidden`), the hidden state
vLLM and SGLang pass their MTP module (their model's output) and transformers too (`hidden_states[-1]`).
"""


def _target_model_type(drafter: MTPDrafter) -> str:
    return drafter.target.config.get_text_config().model_type


def _family_refusal(drafter: MTPDrafter, model_type: str, layout: str, engines: str) -> str | None:
    have = _target_model_type(drafter)
    if have == model_type:
        return None
    return (
        f"the {layout} MTP layout is for {model_type} targets only: {engines}. This target is {have} "
        f"({drafter.config.block_class} blocks), so its MTP modules serve in drafters' own runtime "
        "(infer/mtp_proposer.py), not in vLLM or SGLang"
    )


def _signal_refusal(drafter: MTPDrafter) -> str | None:
    if drafter.config.input_signal == "last_hidden":
        return None
    return (
        "these modules read the target's last-layer output before the final norm (input_signal pre_norm), while vLLM "
        "and SGLang feed their MTP module the model's output after the final norm (transformers: hidden_states[-1], "
        "the same): served there, the module would see another input than in training and accept less. Train them "
        "with mtp.input_signal=last_hidden; this drafter serves in drafters' own runtime (infer/mtp_proposer.py)"
    )


def _is_moe(block: torch.nn.Module) -> bool:
    return hasattr(getattr(block, "mlp", None), "experts")


def _checkpoint_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers 5 block's weights under checkpoint names. transformers fuses MoE experts into 3-D parameters
    (``experts.gate_up_proj`` [E, 2I, H] with gate first, ``experts.down_proj`` [E, H, I]); checkpoints, vLLM and
    SGLang name them one expert at a time (``experts.{e}.{gate,up,down}_proj.weight``; transformers'
    conversion_mapping.py "qwen2_moe", which deepseek_v3 and qwen3_next use)."""
    out = {}
    for name, w in state.items():
        if name.endswith("experts.gate_up_proj") and w.dim() == 3:
            base = name.removesuffix("gate_up_proj")
            gate, up = w.chunk(2, dim=1)
            for e in range(w.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e]
                out[f"{base}{e}.up_proj.weight"] = up[e]
        elif name.endswith("experts.down_proj") and w.dim() == 3:
            base = name.removesuffix("down_proj")
            for e in range(w.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = w[e]
        elif w.dim() > 2:
            raise ValueError(f"{name}: a fused {w.dim()}-D parameter this export does not know the checkpoint name of")
        else:
            out[name] = w
    return out


def _engine_config(drafter: MTPDrafter, architecture: str) -> dict:
    """The target's text config as the engines read it: ``architectures`` set (vLLM's hf_config_override indexes
    ``architectures[0]``; SGLang renames the draft architecture from it), rope in both spellings, the dtype of the
    weights written, and nothing that points at files or quantized weights this folder lacks."""
    config = drafter.target.config.get_text_config().to_dict()
    for key in ("quantization_config", "auto_map", "_name_or_path", "num_mtp_layers"):
        config.pop(key, None)
    rope = config.get("rope_parameters") or {}
    if rope:
        config.setdefault("rope_theta", rope.get("rope_theta"))
        if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
            config["rope_scaling"] = dict(rope)
        if "partial_rotary_factor" in rope:
            config.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
    dtype = str(next(drafter.layers.parameters()).dtype).removeprefix("torch.")
    config.update(architectures=[architecture], torch_dtype=dtype, dtype=dtype)
    return config


# --- DeepSeek-V3 ------------------------------------------------------------------------------------------
def _deepseek_count(drafter: MTPDrafter, num_modules: int | None) -> int:
    return drafter.config.num_modules if num_modules is None else num_modules


def mtp_deepseek_refusal(drafter: MTPDrafter, num_modules: int | None = None) -> str | None:
    """Why the DeepSeek-V3 layout cannot hold these modules (None: it can). ``num_modules``: how many of the D
    modules to write (the first ones); None means all D, which SGLang loads only for D = 1."""
    why = _family_refusal(
        drafter,
        "deepseek_v3",
        "DeepSeek-V3",
        "vLLM (deepseek_mtp.py) and SGLang (deepseek_nextn.py) build their own MTP block (DeepseekV2DecoderLayer: MLA "
        "attention and a mixture of experts) and route a draft to it only for model_type deepseek_v3",
    )
    why = why or _signal_refusal(drafter)
    if why:
        return why
    D, N = drafter.config.num_modules, drafter.target.num_layers
    if num_modules is None and D > 1:
        return (
            f"this drafter has {D} MTP modules and SGLang's DeepSeek NextN loader asserts num_nextn_predict_layers "
            "== 1 (deepseek weight loader): pass num_modules=1 for a folder both engines load, or "
            f"num_modules={D} for vLLM only (deepseek_mtp.py builds num_nextn_predict_layers modules)"
        )
    n = _deepseek_count(drafter, num_modules)
    if not 1 <= n <= D:
        return f"num_modules must be between 1 and {D}, got {n}"
    if N == 1:
        return (
            "SGLang reads a one-layer target's NextN module from model.layers.0 (nextn_layer_id = 0 when "
            "num_hidden_layers == 1), where the target's own layer lives"
        )
    cfg = drafter.target.config.get_text_config()
    freq = getattr(cfg, "moe_layer_freq", 1)
    if freq != 1:
        return (
            f"moe_layer_freq is {freq}: transformers' DeepseekV3 ignores it (MoE from first_k_dense_replace on) while "
            "vLLM and SGLang make only every moe_layer_freq-th layer MoE, so the engines would not serve this target "
            "as it was trained"
        )
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        have = getattr(cfg, key, want)
        if have != want:
            return (
                f"{key} is {have!r}: transformers' DeepseekV3 router computes {want!r} (sigmoid scores, "
                "e_score_correction_bias), which the engines read this key to reproduce"
            )
    if getattr(cfg, "rope_interleave", True) is False:
        return (
            "rope_interleave is false: vLLM's and SGLang's MLA apply rope interleaved (is_neox_style=False), as "
            "transformers does only with rope_interleave true"
        )
    for k in range(n):
        engine_moe = cfg.n_routed_experts is not None and N + k >= cfg.first_k_dense_replace
        if not (_is_moe(drafter.layers[k].block) and engine_moe):
            return (
                f"module {k}'s block is {'a mixture of experts' if _is_moe(drafter.layers[k].block) else 'dense'} "
                f"(a copy of the target's layer {N - 1}) while vLLM builds layer {N + k} "
                f"{'as MoE' if engine_moe else 'dense'} and SGLang's NextN block is always MoE: the layouts must agree"
            )
    return None


def mtp_deepseek_config(drafter: MTPDrafter, num_modules: int | None = None) -> dict:
    """The target's config with the keys that route vLLM and SGLang to their DeepSeek MTP path."""
    _refuse(mtp_deepseek_refusal(drafter, num_modules))
    config = _engine_config(drafter, "DeepseekV3ForCausalLM")
    for derived in ("head_dim", "qk_head_dim"):  # transformers derives them from the qk dims; DeepSeek's own has none
        config.pop(derived, None)
    config.update(
        model_type="deepseek_v3",  # vLLM: deepseek_v3 -> deepseek_mtp (SpeculativeConfig.hf_config_override)
        num_nextn_predict_layers=_deepseek_count(drafter, num_modules),  # vLLM n_predict / layers; SGLang == 1
        # what transformers' DeepseekV3 computes, in the keys vLLM's and SGLang's DeepseekV2MoE read
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        moe_layer_freq=1,
    )
    return config


def mtp_deepseek_state_dict(drafter: MTPDrafter, num_modules: int | None = None) -> dict[str, torch.Tensor]:
    """Module k as ``model.layers.{N+k}.*``: vLLM's DeepSeekMTP.load_weights takes every key of those layers
    (embed_tokens from the first, shared_head per layer, the rest as ``mtp_block``); SGLang's NextN loader takes
    enorm / hnorm / eh_proj / shared_head.norm and the block, and the target's embedding and head."""
    _refuse(mtp_deepseek_refusal(drafter, num_modules))
    target, N = drafter.target, drafter.target.num_layers
    out = {}
    for k in range(_deepseek_count(drafter, num_modules)):
        layer, prefix = drafter.layers[k], f"model.layers.{N + k}."
        # DeepSeek's RMSNorm scales by w, as ours does: enorm / hnorm go as they are
        out[prefix + "enorm.weight"] = layer.enorm.weight
        out[prefix + "hnorm.weight"] = layer.hnorm.weight
        out[prefix + "eh_proj.weight"] = layer.eh_proj.weight
        out.update({prefix + name: w for name, w in _checkpoint_layout(layer.block.state_dict()).items()})
        out[prefix + "embed_tokens.weight"] = target.embed_tokens.weight
        out[prefix + "shared_head.norm.weight"] = target.final_norm.weight
        out[prefix + "shared_head.head.weight"] = target.lm_head.weight
    return out


def _deepseek_readme(drafter: MTPDrafter, n: int) -> str:
    N = drafter.target.num_layers
    layers = f"`model.layers.{N}`" if n == 1 else f"`model.layers.{N}`..`model.layers.{N + n - 1}`"
    cycle = (
        "the one module runs for every draft step"
        if n == 1
        else f"vLLM cycles the {n} modules; more speculative tokens than {n} must be a multiple of {n}"
    )
    sglang = (
        "- SGLang: `--speculative-algorithm EAGLE --speculative-draft-model-path <this folder> "
        "--speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2` (NEXTN is the same "
        "algorithm; SGLang renames DeepseekV3ForCausalLM to DeepseekV3ForCausalLMNextN for the draft)."
        if n == 1
        else f"- SGLang does not load this folder: its NextN loader asserts num_nextn_predict_layers == 1 (here {n})."
    )
    return f"""
# MTP modules: DeepSeek-V3 layout

{n} module(s) as {layers} of a {N}-layer DeepSeek-V3 target, each with its own copy of the target's embedding,
final norm (`shared_head.norm`) and head (`shared_head.head`), in `model-mtp.safetensors`; `config.json` is the
target's with `num_nextn_predict_layers: {n}`.

- vLLM: `--speculative-config '{{"method": "mtp", "model": "<this folder>", "num_speculative_tokens": {n}}}'`
  ({cycle}).
{sglang}
- transformers (`generate(..., use_mtp=True)`) reads MTP weights only from the target's own folder and only at
  layer 61 (DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected), i.e. for the full DeepSeek-V3: copy the
  file there and add its keys to `model.safetensors.index.json`.

vLLM zeroes the embedding at position 0 before the module; drafters does not.
{SIGNAL_NOTE}"""


def save_mtp_deepseek(drafter: MTPDrafter, out_dir: str | Path, num_modules: int | None = None) -> Path:
    """Write the DeepSeek-V3 MTP folder (refused with the reason by `mtp_deepseek_refusal`); returns it."""
    config = mtp_deepseek_config(drafter, num_modules)
    state = mtp_deepseek_state_dict(drafter, num_modules)
    n = config["num_nextn_predict_layers"]
    return _write(out_dir, config, state, "model-mtp.safetensors", _deepseek_readme(drafter, n))


# --- Qwen3-Next -------------------------------------------------------------------------------------------
def mtp_qwen3_next_refusal(drafter: MTPDrafter, module: int | None = None) -> str | None:
    """Why the Qwen3-Next layout cannot hold module ``module`` (None: it can). ``module`` None means the only one."""
    why = _family_refusal(
        drafter,
        "qwen3_next",
        "Qwen3-Next",
        "vLLM (qwen3_next_mtp.py) and SGLang (qwen3_next_mtp.py) build their own MTP layer (Qwen3NextDecoderLayer: "
        "gated full attention, a mixture of experts, (1 + w) norms) and route a draft to it only for model_type "
        "qwen3_next",
    )
    why = why or _signal_refusal(drafter)
    if why:
        return why
    D = drafter.config.num_modules
    if module is None and D > 1:
        return (
            f"the Qwen3-Next layout holds one MTP module and this drafter has {D}: pass module=<0-based index> "
            "(the engines run that one module for every draft step)"
        )
    k = 0 if module is None else module
    if not 0 <= k < D:
        return f"module must be between 0 and {D - 1}, got {k}"
    cfg, N = drafter.target.config.get_text_config(), drafter.target.num_layers
    if cfg.layer_types[N - 1] != "full_attention":
        return (
            "the engines build the MTP layer with full attention (vLLM: layer_type='full_attention'; SGLang: "
            f"full_attention_interval = 1) and this drafter's blocks copy the target's layer {N - 1}, a "
            f"{cfg.layer_types[N - 1]} layer"
        )
    # vLLM and SGLang build the MTP layer as layer 0: MoE unless 0 is in mlp_only_layers or 1 % decoder_sparse_step
    engine_moe = 0 not in (cfg.mlp_only_layers or []) and cfg.num_experts > 0 and 1 % cfg.decoder_sparse_step == 0
    ours = _is_moe(drafter.layers[k].block)
    if ours != engine_moe:
        return (
            f"this drafter's block is {'a mixture of experts' if ours else 'dense'} (the target's layer {N - 1}) and "
            f"the engines build the MTP layer (as layer 0) {'as MoE' if engine_moe else 'dense'}"
        )
    return None


def mtp_qwen3_next_config(drafter: MTPDrafter) -> dict:
    """The target's config with the keys the engines' Qwen3-Next MTP path reads."""
    _refuse(mtp_qwen3_next_refusal(drafter, 0))
    config = _engine_config(drafter, "Qwen3NextForCausalLM")  # SGLang renames it Qwen3NextForCausalLMMTP
    config.update(
        model_type="qwen3_next",  # vLLM: qwen3_next -> qwen3_next_mtp (SpeculativeConfig.hf_config_override)
        num_nextn_predict_layers=1,  # vLLM: n_predict and the number of MTP layers (qwen3_next_mtp.py)
        mtp_num_hidden_layers=1,  # Qwen3-Next's own key
        mtp_use_dedicated_embeddings=False,
        num_mtp_layers=1,  # transformers' MtpModel (get_mtp_config) ...
        mtp_layer_types=["full_attention"],  # ... and the layer type it builds
    )
    return config


def mtp_qwen3_next_state_dict(drafter: MTPDrafter, module: int = 0) -> dict[str, torch.Tensor]:
    """Module ``module`` (0-based) of the drafter: the layout holds one (pass which one explicitly for D > 1)."""
    _refuse(mtp_qwen3_next_refusal(drafter, module))
    layer, target = drafter.layers[module], drafter.target
    return {
        "mtp.fc.weight": layer.eh_proj.weight,
        # our enorm / hnorm scale by w; the engines' (GemmaRMSNorm / Qwen3NextRMSNorm) by 1 + w
        "mtp.pre_fc_norm_embedding.weight": layer.enorm.weight - 1,
        "mtp.pre_fc_norm_hidden.weight": layer.hnorm.weight - 1,
        # the target's final norm and the block's norms are transformers' Qwen3NextRMSNorm: stored as (1 + w) already
        "mtp.norm.weight": target.final_norm.weight,
        **{f"mtp.layers.0.{name}": w for name, w in _checkpoint_layout(layer.block.state_dict()).items()},
        # vLLM's Qwen3NextMTP.load_weights keeps names containing embed_tokens / lm_head and needs both
        "model.embed_tokens.weight": target.embed_tokens.weight,
        "lm_head.weight": target.lm_head.weight,
    }


def _qwen3_next_readme(drafter: MTPDrafter, module: int) -> str:
    return f"""
# MTP module: Qwen3-Next layout

Module {module} of the drafter as `mtp.*` (one full-attention layer `mtp.layers.0`), plus the target's embedding and
head (`model.embed_tokens.weight`, `lm_head.weight`) in `model.safetensors`.

- vLLM: `--speculative-config '{{"method": "mtp", "model": "<this folder>", "num_speculative_tokens": 2}}'`
  (the one module runs for every draft step).
- SGLang: `--speculative-algorithm NEXTN --speculative-draft-model-path <this folder> --speculative-num-steps 2
  --speculative-eagle-topk 1 --speculative-num-draft-tokens 3` (it renames Qwen3NextForCausalLM to
  Qwen3NextForCausalLMMTP for the draft, loads the `mtp.*` keys and shares the target's embedding and head).
- transformers (`generate(..., use_mtp=True)`) reads `mtp.*` from the target's own folder: copy the tensors there.

Norms are zero-centred (the engines scale by 1 + w), as transformers stores Qwen3-Next's.
{SIGNAL_NOTE}"""


def save_mtp_qwen3_next(drafter: MTPDrafter, out_dir: str | Path, module: int | None = None) -> Path:
    """Write the Qwen3-Next MTP folder (refused with the reason by `mtp_qwen3_next_refusal`); ``module`` must be
    given when the drafter has more than one (the layout has room for one). Returns the directory."""
    _refuse(mtp_qwen3_next_refusal(drafter, module))
    module = 0 if module is None else module
    return _write(
        out_dir,
        mtp_qwen3_next_config(drafter),
        mtp_qwen3_next_state_dict(drafter, module),
        readme=_qwen3_next_readme(drafter, module),
    )


# --- what training writes ---------------------------------------------------------------------------------
def mtp_engine_exports(drafter: MTPDrafter) -> list[EngineExport]:
    """Each MTP engine folder for a trained drafter (`EngineExport`: folder name, writer of that folder or None when
    refused, what the folder holds or why there is none). Both layouts hold one module where a drafter has D > 1: SGLang's DeepSeek
    NextN loader asserts one, and Qwen3-Next's MTP layer is one; the engines then run that module for every draft
    step. The first module is written, the one trained on the target's own hidden state (module k > 0 reads module
    k - 1's output). ``save_mtp_deepseek(drafter, out, num_modules=D)`` writes all D for vLLM alone."""
    D = drafter.config.num_modules
    if D == 1:
        held = "the drafter's one module"
    else:
        held = (
            f"module 0 of the drafter's {D} (one module: the engines run it for every draft step; modules 1..{D - 1} "
            "serve in drafters' own runtime)"
        )
    exports = []
    deepseek_modules = None if D == 1 else 1
    why = mtp_deepseek_refusal(drafter, deepseek_modules)
    if why is None:
        write = lambda out: save_mtp_deepseek(drafter, out, deepseek_modules)  # noqa: E731
        exports.append(EngineExport("export-deepseek", write, f"DeepSeek-V3 MTP layout: {held}"))
    else:
        exports.append(EngineExport("export-deepseek", None, why))
    qwen_module = None if D == 1 else 0
    why = mtp_qwen3_next_refusal(drafter, qwen_module)
    if why is None:
        write = lambda out: save_mtp_qwen3_next(drafter, out, qwen_module)  # noqa: E731
        exports.append(EngineExport("export-qwen3-next", write, f"Qwen3-Next MTP layout: {held}"))
    else:
        exports.append(EngineExport("export-qwen3-next", None, why))
    return exports
