"""Drafter training losses (EAGLE-3's TTT loss, the per-position CE of Medusa heads and MTP depths) and the
simulated τ of DESIGN.md §4 (pure functions; shapes in the docstrings)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.acceptance import chain_rounds


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


@dataclass
class TTTTargets:
    """What EAGLE-3's TTT loss compares the drafter against, at the trained positions only (`ttt_targets`)."""

    masks: list[torch.Tensor]
    """Per step i: [B, T] bool, the positions t trained at step i (the drafter's logits are computed there only)."""
    labels: list[torch.Tensor]
    """Per step: [N_i, Vd] float, the target's distribution on the draft vocabulary for each trained position."""
    top: list[torch.Tensor]
    """Per step: [N_i] int64, the target's most likely draft id there (top-1 agreement)."""


@torch.no_grad()
def ttt_targets(
    target_hidden: torch.Tensor,
    target_head: Callable[[torch.Tensor], torch.Tensor],
    loss_mask: torch.Tensor,
    t2d: torch.Tensor,
    ttt_steps: int,
    sample_ids: torch.Tensor | None = None,
) -> TTTTargets:
    """The labels of every TTT step, from the target's head run only where a label is read.

    target_hidden [B, T, H]: what the target's head reads (``target_head`` maps [N, H] → [N, V] logits); position p
    predicts token p+1. Step i at position t is labelled by ``softmax(logits[t+1+i][t2d])`` and trained where
    token t+2+i is a loss token (loss_mask [B, T]) of the same sample (sample_ids [B, T], packed rows) and the
    target's top token at t+1+i is draftable; step weight and reduction are `ttt_loss`'s. Every label position
    p has loss_mask[p+1], so the head runs on those positions alone: on chat data, a third of a padded batch (the
    49k-wide target head and the draft head were ~80 % of a SmolLM2 EAGLE-3 training step, measured)."""
    mask_tokens = loss_mask.bool()
    need = shift_left(mask_tokens, 1, False)  # position p is read as a label exactly when token p+1 is trained
    where = need.nonzero(as_tuple=True)
    logits = target_head(target_hidden[where])  # [P, V]
    row = torch.full(need.shape, -1, dtype=torch.long, device=need.device)
    row[where] = torch.arange(logits.shape[0], device=need.device)
    draftable = torch.zeros_like(need)
    draftable[where] = t2d[logits.argmax(-1)]  # the target's top token is in the draft vocabulary
    draft = logits[:, t2d].float()  # [P, Vd], draft ids ascend with target ids
    masks, labels, top = [], [], []
    for i in range(ttt_steps):
        mask = shift_left(mask_tokens, 2 + i, False) & shift_left(draftable, 1 + i, False)
        if sample_ids is not None:
            mask &= shift_left(sample_ids, 2 + i, -1) == sample_ids
        rows = shift_left(row, 1 + i, -1)[mask]
        masks.append(mask)
        labels.append(draft[rows].softmax(-1))
        top.append(draft[rows].argmax(-1))
    return TTTTargets(masks, labels, top)


def ttt_loss(
    draft_logits: list[torch.Tensor],
    targets: TTTTargets,
    step_weight: float = 0.8,
    position_weights: list[torch.Tensor] | None = None,
) -> TTTLoss:
    """Soft cross-entropy of every TTT step against the target distribution on the draft vocabulary.

    draft_logits: per step i, [N_i, Vd] at the positions ``targets.masks[i]`` selects (in its row-major order; the
    drafter's forward computes them there only). Step i's loss is the mean over its positions, weighted by
    ``step_weight ** i`` (EAGLE-3 / SpecForge: 0.8). ``position_weights`` (per step, [N_i], e.g. `copy_weights`)
    makes that mean a weighted one; none is the plain mean."""
    total = torch.zeros((), device=targets.masks[0].device)
    step_loss, step_correct, step_count = [], [], []
    for i, logits in enumerate(draft_logits):
        logp = F.log_softmax(logits.float(), dim=-1)
        count = targets.masks[i].sum()
        per_position = -(targets.labels[i] * logp).sum(-1)
        if position_weights is None:
            loss_i = per_position.sum() / count.clamp(min=1)
        else:
            w = position_weights[i]
            loss_i = (w * per_position).sum() / w.sum().clamp(min=1e-6)
        total = total + (step_weight**i) * loss_i
        step_loss.append(loss_i.detach())
        step_correct.append((logits.argmax(-1) == targets.top[i]).sum())
        step_count.append(count)
    return TTTLoss(total, torch.stack(step_loss), torch.stack(step_correct), torch.stack(step_count))


