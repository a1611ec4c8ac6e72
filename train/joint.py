"""A target that trains with its drafter (Medusa-2, MTP joint mode): one config (`JointConfig`), one module of target
and drafter (`JointModel`), the unchanged original it is compared with, the LM loss that keeps it close to that
original, the held-out quality guard, and saving its changes beside the drafter. The loop that trains it is
`train.position_loop.train_positions`, shared by both families.

With LoRA the original costs nothing: the adapter is switched off. Full fine-tuning keeps a frozen copy (one more
target in memory; `drafters estimate` counts it).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType

from models.checkpoint import TARGET_DIR
from models.loader import load_target
from models.target import TargetModel, TargetOutput
from train.config import TrainConfig
from train.features import target_forward
from train.losses import position_targets
from train.optim import adamw
from train.schedule import eval_batches

LM_LOSSES = ("ce", "kl")
LAMBDA0_SCHEDULES = ("constant", "linear", "sine")


@dataclass
class JointConfig:
    """Joint training (read when target.mode is "joint"; full fine-tuning, or LoRA with target.lora_rank > 0):
    loss = L_LM + λ0 · L_drafter, the drafter trained alone for ``drafter_warmup_steps`` first. A family's recipe
    sets its own defaults: Medusa-2 (Cai et al. 2024 §2.3.2) λ0 0.2 and the heads at 4x the target's learning rate;
    MTP (DeepSeek-V3 §2.2) λ0 1 (its λ per depth is ``mtp.loss_weight``) at one rate."""

    lambda0: float = 1.0
    """Weight of the drafter's loss next to the LM loss."""
    lambda0_schedule: str = "constant"
    """Warm-up of λ0 after the drafter's warm-up: "constant", "linear" or "sine" over lambda0_warmup_steps."""
    lambda0_warmup_steps: int = 0
    drafter_warmup_steps: int = 0
    """Optimizer steps in which only the drafter trains (the target runs without gradients) before joint training."""
    drafter_lr_multiplier: float = 1.0
    """The drafter's learning rate relative to the target's."""
    lm_loss: str = "ce"
    """"ce": cross-entropy on the data's tokens; "kl": KL(original target ‖ trained target) on the next-token
    distribution (self-distillation: the trained target is pulled towards its own original outputs)."""

    def __post_init__(self) -> None:
        if self.lambda0_schedule not in LAMBDA0_SCHEDULES:
            raise ValueError(f"lambda0_schedule must be one of {LAMBDA0_SCHEDULES}, got {self.lambda0_schedule!r}")
        if self.lm_loss not in LM_LOSSES:
            raise ValueError(f"lm_loss must be one of {LM_LOSSES}, got {self.lm_loss!r}")
        if self.lambda0 < 0 or self.lambda0_warmup_steps < 0 or self.drafter_warmup_steps < 0:
            raise ValueError("need lambda0 >= 0 and warm-up steps >= 0")
        if self.drafter_lr_multiplier <= 0:
            raise ValueError("drafter_lr_multiplier must be > 0")

    def lambda0_at(self, step: int) -> float:
        """λ0 at optimizer step ``step`` (0 during the drafter's warm-up, where the LM loss is off too)."""
        s = step - self.drafter_warmup_steps
        if s < 0:
            return 0.0
        ramp = 1.0 if self.lambda0_warmup_steps == 0 else min(1.0, (s + 1) / self.lambda0_warmup_steps)
        if self.lambda0_schedule == "linear":
            return self.lambda0 * ramp
        if self.lambda0_schedule == "sine":
            return self.lambda0 * math.sin(0.5 * math.pi * ramp)
        return self.lambda0


DrafterRun = Callable[[torch.nn.Module, TargetOutput, dict, list[torch.Tensor]], list[torch.Tensor]]
"""(drafter, the target's output on a batch, the batch, positions per head / depth [B, T] bool) → logits per head /
depth at those positions: how a family's drafter reads the target (Medusa: the final-norm hidden state)."""


class JointModel(torch.nn.Module):
    """Target + drafter as one module: one optimizer and one distributed wrapper see both."""

    def __init__(self, target: TargetModel, drafter: torch.nn.Module, run: DrafterRun) -> None:
        super().__init__()
        self.target, self.drafter, self.run = target, drafter, run

    def forward(self, batch: dict, positions: list[torch.Tensor], lm_positions: torch.Tensor, train_target: bool):
        """(LM logits at ``lm_positions`` [N, V], or None while the target is frozen; the drafter's logits at
        ``positions``); the target runs without a graph while ``train_target`` is off (the drafter's warm-up)."""
        with torch.set_grad_enabled(train_target and torch.is_grad_enabled()):
            out = target_forward(self.target, batch, logits=False)
        lm_logits = self.target.lm_head(out.last_hidden[lm_positions]) if train_target else None
        return lm_logits, self.run(self.drafter, out, batch, positions)


@dataclass
class JointRun:
    """The target's side of a joint run: its settings, the trained target, the unchanged one (None with LoRA), its
    quality before training (the guard's baseline) and what the guard measures on."""

    config: JointConfig
    target: TargetModel
    original: TargetModel | None
    before: dict
    eval_set: object
    pad_id: int


