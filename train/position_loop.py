"""The training loop of drafters whose loss is a weighted sum over draft positions, on a frozen target or jointly
with it: Medusa heads (head k predicts token t+2+k) and MTP modules (depth d predicts token t+2+d).

One micro-step: the family's (positions, labels) per head / depth → logits (frozen: from the target's signal
without a graph; joint: `train.joint.JointModel`, the target with a graph once the drafter's warm-up is over) →
Σ_k λ_k CE_k (`train.losses.position_losses`), plus L_LM weighed against λ0 in joint training → backward under
gradient accumulation; at each optimizer step the log line, the held-out evaluation (and, joint, the quality guard)
and the resumable state when due. The recipes (train/medusa.py, train/mtp.py) build the family's `PositionTask`
and call `train_positions`; they keep their setup, and save and report through `train.finish`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator

from train.checkpoint import save_training_state
from train.config import TrainConfig
from train.joint import JointRun, lm_loss, quality
from train.loop import LoopResult, TrainingPlan
from train.losses import position_losses, position_targets
from train.progress import Progress, record
from train.schedule import epoch_batch

Targets = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PositionTask:
    """What the shared loop needs from one family."""

    name: str
    """Progress bar and checkpoint name ("medusa", "mtp")."""
    positions: int
    """Heads (Medusa) or depths (MTP)."""
    position_loss: str
    """The per-position loss's name in the log ("head_loss", "depth_loss")."""
    targets: Callable[[dict], Targets]
    """batch → (positions [B, T] bool, labels [B, T]) of every head / depth."""
    frozen_logits: Callable[[torch.nn.Module, dict, list[torch.Tensor]], list[torch.Tensor]]
    """(the trained module, batch, positions) → logits per head / depth, the target frozen."""
    weights_at: Callable[[int], list[float]]
    """Per-position loss weights at an optimizer step (Medusa: w^k; MTP: λ/D, switched at a step)."""
    evaluate: Callable[[], dict]
    """Held-out metrics of the drafter (``eval/acc`` per position, ...); keys other than ``eval/*`` are kept in the
    returned last evaluation but not logged (Medusa's tree paths)."""
    batch_of: Callable[[list[int]], dict]
    """Sample indices → the collated batch, on the device."""
    num_samples: int
    log_extra: Callable[[int], dict] = lambda step: {}
    """Values logged beside the loss at a step (MTP: its λ)."""


def train_positions(
    accelerator: Accelerator,
    tc: TrainConfig,
    task: PositionTask,
    plan: TrainingPlan,
    lengths: torch.Tensor | None,
    log,
    joint: JointRun | None,
    with_eval: bool,
) -> LoopResult:
    """Train ``plan.model`` to ``plan.total_steps`` from ``plan.start_step`` (a resumed run's), as
    `train.loop.start_training` planned it; the result holds the last evaluation.
    ``joint``: where ``plan.model`` is a `JointModel`; None for a frozen target. ``with_eval``: there is a held-out
    set."""
    model, optimizer = plan.model, plan.optimizer
    rank, world = accelerator.process_index, accelerator.num_processes
    second = "lm_loss" if joint else None
    progress = Progress(
        accelerator,
        tc,
        plan.total_steps,
        plan.warmup,
        plan.start_step,
        task.positions,
        task.name,
        second,
        task.position_loss,
    )
    micro, last_eval = plan.start_step * tc.grad_accum, {}
    while progress.step < plan.total_steps:
        ids = epoch_batch(task.num_samples, micro, plan.per_epoch, tc.seed, rank, world, tc.batch_size, lengths)
        batch = task.batch_of(ids)
        targets = task.targets(batch)
        positions = [p for p, _ in targets]
        train_target = joint is not None and progress.step >= joint.config.drafter_warmup_steps
        with accelerator.accumulate(model), accelerator.autocast():  # no all-reduce before the boundary
            lm = torch.zeros((), device=accelerator.device)
            if joint is not None:
                lm_pos, lm_labels = position_targets(batch["input_ids"], batch["loss_mask"], -1)  # token t+1
                lm_logits, logits = model(batch, positions, lm_pos, train_target)
                if train_target:
                    lm = lm_loss(
                        joint.config.lm_loss, lm_logits, joint.target, joint.original, batch, lm_pos, lm_labels
                    )
            else:
                logits = task.frozen_logits(model, batch, positions)
            res = position_losses(logits, targets, task.weights_at(progress.step))
            loss = lm + (joint.config.lambda0_at(progress.step) if train_target else 1.0) * res["loss"]
            accelerator.backward(loss)  # divided by train.grad_accum there
        progress.add(loss, res["correct"], res["count"], int(batch["attention_mask"].sum()), lm, res["position_loss"])
        micro += 1
        if not accelerator.sync_gradients:
            continue
        if joint is not None and not train_target:
            # shared embeddings / heads are the target's: they wait for the joint phase
            for p in joint.target.parameters():
                p.grad = None
        progress.optimizer_step(model, optimizer)
        do_log, do_eval = progress.due(with_eval)
        if do_log:
            metrics = {**progress.metrics(), **task.log_extra(progress.step - 1)}
            if joint is not None:
                metrics["lambda0"] = joint.config.lambda0_at(progress.step - 1)
            if do_eval:
                last_eval = task.evaluate()
                if joint is not None:
                    last_eval.update(
                        quality(accelerator, joint.target, joint.original, joint.eval_set, tc, joint.pad_id)
                    )
                    if joint.before:
                        change = last_eval["eval/lm_loss"] - joint.before["eval/lm_loss"]
                        last_eval["eval/lm_loss_change"] = round(change, 4)
                metrics.update({k: v for k, v in last_eval.items() if k.startswith("eval/")})
            record(accelerator, tc, metrics, log)
        if progress.save_due():
            save_training_state(accelerator, Path(tc.output_dir), {"step": progress.step}, tc.keep_states)
    return LoopResult(progress.step, progress.close(), last_eval)
