"""Verify-step kernels, dispatched by device: Triton on CUDA tensors, the torch reference elsewhere.

Public API:

- ``verify_greedy(tree, target)``: tree greedy verify; ``target`` is logits [B, n, V] or the target
  argmax [B, n] (int). Reference: ``infer.accept.accept_greedy``.
- ``verify_rejection(tree, p, accept_u, sample_u)``: tree rejection sampling with q = ``tree.draft_probs``
  (None: one-hot drafts). Reference: ``infer.accept.accept_rejection``.
- ``compact_kv(kv, keep)``: ``out[b, h, j, :] = kv[b, h, keep[b, j], :]``, kv [B, H, S, D], keep [B, L];
  reference ``compact_kv_reference`` (a ``torch.gather``).
- ``rejection_disagreement(...)``: float64 replay that tells a rounding-level tie from a bug when a
  kernel's rejection-sampling result differs from the reference.

Each dispatcher takes ``force_triton``: None (default) = Triton iff the tensors are on CUDA and Triton
imports; True = always Triton (on CPU tensors through Triton's interpreter, which is how the tests run the
kernels without a GPU); False = always the torch reference. The environment variable
``DRAFTERS_TRITON=1`` / ``=0`` sets the default of ``force_triton`` to True / False.

Exactness: greedy and compaction are bit-identical to the reference (argmax and copies are exact).
Rejection sampling makes the same float32 decisions except where a uniform lies within rounding of a
boundary, because two reductions over V cannot reproduce torch's summation order (see
``triton_verify.py``); compare such rows with ``rejection_disagreement``.
"""

from __future__ import annotations

import os

import torch

from infer.accept import AcceptResult, accept_greedy, accept_rejection, greedy_walk
from infer.tree import DraftTree

try:  # Triton is optional: without it every call takes the torch path
    from infer.kernels import triton_verify as _tv
except ImportError:  # pragma: no cover - depends on the environment
    _tv = None

HAS_TRITON = _tv is not None
ENV_VAR = "DRAFTERS_TRITON"

__all__ = [
    "HAS_TRITON",
    "check_verify_inputs",
    "compact_kv",
    "compact_kv_reference",
    "rejection_disagreement",
    "use_triton",
    "verify_greedy",
    "verify_rejection",
]


def use_triton(device: torch.device, force_triton: bool | None = None) -> bool:
    """Whether a call on tensors of ``device`` runs the Triton kernel (see the module docstring)."""
    if force_triton is None:
        force_triton = {"1": True, "0": False}.get(os.environ.get(ENV_VAR, ""))
    if force_triton is False:
        return False
    if force_triton:
        if not HAS_TRITON:
            raise RuntimeError("force_triton=True but triton could not be imported")
        return True
    return HAS_TRITON and device.type == "cuda"


def check_verify_inputs(tree: DraftTree, vocab_size: int | None) -> None:
    """The inputs a verify call trusts, checked before either path runs, so the torch reference and the Triton
    kernel (which would read past a row instead of raising) fail alike, with the same message: every node's token in
    [0, vocab_size), and each draft distribution the rule reads (the q of a node with valid children) a float32 /
    float64 distribution (entries >= 0, sum 1 within 1e-3)."""
    if vocab_size is not None:
        bad = (tree.tokens < 0) | (tree.tokens >= vocab_size)
        if bool(bad.any()):
            b, i = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"draft tree row {b} node {i} has token id {int(tree.tokens[b, i])}, outside [0, {vocab_size})"
            )
    q = tree.draft_probs
    if q is None:
        return
    if q.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"draft_probs must be float32 or float64 (low precision breaks the accept ratios), got {q.dtype}"
        )
    if vocab_size is not None and q.shape[-1] != vocab_size:
        raise ValueError(f"draft_probs cover {q.shape[-1]} tokens, the target's vocabulary has {vocab_size}")
    child = tree.valid.clone()
    child[:, 0] = False  # the root has no parent
    rows = torch.arange(tree.batch_size, device=tree.parents.device)[:, None].expand_as(tree.parents)
    used = torch.zeros_like(tree.valid)
    used[rows[child], tree.parents[child]] = True
    q_used = q[used]
    if q_used.numel() and (
        bool((q_used < 0).any()) or not torch.allclose(q_used.sum(-1), torch.ones_like(q_used[:, 0]), atol=1e-3)
    ):
        raise ValueError("draft_probs rows of nodes with children must be distributions (entries >= 0, sum 1)")


def verify_greedy(tree: DraftTree, target: torch.Tensor, *, force_triton: bool | None = None) -> AcceptResult:
    """Greedy tree verify. ``target``: logits [B, n, V] or target argmax [B, n] (integer dtype)."""
    is_logits = target.is_floating_point()
    check_verify_inputs(tree, target.shape[-1] if is_logits else None)
    ok_dtype = not is_logits or target.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if use_triton(target.device, force_triton) and (ok_dtype or force_triton):
        return AcceptResult(*_tv.greedy_verify(tree.tokens, tree.parents, tree.valid, target))
    return accept_greedy(tree, target) if is_logits else greedy_walk(tree, target)


