"""EAGLE-3 proposer: chains and EAGLE-2 dynamic (or static) trees from an `Eagle3Drafter`, fed with target features.

Feature contract (``infer/proposer.py``): ``observe`` receives the target's aux features of the tokens that entered
the target's cache — after prefill those of ``context[:-1]``, after every verify round those of the root and the
accepted nodes. Feature i belongs to context token i. EAGLE-3 pairs ``(fc(f_i), embed(x_{i+1}))`` to predict
``x_{i+2}``, so every pair needs the token after its feature, which the context holds by the next ``propose``.

The drafter's own KV cache uses the runtime's slot layout: ``kv_valid[b, s]`` marks slots holding pairs of row b,
rope positions are explicit (pair i sits at position i, a depth-d draft node at ``pairs + d - 1``, as in the
training-time-test unroll), and holes are never attended to. Each ``propose``:

1. *sync*: feeds every row's pairs not yet cached (ragged across rows: padded, masked) in one drafter forward; the
   output of each row's last pair gives the depth-1 logits and the root's hidden state;
2. drafts a chain (one step per depth) or a tree (``infer.tree_search``: one batched step per depth, a frontier
   node reads its parent's output hidden state and its own token's embedding, and attends to the context pairs,
   its expanded ancestors and itself);
3. closes the draft slots again: only pairs built from *target* features stay valid, so the next sync replaces
   the drafter's guesses with the target's features of whatever was accepted.
"""

from __future__ import annotations

import torch

from infer.attention import drop_holes
from infer.family import ChainSizer, DrafterFamily, ProposerSetting, ReportSettings
from infer.kernels.cpu_linear import install as install_cpu_linear
from infer.proposer import Proposer, TargetSignal
from infer.sampling import SamplingParams, sample_from_probs, warp_logits
from infer.tree import DraftTree, chain
from infer.tree_search import DynamicTreeConfig, build_dynamic_tree, build_static_tree
from models.eagle3 import Eagle3Drafter, FusedStep, estimate_training
from models.eagle3_export import eagle3_engine_exports
from models.target import TargetModel
from models.timing import best_of


