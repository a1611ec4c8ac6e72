"""The proposer contract: what the runtime gives a drafter and what it gets back (DESIGN.md §3).

A proposer turns the runtime state after the last accepted token into a draft tree. It declares which target signal
it reads (`TargetSignal`); the runtime computes exactly that signal in its target forwards and hands the proposer the
signal of every token that entered the target's cache (the prompt at prefill, the root and accepted nodes after
each verify) through ``observe``. The runtime never names a method: prompt lookup and the draft model read nothing,
EAGLE-3 reads the aux-layer taps, Medusa the final-norm hidden state, MTP the last layer's output before the norm.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

import torch

from infer.sampling import SamplingParams
from infer.tree import DraftTree
from models.target import TargetModel, TargetOutput


class TargetSignal(StrEnum):
    """The per-token target signal a proposer reads."""

    NONE = "none"
    AUX = "aux"
    """Aux-layer outputs concatenated, [B, T, A·H] (EAGLE-3's low / mid / high features)."""
    LAST_HIDDEN = "last_hidden"
    """The final-norm output, [B, T, H] (what the target's head reads; Medusa heads, MTP modules by default)."""
    PRE_NORM = "pre_norm"
    """The last decoder layer's output before the final norm, [B, T, H] (MTP modules saved with input_signal
    pre_norm)."""

    def of(self, out: TargetOutput) -> torch.Tensor:
        """This signal from one target forward."""
        if self is TargetSignal.AUX:
            return out.aux_hidden
        if self is TargetSignal.LAST_HIDDEN:
            return out.last_hidden
        if self is TargetSignal.PRE_NORM:
            return out.pre_norm_last
        raise ValueError("TargetSignal.NONE has no tensor")


class Proposer(Protocol):
    """Subclass it (the hooks below default to doing nothing) or implement the same attributes."""

    signal: TargetSignal = TargetSignal.NONE
    drafts: bool = True
    """False (decided in ``begin``) when this call gets no drafts at all: the runtime then decodes it with the plain
    vanilla loop, which is faster than verifying a root-only tree (the batch-aware policy at large batches)."""
    vanilla_target: TargetModel | None = None
    """Where ``drafts`` is False: the target that vanilla loop runs on (a copy in the dtype vanilla is fastest in);
    None: the served one."""

    def begin(self, contexts: list[list[int]]) -> None:
        """A new generate call starts with these rows (prompt tokens; the last one is the root)."""

    def propose(self, contexts: list[list[int]], params: SamplingParams, generator: torch.Generator) -> DraftTree:
        """Each active row's context (prompt + emitted tokens; the last one is the root) → a draft tree."""
        ...

    def observe(self, features: torch.Tensor, new_lengths: torch.Tensor) -> None:
        """The declared signal [B, L, F] of the tokens just written to the target's cache (row b: its first
        new_lengths[b]); context token i's signal arrives before the propose that needs it."""

    def drop_rows(self, keep: torch.Tensor) -> None:
        """Rows not in ``keep`` have finished; new batch index j holds old row ``keep[j]`` (not always in order)."""
