"""MTP engine exports (the DeepSeek-V3 and Qwen3-Next layouts) against what the engines' loaders read: config keys
and values, weight names, shapes, dtypes.

No engine is installed here, so each test replays the loader's reading rules (cited by file; the commits read are
listed in docs/exports.md) on the written folder; transformers itself is a loader of both layouts
(transformers.modeling_layers.MtpModel, transformers 5.24), so the folder is also loaded there and run against
drafters' own forward.

Sources (stored snapshots read for this file):
  vLLM   vllm/config/speculative.py (hf_config_override), model_executor/models/deepseek_mtp.py, deepseek_v2.py,
         qwen3_next_mtp.py, qwen3_next.py
  SGLang python/sglang/srt/models/deepseek_nextn.py, models/deepseek_common/deepseek_weight_loader.py,
         models/qwen3_next_mtp.py, models/qwen3_next.py (load_weights, is_mtp), configs/model_config.py
         (_config_draft_model)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.modeling_layers import MtpModel

from infer.mtp_proposer import input_signal
from models.mtp import MTPDrafter
from models.mtp_export import (
    mtp_deepseek_refusal,
    mtp_engine_exports,
    mtp_qwen3_next_refusal,
    save_mtp_deepseek,
    save_mtp_qwen3_next,
)
from models.target import TargetModel

V, H = 97, 32


# ----------------------------------------------------------------------------------------------- targets
def tiny_deepseek(layers: int = 2, first_k_dense_replace: int = 1, seed: int = 0, **kw) -> TargetModel:
    """A DeepSeek-V3 built from transformers' own classes: MLA attention (q_lora_rank set) and MoE from layer
    ``first_k_dense_replace`` on."""
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=first_k_dense_replace,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=256,
        attn_implementation="sdpa",
        **kw,
    )
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # the router's correction bias starts at zero: give it values a mislabel would show
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_()
    return TargetModel(model, name_or_path="tiny-deepseek-v3")


def tiny_qwen3_next(layers: int = 4, seed: int = 0, **kw) -> TargetModel:
    """A Qwen3-Next built from transformers' own classes: linear attention with full attention every 4th layer,
    MoE everywhere, zero-centred (1 + w) norms (given non-zero values here so a shifted norm shows)."""
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_conv_kernel_dim=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts_per_tok=2,
        num_experts=4,
        max_position_embeddings=256,
        attn_implementation="sdpa",
        **kw,
    )
    model = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(std=0.1)
    return TargetModel(model, name_or_path="tiny-qwen3-next")


def _perturbed(drafter: MTPDrafter, seed: int = 1) -> MTPDrafter:
    """Trained-looking modules: every weight and buffer moved off its init (enorm / hnorm off 1 included)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for t in list(drafter.layers.parameters()) + list(drafter.layers.buffers()):
            t.add_(0.1 * torch.randn_like(t))
    return drafter


@pytest.fixture(scope="module")
def deepseek():
    return tiny_deepseek()


@pytest.fixture(scope="module")
def qwen3_next():
    return tiny_qwen3_next()