def joint_words(mode: str, target: TargetModel) -> str:
    """The training log's words for a target that trains with its drafter (empty when it stays frozen)."""
    if mode != "joint":
        return ""
    return f"; joint with the target ({'LoRA r' + str(target.lora_rank) if target.lora_rank else 'full'})"


def trained_modules(
    accelerator: Accelerator,
    target: TargetModel,
    drafter: torch.nn.Module,
    run: DrafterRun | None,
    tc: TrainConfig,
    jc: JointConfig,
    eval_set,
    pad_id: int,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, JointRun | None]:
    """(the module to train, its AdamW, the joint run's target side). Frozen target (``run`` None): the drafter
    alone, no joint run. Joint: `JointModel` of both, one module for one optimizer and one distributed wrapper,
    the drafter at ``jc.drafter_lr_multiplier`` times the target's rate."""
    if run is None:
        return drafter, adamw(drafter, tc.lr, tc.weight_decay), None
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        # the warm-up drops the target's gradients between backward and the update, which DeepSpeed fuses
        raise SystemExit(
            f"joint training (target.mode=joint) runs under DDP only, not {accelerator.distributed_type}: launch with "
            "recipes/accelerate/ddp_8gpu.yaml (or cpu_2proc.yaml); DeepSpeed and FSDP train frozen-target drafters"
        )
    original = original_of(target)
    before = quality(accelerator, target, original, eval_set, tc, pad_id) if eval_set is not None else {}
    model = JointModel(target, drafter, run)
    optimizer = adamw(model, tc.lr, tc.weight_decay, lr_scales={drafter: jc.drafter_lr_multiplier})
    return model, optimizer, JointRun(jc, target, original, before, eval_set, pad_id)


def original_of(target: TargetModel) -> TargetModel | None:
    """The unchanged target: a frozen copy for full fine-tuning; None with LoRA (`original_logits` switches the
    adapter off instead)."""
    return None if target.lora_rank else TargetModel(copy.deepcopy(target.hf_model), name_or_path=target.name_or_path)


@torch.no_grad()
def original_logits(target: TargetModel, original: TargetModel | None, batch: dict) -> torch.Tensor:
    """[B, T, V] logits of the original target on ``batch``."""
    if original is not None:
        return target_forward(original, batch).logits
    with target.model.disable_adapter():
        return target_forward(target, batch).logits


def lm_loss(
    kind: str,
    lm_logits: torch.Tensor,
    target: TargetModel,
    original: TargetModel | None,
    batch: dict,
    positions: torch.Tensor,
    labels: torch.Tensor,
) -> torch.Tensor:
    """The target's own loss in joint training. lm_logits [N, V] at ``positions`` [B, T] bool; labels [B, T] the
    next tokens. "ce": cross-entropy on the data; "kl": KL(original ‖ trained) per token (self-distillation: the
    served model is pulled towards its original answers rather than towards the data's)."""
    if kind == "ce":
        return F.cross_entropy(lm_logits.float(), labels[positions])
    want = original_logits(target, original, batch)[positions].float().log_softmax(-1)
    return F.kl_div(lm_logits.float().log_softmax(-1), want, log_target=True, reduction="batchmean")


@torch.no_grad()
def quality(
    accelerator: Accelerator, target: TargetModel, original: TargetModel | None, eval_set, tc: TrainConfig, pad_id: int
) -> dict:
    """Held-out LM loss of the (trained) target on the loss tokens, and its top-1 agreement with the original."""
    was_training = target.training
    target.eval()
    loss, agree, count = (torch.zeros((), device=accelerator.device) for _ in range(3))
    for batch in eval_batches(accelerator, tc, eval_set, pad_id):
        positions, labels = position_targets(batch["input_ids"], batch["loss_mask"], -1)  # token t+1
        logits = target_forward(target, batch).logits[positions].float()
        loss += F.cross_entropy(logits, labels[positions], reduction="sum")
        agree += (logits.argmax(-1) == original_logits(target, original, batch)[positions].argmax(-1)).sum()
        count += positions.sum()
    loss, agree, count = (accelerator.reduce(x, "sum") for x in (loss, agree, count))
    target.train(was_training)
    return {
        "eval/lm_loss": round(float(loss / count.clamp(min=1)), 4),
        "eval/agreement": round(float(agree / count.clamp(min=1)), 4),
    }


def save_target_changes(target: TargetModel, drafter, out: str | Path) -> None:
    """The adapter (LoRA) or the whole target (full) into ``<out>/target``, and the drafter's checkpoint block told
    so; call before the drafter's own save (a checkpoint whose config.json exists is complete)."""
    (target.model if target.lora_rank else target.hf_model).save_pretrained(Path(out) / TARGET_DIR)
    drafter.target_info.target_weights = "lora" if target.lora_rank else "full"


def served(out: str | Path, target_cfg, drafter_cls, tokenizer) -> tuple[TargetModel, torch.nn.Module]:
    """The jointly trained target as it will be served (from ``<out>/target``, an adapter merged) and the drafter
    reloaded against it: what the closing report measures."""
    target = load_target(out, target_cfg)
    return target, drafter_cls.from_pretrained(out, target, tokenizer)
