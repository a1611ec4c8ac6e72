"""Training-loop pieces every drafter recipe shares (EAGLE-3, Medusa): the ``train`` config block, the accelerator
and its log, explicit epoch sharding, the step schedule, the feature source, and the metrics log.

Data sharding is explicit: every epoch is one seeded permutation of the samples, cut into global batches of
world × batch_size; rank r takes its slice of each, so resuming at micro-batch m replays nothing and skips nothing.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs
from tqdm.auto import tqdm

from eval.report import report_main
from models.checkpoint import TargetInfo
from models.config import save_config, to_dict
from models.target import TargetConfig, TargetModel, load_tokenizer
from train.checkpoint import load_training_state
from train.data import build_dataset, collate
from train.features import (
    FEATURE_DTYPES,
    FeatureCache,
    cache_is_valid,
    cache_key,
    collate_features,
    write_feature_cache,
)
from train.optim import mixed_precision, set_lr, warmup_cosine

TRACKERS = ("tensorboard", "wandb")


@dataclass
class TrainConfig:
    output_dir: str
    """Checkpoint, exports, logs, resumable state and report go here."""
    features: str = "online"
    """"online": a target forward per batch; "offline": features cached to disk once, then read every epoch."""
    features_dir: str | None = None
    """Offline cache directory (default <output_dir>/features); any recipe on the same target and data may share one."""
    feature_dtype: str = "bfloat16"
    """Dtype of cached features ("bfloat16", "float16", "float32")."""
    epochs: float = 10.0
    """Passes over the training samples (SpecForge 10; fractions allowed)."""
    max_steps: int | None = None
    """Cap on optimizer steps (None: epochs decide)."""
    max_train_samples: int | None = None
    """Train on a seeded random subset of N samples (None: all)."""
    batch_size: int = 1
    """Samples per rank per micro-batch (SpecForge 1)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    lr: float = 1e-4
    """Peak learning rate (SpecForge 1e-4)."""
    warmup_ratio: float = 0.015
    """Share of steps of linear warm-up (SpecForge 1.5 %)."""
    min_lr_ratio: float = 0.0
    """Cosine decays to min_lr_ratio · lr."""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (SpecForge 0)."""
    grad_clip: float = 0.5
    """Max gradient norm (SpecForge 0.5)."""
    mixed_precision: str = "auto"
    """"auto" (bf16 on CUDA / bf16-capable CPUs, else fp32), "bf16" or "fp32"."""
    group_by_length: bool = False
    """Batches of samples of similar length (sorted within groups of 50 global batches of the epoch's random order,
    then the batches shuffled): far less padding (a SmolLM2 chat batch of 4 was 44 % padding), the same samples per
    epoch."""
    seed: int = 0
    log_every: int = 10
    """Optimizer steps between log lines (loss and top-1 accuracy per step / head)."""
    eval_every: int = 0
    """Optimizer steps between held-out evaluations (simulated τ); 0 = only at the end."""
    eval_samples: int = 64
    """Held-out samples per evaluation."""
    save_every: int = 0
    """Optimizer steps between resumable states; 0 = only at the end."""
    snapshot_steps: list[int] = field(default_factory=list)
    """Optimizer steps after which a servable drafter checkpoint is written to ``<output_dir>/snapshots/step-N/``
    (a data-scaling curve from one run: each snapshot has read a prefix of the same shuffled data)."""
    keep_states: int = 2
    """Resumable states kept on disk: the latest and keep_states - 1 earlier ones (``state.{step}``), so a state
    damaged after its save still leaves one to resume from."""
    log_with: str | None = None
    """Also log to a tracker: "tensorboard" (<output_dir>/<method>/) or "wandb" (<output_dir>/wandb/; offline with
    WANDB_MODE=offline, then `wandb sync`). None: stdout + <output_dir>/train_log.jsonl only (always written)."""
    export: bool = True
    """Also write the serving engines' formats next to the checkpoint."""

    def __post_init__(self) -> None:
        if self.features not in ("online", "offline"):
            raise ValueError(f"features must be 'online' or 'offline', got {self.features!r}")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ValueError(f"feature_dtype must be one of {list(FEATURE_DTYPES)}")
        if self.mixed_precision not in ("auto", "bf16", "fp32"):
            raise ValueError("mixed_precision must be 'auto', 'bf16' or 'fp32'")
        if self.epochs <= 0 or self.batch_size < 1 or self.grad_accum < 1 or self.lr <= 0:
            raise ValueError("need epochs > 0, batch_size >= 1, grad_accum >= 1, lr > 0")
        if not 0 <= self.warmup_ratio < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("warmup_ratio must be in [0, 1) and min_lr_ratio in [0, 1]")
        if self.keep_states < 1:
            raise ValueError("keep_states must be >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("max_steps must be >= 1 or None")
        if self.log_with is not None:
            if self.log_with not in TRACKERS:
                raise ValueError(f"log_with must be one of {list(TRACKERS)} or null, got {self.log_with!r}")
            if importlib.util.find_spec(self.log_with) is None:  # accelerate would drop it with a warning
                raise ValueError(
                    f"log_with={self.log_with!r}: the {self.log_with} package is not installed "
                    f"(pip install 'drafters[{self.log_with}]')"
                )


def _engine_requested() -> str | None:
    """ "deepspeed" / "fsdp" when ``accelerate launch`` was given such a config (it says so in the environment)."""
    for name in ("DEEPSPEED", "FSDP"):
        if os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true":
            return name.lower()
    return None


def make_accelerator(
    tc: TrainConfig, find_unused: bool = False, target: TargetConfig | None = None
) -> tuple[Accelerator, Callable[[str], None]]:
    """The run's Accelerator and a ``log`` that prints on the main process only. ``find_unused``: some trainable
    parameters get no gradient in some steps (Medusa-2's heads warm-up), which DDP must be told.

    Gradient accumulation is accelerate's (``accumulate``): it skips DDP's all-reduce between boundaries and tells
    DeepSpeed where they are, which runs the update inside ``backward``.

    CPU ranks under DeepSpeed / FSDP (DESIGN.md §7): accelerate's ``cpu=True`` turns both engines off, and without
    it accelerate finds no device and reports one process. So without CUDA an engine run asks for the gloo backend
    explicitly, which gives the real world size; FSDP, which accelerate enables for accelerator devices only, is
    then switched on here for the CPU ranks (``_fsdp_on_cpu``)."""
    engine, no_cuda = _engine_requested(), not torch.cuda.is_available()
    autocast, precision = mixed_precision(tc.mixed_precision, target)
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)] if find_unused else []
    if engine and no_cuda:
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    accelerator = Accelerator(
        cpu=no_cuda and engine is None,
        mixed_precision=autocast,
        gradient_accumulation_steps=tc.grad_accum,
        log_with=tc.log_with,
        project_dir=tc.output_dir,
        kwargs_handlers=handlers or None,
    )
    if engine == "fsdp" and accelerator.distributed_type == DistributedType.NO and accelerator.num_processes > 1:
        _fsdp_on_cpu(accelerator)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # accelerate registers its DeepSpeed config with transformers, and under ZeRO-3 from_pretrained would then
        # partition the frozen target as it loads; only the trained drafter goes to the engine
        from transformers.integrations import unset_hf_deepspeed_config

        accelerator.state.deepspeed_plugin.dschf = None
        unset_hf_deepspeed_config()

    def log(msg: str) -> None:
        if accelerator.is_main_process:
            print(msg, flush=True)

    log(
        f"world {accelerator.num_processes} ({accelerator.distributed_type}), precision {accelerator.mixed_precision}, "
        f"device {accelerator.device}, threads/rank {torch.get_num_threads()}"
    )
    log(precision.line())
    return accelerator, log


