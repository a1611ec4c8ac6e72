"""Triton kernels for the verify step: tree greedy verify, tree rejection sampling, KV compaction.

The torch rules in ``infer/accept.py`` are the reference; ``infer/kernels/__init__.py`` dispatches.

Layout: the two verify kernels run **one program per batch row**. A row's walk over the tree is
inherently sequential (node j is tried only if its parent is the current node), so the program loops
over nodes 1..n-1 in index order with scalar loads, exactly as the reference loops in Python, and does
vector work over the vocabulary only where the walk needs it:

- greedy: an argmax over V at each *visited* node (root + accepted nodes), never at the other n - depth
  nodes, so it reads ``depth + 1`` rows of the ``[B, n, V]`` logits instead of all n;
- rejection: two passes over V per *rejected* child (sums, then the renormalised residuals) and two for
  the bonus draw (total, then the inverse CDF). The residuals live in a float32 workspace ``[B, V]``
  (one for r, one for q); right after an accept the walk reads the fresh rows ``p[b, cur]`` /
  ``q[b, cur]`` directly instead of copying them ("fresh" flags), so accepts cost no V pass.

KV compaction is a plain gather: one program per (batch row, head, block of kept positions), each
copying ``[BLOCK_L, D]`` rows with the cache's own strides (the cache may be a view of a larger buffer).

Float32 arithmetic follows the reference operation by operation (``u * q(x) < r(x)``; ``max(r - q, 0)``;
IEEE division via ``div_rn``, since Triton's ``/`` lowers to the approximate ``div.full.f32`` on NVIDIA;
FMA contraction disabled at launch), so decisions at a fresh node are bit-identical. Two things cannot be
bit-identical and differ only at rounding level: the float32 row sums over V (torch's reduction order
differs from a tree reduction in blocks), and the CDF of the bonus draw (torch's CPU ``cumsum`` accumulates
in float64, its CUDA one in float32 with a parallel scan; the kernel accumulates in float64). Results can
therefore differ from the reference only where a uniform falls within a few ulps of a decision boundary;
``infer.kernels.rejection_disagreement`` checks such rows against a float64 replay.

Interpreter (CPU, no GPU): Triton 3.9 picks interpreter or compiler when a function is *decorated*,
reading ``TRITON_INTERPRET`` at that moment, and that includes Triton's own ``tl.sum`` / ``tl.max`` /
``tl.cumsum`` helpers, decorated when ``triton.language`` is imported. Setting the variable later has no
effect, and setting it before ``import triton`` would turn the GPU path into the interpreter too. So the
kernels here (a) are written undecorated and wrapped twice, ``triton.jit`` for CUDA tensors and
``InterpretedFunction`` for CPU tensors, in the same process with no environment variable; and (b) call
only ``tl.reduce`` / ``tl.associative_scan`` with Triton's stock combine functions, which the interpreter
patches to numpy at call time (``tl.sum`` etc. would raise "Cannot call @triton.jit'd outside of the
scope of a kernel" there). If ``TRITON_INTERPRET=1`` is set before import anyway, ``triton.jit`` itself
returns an interpreted function and everything still runs, on the CPU.

The interpreter is not the compiler: its argmax reduction returns the position in the block whatever index
tensor it is given (the compiler returns the given index), so the kernels always reduce over
``tl.arange`` positions and add the block offset themselves. ``compile_for_nvidia`` lowers every variant
to sm_90 machine code without a GPU; ``scripts/gpu_check.py`` runs them for real.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Stock combine functions (JIT functions): fine for the compiler, and recognised by the interpreter's
# numpy fast paths. Private names, stable across Triton 3.x.
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max
_ARGMAX_LEFT = tl.standard._argmax_combine_tie_break_left

MAX_BLOCK_V = 4096
"""Vocabulary chunk per loop iteration: 4096 floats = 16 KiB per live vector, 16 per thread at 8 warps."""


def _greedy_kernel(
    tokens_ptr,
    parents_ptr,
    valid_ptr,  # [B, n] int64, int64, bool; contiguous
    target_ptr,  # logits [B, n, V] (float, unit stride over V) or target argmax [B, n] int64 (contiguous)
    path_ptr,
    length_ptr,
    bonus_ptr,  # outputs [B, n] int64, [B] int64, [B] int64
    n,
    V,
    stride_tb,
    stride_tn,  # target strides (elements) for the logits case
    HAS_LOGITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = b * n  # offset of row b in the [B, n] inputs (int64: B * n * V overflows int32 at real sizes)
    ar_n = tl.arange(0, BLOCK_N)
    ar_v = tl.arange(0, BLOCK_V)
    # the path is kept in registers and stored once: no ordering question between threads' stores
    path = tl.where(ar_n == 0, 0, -1).to(tl.int64)
    length = 1
    cur = 0
    # t* = target argmax at the current node (first maximal index on ties, as torch.argmax)
    if HAS_LOGITS:
        base = target_ptr + b * stride_tb
        best_v = float("-inf")
        best_i = 0
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + ar_v
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            # reduce (value, position in the chunk), then add the chunk offset: the interpreter's argmax
            # returns the position whatever index tensor it is given, the compiler returns that tensor
            m, i = tl.reduce((x, ar_v), 0, _ARGMAX_LEFT)
            # strict '>' keeps the earlier chunk on ties across chunks
            best_i = tl.where(m > best_v, v0 + i, best_i)
            best_v = tl.maximum(m, best_v)
        tstar = best_i.to(tl.int64)
    else:
        tstar = tl.load(target_ptr + row)
    for j in range(1, n):
        vj = tl.load(valid_ptr + row + j)
        pj = tl.load(parents_ptr + row + j)
        tok = tl.load(tokens_ptr + row + j)
        if (vj != 0) & (pj == cur) & (tok == tstar):
            path = tl.where(ar_n == length, j, path)
            length += 1
            cur = j
            if HAS_LOGITS:
                base = target_ptr + b * stride_tb + j * stride_tn
                best_v = float("-inf")
                best_i = 0
                for v0 in range(0, V, BLOCK_V):
                    offs = v0 + ar_v
                    x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                    m, i = tl.reduce((x, ar_v), 0, _ARGMAX_LEFT)
                    best_i = tl.where(m > best_v, v0 + i, best_i)
                    best_v = tl.maximum(m, best_v)
                tstar = best_i.to(tl.int64)
            else:
                tstar = tl.load(target_ptr + row + j)
    tl.store(path_ptr + row + ar_n, path, mask=ar_n < n)
    tl.store(length_ptr + b, length.to(tl.int64))
    tl.store(bonus_ptr + b, tstar)


def _rejection_kernel(
    tokens_ptr,
    parents_ptr,
    valid_ptr,  # [B, n] int64, int64, bool; contiguous
    p_ptr,
    q_ptr,  # [B, n, V] target / draft probabilities (unit stride over V); q unused without HAS_Q
    accept_u_ptr,
    sample_u_ptr,  # [B, n] float32 contiguous
    r_ws_ptr,
    q_ws_ptr,  # [B, V] float32 workspaces: residual target / residual draft of the current node
    path_ptr,
    length_ptr,
    bonus_ptr,  # outputs [B, n] int64, [B] int64, [B] int64
    n,
    V,
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qn,
    HAS_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = b * n
    ar_n = tl.arange(0, BLOCK_N)
    ar_v = tl.arange(0, BLOCK_V)
    r_ws = r_ws_ptr + b * V
    q_ws = q_ws_ptr + b * V
    path = tl.where(ar_n == 0, 0, -1).to(tl.int64)
    length = 1
    cur = 0
    # fresh: the residual r of the current node is still p[b, cur] (read it there); otherwise it is in
    # r_ws. Same for q / q_ws. Both are set on arrival at a node and cleared by its first rejection.
    fresh = True
    fresh_q = True
    for j in range(1, n):
        vj = tl.load(valid_ptr + row + j)
        pj = tl.load(parents_ptr + row + j)
        if (vj != 0) & (pj == cur):
            x = tl.load(tokens_ptr + row + j)
            p_row = p_ptr + b * stride_pb + cur * stride_pn
            # masked loads: only one of the two sources is read
            rx = tl.where(
                fresh,
                tl.load(p_row + x, mask=fresh, other=0.0).to(tl.float32),
                tl.load(r_ws + x, mask=not fresh, other=0.0),
            )
            if HAS_Q:
                q_row = q_ptr + b * stride_qb + cur * stride_qn
                qx = tl.where(
                    fresh_q,
                    tl.load(q_row + x, mask=fresh_q, other=0.0).to(tl.float32),
                    tl.load(q_ws + x, mask=not fresh_q, other=0.0),
                )
            else:
                qx = 0.0
            det = qx <= 0.0  # one-hot draft (or q(x) == 0): subtract one-hot(x) instead of q
            qx = tl.where(det, 1.0, qx)
            u = tl.load(accept_u_ptr + row + j)
            if u * qx < rx:
                path = tl.where(ar_n == length, j, path)
                length += 1
                cur = j
                fresh = True
                fresh_q = True
            else:
                # pass 1: s = sum(max(r - q', 0)) with q' = one-hot(x) if det else q; sq = sum(q with q(x) = 0)
                s = 0.0
                sq = 0.0
                for v0 in range(0, V, BLOCK_V):
                    offs = v0 + ar_v
                    mv = offs < V
                    rv = tl.where(
                        fresh,
                        tl.load(p_row + offs, mask=mv & fresh, other=0.0).to(tl.float32),
                        tl.load(r_ws + offs, mask=mv & (not fresh), other=0.0),
                    )
                    hit = offs == x
                    if HAS_Q:
                        qv = tl.where(
                            fresh_q,
                            tl.load(q_row + offs, mask=mv & fresh_q, other=0.0).to(tl.float32),
                            tl.load(q_ws + offs, mask=mv & (not fresh_q), other=0.0),
                        )
                        sub = tl.where(det, tl.where(hit, 1.0, 0.0), qv)
                        sq += tl.reduce(tl.where(hit, 0.0, qv), 0, _SUM)
                    else:
                        sub = tl.where(hit, 1.0, 0.0)
                    s += tl.reduce(tl.maximum(rv - sub, 0.0), 0, _SUM)
                # pass 2: write the renormalised residuals (in place when already in the workspace: each
                # element is read and written by the same thread in the same iteration). s == 0 keeps r
                # as it is (reference: torch.where(s > 0, res / s, r)); sq == 0 leaves q = 0. The divisor is
                # 1 where the quotient is discarded, so no 0/0 is ever evaluated (numpy warns in the interpreter).
                s_safe = tl.where(s > 0.0, s, 1.0)
                sq_safe = tl.where(sq > 0.0, sq, 1.0)
                for v0 in range(0, V, BLOCK_V):
                    offs = v0 + ar_v
                    mv = offs < V
                    rv = tl.where(
                        fresh,
                        tl.load(p_row + offs, mask=mv & fresh, other=0.0).to(tl.float32),
                        tl.load(r_ws + offs, mask=mv & (not fresh), other=0.0),
                    )
                    hit = offs == x
                    if HAS_Q:
                        qv = tl.where(
                            fresh_q,
                            tl.load(q_row + offs, mask=mv & fresh_q, other=0.0).to(tl.float32),
                            tl.load(q_ws + offs, mask=mv & (not fresh_q), other=0.0),
                        )
                        sub = tl.where(det, tl.where(hit, 1.0, 0.0), qv)
                        qz = tl.where(hit, 0.0, qv)
                        tl.store(q_ws + offs, tl.where(sq > 0.0, tl.math.div_rn(qz, sq_safe), qz), mask=mv)
                    else:
                        sub = tl.where(hit, 1.0, 0.0)
                    res = tl.maximum(rv - sub, 0.0)
                    tl.store(r_ws + offs, tl.where(s > 0.0, tl.math.div_rn(res, s_safe), rv), mask=mv)
                # the next scalar loads of r_ws / q_ws may hit elements written by other threads
                tl.debug_barrier()
                fresh = False
                fresh_q = False
    # bonus ~ r at the stop node, by inverse CDF with sample_u[b, cur] (infer.sampling.sample_from_probs):
    # cdf = cumsum(r); threshold = u * cdf[-1] (float32); index = #{i : cdf[i] <= threshold}, clamped to
    # the last index with r > 0 (0 when r is all zero). The CDF is accumulated in float64, then rounded
    # to float32 like torch's CPU cumsum does.
    p_row = p_ptr + b * stride_pb + cur * stride_pn
    total = tl.full([], 0.0, tl.float64)
    last_pos = -1
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + ar_v
        mv = offs < V
        rv = tl.where(
            fresh,
            tl.load(p_row + offs, mask=mv & fresh, other=0.0).to(tl.float32),
            tl.load(r_ws + offs, mask=mv & (not fresh), other=0.0),
        )
        total += tl.reduce(rv.to(tl.float64), 0, _SUM)
        last_pos = tl.maximum(last_pos, tl.reduce(tl.where(rv > 0.0, offs, -1), 0, _MAX))
    threshold = tl.load(sample_u_ptr + row + cur) * total.to(tl.float32)
    carry = tl.full([], 0.0, tl.float64)
    count = 0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + ar_v
        mv = offs < V
        rv = tl.where(
            fresh,
            tl.load(p_row + offs, mask=mv & fresh, other=0.0).to(tl.float32),
            tl.load(r_ws + offs, mask=mv & (not fresh), other=0.0),
        )
        rv64 = rv.to(tl.float64)
        cdf = (carry + tl.associative_scan(rv64, 0, _SUM)).to(tl.float32)
        count += tl.reduce(((cdf <= threshold) & mv).to(tl.int32), 0, _SUM)
        carry += tl.reduce(rv64, 0, _SUM)
    bonus = tl.minimum(count, tl.maximum(last_pos, 0))
    tl.store(path_ptr + row + ar_n, path, mask=ar_n < n)
    tl.store(length_ptr + b, length.to(tl.int64))
    tl.store(bonus_ptr + b, bonus.to(tl.int64))


def _compact_kv_kernel(
    kv_ptr,
    keep_ptr,
    out_ptr,  # kv [B, H, S, D] (any strides), keep [B, L] int64 (unit stride over L), out [B, H, L, D]
    H,
    L,
    D,
    s_kb,
    s_kh,
    s_ks,
    s_kd,
    s_ob,
    s_oh,
    s_ol,
    s_od,
    s_keep,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    rows = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    mr = rows < L
    src = tl.load(keep_ptr + b * s_keep + rows, mask=mr, other=0)  # int64 source positions
    d = tl.arange(0, BLOCK_D)
    m = mr[:, None] & (d < D)[None, :]
    vals = tl.load(kv_ptr + b * s_kb + h * s_kh + src[:, None] * s_ks + d[None, :] * s_kd, mask=m)
    tl.store(out_ptr + b * s_ob + h * s_oh + rows[:, None].to(tl.int64) * s_ol + d[None, :] * s_od, vals, mask=m)


# Both flavours of every kernel: compiled for CUDA tensors, interpreted (numpy) for CPU tensors.
_KERNELS = {
    name: (triton.jit(fn), InterpretedFunction(fn))
    for name, fn in (("greedy", _greedy_kernel), ("rejection", _rejection_kernel), ("compact_kv", _compact_kv_kernel))
}
# Launch options for the compiled flavour (the interpreter ignores them). No FMA contraction: the float
# ops must round like torch's separate ops.
_LAUNCH = {"enable_fp_fusion": False}


def _kernel(name: str, device: torch.device):
    return _KERNELS[name][0 if device.type == "cuda" else 1]


def _block_n(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _block_v(V: int) -> int:
    return max(16, min(MAX_BLOCK_V, triton.next_power_of_2(V)))


def _num_warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


def _tree_inputs(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor):
    return tokens.long().contiguous(), parents.long().contiguous(), valid.bool().contiguous()


def greedy_verify(
    tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree greedy verify. ``target``: logits [B, n, V] (fp32 / bf16 / fp16) or the target argmax [B, n] (int).

    Returns (path [B, n], length [B], bonus [B]), int64, as ``infer.accept.accept_greedy``.
    """
    tokens, parents, valid = _tree_inputs(tokens, parents, valid)
    B, n = tokens.shape
    has_logits = target.is_floating_point()
    if has_logits:
        if target.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"greedy kernel takes fp32/bf16/fp16 logits, got {target.dtype}")
        if target.stride(-1) != 1:
            target = target.contiguous()
        V = target.shape[-1]
        stride_tb, stride_tn = target.stride(0), target.stride(1)
    else:
        target = target.long().contiguous()
        V, stride_tb, stride_tn = 1, 0, 0
    path = torch.empty(B, n, dtype=torch.int64, device=tokens.device)
    length = torch.empty(B, dtype=torch.int64, device=tokens.device)
    bonus = torch.empty(B, dtype=torch.int64, device=tokens.device)
    bv = _block_v(V)
    _kernel("greedy", tokens.device)[(B,)](
        tokens,
        parents,
        valid,
        target,
        path,
        length,
        bonus,
        n,
        V,
        stride_tb,
        stride_tn,
        HAS_LOGITS=has_logits,
        BLOCK_N=_block_n(n),
        BLOCK_V=bv,
        num_warps=_num_warps(bv),
        **_LAUNCH,
    )
    return path, length, bonus


