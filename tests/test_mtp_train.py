"""The MTP recipe (train/mtp.py): λ weights, frozen and joint training on a tiny target, checkpoint, exports,
report rows, resume, and two CPU ranks through accelerate launch."""

from __future__ import annotations

import json

import pytest
import torch

from infer.families import load_drafter
from infer.mtp_proposer import input_signal
from models.checkpoint import read_checkpoint
from models.config import ConfigError, load_config
from models.loader import load_target
from models.mtp import INPUT_SIGNALS, MTPDrafter
from models.target import TargetConfig, TargetModel
from tests.conftest import ROOT, run_to_end, tiny_run_args
from train.mtp import ModulesConfig, MTPRecipeConfig

RECIPE = ROOT / "recipes" / "smollm2-135m" / "mtp.yaml"


def test_loss_weights_split_one_lambda_over_depths_or_take_a_list_and_switch_at_a_step():
    one = ModulesConfig(num_modules=3, loss_weight=0.3, loss_weight_later=0.1, switch_step=5)
    assert one.weights_at(0) == pytest.approx([0.1] * 3) and one.weights_at(4) == pytest.approx([0.1] * 3)
    assert one.weights_at(5) == pytest.approx([0.1 / 3] * 3)
    per_depth = ModulesConfig(num_modules=2, loss_weight=[1.0, 0.5])
    assert per_depth.weights_at(0) == [1.0, 0.5] and per_depth.weights_at(10**6) == [1.0, 0.5]
    with pytest.raises(ValueError, match="needs 2 entries"):
        ModulesConfig(num_modules=2, loss_weight=[1.0])
    with pytest.raises(ValueError, match=">= 0"):
        ModulesConfig(num_modules=1, loss_weight=-0.1)
    with pytest.raises(ValueError, match="input_signal must be one of"):
        ModulesConfig(input_signal="post_norm")


@pytest.mark.parametrize("signal", INPUT_SIGNALS)
def test_each_input_signal_trains_a_step_on_the_target_signal_it_names(tiny_target, signal):
    """Depth 1 reads the target signal mtp.input_signal names, in the frozen path (run_modules) and the joint one
    (train.joint.JointModel with the recipe's modules_on) alike, and one optimizer step on it moves the modules."""
    import train.mtp as recipe
    from train.features import target_forward
    from train.joint import JointModel
    from train.losses import position_losses

    torch.manual_seed(0)
    drafter = MTPDrafter.from_target(tiny_target, 2, input_signal=signal)
    ids = torch.randint(0, 97, (2, 10))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    targets = recipe.depth_targets(batch, 2)
    positions = [p for p, _ in targets]
    with torch.no_grad():
        out = target_forward(tiny_target, batch, logits=False)
        joint = JointModel(tiny_target, drafter, recipe.modules_on)(batch, positions, positions[0], train_target=False)[
            1
        ]
    hidden = input_signal(drafter).of(out)
    assert hidden is (out.last_hidden if signal == "last_hidden" else out.pre_norm_last)
    logits = recipe.run_modules(drafter, hidden, batch, positions)
    assert all(torch.equal(a, b) for a, b in zip(logits, joint))
    before = drafter.layers[0].eh_proj.weight.detach().clone()
    position_losses(logits, targets, [0.15, 0.15])["loss"].backward()
    torch.optim.SGD(drafter.parameters(), lr=0.1).step()
    assert not torch.equal(before, drafter.layers[0].eh_proj.weight)


def test_offline_features_are_refused_with_the_reason():
    with pytest.raises((ConfigError, ValueError), match="online"):
        load_config(MTPRecipeConfig, RECIPE, ["train.features=offline"])


def mtp_args(root, out, *extra: str) -> list[str]:
    """The shipped frozen MTP recipe on `tiny_recipe`'s target and data (raw text), sized to run in seconds."""
    return [
        *tiny_run_args("mtp", root, out),
        "train.eval_every=0",
        "mtp.tree_ranks=2",
        "report.compare=[]",
        *extra,
    ]


