"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads").

K heads read the target's final-norm hidden state h_t (what its own lm_head reads) and each guesses one future
token at once, without a recursion::

    head k (0-based):  h_t ─ ResBlock × L ─ lm_head_k ─► logits for token t+2+k   (the target's head gives t+1)
    ResBlock(x) = x + SiLU(W x + b)

The blocks of a head are distinct modules (the reference code's ``[ResBlock(h)] * L`` repeats one module, so its
layers share weights; REFERENCE.md). W and b start at zero, so every head starts as exactly the target's head.
``lm_head_k`` is either a per-head copy of the target's head (trained; the paper's default) or the target's own
head, frozen and shared by all heads (``shared_head``; Medusa's "original_lm_head" / v2 heads). On a machine where
decoding streams the weights from memory, a shared head costs one pass over V×H for all K heads instead of K passes
(SmolLM2: 113 MB fp32 per pass), which decides whether Medusa can be faster than vanilla at all there.

Checkpoint: ``config.json`` = `MedusaConfig` fields + the ``drafters`` block (models/checkpoint.py, method
"medusa"), ``model.safetensors`` = ``blocks.{k}.{l}.linear.{weight,bias}`` and, unless shared,
``lm_heads.{k}.weight``. ``tree_paths`` (optional) is the static tree chosen from the heads' measured accuracies.
Exports to vLLM and to the original / TensorRT-LLM layout: models/medusa_export.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.checkpoint import TargetInfo, read_checkpoint, read_weights, write_checkpoint
from models.config import from_dict
from models.sizing import GB, DrafterSizes, RunSizes
from models.target import TargetModel

METHOD = "medusa"


@dataclass
class MedusaConfig:
    hidden_size: int
    """The target's hidden size (heads read its final-norm hidden state)."""
    vocab_size: int
    """The target's vocabulary (each head scores all of it)."""
    num_heads: int = 4
    """K: head k predicts token t+2+k (Medusa: 3–5)."""
    num_layers: int = 1
    """ResBlocks per head (Medusa: 1)."""
    shared_head: bool = False
    """True: every head projects through the target's own lm_head (frozen, not saved); False: per-head copies."""
    tree_paths: list[list[int]] = field(default_factory=list)
    """Static draft tree (rank paths, Medusa's "medusa_choices") chosen from held-out head accuracies; empty: none."""

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError("need num_heads >= 1 and num_layers >= 0")
        for path in self.tree_paths:
            if not path or len(path) > self.num_heads or min(path) < 0:
                raise ValueError(f"tree path {path} must be 1..{self.num_heads} ranks >= 0 (one per head)")


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)), weight and bias zero at start (the identity)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaDrafter(nn.Module):
    """K Medusa heads. ``from_target`` for fresh heads, ``from_pretrained`` to load a checkpoint."""

    method: ClassVar[str] = METHOD
    """The family name its checkpoints carry (infer/medusa_proposer.py declares the family)."""

    def __init__(self, cfg: MedusaConfig, target_info: TargetInfo | None = None) -> None:
        super().__init__()
        self.config, self.target_info = cfg, target_info
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers))) for _ in range(cfg.num_heads)
        )
        self.lm_heads = (
            None
            if cfg.shared_head
            else nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_heads))
        )
        self._target_head: list[nn.Module] = []  # the target's lm_head when shared (a list: not our parameter)

    # --- construction ----------------------------------------------------------------------------

    @classmethod
    def from_target(
        cls,
        target: TargetModel,
        num_heads: int = 4,
        num_layers: int = 1,
        shared_head: bool = False,
        tokenizer=None,
    ) -> MedusaDrafter:
        """Fresh heads for ``target``: zero ResBlocks; per-head lm_heads copied from the target's."""
        cfg = MedusaConfig(target.hidden_size, target.vocab_size, num_heads, num_layers, shared_head)
        drafter = cls(cfg, TargetInfo.of(target, tokenizer, method=cls.method))
        drafter.to(device=target.device, dtype=target.lm_head.weight.dtype)
        drafter.attach_target(target)
        if drafter.lm_heads is not None:
            with torch.no_grad():
                for head in drafter.lm_heads:
                    head.weight.copy_(target.lm_head.weight)
        return drafter

    def attach_target(self, target: TargetModel) -> None:
        """Point a shared head at ``target``'s lm_head (a jointly trained target's current head is then used)."""
        self._target_head = [target.lm_head]

    def save_pretrained(self, path: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """config.json (MedusaConfig + ``drafters`` block) and model.safetensors; bit-exact on reload.
        ``state``: the weights to write instead of this module's own, by the same names (a sharded engine's gathered
        copy: `train.distributed.full_state`).
        """
        if self.target_info is None:
            raise ValueError(
                "target_info is unset: build the heads with from_target so the checkpoint names its target"
            )
        own = self.state_dict()
        write_checkpoint(
            path,
            "MedusaDrafter",
            dataclasses.asdict(self.config),
            self.target_info,
            own if state is None else {k: state[k] for k in own},
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, target: TargetModel, tokenizer=None) -> MedusaDrafter:
        """Load a checkpoint for ``target``; refuses (ValueError) a mismatching target before reading weights."""
        raw, info = read_checkpoint(path)
        if info.method != METHOD:
            raise ValueError(f"{path}: not a {METHOD} checkpoint (method={info.method!r})")
        info.check(target, tokenizer)
        cfg = from_dict(MedusaConfig, raw)
        drafter = cls(cfg, info)
        drafter.load_state_dict(read_weights(path), strict=True)
        drafter.to(device=target.device, dtype=target.lm_head.weight.dtype)
        drafter.attach_target(target)
        return drafter

    # --- forward ---------------------------------------------------------------------------------

    def head_logits(self, k: int, last_hidden: torch.Tensor) -> torch.Tensor:
        """Head k on final-norm hidden states [.., H] → logits [.., V] for token t+2+k."""
        hidden = self.blocks[k](last_hidden)
        head = self.output_head(k)
        return head(hidden.to(head.weight.dtype))  # a shared head stays in the target's dtype beside fp32 blocks

    def output_head(self, k: int) -> nn.Module:
        """The lm_head of head k: its own copy, or the target's when shared."""
        if self.lm_heads is not None:
            return self.lm_heads[k]
        if not self._target_head:
            raise RuntimeError("shared-head Medusa needs attach_target(target) first")
        return self._target_head[0]

    def forward(self, per_head: list[torch.Tensor]) -> list[torch.Tensor]:
        """Training: head k on its own positions' hidden states ``per_head[k]`` [N_k, H] → logits [N_k, V] each
        (one call, so a distributed wrapper sees one forward per step)."""
        return [self.head_logits(k, h) for k, h in enumerate(per_head)]

    def predict(self, last_hidden: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """Inference: the first ``depth`` heads (default all) on hidden [.., H] → logits [depth, .., V]."""
        depth = self.config.num_heads if depth is None else depth
        hidden = torch.stack([self.blocks[k](last_hidden) for k in range(depth)])
        if self.lm_heads is None:  # one pass over the shared head's V×H weight for all heads, in the head's dtype
            head = self.output_head(0)
            return head(hidden.to(head.weight.dtype))
        return torch.stack([self.lm_heads[k](h) for k, h in enumerate(hidden)])


# --- sizing a training run (scripts/estimate.py) ---------------------------------------------------------------
def estimate_training(heads: dict, run: RunSizes) -> DrafterSizes:
    """The heads' share of a run from the recipe's ``heads`` section: K heads of R ResBlocks, each with its own
    lm_head unless shared (a frozen shared head still costs its forward and input gradient), on the answer tokens."""
    H, V = run.shape.H, run.shape.V
    K, R, shared = heads.get("num_heads", 4), heads.get("num_layers", 1), heads.get("shared_head", False)
    trainable = K * R * (H * H + H) + (0 if shared else K * V * H)
    head = (4 if shared else 6) * V * H * run.loss_share  # a frozen shared head: forward + input gradient
    flops = run.target_forward_flops + K * (6 * R * H * H + head)
    memory = {"logits (heads, fp32)": run.tokens * run.loss_share * K * V * 4 * 2 * GB}
    return DrafterSizes(trainable, flops, memory, H * run.feature_bytes)  # cache: the final hidden state
