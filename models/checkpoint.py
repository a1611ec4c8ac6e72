"""The ``drafters`` block of every drafter checkpoint, and the one loader that reads any of them (DESIGN.md §3).

A checkpoint folder holds ``config.json`` (the method's own shape config plus a ``drafters`` block) and
``model.safetensors``. The block says which method wrote it and what target it was trained against; it is checked
against the target before any weight is read, so a drafter never runs on a target it does not fit.

The block's ``method`` names the drafter family that wrote it: each drafter class declares its own (``method``, e.g.
``models.eagle3.Eagle3Drafter.method``) and writes it at save time. This module accepts any method name; which ones
are known is the business of the family declarations (infer/families.py), and `infer.families.load_drafter` refuses an
unknown one, naming the known ones, when the checkpoint is loaded.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from models.config import from_dict
from models.target import AUX_LAYER_CONVENTION, TargetModel
from models.tokenizer import tokenizer_fingerprint

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TARGET_DIR = "target"
"""Sub-folder of a jointly trained drafter's checkpoint holding the target's changed weights (adapter or full)."""


@dataclass
class TargetInfo:
    """The ``drafters`` block of config.json: which method, and what target the drafter was trained against."""

    target_name: str
    """name_or_path of the target at training time (informational: paths move)."""
    target_vocab_size: int
    """Logit width of the target; checked on load."""
    target_hidden_size: int
    """Hidden size of the target; checked on load."""
    target_num_layers: int
    """Decoder layers of the target; checked on load (aux ids index them)."""
    tokenizer_fingerprint: str | None
    """`models.tokenizer.tokenizer_fingerprint` of the target's tokenizer; checked when a tokenizer is given."""
    method: str
    """Which drafter family wrote the checkpoint (its drafter class's ``method``). No default: every block this code
    ever wrote carries it, and a guess would load the wrong class."""
    aux_layer_ids: list[int] = field(default_factory=list)
    """Feature taps the drafter reads, in the convention below (empty for drafters that read none, e.g. those of the
    final hidden state); checked on load."""
    aux_layer_convention: str = AUX_LAYER_CONVENTION
    """How to read aux_layer_ids ("output_of_layer_0based": HF output_hidden_states[k + 1])."""
    target_architectures: list[str] = field(default_factory=list)
    """HF architectures of the target (informational; exports name the verifier with them)."""
    target_weights: str | None = None
    """Joint training changed the target: "lora" (a peft adapter in ``<checkpoint>/target``) or "full" (the whole
    target there). None: the drafter runs on the unchanged target. `models.loader.load_target` applies it."""
    heldout_acceptance: list[float] = field(default_factory=list)
    """Per-depth held-out acceptance (teacher-forced top-1 agreement) at the last evaluation before save; the
    report's chain sizing shrinks its pilot toward it (eval.cost_curve.size_chain). Empty: not measured."""
    heldout_samples: int = 0
    """Held-out samples that acceptance was measured on (the weight it gets in sizing)."""
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not self.method:
            raise ValueError("method must name the drafter family that wrote the checkpoint")
        if self.version > FORMAT_VERSION:
            raise ValueError(f"checkpoint format version {self.version} is newer than this code ({FORMAT_VERSION})")
        if self.target_weights not in (None, "lora", "full"):
            raise ValueError(f"target_weights must be null, 'lora' or 'full', got {self.target_weights!r}")
        if self.aux_layer_convention != AUX_LAYER_CONVENTION:
            raise ValueError(
                f"aux_layer_convention {self.aux_layer_convention!r} is not {AUX_LAYER_CONVENTION!r}; convert the ids "
                "with models.target.from_before_layer_ids"
            )

    @classmethod
    def of(
        cls, target: TargetModel, tokenizer=None, *, method: str, aux_layer_ids: list[int] | None = None
    ) -> TargetInfo:
        """The block for a drafter of family ``method`` trained on ``target``; ``aux_layer_ids``: the taps it reads
        (drafters that read aux-layer features pass ``target.aux_layer_ids``; None: it reads none)."""
        return cls(
            target_name=str(target.name_or_path),
            target_vocab_size=target.vocab_size,
            target_hidden_size=target.hidden_size,
            target_num_layers=target.num_layers,
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
            method=method,
            aux_layer_ids=list(aux_layer_ids or []),
            target_architectures=list(target.config.architectures or [type(target.hf_model).__name__]),
        )

    def check(self, target: TargetModel, tokenizer=None) -> None:
        """Raise ValueError naming every mismatch between this block and ``target`` (and its tokenizer)."""
        problems = []
        for name, want, got in (
            ("vocab size", self.target_vocab_size, target.vocab_size),
            ("hidden size", self.target_hidden_size, target.hidden_size),
            ("decoder layers", self.target_num_layers, target.num_layers),
        ):
            if want != got:
                problems.append(f"{name}: drafter trained for {want}, target has {got}")
        if self.aux_layer_ids and list(self.aux_layer_ids) != target.aux_layer_ids:
            problems.append(
                f"aux layers: drafter reads {self.aux_layer_ids} ({self.aux_layer_convention}), the target captures "
                f"{target.aux_layer_ids}; build TargetModel(..., aux_layer_ids={self.aux_layer_ids})"
            )
        if tokenizer is not None and self.tokenizer_fingerprint is not None:
            got_fp = tokenizer_fingerprint(tokenizer)
            if got_fp != self.tokenizer_fingerprint:
                problems.append(f"tokenizer fingerprint: drafter {self.tokenizer_fingerprint}, target {got_fp}")
        if problems:
            raise ValueError(f"drafter does not match target {target.name_or_path!r}: " + "; ".join(problems))


def read_checkpoint(path: str | Path) -> tuple[dict, TargetInfo]:
    """(the method's own config keys, the ``drafters`` block) of a checkpoint folder; no weights are read."""
    config_path = Path(path) / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist: not a drafter checkpoint folder")
    raw = json.loads(config_path.read_text())
    block = raw.pop("drafters", None)
    if block is None:
        raise ValueError(f"{config_path} has no 'drafters' block: not a drafters checkpoint")
    if "method" not in block:
        raise ValueError(
            f"{config_path}: its 'drafters' block names no method (every checkpoint drafters writes has one); add "
            '"method": the family that wrote it (infer.families.FAMILIES lists the known ones)'
        )
    raw.pop("architectures", None)
    return raw, from_dict(TargetInfo, block)


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint folder's model.safetensors (safetensors only: nothing in it can run code), with an
    error naming the file when it is missing or does not parse (truncated by a full disk or an interrupted copy)."""
    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: the checkpoint folder has a config but no weights")
    try:
        return load_file(str(file))
    except SafetensorError as e:
        raise ValueError(
            f"{file} ({file.stat().st_size:,} bytes) does not read as safetensors ({e}): truncated or not a "
            "safetensors file; copy or save it again"
        ) from e


def write_checkpoint(
    path: str | Path, architecture: str, config: dict, info: TargetInfo, tensors: dict[str, torch.Tensor]
) -> None:
    """config.json (``config`` + the block) and model.safetensors; the weights are written first and the config last,
    so a folder with a config is complete."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(weights, str(out / WEIGHTS_NAME), metadata={"format": "pt", "drafters_method": info.method})
    full = {"architectures": [architecture], **config, "drafters": dataclasses.asdict(info)}
    (out / CONFIG_NAME).write_text(json.dumps(full, indent=2) + "\n")
