"""Triton verify kernels (``infer/kernels``) against the torch reference (``infer/accept.py``, ``torch.gather``).

Default tier: the kernels run on CPU tensors through Triton's interpreter (``force_triton=True``; no
environment variable is needed, see ``infer/kernels/triton_verify.py`` for why), on small random inputs
(the interpreter executes every block op in numpy). ``gpu`` tier: the same comparisons on CUDA with the
compiled kernels, through the default dispatch; skipped without CUDA. ``integration`` tier: compile every
kernel variant for sm_90 with Triton's bundled ptxas (no GPU needed; slow on a busy CPU).

Greedy and KV compaction must match bit for bit. Rejection sampling must match on every row except where
the kernel and the reference round a sum over V differently at a rounding-level tie; such rows are
accepted only if both results are within 1e-5 of a float64 replay (``rejection_disagreement``), and the
checker itself is shown to reject wrong results.
"""

from __future__ import annotations

import pytest
import torch

from infer.accept import AcceptResult, accept_greedy, accept_rejection, greedy_walk
from infer.kernels import (
    compact_kv,
    compact_kv_reference,
    rejection_disagreement,
    use_triton,
    verify_greedy,
    verify_rejection,
)
from infer.tree import DraftTree

TIE_TOL = 1e-5
"""Largest float64 distance from a decision boundary at which kernel and reference may decide differently."""

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


# ----------------------------------------------------------------------------------------------- inputs


