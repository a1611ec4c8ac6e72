"""Building draft trees from an autoregressive drafter: static (rank paths) and dynamic (EAGLE-2).

Both builders talk to the drafter through one callback, ``expand``, which scores a frontier of nodes
in one batched drafter call, so the draft model, EAGLE-3 and MTP proposers share them.

Static trees (Medusa-style, Cai et al. 2024): a fixed list of root-to-node rank paths, e.g.
``(0,), (1,), (0, 0)``: the top-1 and top-2 tokens after the root and the top-1 token after the
first of them. Every node with children is expanded once per depth.

Dynamic trees (EAGLE-2, Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic
Draft Trees"). Expansion: at each depth the ``top_k`` frontier nodes are scored by the drafter in one batched
call; each yields its ``top_k`` children scored by cumulative log-probability (the drafter's
confidence that the whole path is right), and the global ``top_k`` of those become the next
frontier. Rerank: of all candidates, keep the ``total_tokens - 1`` with the highest scores. A
child's score never exceeds its parent's, and ties are broken towards the earlier (shallower) node,
so every kept node's ancestors are kept too. Children are top-k picks, not samples: the accept
rules treat them as deterministic drafts (one-hot q), which keeps sampling lossless.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infer.tree import DraftTree, paths_to_parents


@dataclass
class DynamicTreeConfig:
    top_k: int = 10
    """Children per expanded node and frontier width (EAGLE-2 default 10; 4 suits a CPU verify)."""
    depth: int = 5
    """Maximum draft depth (EAGLE-2: 5-7); depth - 1 drafter calls per round after the first."""
    total_tokens: int = 60
    """Tree size including the root (EAGLE-2 default 60 on GPU; ≤ 16 on this project's CPU)."""

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.depth < 1 or self.total_tokens < 2:
            raise ValueError("need top_k >= 1, depth >= 1 and total_tokens >= 2")


Expand = Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]
"""expand(frontier_tokens [B, k], frontier_depth, ancestors [B, k, k * (frontier_depth - 1)]) → log-probs [B, k, V].
``ancestors[b, i, j]`` says whether the j-th previously expanded node (in expansion order) is an
ancestor of frontier node i, so a drafter with its own KV cache can build its tree mask."""


@torch.no_grad()
def build_dynamic_tree(
    roots: torch.Tensor, root_logprobs: torch.Tensor, expand: Expand, cfg: DynamicTreeConfig
) -> DraftTree:
    """roots [B], root_logprobs [B, V] (drafter log-probs of the token after the root) → DraftTree."""
    B, V = root_logprobs.shape
    k = min(cfg.top_k, V)
    dev = roots.device
    rows = torch.arange(B, device=dev)
    # candidate list (excluding the root), in creation order = depth order
    scores, tokens = root_logprobs.topk(k, dim=-1)
    cand_scores, cand_tokens = [scores], [tokens]
    cand_parents = [torch.zeros(B, k, dtype=torch.long, device=dev)]  # global ids; root = 0
    frontier_ids = torch.arange(1, k + 1, device=dev).expand(B, k)  # global ids of the frontier
    frontier_scores, frontier_tokens = scores, tokens
    ancestors = torch.zeros(B, k, 0, dtype=torch.bool, device=dev)
    n_cands = k
    for depth in range(1, cfg.depth):
        logp = expand(frontier_tokens, depth, ancestors)  # [B, k, V]
        child_lp, child_tok = logp.topk(k, dim=-1)
        child_scores = (frontier_scores[:, :, None] + child_lp).reshape(B, k * k)
        child_tokens = child_tok.reshape(B, k * k)
        child_parents = frontier_ids[:, :, None].expand(B, k, k).reshape(B, k * k)
        cand_scores.append(child_scores)
        cand_tokens.append(child_tokens)
        cand_parents.append(child_parents)
        # next frontier: global top-k among this depth's candidates
        top_scores, top_idx = child_scores.topk(k, dim=-1)
        parent_slot = top_idx // k  # which frontier node (0..k-1) each new frontier node hangs from
        expanded_now = torch.nn.functional.one_hot(parent_slot, k).bool()
        ancestors = torch.cat(
            [ancestors.gather(1, parent_slot[..., None].expand(-1, -1, ancestors.shape[2])), expanded_now], 2
        )
        frontier_ids = 1 + n_cands + top_idx
        frontier_scores = top_scores
        frontier_tokens = child_tokens.gather(1, top_idx)
        n_cands += k * k

    all_scores = torch.cat(cand_scores, 1)
    all_tokens = torch.cat(cand_tokens, 1)
    all_parents = torch.cat(cand_parents, 1)
    keep_n = min(cfg.total_tokens - 1, all_scores.shape[1])
    # stable sort on -score: equal scores keep creation order, so a parent precedes its child
    order = torch.sort(-all_scores, dim=1, stable=True).indices[:, :keep_n]
    kept = torch.sort(order, dim=1).values  # topological (creation) order
    # map global ids (1-based candidate index) of kept nodes to their position in the new tree
    remap = torch.full((B, n_cands + 1), -1, dtype=torch.long, device=dev)
    remap[:, 0] = 0
    remap[rows[:, None], kept + 1] = torch.arange(1, keep_n + 1, device=dev).expand(B, keep_n)
    parents = remap.gather(1, all_parents.gather(1, kept))
    if bool((parents < 0).any()):
        raise RuntimeError("dynamic tree lost an ancestor (non-monotone scores?)")
    tree_tokens = torch.cat([roots[:, None], all_tokens.gather(1, kept)], 1)
    tree_parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), parents], 1)
    # a node's value: the drafter's probability of its whole path (the root is always accepted)
    values = torch.cat([torch.ones(B, 1, device=dev), all_scores.gather(1, kept).float().exp()], 1)
    return DraftTree(tree_tokens, tree_parents, torch.ones_like(tree_tokens, dtype=torch.bool), values=values)


