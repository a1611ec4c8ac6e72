"""MTP self-speculation: a chain of the modules' drafts, optionally longer than D by reusing the last module, or a
small tree of per-depth top-k candidates.

Notation (models/mtp.py): context tokens c_0 … c_L, c_L the root (emitted by the last verify, not yet in the target's
cache), h^0_i the target's signal at c_i (observed for i < L): the final-norm output or the pre-norm one, as the
drafter's ``input_signal`` says, so the proposer declares that signal per drafter. Depth j at position i reads
h^{j-1}_i and c_{i+j} and its output predicts c_{i+j+1}; so depth j at position L-1 drafts c_{L+j}. Each depth keeps
its own KV cache of *true* entries (inputs built from target signals and context tokens only: positions i ≤ L-j). A
round, for j = 1 … k:

1. feed depth j the positions from its committed count up to L-1 in one call: the leading ones are true (they
   become permanent cache slots), the last j-1 read drafted tokens c_{L+1} … c_{L+j-1} and the previous depth's
   speculative outputs (their slots are dropped after the call, and recomputed from the verified tokens next round);
2. the output at L-1 gives draft j (greedy: argmax; sampled chains: drawn from the warped distribution, which is
   then the q of lossless rejection sampling).

Depth j > D reuses module D with a cache of its own (``reuse``): acceptance decays with reuse (REFERENCE.md), so
reports list such chains separately. The tree keeps the greedy chain and adds each depth's next ``top_k - 1``
candidates as leaf siblings of the chain node (their children would need another pass of every deeper module);
tree drafts are deterministic, verified as one-hot q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from infer.attention import drop_holes
from infer.family import ChainSizer, DrafterFamily, ProposerSetting, ReportSettings
from infer.kernels.cpu_linear import install as install_cpu_linear
from infer.proposer import Proposer, TargetSignal
from infer.sampling import SamplingParams, sample_from_probs, warp_logits
from infer.tree import DraftTree, chain
from models.mtp import MTPDrafter, estimate_training
from models.mtp_export import mtp_engine_exports


def input_signal(drafter: MTPDrafter) -> TargetSignal:
    """The target signal the drafter's first module reads (its config's ``input_signal``, a TargetSignal value)."""
    return TargetSignal(drafter.config.input_signal)


class MTPProposer(Proposer):
    """``k`` drafts per round (default D; k > D reuses the last module for depths D+1 … k); ``top_k`` > 1: the chain
    plus ``top_k - 1`` leaf siblings per depth (a tree of 1 + k·top_k nodes). Reads h^0 as the drafter was trained."""

    def __init__(self, drafter: MTPDrafter, k: int | None = None, top_k: int = 1) -> None:
        k = drafter.config.num_modules if k is None else k
        if k < 1 or top_k < 1:
            raise ValueError("k and top_k must be >= 1")
        self.drafter, self.k, self.top_k = drafter.eval(), k, top_k
        self.signal = input_signal(drafter)
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cpu":
            install_cpu_linear(drafter, log=lambda msg: None)  # the blocks' small-row matmuls, layouts measured here

    def module_of(self, depth: int) -> int:
        """0-based module index of 1-based depth ``depth``."""
        return min(depth, self.drafter.config.num_modules) - 1

    # --- runtime hooks -----------------------------------------------------------------------------

    def begin(self, contexts: list[list[int]]) -> None:
        B, H = len(contexts), self.drafter.config.hidden_size
        cap = max(len(c) for c in contexts) + self.k + 64
        # hist[j][b, i]: depth j's output at position i (j = 0: the target's signal); true entries below fed[j]
        self.hist = [torch.zeros(B, cap, H, dtype=self.dtype, device=self.device) for _ in range(self.k + 1)]
        self.fed = torch.zeros(self.k + 1, B, dtype=torch.long)
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * (self.k + 1)
        self.kv_valid = [torch.zeros(B, 0, dtype=torch.bool, device=self.device) for _ in range(self.k + 1)]

    def _grow(self, need: int) -> None:
        cap = self.hist[0].shape[1]
        if need > cap:
            extra = max(need, 2 * cap) - cap
            self.hist = [torch.cat([h, h.new_zeros(h.shape[0], extra, h.shape[2])], 1) for h in self.hist]

    def observe(self, features: torch.Tensor, new_lengths: torch.Tensor) -> None:
        lengths = new_lengths.cpu()
        self._grow(int((self.fed[0] + lengths).max()) + self.k + 1)
        for b, n in enumerate(lengths.tolist()):
            if n:
                start = int(self.fed[0, b])
                self.hist[0][b, start : start + n] = features[b, :n].to(self.dtype)
                self.fed[0, b] = start + n

    def drop_rows(self, keep: torch.Tensor) -> None:
        keep_cpu, keep = keep.cpu(), keep.to(self.device)
        self.hist = [h.index_select(0, keep) for h in self.hist]
        self.fed = self.fed[:, keep_cpu]
        self.kv = [None if kv is None else (kv[0].index_select(0, keep), kv[1].index_select(0, keep)) for kv in self.kv]
        self.kv_valid = [v.index_select(0, keep) for v in self.kv_valid]

    # --- one depth ---------------------------------------------------------------------------------

    def _depth(self, j: int, contexts: list[list[int]], drafts: list[list[int]]) -> torch.Tensor:
        """Feed depth j its positions fed[j] … L-1 (see the module docstring); returns its output at L-1 [B, H]."""
        B = len(contexts)
        L = self.fed[0]
        start = self.fed[j].clone()
        counts = (L - start).tolist()
        m = max(counts)
        tokens = torch.zeros(B, m, dtype=torch.long)
        for b, c in enumerate(contexts):
            s, n = int(start[b]), counts[b]
            ext = c[s + j : int(L[b]) + 1] + drafts[b][: j - 1]  # c_{i+j} for i = s … L-1 (drafts past the root)
            tokens[b, :n] = torch.tensor(ext[:n])
        steps = torch.arange(m)
        valid = steps[None] < torch.tensor(counts)[:, None]  # [B, m]
        positions = (start[:, None] + steps[None]).clamp(max=self.hist[0].shape[1] - 1)
        dev_pos, valid = positions.to(self.device), valid.to(self.device)
        hidden = self.hist[j - 1].gather(1, dev_pos[..., None].expand(-1, -1, self.hist[0].shape[2]))
        causal = torch.ones(m, m, dtype=torch.bool, device=self.device).tril()
        # padded queries see themselves only, so no softmax row is empty (their outputs are discarded)
        new_allowed = (causal[None] & valid[:, None, :]) | torch.eye(m, dtype=torch.bool, device=self.device)[None]
        allowed = torch.cat([self.kv_valid[j][:, None, :].expand(B, m, -1), new_allowed], 2)
        out, keys, values = self.drafter.module_step(
            self.module_of(j), hidden, tokens.to(self.device), dev_pos, allowed, self.kv[j]
        )
        # permanent slots: true entries only (positions ≤ L-j); the speculative tail is recomputed next round
        true_count = (L - j + 1 - start).clamp(min=0)
        true = steps[None] < true_count[:, None]
        self.kv[j] = (keys, values)
        self.kv_valid[j] = torch.cat([self.kv_valid[j], true.to(self.device) & valid], 1)
        self.hist[j].scatter_(1, dev_pos[..., None].expand_as(out), out)  # padded entries land past L-1: unread
        self.fed[j] = torch.maximum(start, L - j + 1)
        self._repack(j)
        rows = torch.arange(B, device=self.device)
        return out[rows, (torch.tensor(counts) - 1).clamp(min=0).to(self.device)]

    def _repack(self, j: int) -> None:
        """Drop the holes the speculative tails leave (j - 1 per round) once they dominate depth j's cache."""
        self.kv_valid[j], (keys, values) = drop_holes(self.kv_valid[j], list(self.kv[j]))
        self.kv[j] = (keys, values)

    # --- proposals ---------------------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, contexts: list[list[int]], params: SamplingParams, generator: torch.Generator) -> DraftTree:
        B = len(contexts)
        roots = torch.tensor([c[-1] for c in contexts], device=self.device)
        has_hidden = (self.fed[0] > 0).to(self.device)
        if not bool(has_hidden.any()):  # one-token prompts before their first round: root only
            return chain(roots[:, None])
        if not bool((self.fed[0] == torch.tensor([len(c) - 1 for c in contexts])).all()):
            raise RuntimeError("MTP proposer: observed signals do not cover every context token but the root")
        self._grow(int(self.fed[0].max()) + self.k + 1)
        sampled = not params.greedy and self.top_k == 1
        drafts: list[list[int]] = [[] for _ in range(B)]
        chain_tokens, siblings, qs = [roots], [], []
        for j in range(1, self.k + 1):
            logits = self.drafter.logits(self._depth(j, contexts, drafts)).float()  # [B, V]
            if sampled:
                q = warp_logits(logits, params).softmax(-1)
                qs.append(q)
                nxt = sample_from_probs(q, torch.rand(B, generator=generator, device=generator.device))
            else:
                top = logits.topk(self.top_k, dim=-1).indices
                nxt = top[:, 0]
                siblings.append(top[:, 1:])
            chain_tokens.append(nxt)
            for b, t in enumerate(nxt.tolist()):
                drafts[b].append(t)
        if self.top_k == 1:
            tokens = torch.stack(chain_tokens, 1)
            valid = has_hidden[:, None].expand(-1, self.k + 1).clone()
            valid[:, 0] = True
            probs = torch.stack(qs + [torch.zeros_like(qs[0])], 1) if qs else None
            return chain(tokens, probs, valid=valid)
        return self._tree(chain_tokens, siblings, has_hidden)

    def _tree(self, chain_tokens: list[torch.Tensor], siblings: list[torch.Tensor], has_hidden) -> DraftTree:
        """Node order: root, then per depth the chain node followed by its siblings (parents precede children)."""
        tokens, parents, chain_node = [chain_tokens[0]], [-1], 0
        for j in range(1, self.k + 1):
            parent, chain_node = chain_node, len(parents)
            tokens.append(chain_tokens[j])
            parents.append(parent)
            for r in range(self.top_k - 1):
                tokens.append(siblings[j - 1][:, r])
                parents.append(parent)
        B, n = chain_tokens[0].shape[0], len(parents)
        valid = has_hidden[:, None].expand(B, n).clone()
        valid[:, 0] = True
        parent_ids = torch.tensor(parents, device=self.device).expand(B, n).clone()
        return DraftTree(torch.stack(tokens, 1), parent_ids, valid)


