"""EAGLE-3 engine exports (SGLang's layout and the speculators one) against what the engines' loaders read: config
keys and values, weight names, shapes, dtypes, and the target features each engine captures for the drafter.

No engine is installed here, so each test replays the loader's reading rules (cited by file; the commits read are
listed in docs/exports.md) on the written folder, and each engine's capture rule on a tiny Llama target.

Sources (stored snapshots read for this file):
  vLLM   model_executor/models/llama_eagle3.py, transformers_utils/configs/eagle.py,
         transformers_utils/configs/speculators/algos.py, model_executor/models/registry.py
  SGLang python/sglang/srt/models/llama_eagle3.py
  EAGLE-3 capture rules: vLLM vllm/model_executor/models/llama.py (LlamaModel.forward, set_aux_hidden_state_layers),
         vllm/v1/worker/gpu_model_runner.py, vllm/transformers_utils/configs/speculators/algos.py (update_eagle3);
         SGLang python/sglang/srt/models/llama.py (LlamaForCausalLM.set_eagle3_layers_to_capture),
         model_executor/model_runner.py
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig

from models.eagle3 import Eagle3Drafter
from models.eagle3_config import read_checkpoint_config
from models.eagle3_export import save_sglang, save_speculators, sglang_config
from models.target import TargetModel
from tests.conftest import ROOT, tiny_llama

H = 32


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
