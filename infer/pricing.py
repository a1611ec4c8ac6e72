"""How many draft nodes a round should verify, priced on this machine's verify curve.

A verify forward's cost is a step function of its node count on a CPU: the routed matmuls pad their rows up to 1, 4,
8 or 16 (`infer.kernels.cpu_linear`), so on SmolLM2 in bf16 (AVX-512-BF16 EPYC, 2 threads) verifying 5 nodes cost
what 8 cost (40 ms) and 11 what 16 cost (48 ms), against 35 ms for 4 and 32 for 1. A proposer that knows how likely
each of its nodes is to be accepted can therefore ask, per round, which node count gives the most tokens per
millisecond: a weak candidate that pushes the tree past a step costs more than it returns, and spare nodes below a
step are free.

The rule (as in hardware-aware tree sizing, Sequoia, Chen et al. 2024, and EAGLE-2's rerank by path probability,
Li et al. 2024): a node's value is the probability that it is accepted, i.e. that its whole path is right; the
expected tokens of a round that keeps the N − 1 most valuable nodes (and the root) is 1 + their summed values, since
the accepted length counts each accepted node once and the bonus token always comes. Values fall along every path,
so the most valuable nodes always include their ancestors. The round keeps the N with the largest
``(1 + Σ values) / (verify(N) + rest)``, where the rest is what a round costs besides the verify forward (the
drafter's steps where it ran, bookkeeping). Which nodes are verified never changes which tokens are emitted: the accept rules are exact for
any deterministic tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class VerifyPrice:
    """What a round costs here by the node count it verifies (root included), as measured on the served target."""

    verify_ms: dict[int, float]
    """Measured node counts → ms of the verify forward; a count between two measured ones costs what the next larger
    one does (the padded row count of the routed matmuls), and counts above the largest cannot be priced."""
    draft_ms: float = 0.0
    """The learned drafter's steps in a round that runs it."""
    overhead_ms: float = 0.0
    """Bookkeeping of every round (accepting, the cache kept, tokens emitted)."""

    def __post_init__(self) -> None:
        if not self.verify_ms or min(self.verify_ms) < 1:
            raise ValueError("verify_ms needs at least one node count >= 1")
        if self.draft_ms < 0 or self.overhead_ms < 0 or any(ms <= 0 for ms in self.verify_ms.values()):
            raise ValueError("verify costs must be positive, draft and overhead costs non-negative")

    @property
    def max_nodes(self) -> int:
        return max(self.verify_ms)

    def cost(self, nodes: int, drafted: bool) -> float:
        """ms of a round that verifies ``nodes`` nodes (``drafted``: the learned drafter ran): the smallest measured
        count that holds them, the later counts never cheaper (a best-of timing errs only upwards), plus the rest."""
        larger = [n for n in self.verify_ms if n >= nodes]
        if not larger:
            raise ValueError(f"{nodes} nodes: the price was measured up to {self.max_nodes}")
        return min(self.verify_ms[n] for n in larger) + self.overhead_ms + (self.draft_ms if drafted else 0.0)

    def best_count(self, values: Sequence[float], drafted: bool) -> int:
        """Node count (root included) with the most expected tokens per ms, keeping the most valuable nodes first;
        ``values``: the non-root nodes' acceptance probabilities, in the order they would be kept (non-increasing).
        A tie keeps the smaller count."""
        best, best_rate, gained = 1, 1.0 / self.cost(1, drafted), 1.0
        for i, v in enumerate(values[: self.max_nodes - 1]):
            gained += v
            rate = gained / self.cost(i + 2, drafted)
            if rate > best_rate:
                best, best_rate = i + 2, rate
        return best


@dataclass
class ChainAcceptance:
    """How often prompt lookup's j-th token is right after its first j − 1 were, by the n-gram size that matched,
    tallied online from the rounds a proposer has seen (the emitted tokens say how far each chain was right).

    Each cell starts from a prior of weight `PRIOR_WEIGHT` centred on the rate of the position before it (0.5 for the
    first): a position is only judged where a round verified up to it, so a cell the pricing has not yet reached
    must not look worse than the one before it, or it would never be reached. Shared by every call of one report
    row, so later answers are priced from what earlier ones taught it.
    """

    PRIOR_WEIGHT = 2.0

    tried: dict[tuple[int, int], int] = field(default_factory=dict)
    accepted: dict[tuple[int, int], int] = field(default_factory=dict)

    def rates(self, ngram: int, length: int) -> list[float]:
        """P(token j right | the ones before it right) after an ``ngram``-token match, j = 1..length."""
        out, rate = [], 0.5
        for j in range(1, length + 1):
            key = (ngram, j)
            rate = (self.accepted.get(key, 0) + self.PRIOR_WEIGHT * rate) / (self.tried.get(key, 0) + self.PRIOR_WEIGHT)
            out.append(rate)
        return out

    def values(self, ngram: int, length: int) -> list[float]:
        """The chain's node values: the probability that its first j tokens are all right, j = 1..length."""
        out, p = [], 1.0
        for rate in self.rates(ngram, length):
            p *= rate
            out.append(p)
        return out

    def record(self, ngram: int, chain: Sequence[int], emitted: Sequence[int]) -> None:
        """Tally one verified chain against the tokens the round emitted after its root. Token j is judged only
        where the emitted tokens reach it: a row that stopped early (end of sequence, budget) tells nothing past
        its last token."""
        for j, token in enumerate(chain, start=1):
            if j > len(emitted):
                return
            key = (ngram, j)
            self.tried[key] = self.tried.get(key, 0) + 1
            if emitted[j - 1] != token:
                return
            self.accepted[key] = self.accepted.get(key, 0) + 1
