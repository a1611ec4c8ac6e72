"""The training engines (recipes/accelerate/): each entry script on two CPU ranks under DDP, DeepSpeed ZeRO-2,
DeepSpeed ZeRO-3 and FSDP2 trains like one process with the same global batch, on disjoint shards, with the frozen
target in no optimizer state, and saves one loadable checkpoint file, also where the engine shards the drafter."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from tests.conftest import ENGINE_CONFIGS, run_to_end
from tests.test_eagle3_train import recipe_args
from tests.test_medusa import medusa_args
from tests.test_mtp_train import mtp_args
from train.checkpoint import _check_deepspeed_files
from train.config import TrainConfig
from train.data.answerer import end_launched_process
from train.distributed import fill_deepspeed_config

# two micro-batches per step, so accumulation runs under every engine (DeepSpeed's own included)
STEPS = ("train.max_steps=3", "train.log_every=1", "train.grad_accum=2", "report.enabled=false", "train.export=false")
SCRIPTS = {"eagle3.py": recipe_args, "medusa.py": medusa_args, "mtp.py": mtp_args}
DISTRIBUTED_TYPE = {"ddp": "MULTI_CPU", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED", "fsdp": "FSDP"}


def log_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in log_of(out) if "loss" in r]


def drafter_class(script: str):
    from models.eagle3 import Eagle3Drafter
    from models.medusa import MedusaDrafter
    from models.mtp import MTPDrafter

    return {"eagle3.py": Eagle3Drafter, "medusa.py": MedusaDrafter, "mtp.py": MTPDrafter}[script]


@pytest.fixture(scope="module")
def reference_runs(tiny_recipe, tmp_path_factory):
    """Per script, run on demand and kept: one process at batch 2, and DDP on two ranks at batch 1 per rank (the
    same global batch, 2 × 2 accumulated, so the same samples every step)."""
    runs: dict[tuple[str, str], Path] = {}

    def get(script: str, launcher: str) -> Path:
        if (script, launcher) not in runs:
            out = tmp_path_factory.mktemp(f"{script[:-3]}-{launcher}")
            batch = "train.batch_size=2" if launcher == "python" else "train.batch_size=1"
            run_to_end(script, SCRIPTS[script](tiny_recipe, out, *STEPS, batch), launcher)
            runs[script, launcher] = out
        return runs[script, launcher]

    return get


@pytest.mark.integration
@pytest.mark.parametrize("engine", list(ENGINE_CONFIGS))
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_every_engine_trains_like_one_process(tiny_recipe, tmp_path, reference_runs, script, engine):
    one = reference_runs(script, "python")
    out = reference_runs(script, "ddp") if engine == "ddp" else tmp_path / engine
    if engine != "ddp":
        run_to_end(script, SCRIPTS[script](tiny_recipe, out, *STEPS, "train.batch_size=1"), engine)

    # the world this run really got, and the samples each rank saw
    sharding = next(r["sharding"] for r in log_of(out) if "sharding" in r)
    assert sharding["world"] == 2 and DISTRIBUTED_TYPE[engine] in sharding["distributed_type"]
    assert sharding["distinct_over_ranks"] == sharding["total_over_ranks"] == 2 * sharding["samples_per_rank"]

    # optimizer state: DDP keeps the drafter's on every rank, the sharding engines split it; the frozen target
    # (far larger than these drafters) is in none of them
    held, trainable = sharding["optimizer_numel_over_ranks"], sharding["trainable_numel"]
    if engine == "ddp":
        assert held == 2 * trainable
    else:
        assert trainable <= held <= trainable + 256  # partitions padded to an alignment at most

    # the loss curve of one process with the same global batch. Each rank averages its own tokens and the ranks'
    # gradients are averaged, where one process averages all tokens: equal when the ranks' token counts are
    # (Medusa, MTP here), within a few 1e-4 otherwise (EAGLE-3's self-distilled samples are shorter)
    assert len(losses(out)) == 3
    assert losses(out) == pytest.approx(losses(one), rel=2e-3)

    # one checkpoint file that loads for the target; the same weights as DDP's (gathered where the engine shards)
    from models.target import TargetConfig, TargetModel

    target = TargetModel.from_config(TargetConfig(name_or_path=str(tiny_recipe / "target"), device="cpu"))
    drafter_class(script).from_pretrained(out, target)
    ddp, mine = (load_file(str(d / "model.safetensors")) for d in (reference_runs(script, "ddp"), out))
    assert mine.keys() == ddp.keys()
    for name in ddp:
        assert torch.allclose(mine[name], ddp[name], atol=1e-5), name


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["zero3", "fsdp"])
def test_a_sharded_run_resumes_to_the_same_weights(tiny_recipe, tmp_path, engine):
    """Four steps saving every two; then the same run resumed from its step-2 state (the later one removed) ends
    on the same weights: the sharded model, optimizer and data position all came back."""
    whole = tmp_path / "whole"
    args = ("train.max_steps=4", "train.save_every=2", "report.enabled=false", "train.export=false")
    run_to_end("mtp.py", mtp_args(tiny_recipe, whole, *args), engine)
    assert sorted(p.name for p in whole.glob("state*")) == ["state", "state.2"]
    again = tmp_path / "again"
    shutil.copytree(whole, again, ignore=shutil.ignore_patterns("state", "model.safetensors", "train_log.jsonl"))
    printed = run_to_end("mtp.py", mtp_args(tiny_recipe, again, *args), engine)
    assert "resumed at step 2" in printed
    a, b = (load_file(str(d / "model.safetensors")) for d in (whole, again))
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6), name


def _deepspeed_accelerator(config: dict, world: int = 2):
    return SimpleNamespace(
        num_processes=world, state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config))
    )


def test_deepspeed_auto_values_come_from_the_recipe_and_explicit_ones_must_agree():
    tc = TrainConfig(output_dir="unused", batch_size=2, grad_accum=3, grad_clip=0.5)
    config = json.loads((Path(__file__).parents[1] / "recipes" / "deepspeed" / "zero3.json").read_text())
    fill_deepspeed_config(_deepspeed_accelerator(config), tc)
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 12 and config["gradient_clipping"] == 0.5
    with pytest.raises(SystemExit, match="train_micro_batch_size_per_gpu=4 but the recipe gives 2"):
        fill_deepspeed_config(_deepspeed_accelerator({"train_micro_batch_size_per_gpu": 4}), tc)


def test_joint_training_under_a_sharding_engine_is_refused_before_it_starts():
    from train.joint import JointConfig, trained_modules

    for kind in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        with pytest.raises(SystemExit, match="joint training .* runs under DDP only"):
            trained_modules(
                SimpleNamespace(distributed_type=kind), None, None, lambda t, d: None, None, JointConfig(), None, 0
            )


class _Payload:
    def __reduce__(self):
        return (print, ("payload ran",))


def test_a_pickle_payload_in_a_deepspeed_state_is_refused_before_deepspeed_reads_it(tmp_path, capsys):
    state = tmp_path / "state" / "pytorch_model"
    state.mkdir(parents=True)
    torch.save({"optimizer_state_dict": _Payload()}, state / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(pickle.UnpicklingError):
        _check_deepspeed_files(tmp_path / "state")
    assert "payload ran" not in capsys.readouterr().out


def test_a_launched_process_ends_without_the_interpreter_teardown(monkeypatch):
    """A rank of a launched run leaves through os._exit(0) (a gloo worker thread releasing a finished collective
    during interpreter finalization aborts the process); a one-process run returns."""
    exits = []
    monkeypatch.setattr("os._exit", exits.append)
    end_launched_process(1)
    assert exits == []
    end_launched_process(2)
    assert exits == [0]