def _fsdp_on_cpu(accelerator: Accelerator) -> None:
    """FSDP for CPU ranks: accelerate has the process group (gloo, real world size) and the launcher's FSDP settings
    in the environment, but enables FSDP only for GPU-like device types; the plugin it would build is set here."""
    from accelerate.state import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def sharded(accelerator: Accelerator) -> bool:
    """True when the engine splits the trained weights across ranks (ZeRO-3, FSDP): the module in hand is then not
    the whole drafter, and saving it needs ``full_state`` first."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.state.deepspeed_plugin.zero_stage == 3
    return False


def full_state(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Collective (every rank calls it): the whole state dict of a sharded ``model`` on the main process (None on the
    others, and None when nothing is sharded: the module in hand is then complete)."""
    if not sharded(accelerator):
        return None
    state = accelerator.get_state_dict(model)
    return {k: v.detach().cpu().clone() for k, v in state.items()} if accelerator.is_main_process else None


@functools.lru_cache(maxsize=2)
def _epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    # one permutation per epoch, not per micro-batch: O(N) each, and the 8B recipes' N is ~1e6 (read-only result)
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


GROUP_MEGABATCH = 50
"""Global batches per length group of `group_by_length` (HF's LengthGroupedSampler uses 50 too)."""
_GROUPED: dict[tuple, torch.Tensor] = {}


