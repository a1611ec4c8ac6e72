"""A training run's log and progress: the metrics line (stdout, ``train_log.jsonl``, the tracker), `Progress` (sums
kept on the device, the scheduled optimizer step, when to log / evaluate / save / snapshot) and the held-out
acceptance stamped into the checkpoint block at the end.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from models.checkpoint import TargetInfo
from train.config import TrainConfig
from train.optim import set_lr, warmup_cosine


def stamp_heldout(info: TargetInfo, tc: TrainConfig, eval_set) -> None:
    """Write the run's last held-out per-depth acceptance (``eval/acc`` in train_log.jsonl, resumed runs included)
    and its sample count into the checkpoint block, so any later report can size chains with it."""
    log = Path(tc.output_dir) / "train_log.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    last = next((r["eval/acc"] for r in reversed(rows) if r.get("eval/acc")), None)
    if last is not None and eval_set is not None:
        info.heldout_acceptance = [float(a) for a in last]
        info.heldout_samples = min(len(eval_set), tc.eval_samples)


def record(accelerator: Accelerator, tc: TrainConfig, metrics: dict, log) -> None:
    """One metrics line: stdout, <output_dir>/train_log.jsonl (appended) and the tracker, main process only."""
    log(json.dumps(metrics))
    if not accelerator.is_main_process:
        return
    with open(Path(tc.output_dir) / "train_log.jsonl", "a") as f:
        f.write(json.dumps(metrics) + "\n")
    if tc.log_with and "step" in metrics:
        accelerator.log(scalars(metrics), step=metrics["step"])


def scalars(tree: dict, prefix: str = "") -> dict:
    """A tracker's view of a metrics line or a config: nested dicts and lists flattened to "a/b" / "acc/0" keys;
    numbers kept, other leaves as text (tensorboard's hyper-parameters take numbers, text and booleans only)."""
    flat = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            flat.update(scalars(value, f"{key}/"))
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
            flat.update({f"{key}/{i}": v for i, v in enumerate(value)})
        elif isinstance(value, (bool, int, float, str)):
            flat[key] = value
        else:
            flat[key] = str(value)
    return flat


class Progress:
    """The bookkeeping of a training loop: sums kept on the device and read once per log line (reading them every
    step would sync the device), the scheduled optimizer step, when to log / evaluate / save, the metrics line.

    Sums: loss, an optional second loss (``second_loss`` names it in the log), micro-batches, then correct, count
    and (``position_loss`` names it in the log) the mean loss per position (TTT step, head or depth)."""

    def __init__(
        self,
        accelerator: Accelerator,
        tc: TrainConfig,
        total_steps: int,
        warmup: int,
        step: int,
        positions: int,
        desc: str,
        second_loss: str | None = None,
        position_loss: str | None = None,
    ) -> None:
        self.accelerator, self.tc, self.total_steps, self.warmup, self.step = accelerator, tc, total_steps, warmup, step
        self.k, self.second_loss, self.position_loss = positions, second_loss, position_loss
        self.stats = torch.zeros(3 + 3 * positions, device=accelerator.device)
        self.tokens, self.t_loop, self.grad_norm = 0, time.time(), 0.0
        self.bar = tqdm(total=total_steps, initial=step, desc=desc, disable=not accelerator.is_main_process)

    def add(
        self,
        loss: torch.Tensor,
        correct: torch.Tensor,
        count: torch.Tensor,
        tokens: int,
        second: torch.Tensor | None = None,
        position_loss: torch.Tensor | None = None,
    ) -> None:
        second = torch.zeros_like(loss) if second is None else second
        position_loss = self.stats.new_zeros(self.k) if position_loss is None else position_loss
        parts = [loss.detach().reshape(1), second.detach().reshape(1), self.stats.new_ones(1), correct, count]
        parts.append(position_loss.detach().float())
        self.stats += torch.cat(parts)
        self.tokens += tokens

    def optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Learning rate of this step (warm-up + cosine), gradient clipping, the update; a non-finite gradient stops
        the run before the update (FloatingPointError naming the step)."""
        tc = self.tc
        # DeepSpeed clipped and updated inside backward (clipping from its config); this reads the norm it used
        self.grad_norm = float(self.accelerator.clip_grad_norm_(model.parameters(), tc.grad_clip))
        if not math.isfinite(self.grad_norm):  # every rank sees the same all-reduced norm, so all stop together
            when = (
                "DeepSpeed applied this step's update inside backward, but nothing was saved after it"
                if self.accelerator.distributed_type == DistributedType.DEEPSPEED
                else "Stopped before the update"
            )
            raise FloatingPointError(
                f"step {self.step + 1}: the gradient norm is {self.grad_norm} (a NaN / inf loss). {when}: the saved "
                f"states under {tc.output_dir} are the last good ones (resume from them with a lower learning rate, "
                "or look at this step's batch)"
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.lr = optimizer.param_groups[0]["lr"]
        self.step += 1
        self.bar.update(1)
        # the next step's rate is set now: under DeepSpeed its update runs inside the next boundary's backward
        set_lr(optimizer, warmup_cosine(self.step, self.total_steps, self.warmup, tc.lr, tc.min_lr_ratio))

    def due(self, has_eval: bool) -> tuple[bool, bool]:
        """(log now, evaluate now) after the step just taken."""
        tc, s = self.tc, self.step
        do_eval = has_eval and (s == self.total_steps or bool(tc.eval_every and s % tc.eval_every == 0))
        return s % tc.log_every == 0 or s == self.total_steps or do_eval, do_eval

    def metrics(self) -> dict:
        """The log line's training numbers since the last line (collective: every rank calls it at the same step)."""
        total = self.accelerator.reduce(self.stats, "sum")
        k, world = self.k, self.accelerator.num_processes
        out = {
            "step": self.step,
            "loss": float(total[0] / total[2]),
            "acc": [round(a, 4) for a in (total[3 : 3 + k] / total[3 + k : 3 + 2 * k].clamp(min=1)).tolist()],
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "tokens_per_s": round(self.tokens * world / (time.time() - self.t_loop), 1),
        }
        if self.second_loss:
            out[self.second_loss] = float(total[1] / total[2])
        if self.position_loss:
            out[self.position_loss] = [round(x, 4) for x in (total[3 + 2 * k :] / total[2]).tolist()]
        self.stats.zero_()
        return out

    def save_due(self) -> bool:
        return bool(self.tc.save_every and self.step % self.tc.save_every == 0 and self.step < self.total_steps)

    def snapshot_due(self) -> bool:
        return self.step in self.tc.snapshot_steps

    def close(self) -> float:
        """Seconds spent in the loop."""
        self.bar.close()
        return time.time() - self.t_loop
