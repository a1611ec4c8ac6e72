"""Shape-invariant target forwards (opt-in): a row's logits do not depend on how many rows share its forward.

    with shape_invariant(target.model):          # or install(target.model, rows) ... uninstall(target.model)
        reference = generate_vanilla(target, prompts, params)
        result = generate_speculative(target, proposer, prompts, params)   # tokens and logits bitwise vanilla's

At T = 0 speculative decoding emits vanilla's greedy tokens only up to rounding: a token scored alone (vanilla, one
row per forward) and the same token scored as row j of a k + 1 row verify forward go through kernels that sum in
different orders, and in bf16 that difference is whole ulps of the logits (DESIGN.md §7: 10-13 of 16 answers parted
at top-2 gaps of 0-0.25 on a CPU with fast bf16). In this mode both runs compute every row with the same kernels and
the same reduction order, so the outputs are bit-identical in any dtype; vanilla must run in the mode too (its
numbers are the mode's, not the default path's).

What made rows shape-dependent on this project's CPU (AMD EPYC, AVX2, MKL, torch 2.13, transformers 5.24; measured
by ``python -m eval.invariance`` on random Llamas and SmolLM2, a row alone against row j of a 5-row chain):

- fp32 linear layers: MKL computes 1 row (gemv), 2-3 rows and >= 4 rows in three different summation orders (every
  weight shape tried, 256-1,536 inputs, 256-49,152 outputs; SmolLM2 rows differ by up to 2e-5). At a fixed row count
  a row's result depends neither on its position nor on the other rows, and not on the thread count (1 vs 2).
- fp32 attention (sdpa and eager, ~5e-7) and bf16 sdpa (5-20 % of rows differ, at some context lengths only).
- not: bf16 linear layers and bf16 eager attention (no bf16 instructions here: torch's fallback computes one dot
  product per output), RMSNorm, rotary embeddings, SiLU (SiLU only because model widths are multiples of 16: the
  last < 16 elements of a tensor take a scalar loop with other results). So in bf16 *on this CPU*,
  ``attn_implementation="eager"`` alone already gives bitwise-equal logits; CPUs with bf16 instructions (oneDNN,
  AMX) and GPUs pick shape-dependent kernels, which this mode is for.

What the mode does:

1. Every ``nn.Linear`` inference call computes its rows in blocks of exactly ``rows`` rows (the last block
   zero-padded, each a fresh copy), through the module's own forward: one row count means one kernel and one layout
   (also cpu_linear's routed layout, when that was installed first), so a row's result is the same whether it is
   alone, one of k + 1 tree nodes, a batch row or a prompt token (prefill is blocked too).
2. Attention runs `invariant_attention`: each query row gathers exactly the keys its mask opens, in slot order, and
   reduces over them in fp32 in chunks of `KEY_CHUNK` keys: fixed-shape batched matmuls (measured independent of the
   batch count here), an exact max, and a sequential sum across chunks, to which the chunks past a row's keys add
   exact zeros. Neither the other queries nor the masked columns of a longer cache touch a row's reduction.

Cost (docs/decisions.md, measured on a shared machine): with the default ``rows = 1`` SmolLM2 fp32's vanilla step
cost 1.04-1.26x, a 5-token verify 1.26-1.40x and chain-4 prompt lookup ran at 0.60-0.73x its tokens/s without the
mode; a block of 8 rows is cheaper per verify but doubles the vanilla step there, and pays on small models.

Limits: row independence at a fixed row count and batch-count independence of fixed-shape matmuls are measured
properties of this CPU's kernels, not promises of torch (tests/test_shape_invariant.py checks them end to end; run it
and ``python -m eval.invariance`` on another machine before relying on the mode there); GPUs and bf16 kernels with
native instructions are untested. The mask is read as visible / not visible: position biases, logit softcapping and
attention sinks are outside the mode, as are models whose attention is not HF's ``AttentionInterface`` functional form.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

NAME = "drafters_shape_invariant"
"""The attention implementation name the mode registers with transformers."""

DEFAULT_ROWS = 1
"""Rows per linear block. 1 computes every row exactly as the batch-1 vanilla loop does (one gemv each) and was the
faster choice for SmolLM2 here (docs/decisions.md); a block of 8 pays where a forward is dispatch-bound (tiny
models) or where several rows cost little more than one."""

KEY_CHUNK = 64
"""Keys per reduction chunk: a multiple of 16, so the exp over a chunk never takes torch's scalar tail loop."""


_last_slots: list = [None, None]
"""The last mask seen and its `key_slots`: every layer of a forward gets the same mask object."""


