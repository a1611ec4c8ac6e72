"""Per-position acceptance and the tokens a chain yields (DESIGN.md §4), written once for every room that needs them:
training's simulated τ, the precision policy's serving model, the cost curve's chain sizing and the reports' α.

It sits in ``models/`` because the precision policy, which imports nothing above ``models/``, weighs chains with it.
"""

from __future__ import annotations

from collections.abc import Sequence


def expected_tokens(alpha: Sequence[float], k: int | None = None) -> float:
    """Tokens per verify round of a chain of ``k`` drafts (default: as many as ``alpha`` has) with conditional
    acceptance α_i per depth: 1 + Σ_{i≤k} Π_{j≤i} α_j, the bonus token included (Leviathan et al. 2023, for a
    chain). With teacher-forced top-1 agreement as α it is training's simulated τ."""
    total, run = 1.0, 1.0
    for a in list(alpha)[:k]:
        run *= a
        total += run
    return total


def acceptance_rates(accepted: Sequence[float], attempted: Sequence[float]) -> list[float]:
    """α_k = accepted_k / attempted_k per depth, from tallies pooled over every call first (a mean of per-call rates
    would weigh a call that reached depth k once like one that reached it a hundred times); 0 where never attempted."""
    return [a / t if t else 0.0 for a, t in zip(accepted, attempted)]