def verify_rejection(
    tree: DraftTree,
    p: torch.Tensor,
    accept_u: torch.Tensor,
    sample_u: torch.Tensor,
    *,
    force_triton: bool | None = None,
) -> AcceptResult:
    """Lossless tree rejection sampling; ``p`` [B, n, V] warped target probs, uniforms [B, n]."""
    check_verify_inputs(tree, p.shape[-1])
    if use_triton(p.device, force_triton):
        return AcceptResult(
            *_tv.rejection_verify(tree.tokens, tree.parents, tree.valid, p, tree.draft_probs, accept_u, sample_u)
        )
    return accept_rejection(tree, p, accept_u, sample_u)


def compact_kv_reference(kv: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``out[b, h, j, :] = kv[b, h, keep[b, j], :]``: kv [B, H, S, D], keep [B, L] int -> [B, H, L, D]."""
    B, H, _, D = kv.shape
    if B == 1:  # one row (batch-1 decoding, every layer every round): a plain index_select, half a gather's time
        return kv.index_select(2, keep[0].long())
    index = keep.long()[:, None, :, None].expand(B, H, keep.shape[1], D)
    return torch.gather(kv, 2, index)


def compact_kv(kv: torch.Tensor, keep: torch.Tensor, *, force_triton: bool | None = None) -> torch.Tensor:
    """Keep only positions ``keep`` [B, L] of the cache ``kv`` [B, H, S, D] (rows may keep different positions).

    The Triton path does not bounds-check ``keep`` (it must lie in [0, S)); the reference raises.
    """
    if use_triton(kv.device, force_triton):
        return _tv.compact_kv(kv, keep)
    return compact_kv_reference(kv, keep)


def rejection_disagreement(
    tree: DraftTree,
    p: torch.Tensor,
    accept_u: torch.Tensor,
    sample_u: torch.Tensor,
    result: AcceptResult,
    rows: list[int] | None = None,
) -> torch.Tensor:
    """How far ``result`` is from a float64 replay of ``accept_rejection``, per row: [len(rows)] float64.

    The replay follows ``result``'s own decisions (so its state is the state ``result`` saw) and, at each
    decision where the exact float64 rule would have decided otherwise, measures the distance to the
    decision boundary: ``|u * q(x) - r(x)|`` for an accept test, the distance of the threshold
    ``u * cdf[-1]`` from the token's CDF interval for the bonus. The row's value is the largest such
    distance: 0 when ``result`` agrees with float64 everywhere, a few 1e-7 when it differs at a
    rounding-level tie, large for a wrong decision, ``inf`` for an impossible result (a path that is not
    a walk of the rule, or a bonus outside the residual's support).
    """
    q = tree.draft_probs
    rows = list(range(tree.batch_size)) if rows is None else rows
    out = torch.zeros(len(rows), dtype=torch.float64)
    for k, b in enumerate(rows):
        n = tree.num_nodes
        length = int(result.length[b])
        path = result.path[b].tolist()
        if length < 1 or path[0] != 0 or any(v != -1 for v in path[length:]):
            out[k] = float("inf")
            continue
        r = p[b, 0].double()
        qr = None if q is None else q[b, 0].double()
        cur, pos, worst = 0, 1, 0.0
        for j in range(1, n):
            if not (bool(tree.valid[b, j]) and int(tree.parents[b, j]) == cur):
                continue
            x = int(tree.tokens[b, j])
            rx = float(r[x])
            qx = 0.0 if qr is None else float(qr[x])
            det = qx <= 0
            qx = 1.0 if det else qx
            lhs = float(accept_u[b, j].float()) * qx
            taken = pos < length and path[pos] == j
            if taken != (lhs < rx):
                worst = max(worst, abs(lhs - rx))
            if taken:
                cur, pos = j, pos + 1
                r = p[b, j].double()
                qr = None if q is None else q[b, j].double()
                continue
            onehot = torch.zeros_like(r)
            onehot[x] = 1.0
            res = (r - (onehot if det or qr is None else qr)).clamp_min(0.0)
            s = float(res.sum())
            r = res / s if s > 0 else r
            if qr is not None:
                qr = qr.clone()
                qr[x] = 0.0
                sq = float(qr.sum())
                qr = qr / sq if sq > 0 else qr
        if pos != length:  # result accepted a node the walk never tried
            out[k] = float("inf")
            continue
        cdf = r.cumsum(0)
        thr = float(sample_u[b, cur].float()) * float(cdf[-1])
        t = int(result.bonus[b])
        if float(cdf[-1]) <= 0:
            worst = worst if t == 0 else float("inf")
        elif not 0 <= t < r.numel() or float(r[t]) <= 0:
            worst = float("inf")
        else:
            lo = float(cdf[t - 1]) if t > 0 else 0.0
            worst = max(worst, lo - thr, thr - float(cdf[t]))  # 0 when thr in [lo, cdf[t]]
        out[k] = max(worst, 0.0)
    return out
