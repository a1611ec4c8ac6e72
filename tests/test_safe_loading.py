"""Checkpoints from strangers: a pickle payload in a resumable state or in a drafter folder is refused, and its code
never runs (issue: safe loading)."""

from __future__ import annotations

import pickle

import pytest
import torch

from infer.families import load_drafter
from models.mtp import MTPDrafter


class Payload:
    """Unpickling this runs ``open(path, "w")``: the marker file shows whether the loader executed it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_in_the_resumable_state_is_refused_without_running(tmp_path):
    from accelerate import Accelerator

    from train.checkpoint import load_training_state, save_training_state

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    save_training_state(accelerator, tmp_path, {"step": 3})
    assert load_training_state(accelerator, tmp_path) == {"step": 3}  # the real state loads

    marker = tmp_path / "ran"
    with open(tmp_path / "state" / "optimizer.bin", "wb") as f:
        pickle.dump({"state": Payload(str(marker))}, f)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_training_state(accelerator, tmp_path)
    assert not marker.exists()


def test_a_pickle_in_place_of_the_drafter_weights_is_refused_without_running(tiny_target, tmp_path):
    MTPDrafter.from_target(tiny_target, num_modules=1).save_pretrained(tmp_path)
    marker = tmp_path / "ran"
    with open(tmp_path / "model.safetensors", "wb") as f:
        pickle.dump(Payload(str(marker)), f)
    with pytest.raises(Exception, match="header|Header|deserializ"):
        load_drafter(tmp_path, tiny_target)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_or_truncated_drafter_weights_name_the_file(tiny_target, tmp_path, damage):
    MTPDrafter.from_target(tiny_target, num_modules=1).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    if damage == "missing":
        weights.unlink()
        with pytest.raises(
            FileNotFoundError, match=r"model.safetensors is missing: the checkpoint folder has a config"
        ):
            load_drafter(tmp_path, tiny_target)
    else:
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
        with pytest.raises(ValueError, match=r"model.safetensors \(.* bytes\) does not read as safetensors"):
            load_drafter(tmp_path, tiny_target)