def _target_folder_with(target: TargetModel, export: Path, weights: str, root: Path) -> Path:
    """The target saved by transformers with the export's tensors added to its checkpoint and the export's config:
    the folder transformers' MTP generation reads (it takes MTP weights from the target's own checkpoint)."""
    target.hf_model.save_pretrained(root)
    state = load_file(str(root / "model.safetensors"))
    extra = load_file(str(export / weights))
    for k in set(state) & set(extra):  # the copies of the shared parts must equal the target's
        assert torch.equal(state[k], extra[k]), k
    save_file({**state, **extra}, str(root / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(export / "config.json", root / "config.json")
    return root


def _module_outputs_match(drafter: MTPDrafter, k: int, mtp: MtpModel, layer: int) -> None:
    """Module k of the drafter and transformers' MtpLayer ``layer`` on the same inputs: transformers' layer ends
    with its post_norm (shared_head.norm / mtp.norm), ours hands its output to the target's final norm."""
    torch.manual_seed(5)
    ids, pos = torch.randint(0, V, (1, 7)), torch.arange(7)[None]
    hidden = torch.randn(1, 7, H)
    allowed = torch.ones(7, 7, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        ours = drafter.target.final_norm(drafter.module_step(k, hidden, ids, pos, allowed)[0])
        embeds = mtp.embed_tokens(ids)
        theirs = mtp.layers[layer](
            embeds,
            hidden,
            position_embeddings=mtp.rotary_emb(embeds, pos),
            attention_mask=allowed[:, None],
            position_ids=pos,
            cache=None,
        )
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def _fed_what_it_was_trained_on(drafter: MTPDrafter, main: nn.Module) -> None:
    """transformers' MTPCandidateGenerator hands MtpModel ``hidden_states[-1]`` of the main model's forward (asked with
    output_hidden_states=-1), which capture_outputs ties to last_hidden_state, the final-norm output: a last_hidden
    drafter's h^0 exactly, and not the pre-norm output an old drafter reads."""
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        fed = main(ids, output_hidden_states=-1).hidden_states[-1]
        out = drafter.target(ids)
    assert drafter.config.input_signal == "last_hidden"
    torch.testing.assert_close(fed, input_signal(drafter).of(out), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fed, out.pre_norm_last, atol=1e-3)


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


# ------------------------------------------------------------------------------------ MTP: DeepSeek-V3
def deepseek_layer_shapes(cfg: DeepseekV3Config, layer: int) -> dict[str, tuple[int, ...]]:
    """The tensors vLLM's DeepSeekMTP and SGLang's DeepseekV3ForCausalLMNextN load for one MTP layer, by checkpoint
    name. Names: deepseek_mtp.py (_rewrite_spec_layer_name: embed_tokens / enorm / hnorm / eh_proj / shared_head,
    the rest is mtp_block), deepseek_v2.py (DeepseekV2MLAAttention: q_a_proj, q_a_layernorm, q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; DeepseekV2MoE: gate + e_score_correction_bias for
    topk_method noaux_tc, experts.{e}.{gate,up,down}_proj through FusedMoE.make_expert_params_mapping,
    shared_experts through the gate_proj / up_proj stacking)."""
    p, heads = f"model.layers.{layer}.", cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    moe, shared = cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts
    shapes = {
        "enorm.weight": (H,),
        "hnorm.weight": (H,),
        "eh_proj.weight": (H, 2 * H),
        "embed_tokens.weight": (V, H),
        "shared_head.norm.weight": (H,),
        "shared_head.head.weight": (V, H),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.q_a_proj.weight": (cfg.q_lora_rank, H),
        "self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,),
        "self_attn.q_b_proj.weight": (heads * qk, cfg.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),
        "self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "self_attn.o_proj.weight": (H, heads * cfg.v_head_dim),
        "mlp.gate.weight": (cfg.n_routed_experts, H),
        "mlp.gate.e_score_correction_bias": (cfg.n_routed_experts,),
        "mlp.shared_experts.gate_proj.weight": (shared, H),
        "mlp.shared_experts.up_proj.weight": (shared, H),
        "mlp.shared_experts.down_proj.weight": (H, shared),
    }
    for e in range(cfg.n_routed_experts):
        shapes |= {
            f"mlp.experts.{e}.gate_proj.weight": (moe, H),
            f"mlp.experts.{e}.up_proj.weight": (moe, H),
            f"mlp.experts.{e}.down_proj.weight": (H, moe),
        }
    return {p + k: v for k, v in shapes.items()}


def sglang_nextn_names(state: dict, config: dict) -> set[str]:
    """deepseek_weight_loader.py (NextNEnabledConfig): asserts num_nextn_predict_layers == 1, keeps keys under
    model.layers.{N} (N = num_hidden_layers, or 0 for a one-layer config), drops shared_head.head / embed_tokens (the
    target's are used), renames shared_head.norm / eh_proj / enorm / hnorm to model.*, the rest to model.decoder.*."""
    assert config["num_nextn_predict_layers"] == 1, "Only 1 nextn layer is supported"
    N = config["num_hidden_layers"]
    prefix = f"model.layers.{0 if N == 1 else N}"
    out = set()
    for name in state:
        if not name.startswith(prefix) or "shared_head.head" in name or "embed_tokens" in name:
            continue
        spec = any(s in name for s in ("shared_head.norm", "eh_proj", "enorm", "hnorm"))
        out.add(name.replace(prefix, "model" if spec else "model.decoder"))
    return out


def test_deepseek_export_holds_what_vllm_and_sglang_load(deepseek, tmp_path):
    drafter = _perturbed(MTPDrafter.from_target(deepseek, num_modules=1))
    out = save_mtp_deepseek(drafter, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model-mtp.safetensors"]
    config = json.loads((out / "config.json").read_text())
    cfg, N = deepseek.config, deepseek.num_layers
    # vLLM SpeculativeConfig.hf_config_override: model_type deepseek_v3 -> deepseek_mtp, architectures[0] is read
    # (a null list fails there); SGLang model_config.py renames architectures[0] DeepseekV3ForCausalLM for the draft
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    # vLLM: n_predict and DeepSeekMultiTokenPredictor's layer count; SGLang asserts 1; the MTP layer index is N
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == N
    # DeepseekV2MoE reads these by attribute (config.topk_method, config.scoring_func); moe_layer_freq by getattr
    assert (config["topk_method"], config["scoring_func"], config["moe_layer_freq"]) == ("noaux_tc", "sigmoid", 1)
    for key in ("n_routed_experts", "first_k_dense_replace", "n_group", "topk_group", "num_experts_per_tok"):
        assert config[key] == getattr(cfg, key), key
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        assert config[key] == getattr(cfg, key), key
    assert config["rope_theta"] == 10000.0 and config["torch_dtype"] == "float32"
    assert not {"quantization_config", "auto_map", "num_mtp_layers", "head_dim"} & set(config)
    parsed = AutoConfig.from_pretrained(out)  # what both engines hand their model classes
    assert isinstance(parsed, DeepseekV3Config) and parsed.num_nextn_predict_layers == 1

    state = load_file(str(out / "model-mtp.safetensors"))
    assert _shapes(state) == deepseek_layer_shapes(cfg, N)  # every key vLLM needs, nothing else
    assert all(v.dtype == torch.float32 for v in state.values())
    # vLLM get_spec_layer_idx_from_weight_name: a key outside model.layers.{N..N+n-1} is skipped, i.e. never loaded
    assert all(k.startswith(f"model.layers.{N}.") for k in state)
    block = drafter.layers[0].block
    spec = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
    block_keys = {k.removeprefix(f"model.layers.{N}.") for k in state} - {f"{n}.weight" for n in spec}
    block_keys -= {"embed_tokens.weight", "shared_head.head.weight"}
    expected_sglang = {f"model.{n}.weight" for n in spec} | {f"model.decoder.{k}" for k in block_keys}
    assert sglang_nextn_names(state, config) == expected_sglang
    # values: ours, the experts unfused gate first (transformers' gate_up_proj = cat(gate, up))
    p, inter = f"model.layers.{N}.", cfg.moe_intermediate_size
    assert torch.equal(state[p + "eh_proj.weight"], drafter.layers[0].eh_proj.weight)
    assert torch.equal(state[p + "enorm.weight"], drafter.layers[0].enorm.weight)  # DeepSeek norms scale by w
    assert torch.equal(state[p + "mlp.experts.3.gate_proj.weight"], block.mlp.experts.gate_up_proj[3, :inter])
    assert torch.equal(state[p + "mlp.experts.3.up_proj.weight"], block.mlp.experts.gate_up_proj[3, inter:])
    assert torch.equal(state[p + "mlp.experts.1.down_proj.weight"], block.mlp.experts.down_proj[1])
    assert torch.equal(state[p + "mlp.gate.e_score_correction_bias"], block.mlp.gate.e_score_correction_bias)
    assert torch.equal(state[p + "shared_head.head.weight"], deepseek.lm_head.weight)
    readme = (out / "README.md").read_text()
    assert '"method": "mtp"' in readme and "--speculative-draft-model-path" in readme and "final norm" in readme
    assert "input_signal: last_hidden" in readme


def test_deepseek_export_loads_in_transformers_mtp_and_computes_our_module(deepseek, tmp_path, monkeypatch):
    """transformers' MtpModel reads the DeepSeek layout (its conversion mapping "MtpModel" + the qwen2_moe expert
    merge) from the target's folder; it finds the layers by DeepseekV3's _keys_to_ignore_on_load_unexpected, which
    names layer 61 (the real model), so the test points it at this target's layer N."""
    drafter = _perturbed(MTPDrafter.from_target(deepseek, num_modules=2))
    out = save_mtp_deepseek(drafter, tmp_path / "export", num_modules=2)  # vLLM-only: two modules
    folder = _target_folder_with(deepseek, out, "model-mtp.safetensors", tmp_path / "target")
    N = deepseek.num_layers
    monkeypatch.setattr(
        DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected", [rf"model\.layers\.({N}|{N + 1})\."]
    )
    main = DeepseekV3ForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    assert main.config.num_mtp_layers == 2
    mtp = MtpModel.from_pretrained(main)
    for k in range(2):
        ours = drafter.layers[k].block.state_dict()
        theirs = {n.removeprefix(f"layers.{k}.mtp_block."): t for n, t in mtp.state_dict().items()}
        assert all(torch.equal(ours[n], theirs[n]) for n in ours)
        assert torch.equal(mtp.layers[k].hnorm.weight, drafter.layers[k].hnorm.weight)
        assert torch.equal(mtp.layers[k].post_norm.weight, deepseek.final_norm.weight)
        _module_outputs_match(drafter, k, mtp, k)
    _fed_what_it_was_trained_on(drafter, main)


def test_deepseek_export_refusals(deepseek, tiny_target, tmp_path):
    two = MTPDrafter.from_target(deepseek, num_modules=2)
    with pytest.raises(ValueError, match="asserts num_nextn_predict_layers == 1"):
        save_mtp_deepseek(two, tmp_path / "a")
    one = save_mtp_deepseek(two, tmp_path / "b", num_modules=1)  # the first module: both engines load it
    config = json.loads((one / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert {k.split(".")[2] for k in load_file(str(one / "model-mtp.safetensors"))} == {str(deepseek.num_layers)}
    assert "SGLang does not load" in (save_mtp_deepseek(two, tmp_path / "c", num_modules=2) / "README.md").read_text()
    # all layers dense: transformers' copy of the last layer is dense, the engines' MTP block is MoE
    dense = MTPDrafter.from_target(tiny_deepseek(first_k_dense_replace=2))
    assert "dense" in mtp_deepseek_refusal(dense)
    assert "model.layers.0" in mtp_deepseek_refusal(
        MTPDrafter.from_target(tiny_deepseek(layers=1, first_k_dense_replace=0))
    )
    assert "rope_interleave" in mtp_deepseek_refusal(MTPDrafter.from_target(tiny_deepseek(rope_interleave=False)))
    # another family: a Llama target's modules have no engine that builds its block
    llama = MTPDrafter.from_target(tiny_target)
    with pytest.raises(ValueError, match="is for deepseek_v3 targets only.*serve in drafters' own runtime"):
        save_mtp_deepseek(llama, tmp_path / "d")
    assert not (tmp_path / "d").exists()
    # modules trained on the pre-norm output: the engines feed the post-norm one, so no folder is written
    pre = MTPDrafter.from_target(deepseek, num_modules=1, input_signal="pre_norm")
    why = mtp_deepseek_refusal(pre)
    assert "before the final norm (input_signal pre_norm)" in why and "vLLM and SGLang feed" in why
    assert "after the final norm" in why and "mtp.input_signal=last_hidden" in why
    with pytest.raises(ValueError, match=r"input_signal pre_norm.*after the final norm"):
        save_mtp_deepseek(pre, tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_training_writes_the_one_module_folders_of_a_multi_module_drafter(deepseek, qwen3_next, tiny_target, tmp_path):
    """What train/mtp.py writes (`mtp_engine_exports`): a drafter with D = 2 modules gets each family's one-module
    folder, holding module 0, and the line the training log prints says so; other families get the reason instead."""
    two = _perturbed(MTPDrafter.from_target(deepseek, num_modules=2))
    (name, write, what), (other, none, why) = mtp_engine_exports(two)
    assert (name, other, none) == ("export-deepseek", "export-qwen3-next", None) and "qwen3_next targets only" in why
    assert "module 0 of the drafter's 2" in what and "every draft step" in what
    out = write(tmp_path / name)
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1  # SGLang's NextN loader asserts it; vLLM builds one module
    state, N = load_file(str(out / "model-mtp.safetensors")), deepseek.num_layers
    assert sglang_nextn_names(state, config)  # the folder SGLang loads
    assert all(k.startswith(f"model.layers.{N}.") for k in state)  # one module, at layer N
    assert torch.equal(state[f"model.layers.{N}.eh_proj.weight"], two.layers[0].eh_proj.weight)  # the first one
    assert torch.equal(state[f"model.layers.{N}.hnorm.weight"], two.layers[0].hnorm.weight)

    two = _perturbed(MTPDrafter.from_target(qwen3_next, num_modules=2))
    (_, none, why), (name, write, what) = mtp_engine_exports(two)
    assert none is None and "deepseek_v3 targets only" in why and "module 0 of the drafter's 2" in what
    state = load_file(str(write(tmp_path / name) / "model.safetensors"))
    assert torch.equal(state["mtp.fc.weight"], two.layers[0].eh_proj.weight)

    one = mtp_engine_exports(MTPDrafter.from_target(deepseek))  # D = 1: the module itself
    assert one[0][1] is not None and one[0].what == "DeepSeek-V3 MTP layout: the drafter's one module"
    assert [w for _, w, _ in mtp_engine_exports(MTPDrafter.from_target(tiny_target))] == [None, None]  # Llama


# --------------------------------------------------------------------------------------- MTP: Qwen3-Next
def qwen3_next_shapes(cfg: Qwen3NextConfig) -> dict[str, tuple[int, ...]]:
    """What vLLM's Qwen3NextMTP loads (qwen3_next_mtp.py: mtp.* -> model.*, plus every name containing embed_tokens
    or lm_head; the layer is Qwen3NextDecoderLayer(layer_type="full_attention") at prefix mtp.layers.0, MoE by
    qwen3_next.py's rule for layer 0) and SGLang's Qwen3NextForCausalLMMTP takes (the mtp.* keys)."""
    d, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    moe, shared = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    layer = {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (heads * d * 2, H),  # query and output gate (attn_output_gate)
        "self_attn.k_proj.weight": (kv * d, H),
        "self_attn.v_proj.weight": (kv * d, H),
        "self_attn.o_proj.weight": (H, heads * d),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate.weight": (cfg.num_experts, H),
        "mlp.shared_expert.gate_proj.weight": (shared, H),
        "mlp.shared_expert.up_proj.weight": (shared, H),
        "mlp.shared_expert.down_proj.weight": (H, shared),
        "mlp.shared_expert_gate.weight": (1, H),
    }
    for e in range(cfg.num_experts):
        layer |= {
            f"mlp.experts.{e}.gate_proj.weight": (moe, H),
            f"mlp.experts.{e}.up_proj.weight": (moe, H),
            f"mlp.experts.{e}.down_proj.weight": (H, moe),
        }
    return {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
        **{f"mtp.layers.0.{k}": v for k, v in layer.items()},
        "model.embed_tokens.weight": (V, H),
        "lm_head.weight": (V, H),
    }


def vllm_qwen3_next_names(state: dict) -> set[str]:
    """qwen3_next_mtp.py, Qwen3NextMTP.load_weights: mtp.* -> model.*, names with embed_tokens / lm_head kept,
    everything else skipped."""
    out = set()
    for name in state:
        if name.startswith("mtp."):
            out.add(name.replace("mtp.", "model."))
        elif any(key in name for key in ("embed_tokens", "lm_head")):
            out.add(name)
    return out


def sglang_qwen3_next_names(state: dict) -> set[str]:
    """SGLang qwen3_next.py load_weights(is_mtp=True): keys without "mtp" skipped (the target's embedding and head
    are shared in), mtp.fc / mtp.pre_fc_norm_* lose the prefix, the rest "mtp" -> "model"."""
    out = set()
    for name in state:
        if "mtp" not in name:
            continue
        if name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
            out.add(name.replace("mtp.", ""))
        else:
            out.add(name.replace("mtp", "model"))
    return out


def test_qwen3_next_export_holds_what_vllm_and_sglang_load(qwen3_next, tmp_path):
    drafter = _perturbed(MTPDrafter.from_target(qwen3_next))
    out = save_mtp_qwen3_next(drafter, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    # vLLM hf_config_override: qwen3_next -> qwen3_next_mtp, n_predict = num_nextn_predict_layers (also
    # Qwen3NextMultiTokenPredictor's layer count); SGLang renames architectures[0] Qwen3NextForCausalLM -> ...MTP
    assert config["model_type"] == "qwen3_next" and config["architectures"] == ["Qwen3NextForCausalLM"]
    assert config["num_nextn_predict_layers"] == 1 and config["mtp_num_hidden_layers"] == 1
    assert config["mtp_use_dedicated_embeddings"] is False
    assert config["num_mtp_layers"] == 1 and config["mtp_layer_types"] == ["full_attention"]  # transformers' MTP
    assert config["partial_rotary_factor"] == 0.25 and config["rope_theta"] == 10000.0
    for key in ("num_experts", "decoder_sparse_step", "mlp_only_layers", "head_dim", "moe_intermediate_size"):
        assert config[key] == getattr(qwen3_next.config, key), key
    parsed = AutoConfig.from_pretrained(out)
    assert isinstance(parsed, Qwen3NextConfig) and parsed.num_nextn_predict_layers == 1

    state = load_file(str(out / "model.safetensors"))
    assert _shapes(state) == qwen3_next_shapes(qwen3_next.config)
    assert all(v.dtype == torch.float32 for v in state.values())
    vllm_names = vllm_qwen3_next_names(state)
    assert vllm_names == {k.replace("mtp.", "model.") for k in state if k.startswith("mtp.")} | {
        "model.embed_tokens.weight",
        "lm_head.weight",
    }
    sglang = sglang_qwen3_next_names(state)
    assert {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "model.norm.weight"} <= sglang
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in sglang and "lm_head.weight" not in sglang
    # norms: ours (x * w) are written w - 1 for the engines' (1 + w); transformers' own are zero-centred already and
    # go unchanged (subtracting 1 again would shift a real Qwen3-Next target's norms)
    layer = drafter.layers[0]
    assert torch.equal(state["mtp.pre_fc_norm_embedding.weight"], layer.enorm.weight - 1)
    assert torch.equal(state["mtp.pre_fc_norm_hidden.weight"], layer.hnorm.weight - 1)
    assert torch.equal(state["mtp.norm.weight"], qwen3_next.final_norm.weight)
    assert torch.equal(state["mtp.layers.0.input_layernorm.weight"], layer.block.input_layernorm.weight)
    assert torch.equal(state["mtp.layers.0.self_attn.q_norm.weight"], layer.block.self_attn.q_norm.weight)
    assert torch.equal(state["lm_head.weight"], qwen3_next.lm_head.weight)


def test_qwen3_next_export_loads_in_transformers_mtp_and_computes_our_module(qwen3_next, tmp_path):
    """transformers' MtpModel builds enorm / hnorm / post_norm as Qwen3NextRMSNorm (1 + w) and reads mtp.* from the
    target's folder: equal outputs mean the norm conversion (ours only) and the expert names are right."""
    drafter = _perturbed(MTPDrafter.from_target(qwen3_next, num_modules=2))
    out = save_mtp_qwen3_next(drafter, tmp_path / "export", module=1)
    folder = _target_folder_with(qwen3_next, out, "model.safetensors", tmp_path / "target")
    main = Qwen3NextForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    mtp = MtpModel.from_pretrained(main)
    ours = drafter.layers[1].block.state_dict()
    theirs = {n.removeprefix("layers.0.mtp_block."): t for n, t in mtp.state_dict().items()}
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    _module_outputs_match(drafter, 1, mtp, 0)
    _fed_what_it_was_trained_on(drafter, main)


def test_qwen3_next_export_refusals(qwen3_next, tiny_target, tmp_path):
    two = MTPDrafter.from_target(qwen3_next, num_modules=2)
    with pytest.raises(ValueError, match="holds one MTP module"):
        save_mtp_qwen3_next(two, tmp_path / "a")
    # the last layer of a 3-layer Qwen3-Next is linear attention; the engines' MTP layer is full attention
    assert "full attention" in mtp_qwen3_next_refusal(MTPDrafter.from_target(tiny_qwen3_next(layers=3)))
    # decoder_sparse_step 2: the engines' MTP layer (built as layer 0) is dense, the copied layer 3 is MoE
    mixed = MTPDrafter.from_target(tiny_qwen3_next(decoder_sparse_step=2))
    assert "layer 0" in mtp_qwen3_next_refusal(mixed)
    with pytest.raises(ValueError, match="is for qwen3_next targets only.*serve in drafters' own runtime"):
        save_mtp_qwen3_next(MTPDrafter.from_target(tiny_target), tmp_path / "b")
    pre = MTPDrafter.from_target(qwen3_next, input_signal="pre_norm")
    assert "before the final norm (input_signal pre_norm)" in mtp_qwen3_next_refusal(pre)
    with pytest.raises(ValueError, match=r"input_signal pre_norm.*after the final norm"):
        save_mtp_qwen3_next(pre, tmp_path / "c")
    assert not (tmp_path / "c").exists()