def test_fp32_modules_beside_a_bf16_target_evaluate_and_serve(tiny_recipe, tmp_path):
    """The data-scaling curve holds a loaded checkpoint in fp32 beside the target in its served dtype (bf16 on a CPU
    with fast bf16), outside the training step's autocast: the modules' output reaches the target's final norm and
    head in the target's dtype, and both the held-out evaluation and the served chain run."""
    from infer.generate import generate_speculative, generate_vanilla
    from infer.mtp_proposer import MTPProposer
    from infer.sampling import SamplingParams
    from models.config import parse_cli
    from train.distributed import make_accelerator
    from train.loop import load_target_and_data
    from train.mtp import evaluate

    args = mtp_args(tiny_recipe, tmp_path / "run", "target.dtype=bfloat16", "train.mixed_precision=fp32")
    cfg = parse_cli(MTPRecipeConfig, args)
    accelerator, _ = make_accelerator(cfg.train, target=cfg.target)
    loaded = load_target_and_data(cfg, accelerator, lambda msg: None, None)
    assert loaded.target.lm_head.weight.dtype == torch.bfloat16
    drafter = MTPDrafter.from_target(loaded.target, 2, loaded.tokenizer).float()
    result = evaluate(
        accelerator, loaded.target, drafter, loaded.eval_set, cfg.train, 2, loaded.pad_id, per_sample=True
    )
    acc = result["eval/acc"]
    assert len(acc) == 2 and all(0.0 <= a <= 1.0 for a in acc)
    table = result["per_sample"]  # each held-out sample's counts add up to the evaluation's accuracy
    assert len(table) == min(len(loaded.eval_set), cfg.train.eval_samples)
    for d in range(2):
        assert round(sum(s[d][0] for s in table) / sum(s[d][1] for s in table), 4) == acc[d]
    drafter.eval()
    params = SamplingParams(max_new_tokens=6)
    served = generate_speculative(loaded.target, MTPProposer(drafter, k=2), [[5, 9, 11]], params).tokens
    assert served == generate_vanilla(loaded.target, [[5, 9, 11]], params).tokens


def test_a_missing_init_checkpoint_is_refused_before_anything_loads(tmp_path):
    import train.mtp as recipe

    with pytest.raises(SystemExit, match="mtp.init_from=.*no checkpoint there"):
        recipe.main(mtp_args(tmp_path, tmp_path / "out", f"mtp.init_from={tmp_path / 'none'}"))
    assert not (tmp_path / "out").exists()


def test_continuing_modules_trained_on_another_signal_is_refused(tiny_recipe, tmp_path):
    """mtp.init_from keeps the checkpoint's modules, which learned to read its signal: a recipe asking for the other
    one is refused with the setting that continues it (an old checkpoint without the field reads pre_norm)."""
    import train.mtp as recipe

    target = TargetModel.from_config(TargetConfig(name_or_path=str(tiny_recipe / "target"), device="cpu"))
    MTPDrafter.from_target(target, 2, input_signal="pre_norm").save_pretrained(tmp_path / "old")
    with pytest.raises(SystemExit, match="reads the target's pre_norm signal.*set mtp.input_signal=pre_norm"):
        recipe.main(mtp_args(tiny_recipe, tmp_path / "out", f"mtp.init_from={tmp_path / 'old'}"))


def test_a_dataset_with_nothing_to_train_on_is_refused_before_the_target_loads(tiny_recipe, tmp_path, monkeypatch):
    import train.loop
    import train.mtp as recipe

    (tmp_path / "blank.jsonl").write_text("".join(json.dumps({"text": " " * i}) + "\n" for i in range(5)))

    def no_target(*args, **kwargs):
        raise AssertionError("the target loaded before the data was checked")

    monkeypatch.setattr(train.loop.TargetModel, "from_config", no_target)
    with pytest.raises(SystemExit, match=r"none of its 5 rows gives a training sample \(skipped: \{'empty_text': 5\}"):
        recipe.main(mtp_args(tiny_recipe, tmp_path / "out", f"data.path={tmp_path / 'blank.jsonl'}"))


