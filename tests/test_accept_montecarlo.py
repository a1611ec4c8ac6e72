"""Monte-Carlo checks that rejection-sampling verification is lossless (REFERENCE.md, "Accept rules").

A stand-in target whose next-token distribution depends on the context (a fixed random logits table
indexed by position and previous token) and a different stand-in draft, over a small vocabulary.
Each case runs 1e5 independent generations of two tokens and compares the first emitted token and the
first two jointly with the exact target distribution p(x1 | root) * p(x2 | root, x1). When a round
emits only one token, the second comes from a second speculative round rooted at x1, as in real
generation. Then the same check must FAIL for wrong rules ("teeth").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import scipy.stats
import torch

from infer.accept import AcceptResult, accept_rejection
from infer.sampling import SamplingParams, sample_from_probs, target_probs, warp_logits
from infer.tree import DraftTree

V = 6
N_DRAWS = 100_000
ROOT = 2
_table_gen = torch.Generator().manual_seed(1234)
# [position, previous token, V]: the root sits at position 0; a node at depth d of a round rooted at
# position s predicts the token at position s + d + 1 from TARGET[s + d, its own token].
TARGET = 1.5 * torch.randn(6, V, V, generator=_table_gen)
DRAFT = 0.6 * TARGET + torch.randn(6, V, V, generator=_table_gen)

CHAIN = [-1, 0, 1, 2]
# 3 siblings below the root, 2 below nodes 1 and 2 (depth 2), one depth-3 node, a leaf at depth 1
TREE = [-1, 0, 0, 0, 1, 1, 2, 2, 4]

Rule = Callable[[DraftTree, torch.Tensor, torch.Tensor, torch.Tensor], AcceptResult]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Many small ops on [1e5, 6] tensors: extra intra-op threads only add overhead (5x on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Case:
    parents: list[int]
    stochastic: bool
    """True: children drawn from q without replacement; False: deterministic top-k drafts (one-hot q)."""
    params: SamplingParams
    draft_top_k: int = 0
    """Warp the stochastic draft with top-k too (q with zeros)."""


def build_round(case: Case, root: torch.Tensor, pos: int, gen: torch.Generator) -> tuple[DraftTree, torch.Tensor]:
    """A draft tree per row rooted at token ``root`` [B] at position ``pos``, and the target probs [B, n, V]."""
    B, n = root.shape[0], len(case.parents)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[case.parents[i]] + 1
    tokens = torch.zeros(B, n, dtype=torch.int64)
    tokens[:, 0] = root
    q = torch.zeros(B, n, V)
    p = torch.zeros(B, n, V)
    draft_params = SamplingParams(temperature=1.0, top_k=case.draft_top_k)
    for i in range(n):  # parents precede children, so tokens[:, i] is known here
        draft_logits = warp_logits(DRAFT[pos + depth[i], tokens[:, i]], draft_params)
        q[:, i] = draft_logits.softmax(-1)
        p[:, i] = target_probs(TARGET[pos + depth[i], tokens[:, i]], case.params)
        kids = [j for j in range(n) if case.parents[j] == i]
        if not kids:
            continue
        if case.stochastic:  # Gumbel-top-k = sequential sampling without replacement, in draw order
            gumbel = -torch.log(-torch.log(torch.rand(B, V, generator=gen).clamp_min(1e-20)))
            tokens[:, kids] = (q[:, i].log() + gumbel).topk(len(kids), dim=-1).indices
        else:
            tokens[:, kids] = draft_logits.topk(len(kids), dim=-1).indices
    parents = torch.tensor(case.parents).expand(B, n).clone()
    valid = torch.ones(B, n, dtype=torch.bool)
    tree = DraftTree(tokens, parents, valid, q if case.stochastic else None, siblings_sampled=case.stochastic)
    return tree, p


def first_emitted(tree: DraftTree, res: AcceptResult, k: int) -> torch.Tensor:
    """[B] the k-th emitted token (k = 0, 1) where the round emitted more than k tokens, else -1."""
    rows = torch.arange(tree.batch_size)
    node = res.path[rows, (k + 1) % tree.num_nodes]
    drafted = tree.tokens[rows, node.clamp_min(0)]
    return torch.where(res.length > k + 1, drafted, torch.where(res.length == k + 1, res.bonus, -1))


def generate_two(rule: Rule, case: Case, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """N_DRAWS independent generations from ROOT: the first two emitted tokens, [N], [N]."""
    gen = torch.Generator().manual_seed(seed)
    root = torch.full((N_DRAWS,), ROOT, dtype=torch.int64)
    tree, p = build_round(case, root, 0, gen)
    res = rule(tree, p, torch.rand(tree.tokens.shape, generator=gen), torch.rand(tree.tokens.shape, generator=gen))
    x1, x2 = first_emitted(tree, res, 0), first_emitted(tree, res, 1)
    tree2, p2 = build_round(case, x1, 1, gen)  # next round, used by the rows that emitted one token
    res2 = rule(tree2, p2, torch.rand(tree2.tokens.shape, generator=gen), torch.rand(tree2.tokens.shape, generator=gen))
    return x1, torch.where(x2 >= 0, x2, first_emitted(tree2, res2, 0))


def true_distributions(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact p(x1 | root) [V] and the joint p(x1, x2) flattened to [V * V] (bin x1 * V + x2), float64."""
    p1 = target_probs(TARGET[0, ROOT], params).double()
    p2 = target_probs(TARGET[1], params).double()  # [x1, x2]
    return p1 / p1.sum(), (p1[:, None] * p2 / p2.sum(-1, keepdim=True)).flatten()