def key_slots(attention_mask: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_mask [B or 1, 1, n, S] additive (0 = may attend) -> (slots [B, n, W], seen [B, n, W]): the slots
    each query row sees, in slot order, then slot 0 where ``seen`` is False; W = the most keys a row sees, rounded
    up to a multiple of `KEY_CHUNK`. Cached for the mask object, which HF passes to every layer."""
    if _last_slots[0] is attention_mask:
        return _last_slots[1]
    visible = attention_mask[:, 0] == 0
    visible = visible.expand(batch, *visible.shape[1:])
    B, n, S = visible.shape
    count = visible.sum(-1)  # [B, n] >= 1: every row sees itself
    width = KEY_CHUNK * -(-int(count.max()) // KEY_CHUNK)
    rank = torch.where(visible, visible.cumsum(-1) - 1, width)  # a row's j-th visible slot goes to column j
    slots = torch.zeros(B, n, width + 1, dtype=torch.long, device=visible.device)
    slots.scatter_(-1, rank, torch.arange(S, device=visible.device).expand(B, n, S))
    result = slots[..., :width], torch.arange(width, device=visible.device) < count[..., None]
    _last_slots[:] = attention_mask, result
    return result


def invariant_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention in which a query row's result depends only on that row's query and the keys it may see.

    query [B, Hq, n, D]; key, value [B, Hkv, S, D] (Hq = g·Hkv, query head h reads key head h // g);
    attention_mask [B or 1, 1, n, S] additive, 0 where a query may attend. Returns ([B, n, Hq, D] in query's
    dtype, None). Computed in fp32; the reductions over keys run in chunks of C = `KEY_CHUNK` keys.
    """
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("the shape-invariant attention has no logit softcapping and no attention sinks")
    B, Hq, n, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    g = Hq // Hkv
    slots, seen = key_slots(attention_mask, B)
    chunks = slots.shape[-1] // KEY_CHUNK
    # rows of kv viewed as [B·Hkv·S, D] that query row (b, i) of head h reads, in the order (b, h, i, key)
    picked = (torch.arange(B * Hkv, device=key.device).view(B, Hkv, 1, 1) * S + slots[:, None]).flatten()

    def gather(kv: torch.Tensor) -> torch.Tensor:
        """kv [B, Hkv, S, D] -> [B·Hkv·n·chunks, C, D]: each query row's own keys, fp32, contiguous."""
        return kv.float().reshape(-1, D).index_select(0, picked).view(-1, KEY_CHUNK, D)

    q = query.float().view(B, Hkv, g, n, D).transpose(2, 3)[:, :, :, None]  # [B, Hkv, n, 1, g, D]
    q = q.expand(B, Hkv, n, chunks, g, D).reshape(-1, g, D).contiguous()
    scores = torch.bmm(q, gather(key).transpose(1, 2)).view(B, Hkv, n, chunks, g, KEY_CHUNK).mul_(scaling)
    scores.masked_fill_(~seen.view(B, 1, n, chunks, 1, KEY_CHUNK), float("-inf"))
    top = scores.amax(dim=(3, 5), keepdim=True)  # a max is exact in any order
    p = (scores - top).exp_()  # masked keys: exactly 0
    # within a chunk: a sum of C terms and a matmul of fixed shape; across chunks: cumsum, a sequential scan, so the
    # all-masked chunks past a row's keys add exact zeros
    total = p.sum(-1).cumsum(3)[:, :, :, -1]  # [B, Hkv, n, g]
    out = torch.bmm(p.view(-1, g, KEY_CHUNK), gather(value)).view(B, Hkv, n, chunks, g, D)
    out = out.cumsum(3)[:, :, :, -1] / total[..., None]  # [B, Hkv, n, g, D]
    return out.permute(0, 2, 1, 3, 4).reshape(B, n, Hq, D).to(query.dtype), None


AttentionInterface.register(NAME, invariant_attention)
# A mask HF builds itself (none passed, as in the batch-1 vanilla loop) comes as eager's additive 0 / min mask.
AttentionMaskInterface.register(NAME, eager_mask)


def blocked_linear(x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor], rows: int) -> torch.Tensor:
    """``forward(x)`` computed in blocks of exactly ``rows`` rows (zero-padded), each block a fresh contiguous copy
    (MKL may pick another code path for a misaligned operand). Grad-enabled calls run unchanged."""
    if torch.is_grad_enabled():
        return forward(x)
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    padded = F.pad(flat, (0, 0, 0, -m % rows))  # a new tensor even when nothing is padded
    outs = [forward(padded[i : i + rows].clone() if m > rows else padded) for i in range(0, m, rows)]
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return y[:m].reshape(*x.shape[:-1], y.shape[-1])


def rows_of(model: PreTrainedModel) -> int | None:
    """The block row count of the mode when it is installed on ``model``, else None."""
    state = model.__dict__.get("_drafters_shape_invariant")
    return None if state is None else state[0]


def install(model: PreTrainedModel, rows: int = DEFAULT_ROWS) -> None:
    """Turn the mode on for every forward of ``model`` (an HF model using ``AttentionInterface``): linear layers in
    blocks of ``rows`` rows, `invariant_attention`. Install cpu_linear's routing (infer.serving.prepare_target)
    before, not after: the mode wraps each linear's forward as it finds it. `uninstall` restores both."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if rows_of(model) is not None:
        raise RuntimeError("the shape-invariant mode is already installed on this model")
    model.__dict__["_drafters_shape_invariant"] = (rows, model.config._attn_implementation)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            inner = module.forward  # the class forward, or cpu_linear's routed one
            module.__dict__["_drafters_forward_before_invariant"] = module.__dict__.get("forward")
            module.forward = types.MethodType(lambda self, x, f=inner: blocked_linear(x, f, rows), module)
    model.set_attn_implementation(NAME)


def uninstall(model: PreTrainedModel) -> None:
    """Undo `install`: the linear forwards and the attention implementation found there."""
    _, attn = model.__dict__.pop("_drafters_shape_invariant")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            before = module.__dict__.pop("_drafters_forward_before_invariant")
            module.__dict__.pop("forward")
            if before is not None:
                module.forward = before
    model.set_attn_implementation(attn)


@contextmanager
def shape_invariant(model: PreTrainedModel, rows: int = DEFAULT_ROWS) -> Iterator[None]:
    """``with shape_invariant(target.model): ...`` runs the block with the mode installed."""
    install(model, rows)
    try:
        yield
    finally:
        uninstall(model)