@torch.no_grad()
def build_static_tree(
    roots: torch.Tensor, root_logprobs: torch.Tensor, expand: Expand, paths: list[tuple[int, ...]]
) -> DraftTree:
    """roots [B], root_logprobs [B, V], rank paths → DraftTree with node order from ``paths_to_parents``."""
    parents, ordered = paths_to_parents(paths)
    B = roots.shape[0]
    dev = roots.device
    n = len(parents)
    tokens = torch.zeros(B, n, dtype=torch.long, device=dev)
    tokens[:, 0] = roots
    children: dict[int, list[int]] = {}
    for i in range(1, n):
        children.setdefault(parents[i], []).append(i)

    def fill(parent: int, logp: torch.Tensor) -> None:
        kids = children.get(parent, [])
        ranks = [ordered[c - 1][-1] for c in kids]
        top = logp.topk(max(ranks) + 1, dim=-1).indices
        for c, r in zip(kids, ranks):
            tokens[:, c] = top[:, r]

    fill(0, root_logprobs)
    expanded: list[int] = []
    max_depth = max(len(p) for p in ordered)
    for depth in range(1, max_depth):
        frontier = [i for i in range(1, n) if len(ordered[i - 1]) == depth and i in children]
        anc = torch.zeros(B, len(frontier), len(expanded), dtype=torch.bool, device=dev)
        for fi, node in enumerate(frontier):
            a = parents[node]
            while a > 0:
                anc[:, fi, expanded.index(a)] = True
                a = parents[a]
        logp = expand(tokens[:, frontier], depth, anc)
        for fi, node in enumerate(frontier):
            fill(node, logp[:, fi])
        expanded += frontier
    return DraftTree(
        tokens, torch.tensor(parents, device=dev).expand(B, n).clone(), torch.ones(B, n, dtype=torch.bool, device=dev)
    )


def best_rank_paths(rank_accuracy: list[list[float]], budget: int) -> list[tuple[int, ...]]:
    """The static tree of at most ``budget`` draft nodes with the largest expected accepted length.

    ``rank_accuracy[d][r]``: measured probability that the r-th most likely candidate of draft position d (Medusa:
    head d) is the token the target emits there, given the earlier positions were right. A node at rank path
    (r_0, …, r_d) is accepted with probability Π_i rank_accuracy[i][r_i] (the positions taken as independent, as
    Medusa's calibrated trees do), and the expected accepted length of a tree is the sum of its nodes' values.
    Values fall along every path, so the best tree of n nodes is the n most valuable paths: grown greedily, best
    frontier node first (Medusa §3.3.1's construction). Returns paths in (depth, path) order.
    """
    if budget < 1:
        return []
    depth_max = len(rank_accuracy)
    frontier = [(-rank_accuracy[0][r], (r,)) for r in range(len(rank_accuracy[0]))] if depth_max else []
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < budget:
        neg_value, path = heapq.heappop(frontier)
        chosen.append(path)
        d = len(path)
        if d < depth_max:
            for r, acc in enumerate(rank_accuracy[d]):
                heapq.heappush(frontier, (neg_value * acc, (*path, r)))
    return sorted(chosen, key=lambda p: (len(p), p))


def expected_accepted(rank_accuracy: list[list[float]], paths: list[tuple[int, ...]]) -> float:
    """Σ over the tree's nodes of Π_i rank_accuracy[i][r_i]: expected accepted drafts per round (τ − 1)."""
    total = 0.0
    for path in paths:
        value = 1.0
        for d, r in enumerate(path):
            value *= rank_accuracy[d][r]
        total += value
    return total
