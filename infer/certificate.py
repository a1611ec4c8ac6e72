"""Greedy-identity certificate: where two greedy outputs part, was it a numerical tie or a bug?

Tree verification computes the same logits as sequential decoding only up to float rounding
(~1e-7 relative in fp32, DESIGN.md §7). When the target's top two logits at some step are within
that rounding, the two runs may legitimately pick different tokens. Every greedy comparison in
this project reports the first divergence and the target's top-2 logit gap there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_GAP = 1e-4
"""Top-2 logit gaps below this are reported as numerical ties (fp32 logits of order 10 carry ~1e-6
absolute rounding; a tree forward reorders sums, so we allow two orders of magnitude)."""


@dataclass
class GreedyComparison:
    identical: bool
    first_divergence: int | None
    """Index into the generated tokens where the outputs first differ (None if identical or one is a prefix)."""
    top2_gap: float | None
    """Target's top-1 minus top-2 logit at the divergence, computed by a plain forward over the shared prefix."""

    @property
    def numerical_tie(self) -> bool:
        return self.top2_gap is not None and self.top2_gap < TIE_GAP


@torch.no_grad()
def compare_greedy(model, prompt: list[int], reference: list[int], candidate: list[int]) -> GreedyComparison:
    """Compare ``candidate`` with ``reference`` (both continuations of ``prompt``)."""
    n = min(len(reference), len(candidate))
    first = next((i for i in range(n) if reference[i] != candidate[i]), None)
    if first is None:
        return GreedyComparison(len(reference) == len(candidate), None, None)
    ids = torch.tensor([prompt + reference[:first]], device=next(model.parameters()).device)
    logits = model(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2).values
    return GreedyComparison(False, first, float(top[0] - top[1]))