def random_parents(B: int, n: int, kind: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """parents, valid [B, n]. kind: 'chain', 'star' (all children of the root) or 'tree' (random, with siblings).

    Rows get ragged real-node counts (invalid suffix) and some invalid nodes in the middle (whose valid
    children are then unreachable), so the batch exercises padding and ragged acceptance.
    """
    parents = torch.empty(B, n, dtype=torch.int64)
    parents[:, 0] = -1
    for j in range(1, n):
        if kind == "chain":
            parents[:, j] = j - 1
        elif kind == "star":
            parents[:, j] = 0
        else:  # biased towards recent nodes so trees get depth as well as siblings
            lo = torch.randint(0, j, (B,), generator=gen)
            parents[:, j] = torch.maximum(lo, torch.randint(0, j, (B,), generator=gen))
    valid = torch.ones(B, n, dtype=torch.bool)
    real = torch.randint(max(1, n // 2), n + 1, (B,), generator=gen)
    valid &= torch.arange(n)[None, :] < real[:, None]
    valid[:, 1:] &= torch.rand(B, n - 1, generator=gen) > 0.1
    valid[0] = True  # one full row
    return parents, valid


def greedy_case(
    B: int, n: int, V: int, kind: str, seed: int, ties: bool = False, logits: torch.Tensor | None = None
) -> tuple[DraftTree, torch.Tensor]:
    """A tree whose tokens copy the target argmax at their parent with prob 0.6 (ragged acceptance)."""
    gen = torch.Generator().manual_seed(seed)
    parents, valid = random_parents(B, n, kind, gen)
    if logits is None and ties:  # small integer logits: many exact ties, so argmax must take the first maximal index
        logits = torch.randint(0, 3, (B, n, V), generator=gen).float()
    elif logits is None:
        logits = torch.randn(B, n, V, generator=gen)
    tstar = logits.argmax(-1)
    tokens = torch.randint(0, V, (B, n), generator=gen)
    copy = torch.rand(B, n, generator=gen) < 0.6
    rows = torch.arange(B)
    for j in range(1, n):
        tokens[:, j] = torch.where(copy[:, j], tstar[rows, parents[:, j]], tokens[:, j])
    return DraftTree(tokens, parents, valid), logits


def rejection_case(
    B: int, n: int, V: int, kind: str, seed: int, draft: str
) -> tuple[DraftTree, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tree, p, accept_u, sample_u). draft: 'stochastic' (siblings drawn from q without replacement),
    'onehot' (deterministic top-k siblings, q = None), or 'degenerate' (q and p with exact zeros from
    top-k, a drafted token with q(x) = 0, and rows with p = q / 2, whose residual max(p - q, 0) is all zero).
    """
    gen = torch.Generator().manual_seed(seed)
    parents, valid = random_parents(B, n, kind, gen)
    base = 2.0 * torch.randn(B, n, V, generator=gen)
    # target close to the draft so that a good share of drafts is accepted
    p = torch.softmax(base + 0.7 * torch.randn(B, n, V, generator=gen), -1)
    q = torch.softmax(base, -1)
    if draft == "degenerate":
        q = q * (q >= q.topk(4, -1).values[..., -1:])
        q = q / q.sum(-1, keepdim=True)
        p = p * (p >= p.topk(6, -1).values[..., -1:])
        p = p / p.sum(-1, keepdim=True)
        p[B - 1] = q[B - 1] / 2
    tokens = torch.zeros(B, n, dtype=torch.int64)
    for b in range(B):
        for i in range(n):
            kids = (parents[b] == i).nonzero().flatten()
            if len(kids) == 0:
                continue
            if draft == "onehot":  # deterministic drafts: the top-k of the draft logits, in rank order
                picks = base[b, i].topk(len(kids)).indices
            else:
                k = min(len(kids), int((q[b, i] > 0).sum()))
                picks = torch.multinomial(q[b, i], k, replacement=False, generator=gen)
                picks = torch.cat([picks, torch.randint(0, V, (len(kids) - k,), generator=gen)])
            tokens[b, kids] = picks
    if draft == "degenerate":
        tokens[0, 1] = int(q[0, 0].argmin())  # a drafted token the draft gives zero probability
    tree = DraftTree(tokens, parents, valid, None if draft == "onehot" else q, siblings_sampled=draft != "onehot")
    accept_u = torch.rand(B, n, generator=gen)
    if draft == "degenerate":  # u >= 1/2 rejects every first try where p = q / 2: the residual is all zero
        accept_u[B - 1] = 0.5 + 0.5 * accept_u[B - 1]
    return tree, p, accept_u, torch.rand(B, n, generator=gen)


def to(device: str, tree: DraftTree, *tensors: torch.Tensor) -> tuple:
    dp = None if tree.draft_probs is None else tree.draft_probs.to(device)
    return (
        DraftTree(
            tree.tokens.to(device),
            tree.parents.to(device),
            tree.valid.to(device),
            dp,
            siblings_sampled=tree.siblings_sampled,
        ),
        *(t.to(device) for t in tensors),
    )


# ------------------------------------------------------------------------------------------ comparisons


def assert_same(got: AcceptResult, ref: AcceptResult) -> None:
    assert torch.equal(got.path, ref.path), f"path\n{got.path}\n{ref.path}"
    assert torch.equal(got.length, ref.length), f"length {got.length} vs {ref.length}"
    assert torch.equal(got.bonus, ref.bonus), f"bonus {got.bonus} vs {ref.bonus}"


def assert_rejection_matches(
    tree: DraftTree,
    p: torch.Tensor,
    au: torch.Tensor,
    su: torch.Tensor,
    got: AcceptResult,
    ref: AcceptResult,
    max_tie_rows: int = 0,
) -> None:
    """Rows equal, or (at most ``max_tie_rows`` of them) different only at a rounding-level tie."""
    same = (got.path == ref.path).all(1) & (got.length == ref.length) & (got.bonus == ref.bonus)
    diff = (~same).nonzero().flatten().tolist()
    if not diff:
        return
    cpu = to("cpu", tree, p, au, su)
    m_got = rejection_disagreement(*cpu, AcceptResult(got.path.cpu(), got.length.cpu(), got.bonus.cpu()), diff)
    m_ref = rejection_disagreement(*cpu, AcceptResult(ref.path.cpu(), ref.length.cpu(), ref.bonus.cpu()), diff)
    detail = "\n".join(
        f"row {b}: kernel {got.path[b].tolist()}+{int(got.bonus[b])} (float64 distance {float(mg):.2e}), "
        f"reference {ref.path[b].tolist()}+{int(ref.bonus[b])} ({float(mr):.2e})"
        for b, mg, mr in zip(diff, m_got, m_ref)
    )
    assert bool((m_got <= TIE_TOL).all() and (m_ref <= TIE_TOL).all()), f"not a rounding-level tie:\n{detail}"
    assert len(diff) <= max_tie_rows, f"{len(diff)} rows differ at ties (allowed {max_tie_rows}):\n{detail}"


# ------------------------------------------------------------------------------- default tier (interpreter)


@pytest.mark.parametrize(
    "kind,seed,ties", [("tree", 0, False), ("chain", 1, False), ("star", 2, False), ("tree", 3, True)]
)
def test_greedy_interpreter(kind: str, seed: int, ties: bool) -> None:
    tree, logits = greedy_case(B=4, n=12, V=40, kind=kind, seed=seed, ties=ties)
    ref = accept_greedy(tree, logits)
    assert_same(verify_greedy(tree, logits, force_triton=True), ref)
    # the argmax-input variant (kernel and torch path) and bf16 logits follow the same walk
    assert_same(verify_greedy(tree, logits.argmax(-1), force_triton=True), ref)
    assert_same(greedy_walk(tree, logits.argmax(-1)), ref)
    bf = logits.bfloat16()
    assert_same(verify_greedy(tree, bf, force_triton=True), accept_greedy(tree, bf))
    if kind == "star":  # one level: a row accepts at most one draft
        assert int(ref.length.max()) == 2
    else:
        assert int(ref.length.min()) < int(ref.length.max()) and int(ref.length.max()) > 2, "acceptance not ragged"


def test_greedy_interpreter_multi_block_vocab(monkeypatch: pytest.MonkeyPatch) -> None:
    """V spanning several BLOCK_V chunks, with the maximum tied across chunks (the first chunk must win)."""
    from infer.kernels import triton_verify

    monkeypatch.setattr(triton_verify, "MAX_BLOCK_V", 16)
    logits = torch.randn(2, 6, 45, generator=torch.Generator().manual_seed(4))
    logits[:, :, 3] = 10.0
    logits[:, :, 35] = 10.0  # same maximum in the third chunk
    logits[1, 2, 40] = 11.0  # a strict maximum in the last, partial chunk
    tree, logits = greedy_case(B=2, n=6, V=45, kind="chain", seed=4, logits=logits)
    assert_same(verify_greedy(tree, logits, force_triton=True), accept_greedy(tree, logits))


@pytest.mark.parametrize(
    "kind,seed,draft",
    [
        ("tree", 10, "stochastic"),
        ("chain", 11, "stochastic"),
        ("star", 17, "stochastic"),
        ("tree", 12, "onehot"),
        ("star", 13, "onehot"),
        ("tree", 14, "degenerate"),
        ("star", 16, "degenerate"),
    ],
)
def test_rejection_interpreter(kind: str, seed: int, draft: str) -> None:
    tree, p, au, su = rejection_case(B=4, n=10, V=24, kind=kind, seed=seed, draft=draft)
    ref = accept_rejection(tree, p, au, su)
    got = verify_rejection(tree, p, au, su, force_triton=True)
    assert_rejection_matches(tree, p, au, su, got, ref)
    if kind != "star":
        assert int(ref.length.max()) > 2, "no row accepted two drafts: the case does not exercise the walk"


def test_rejection_interpreter_multi_block_vocab(monkeypatch: pytest.MonkeyPatch) -> None:
    """Residual sums, workspace writes and the inverse CDF across several BLOCK_V chunks."""
    from infer.kernels import triton_verify

    monkeypatch.setattr(triton_verify, "MAX_BLOCK_V", 16)
    tree, p, au, su = rejection_case(B=3, n=8, V=50, kind="tree", seed=15, draft="stochastic")
    assert_rejection_matches(
        tree, p, au, su, verify_rejection(tree, p, au, su, force_triton=True), accept_rejection(tree, p, au, su)
    )


def test_disagreement_checker_has_teeth() -> None:
    """The float64 replay accepts the reference and rejects a moved bonus, a dropped or an extra accept."""
    tree, p, au, su = rejection_case(B=4, n=10, V=24, kind="tree", seed=16, draft="stochastic")
    ref = accept_rejection(tree, p, au, su)
    assert bool((rejection_disagreement(tree, p, au, su, ref) <= 1e-6).all())
    b = int(ref.length.argmax())
    moved = AcceptResult(ref.path.clone(), ref.length.clone(), ref.bonus.clone())
    moved.bonus[b] = (moved.bonus[b] + 7) % p.shape[-1]
    dropped = AcceptResult(ref.path.clone(), ref.length.clone(), ref.bonus.clone())
    dropped.length[b] -= 1
    dropped.path[b, dropped.length[b]] = -1
    extra = AcceptResult(ref.path.clone(), ref.length.clone(), ref.bonus.clone())
    extra.path[b, extra.length[b]] = tree.num_nodes - 1
    extra.length[b] += 1
    for bad in (moved, dropped, extra):
        assert float(rejection_disagreement(tree, p, au, su, bad, [b])[0]) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_kv_interpreter(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(20)
    # D not a power of two, L spanning two BLOCK_L blocks, keep unsorted with repeats, different per row
    B, H, S, D, L = 3, 2, 50, 24, 40
    kv = torch.randn(B, H, S, D, generator=gen).to(dtype)
    keep = torch.randint(0, S, (B, L), generator=gen)
    assert torch.equal(compact_kv(kv, keep, force_triton=True), compact_kv_reference(kv, keep))
    # a strided view: the cache stored [B, S, H, D] and seen as [B, H, S, D], and a prefix of a longer buffer
    big = torch.randn(B, S + 7, H, D, generator=gen).to(dtype)
    view = big[:, :S].transpose(1, 2)
    assert torch.equal(compact_kv(view, keep, force_triton=True), compact_kv_reference(view, keep))
    # the runtime's use: keep the prefix plus the accepted tree nodes
    keep2 = torch.cat([torch.arange(30).expand(B, 30), 30 + torch.tensor([[0, 2, 5], [0, 1, 3], [0, 4, 9]])], 1)
    assert torch.equal(
        compact_kv(kv, keep2, force_triton=True), kv.gather(2, keep2[:, None, :, None].expand(-1, H, -1, D))
    )


def test_compact_kv_reference_of_one_row_is_the_gather() -> None:
    """Batch 1 takes an index_select: the same positions as the batched gather, on a strided view too."""
    gen = torch.Generator().manual_seed(21)
    H, S, D = 3, 40, 16
    keep = torch.tensor([[0, 4, 4, 9, 39]])
    for kv in (
        torch.randn(1, H, S, D, generator=gen),
        torch.randn(1, S + 5, H, D, generator=gen)[:, :S].transpose(1, 2),
    ):
        want = kv.gather(2, keep[:, None, :, None].expand(-1, H, -1, D))
        assert torch.equal(compact_kv_reference(kv, keep), want)
    with pytest.raises(IndexError):
        compact_kv_reference(torch.zeros(1, H, S, D), torch.tensor([[S]]))


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("DRAFTERS_TRITON", raising=False)
    assert not use_triton(cpu)
    assert use_triton(cpu, force_triton=True)
    monkeypatch.setenv("DRAFTERS_TRITON", "1")
    assert use_triton(cpu)
    assert not use_triton(cpu, force_triton=False)
    monkeypatch.setenv("DRAFTERS_TRITON", "0")
    assert not use_triton(torch.device("cuda"))
    # the default path on CPU tensors is the reference itself
    monkeypatch.delenv("DRAFTERS_TRITON")
    tree, logits = greedy_case(B=2, n=5, V=10, kind="tree", seed=21)
    assert_same(verify_greedy(tree, logits), accept_greedy(tree, logits))


# --------------------------------------------------------------------------------------------- gpu tier


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["tree", "chain", "star"])
def test_greedy_cuda(kind: str) -> None:
    for seed, V, ties in ((30, 1000, False), (31, 50_000, False), (32, 300, True)):
        tree, logits = to("cuda", *greedy_case(B=16, n=40, V=V, kind=kind, seed=seed, ties=ties))
        ref = accept_greedy(tree, logits)
        assert_same(verify_greedy(tree, logits), ref)  # default dispatch on CUDA = the Triton kernel
        assert_same(verify_greedy(tree, logits.argmax(-1)), ref)
        assert_same(verify_greedy(tree, logits.bfloat16()), accept_greedy(tree, logits.bfloat16()))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("draft", ["stochastic", "onehot", "degenerate"])
def test_rejection_cuda(draft: str) -> None:
    for seed, kind, V in ((40, "tree", 500), (41, "chain", 5000), (42, "tree", 32_000)):
        tree, p, au, su = to("cuda", *rejection_case(B=16, n=24, V=V, kind=kind, seed=seed, draft=draft))
        ref = accept_rejection(tree, p, au, su)
        # on CUDA the reference's cumsum is a float32 scan: a row may differ at a tie, rarely
        assert_rejection_matches(tree, p, au, su, verify_rejection(tree, p, au, su), ref, max_tie_rows=1)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compact_kv_cuda(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(50)
    for B, H, S, D, L in ((1, 8, 2048, 128, 2000), (4, 2, 300, 80, 77), (3, 4, 64, 64, 64)):
        kv = torch.randn(B, H, S, D, generator=gen).to(dtype).cuda()
        keep = torch.randint(0, S, (B, L), generator=gen).cuda()
        assert torch.equal(compact_kv(kv, keep), compact_kv_reference(kv, keep))
        view = kv.transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, D] storage
        assert torch.equal(compact_kv(view, keep), compact_kv_reference(view, keep))


# ------------------------------------------------------------------------------------- integration tier


@pytest.mark.integration
def test_kernels_compile_for_hopper() -> None:
    """Every kernel variant lowers to a cubin for sm_90 (the interpreter never runs the real compiler)."""
    from infer.kernels.triton_verify import compile_for_nvidia

    sizes = compile_for_nvidia(90)
    assert sizes and all(v > 0 for v in sizes.values())


# ------------------------------------------------------------------------------- inputs checked first
@pytest.mark.parametrize("force", [False, True])
def test_bad_verify_inputs_give_the_same_error_on_both_paths(force: bool) -> None:
    """The torch reference raises on an out-of-range token only by accident of indexing, and the kernel would read
    past the row: both must refuse before running, with one message."""
    torch.manual_seed(0)
    B, n, V = 2, 3, 11
    tokens = torch.randint(0, V, (B, n))
    parents = torch.tensor([[-1, 0, 1]] * B)
    valid = torch.ones(B, n, dtype=torch.bool)
    p = torch.rand(B, n, V).softmax(-1)
    u = torch.rand(B, n)
    q = torch.rand(B, n, V).softmax(-1)

    def run(tree: DraftTree, rule: str):
        if rule == "greedy":
            return verify_greedy(tree, p.log(), force_triton=force)
        return verify_rejection(tree, p, u, u, force_triton=force)

    for rule in ("greedy", "rejection"):
        for bad in (V, -1):
            t = tokens.clone()
            t[1, 2] = bad
            with pytest.raises(ValueError, match=rf"row 1 node 2 has token id {bad}, outside \[0, 11\)"):
                run(DraftTree(t, parents, valid), rule)
    not_a_distribution = q.clone()
    not_a_distribution[0, 1] *= 2  # node 1 has a child (node 2): its q is read
    negative = q.clone()
    negative[1, 0, 3] = -0.1
    negative[1, 0, 4] += 0.1
    for draft_probs, message in (
        (not_a_distribution, "must be distributions"),
        (negative, "must be distributions"),
        (q.to(torch.bfloat16), "float32 or float64"),
        (q[..., :-1].softmax(-1), "cover 10 tokens"),
    ):
        with pytest.raises(ValueError, match=message):
            run(DraftTree(tokens, parents, valid, draft_probs), "rejection")
    unread = q.clone()
    unread[:, 2] = 0.0  # the last node has no children: its row is never read, so zeros are fine
    run(DraftTree(tokens, parents, valid, unread), "rejection")