def _grouped_order(lengths: torch.Tensor, seed: int, epoch: int, group: int) -> torch.Tensor:
    """The epoch's random order, sorted by length (longest first) within chunks of GROUP_MEGABATCH global batches,
    cut into global batches of ``group``, whose order is shuffled (seeded; the short last batch stays last, where
    the epoch's remainder is dropped). Every rank computes the same order, so their slices stay disjoint."""
    key = (lengths.data_ptr(), lengths.numel(), seed, epoch, group)
    if key not in _GROUPED:
        perm = _epoch_order(lengths.numel(), seed, epoch)
        chunks = [c[lengths[c].argsort(descending=True, stable=True)] for c in perm.split(group * GROUP_MEGABATCH)]
        batches = list(torch.cat(chunks).split(group))
        full = [b for b in batches if len(b) == group]
        shuffle = torch.randperm(len(full), generator=torch.Generator().manual_seed(seed * 100_019 + epoch))
        _GROUPED.clear()
        _GROUPED[key] = torch.cat([full[i] for i in shuffle.tolist()] + batches[len(full) :])
    return _GROUPED[key]


def sample_lengths(train_set) -> torch.Tensor:
    """Tokens per sample of a tokenized dataset (`group_by_length`)."""
    return torch.tensor([len(ids) for ids in train_set["input_ids"]])


def epoch_batch(
    num_samples: int,
    micro: int,
    per_epoch: int,
    seed: int,
    rank: int,
    world: int,
    bs: int,
    lengths: torch.Tensor | None = None,
) -> list[int]:
    """Sample indices of this rank's micro-batch number ``micro`` (global batches of world·bs, seeded per epoch);
    with ``lengths`` (`TrainConfig.group_by_length`), batches of similar length."""
    epoch, g = divmod(micro, per_epoch)
    start = g * world * bs + rank * bs
    if lengths is None:
        order = _epoch_order(num_samples, seed, epoch)
    else:
        order = _grouped_order(lengths, seed, epoch, world * bs)
    return order[start : start + bs].tolist()


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def schedule(tc: TrainConfig, num_samples: int, world: int) -> tuple[int, int, int]:
    """(micro-batches per epoch per rank, optimizer steps, warm-up steps); the remainder of an epoch is dropped on
    every rank alike."""
    per_epoch = num_samples // (world * tc.batch_size)
    if per_epoch == 0:
        raise SystemExit(f"{num_samples} samples are fewer than one global batch ({world} x {tc.batch_size})")
    total_steps = int(tc.epochs * per_epoch) // tc.grad_accum
    total_steps = min(total_steps, tc.max_steps or total_steps)
    warmup = max(1, round(tc.warmup_ratio * total_steps)) if tc.warmup_ratio else 0
    return per_epoch, total_steps, warmup


def check_sharding(
    accelerator: Accelerator, tc: TrainConfig, num_samples: int, per_epoch: int, lengths: torch.Tensor | None = None
) -> dict:
    """Every rank's first-epoch samples, gathered: raises if two ranks would train on the same sample."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = torch.tensor(
        [
            i
            for m in range(per_epoch)
            for i in epoch_batch(num_samples, m, per_epoch, tc.seed, rank, world, tc.batch_size, lengths)
        ]
    )
    every = accelerator.gather(mine.to(accelerator.device)).cpu()
    sharding = {
        "world": world,
        "distributed_type": str(accelerator.distributed_type),
        "samples_per_rank": len(mine),
        "distinct_over_ranks": int(every.unique().numel()),
        "total_over_ranks": int(every.numel()),
    }
    if sharding["distinct_over_ranks"] != sharding["total_over_ranks"]:
        raise RuntimeError(f"ranks would train on overlapping samples: {sharding}")
    return sharding


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
        accelerator.log(_scalars(metrics), step=metrics["step"])


def _scalars(tree: dict, prefix: str = "") -> dict:
    """A tracker's view of a metrics line or a config: nested dicts and lists flattened to "a/b" / "acc/0" keys;
    numbers kept, other leaves as text (tensorboard's hyper-parameters take numbers, text and booleans only)."""
    flat = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            flat.update(_scalars(value, f"{key}/"))
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
            flat.update({f"{key}/{i}": v for i, v in enumerate(value)})
        elif isinstance(value, (bool, int, float, str)):
            flat[key] = value
        else:
            flat[key] = str(value)
    return flat


def load_target_and_data(cfg, accelerator: Accelerator, log, prepare: Callable[[object], None] | None = None):
    """(tokenizer, pad id, target, the whole training split, the training subset, held-out set) of a recipe with
    ``target``, ``data``, ``eval_data`` and ``train`` sections; ``prepare(tokenizer)`` runs first on the main
    process (e.g. writing a corpus the data paths point into). Also writes <output_dir>/recipe.yaml."""
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
        f"skipped { ({k: v for k, v in summary['skipped'].items() if v}) }; training on {len(train_set)}"
    )
    if accelerator.is_main_process:
        Path(tc.output_dir).mkdir(parents=True, exist_ok=True)
        save_config(cfg, Path(tc.output_dir) / "recipe.yaml")
    return tokenizer, pad_id, target, full, train_set, eval_set


