"""EAGLE-3 draft vocabulary: the most frequent training-target tokens and the d2t / t2d maps (REFERENCE.md).

The drafter's lm_head only scores ``draft_vocab_size`` tokens; what it cannot name it can never draft, so the
vocabulary is chosen from the tokens the drafter is trained to predict: loss-masked (assistant) tokens of the
training data. Reuse the saved maps when resuming or fine-tuning a drafter: rebuilding them from other data
silently misaligns the rows of a trained lm_head.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


def count_loss_tokens(samples: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """[V] int64 counts of the tokens with ``loss_mask == 1`` over ``samples`` (dicts with input_ids, loss_mask)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for sample in samples:
        ids = np.asarray(sample["input_ids"], dtype=np.int64)
        mask = np.asarray(sample["loss_mask"], dtype=bool)
        counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [V] → (d2t [Vd] int64, t2d [V] bool).

    The ``draft_vocab_size`` most frequent ids (ties: smaller id first, so the result is deterministic); when fewer
    distinct ids were seen, the smallest unseen ids 0, 1, … pad the set. Ids are sorted ascending, then
    ``d2t[i] = used[i] - i`` (target id = draft id + d2t[draft id]) and ``t2d[id]`` marks membership.
    """
    vocab_size = counts.shape[0]
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    ids = torch.arange(vocab_size)
    # stable sort on -count keeps ascending ids among equal counts
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    seen = order[counts[order] > 0][:draft_vocab_size]
    if len(seen) < draft_vocab_size:
        unseen = ids[~torch.isin(ids, seen)]
        seen = torch.cat([seen, unseen[: draft_vocab_size - len(seen)]])
    used = torch.sort(seen).values
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of counted tokens inside the draft vocabulary (an upper bound on per-token acceptance)."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0