def distribution_mismatch(samples: torch.Tensor, probs: torch.Tensor) -> str | None:
    """None when ``samples`` (bin ids) look drawn from ``probs``, else what is wrong.

    Every bin within 6 sqrt(n p (1 - p)) + 5 of n p, zero-probability bins never drawn, and a
    chi-square p-value > 1e-3 over the nonzero bins.
    """
    probs = probs.double() / probs.double().sum()
    n = samples.numel()
    if int(samples.min()) < 0:
        return "some draws produced no token"
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = n * probs
    tol = 6 * torch.sqrt(n * probs * (1 - probs)) + 5
    problems = []
    bad = ((counts - expected).abs() > tol).nonzero().flatten().tolist()
    if bad:
        problems.append(f"bins {bad}: counts {counts[bad].tolist()} vs expected {expected[bad].round().tolist()}")
    zero = ((probs == 0) & (counts > 0)).nonzero().flatten().tolist()
    if zero:
        problems.append(f"zero-probability bins {zero} drawn")
    nz = probs > 0
    chi = scipy.stats.chisquare(counts[nz].numpy(), expected[nz].numpy() * counts[nz].sum().item() / n)
    if not chi.pvalue > 1e-3:
        problems.append(f"chi-square p-value {chi.pvalue:.3g}")
    return "; ".join(problems) or None


def check_rule(rule: Rule, case: Case, seed: int) -> str | None:
    """Run the Monte-Carlo generations and check the first token and the first two jointly."""
    x1, x2 = generate_two(rule, case, seed)
    p1, joint = true_distributions(case.params)
    first = distribution_mismatch(x1, p1)
    pair = distribution_mismatch(x1 * V + x2, joint)
    if first is None and pair is None:
        return None
    return f"first token: {first}; first two: {pair}"


T1 = SamplingParams(temperature=1.0)
WARPED = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
CASES = {
    "chain_stochastic": Case(CHAIN, True, T1),
    "tree_stochastic": Case(TREE, True, T1),
    "chain_topk": Case(CHAIN, False, T1),
    "tree_topk": Case(TREE, False, T1),
    "tree_stochastic_warped": Case(TREE, True, WARPED),
    "tree_stochastic_sparse_draft_warped": Case(TREE, True, WARPED, draft_top_k=3),
    "chain_topk_warped": Case(CHAIN, False, WARPED),
    "tree_topk_warped": Case(TREE, False, WARPED),
}


def test_cases_are_informative() -> None:
    """The stand-in draft is neither perfect nor useless: every case accepts and rejects often."""
    gen = torch.Generator().manual_seed(7)
    for name, case in CASES.items():
        root = torch.full((20_000,), ROOT, dtype=torch.int64)
        tree, p = build_round(case, root, 0, gen)
        res = accept_rejection(tree, p, torch.rand(tree.tokens.shape, generator=gen), torch.rand(tree.tokens.shape))
        mean = (res.length - 1).double().mean().item()
        assert 0.2 < mean < len(case.parents) - 1.2, (name, mean)
    p1, _ = true_distributions(WARPED)
    assert int((p1 == 0).sum()) >= 2  # the warped target really has zero-probability tokens


@pytest.mark.parametrize("name", list(CASES))
def test_rejection_sampling_is_lossless(name: str) -> None:
    problem = check_rule(accept_rejection, CASES[name], seed=100 + list(CASES).index(name))
    assert problem is None, problem


# ---------------------------------------------------------------------------------------------------
# Wrong rules: the check above must reject each of them.


