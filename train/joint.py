"""A target that trains with its drafter (Medusa-2, MTP joint mode): the unchanged original it is compared with, the
LM loss that keeps it close to that original, the held-out quality guard, and saving its changes beside the drafter.

With LoRA the original costs nothing: the adapter is switched off. Full fine-tuning keeps a frozen copy (one more
target in memory; `drafters estimate` counts it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType

from models.checkpoint import TARGET_DIR
from models.loader import load_target
from models.target import TargetModel
from train.features import target_forward
from train.loop import TrainConfig, eval_batches
from train.losses import medusa_head_targets
from train.optim import adamw

LM_LOSSES = ("ce", "kl")


def trained_modules(
    accelerator: Accelerator,
    target: TargetModel,
    drafter: torch.nn.Module,
    wrap: Callable[[TargetModel, torch.nn.Module], torch.nn.Module] | None,
    tc: TrainConfig,
    drafter_lr_multiplier: float,
    eval_set,
    pad_id: int,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, TargetModel | None, dict]:
    """(the module to train, its AdamW, the original target, the quality guard before training). Frozen target
    (``wrap`` None): the drafter alone. Joint: ``wrap(target, drafter)``, one module for one optimizer and one
    distributed wrapper, the drafter at ``drafter_lr_multiplier`` times the target's rate."""
    if wrap is None:
        return drafter, adamw(drafter, tc.lr, tc.weight_decay), None, {}
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        # the warm-up drops the target's gradients between backward and the update, which DeepSpeed fuses
        raise SystemExit(
            f"joint training (target.mode=joint) runs under DDP only, not {accelerator.distributed_type}: launch with "
            "recipes/accelerate/ddp_8gpu.yaml (or cpu_2proc.yaml); DeepSpeed and FSDP train frozen-target drafters"
        )
    original = original_of(target)
    before = quality(accelerator, target, original, eval_set, tc, pad_id) if eval_set is not None else {}
    model = wrap(target, drafter)
    optimizer = adamw(model, tc.lr, tc.weight_decay, lr_scales={drafter: drafter_lr_multiplier})
    return model, optimizer, original, before


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
        positions, labels = medusa_head_targets(batch["input_ids"], batch["loss_mask"], -1)  # token t+1
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
