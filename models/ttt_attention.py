"""The attention of EAGLE-3's training-time-test unroll (Li et al. 2025, §3.3), two ways with the same result.

At TTT step i a query at position t reads the step-0 keys at the positions ``allowed`` permits (causal, same sample)
and, for i ≥ 1, the same-position key of each step 1..i: what an inference-time node at depth i sees. Shapes:
q [B, nh, T, d]; keys0 / values0 [B, nkv, T, d] (grouped-query: query head h reads key head h // (nh / nkv));
diag_keys / diag_values: i tensors [B, nkv, T, d].

- ``dense_ttt_attention``: the scores written out, [B, nh, T, T + i] in the compute dtype with an fp32 softmax. Any
  device; the reference the other is tested against.
- ``flash_ttt_attention`` (CPU): one pass of torch's blocked CPU flash kernel over the step-0 keys, which returns the
  log-sum-exp of its scores, merged with the i same-position scores by log-sum-exp. Its backward is the kernel's
  own backward called with the *merged* output and log-sum-exp: that backward rebuilds every probability as
  exp(score − lse) and takes D = rowsum(dO ∘ O) from the output it is handed, which for the merged pair are exactly
  the merged softmax's probabilities and D, so the step-0 gradients come out right; the i diagonal scores are
  differentiated by hand. Measured on a SmolLM2 drafter (docs/decisions.md, "EAGLE-3 training throughput"): the
  dense path's [B, nh, T, T] score tensors, their fp32 softmax and dtype copies were most of the unroll's
  non-matmul time.
"""

from __future__ import annotations

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


IMPLEMENTATIONS = ("auto", "dense", "flash")
"""``auto``: flash on CPU, dense elsewhere (no GPU run has measured a fused path there yet)."""


def resolve(implementation: str, device: torch.device) -> str:
    """``"flash"`` or ``"dense"``: the path ``implementation`` (one of ``IMPLEMENTATIONS``) takes on ``device``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"TTT attention implementation {implementation!r} is not one of {IMPLEMENTATIONS}")
    cpu = device.type == "cpu"
    if implementation == "flash" and not cpu:
        raise ValueError(f"the flash TTT attention runs on CPU only, not on {device.type}: use 'dense' or 'auto'")
    return "flash" if implementation == "flash" or (implementation == "auto" and cpu) else "dense"


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the unroll's matmuls run in: autocast's where it is on for ``x``'s device, else ``x``'s own."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def attention_bias(allowed: torch.Tensor, dtype: torch.dtype, path: str) -> torch.Tensor:
    """bool ``allowed`` [B, T, T] → the additive step-0 mask [B, 1, T, T] in ``dtype``, built once per unroll.

    The flash path runs the kernel causal and skips the blocks above the diagonal, so a later key ``allowed`` permitted
    would be dropped silently; the unroll's keys never are, and such a mask is refused instead."""
    if path == "flash" and bool((allowed & ~torch.ones_like(allowed[0]).tril()).any()):
        raise ValueError("the TTT attention is causal: allowed[b, t, s] must be False for s > t")
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def ttt_attention(
    q: torch.Tensor,
    keys0: torch.Tensor,
    values0: torch.Tensor,
    diag_keys: list[torch.Tensor],
    diag_values: list[torch.Tensor],
    bias: torch.Tensor,
    scale: float,
    path: str,
) -> torch.Tensor:
    """→ attn [B, nh, T, d] by ``path`` (`resolve`); ``bias`` from `attention_bias`."""
    attend = flash_ttt_attention if path == "flash" else dense_ttt_attention
    return attend(q, keys0, values0, diag_keys, diag_values, bias, scale)