def read_log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.integration
def test_frozen_recipe_trains_saves_exports_reports_and_resumes(tiny_recipe, tmp_path, capsys):
    import train.mtp as recipe

    out = tmp_path / "run"
    recipe.main(mtp_args(tiny_recipe, out, "train.max_steps=4"))
    printed = capsys.readouterr().out
    assert "modules: 2 x LlamaDecoderLayer (last_layer)" in printed and "λ [0.15, 0.15]" in printed
    assert "h^0 = the target's last_hidden" in printed
    for name in ("config.json", "model.safetensors", "report.json"):
        assert (out / name).exists(), name
    # a Llama target: neither engine layout holds its modules (they serve in drafters' runtime), and the log says so
    assert not (out / "export-deepseek").exists() and not (out / "export-qwen3-next").exists()
    assert "export-deepseek left out" in printed and "export-qwen3-next left out" in printed
    steps = [r for r in read_log(out) if "step" in r]
    assert [r["step"] for r in steps] == [2, 4]
    last = steps[-1]
    assert len(last["acc"]) == 2 and len(last["depth_loss"]) == 2 and all(x > 0 for x in last["depth_loss"])
    assert len(last["eval/rank_acc"]) == 2 and len(last["eval/rank_acc"][0]) == 2
    assert 1.0 <= last["eval/simulated_tau"] <= last["eval/tree_top2_expected_tau"] <= 3.0
    assert last["lambda"] == pytest.approx([0.15, 0.15])
    raw, info = read_checkpoint(out)
    assert info.method == "mtp" and info.target_weights is None and raw["num_modules"] == 2
    assert raw["input_signal"] == "last_hidden"

    rows = json.loads((out / "report.json").read_text())["results"]
    mtp = {r["setting"]: r for r in rows if r["proposer"] == "mtp"}
    assert set(mtp) == {"chain 2", "chain 3 (module 2 reused)", "top-2 tree n5"}
    assert all(r["greedy_identical"] == 1.0 for r in mtp.values())
    assert all(len(r["alpha"]) >= 1 for r in mtp.values())  # per-depth acceptance

    # the trained modules moved away from their start; the frozen target did not move
    target = TargetModel.from_config(TargetConfig(name_or_path=str(tiny_recipe / "target"), device="cpu"))
    fresh, trained = MTPDrafter.from_target(target, 2), load_drafter(out, target)
    assert not torch.equal(fresh.layers[0].block.mlp.up_proj.weight, trained.layers[0].block.mlp.up_proj.weight)

    # resume with more steps: continues at step 4
    recipe.main(mtp_args(tiny_recipe, out, "train.max_steps=6", "report.enabled=false"))
    assert "resumed at step 4" in capsys.readouterr().out
    assert [r["step"] for r in read_log(out) if "step" in r] == [2, 4, 6]


