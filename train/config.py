"""The ``train`` block every recipe shares: output folder, feature source, epochs and schedule, batch sizes, logging
cadence, resumable states and trackers, validated on construction."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from train.features import FEATURE_DTYPES

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