def _walk(
    tree: DraftTree,
    p: torch.Tensor,
    accept_u: torch.Tensor,
    sample_u: torch.Tensor,
    accept: Callable[..., torch.Tensor],
    residual: Callable[..., torch.Tensor],
    update_q: bool = True,
) -> AcceptResult:
    """Tree walk with pluggable test and residual (same skeleton as infer.accept, stochastic q only).

    ``accept(r, q, x, u) -> bool [B]``; ``residual(r, q, x) -> [B, V]`` the target after rejecting x.
    """
    B, n, _ = p.shape
    q = tree.draft_probs
    rows = torch.arange(B)
    cur = torch.zeros(B, dtype=torch.int64)
    path = torch.full((B, n), -1, dtype=torch.int64)
    path[:, 0] = 0
    length = torch.ones(B, dtype=torch.int64)
    r, qr = p[:, 0].clone(), q[:, 0].clone()
    for j in range(1, n):
        tried = tree.valid[:, j] & (tree.parents[:, j] == cur)
        x = tree.tokens[:, j : j + 1]
        acc = tried & accept(r, qr, x, accept_u[:, j])
        rej = (tried & ~acc)[:, None]
        new_q = qr.scatter(1, x, 0.0)
        new_q = new_q / new_q.sum(-1, keepdim=True).clamp_min(1e-30) if update_q else qr
        r = torch.where(acc[:, None], p[:, j], torch.where(rej, residual(r, qr, x), r))
        qr = torch.where(acc[:, None], q[:, j], torch.where(rej, new_q, qr))
        path[rows, length] = torch.where(acc, j, path[rows, length])
        cur = torch.where(acc, j, cur)
        length = length + acc.long()
    return AcceptResult(path, length, sample_from_probs(r, sample_u[rows, cur]))


def _correct_accept(r: torch.Tensor, q: torch.Tensor, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return u * q.gather(1, x).squeeze(1) < r.gather(1, x).squeeze(1)


def _correct_residual(r: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    res = (r - q).clamp_min(0)
    return res / res.sum(-1, keepdim=True).clamp_min(1e-30)


def explainer_rule(tree: DraftTree, p: torch.Tensor, accept_u: torch.Tensor, sample_u: torch.Tensor) -> AcceptResult:
    """WRONG (popular explainers): accept x if q(x) >= p(x), else sample from softmax(q - p)."""
    return _walk(
        tree,
        p,
        accept_u,
        sample_u,
        lambda r, q, x, u: q.gather(1, x).squeeze(1) >= r.gather(1, x).squeeze(1),
        lambda r, q, x: (q - r).softmax(-1),
    )


def resample_target_rule(
    tree: DraftTree, p: torch.Tensor, accept_u: torch.Tensor, sample_u: torch.Tensor
) -> AcceptResult:
    """WRONG: correct accept test, but on rejection keep sampling from p instead of max(p - q, 0)."""
    return _walk(tree, p, accept_u, sample_u, _correct_accept, lambda r, q, x: r)


def stale_q_rule(tree: DraftTree, p: torch.Tensor, accept_u: torch.Tensor, sample_u: torch.Tensor) -> AcceptResult:
    """WRONG for siblings drawn without replacement: q is not updated after a rejected sibling."""
    return _walk(tree, p, accept_u, sample_u, _correct_accept, _correct_residual, update_q=False)


def test_walk_skeleton_with_correct_rule_passes() -> None:
    """The test-side walker with the correct pieces agrees with infer.accept (so the teeth test the rule)."""
    case = CASES["tree_stochastic"]
    gen = torch.Generator().manual_seed(3)
    tree, p = build_round(case, torch.full((5000,), ROOT, dtype=torch.int64), 0, gen)
    au, su = torch.rand(tree.tokens.shape, generator=gen), torch.rand(tree.tokens.shape, generator=gen)
    ours = accept_rejection(tree, p, au, su)
    theirs = _walk(tree, p, au, su, _correct_accept, _correct_residual)
    assert torch.equal(ours.path, theirs.path) and torch.equal(ours.bonus, theirs.bonus)


@pytest.mark.parametrize(
    ("rule", "name"),
    [
        (explainer_rule, "chain_stochastic"),
        (explainer_rule, "tree_stochastic"),
        (resample_target_rule, "chain_stochastic"),
        (resample_target_rule, "tree_stochastic_warped"),
        (stale_q_rule, "tree_stochastic"),
    ],
)
def test_check_catches_wrong_rules(rule: Rule, name: str) -> None:
    assert check_rule(rule, CASES[name], seed=100 + list(CASES).index(name)) is not None


def test_mismatch_helper_on_exact_samples() -> None:
    """The helper accepts exact draws and flags a small bias and a drawn zero-probability bin."""
    gen = torch.Generator().manual_seed(5)
    probs = torch.tensor([0.5, 0.2, 0.0, 0.3])
    draws = sample_from_probs(probs.expand(N_DRAWS, 4), torch.rand(N_DRAWS, generator=gen))
    assert distribution_mismatch(draws, probs) is None
    biased = torch.tensor([0.49, 0.21, 0.0, 0.3])
    assert distribution_mismatch(draws, biased) is not None
    assert distribution_mismatch(torch.cat([draws[:-1], torch.tensor([2])]), probs) is not None
    assert math.isclose(float(probs.sum()), 1.0)