def dense_ttt_attention(
    q: torch.Tensor,
    keys0: torch.Tensor,
    values0: torch.Tensor,
    diag_keys: list[torch.Tensor],
    diag_values: list[torch.Tensor],
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The TTT attention with its scores written out (module docstring)."""
    group = q.shape[1] // keys0.shape[1]
    keys0, values0 = keys0.repeat_interleave(group, 1), values0.repeat_interleave(group, 1)
    T = keys0.shape[2]
    scores0 = torch.matmul(q, keys0.transpose(2, 3)) * scale + bias  # [B, nh, T, T]
    # same-position keys of steps 1..i: one score per (query, step) → [B, nh, T, i]
    diag = [(q * dk.repeat_interleave(group, 1)).sum(-1, keepdim=True) * scale for dk in diag_keys]
    probs = torch.cat([scores0, *diag], dim=-1).float().softmax(-1).to(q.dtype)
    attn = torch.matmul(probs[..., :T], values0)
    for j, dv in enumerate(diag_values):
        attn = attn + probs[..., T + j : T + j + 1] * dv.repeat_interleave(group, 1)
    return attn


def flash_ttt_attention(
    q: torch.Tensor,
    keys0: torch.Tensor,
    values0: torch.Tensor,
    diag_keys: list[torch.Tensor],
    diag_values: list[torch.Tensor],
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The TTT attention as one flash pass and a log-sum-exp merge (module docstring); CPU only, ``bias`` causal.

    The kernel wants one dtype: the bias's (`compute_dtype`; under autocast rope leaves q and k in the layer's dtype
    while v comes out of an autocast matmul)."""
    dtype = bias.dtype
    q, keys0, values0 = q.to(dtype), keys0.to(dtype), values0.to(dtype)
    if not diag_keys:
        return _FlashTTT.apply(q, keys0, values0, None, None, bias, scale)
    dk, dv = torch.stack(diag_keys, 3).to(dtype), torch.stack(diag_values, 3).to(dtype)
    return _FlashTTT.apply(q, keys0, values0, dk, dv, bias, scale)


class _FlashTTT(torch.autograd.Function):
    """q [B, nh, T, d], k0 / v0 [B, nkv, T, d], dk / dv [B, nkv, T, i, d] or None, bias [B, 1, T, T] in q's dtype.

    Grouped heads are viewed as [B, nkv, g, T, ·] for the diagonal terms, so no key is copied per query head."""

    @staticmethod
    def forward(ctx, q, k0, v0, dk, dv, bias, scale):
        with torch.autocast("cpu", enabled=False):  # the merge runs in fp32 whatever the caller's autocast says
            out0, lse0 = _flash(q, k0, v0, 0.0, True, attn_mask=bias, scale=scale)
            if dk is None:
                ctx.save_for_backward(q, k0, v0, bias, out0, lse0)
                ctx.scale = scale
                return out0
            B, nh, T, d = q.shape
            nkv = k0.shape[1]
            qg = q.float().view(B, nkv, nh // nkv, T, d)
            s = torch.einsum("bkgtd,bktid->bkgti", qg, dk.float()) * scale  # [B, nkv, g, T, i]
            lse0 = lse0.view(B, nkv, nh // nkv, T)
            lse = torch.logaddexp(lse0, s.logsumexp(-1))
            p = (s - lse[..., None]).exp()
            out = (lse0 - lse).exp()[..., None] * out0.float().view(B, nkv, nh // nkv, T, d)
            out = (out + torch.einsum("bkgti,bktid->bkgtd", p, dv.float())).view(B, nh, T, d).to(q.dtype)
            ctx.save_for_backward(q, k0, v0, bias, out, lse.view(B, nh, T), dk, dv, p)
            ctx.scale = scale
            return out

    @staticmethod
    def backward(ctx, grad):
        q, k0, v0, bias, out, lse, *diag = ctx.saved_tensors
        grad = grad.contiguous().to(q.dtype)
        gq, gk0, gv0 = _flash_backward(grad, q, k0, v0, out, lse, 0.0, True, attn_mask=bias, scale=ctx.scale)
        if not diag:
            return gq, gk0, gv0, None, None, None, None
        dk, dv, p = diag
        B, nh, T, d = q.shape
        nkv = k0.shape[1]
        gf = grad.float().view(B, nkv, nh // nkv, T, d)
        D = (gf * out.float().view(B, nkv, nh // nkv, T, d)).sum(-1, keepdim=True)  # the D the kernel used
        ds = p * (torch.einsum("bkgtd,bktid->bkgti", gf, dv.float()) - D) * ctx.scale  # dL/ds, scale folded in
        gq = gq.float() + torch.einsum("bkgti,bktid->bkgtd", ds, dk.float()).reshape(B, nh, T, d)
        gdk = torch.einsum("bkgti,bkgtd->bktid", ds, q.float().view(B, nkv, nh // nkv, T, d))
        gdv = torch.einsum("bkgti,bkgtd->bktid", p, gf)
        return gq.to(q.dtype), gk0, gv0, gdk.to(dk.dtype), gdv.to(dv.dtype), None, None
