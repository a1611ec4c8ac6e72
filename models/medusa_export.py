"""Medusa engine exports: vLLM (``model_type: medusa``) and the original layout (FasterDecoding, TensorRT-LLM);
the shared writing machinery is `models.export`, the list of refusals docs/exports.md.

Medusa heads (REFERENCE.md, "Medusa"). The engines load the heads' lm_heads from the drafter folder, not from the
target, so a shared-head drafter carries the target's head too, in the drafter's own dtype (a bf16 drafter of a bf16
hub target: the same values, half the bytes of an fp32 copy):

- vLLM (``model_type: "medusa"``): ``blocks.{h}.layers.{j}.{weight,bias}``; per-head heads as ``lm_heads.{h}.weight``,
  a shared head once as ``lm_head.weight`` with ``original_lm_head: true`` (vllm/model_executor/models/medusa.py:
  that flag builds one ParallelLMHead named ``lm_head`` and hands it to every head; its ``load_weights`` takes the
  tensor as ``lm_head.weight``, or as ``lm_heads.0.weight``).
- original Medusa (FasterDecoding) and TensorRT-LLM's converter: ``medusa_lm_head.pt`` (a torch pickle: FasterDecoding
  opens nothing else; TensorRT-LLM prefers it) with ``{h}.{l}.linear.{weight,bias}`` and ``{h}.{L}.weight``; config
  ``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``. TensorRT-LLM takes the head count from
  ``--num_medusa_heads`` (default 4) and the depth from ``--num_medusa_layers``, never from the config: the README
  written beside the weights gives the command. Refused (`medusa_original_refusal`) where FasterDecoding's loader
  cannot build the heads as trained: more than one ResBlock per head (it builds ``[ResBlock] * L``, one module
  repeated), more than five heads (it builds five, loads with ``strict=False`` and drops the rest), a base that is
  not Llama or Mistral (its ``MedusaModel.from_pretrained`` raises).

"""

from __future__ import annotations

from pathlib import Path

import torch

from models.export import EngineExport, refuse, write_folder
from models.medusa import MedusaDrafter

FASTERDECODING_HEADS = 5
"""Heads FasterDecoding's loader builds whatever the config says (medusa/model/medusa_model.py, the MEDUSA-v0.1
branch of MedusaModelABC.from_pretrained: ``base_model_config.medusa_num_heads = 5``)."""
FASTERDECODING_BASES = ("LlamaForCausalLM", "MistralForCausalLM")
"""FasterDecoding's MedusaModel.from_pretrained accepts model_type llama or mistral only."""


def _dtype(drafter: MedusaDrafter) -> torch.dtype:
    """The drafter's own dtype: its blocks' (a shared head is the target's module, in the target's dtype)."""
    return next(drafter.blocks.parameters(), drafter.output_head(0).weight).dtype


def _head(drafter: MedusaDrafter, k: int) -> torch.Tensor:
    """Head k's lm_head weight, in the drafter's dtype (a copy: safetensors refuses several names for one storage)."""
    return drafter.output_head(k).weight.detach().to(_dtype(drafter)).clone()


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
        "original_lm_head": cfg.shared_head,
        "torch_dtype": str(_dtype(drafter)).removeprefix("torch."),
    }


def _blocks_state(drafter: MedusaDrafter, block_key: str) -> dict[str, torch.Tensor]:
    """The ResBlocks' tensors under an engine's names: ``block_key`` formats (head, layer, weight|bias)."""
    out = {}
    for h, block in enumerate(drafter.blocks):
        for j, res in enumerate(block):
            out[block_key.format(h, j, "weight")] = res.linear.weight
            out[block_key.format(h, j, "bias")] = res.linear.bias
    return out


def medusa_vllm_state_dict(drafter: MedusaDrafter) -> dict[str, torch.Tensor]:
    """vLLM's names; a shared head is written once (``lm_head.weight``, read with ``original_lm_head``)."""
    state = _blocks_state(drafter, "blocks.{}.layers.{}.{}")
    if drafter.config.shared_head:
        return state | {"lm_head.weight": _head(drafter, 0)}
    return state | {f"lm_heads.{h}.weight": _head(drafter, h) for h in range(drafter.config.num_heads)}


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
    return write_folder(out_dir, medusa_vllm_config(drafter), medusa_vllm_state_dict(drafter), readme=readme)


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
    refuse(medusa_original_refusal(drafter, base_model_name_or_path))
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
    L = drafter.config.num_layers
    heads = {f"{h}.{L}.weight": _head(drafter, h) for h in range(drafter.config.num_heads)}
    return _blocks_state(drafter, "{}.{}.linear.{}") | heads


def _medusa_original_readme(drafter: MedusaDrafter, base: str) -> str:
    cfg, info = drafter.config, drafter.target_info
    n, layers = cfg.num_heads, cfg.num_layers
    dtype = str(_dtype(drafter)).removeprefix("torch.")
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
    return write_folder(out_dir, config, medusa_original_state_dict(drafter), "medusa_lm_head.pt", readme)


def medusa_engine_exports(drafter: MedusaDrafter) -> list[EngineExport]:
    """The Medusa engine folders of a trained drafter: vLLM always, the original layout where FasterDecoding builds
    the heads as trained (`medusa_original_refusal`)."""
    cfg = drafter.config
    heads = f"{cfg.num_heads} heads x {cfg.num_layers} ResBlock(s)"
    vllm_heads = "the target's lm_head once, shared (`original_lm_head`)" if cfg.shared_head else "one lm_head per head"
    write_vllm = lambda out: save_medusa_vllm(drafter, out)  # noqa: E731
    exports = [EngineExport("export-vllm", write_vllm, f"vLLM `medusa`: {heads}, {vllm_heads}")]
    heads += ", one lm_head per head (the layout has no shared head)"
    why = medusa_original_refusal(drafter)
    if why is None:
        write = lambda out: save_medusa_original(drafter, out)  # noqa: E731
        exports.append(EngineExport("export-medusa", write, f"FasterDecoding / TensorRT-LLM original layout: {heads}"))
    else:
        exports.append(EngineExport("export-medusa", None, why))
    return exports