def report_mode(argv: list[str], recipe_cls: type) -> None:
    """``python train/<method>.py report ...``: the shared report (`eval.report.report_main`, as ``drafters report``)
    with ``--config`` read as a recipe of ``recipe_cls``, and that recipe's eval_data samples built here for
    ``report.prompt_source=eval_data`` (data building is train/'s; eval/ is handed the samples)."""

    def eval_set(cfg, tokenizer) -> datasets.Dataset | None:
        return build_dataset(cfg.eval_data, tokenizer)[0] if cfg.eval_data is not None else None

    report_main(argv, recipe_cls, eval_set)


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
):
    """What every recipe does between building its optimizer and its loop: accelerate's wrapping, the step
    schedule, resuming from the latest state, the run's log line, the tracker (``train.log_with``), the sharding
    check (every rank's first-epoch samples, disjoint across ranks) and, for a joint target, its quality before
    training. Returns (model, optimizer, micro-batches per epoch, optimizer steps, warm-up steps, start step)."""
    tc, world = cfg.train, accelerator.num_processes
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        _fill_deepspeed_config(accelerator, tc)
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
        accelerator.init_trackers(name, config=_scalars(to_dict(cfg)), init_kwargs={"wandb": {"dir": tc.output_dir}})
    sharding = check_sharding(accelerator, tc, num_samples, per_epoch, lengths)
    sharding.update(_optimizer_numel(accelerator, optimizer, trainable))
    record(accelerator, tc, {"sharding": sharding}, log)
    if before:
        record(accelerator, tc, {"step": 0, **{f"before/{k.split('/')[1]}": v for k, v in before.items()}}, log)
    return model, optimizer, per_epoch, total_steps, warmup, step


def _fill_deepspeed_config(accelerator: Accelerator, tc: TrainConfig) -> None:
    """The recipe decides batch size, accumulation and clipping; a DeepSpeed JSON leaves them "auto" (the shipped
    ones do) or must agree. Without a dataloader in ``prepare`` accelerate cannot fill "auto" batch sizes itself."""
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    wanted = {
        "train_micro_batch_size_per_gpu": tc.batch_size,
        "gradient_accumulation_steps": tc.grad_accum,
        "train_batch_size": tc.batch_size * tc.grad_accum * accelerator.num_processes,
        "gradient_clipping": tc.grad_clip,
    }
    for key, value in wanted.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
        elif float(ds[key]) != value:
            raise SystemExit(
                f"the DeepSpeed config sets {key}={ds[key]} but the recipe gives {value} (train.batch_size, "
                'train.grad_accum, train.grad_clip and the world size): set it to "auto" or change the recipe'
            )


def _optimizer_numel(accelerator: Accelerator, optimizer: torch.optim.Optimizer, trainable: int) -> dict:
    """Parameter elements the optimizer updates on this rank, summed over ranks, beside the trainable count: DDP
    holds world × trainable, ZeRO / FSDP about trainable (partitions, plus padding), and a frozen target never
    appears (it would add its whole size)."""
    from torch.distributed.tensor import DTensor

    inner = optimizer.optimizer  # under accelerate's wrapper
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # ZeRO's flat fp32 partitions: ZeRO-1/2 keep them in its torch optimizer's groups, ZeRO-3 hands them to it
        # only during the step
        if accelerator.state.deepspeed_plugin.zero_stage == 3:
            params = inner.fp32_partitioned_groups_flat
        else:
            params = [p for group in inner.optimizer.param_groups for p in group["params"]]
    else:
        params = [p for group in inner.param_groups for p in group["params"]]
    # FSDP's parameters are DTensors, whose numel() is the global size
    mine = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    total = accelerator.reduce(torch.tensor([mine], device=accelerator.device), "sum")
    return {"trainable_numel": trainable, "optimizer_numel_over_ranks": int(total.item())}


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


def eval_batches(accelerator: Accelerator, tc: TrainConfig, eval_set, pad_id: int):
    """Collated batches of this rank's share of the first ``tc.eval_samples`` held-out samples (callers sum their
    counts and reduce them over ranks)."""
    n = min(len(eval_set), tc.eval_samples)
    mine = list(range(accelerator.process_index, n, accelerator.num_processes))
    for s in range(0, len(mine), tc.batch_size):
        yield to_device(collate([eval_set[i] for i in mine[s : s + tc.batch_size]], pad_id), accelerator.device)
