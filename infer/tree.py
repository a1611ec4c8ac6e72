"""Draft trees: the object every proposer returns and every verify forward consumes.

Node 0 of each row is the *root*: the last accepted token, whose KV is not yet in the target's
cache. Nodes 1..n-1 are draft tokens; ``parents[b, i] < i`` for every non-root node (topological
order), so depth and ancestor sets are cheap to derive. Rows of a batch share the node count ``n``;
a row with fewer real nodes marks the rest ``valid = False`` and they are never accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor
    """[B, n] int64 token ids; column 0 is the root (last accepted token)."""
    parents: torch.Tensor
    """[B, n] int64 parent node index; -1 for the root."""
    valid: torch.Tensor
    """[B, n] bool; False for padding nodes (rows with fewer drafts than n)."""
    draft_probs: torch.Tensor | None = None
    """[B, n, V] float: row i is the draft distribution q from which node i's children were sampled
    (without replacement, in child order). None for deterministic (top-k / greedy) drafts, which
    the accept rules treat as one-hot q."""
    values: torch.Tensor | None = None
    """[B, n] float: the proposer's estimate that each node is accepted (for EAGLE-2 trees the drafter's probability
    of the node's whole path), which `infer.pricing` ranks nodes by; None where the proposer gives none."""
    siblings_sampled: bool = False
    """Declares that a node's several children were *drawn* from its q without replacement (e.g. Gumbel-top-k).
    Required to pass draft_probs with a node of two or more children: siblings *ranked* by top-k must be verified
    one-hot (draft_probs None); verified against the q they were ranked by, the output is biased."""

    def __post_init__(self) -> None:
        if self.tokens.shape != self.parents.shape or self.tokens.shape != self.valid.shape:
            raise ValueError("tokens, parents and valid must have the same [B, n] shape")
        if not bool((self.parents[:, 0] == -1).all()):
            raise ValueError("node 0 must be the root (parent -1)")
        if not bool(self.valid[:, 0].all()):
            raise ValueError("the root (node 0) must be valid in every row")
        if self.values is not None and self.values.shape != self.tokens.shape:
            raise ValueError(f"values must be [B, n] like tokens; got {tuple(self.values.shape)}")
        if self.draft_probs is not None and self.draft_probs.shape[:2] != self.tokens.shape:
            raise ValueError(f"draft_probs must be [B, n, V]; got {tuple(self.draft_probs.shape)}")
        if self.draft_probs is not None and not self.siblings_sampled and self.tokens.shape[1] > 2:
            children = torch.zeros_like(self.parents).scatter_add_(
                1, self.parents[:, 1:].clamp(min=0), self.valid[:, 1:].long()
            )
            if bool((children > 1).any()):
                raise ValueError(
                    "draft_probs with a node of several children: top-k siblings must be verified one-hot "
                    "(draft_probs=None); pass siblings_sampled=True only if they were drawn from q without replacement"
                )
        idx = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        if not bool((self.parents[:, 1:] < idx[1:]).all()) or not bool((self.parents[:, 1:] >= 0).all()):
            raise ValueError("every non-root node needs a parent with a smaller index")

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def depths(self) -> torch.Tensor:
        """[B, n] int64 depth (root = 0)."""
        depth = torch.zeros_like(self.parents)
        for i in range(1, self.num_nodes):
            depth[:, i] = depth.gather(1, self.parents[:, i : i + 1]).squeeze(1) + 1
        return depth

    def ancestor_mask(self) -> torch.Tensor:
        """[B, n, n] bool: ``mask[b, i, j]`` is True when node j is node i or one of its ancestors."""
        B, n = self.tokens.shape
        mask = torch.zeros(B, n, n, dtype=torch.bool, device=self.tokens.device)
        mask[:, 0, 0] = True
        rows = torch.arange(B, device=self.tokens.device)
        for i in range(1, n):
            mask[:, i] = mask[rows, self.parents[:, i]]
            mask[:, i, i] = True
        return mask


def chain(
    tokens: torch.Tensor, draft_probs: torch.Tensor | None = None, valid: torch.Tensor | None = None
) -> DraftTree:
    """A chain draft: ``tokens[B, n]`` = root followed by n-1 drafts, each the child of the previous."""
    B, n = tokens.shape
    parents = torch.arange(-1, n - 1, device=tokens.device).expand(B, n).clone()
    if valid is None:
        valid = torch.ones(B, n, dtype=torch.bool, device=tokens.device)
    return DraftTree(tokens, parents, valid, draft_probs)


def paths_to_parents(paths: list[tuple[int, ...]]) -> tuple[list[int], list[tuple[int, ...]]]:
    """Static tree from root-to-node rank paths (Medusa ``mc_sim`` style).

    ``(0,)`` is the top-1 candidate at depth 1, ``(0, 1)`` the second candidate below it, etc.
    Returns ``parents`` for nodes 0..len(paths) (node 0 = root) and the paths sorted by
    (depth, path) so that parents precede children. Every prefix of a path must itself be a path.
    """
    ordered = sorted(set(map(tuple, paths)), key=lambda p: (len(p), p))
    index = {(): 0}
    parents = [-1]
    for i, p in enumerate(ordered, start=1):
        if len(p) == 0:
            raise ValueError("the empty path is the root; do not list it")
        if p[:-1] not in index:
            raise ValueError(f"path {p} has no parent path {p[:-1]} in the tree")
        index[p] = i
        parents.append(index[p[:-1]])
    return parents, ordered
