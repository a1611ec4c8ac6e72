"""Per-position acceptance and the tokens a chain yields (DESIGN.md §4), written once for every room that needs them:
training's simulated τ, the precision policy's serving model, the cost curve's chain sizing and the reports' α.

It sits in ``models/`` because the precision policy, which imports nothing above ``models/``, weighs chains with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


def expected_tokens(alpha: Sequence[float], k: int | None = None) -> float:
    """Tokens per verify round of a chain of ``k`` drafts (default: as many as ``alpha`` has) with conditional
    acceptance α_i per depth: 1 + Σ_{i≤k} Π_{j≤i} α_j, the bonus token included (Leviathan et al. 2023, for a
    chain). With teacher-forced top-1 agreement as α it is training's simulated τ: an optimistic one, since it takes
    every position's agreement as the rate of the positions a round starts at (`walked_chain` does not)."""
    total, run = 1.0, 1.0
    for a in list(alpha)[:k]:
        run *= a
        total += run
    return total


def acceptance_rates(accepted: Sequence[float], attempted: Sequence[float]) -> list[float]:
    """α_k = accepted_k / attempted_k per depth, from tallies pooled over every call first (a mean of per-call rates
    would weigh a call that reached depth k once like one that reached it a hundred times); 0 where never attempted."""
    return [a / t if t else 0.0 for a, t in zip(accepted, attempted)]


class Walk(NamedTuple):
    """What greedy chain decoding of one answer gives: tokens, verify rounds (τ = tokens / rounds, the bonus token
    included) and the rounds whose first draft was accepted (α1 = first / rounds, counted once a round as served)."""

    tokens: int
    rounds: int
    first: int


def chain_rounds(hits: Sequence[Sequence[bool]], start: int, end: int, k: int) -> list[tuple[int, int]]:
    """Greedy chain decoding of the answer at positions [start, end) replayed on teacher-forced hits: each verify
    round as (r, accepted drafts), r the position of the round's newest context token.

    ``hits[i][r]``: the depth-(i+1) draft of a round whose newest context token sits at position r is the answer's
    token r+1+i, given that the drafts before it were (a drafter fed its accepted drafts sees then exactly the
    teacher-forced inputs, so its greedy chain accepts the run of hits at r). The first round drafts the answer's
    first token (r = start - 1); each round moves past its accepted drafts and the bonus token. These are the rounds
    the served run on the same text verifies (tests/test_eagle3_proposer.py). ``hits`` must hold False past the
    answer's end."""
    if not 0 < start <= end or k < 1 or len(hits) < k:
        raise ValueError(f"need 0 < start <= end and 1 <= k <= {len(hits)} depths, got [{start}, {end}), k={k}")
    rounds, r = [], start - 1
    while r < end - 1:
        a = 0
        while a < k and hits[a][r]:
            a += 1
        rounds.append((r, a))
        r += a + 1
    return rounds


def walked_chain(hits: Sequence[Sequence[bool]], start: int, end: int, k: int) -> Walk:
    """`chain_rounds` counted: the answer's tokens, its rounds and those whose first draft was accepted. Unlike served
    τ, which decodes each drafter's own text, it scores every drafter on one text, position by position."""
    rounds = chain_rounds(hits, start, end, k)
    return Walk(end - start, len(rounds), sum(a > 0 for _, a in rounds))
