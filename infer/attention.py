"""The slot layout every KV cache of the runtime shares, and the two operations on it that several caches need.

A cache here (the target's, infer/generate.py; an EAGLE-3 drafter's, an MTP depth's, a draft model's, in their
proposers) holds S slots per row, shared by the batch; ``valid[b, s]`` says whether slot s holds one of row b's
tokens. Positions are explicit, so an invalid slot (a *hole*: padding of a row that fed fewer tokens than the others,
a draft slot closed after verification) changes nothing a row computes; it costs memory and attention width only.

- `additive_mask`: which slots each query may read (bool) → the 4D additive mask HF attention takes.
- `drop_holes`: once holes dominate a cache, left-align every row's valid slots with one gather per tensor
  (`infer.kernels.compact_kv`, the gather the verify step's compaction uses too).
"""

from __future__ import annotations

import torch

from infer.kernels import compact_kv


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, q, k] → additive float mask [B, 1, q, k] (0 where allowed, dtype-min elsewhere), the form HF
    attention takes for a custom 4D mask (eager and sdpa alike; DESIGN.md §7)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def drop_holes(valid: torch.Tensor, caches: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Drop the holes of a cache once they dominate: ``valid`` [B, S] bool and the cache's keys / values, each
    [B, nkv, S, d] (any number of them: one pair per layer) → each row's valid slots in order, left-aligned, in
    ``max_b used_b`` slots, shorter rows padded with invalid slots.

    Below S > 2·used + 64 everything is returned as given (the same objects): a gather every round would cost more
    than attending over the holes, and a long generation still never grows its cache without bound."""
    S, used = valid.shape[1], int(valid.sum(1).max())
    if S <= 2 * used + 64:
        return valid, caches
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :used]  # valid slots first, in order
    return valid.gather(1, order), [compact_kv(kv, order) for kv in caches]
