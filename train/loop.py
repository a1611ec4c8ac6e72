"""What every drafter recipe does between parsing its config and its own loop: load the target and the data (a
`TargetAndData`), choose the feature source, and start training (accelerate's wrapping, the step schedule, resuming,
the run's log line, the tracker, the sharding check), which returns the run's `TrainingPlan`; a loop ends with a
`LoopResult`, which `train.finish` saves and reports.

The pieces it is made of sit beside it, one concern each: `train.config` (the ``train`` block), `train.distributed`
(the accelerator, DeepSpeed / FSDP, sharded state), `train.schedule` (steps, epoch sharding, held-out batches),
`train.progress` (metrics log, `Progress`), `train.report_mode` (``python train/<method>.py report``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from models.config import save_config, to_dict
from models.target import TargetModel
from models.tokenizer import load_tokenizer
from train.checkpoint import load_training_state
from train.config import TrainConfig
from train.data.dataset import build_dataset, collate
from train.distributed import fill_deepspeed_config, optimizer_numel
from train.features import FeatureCache, cache_is_valid, cache_key, collate_features, write_feature_cache
from train.optim import set_lr, warmup_cosine
from train.progress import record, scalars
from train.schedule import check_sharding, schedule

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase


@dataclass
class TargetAndData:
    """What `load_target_and_data` loads for a recipe."""

    tokenizer: PreTrainedTokenizerBase
    pad_id: int
    """The tokenizer's pad id (0 when it has none)."""
    target: TargetModel
    full_set: datasets.Dataset
    """The whole training split, before ``train.max_train_samples`` (self-distillation's prompt pool)."""
    train_set: datasets.Dataset
    """The samples the run trains on."""
    eval_set: datasets.Dataset | None
    """Held-out samples (None: the recipe has no ``eval_data``)."""


@dataclass
class TrainingPlan:
    """What a recipe's loop runs to, as `start_training` leaves it."""

    model: torch.nn.Module
    """The trained module, wrapped by accelerate (DDP, DeepSpeed or FSDP); ``accelerator.unwrap_model`` gives the
    drafter back."""
    optimizer: torch.optim.Optimizer
    """Its optimizer, wrapped by accelerate, at the learning rate of ``start_step``."""
    per_epoch: int
    """Micro-batches per epoch per rank (the epoch's remainder is dropped on every rank alike)."""
    total_steps: int
    """Optimizer steps of the whole run."""
    warmup: int
    """Optimizer steps of linear warm-up."""
    start_step: int
    """Optimizer step to start from: 0, or the step of the resumed state."""


@dataclass
class LoopResult:
    """Where a recipe's loop ended."""

    steps: int
    """Optimizer steps done, a resumed run's earlier ones included."""
    train_seconds: float
    """Seconds this run spent in its loop."""
    last_eval: dict = field(default_factory=dict)
    """The last held-out evaluation (empty: none ran, or the loop keeps none)."""


def feature_source(
    accelerator: Accelerator, tc: TrainConfig, target: TargetModel, train_set, pad_id: int, log
) -> tuple[object, Callable]:
    """(samples, collate function): the tokenized set (online: a target forward per batch) or the offline cache,
    written first when missing or stale (its key covers target, data and dtype)."""
    if tc.features != "offline":
        return train_set, collate
    cache_dir = Path(tc.features_dir or Path(tc.output_dir) / "features")
    key = cache_key(target, train_set._fingerprint, tc.feature_dtype, len(train_set))
    if not cache_is_valid(cache_dir, key):
        write_feature_cache(accelerator, target, train_set, cache_dir, key, tc.feature_dtype, pad_id=pad_id, log=log)
    log(f"features: offline cache {cache_dir} ({len(train_set)} samples)")
    return FeatureCache(cache_dir), collate_features


