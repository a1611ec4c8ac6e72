"""What every drafter recipe does after its loop: save the run (resumable state, checkpoint, engine exports) and
measure the saved drafter in the verify runtime (`eval.report.run_report`). The recipes keep what differs: their
exports, and the notes their report carries.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import Accelerator

from eval.report import run_report
from train.checkpoint import save_training_state
from train.config import TrainConfig
from train.data.answerer import end_launched_process
from train.distributed import full_state
from train.joint import save_target_changes, served
from train.loop import LoopResult, TargetAndData, TrainingPlan
from train.progress import stamp_heldout


def save_drafter(
    accelerator: Accelerator,
    tc: TrainConfig,
    plan: TrainingPlan,
    drafter: torch.nn.Module,
    drafter_cls: type,
    loaded: TargetAndData,
    done: LoopResult,
    started: float,
    log: Callable[[str], None],
    export: Callable[[torch.nn.Module, Path, Callable[[str], None]], None],
    joint: bool = False,
) -> torch.nn.Module | None:
    """Save a finished run into ``train.output_dir``. Every rank: the resumable state, the whole trained module
    gathered on the main process, the end of training. Then, on the main process only: the target's changes
    (``joint``; before the drafter's checkpoint, whose config.json marks a complete save), the held-out stamp, the
    drafter's checkpoint, the engine folders (``export(drafter, out, log)``, when ``train.export``) and the log line.
    Returns the drafter as saved (None on the other ranks): ``drafter``, or, where the trained module was sharded,
    the checkpoint just written read back as ``drafter_cls`` (named, not ``type(drafter)``: a sharding engine may
    have swapped the module's class)."""
    out = Path(tc.output_dir)
    save_training_state(accelerator, out, {"step": done.steps}, tc.keep_states)
    gathered = full_state(accelerator, plan.model)  # ZeRO-3 / FSDP: the whole drafter, on the main process
    accelerator.end_training()
    # The last collective is behind us (each launched process then ends through `end_launched_process`)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if not accelerator.is_main_process:
        end_launched_process(accelerator.num_processes)
        return None
    if joint:
        save_target_changes(loaded.target, drafter, out)
    stamp_heldout(drafter.target_info, tc, loaded.eval_set)
    drafter.save_pretrained(out, gathered)
    if gathered is not None:  # the sharded module in hand is not the drafter: serve the one file just written
        drafter = drafter_cls.from_pretrained(out, loaded.target, loaded.tokenizer)
    if tc.export:
        export(drafter, out, log)
    log(
        f"saved {out} (+ exports) after {done.train_seconds / 60:.1f} min of training, "
        f"{(time.time() - started) / 60:.1f} min total"
    )
    return drafter


def report_drafter(
    cfg,
    loaded: TargetAndData,
    drafter_cls: type,
    notes: str,
    log: Callable[[str], None],
    joint: bool = False,
) -> None:
    """The closing report of a recipe with ``target``, ``train`` and ``report`` sections, when ``report.enabled``:
    τ and speedup in the verify runtime on held-out prompts, the drafter (and a jointly trained target, ``joint``)
    read back as they will be served: in the target's dtype, where training kept fp32 weights. Main process only."""
    if not cfg.report.enabled:
        return
    out, target = Path(cfg.train.output_dir), loaded.target
    if joint:
        target, drafter = served(out, cfg.target, drafter_cls, loaded.tokenizer)
    else:
        drafter = drafter_cls.from_pretrained(out, target, loaded.tokenizer)
    run_report(target, drafter, loaded.tokenizer, cfg.report, out, loaded.eval_set, notes=notes, log=log)
