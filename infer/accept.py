"""Accept rules for speculative verification of a draft tree (chains are trees with one child per node).

Each rule is a pure function of the draft tree, the target's outputs at every node and (for the
stochastic rules) uniforms given as inputs, so the torch reference here and the GPU kernels in
``infer/kernels`` can be compared exactly. Conventions (see ``infer/tree.py``):

- node 0 is the root (last accepted token); the target output at node i is the distribution of the
  token *after* node i;
- the children of node i are the valid nodes j with ``parents[b, j] == i``, tried in increasing j
  ("sibling order"); invalid nodes are never children, hence never accepted;
- every rule walks the nodes once in index order (topological, since ``parents[b, j] < j``), keeping
  per row the current node ``cur``: a node j is *tried* when it is a valid child of ``cur``. Because
  children have larger indices than their parent, one pass sees every child of every node the walk
  reaches, in sibling order. All work is vectorised over the batch B; only the loop over nodes is Python.

Arithmetic is float32 throughout. The order of operations is spelled out in comments where a kernel
must follow it to reproduce the same decisions. Elementwise steps are exact IEEE float32 and so
reproducible anywhere; the only order-dependent steps are the reductions over V: the row sums that
renormalise a residual (``torch.sum``, float32, order unspecified) and the cumulative sum inside
``sample_from_probs`` (torch CPU accumulates it in float64). A kernel reducing in another order can
differ in the last ulp of a normaliser, which changes a decision only when a uniform falls within
~1e-7 (relative) of a threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.sampling import SamplingParams, greedy_ids, sample_from_probs, target_probs
from infer.tree import DraftTree


@dataclass
class AcceptResult:
    path: torch.Tensor
    """[B, n] int64: accepted node indices in order, ``path[:, 0] == 0`` (root), padded with -1."""
    length: torch.Tensor
    """[B] int64: entries in ``path`` (>= 1, the root counts); accepted drafts = ``length - 1``."""
    bonus: torch.Tensor
    """[B] int64: the token emitted after the last accepted node."""


def _start(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk state: rows [B], cur [B] (= root), path [B, n] (root then -1), length [B] (= 1)."""
    B, n = tree.tokens.shape
    dev = tree.tokens.device
    path = torch.full((B, n), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    return (
        torch.arange(B, device=dev),
        torch.zeros(B, dtype=torch.int64, device=dev),
        path,
        torch.ones(B, dtype=torch.int64, device=dev),
    )


def _advance(
    rows: torch.Tensor, cur: torch.Tensor, path: torch.Tensor, length: torch.Tensor, accepted: torch.Tensor, j: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the rows where ``accepted`` [B] holds to node j; returns (cur, length). Writes ``path`` in place.

    Before step j a row has accepted at most j-1 drafts, so ``length <= j < n`` is always in range.
    """
    path[rows, length] = torch.where(accepted, j, path[rows, length])
    return torch.where(accepted, j, cur), length + accepted.long()


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> AcceptResult:
    """Greedy verification (T = 0): follow the target's argmax through the tree.

    ``target_logits`` [B, n, V]. From the root, t* = argmax of the target at the current node (first
    maximal index on ties, as ``torch.argmax``); move to the first child (sibling order) whose token is
    t*; stop when none matches. The bonus is t* at the stop node, so the emitted tokens are exactly
    what greedy decoding of the target would produce (Leviathan et al. 2023, T -> 0 limit).
    """
    return greedy_walk(tree, greedy_ids(target_logits))


def greedy_walk(tree: DraftTree, tstar: torch.Tensor) -> AcceptResult:
    """``accept_greedy`` given the target argmax ``tstar`` [B, n] per node (kernels may compute it)."""
    tstar = tstar.long()
    rows, cur, path, length = _start(tree)
    for j in range(1, tree.num_nodes):
        tried = tree.valid[:, j] & (tree.parents[:, j] == cur)
        accepted = tried & (tree.tokens[:, j] == tstar[rows, cur])
        cur, length = _advance(rows, cur, path, length, accepted, j)
    return AcceptResult(path, length, tstar[rows, cur])


def accept_rejection(tree: DraftTree, p: torch.Tensor, accept_u: torch.Tensor, sample_u: torch.Tensor) -> AcceptResult:
    """Lossless rejection sampling over a tree: the emitted tokens follow the target's (warped) distribution.

    Chain: Leviathan et al. 2023 ("Fast inference from transformers via speculative decoding") and
    Chen et al. 2023 ("Accelerating LLM decoding with speculative sampling"). Siblings: SpecInfer's
    multi-candidate rule (Miao et al. 2024), for candidates drawn without replacement as in Jeon et al.
    2024 (recursive speculative decoding).

    Shapes: ``p`` [B, n, V] target probabilities per node, already warped
    (``infer.sampling.target_probs``); ``tree.draft_probs`` q [B, n, V] (row i = the distribution node
    i's children were drawn from, without replacement, in child order; each row sums to 1) or None for
    deterministic drafts, treated as one-hot q; ``accept_u`` [B, n]: the uniform in [0, 1) of the
    accept test of node j; ``sample_u`` [B, n]: the uniform that draws the bonus at stop node i.

    At node i with residual target r (= p_i on arrival) and residual draft q (= q_i on arrival), each
    child x is tried in sibling order:
      accept  iff ``u * q(x) < r(x)``                      (i.e. with prob min(1, r(x)/q(x)), float32)
      reject: r <- max(r - q, 0) / sum(max(r - q, 0))    (subtract, clamp, float32 sum, divide)
              q <- q with q(x) = 0, then / sum            (the candidate is not drawn again)
    With one-hot q the test is ``u < r(x)`` and the residual is r with r(x) = 0, renormalised.
    Accepting moves to the child with fresh (p, q) of that node; when no child is accepted (or the node
    is a leaf) the bonus is ``sample_from_probs(r, sample_u[b, i])``.

    Degenerate cases (none occurs in exact arithmetic with well-formed inputs):
    - q(x) == 0 for a drafted x (the candidate was not drawn from q, or all q mass was already used by
      earlier siblings): x is treated as a deterministic candidate, i.e. q -> one-hot(x) for this test.
      That step is still lossless (a fixed candidate accepted w.p. r(x), r(x) zeroed on rejection), where
      "accept iff r(x) > 0" (the limit of r/q) would over-emit x.
    - p(x) == 0 (top-k / top-p removed x, or an earlier sibling zeroed it): ``u * q(x) < 0`` is false,
      so x is never accepted; the residual keeps the zeros of p, so the bonus stays in p's support.
    - all-zero residual max(r - q, 0): possible only when r <= q everywhere, i.e. r == q up to rounding,
      where rejection has probability ~2^-24. Then r is kept unchanged (the exact residual is 0/0;
      keeping the target is the choice that cannot leave its support).
    """
    B, n, V = p.shape
    p = p.float()
    q = None if tree.draft_probs is None else tree.draft_probs.float()
    rows, cur, path, length = _start(tree)
    r = p[:, 0].clone()  # [B, V] residual target at the current node
    qr = None if q is None else q[:, 0].clone()  # [B, V] residual draft at the current node
    for j in range(1, n):
        tried = tree.valid[:, j] & (tree.parents[:, j] == cur)
        x = tree.tokens[:, j : j + 1]  # [B, 1]
        onehot = torch.zeros_like(r).scatter_(1, x, 1.0)  # [B, V]
        rx = r.gather(1, x).squeeze(1)
        qx = torch.zeros_like(rx) if qr is None else qr.gather(1, x).squeeze(1)
        det = qx <= 0  # deterministic draft, or degenerate q(x) == 0: use one-hot q for this test
        qx = torch.where(det, 1.0, qx)
        accepted = tried & (accept_u[:, j].float() * qx < rx)
        rejected = tried & ~accepted
        # residual after rejecting x: clamp(r - q, 0) / sum (for one-hot q: r with r(x) = 0, renormalised;
        # r(x) - 1 < 0 since rejection implies r(x) <= u < 1)
        res = (r - (onehot if qr is None else torch.where(det[:, None], onehot, qr))).clamp_min(0.0)
        s = res.sum(-1, keepdim=True)
        res = torch.where(s > 0, res / s, r)
        r = torch.where(accepted[:, None], p[:, j], torch.where(rejected[:, None], res, r))
        if qr is not None:
            qz = qr.masked_fill(onehot.bool(), 0.0)
            sq = qz.sum(-1, keepdim=True)
            qz = torch.where(sq > 0, qz / sq, qz)  # all used up: stays 0, later siblings take the one-hot path
            qr = torch.where(accepted[:, None], q[:, j], torch.where(rejected[:, None], qz, qr))
        cur, length = _advance(rows, cur, path, length, accepted, j)
    return AcceptResult(path, length, sample_from_probs(r, sample_u[rows, cur]))


def accept_typical(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    sample_u: torch.Tensor,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> AcceptResult:
    """Medusa typical acceptance (Cai et al. 2024, "Medusa", sec. 2.3.1). LOSSY: opt-in only.

    The output does *not* follow the target distribution; it trades fidelity for acceptance.
    ``target_logits`` [B, n, V]; ``sample_u`` [B, n] uniforms for the bonus at the stop node.
    p = ``target_probs(logits, params)`` per node (temperature, top-k, top-p; one-hot when greedy),
    H(p) = -sum p log p (0 log 0 = 0), threshold = min(epsilon, delta * exp(-H)). A child x is accepted
    when p(x) > threshold at its parent; the walk moves to the first passing child in sibling order and
    stops when none passes. The bonus is ``sample_from_probs(p, sample_u[b, i])`` at the stop node i.
    At temperature 0, p is one-hot (H = 0), so only the argmax passes: the rule equals greedy.
    """
    probs = target_probs(target_logits, params).float()  # [B, n, V]
    entropy = -torch.special.xlogy(probs, probs).sum(-1)  # [B, n]
    threshold = torch.clamp_max(delta * torch.exp(-entropy), epsilon)  # [B, n]
    rows, cur, path, length = _start(tree)
    for j in range(1, tree.num_nodes):
        tried = tree.valid[:, j] & (tree.parents[:, j] == cur)
        px = probs[rows, cur, tree.tokens[:, j]]
        accepted = tried & (px > threshold[rows, cur])
        cur, length = _advance(rows, cur, path, length, accepted, j)
    return AcceptResult(path, length, sample_from_probs(probs[rows, cur], sample_u[rows, cur]))


def emitted_tokens(tree: DraftTree, result: AcceptResult) -> list[list[int]]:
    """Per row: the accepted draft tokens (root excluded) followed by the bonus token."""
    out = []
    for b in range(tree.batch_size):
        nodes = result.path[b, 1 : int(result.length[b])]
        out.append(tree.tokens[b, nodes].tolist() + [int(result.bonus[b])])
    return out
