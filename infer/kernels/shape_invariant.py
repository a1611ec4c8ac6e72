"""Shape-invariant target forwards (opt-in): a row's logits do not depend on how many rows share its forward.

At T = 0 speculative decoding is meant to emit vanilla's greedy tokens. It does so only up to rounding, because a token
scored alone (vanilla, one row per forward) and the same token scored as row j of a k + 1 row verify forward go
through kernels that sum in different orders. DESIGN.md §7: in bf16 on a CPU with fast bf16, 10-13 of 16 answers
diverged at top-2 gaps of whole bf16 ulps. This mode removes that freedom, so greedy speculative output is
bit-identical to greedy vanilla output run in the same mode, in any dtype.

What made rows shape-dependent on the CPU of this project (AMD EPYC, AVX2, MKL, torch 2.13; measured with
``python -m eval.invariance``):

- fp32 linear layers: MKL computes one row (gemv), 2-3 rows and >= 4 rows with three different summation orders
  (row results fall into exactly those three classes for every weight shape tried, 256-1024 inputs, 256-49,152
  outputs). At a fixed row count, a row's result does not depend on its position or on the other rows.
- attention: both HF paths (sdpa, eager) change a row's output with the number of query rows and the length of the
  (partly masked) key axis, in fp32 (~3e-7) and in bf16 (whole ulps of the output in some rows).
- not the rest here: bf16 linear layers (this CPU has no bf16 instructions; torch's fallback is one dot product per
  output, already row-independent), RMSNorm, rotary embeddings and SiLU gave bitwise-equal rows (SiLU only because
  the model widths are multiples of 16: a tensor whose size is not takes a scalar tail loop with another result).

What the mode does (`install`, or the `shape_invariant` context manager):

1. Every ``nn.Linear`` inference call computes its rows in blocks of exactly ``rows`` rows (the last block
   zero-padded, every block a fresh aligned copy), through the module's own forward. One row count means one kernel
   and one layout for every call (also cpu_linear's routed layout when that was installed first), and a row's result
   depends only on that row, whether it is alone, one of k + 1 tree nodes, one of a batch, or a prompt token.
2. Attention runs `invariant_attention`: each query row gathers exactly the keys its mask opens, in slot order, and
   reduces over them in fixed chunks of `KEY_CHUNK` keys, in fp32: fixed-shape matmuls for scores and values (batched
   matmuls with fixed matrix shapes measured independent of the batch count here), an exact max, and a sequential sum
   across chunks, where the chunks past a row's keys add exact zeros. Neither the other queries nor the masked
   columns of a longer cache change a row's reduction.

It costs a forward of ``rows`` rows for every call of fewer, a gather of each query's keys, and fp32 attention
(numbers in docs/decisions.md). Limits: the row independence at a fixed row count and the batch-count independence
of fixed-shape matmuls are measured facts about this CPU's kernels, not guarantees of torch; other CPUs' bf16 kernels
(oneDNN / AMX) and GPUs are not tested here — run ``python -m eval.invariance`` and tests/test_shape_invariant.py
there. Models whose attention is not HF's ``AttentionInterface`` functional form, or that add position biases to the
mask, are outside the mode (the mask is read as visible / not visible).
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
    blocks of ``rows`` rows, `invariant_attention`. Install cpu_linear's routing (eval.measure.prepare_target)
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
