"""The TTT attention's flash path against its written-out reference: outputs and every gradient, with grouped heads,
right padding, packed samples and 0-3 same-position keys; bf16 within its rounding; a non-causal mask refused."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from models.eagle3 import Eagle3Drafter
from models.eagle3_config import Eagle3Config
from models.ttt_attention import attention_bias, dense_ttt_attention, flash_ttt_attention, resolve
from tests.test_eagle3_model import TINY


def _allowed(B: int, T: int) -> torch.Tensor:
    """Row 0 right-padded after 9 tokens (pad queries see the valid keys and themselves), row 1 two packed samples."""
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    allowed = causal.repeat(B, 1, 1)
    allowed[0, :, 9:] = False
    allowed[0] |= torch.eye(T, dtype=torch.bool)
    seg = (torch.arange(T) >= 5).long()
    allowed[1] &= seg[:, None] == seg[None, :]
    return allowed


def _inputs(steps: int, dtype: torch.dtype, B: int = 2, nh: int = 6, nkv: int = 2, T: int = 13, d: int = 8):
    g = torch.Generator().manual_seed(steps)
    shape_q, shape_k = (B, nh, T, d), (B, nkv, T, d)
    q, k0, v0 = (torch.randn(s, generator=g).to(dtype) for s in (shape_q, shape_k, shape_k))
    dks = [torch.randn(shape_k, generator=g).to(dtype) for _ in range(steps)]
    dvs = [torch.randn(shape_k, generator=g).to(dtype) for _ in range(steps)]
    return [t.requires_grad_() for t in (q, k0, v0, *dks, *dvs)], _allowed(B, T)


def _run(fn, tensors, steps, allowed):
    q, k0, v0, *diag = tensors
    bias = attention_bias(allowed, q.dtype, "flash" if fn is flash_ttt_attention else "dense")
    out = fn(q, k0, v0, diag[:steps], diag[steps:], bias, 8**-0.5)
    grad = torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype)
    grads = torch.autograd.grad(out, tensors, grad)
    return out, grads


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_flash_equals_dense_fp32(steps):
    tensors, allowed = _inputs(steps, torch.float32)
    want, want_grads = _run(dense_ttt_attention, tensors, steps, allowed)
    got, got_grads = _run(flash_ttt_attention, tensors, steps, allowed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    names = (
        ["q", "keys0", "values0"] + [f"diag_key{j}" for j in range(steps)] + [f"diag_value{j}" for j in range(steps)]
    )
    for name, a, b in zip(names, got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_flash_bf16_within_rounding_of_fp32():
    """In bf16 the flash path keeps its scores and merge in fp32: its error against an fp32 reference stays within
    the error bf16 inputs alone cause (the dense bf16 path's error against the same reference)."""
    steps = 2
    tensors, allowed = _inputs(steps, torch.bfloat16)
    ref_in = [t.detach().float().requires_grad_() for t in tensors]
    ref, ref_grads = _run(dense_ttt_attention, ref_in, steps, allowed)
    got, got_grads = _run(flash_ttt_attention, tensors, steps, allowed)
    dense, dense_grads = _run(dense_ttt_attention, tensors, steps, allowed)
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max() <= (dense.float() - ref).abs().max() + 1e-2
    for a, b, r in zip(got_grads, dense_grads, ref_grads):
        assert (a.float() - r).abs().max() <= 2 * (b.float() - r).abs().max() + 2e-2


def test_later_keys_refused():
    tensors, allowed = _inputs(1, torch.float32)
    allowed[1, 2, 7] = True
    with pytest.raises(ValueError, match="causal"):
        _run(flash_ttt_attention, tensors, 1, allowed)


def test_drafter_unroll_under_autocast_matches_dense():
    """The drafter's own unroll under bf16 autocast (rope leaves q and k in fp32, v comes out bf16): the flash path
    gives the dense path's logits and weight gradients within bf16 rounding; an unknown implementation is refused."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config.from_target(LlamaConfig(**TINY), draft_vocab_size=48, num_aux_layers=3))
    B, T = 2, 13
    feats, ids = torch.randn(B, T, 3 * 32), torch.randint(0, 96, (B, T))
    positions = torch.arange(T).expand(B, T)

    def unroll(attention: str):
        drafter.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = drafter(feats, ids, positions, _allowed(B, T), 3, attention=attention)
            sum(lg.float().square().mean() for lg in logits).backward()
        return [lg.detach().float() for lg in logits], drafter.fc.weight.grad.clone()

    want, want_grad = unroll("dense")
    got, got_grad = unroll("flash")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
    assert (got_grad - want_grad).norm() <= 0.05 * want_grad.norm()
    with pytest.raises(ValueError, match="not one of"):
        unroll("fused")


def test_the_path_follows_the_device_not_the_host():
    """``auto`` is flash on CPU and dense on any other device (a CUDA device is simulated: no kernel runs)."""
    assert resolve("auto", torch.device("cpu")) == "flash"
    assert resolve("auto", torch.device("cuda")) == "dense"
    assert resolve("dense", torch.device("cpu")) == "dense"
    with pytest.raises(ValueError, match="CPU only"):
        resolve("flash", torch.device("cuda"))
    with pytest.raises(ValueError, match="not one of"):
        resolve("fused", torch.device("cpu"))
