"""MTP engine exports: the DeepSeek-V3 and Qwen3-Next layouts vLLM and SGLang serve; the shared writing machinery
is `models.export`, the list of refusals docs/exports.md.

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

from pathlib import Path

import torch

from models.export import EngineExport, refuse, write_folder
from models.mtp import MTPDrafter

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
    refuse(mtp_deepseek_refusal(drafter, num_modules))
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
    refuse(mtp_deepseek_refusal(drafter, num_modules))
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
    return write_folder(out_dir, config, state, "model-mtp.safetensors", _deepseek_readme(drafter, n))


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
    refuse(mtp_qwen3_next_refusal(drafter, 0))
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
    refuse(mtp_qwen3_next_refusal(drafter, module))
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
    refuse(mtp_qwen3_next_refusal(drafter, module))
    module = 0 if module is None else module
    return write_folder(
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
