"""HF's ``logits_to_keep`` for "the last n positions", as indices rather than the int HF also accepts.

With an int, HF slices the final hidden states to ``[:, -n:, :]``, a strided view of ``[B, T, H]``; torch's matmul
cannot fold such a view into one GEMM and takes its batched path instead, which expands the head's weight to
``[B, H, V]`` and copies it, B times 57 MB for SmolLM2's 49k-wide head in bf16. Measured on the 2-core
AVX-512-BF16 EPYC (bf16; docs/decisions.md, "EAGLE-3 training throughput"): the head on the last position took
37 ms at batch 1, 0.15-0.9 s at batch 4 and 2.8 s at batch 48 where the same product on contiguous rows takes
2-5 ms. Indices make HF gather the rows into a contiguous tensor first; the logits are the same.
"""

from __future__ import annotations

import torch


def last_positions(n: int, length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``logits_to_keep`` selecting the last ``n`` of ``length`` positions (1 ≤ n ≤ length)."""
    if not 1 <= n <= length:
        raise ValueError(f"cannot keep the last {n} of {length} positions")
    return torch.arange(length - n, length, device=device)
