"""What one generate call reports: tokens per row and the counters behind τ, α and the time split (DESIGN.md §3-4).

Shared by the decoding loops (`infer.generate`, `infer.continuous`) and the reports that sum them (`eval/`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from models.acceptance import acceptance_rates


@dataclass
class GenerationStats:
    """Counters of one generate call. τ and α follow DESIGN.md §4 (bonus token included in τ)."""

    new_tokens: int = 0
    """Tokens emitted over all rows."""
    row_forwards: int = 0
    """Σ over target verify forwards of the rows active in it (prefill excluded)."""
    rounds: int = 0
    """Target verify forwards (batched)."""
    accepted_per_round: list[int] = field(default_factory=list)
    """Accepted draft tokens per (round, row), bonus excluded."""
    attempted_at_depth: list[int] = field(default_factory=list)
    """[k] how often depth k+1 was reachable (all shallower positions accepted and a draft existed)."""
    accepted_at_depth: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0
    total_s: float = 0.0
    tree_nodes: int = 0
    """Nodes per verify forward (root included); 1 for vanilla."""

    @property
    def tau(self) -> float:
        return self.new_tokens / max(1, self.row_forwards)

    @property
    def alpha(self) -> list[float]:
        return acceptance_rates(self.accepted_at_depth, self.attempted_at_depth)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: emitted tokens / wall time (prefill included, as a user sees it)."""
        return self.new_tokens / max(1e-9, self.total_s)

    def step_costs(self) -> dict[str, float]:
        """Mean seconds per round of draft and verify (the inputs of the predicted speedup)."""
        r = max(1, self.rounds)
        return {"draft_s": self.draft_s / r, "verify_s": self.verify_s / r, "bookkeeping_s": self.bookkeeping_s / r}

    def predicted_speedup(self, vanilla_step_s: float) -> float:
        """τ · t_target(1 token) / (t_draft + t_verify(tree)) per round (DESIGN.md §4)."""
        c = self.step_costs()
        return self.tau * vanilla_step_s / max(1e-12, c["draft_s"] + c["verify_s"])

    def record_acceptance(self, accepted: int, tree_depth: int) -> None:
        self.accepted_per_round.append(accepted)
        while len(self.attempted_at_depth) < tree_depth:
            self.attempted_at_depth.append(0)
            self.accepted_at_depth.append(0)
        for k in range(min(accepted + 1, tree_depth)):
            self.attempted_at_depth[k] += 1
            self.accepted_at_depth[k] += int(k < accepted)

    def as_dict(self) -> dict:
        return {
            "tau": self.tau,
            "alpha": self.alpha,
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "tokens_per_s": self.tokens_per_s,
            "tree_nodes": self.tree_nodes,
            "time_s": {
                "prefill": self.prefill_s,
                "draft": self.draft_s,
                "verify": self.verify_s,
                "bookkeeping": self.bookkeeping_s,
                "total": self.total_s,
            },
        }


def depth_tallies(stats: Iterable[GenerationStats], depth: int | None = None) -> tuple[list[int], list[int]]:
    """(accepted, attempted) per draft depth, summed over generate calls, to ``depth`` (default: the deepest any call
    reached); `models.acceptance.acceptance_rates` turns them into α."""
    stats = list(stats)
    if depth is None:
        depth = max((len(s.attempted_at_depth) for s in stats), default=0)
    accepted = [sum(s.accepted_at_depth[k] for s in stats if k < len(s.accepted_at_depth)) for k in range(depth)]
    attempted = [sum(s.attempted_at_depth[k] for s in stats if k < len(s.attempted_at_depth)) for k in range(depth)]
    return accepted, attempted


@dataclass
class GenerationResult:
    """What one generate call returns: the new tokens of every row and the call's counters."""

    tokens: list[list[int]]
    """New tokens per row (prompt excluded), stop token included, never more than max_new_tokens."""
    stats: GenerationStats
