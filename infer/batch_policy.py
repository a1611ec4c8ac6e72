"""Batch-aware speculation: how many drafts a round gets, as a function of how many rows decode together.

At batch 1 a CPU (or GPU) target forward is bound by reading its weights, so verifying k + 1 tokens costs about
what one token costs and drafting pays. As the batch grows the forward becomes compute-bound: B·(k + 1) tokens cost
about (k + 1) times B tokens, and the drafts a row rejects are paid for by every row. The rate of a k-draft chain,
``E(k) / (k·t_draft(B) + t_verify(B, k + 1) + t_overhead(B))`` over vanilla's ``1 / t_vanilla(B)``, then falls
below 1 at some batch size; from there on speculation must be off (the point vLLM's and SGLang's users meet as
"speculative decoding slows down high-concurrency serving"). `BatchPolicy` holds the chain length chosen for each
measured batch size (``eval.batch_sizing.size_batch_policy`` chooses it from the cost curve at that batch size and
the drafter's per-position acceptance); `BatchAwareProposer` applies it per generate call: a batch whose length is
0 runs the plain vanilla loop (``Proposer.drafts`` False), any other runs the chain of that length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from infer.proposer import Proposer, TargetSignal
from infer.sampling import SamplingParams
from infer.tree import DraftTree
from models.target import TargetModel


def at_batch(table: dict, rows: int):
    """``table``'s entry for a batch of ``rows``: that of the next measured batch size up, past the largest the
    largest's."""
    sizes = sorted(table)
    return table[next((b for b in sizes if b >= rows), sizes[-1])]


@dataclass(frozen=True)
class BatchPolicy:
    """Chain length by batch size (0: no speculation). Between measured sizes a batch takes the length of the next
    measured size up (the more conservative one); past the largest, the largest's. Lengths never grow with the
    batch (`__post_init__` enforces it): measurement noise must not switch speculation back on at a larger batch."""

    lengths: dict[int, int]

    def __post_init__(self) -> None:
        if not self.lengths or any(b < 1 or k < 0 for b, k in self.lengths.items()):
            raise ValueError(f"a batch policy needs batch sizes >= 1 and lengths >= 0, got {self.lengths}")
        monotone, cap = {}, None
        for b in sorted(self.lengths):
            cap = self.lengths[b] if cap is None else min(cap, self.lengths[b])
            monotone[b] = cap
        object.__setattr__(self, "lengths", monotone)

    def length_for(self, rows: int) -> int:
        return at_batch(self.lengths, rows)

    def words(self) -> str:
        return ", ".join(f"bs{b}:{'off' if k == 0 else f'chain {k}'}" for b, k in sorted(self.lengths.items()))


class BatchAwareProposer(Proposer):
    """The chain ``make(k)`` with k = ``policy.length_for(batch rows)``, decided when a generate call begins; at
    k = 0 it declares ``drafts = False`` and the runtime decodes that call with the vanilla loop, on the target
    ``vanilla_targets`` names for that batch size (by the same next-size-up rule; e.g. a bf16 copy where bf16 decodes
    one row faster than the fp32 target that verifies faster; None or missing: the served target)."""

    def __init__(
        self,
        make: Callable[[int], Proposer],
        policy: BatchPolicy,
        vanilla_targets: dict[int, TargetModel | None] | None = None,
    ) -> None:
        self.make, self.policy, self.vanilla_targets = make, policy, vanilla_targets or {}
        self.inner: Proposer | None = None
        self.drafts = True
        self.signal = TargetSignal.NONE
        self.vanilla_target = None

    def begin(self, contexts: list[list[int]]) -> None:
        k = self.policy.length_for(len(contexts))
        self.drafts = k > 0
        self.inner = self.make(k) if self.drafts else None
        self.signal = self.inner.signal if self.drafts else TargetSignal.NONE
        self.vanilla_target = None
        if self.drafts:
            self.inner.begin(contexts)
        elif self.vanilla_targets:
            self.vanilla_target = at_batch(self.vanilla_targets, len(contexts))

    def propose(self, contexts: list[list[int]], params: SamplingParams, generator: torch.Generator) -> DraftTree:
        if self.inner is None:
            raise RuntimeError("propose before begin, or on a call the policy runs without drafts")
        return self.inner.propose(contexts, params, generator)

    def observe(self, features: torch.Tensor, new_lengths: torch.Tensor) -> None:
        if self.inner is not None:
            self.inner.observe(features, new_lengths)

    def drop_rows(self, keep: torch.Tensor) -> None:
        if self.inner is not None:
            self.inner.drop_rows(keep)
