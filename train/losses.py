"""Drafter training losses (EAGLE-3's TTT loss, the per-position CE of Medusa heads and MTP depths) and the
simulated τ of DESIGN.md §4 (pure functions; shapes in the docstrings)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TTTLoss:
    loss: torch.Tensor
    """Scalar: Σ_i weight^i · (masked mean soft cross-entropy of step i)."""
    step_loss: torch.Tensor
    """[steps] per TTT step masked mean loss (detached)."""
    step_correct: torch.Tensor
    """[steps] int64: positions where the draft argmax equals the target argmax (inside the mask)."""
    step_count: torch.Tensor
    """[steps] int64: positions in the mask.

    Tensors on the loss's device, not Python numbers: reading them would sync the device every TTT step of every
    training step; the training loop sums them on the device and reads them once per log line."""


def shift_left(x: torch.Tensor, n: int, fill: float | int | bool = 0) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]`` along dim 1, ``fill`` past the end (any trailing dims)."""
    T = x.shape[1]
    if n >= T:
        return torch.full_like(x, fill)
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], 1)


def eagle3_ttt_loss(
    draft_logits: list[torch.Tensor],
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    t2d: torch.Tensor,
    sample_ids: torch.Tensor | None = None,
    step_weight: float = 0.8,
) -> TTTLoss:
    """Soft cross-entropy of every TTT step against the target distribution on the draft vocabulary.

    draft_logits: one [B, T, Vd] per step; step i at position t predicts token t+2+i.
    target_logits [B, T, V]: the target's logits (position j predicts token j+1), so step i's label distribution
    is ``softmax(target_logits[:, t+1+i][t2d])``. loss_mask [B, T]: 1 where token t is a training target.
    sample_ids [B, T] (optional, packed rows): positions t and t+2+i must lie in the same sample.
    Mask of step i at t = loss_mask[t+2+i] · t2d[argmax target_logits[t+1+i]] (the target's choice is draftable)
    · same sample; weight of step i = step_weight ** i (EAGLE-3 / SpecForge: 0.8).
    """
    target_draft = target_logits[..., t2d].float()  # [B, T, Vd], draft ids ascend with target ids
    target_argmax = target_logits.argmax(-1)  # [B, T]
    draftable = t2d[target_argmax]  # [B, T]: the target's top token is in the draft vocabulary
    target_top_draft = target_draft.argmax(-1)  # its draft id, when draftable
    mask_tokens = loss_mask.bool()
    total = torch.zeros((), device=target_logits.device)
    step_loss, step_correct, step_count = [], [], []
    for i, logits in enumerate(draft_logits):
        labels = shift_left(target_draft, 1 + i).softmax(-1)
        mask = shift_left(mask_tokens, 2 + i, False) & shift_left(draftable, 1 + i, False)
        if sample_ids is not None:
            mask &= shift_left(sample_ids, 2 + i, -1) == sample_ids
        logp = F.log_softmax(logits.float(), dim=-1)
        per_token = -(labels * logp).sum(-1)
        count = mask.sum()
        loss_i = (per_token * mask).sum() / count.clamp(min=1)
        total = total + (step_weight**i) * loss_i
        correct = ((logits.argmax(-1) == shift_left(target_top_draft, 1 + i)) & mask).sum()
        step_loss.append(loss_i.detach())
        step_correct.append(correct)
        step_count.append(count)
    return TTTLoss(total, torch.stack(step_loss), torch.stack(step_correct), torch.stack(step_count))


def simulated_tau(alphas: list[float]) -> float:
    """DESIGN.md §4: τ ≈ 1 + Σ_k Π_{i≤k} α_i from per-step top-1 agreement α_i (teacher-forced, so an estimate)."""
    tau, run = 1.0, 1.0
    for a in alphas:
        run *= a
        tau += run
    return tau


def medusa_head_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, head: int, sample_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [B, T] bool, labels [B, T]) of Medusa head ``head`` (0-based): at position t it predicts token
    t+2+head, trained where that token is a loss token of the same sample (Cai et al. 2024, Medusa-1 loss)."""
    labels = shift_left(input_ids, 2 + head, 0)
    positions = shift_left(loss_mask.bool(), 2 + head, False)
    if sample_ids is not None:
        positions &= shift_left(sample_ids, 2 + head, -1) == sample_ids
    return positions, labels


def rank_hits(logits: torch.Tensor, labels: torch.Tensor, ranks: int) -> torch.Tensor:
    """logits [N, V], labels [N] → [ranks] int64: how often the label is the r-th most likely token (r < ranks)."""
    top = logits.topk(ranks, dim=-1).indices  # [N, ranks]
    return (top == labels[:, None]).sum(0)


def position_losses(
    logits: list[torch.Tensor], targets: list[tuple[torch.Tensor, torch.Tensor]], weights: list[float]
) -> dict[str, torch.Tensor]:
    """Σ_k weights[k] · CE_k over draft positions k (a Medusa head, an MTP depth): ``logits[k]`` [N_k, V] at the
    positions of ``targets[k]`` = (positions [B, T] bool, labels [B, T]), e.g. from `medusa_head_targets`.
    Returns the weighted loss (scalar) and, per position, its mean loss (detached), top-1 correct and count."""
    loss = logits[0].new_zeros((), dtype=torch.float32)
    each, correct, count = [], [], []
    for k, ((positions, labels), pos_logits) in enumerate(zip(targets, logits)):
        want, n = labels[positions], positions.sum()
        ce = F.cross_entropy(pos_logits.float(), want, reduction="sum") / n.clamp(min=1)
        loss = loss + weights[k] * ce
        each.append(ce.detach())
        correct.append((pos_logits.detach().argmax(-1) == want).sum())
        count.append(n)
    return {
        "loss": loss,
        "position_loss": torch.stack(each),
        "correct": torch.stack(correct),
        "count": torch.stack(count),
    }
