"""Exact-value tests of the accept rules on hand-built trees (distribution tests: test_accept_montecarlo.py)."""

from __future__ import annotations

import math

import pytest
import torch

from infer.accept import AcceptResult, accept_greedy, accept_rejection, accept_typical, emitted_tokens
from infer.sampling import SamplingParams, greedy_ids, sample_from_probs, target_probs
from infer.tree import DraftTree, chain

V = 8


def argmax_logits(best: list[list[int]]) -> torch.Tensor:
    """[B, n, V] logits whose argmax at row b, node i is ``best[b][i]`` (other tokens get smaller random logits)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.rand(len(best), len(best[0]), V, generator=gen)
    logits.scatter_(2, torch.tensor(best)[..., None], 2.0)
    return logits


def tree(
    tokens: list[list[int]],
    parents: list[int],
    valid: list[list[bool]] | None = None,
    draft_probs: torch.Tensor | None = None,
) -> DraftTree:
    B, n = len(tokens), len(parents)
    v = torch.ones(B, n, dtype=torch.bool) if valid is None else torch.tensor(valid)
    # trees given a q here stand for siblings drawn from it without replacement
    parent_ids = torch.tensor(parents).expand(B, n).clone()
    return DraftTree(torch.tensor(tokens), parent_ids, v, draft_probs, siblings_sampled=draft_probs is not None)


def assert_result(res: AcceptResult, paths: list[list[int]], bonus: list[int]) -> None:
    n = res.path.shape[1]
    assert res.path.tolist() == [p + [-1] * (n - len(p)) for p in paths]
    assert res.length.tolist() == [len(p) for p in paths]
    assert res.bonus.tolist() == bonus


def reference_greedy(t: DraftTree, logits: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """Plain per-row walk, written independently of infer.accept."""
    paths, bonus = [], []
    tokens, parents, valid, argmax = t.tokens.tolist(), t.parents.tolist(), t.valid.tolist(), logits.argmax(-1).tolist()
    for b in range(t.batch_size):
        node, path = 0, [0]
        while True:
            best = argmax[b][node]
            kids = [j for j in range(t.num_nodes) if valid[b][j] and parents[b][j] == node]
            match = [j for j in kids if tokens[b][j] == best]
            if not match:
                break
            node = match[0]
            path.append(node)
        paths.append(path)
        bonus.append(best)
    return paths, bonus


# --- greedy -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_ids_are_argmax_first_on_ties(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3, 1000, generator=g).to(dtype)
    logits[0, 0, [17, 400, 999]] = 50.0  # a three-way tie at the top: the first index wins
    logits[1, 2, [0, 1]] = 50.0
    ids = greedy_ids(logits)
    assert ids.dtype == torch.int64 and ids.shape == (6, 3)
    assert torch.equal(ids, logits.argmax(-1))
    assert ids[0, 0] == 17 and ids[1, 2] == 0


def test_greedy_full_accept() -> None:
    res = accept_greedy(chain(torch.tensor([[7, 1, 2, 3]])), argmax_logits([[1, 2, 3, 4]]))
    assert_result(res, [[0, 1, 2, 3]], [4])


def test_greedy_partial_accept() -> None:
    res = accept_greedy(chain(torch.tensor([[7, 1, 2, 3]])), argmax_logits([[1, 5, 3, 4]]))
    assert_result(res, [[0, 1]], [5])
    res = accept_greedy(chain(torch.tensor([[7, 1, 2, 3]])), argmax_logits([[6, 2, 3, 4]]))
    assert_result(res, [[0]], [6])


def test_greedy_second_sibling_and_its_subtree() -> None:
    # root -> {1: tok 5, 2: tok 7}; 1 -> {3: tok 6}; 2 -> {4: tok 6, 5: tok 3}
    t = tree([[0, 5, 7, 6, 6, 3]], [-1, 0, 0, 1, 2, 2])
    res = accept_greedy(t, argmax_logits([[7, 6, 3, 0, 0, 0]]))
    assert_result(res, [[0, 2, 5]], [0])  # node 3 would match (6 at node 1), but is below the rejected sibling
    res = accept_greedy(t, argmax_logits([[7, 6, 6, 0, 4, 0]]))
    assert_result(res, [[0, 2, 4]], [4])


def test_greedy_duplicate_siblings_take_the_first() -> None:
    t = tree([[0, 4, 4]], [-1, 0, 0])
    assert_result(accept_greedy(t, argmax_logits([[4, 1, 2]])), [[0, 1]], [1])


def test_invalid_nodes_are_never_accepted() -> None:
    t = tree([[0, 1, 2, 3], [0, 4, 4, 5]], [-1, 0, 1, 2], valid=[[True, True, False, False], [True, False, True, True]])
    res = accept_greedy(t, argmax_logits([[1, 2, 3, 6], [4, 4, 4, 4]]))
    # row 0: node 2 matches but is padding; row 1: node 1 matches but is invalid, and node 2's parent is node 1
    assert_result(res, [[0, 1], [0]], [2, 4])
    sib = tree([[0, 4, 4]], [-1, 0, 0], valid=[[True, False, True]])
    assert_result(accept_greedy(sib, argmax_logits([[4, 1, 2]])), [[0, 2]], [2])
    # the same for the stochastic rules: an invalid node whose token has target mass 1 is still skipped
    p = target_probs(argmax_logits([[4, 1, 2]]), SamplingParams())
    assert_result(accept_rejection(sib, p, torch.zeros(1, 3), torch.zeros(1, 3)), [[0, 2]], [2])
    assert_result(accept_typical(sib, argmax_logits([[4, 1, 2]]), SamplingParams(), torch.zeros(1, 3)), [[0, 2]], [2])


def test_greedy_ragged_batch() -> None:
    tokens = torch.tensor([[9, 1, 2, 3], [9, 1, 2, 3], [9, 1, 2, 3]])
    res = accept_greedy(chain(tokens), argmax_logits([[0, 2, 3, 4], [1, 0, 3, 4], [1, 2, 3, 5]]))
    assert_result(res, [[0], [0, 1], [0, 1, 2, 3]], [0, 0, 5])
    assert emitted_tokens(chain(tokens), res) == [[0], [1, 0], [1, 2, 3, 5]]


def test_greedy_matches_reference_walk_on_random_trees_and_chains() -> None:
    gen = torch.Generator().manual_seed(1)
    B, n, v = 64, 12, 3  # tiny vocab so that matches are frequent
    parents = torch.stack(
        [torch.cat([torch.tensor([-1, 0]), torch.randint(0, 1 << 30, (n - 2,), generator=gen)]) for _ in range(B)]
    )
    parents[:, 2:] = parents[:, 2:] % torch.arange(2, n)  # parent < index
    valid = torch.rand(B, n, generator=gen) > 0.1
    valid[:, 0] = True
    t = DraftTree(torch.randint(0, v, (B, n), generator=gen), parents, valid)
    logits = torch.randn(B, n, v, generator=gen)
    paths, bonus = reference_greedy(t, logits)
    assert_result(accept_greedy(t, logits), paths, bonus)
    c = chain(t.tokens)
    paths, bonus = reference_greedy(c, logits)
    assert_result(accept_greedy(c, logits), paths, bonus)
    assert max(len(p) for p in paths) > 2  # the random case exercises acceptance


# --- rejection sampling -----------------------------------------------------------------------------


def test_rejection_with_p_equal_q_accepts_everything() -> None:
    gen = torch.Generator().manual_seed(2)
    B, n = 256, 6
    q = torch.rand(B, n, V, generator=gen).softmax(-1)
    c = chain(torch.randint(0, V, (B, n), generator=gen), draft_probs=q)
    u, su = torch.rand(B, n, generator=gen), torch.rand(B, n, generator=gen)
    res = accept_rejection(c, q.clone(), u, su)
    assert res.length.tolist() == [n] * B
    assert torch.equal(res.bonus, sample_from_probs(q[:, -1], su[:, -1]))  # leaf bonus ~ p at the leaf
    # siblings: the first child is always accepted, whatever the uniforms
    t = tree([[0, 1, 2, 3, 4]] * B, [-1, 0, 0, 1, 1], draft_probs=q[:, :5])
    res = accept_rejection(t, q[:, :5].clone(), u[:, :5], u[:, :5])
    assert res.path[:, :3].tolist() == [[0, 1, 3]] * B


def test_rejection_leaf_bonus_uses_leaf_distribution() -> None:
    p = torch.tensor([[[0.0, 1.0, 0, 0, 0, 0, 0, 0], [0.25, 0.25, 0.25, 0.25, 0, 0, 0, 0]]])
    c = chain(torch.tensor([[5, 1]]))
    for su, tok in [(0.1, 0), (0.3, 1), (0.6, 2), (0.99, 3)]:
        res = accept_rejection(c, p, torch.tensor([[0.0, 0.999]]), torch.tensor([[0.0, su]]))
        assert_result(res, [[0, 1]], [tok])


def test_one_hot_draft_with_zero_target_mass_is_always_rejected() -> None:
    p = torch.zeros(1, 2, V)
    p[0, 0, :4] = torch.tensor([0.1, 0.2, 0.3, 0.4])  # token 6 has p = 0 (e.g. removed by top-k)
    p[0, 1, 0] = 1.0
    c = chain(torch.tensor([[0, 6]]))
    for su in (0.0, 0.05, 0.2, 0.45, 0.7, 0.95, 0.999):
        res = accept_rejection(c, p, torch.zeros(1, 2), torch.tensor([[su, 0.0]]))  # u = 0: most lenient
        assert res.length.item() == 1 and res.bonus.item() in (0, 1, 2, 3)


def test_one_hot_siblings_zero_out_rejected_tokens() -> None:
    p = torch.zeros(1, 3, V)
    p[0, 0, :3] = torch.tensor([0.5, 0.3, 0.2])
    p[0, 1, 7] = p[0, 2, 7] = 1.0
    t = tree([[0, 0, 1]], [-1, 0, 0])
    # sibling 1 (token 0): accept iff u < 0.5; sibling 2 (token 1) against [0, 0.6, 0.4]: accept iff u < 0.6
    assert_result(accept_rejection(t, p, torch.tensor([[0, 0.49, 0]]), torch.zeros(1, 3)), [[0, 1]], [7])
    assert_result(accept_rejection(t, p, torch.tensor([[0, 0.5, 0.59]]), torch.zeros(1, 3)), [[0, 2]], [7])
    # both rejected: the residual is [0, 0, 1] -> bonus 2 whatever sample_u
    for su in (0.0, 0.5, 0.999):
        res = accept_rejection(t, p, torch.tensor([[0, 0.5, 0.61]]), torch.tensor([[su, 0, 0]]))
        assert_result(res, [[0]], [2])


def test_stochastic_siblings_residual_and_q_update() -> None:
    p = torch.zeros(1, 3, V)
    q = torch.zeros(1, 3, V)
    p[0, 0, :3] = torch.tensor([0.5, 0.3, 0.2])
    q[0, 0, :3] = torch.tensor([0.6, 0.1, 0.3])
    p[0, 1:, 7] = q[0, 1:, 7] = 1.0
    t = tree([[0, 0, 2]], [-1, 0, 0], draft_probs=q)
    # sibling 1 (token 0): accept iff u * 0.6 < 0.5, i.e. u < 5/6
    assert_result(accept_rejection(t, p, torch.tensor([[0, 0.83, 0]]), torch.zeros(1, 3)), [[0, 1]], [7])
    # rejected: residual max(p - q, 0) = [0, 0.2, 0] -> [0, 1, 0]; q -> [0, 0.25, 0.75]. Sibling 2 (token 2) has
    # residual mass 0: rejected even at u = 0; residual max([0, 1, 0] - [0, .25, .75], 0) -> [0, 1, 0] -> bonus 1.
    for su in (0.0, 0.7, 0.999):
        res = accept_rejection(t, p, torch.tensor([[0, 0.84, 0.0]]), torch.tensor([[su, 0, 0]]))
        assert_result(res, [[0]], [1])
    # q(x) = 0 for a drafted x (degenerate): treated as a one-hot draft, accepted iff u < r(x)
    q2 = q.clone()
    q2[0, 0] = torch.tensor([0.7, 0.0, 0.3, 0, 0, 0, 0, 0])
    t2 = tree([[0, 1, 2]], [-1, 0, 0], draft_probs=q2)
    assert_result(accept_rejection(t2, p, torch.tensor([[0, 0.29, 0]]), torch.zeros(1, 3)), [[0, 1]], [7])
    # rejected at u = 0.31: r -> [5/7, 0, 2/7] (token 1 zeroed); q keeps [0.7, 0, 0.3]; token 2: u * 0.3 < 2/7
    assert_result(accept_rejection(t2, p, torch.tensor([[0, 0.31, 0.95]]), torch.zeros(1, 3)), [[0, 2]], [7])
    res = accept_rejection(t2, p, torch.tensor([[0, 0.31, 0.96]]), torch.tensor([[0.999, 0, 0]]))
    assert_result(res, [[0]], [0])  # residual max([5/7, 0, 2/7] - [.7, 0, .3], 0) = [1/70, 0, 0] -> token 0


def test_rejection_degenerate_all_zero_residual_keeps_target() -> None:
    # u = 1.0 (outside [0, 1), only to force it): p == q rejects with max(p - q, 0) == 0 -> residual stays p
    p = torch.zeros(1, 2, V)
    p[0, 0, :2] = 0.5
    p[0, 1, 3] = 1.0
    c = chain(torch.tensor([[0, 1]]), draft_probs=p.clone())
    res = accept_rejection(c, p, torch.tensor([[0.0, 1.0]]), torch.tensor([[0.75, 0.0]]))
    assert_result(res, [[0]], [1])
    assert not torch.isnan(res.bonus.float()).any()


def test_rejection_with_greedy_target_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(3)
    B, n, v = 128, 7, 3
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3]).expand(B, n).clone()
    t = DraftTree(torch.randint(0, v, (B, n), generator=gen), parents, torch.ones(B, n, dtype=torch.bool))
    logits = torch.randn(B, n, v, generator=gen)
    p = target_probs(logits, SamplingParams(temperature=0.0))
    greedy = accept_greedy(t, logits)
    for draft_probs in (None, torch.rand(B, n, v, generator=gen).softmax(-1)):
        t.draft_probs = draft_probs
        res = accept_rejection(t, p, torch.rand(B, n, generator=gen), torch.rand(B, n, generator=gen))
        assert torch.equal(res.path, greedy.path) and torch.equal(res.bonus, greedy.bonus)
        assert torch.equal(res.length, greedy.length)


# --- typical acceptance -----------------------------------------------------------------------------


def test_typical_thresholds() -> None:
    # node 0: peaked p = [0.95, 0.02, 0.03] -> H small, threshold = min(0.09, 0.3 e^-H) = 0.09
    # node 1: uniform over 8 -> H = ln 8, threshold = min(0.09, 0.3 / 8 = 0.0375) = 0.0375
    p0 = torch.tensor([0.95, 0.02, 0.03, 0, 0, 0, 0, 0])
    logits = torch.stack([p0.log(), torch.zeros(V), torch.zeros(V)])[None]  # [1, 3, V]
    h = -(p0[:3] * p0[:3].log()).sum()
    assert 0.3 * math.exp(-h) > 0.09
    params = SamplingParams(temperature=1.0)
    su = torch.zeros(1, 3)
    t = tree([[0, 2, 1]], [-1, 0, 0])  # 0.03 and 0.02 < 0.09: both rejected
    assert_result(accept_typical(t, logits, params, su), [[0]], [0])
    t = tree([[0, 2, 0, 5]], [-1, 0, 0, 2])  # second sibling passes (0.95), then uniform node: 1/8 > 0.0375
    logits4 = torch.stack([p0.log(), p0.log(), torch.zeros(V), torch.zeros(V)])[None]
    assert_result(accept_typical(t, logits4, params, torch.tensor([[0, 0, 0, 0.99]])), [[0, 2, 3]], [7])
    # epsilon binds when the distribution is peaked: with epsilon = 0.025 token 2 (0.03) passes
    t = tree([[0, 2, 1]], [-1, 0, 0])
    assert_result(accept_typical(t, logits, params, su, epsilon=0.025), [[0, 1]], [0])
    # delta binds when flat: threshold at the uniform node = delta / 8 -> delta = 1.1 rejects 1/8, 0.9 accepts
    t = tree([[0, 0, 3]], [-1, 0, 1])
    lg = torch.stack([p0.log(), torch.zeros(V), torch.zeros(V)])[None]
    assert_result(accept_typical(t, lg, params, su, epsilon=1.0, delta=1.1), [[0, 1]], [0])
    assert_result(accept_typical(t, lg, params, su, epsilon=1.0, delta=0.9), [[0, 1, 2]], [0])


def test_typical_first_passing_sibling_and_bonus_sampling() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 3, V, generator=gen)
    params = SamplingParams(temperature=0.8, top_k=5)
    probs = target_probs(logits, params)
    order = probs[0, 0].argsort(descending=True)
    assert probs[0, 0, order[1]] > 0.09  # both candidates pass; the first in sibling order wins
    t = tree([[0, int(order[1]), int(order[0])]], [-1, 0, 0])
    res = accept_typical(t, logits, params, torch.full((1, 3), 0.4))
    assert_result(res, [[0, 1]], [int(sample_from_probs(probs[0, 1], torch.tensor(0.4)))])
    assert probs[0, 1, res.bonus].item() > 0


def test_typical_at_temperature_zero_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(5)
    B, n, v = 128, 7, 3
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3]).expand(B, n).clone()
    t = DraftTree(torch.randint(0, v, (B, n), generator=gen), parents, torch.ones(B, n, dtype=torch.bool))
    logits = torch.randn(B, n, v, generator=gen)
    res = accept_typical(t, logits, SamplingParams(temperature=0.0), torch.rand(B, n, generator=gen))
    greedy = accept_greedy(t, logits)
    assert torch.equal(res.path, greedy.path) and torch.equal(res.bonus, greedy.bonus)


def test_emitted_tokens() -> None:
    t = tree([[9, 5, 7, 3], [9, 5, 7, 3]], [-1, 0, 0, 2])
    res = AcceptResult(torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1]]), torch.tensor([3, 1]), torch.tensor([4, 6]))
    assert emitted_tokens(t, res) == [[7, 3, 4], [6]]


def test_top_k_siblings_cannot_be_verified_against_the_q_they_were_ranked_by() -> None:
    """Siblings ranked by top-k are deterministic drafts: verifying them against q biases the output (a
    measured reproduction: chi-squared p = 0). A tree that gives q with a node of several children must declare that they were
    sampled; a chain with q, or top-k siblings without q, needs nothing."""
    q = torch.softmax(torch.randn(1, 4, 7), -1)
    tokens, parents = torch.tensor([[0, 3, 5, 2]]), torch.tensor([[-1, 0, 0, 0]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="top-k siblings must be verified one-hot"):
        DraftTree(tokens, parents, valid, q)
    DraftTree(tokens, parents, valid, None)  # one-hot verification of the same siblings
    DraftTree(tokens, parents, valid, q, siblings_sampled=True)  # drawn from q without replacement
    DraftTree(tokens, torch.tensor([[-1, 0, 1, 2]]), valid, q)  # a sampled chain
    one_left = valid.clone()
    one_left[0, 2:] = False  # padding siblings do not count
    DraftTree(tokens, parents, one_left, q)
