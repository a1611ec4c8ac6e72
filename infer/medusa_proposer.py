"""Medusa heads as a proposer: a chain of the heads' top-1 tokens, or a static tree of their top-k ranks.

The heads read the final-norm hidden state of the last token in the target's cache, h_t, whose own lm_head output
is the root (the token the last verify emitted). Head k's candidates are children at depth k+1, so a tree node at
rank path (r_0, …, r_d) holds head d's r_d-th most likely token whatever its parents hold: Medusa's heads do not
condition on the drafted tokens, which is why one forward of the heads drafts the whole tree.

Drafts are deterministic (top-k), so sampling verifies them as one-hot q (lossless rejection sampling; or Medusa's
typical acceptance, lossy, when the runtime is asked for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from infer.family import ChainSizer, DrafterFamily, ProposerSetting, ReportSettings
from infer.generate import SpecConfig
from infer.kernels.cpu_linear import install as install_cpu_linear
from infer.proposer import Proposer, TargetSignal
from infer.sampling import SamplingParams
from infer.tree import DraftTree, chain, paths_to_parents
from models.medusa import MedusaDrafter, estimate_training
from models.medusa_export import medusa_engine_exports


class MedusaProposer(Proposer):
    """``paths`` None: a chain of the first ``k`` heads' top-1 (default all heads); else a static tree of rank
    paths (e.g. the checkpoint's ``tree_paths``, chosen from held-out head accuracies)."""

    signal = TargetSignal.LAST_HIDDEN

    def __init__(
        self, drafter: MedusaDrafter, k: int | None = None, paths: list[tuple[int, ...]] | None = None
    ) -> None:
        heads = drafter.config.num_heads
        k = heads if k is None else k
        if not 1 <= k <= heads:
            raise ValueError(f"k must be in 1..{heads} (the number of heads)")
        if paths is not None and (not paths or max(len(p) for p in paths) > heads):
            raise ValueError(f"tree paths must be non-empty and at most {heads} deep (one rank per head)")
        self.drafter, self.k = drafter.eval(), k
        self.parents, self.paths = paths_to_parents([tuple(p) for p in paths]) if paths is not None else (None, None)
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cpu":
            install_cpu_linear(drafter, log=lambda msg: None)  # the heads' small-row matmuls, layouts measured here

    def begin(self, contexts: list[list[int]]) -> None:
        B, H = len(contexts), self.drafter.config.hidden_size
        self.hidden = torch.zeros(B, H, dtype=self.dtype, device=self.device)
        self.has_hidden = torch.zeros(B, dtype=torch.bool, device=self.device)

    def observe(self, features: torch.Tensor, new_lengths: torch.Tensor) -> None:
        rows = (new_lengths > 0).nonzero().flatten()
        if len(rows):
            last = features[rows, new_lengths[rows] - 1]
            self.hidden[rows] = last.to(self.dtype)
            self.has_hidden[rows] = True

    def drop_rows(self, keep: torch.Tensor) -> None:
        self.hidden, self.has_hidden = self.hidden[keep], self.has_hidden[keep]

    @torch.no_grad()
    def propose(self, contexts: list[list[int]], params: SamplingParams, generator: torch.Generator) -> DraftTree:
        roots = torch.tensor([c[-1] for c in contexts], device=self.device)
        depth = self.k if self.paths is None else max(len(p) for p in self.paths)
        ranks = 1 if self.paths is None else max(max(p) for p in self.paths) + 1
        logits = self.drafter.predict(self.hidden, depth)  # [depth, B, V]; heads past the tree's depth are not run
        top = logits.topk(ranks, dim=-1).indices  # [depth, B, ranks]
        # a one-token prompt has no cached token yet, so no hidden state: root only this round
        valid_rows = self.has_hidden
        if self.paths is None:
            tokens = torch.cat([roots[:, None], top[:, :, 0].t()], 1)
            valid = valid_rows[:, None].expand(-1, depth + 1).clone()
            valid[:, 0] = True
            return chain(tokens, valid=valid)
        B, n = len(contexts), len(self.parents)
        tokens = torch.empty(B, n, dtype=torch.long, device=self.device)
        tokens[:, 0] = roots
        for i, path in enumerate(self.paths, start=1):
            tokens[:, i] = top[len(path) - 1, :, path[-1]]
        valid = valid_rows[:, None].expand(-1, n).clone()
        valid[:, 0] = True
        parents = torch.tensor(self.parents, device=self.device).expand(B, n).clone()
        return DraftTree(tokens, parents, valid)


# --- the family ----------------------------------------------------------------------------------


@dataclass
class MedusaReportOptions:
    """The report settings Medusa reads beyond the generic ones (eval.report_config.ReportConfig takes these fields)."""

    typical_acceptance: bool = False
    """Also measure each Medusa drafter's chain with Medusa's typical acceptance (lossy: such rows are labelled
    "(lossy)" and have no identity check)."""


class MedusaReportSettings(ReportSettings, Protocol):
    """What Medusa's report rows read: the generic settings and `MedusaReportOptions`."""

    typical_acceptance: bool


def report_proposers(drafter: MedusaDrafter, settings: MedusaReportSettings, size: ChainSizer) -> list[ProposerSetting]:
    """Medusa in a report: a chain of the heads' top-1 (``settings.chain_k`` capped at the number of heads, sized on
    the measuring machine), that chain again under typical acceptance when asked, and the static tree stored with
    the heads (chosen at training time from held-out rank accuracies) when there is one."""
    out = []
    if settings.chain_k:
        k = size(lambda n: MedusaProposer(drafter, k=n), min(settings.chain_k, drafter.config.num_heads))
        out.append(ProposerSetting(f"chain {k}", lambda: MedusaProposer(drafter, k=k)))
        if settings.typical_acceptance:
            typical = SpecConfig(accept="typical")
            out.append(ProposerSetting(f"chain {k}, typical acceptance", lambda: MedusaProposer(drafter, k=k), typical))
    paths = [tuple(p) for p in drafter.config.tree_paths]
    if paths:
        out.append(ProposerSetting(f"static tree n{len(paths) + 1}", lambda: MedusaProposer(drafter, paths=paths)))
    return out


FAMILY = DrafterFamily(
    MedusaDrafter,
    lambda drafter: MedusaProposer.signal,
    report_proposers,
    MedusaReportOptions,
    engine_exports=medusa_engine_exports,
    chain=lambda drafter, k: MedusaProposer(drafter, k=k),
    recipe_section="heads",
    estimate=estimate_training,
)