@pytest.mark.integration
def test_joint_lora_trains_the_target_with_the_modules_and_reports_the_quality_guard(tiny_recipe, tmp_path, capsys):
    import train.mtp as recipe

    out = tmp_path / "lora"
    joint = ["target.mode=joint", "target.lora_rank=4", "joint.drafter_warmup_steps=2", "joint.lm_loss=kl"]
    one = ["mtp.num_modules=1", "report.chain_k=2"]
    recipe.main(mtp_args(tiny_recipe, out, *joint, *one, "train.max_steps=4"))
    printed = capsys.readouterr().out
    assert "joint with the target (LoRA r4)" in printed and "top-1 agreement with the original" in printed
    log = read_log(out)
    assert next(r for r in log if "before/agreement" in r)["before/agreement"] == 1.0
    steps = [r for r in log if "step" in r and "acc" in r]
    assert steps[0]["lm_loss"] == 0.0 and steps[-1]["lm_loss"] >= 0.0  # step 2: warm-up, the target idles
    last = steps[-1]
    assert 0.0 <= last["eval/agreement"] <= 1.0
    before = next(r for r in log if "before/lm_loss" in r)["before/lm_loss"]
    assert last["eval/lm_loss_change"] == pytest.approx(last["eval/lm_loss"] - before, abs=1e-3)
    assert (out / "target" / "adapter_config.json").exists() and read_checkpoint(out)[1].target_weights == "lora"
    assert not (out / "export-qwen3-next").exists()  # a Llama target: refused (tests/test_export_engines_mtp.py)
    # one pinned dtype: two "fastest" loads may each measure a different choice on a busy host
    base_cfg = TargetConfig(name_or_path=str(tiny_recipe / "target"), device="cpu", dtype="float32")
    base, changed = TargetModel.from_config(base_cfg), load_target(out, base_cfg)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    assert not torch.allclose(base(ids).logits, changed(ids).logits)  # the adapter trained and is applied
    rows = json.loads((out / "report.json").read_text())["results"]
    assert {r["setting"] for r in rows if r["proposer"] == "mtp"} == {
        "chain 1",
        "chain 2 (module 1 reused)",
        "top-2 tree n3",
    }
    assert all(r["greedy_identical"] == 1.0 for r in rows if r["proposer"] == "mtp")


@pytest.mark.integration
def test_joint_mode_on_two_cpu_ranks_through_accelerate_launch(tiny_recipe, tmp_path):
    """Joint training under DDP (the frozen mode under every engine: tests/test_engines.py)."""
    out = tmp_path / "joint"
    args = mtp_args(tiny_recipe, out, "train.max_steps=2", "report.enabled=false", "train.export=false")
    args += ["target.mode=joint", "target.lora_rank=4", "joint.drafter_warmup_steps=1"]
    run_to_end("mtp.py", args, "ddp")
    sharding = next(r["sharding"] for r in read_log(out) if "sharding" in r)
    assert sharding["world"] == 2 and sharding["distinct_over_ranks"] == sharding["total_over_ranks"]
    assert read_checkpoint(out)[1].target_weights == "lora"


@pytest.mark.integration
@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_the_recipe_tracker_logs_every_step_offline(tiny_recipe, tmp_path, monkeypatch, tracker):
    """train.log_with: the same loss per step as train_log.jsonl reaches tensorboard's event file, or wandb's offline
    run (WANDB_MODE=offline, no network), under the output folder."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / tracker
    steps = ("train.max_steps=3", "train.log_every=1", "report.enabled=false", "train.export=false")
    run_to_end("mtp.py", mtp_args(tiny_recipe, out, *steps, f"train.log_with={tracker}"))
    logged = [r for r in read_log(out) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3]
    if tracker == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "mtp"))
        events.Reload()
        for name, key in (("loss", None), ("acc/1", 1)):
            seen = [(e.step, e.value) for e in events.Scalars(name)]
            want = [(r["step"], r["loss"] if key is None else r["acc"][key]) for r in logged]
            assert [s for s, _ in seen] == [s for s, _ in want]
            assert [v for _, v in seen] == pytest.approx([v for _, v in want], rel=1e-6)
    else:
        (run,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
        data = run.read_bytes()
        # the history records hold each metric's name and its JSON value
        for r in logged:
            assert json.dumps(r["loss"]).encode() in data and json.dumps(r["grad_norm"]).encode() in data
        assert b"depth_loss/1" in data and b"eval/simulated_tau" in data


def test_an_unknown_or_missing_tracker_is_refused(monkeypatch):
    """Accelerate only warns and trains without a tracker it cannot find; the recipe refuses at config time."""
    import importlib.util

    from train.config import TrainConfig

    with pytest.raises(ValueError, match="log_with must be one of"):
        TrainConfig(output_dir="x", log_with="tensorbord")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"the wandb package is not installed \(pip install 'drafters\[wandb\]'\)"):
        TrainConfig(output_dir="x", log_with="wandb")
