"""Engine exports against what the engines' loaders read: config keys and values, weight names, shapes, dtypes.

No engine is installed here, so each test replays the loader's reading rules (cited by file; the commits read are
listed in docs/exports.md) on the written folder, and where transformers itself is a loader of the layout
(DeepSeek-V3 and Qwen3-Next MTP: transformers.modeling_layers.MtpModel, transformers 5.24) the folder is loaded
there and run against drafters' own forward.

Sources (stored snapshots read for this file):
  vLLM   vllm/config/speculative.py (hf_config_override), model_executor/models/deepseek_mtp.py, deepseek_v2.py,
         qwen3_next_mtp.py, qwen3_next.py, medusa.py, llama_eagle3.py, transformers_utils/configs/medusa.py,
         transformers_utils/configs/eagle.py, v1/worker/gpu_model_runner.py, model_executor/models/registry.py
  SGLang python/sglang/srt/models/deepseek_nextn.py, models/deepseek_common/deepseek_weight_loader.py,
         models/qwen3_next_mtp.py, models/qwen3_next.py (load_weights, is_mtp), models/llama_eagle3.py,
         configs/model_config.py (_config_draft_model)
  FasterDecoding/Medusa medusa/model/medusa_model.py; TensorRT-LLM tensorrt_llm/models/medusa/weight.py,
         examples/medusa/convert_checkpoint.py
  EAGLE-3 capture rules: vLLM vllm/model_executor/models/llama.py (LlamaModel.forward, set_aux_hidden_state_layers),
         vllm/transformers_utils/configs/speculators/algos.py (update_eagle3); SGLang python/sglang/srt/models/llama.py
         (LlamaModel.forward, LlamaForCausalLM.set_eagle3_layers_to_capture), model_executor/model_runner.py
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoConfig,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.modeling_layers import MtpModel

from infer.mtp_proposer import input_signal
from models.eagle3 import Eagle3Drafter
from models.eagle3_config import read_checkpoint_config
from models.eagle3_export import save_sglang, save_speculators, sglang_config
from models.medusa import MedusaDrafter
from models.medusa_export import (
    FASTERDECODING_HEADS,
    medusa_original_refusal,
    medusa_original_state_dict,
    save_medusa_original,
    save_medusa_vllm,
)
from models.mtp import MTPDrafter
from models.mtp_export import (
    mtp_deepseek_refusal,
    mtp_engine_exports,
    mtp_qwen3_next_refusal,
    save_mtp_deepseek,
    save_mtp_qwen3_next,
)
from models.target import TargetModel
from tests.conftest import tiny_llama

V, H = 97, 32
ROOT = Path(__file__).resolve().parents[1]


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


# ------------------------------------------------------------------------------------------------ Medusa
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


# ------------------------------------------------------------------------------------------------ EAGLE-3
@pytest.fixture(scope="module")
def eagle3_drafter():
    # taps on layers 0, 1, 3 of 5 (none on the last layer, which no engine captures: it is no layer's input)
    target = TargetModel(tiny_llama(vocab=64, layers=5, seed=0), aux_layer_ids=[0, 1, 3], name_or_path="tiny")
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=16)
    used = torch.sort(torch.randperm(64, generator=torch.Generator().manual_seed(0))[:16]).values
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[used] = True
    drafter.set_draft_vocab(used - torch.arange(16), t2d)
    return drafter


STACKED = ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"))
STACKED += ((".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj"))


def vllm_eagle3_names(state: dict) -> set[str]:
    """llama_eagle3.py: Eagle3LlamaForCausalLM.load_weights skips t2d, renames d2t draft_id_to_target_id, prefixes
    "model." except lm_head; LlamaModel.load_weights renames midlayer. -> layers.0. and stacks q/k/v, gate/up."""
    out = set()
    for name in state:
        if "t2d" in name:
            continue
        if "d2t" in name:
            out.add("draft_id_to_target_id")
            continue
        name = name if "lm_head" in name else "model." + name.replace("midlayer.", "layers.0.")
        for fused, part in STACKED:
            name = name.replace(part, fused)
        out.add(name)
    return out


def sglang_eagle3_names(state: dict) -> set[str]:
    """SGLang llama_eagle3.py, LlamaForCausalLMEagle3.load_weights: d2t becomes hot_token_id (d2t + arange), t2d is
    skipped, q/k/v and gate/up are stacked, names get "model." unless already a parameter (lm_head)."""
    out = set()
    for name in state:
        if "d2t" in name:
            out.add("hot_token_id")
            continue
        if "t2d" in name:
            continue
        for fused, part in STACKED:
            name = name.replace(part, fused)
        out.add(name if name.startswith("lm_head") else "model." + name)
    return out


LAYER = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")
LAYER += ("input_layernorm.weight", "post_attention_layernorm.weight", "hidden_norm.weight")


def test_eagle3_sglang_export_holds_what_both_engines_load(eagle3_drafter, tmp_path):
    out = save_sglang(eagle3_drafter, tmp_path / "sglang")
    config = json.loads((out / "config.json").read_text())
    # both: LlamaConfig parsing; SGLang raises unless num_hidden_layers == 1 and shares embed_tokens as lm_head when
    # tie_word_embeddings; vLLM's registry maps LlamaForCausalLMEagle3 to Eagle3LlamaForCausalLM and EAGLEConfig
    # keeps an architecture ending in "Eagle3"
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False and config["draft_vocab_size"] == 16
    assert config["target_hidden_size"] == H and config["hidden_size"] == H and config["vocab_size"] == 64
    # SGLang: eagle_config holds after-layer ids, ours (set_eagle3_layers_to_capture adds 1); vLLM: the top-level key
    # holds before-layer ids, ours + 1 (what each engine then captures: the test below)
    after, before = [0, 1, 3], [1, 2, 4]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": after, "use_aux_hidden_state": True}
    assert config["eagle_aux_hidden_state_layer_ids"] == before
    assert config["norm_before_residual"] is False  # vLLM llama_eagle3.py: residual = h, hidden_norm after
    parsed = LlamaConfig.from_pretrained(out)
    assert parsed.eagle_aux_hidden_state_layer_ids == before and parsed.eagle_config["use_aux_hidden_state"] is True
    state = load_file(str(out / "model.safetensors"))
    assert not any("embed_tokens" in k for k in state)  # vLLM's draft (PP 1) has no embed_tokens parameter
    assert vllm_eagle3_names(state) == {f"model.layers.0.{k}" for k in LAYER} | {
        "model.fc.weight",
        "model.norm.weight",
        "lm_head.weight",
        "draft_id_to_target_id",
    }
    assert sglang_eagle3_names(state) == {f"model.midlayer.{k}" for k in LAYER} | {
        "model.fc.weight",
        "model.norm.weight",
        "lm_head.weight",
        "hot_token_id",
    }  # every parameter but model.embed_tokens (the target's is set in)
    assert state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H  # qkv reads [embeds ; hidden]
    assert state["fc.weight"].shape == (H, 3 * H) and state["lm_head.weight"].shape == (16, H)
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool and state["t2d"].shape == (64,)
    hot = state["d2t"] + torch.arange(16)  # SGLang hot_token_id = vLLM's base + draft_id_to_target_id
    assert torch.equal(hot, torch.nonzero(state["t2d"]).flatten())
    assert '"method": "eagle3"' in (out / "README.md").read_text()


def test_eagle3_speculators_export_fields_vllm_reads(eagle3_drafter, tmp_path):
    out = save_speculators(eagle3_drafter, tmp_path / "spec")
    config = json.loads((out / "config.json").read_text())
    # vLLM transformers_utils/configs/speculators/algos.py update_eagle3: draft_vocab_size, target_hidden_size,
    # norm_before_residual (its default is True, the other variant: ours must be written false) and the aux ids
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 16
    assert config["norm_before_residual"] is False and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    state = load_file(str(out / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in state and not any(k.startswith("midlayer.") for k in state)
    assert re.search(r'"num_speculative_tokens"', (out / "README.md").read_text())


# ------------------------------------------------------------------- EAGLE-3: the features each engine feeds
def vllm_capture_layers(config: dict, num_layers: int) -> tuple[int, ...]:
    """vLLM, vllm/v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config`` (vllm-project/vllm, read at
    000fc94b; at 4e179065 only the first branch exists): the draft config's top-level
    ``eagle_aux_hidden_state_layer_ids`` when non-empty, else ``eagle_config``'s list, taken as they are; with neither,
    the target's default, vllm/model_executor/models/llama.py ``get_eagle3_aux_hidden_state_layers``:
    (2, N // 2, N - 3). The runner hands them to ``set_aux_hidden_state_layers``."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)


def vllm_config_from_speculators(config: dict) -> dict:
    """vLLM, vllm/transformers_utils/configs/speculators/algos.py ``update_eagle3``: the fields of the draft config
    vLLM builds from a speculators one (``eagle_aux_hidden_state_layer_ids`` copied to its top level when set)."""
    built = {"draft_vocab_size": config.get("draft_vocab_size")}
    built["norm_before_residual"] = config.get("norm_before_residual", True)
    if config.get("eagle_aux_hidden_state_layer_ids"):
        built["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    return built


def sglang_capture_layers(config: dict, num_layers: int) -> list[int]:
    """SGLang: python/sglang/srt/model_executor/model_runner.py (EAGLE3 target worker) takes
    ``eagle_config["eagle_aux_hidden_state_layer_ids"]`` from the draft config (None when that fails) and calls the
    target's ``set_eagle3_layers_to_capture``; python/sglang/srt/models/llama.py (LlamaForCausalLM, sgl-project/sglang
    bf7a0e23): None -> [2, N // 2, N - 3], else ``[val + 1 for val in layer_ids]`` ("for the ith layer, it takes the
    output of the (i-1)th layer"). It never reads the top-level key."""
    try:
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    except (KeyError, TypeError):
        ids = None
    if ids is None:
        return [2, num_layers // 2, num_layers - 3]
    return [val + 1 for val in ids]


def engine_llama_features(hf_model: nn.Module, input_ids: torch.Tensor, layers_to_capture) -> torch.Tensor:
    """Both engines' target forward, LlamaModel.forward (vLLM vllm/model_executor/models/llama.py; SGLang
    python/sglang/srt/models/llama.py): walking the decoder layers in order, before running layer i it appends
    ``hidden_states + residual`` (the residual stream entering layer i) when i is in the capture list; the drafter gets
    the captures concatenated on the hidden dim in that order (vLLM propose_draft_token_ids: ``torch.cat([h[...] for h
    in aux_hidden_states], dim=-1)``; SGLang's logits processor the same). Replayed on the HF model: the residual
    stream entering HF decoder layer i is that layer's ``hidden_states`` input."""
    captured = []

    def before(i: int):
        def hook(module, args, kwargs):
            if i in layers_to_capture:
                captured.append(args[0] if args else kwargs["hidden_states"])

        return hook

    handles = [
        layer.register_forward_pre_hook(before(i), with_kwargs=True) for i, layer in enumerate(hf_model.model.layers)
    ]
    try:
        with torch.no_grad():
            hf_model(input_ids)
    finally:
        for h in handles:
            h.remove()
    return torch.cat(captured, dim=-1)


@pytest.mark.parametrize("aux", [[0, 2, 3], [1, 2, 4]])
def test_eagle3_exports_feed_each_engine_the_features_the_drafter_was_trained_on(aux, tmp_path):
    """The drafter's fc was trained on TargetOutput.aux_hidden (models/target.py: the outputs of layers ``aux``,
    concatenated). Each engine's own capture rule, applied to the exported config on the same target, must hand it
    exactly those tensors: SGLang (eagle_config, + 1), vLLM (top-level key) and vLLM through the speculators format."""
    N = 6
    target = TargetModel(tiny_llama(vocab=64, layers=N, seed=1), aux_layer_ids=aux, name_or_path="tiny")
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=16)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained_on = target(ids).aux_hidden
    sglang_folder = json.loads((save_sglang(drafter, tmp_path / "sglang") / "config.json").read_text())
    speculators = json.loads((save_speculators(drafter, tmp_path / "spec") / "config.json").read_text())
    captures = {
        "SGLang": sglang_capture_layers(sglang_folder, N),
        "vLLM": vllm_capture_layers(sglang_folder, N),
        "vLLM (speculators)": vllm_capture_layers(vllm_config_from_speculators(speculators), N),
    }
    for engine, layers in captures.items():
        assert torch.equal(engine_llama_features(target.hf_model, ids, layers), trained_on), engine
    assert captures["SGLang"] == list(captures["vLLM"]) == [k + 1 for k in aux]  # the inputs of layers k + 1
    # the check can fail: before-layer ids in eagle_config (the earlier export) make SGLang add 1 again and feed the
    # outputs of layers k + 1; without the top-level key vLLM would take eagle_config's after-layer ids as its own
    # before-layer ids and feed the outputs of layers k - 1
    shifted = dict(sglang_folder, eagle_config={"eagle_aux_hidden_state_layer_ids": [k + 1 for k in aux]})
    assert sglang_capture_layers(shifted, N) == [k + 2 for k in aux]
    fed = engine_llama_features(target.hf_model, ids, sglang_capture_layers(shifted, N))
    # the outputs of layers k + 1: silently other features while k + 2 < N ([0, 2, 3]), fewer features (a shape error
    # at load) when one of them is past the last layer ([1, 2, 4])
    assert fed.shape != trained_on.shape or not torch.allclose(fed, trained_on)

    no_top = {k: v for k, v in sglang_folder.items() if k != "eagle_aux_hidden_state_layer_ids"}
    assert vllm_capture_layers(no_top, N) == tuple(aux)


def test_eagle3_export_refuses_taps_out_of_layer_order(tmp_path):
    """The engines concatenate their captures in layer order; fc was trained on the order of ``aux_layer_ids``."""
    target = TargetModel(tiny_llama(vocab=64, layers=6, seed=1), aux_layer_ids=[4, 1, 2], name_or_path="tiny")
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=16)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    fed = engine_llama_features(target.hf_model, ids, [5, 2, 3])  # what either engine would capture: 2, 3, 5
    with torch.no_grad():
        assert not torch.equal(fed, target(ids).aux_hidden)
    for save in (save_sglang, save_speculators):
        with pytest.raises(ValueError, match=r"not in ascending order.*concatenate them in layer order"):
            save(drafter, tmp_path / save.__name__)
        assert not (tmp_path / save.__name__).exists()


def test_shipped_eagle3_export_is_what_the_exporter_writes():
    """models/smollm2_eagle3/export-sglang/config.json is `sglang_config` of the shipped drafter (bf16): SmolLM2's
    30 layers, trained on the outputs of layers [1, 14, 26]; SGLang reads [1, 14, 26] and captures before layers
    2, 15, 27, as vLLM does from [2, 15, 27]."""
    folder = ROOT / "models" / "smollm2_eagle3"
    cfg, info = read_checkpoint_config(folder)
    with torch.device("meta"):
        drafter = Eagle3Drafter(cfg, info).to(torch.bfloat16)
    shipped = json.loads((folder / "export-sglang" / "config.json").read_text())
    assert shipped == sglang_config(drafter)
    assert info.aux_layer_ids == shipped["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    N = info.target_num_layers
    assert sglang_capture_layers(shipped, N) == list(vllm_capture_layers(shipped, N)) == [2, 15, 27]