def lookup_hits(input_ids: torch.Tensor, sample_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] bool: token t is what prompt lookup would propose after tokens < t of its sample, i.e. the token after
    the latest earlier occurrence of the last two tokens, else of the last one (Saxena 2023, a 2-gram then 1-gram
    match). Where this is true the next token is a copy from the context."""
    ids = input_ids.tolist()
    same = None if sample_ids is None else sample_ids.tolist()
    hits = [[False] * len(row) for row in ids]  # plain lists: a tensor written element by element costs µs each
    for b, row in enumerate(ids):
        after2: dict[tuple[int, int], int] = {}  # (x[p-2], x[p-1]) → x[p] of its latest occurrence
        after1: dict[int, int] = {}
        start = 0
        for p in range(1, len(row)):
            if same is not None and same[b][p] != same[b][p - 1]:  # a new packed sample: nothing before it counts
                after2, after1, start = {}, {}, p
                continue
            key2 = (row[p - 2], row[p - 1]) if p - 2 >= start else None
            guess = after2.get(key2) if key2 is not None else None
            if guess is None:
                guess = after1.get(row[p - 1])
            hits[b][p] = guess == row[p]
            if key2 is not None:
                after2[key2] = row[p]
            after1[row[p - 1]] = row[p]
    return torch.tensor(hits, dtype=torch.bool, device=input_ids.device).view(input_ids.shape)


def copy_weights(hits: torch.Tensor, masks: list[torch.Tensor], weight: float) -> list[torch.Tensor]:
    """Per TTT step i, [N_i] float: ``weight`` where the token step i predicts at a trained position t (token
    t+2+i, `ttt_targets`) is a lookup hit (`lookup_hits`), else 1."""
    out = []
    for i, mask in enumerate(masks):
        hit = shift_left(hits, 2 + i, False)[mask]
        out.append(torch.where(hit, weight, 1.0).to(torch.float32))
    return out


def answer_spans(loss_mask: torch.Tensor, sample_ids: torch.Tensor | None = None) -> list[list[tuple[int, int]]]:
    """Each row's answers as [start, end) runs of loss tokens within one sample (packed rows: ``sample_ids``), those
    with a token before them only (an answer at a row's first place is never decoded)."""
    flags = loss_mask.bool().tolist()  # plain lists: read one by one
    same = None if sample_ids is None else sample_ids.tolist()
    out = []
    for b, row in enumerate(flags):
        spans, t, T = [], 0, len(row)
        while t < T:
            end = t
            while end < T and row[end] and (same is None or same[b][end] == same[b][t]):
                end += 1
            if end > t and t > 0:
                spans.append((t, end))
            t = max(end, t + 1)
        out.append(spans)
    return out


def hits_by_root(masks: list[torch.Tensor], hits: list[torch.Tensor]) -> torch.Tensor:
    """[k, B, T] bool from TTT step i's top-1 hits ``hits[i]`` [N_i] at its trained places ``masks[i]`` [B, T]:
    entry (i, b, r) is whether the depth-(i+1) draft of a round whose newest context token is r is right, i.e.
    step i at pair r - 1 (which drafts token r+1+i, `ttt_targets`); False wherever nothing was scored. What
    `models.acceptance.chain_rounds` replays."""
    out = torch.zeros(len(masks), *masks[0].shape, dtype=torch.bool, device=masks[0].device)
    for i, (mask, hit) in enumerate(zip(masks, hits)):
        out[i, :, 1:] = torch.zeros_like(mask).masked_scatter_(mask, hit)[:, :-1]
    return out


def served_path_weights(
    masks: list[torch.Tensor],
    hits: list[torch.Tensor],
    spans: list[list[tuple[int, int]]],
    off_path: float,
) -> list[torch.Tensor]:
    """Per TTT step i, [N_i] float: 1 where serving asks for step i's draft at that place, ``off_path`` elsewhere.

    Serving asks only along the greedy chain's walk (`models.acceptance.chain_rounds` of each answer in ``spans``,
    `answer_spans`, on this batch's own hits, as deep as the unroll): at a round's first place, and deeper there only
    while the drafts before were right. The other places are ones the served drafter never drafts from on this text
    (inside an accepted run); the plain loss weighs them alike. Rounds mostly start right after a rejection, so the
    walk puts the weight where acceptance is lowest (docs/decisions.md, "Walked τ")."""
    k = len(masks)
    by_root = hits_by_root(masks, hits)
    asked = torch.zeros_like(by_root)
    maps = by_root.permute(1, 0, 2).tolist()
    for b, row in enumerate(spans):
        for start, end in row:
            for r, a in chain_rounds(maps[b], start, end, k):
                asked[: min(a + 1, k), b, r] = True
    out = []
    for i, mask in enumerate(masks):
        on_path = torch.zeros_like(mask)
        on_path[:, :-1] = asked[i, :, 1:]  # back from roots to the pairs step i is trained at
        out.append(torch.where(on_path[mask], 1.0, off_path).to(torch.float32))
    return out


def position_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, position: int, sample_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [B, T] bool, labels [B, T]) of draft position ``position`` (0-based: a Medusa head, an MTP depth):
    at token t it predicts token t+2+position, trained where that token is a loss token of the same sample (Cai et
    al. 2024, the Medusa-1 loss; the same targets for MTP's depths); ``position`` -1 gives the next token t+1 (the
    target's own language-model loss)."""
    labels = shift_left(input_ids, 2 + position, 0)
    positions = shift_left(loss_mask.bool(), 2 + position, False)
    if sample_ids is not None:
        positions &= shift_left(sample_ids, 2 + position, -1) == sample_ids
    return positions, labels


def rank_matches(logits: torch.Tensor, labels: torch.Tensor, ranks: int) -> torch.Tensor:
    """logits [N, V], labels [N] → [N, ranks] bool: whether the label is the r-th most likely token (r < ranks);
    summed over N, how often it is (column 0: the top-1 hits)."""
    return logits.topk(ranks, dim=-1).indices == labels[:, None]


def position_losses(
    logits: list[torch.Tensor], targets: list[tuple[torch.Tensor, torch.Tensor]], weights: list[float]
) -> dict[str, torch.Tensor]:
    """Σ_k weights[k] · CE_k over draft positions k (a Medusa head, an MTP depth): ``logits[k]`` [N_k, V] at the
    positions of ``targets[k]`` = (positions [B, T] bool, labels [B, T]), e.g. from `position_targets`.
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
