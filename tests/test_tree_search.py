"""Tree builders and tree structure, with a stand-in drafter whose scores are known."""

import math

import pytest
import torch

from infer.proposers import PromptLookupProposer
from infer.sampling import SamplingParams
from infer.tree import chain, paths_to_parents
from infer.tree_search import DynamicTreeConfig, build_dynamic_tree, build_static_tree

V = 12


def fixed_logprobs(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g) * 2).log_softmax(-1)


def table_expand(calls):
    """Stand-in drafter: next-token log-probs depend only on the frontier token."""

    def expand(tokens, depth, ancestors):
        calls.append((tokens.clone(), depth, ancestors.clone()))
        return torch.stack([torch.stack([fixed_logprobs(int(t)) for t in row]) for row in tokens])

    return expand


def brute_force_candidates(root_lp, k, depth):
    """EAGLE-2 expansion spelled out on paths: {token path: cumulative log-prob} of every candidate."""
    cands = {}
    frontier = []
    for t in root_lp.topk(k).indices.tolist():
        cands[(t,)] = float(root_lp[t])
        frontier.append((t,))
    for _ in range(depth - 1):
        children = {}
        for path in frontier:
            lp = fixed_logprobs(path[-1])
            for t in lp.topk(k).indices.tolist():
                children[path + (t,)] = cands[path] + float(lp[t])
        cands.update(children)
        frontier = sorted(children, key=children.get, reverse=True)[:k]
    return cands


def node_paths(tree):
    out = []
    for j in range(1, tree.num_nodes):
        path, node = [], j
        while node > 0:
            path.append(int(tree.tokens[0, node]))
            node = int(tree.parents[0, node])
        out.append(tuple(reversed(path)))
    return out


def test_dynamic_tree_keeps_best_candidates_and_their_ancestors():
    root_lp = fixed_logprobs(100)
    cfg = DynamicTreeConfig(top_k=3, depth=4, total_tokens=10)
    calls = []
    tree = build_dynamic_tree(torch.tensor([7]), root_lp[None], table_expand(calls), cfg)
    assert tree.tokens.shape == (1, 10) and int(tree.tokens[0, 0]) == 7
    assert len(calls) == cfg.depth - 1  # one drafter call per depth after the first
    parents = tree.parents[0]
    assert all(int(parents[j]) < j for j in range(1, 10))
    cands = brute_force_candidates(root_lp, 3, 4)
    best = sorted(cands, key=cands.get, reverse=True)[:9]
    assert sorted(node_paths(tree)) == sorted(best)
    kept = set(node_paths(tree))
    assert all(p[:i] in kept for p in kept for i in range(1, len(p)))  # ancestors survive
    # each node's value is the drafter's probability of its whole path (what infer/pricing ranks nodes by)
    expected = [1.0] + [math.exp(cands[path]) for path in node_paths(tree)]
    assert tree.values[0].tolist() == pytest.approx(expected, rel=1e-5)
    # frontier ancestors: none at the first call, exactly depth - 1 afterwards
    for _tokens, depth, anc in calls:
        assert anc.shape == (1, 3, 3 * (depth - 1))
        assert (anc.sum(-1) == depth - 1).all()


def test_dynamic_tree_top1_is_greedy_chain():
    root_lp = fixed_logprobs(5)
    cfg = DynamicTreeConfig(top_k=1, depth=4, total_tokens=5)
    tree = build_dynamic_tree(torch.tensor([1]), root_lp[None], table_expand([]), cfg)
    toks = [int(root_lp.argmax())]
    for _ in range(3):
        toks.append(int(fixed_logprobs(toks[-1]).argmax()))
    assert tree.tokens[0, 1:].tolist() == toks
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3]


def test_static_tree_follows_rank_paths():
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    parents, ordered = paths_to_parents(paths)
    assert parents == [-1, 0, 0, 1, 1, 2, 3]
    root_lp = fixed_logprobs(9)
    tree = build_static_tree(torch.tensor([2, 3]), torch.stack([root_lp, root_lp]), table_expand([]), paths)
    ranked = root_lp.topk(2).indices
    assert tree.tokens[0, 1:3].tolist() == ranked.tolist()
    second = fixed_logprobs(int(ranked[0])).topk(2).indices
    assert tree.tokens[0, 3:5].tolist() == second.tolist()
    assert tree.tokens[0, 6] == fixed_logprobs(int(second[0])).argmax()


def test_ancestor_mask_of_chain_is_lower_triangular():
    tree = chain(torch.arange(5)[None])
    assert torch.equal(tree.ancestor_mask()[0], torch.ones(5, 5, dtype=torch.bool).tril())
    assert tree.depths()[0].tolist() == [0, 1, 2, 3, 4]


def test_prompt_lookup_candidates_and_trie():
    prop = PromptLookupProposer(num_draft=3, max_ngram=2, num_candidates=2)
    ctx = [1, 2, 3, 4, 9, 1, 2, 5, 6, 7, 1, 2]
    # the bigram (1, 2) occurred twice before: most recent continuation first
    assert prop.candidates(ctx) == [[5, 6, 7], [3, 4, 9]]
    tree = prop.propose([ctx, [8]], SamplingParams(), torch.Generator())
    assert tree.tokens[0].tolist() == [2, 5, 6, 7, 3, 4, 9]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 0, 4, 5]
    assert tree.valid[1].tolist() == [True] + [False] * 6  # no match: the root alone
