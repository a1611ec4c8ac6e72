"""Crash-safe training: states rotate (latest + keep-1 earlier), whatever a kill leaves on disk still loads, and a
run killed with SIGKILL and resumed ends with the same weights as one that was never interrupted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_entry, run_to_end
from tests.test_mtp_train import mtp_args
from train.checkpoint import load_training_state, save_training_state


def states(out) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("state"))


def test_states_rotate_and_every_state_a_crash_leaves_loads_the_newest_good_one(tmp_path):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 2))

    def save(step: int) -> None:
        with torch.no_grad():
            model.weight.fill_(step)
        save_training_state(acc, tmp_path, {"step": step}, keep=2)

    for step in (2, 4, 6):
        save(step)
    assert states(tmp_path) == ["state", "state.4"]  # the latest and one earlier

    def loads() -> tuple[int, float]:
        with torch.no_grad():
            model.weight.zero_()
        step = load_training_state(acc, tmp_path)["step"]
        return step, model.weight[0, 0].item()

    assert loads() == (6, 6.0)
    # killed during the next save: a partial state.tmp (no step.json) is ignored, and the next save clears it
    (tmp_path / "state.tmp").mkdir()
    (tmp_path / "state.tmp" / "model.safetensors").write_bytes(b"partial")
    assert loads() == (6, 6.0)
    # killed between the two renames: no `state`, the previous one is state.6
    save(8)
    os.rename(tmp_path / "state", tmp_path / "state.8")
    shutil.rmtree(tmp_path / "state.8")
    assert loads() == (6, 6.0)
    # the latest state damaged after its save (a truncated file): the one before it loads, and says why
    save(10)
    (tmp_path / "state" / "model.safetensors").write_bytes(b"\0" * 16)
    assert loads() == (6, 6.0)
    for s in ("state", "state.6"):
        (tmp_path / s / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(RuntimeError, match="no training state .* loads"):
        load_training_state(acc, tmp_path)


@pytest.mark.integration
def test_a_run_killed_with_sigkill_resumes_to_the_same_weights(tiny_recipe, tmp_path):
    common = ["train.max_steps=8", "train.save_every=2", "report.enabled=false", "train.export=false"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_to_end("mtp.py", mtp_args(tiny_recipe, whole, *common))

    proc = run_entry("mtp.py", mtp_args(tiny_recipe, killed, *common))
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads((killed / "state" / "step.json").read_text())["step"] >= 2:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    # Frozen before the check: a tiny run saves several steps between two polls and could end between the check
    # and the kill; stopped, it cannot, and the kill lands wherever it stands, a save cut short included.
    proc.send_signal(signal.SIGSTOP)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert not (killed / "config.json").exists()  # it died before the end
    printed = run_to_end("mtp.py", mtp_args(tiny_recipe, killed, *common))
    resumed = int(printed.split("resumed at step ")[1].split()[0])  # it resumed, not restarted
    assert 2 <= resumed < 8

    a, b = load_file(str(whole / "model.safetensors")), load_file(str(killed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(line) for line in (killed / "train_log.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in log if "loss" in r) == 8


def test_a_nan_loss_stops_before_the_update_and_names_the_step(tmp_path):
    from accelerate import Accelerator

    from train.config import TrainConfig
    from train.progress import Progress

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    progress = Progress(acc, TrainConfig(output_dir=str(tmp_path)), 4, 0, 0, 1, "test")
    model(torch.ones(1, 2)).sum().backward()
    progress.optimizer_step(model, optimizer)  # a good step
    good = model.weight.detach().clone()
    (model(torch.ones(1, 2)).sum() * float("nan")).backward()
    with pytest.raises(FloatingPointError, match="step 2: the gradient norm is nan"):
        progress.optimizer_step(model, optimizer)
    assert torch.equal(model.weight.detach(), good) and progress.step == 1