def load_target_and_data(
    cfg, accelerator: Accelerator, log, prepare: Callable[[object], None] | None = None
) -> TargetAndData:
    """Tokenizer, target and data of a recipe with ``target``, ``data``, ``eval_data`` and ``train`` sections;
    ``prepare(tokenizer)`` runs first on the main process (e.g. writing a corpus the data paths point into). Also
    writes <output_dir>/recipe.yaml."""
    tc = cfg.train
    tokenizer = load_tokenizer(cfg.target.name_or_path, cfg.target.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with accelerator.main_process_first():
        if prepare is not None and accelerator.is_main_process:
            prepare(tokenizer)
        full, summary = build_dataset(cfg.data, tokenizer)
        eval_set = build_dataset(cfg.eval_data, tokenizer)[0] if cfg.eval_data is not None else None
    if summary["kept"] == 0:  # before the target loads: nothing here can train
        reasons = {k: v for k, v in summary["skipped"].items() if v}
        raise SystemExit(
            f"{cfg.data.path}: none of its {summary['rows']} rows gives a training sample (skipped: {reasons}); a chat "
            "dataset needs assistant turns with content, raw text needs text, and data.max_length must leave a loss token"
        )
    target = TargetModel.from_config(cfg.target, workload="train")  # its forward feeds a training step
    log(target.precision.line())
    train_set = full
    # a seeded random subset: a corpus in file order has a few sources at its head
    if tc.max_train_samples is not None:
        train_set = full.shuffle(seed=tc.seed).select(range(min(tc.max_train_samples, len(full))))
    log(
        f"data: {summary['kept']} samples kept of {summary['rows']} ({summary['loss_tokens']:,} loss tokens), "
        f"skipped { ({k: v for k, v in summary['skipped'].items() if v}) }"
        + (f", {summary['loop_tokens_dropped']:,} loop tokens dropped" if summary["loop_tokens_dropped"] else "")
        + f"; training on {len(train_set)}"
    )
    if accelerator.is_main_process:
        Path(tc.output_dir).mkdir(parents=True, exist_ok=True)
        save_config(cfg, Path(tc.output_dir) / "recipe.yaml")
    return TargetAndData(tokenizer, pad_id, target, full, train_set, eval_set)


def start_training(
    accelerator: Accelerator,
    cfg,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    num_samples: int,
    log,
    name: str,
    detail: str = "",
    before: dict | None = None,
    lengths: torch.Tensor | None = None,
) -> TrainingPlan:
    """What every recipe does between building its optimizer and its loop: accelerate's wrapping, the step
    schedule, resuming from the latest state, the run's log line, the tracker (``train.log_with``), the sharding
    check (every rank's first-epoch samples, disjoint across ranks) and, for a joint target, its quality before
    training."""
    tc, world = cfg.train, accelerator.num_processes
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        fill_deepspeed_config(accelerator, tc)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model, optimizer = accelerator.prepare(model, optimizer)
    per_epoch, total_steps, warmup = schedule(tc, num_samples, world)
    step = (load_training_state(accelerator, tc.output_dir) or {"step": 0})["step"]
    set_lr(optimizer, warmup_cosine(step, total_steps, warmup, tc.lr, tc.min_lr_ratio))
    log(
        f"train: {total_steps} optimizer steps ({per_epoch} micro-batches/epoch/rank, batch {tc.batch_size} x "
        f"{tc.grad_accum} accum x {world} ranks), warm-up {warmup}{detail}"
        + (f"; resumed at step {step}" if step else "")
    )
    if accelerator.is_main_process and tc.log_with:
        accelerator.init_trackers(name, config=scalars(to_dict(cfg)), init_kwargs={"wandb": {"dir": tc.output_dir}})
    sharding = check_sharding(accelerator, tc, num_samples, per_epoch, lengths)
    sharding.update(optimizer_numel(accelerator, optimizer, trainable))
    record(accelerator, tc, {"sharding": sharding}, log)
    if before:
        record(accelerator, tc, {"step": 0, **{f"before/{k.split('/')[1]}": v for k, v in before.items()}}, log)
    return TrainingPlan(model, optimizer, per_epoch, total_steps, warmup, step)