def rejection_verify(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    accept_u: torch.Tensor,
    sample_u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree rejection sampling: ``p`` [B, n, V] target probs, ``q`` [B, n, V] draft probs or None (one-hot drafts),
    ``accept_u`` / ``sample_u`` [B, n] uniforms. Returns (path, length, bonus) as ``infer.accept.accept_rejection``.
    """
    tokens, parents, valid = _tree_inputs(tokens, parents, valid)
    B, n = tokens.shape
    V = p.shape[-1]

    def prep(t: torch.Tensor) -> torch.Tensor:
        # float32 / bf16 / fp16 are read as they are and widened exactly in the kernel; anything else is
        # converted here as the reference's ``.float()`` would
        t = t if t.dtype in (torch.float32, torch.bfloat16, torch.float16) else t.float()
        return t if t.stride(-1) == 1 else t.contiguous()

    p = prep(p)
    r_ws = torch.empty(B, V, dtype=torch.float32, device=p.device)
    if q is not None:
        q = prep(q)
        q_ws = torch.empty(B, V, dtype=torch.float32, device=p.device)
        sq = (q.stride(0), q.stride(1))
    else:
        q, q_ws, sq = p, r_ws, (0, 0)  # placeholders, never read (HAS_Q=False)
    accept_u = accept_u.float().contiguous()
    sample_u = sample_u.float().contiguous()
    path = torch.empty(B, n, dtype=torch.int64, device=p.device)
    length = torch.empty(B, dtype=torch.int64, device=p.device)
    bonus = torch.empty(B, dtype=torch.int64, device=p.device)
    bv = _block_v(V)
    _kernel("rejection", p.device)[(B,)](
        tokens,
        parents,
        valid,
        p,
        q,
        accept_u,
        sample_u,
        r_ws,
        q_ws,
        path,
        length,
        bonus,
        n,
        V,
        p.stride(0),
        p.stride(1),
        sq[0],
        sq[1],
        HAS_Q=q_ws is not r_ws,
        BLOCK_N=_block_n(n),
        BLOCK_V=bv,
        num_warps=_num_warps(bv),
        **_LAUNCH,
    )
    return path, length, bonus


def compact_kv(kv: torch.Tensor, keep: torch.Tensor, block_l: int = 32) -> torch.Tensor:
    """``out[b, h, j, :] = kv[b, h, keep[b, j], :]`` for kv [B, H, S, D] (any strides) and keep [B, L] int.

    ``keep`` must lie in [0, S): the kernel does not check (the reference ``torch.gather`` raises).
    """
    B, H, S, D = kv.shape
    keep = keep.long()
    if keep.stride(-1) != 1:
        keep = keep.contiguous()
    L = keep.shape[1]
    out = torch.empty(B, H, L, D, dtype=kv.dtype, device=kv.device)
    if out.numel() == 0:
        return out
    grid = (B * H, triton.cdiv(L, block_l))
    _kernel("compact_kv", kv.device)[grid](
        kv,
        keep,
        out,
        H,
        L,
        D,
        *kv.stride(),
        *out.stride(),
        keep.stride(0),
        BLOCK_L=block_l,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        num_warps=4,
    )
    return out


def compile_for_nvidia(capability: int = 90, warp_size: int = 32) -> dict[str, int]:
    """Compile every kernel variant the launchers use to a cubin for an NVIDIA target, without a GPU.

    Uses Triton's bundled ``ptxas``; catches type and lowering errors that the interpreter cannot see.
    Returns {variant: cubin bytes}. Signatures mirror the launches above (ints as i32, strides as i64).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, warp_size)
    tree = {"tokens_ptr": "*i64", "parents_ptr": "*i64", "valid_ptr": "*i1"}
    out3 = {"path_ptr": "*i64", "length_ptr": "*i64", "bonus_ptr": "*i64"}
    variants = {}
    for has_logits, dt in ((True, "*fp32"), (True, "*bf16"), (False, "*i64")):
        for bv in (16, MAX_BLOCK_V):
            sig = {
                **tree,
                "target_ptr": dt,
                **out3,
                "n": "i32",
                "V": "i32",
                "stride_tb": "i64",
                "stride_tn": "i64",
                "HAS_LOGITS": "constexpr",
                "BLOCK_N": "constexpr",
                "BLOCK_V": "constexpr",
            }
            const = {"HAS_LOGITS": has_logits, "BLOCK_N": 64, "BLOCK_V": bv}
            variants[f"greedy[logits={dt if has_logits else None},BLOCK_V={bv}]"] = (
                _KERNELS["greedy"][0],
                sig,
                const,
                _num_warps(bv),
            )
    for has_q in (True, False):
        for bv in (16, MAX_BLOCK_V):
            sig = {
                **tree,
                "p_ptr": "*fp32",
                "q_ptr": "*fp32",
                "accept_u_ptr": "*fp32",
                "sample_u_ptr": "*fp32",
                "r_ws_ptr": "*fp32",
                "q_ws_ptr": "*fp32",
                **out3,
                "n": "i32",
                "V": "i32",
                "stride_pb": "i64",
                "stride_pn": "i64",
                "stride_qb": "i64",
                "stride_qn": "i64",
                "HAS_Q": "constexpr",
                "BLOCK_N": "constexpr",
                "BLOCK_V": "constexpr",
            }
            const = {"HAS_Q": has_q, "BLOCK_N": 64, "BLOCK_V": bv}
            variants[f"rejection[q={has_q},BLOCK_V={bv}]"] = (_KERNELS["rejection"][0], sig, const, _num_warps(bv))
    for dt in ("*bf16", "*fp32"):
        sig = {
            "kv_ptr": dt,
            "keep_ptr": "*i64",
            "out_ptr": dt,
            "H": "i32",
            "L": "i32",
            "D": "i32",
            **{k: "i64" for k in ("s_kb", "s_kh", "s_ks", "s_kd", "s_ob", "s_oh", "s_ol", "s_od", "s_keep")},
            "BLOCK_L": "constexpr",
            "BLOCK_D": "constexpr",
        }
        variants[f"compact_kv[{dt}]"] = (_KERNELS["compact_kv"][0], sig, {"BLOCK_L": 32, "BLOCK_D": 128}, 4)
    sizes = {}
    for name, (fn, sig, const, warps) in variants.items():
        src = ASTSource(fn=fn, signature=sig, constexprs=const)
        compiled = triton.compile(src, target=target, options={"num_warps": warps, **_LAUNCH})
        sizes[name] = len(compiled.asm["cubin"])
    return sizes