# --- the family ----------------------------------------------------------------------------------


@dataclass
class MTPReportOptions:
    """The report settings MTP reads beyond the generic ones (eval.report_config.ReportConfig takes these fields)."""

    mtp_top_k: int = 2
    """MTP's tree: the chain plus the next top_k - 1 candidates of every depth as leaves (1 + D·top_k nodes); 1
    leaves it out."""

    def __post_init__(self) -> None:
        if self.mtp_top_k < 1:
            raise ValueError(f"mtp_top_k must be >= 1, got {self.mtp_top_k}")


class MTPReportSettings(ReportSettings, Protocol):
    """What MTP's report rows read: the generic settings and `MTPReportOptions`."""

    mtp_top_k: int


def report_proposers(drafter: MTPDrafter, settings: MTPReportSettings, size: ChainSizer) -> list[ProposerSetting]:
    """MTP in a report (self-speculation): the chain of its D modules; when ``settings.chain_k`` > D, a chain of
    chain_k reusing module D past its depth (its own row: acceptance decays with reuse); and the top-k tree. The
    chain's length is the modules' count, so nothing is sized."""
    D = drafter.config.num_modules
    out = [ProposerSetting(f"chain {D}", lambda: MTPProposer(drafter))]
    if settings.chain_k > D:
        k = settings.chain_k
        out.append(ProposerSetting(f"chain {k} (module {D} reused)", lambda: MTPProposer(drafter, k=k)))
    if settings.mtp_top_k > 1:
        top_k = settings.mtp_top_k
        out.append(ProposerSetting(f"top-{top_k} tree n{1 + D * top_k}", lambda: MTPProposer(drafter, top_k=top_k)))
    return out


FAMILY = DrafterFamily(
    MTPDrafter,
    input_signal,
    report_proposers,
    MTPReportOptions,
    engine_exports=mtp_engine_exports,
    chain=lambda drafter, k: MTPProposer(drafter, k=k),
    recipe_section="mtp",
    estimate=estimate_training,
)