class Eagle3Proposer(Proposer):
    """Chain of ``k`` drafts (default), an EAGLE-2 dynamic tree (``tree``) or a static tree (``static_paths``).

    Greedy chains and trees are deterministic drafts (one-hot q for the accept rules); chains at T > 0 are sampled
    from the drafter's warped distribution and verified with it (lossless rejection sampling).
    """

    signal = TargetSignal.AUX

    def __init__(
        self,
        drafter: Eagle3Drafter,
        k: int = 5,
        tree: DynamicTreeConfig | None = None,
        static_paths: list[tuple[int, ...]] | None = None,
    ) -> None:
        if k < 1:
            raise ValueError("k must be >= 1")
        if tree is not None and static_paths is not None:
            raise ValueError("choose a dynamic tree or static paths, not both")
        self.drafter, self.k, self.tree, self.static_paths = drafter.eval(), k, tree, static_paths
        self.fused = FusedStep(drafter)  # the drafter's step in fewer kernels (a snapshot: build after training)
        if self.fused.qkv.weight.device.type == "cpu":
            install_cpu_linear(self.fused, log=lambda msg: None)  # small-row matmul layouts measured on this CPU
        self.device = drafter.fc.weight.device
        self.dtype = drafter.fc.weight.dtype
        self.vocab_size = drafter.config.vocab_size
        self.draft_to_target = drafter.draft_to_target

    # --- runtime hooks -----------------------------------------------------------------------------

    def begin(self, contexts: list[list[int]]) -> None:
        B = len(contexts)
        cfg = self.drafter.config
        self.keys = torch.zeros(B, cfg.num_key_value_heads, 0, cfg.head_dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.kv_valid = torch.zeros(B, 0, dtype=torch.bool, device=self.device)
        self.fed = [0] * B  # pairs of each row in the cache (= next pair position)
        self.pending: list[list[torch.Tensor]] = [[] for _ in range(B)]  # observed features not yet fed

    def observe(self, features: torch.Tensor, new_lengths: torch.Tensor) -> None:
        for b, n in enumerate(new_lengths.tolist()):
            if n:
                self.pending[b].append(features[b, :n].to(self.dtype))

    def drop_rows(self, keep: torch.Tensor) -> None:
        keep = keep.to(self.device)
        self.keys, self.values = self.keys.index_select(0, keep), self.values.index_select(0, keep)
        self.kv_valid = self.kv_valid.index_select(0, keep)
        self.fed = [self.fed[i] for i in keep.tolist()]
        self.pending = [self.pending[i] for i in keep.tolist()]

    # --- drafter calls -----------------------------------------------------------------------------

    def _append(self, out, new_valid: torch.Tensor) -> None:
        """Adopt a step's cache (the old one with the new tokens appended) and mark the new slots."""
        self.keys, self.values = out.keys, out.values
        self.kv_valid = torch.cat([self.kv_valid, new_valid], 1)

    def _sync(self, contexts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed the uncached pairs. Returns root hidden [B, H], depth-1 logits [B, Vd], has_pairs [B] bool."""
        B = len(contexts)
        feats = [torch.cat(p) if p else None for p in self.pending]
        counts = [0 if f is None else f.shape[0] for f in feats]
        m = max(counts)
        H = self.drafter.config.hidden_size
        if m == 0:  # only happens for one-token prompts before their first round; they get no drafts
            z = torch.zeros(B, H, dtype=self.dtype, device=self.device)
            return (
                z,
                torch.zeros(B, self.drafter.config.draft_vocab_size, device=self.device),
                torch.zeros(B, dtype=torch.bool, device=self.device),
            )
        A = self.drafter.fc.in_features
        features = torch.zeros(B, m, A, dtype=self.dtype, device=self.device)
        tokens = torch.zeros(B, m, dtype=torch.long, device=self.device)
        valid = torch.zeros(B, m, dtype=torch.bool, device=self.device)
        for b, f in enumerate(feats):
            if f is None:
                continue
            n, start = counts[b], self.fed[b]
            if start + n >= len(contexts[b]):
                raise RuntimeError(f"row {b}: features of {start + n} tokens but a context of {len(contexts[b])}")
            features[b, :n] = f
            tokens[b, :n] = torch.tensor(contexts[b][start + 1 : start + 1 + n], device=self.device)
            valid[b, :n] = True
        start = torch.tensor(self.fed, device=self.device)
        positions = start[:, None] + torch.arange(m, device=self.device)[None]
        causal = torch.ones(m, m, dtype=torch.bool, device=self.device).tril()
        # padded queries see themselves only so no softmax row is empty (their outputs are discarded)
        new_allowed = (causal[None] & valid[:, None, :]) | torch.eye(m, dtype=torch.bool, device=self.device)[None]
        allowed = torch.cat([self.kv_valid[:, None, :].expand(B, m, -1), new_allowed], 2)
        out = self.fused.step(
            self.fused.project_features(features),
            tokens,
            positions,
            allowed,
            self.keys,
            self.values,
            with_logits=False,
        )
        self._append(out, valid)
        self.fed = [f + n for f, n in zip(self.fed, counts)]
        self.pending = [[] for _ in range(B)]
        rows = torch.arange(B, device=self.device)
        last = (torch.tensor(counts, device=self.device) - 1).clamp(min=0)
        # a row without new pairs this round cannot happen after the first round (the root is always observed)
        has_pairs = torch.tensor([f > 0 for f in self.fed], device=self.device)
        hidden = out.hidden[rows, last]
        return hidden, self.fused.logits(hidden), has_pairs

    def _full_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[.., Vd] draft-vocab logits → [.., V] float32 target-vocab logits (-inf outside the draft vocab), for
        sampled chains whose q must be a distribution over the target vocabulary."""
        full = torch.full((*draft_logits.shape[:-1], self.vocab_size), float("-inf"), device=self.device)
        return full.index_copy_(-1, self.draft_to_target, draft_logits.float())

    def _close_draft_slots(self, proposal_start: int) -> None:
        self.kv_valid = self.kv_valid[:, :proposal_start]
        self.keys, self.values = self.keys[:, :, :proposal_start], self.values[:, :, :proposal_start]
        # rows sync different pair counts, so padding slots leave holes
        self.kv_valid, (self.keys, self.values) = drop_holes(self.kv_valid, [self.keys, self.values])

    # --- proposals ---------------------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, contexts: list[list[int]], params: SamplingParams, generator: torch.Generator) -> DraftTree:
        root_hidden, root_logits, has_pairs = self._sync(contexts)
        proposal_start = self.kv_valid.shape[1]
        roots = torch.tensor([c[-1] for c in contexts], device=self.device)
        if not bool(has_pairs.any()):
            tree = chain(roots[:, None])
        elif self.tree is not None or self.static_paths is not None:
            tree = self._propose_tree(roots, root_hidden, root_logits)
        else:
            tree = self._propose_chain(roots, root_hidden, root_logits, params, generator)
        self._close_draft_slots(proposal_start)
        if not bool(has_pairs.all()):
            tree.valid[~has_pairs.to(tree.valid.device), 1:] = False
        return tree

    def _propose_chain(self, roots, hidden, draft_logits, params, generator) -> DraftTree:
        B = roots.shape[0]
        tokens, qs = [roots], []
        depth_pos = torch.tensor(self.fed, device=self.device)  # position of the depth-1 node
        one = torch.ones(B, 1, 1, dtype=torch.bool, device=self.device)
        for i in range(self.k):
            if params.greedy:
                # argmax in draft space: draft ids are sorted by target id, so ties resolve as over the full vocab
                nxt = self.draft_to_target[draft_logits.argmax(-1)]
            else:
                q = warp_logits(self._full_vocab(draft_logits), params).softmax(-1)
                qs.append(q)
                nxt = sample_from_probs(q, torch.rand(B, generator=generator, device=generator.device))
            tokens.append(nxt)
            if i + 1 < self.k:
                # the new node sees the row's valid pairs and, through kv_valid, the chain drafted so far
                allowed = torch.cat([self.kv_valid[:, None, :], one], 2)
                out = self.fused.step(
                    hidden[:, None], nxt[:, None], (depth_pos + i)[:, None], allowed, self.keys, self.values
                )
                self._append(out, one[:, 0])
                hidden, draft_logits = out.hidden[:, 0], out.logits[:, 0]
        draft_probs = torch.stack(qs + [torch.zeros_like(qs[0])], 1) if qs else None
        return chain(torch.stack(tokens, 1), draft_probs)

    def _propose_tree(self, roots, root_hidden, root_logits) -> DraftTree:
        """The tree is searched in draft-id space (log-softmax and top-k over Vd, not V) and mapped to target ids."""
        B = roots.shape[0]
        start = self.kv_valid.shape[1]
        pair_count = torch.tensor(self.fed, device=self.device)
        expanded_hidden: list[torch.Tensor] = []  # [B, k, H] per expand call, in expansion order

        def expand(frontier_ids: torch.Tensor, frontier_depth: int, frontier_anc: torch.Tensor) -> torch.Tensor:
            """Score frontier [B, k] (draft ids) at depth ``frontier_depth``; ``frontier_anc[b, i, j]``: the j-th
            expanded node (= drafter cache slot start + j) is an ancestor of frontier node i. → log-probs [B, k, Vd]."""
            k = frontier_ids.shape[1]
            if frontier_depth == 1:
                parent_hidden = root_hidden[:, None].expand(B, k, -1)
            else:
                # parent = deepest expanded ancestor = the last True column (expansion order is depth order)
                cols = torch.arange(frontier_anc.shape[2], device=self.device)
                parent = torch.where(frontier_anc, cols, -1).max(-1).values  # [B, k]
                every = torch.cat(expanded_hidden, 1)
                parent_hidden = every.gather(1, parent[..., None].expand(-1, -1, every.shape[-1]))
            own = torch.eye(k, dtype=torch.bool, device=self.device)[None].expand(B, k, k)
            allowed = torch.cat([self.kv_valid[:, None, :start].expand(B, k, -1), frontier_anc, own], 2)
            positions = (pair_count + frontier_depth - 1)[:, None].expand(B, k)
            out = self.fused.step(
                parent_hidden, self.draft_to_target[frontier_ids], positions, allowed, self.keys, self.values
            )
            self._append(out, torch.ones(B, k, dtype=torch.bool, device=self.device))
            expanded_hidden.append(out.hidden)
            return out.logits.float().log_softmax(-1)

        root_logprobs = root_logits.float().log_softmax(-1)
        if self.static_paths is not None:
            tree = build_static_tree(roots, root_logprobs, expand, self.static_paths)
        else:
            tree = build_dynamic_tree(roots, root_logprobs, expand, self.tree)
        tree.tokens[:, 1:] = self.draft_to_target[tree.tokens[:, 1:]]  # node 0 is the root, already a target id
        return tree


# --- the family ----------------------------------------------------------------------------------


def report_proposers(drafter: Eagle3Drafter, settings: ReportSettings, size: ChainSizer) -> list[ProposerSetting]:
    """EAGLE-3 in a report: a chain of ``settings.chain_k`` drafts (its length sized on the measuring machine) and the
    EAGLE-2 dynamic tree (``settings.tree``), each left out when its size is 0."""
    out = []
    if settings.chain_k:
        k = size(lambda n: Eagle3Proposer(drafter, k=n), settings.chain_k)
        out.append(ProposerSetting(f"chain {k}", lambda: Eagle3Proposer(drafter, k=k)))
    if settings.tree_total_tokens:
        tree = settings.tree
        out.append(ProposerSetting(settings.tree_name, lambda: Eagle3Proposer(drafter, tree=tree)))
    return out


@torch.inference_mode()
def step_timings(drafter: Eagle3Drafter, target: TargetModel, context_len: int, reps: int) -> dict[str, float]:
    """Median seconds of one drafter step (1 new token after ``context_len`` cached pairs), by path: the module's own
    ``step`` and the fused one (`FusedStep`)."""
    cfg, dtype = drafter.config, drafter.fc.weight.dtype
    kv = torch.randn(1, cfg.num_key_value_heads, context_len, cfg.head_dim, dtype=dtype)
    args = (
        torch.randn(1, 1, cfg.hidden_size, dtype=dtype),
        torch.tensor([[1]]),
        torch.tensor([[context_len]]),
        torch.ones(1, 1, context_len + 1, dtype=torch.bool),
        kv,
        kv.clone(),
    )
    steps = {"module": drafter.step, "fused": FusedStep(drafter).step}
    return {name: best_of(lambda step=step: step(*args), reps, target.device).median for name, step in steps.items()}


FAMILY = DrafterFamily(
    Eagle3Drafter,
    lambda drafter: Eagle3Proposer.signal,
    report_proposers,
    step_timings=step_timings,
    engine_exports=eagle3_engine_exports,
    chain=lambda drafter, k: Eagle3Proposer(drafter, k=k),
    recipe_section="drafter",
    estimate=estimate_training,
)
