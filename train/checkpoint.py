"""Resumable training state: accelerate's model / optimizer / RNG state plus the loop counters (the data position is
the step: `train.schedule.epoch_batch` derives every micro-batch from it; the learning rate is a function of the step),
written so that a crash at any moment leaves a loadable state behind.

Layout under ``<output_dir>/``: ``state/`` is the latest state, ``state.{step}`` the ``keep - 1`` earlier ones.
A save writes ``state.tmp``, fsyncs every file and the folder, then renames: ``state`` → ``state.{its step}``,
``state.tmp`` → ``state``, and fsyncs the parent; ``step.json`` is written last, so a folder without it is
incomplete. Loading takes the newest complete state; one that fails to load (a file truncated by a full disk or a
lost write) is skipped, with the reason printed, for the one before it. A refused pickle is not skipped: that is a
tampered checkpoint, and it raises.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from models.allocator import release_freed_memory

STATE_DIR = "state"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _earlier_states(out: Path) -> list[Path]:
    """``state.{step}`` folders, newest first."""
    found = [p for p in out.glob(f"{STATE_DIR}.*") if p.is_dir() and p.suffix[1:].isdigit()]
    return sorted(found, key=lambda p: int(p.suffix[1:]), reverse=True)


def save_training_state(accelerator: Accelerator, output_dir: str | Path, counters: dict, keep: int = 2) -> None:
    """Collective: every rank calls it (accelerate gathers), the main process renames. ``keep``: states left on
    disk, the latest included."""
    out = Path(output_dir)
    tmp, final = out / f"{STATE_DIR}.tmp", out / STATE_DIR
    if accelerator.is_main_process and tmp.exists():  # a save killed midway
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every rank's RNG file is in tmp before it moves
    if accelerator.is_main_process:
        (tmp / "step.json").write_text(json.dumps(counters))
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        _fsync(tmp)
        if (final / "step.json").exists():
            previous = out / f"{STATE_DIR}.{json.loads((final / 'step.json').read_text())['step']}"
            if previous.exists():  # the same step saved again (a resumed run's first save)
                shutil.rmtree(previous)
            os.rename(final, previous)
        elif final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(out)
        for old in _earlier_states(out)[max(keep - 1, 0) :] + [out / f"{STATE_DIR}.old"]:
            if old.exists():  # state.old: the layout before keep-K, a leftover of an interrupted save
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    release_freed_memory()  # between steps: a heap fragmented past half the machine gives its free pages back


def _check_deepspeed_files(state: Path) -> None:
    """DeepSpeed reads its own checkpoint files with pickle (``weights_only=False``); each is first read here the
    safe way, allowing only the three DeepSpeed classes its optimizer state holds, so a file naming anything else
    (a code payload) raises ``UnpicklingError`` before DeepSpeed opens it."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        for f in sorted(state.rglob("*.pt")):
            torch.load(f, map_location="cpu", weights_only=True)


def load_training_state(accelerator: Accelerator, output_dir: str | Path) -> dict | None:
    """Restore the newest loadable state; returns its counters (None: no state, a fresh start). Raises when states
    exist but none loads, rather than silently starting over."""
    out = Path(output_dir)
    candidates = [out / STATE_DIR, *_earlier_states(out), out / f"{STATE_DIR}.old"]
    complete = [c for c in candidates if (c / "step.json").exists()]
    errors = []
    for state in complete:
        try:
            if accelerator.distributed_type == DistributedType.DEEPSPEED:
                _check_deepspeed_files(state)
            accelerator.load_state(str(state))
        except pickle.UnpicklingError:
            raise
        except Exception as e:  # noqa: BLE001 (a truncated or missing file, whatever layer notices it)
            errors.append(f"{state.name}: {type(e).__name__}: {e}")
            if accelerator.is_main_process:
                print(f"resume: {state} does not load ({type(e).__name__}: {e}); trying the one before", flush=True)
            continue
        return json.loads((state / "step.json").read_text())
    if errors:
        raise RuntimeError(f"no training state under {out} loads: " + "; ".join(errors))
    return None
