"""The hybrid proposer (infer/hybrid.py): prompt lookup and a learned tree in one verify, lossless."""

import pytest
import torch

from infer.generate import generate_speculative, generate_vanilla
from infer.hybrid import HybridProposer, _union
from infer.pricing import ChainAcceptance, VerifyPrice
from infer.proposer import Proposer
from infer.proposers import DraftModelProposer
from infer.sampling import SamplingParams
from infer.tree import DraftTree
from infer.tree_search import DynamicTreeConfig
from tests.test_generate import GREEDY, PROMPTS
from tests.test_pricing import STEPS


def test_union_shares_the_prefix_the_learned_tree_already_has_and_keeps_the_budget():
    # learned: root 7 → 1 → 2, root → 3, 1 → 4
    tokens, parents = [7, 1, 3, 2, 4], [-1, 0, 0, 1, 1]
    t, p = _union(tokens, parents, [1, 2, 5, 6], budget=10, lookup_first=True)
    assert (t, p) == ([7, 1, 3, 2, 4, 5, 6], [-1, 0, 0, 1, 1, 3, 5])  # 1 → 2 shared, 5 → 6 hang from 2
    # a strong match keeps the chain first: 5 nodes = root + the chain's 4, the learned 3 and 4 are cut
    t, p = _union(tokens, parents, [1, 2, 5, 6], budget=5, lookup_first=True)
    assert (t, p) == ([7, 1, 2, 5, 6], [-1, 0, 1, 2, 3])
    # a weak one keeps the learned tree first: the chain's new nodes are cut
    t, p = _union(tokens, parents, [1, 2, 5, 6], budget=5, lookup_first=False)
    assert (t, p) == (tokens, parents)
    t, p = _union(tokens, parents, [], budget=3, lookup_first=False)
    assert (t, p) == ([7, 1, 3], [-1, 0, 0])


class Fixed(Proposer):
    """A learned stand-in that always drafts the same two children of the root (tokens 90, 91)."""

    def propose(self, contexts, params, generator):
        B = len(contexts)
        tokens = torch.tensor([[ctx[-1], 90, 91] for ctx in contexts])
        return DraftTree(tokens, torch.tensor([[-1, 0, 0]] * B), torch.ones(B, 3, dtype=torch.bool))


def test_the_step_merges_lookup_by_match_strength():
    hybrid = HybridProposer(Fixed(), num_draft=4, strong_match=2, weak_tokens=1, budget=16)
    strong = [5, 6, 7, 8, 9, 5, 6]  # "5 6" matched (n = 2): continue 7 8 9 5
    weak = [1, 2, 3, 1]  # only "1" matches (n = 1): continue with its first token, 2
    none = [1, 2, 3]
    hybrid.begin([strong, weak, none])
    tree = hybrid.propose([strong, weak, none], SamplingParams(), torch.Generator())
    rows = [[(int(t), int(p)) for t, p, v in zip(*r) if v] for r in zip(tree.tokens, tree.parents, tree.valid)]
    assert rows[0] == [(6, -1), (90, 0), (91, 0), (7, 0), (8, 3), (9, 4), (5, 5)]
    assert rows[1] == [(1, -1), (90, 0), (91, 0), (2, 0)]
    assert rows[2] == [(3, -1), (90, 0), (91, 0)]
    assert hybrid.steps == {"strong": 1, "datastore": 0, "weak": 1, "none": 1, "lookup alone": 0}


@pytest.mark.parametrize("batch", [1, 4])
def test_hybrid_greedy_is_token_identical_with_a_learned_tree(tiny_target, tiny_draft, batch):
    prompts = PROMPTS[:batch]
    expected = [generate_vanilla(tiny_target, [p], GREEDY).tokens[0] for p in prompts]
    learned = DraftModelProposer(tiny_draft, tree=DynamicTreeConfig(top_k=2, depth=3, total_tokens=6))
    hybrid = HybridProposer(learned, num_draft=5, budget=10)
    res = generate_speculative(tiny_target, hybrid, prompts, GREEDY)
    assert res.tokens == expected
    assert hybrid.steps["strong"] > 0  # the repetitive prompts matched, so lookup nodes were verified


def test_hybrid_with_a_sampled_chain_verifies_one_source_per_row(tiny_target, tiny_draft):
    """At T > 0 a draft-model chain carries its q: rows with a strong match verify the lookup chain one-hot, the
    others the sampled chain; the answers are reproducible and in the vocabulary."""
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)
    vocab = tiny_target.model.config.vocab_size
    outs = []
    for _ in range(2):
        hybrid = HybridProposer(DraftModelProposer(tiny_draft, k=3), num_draft=4)
        outs.append(generate_speculative(tiny_target, hybrid, PROMPTS, params).tokens)
    assert outs[0] == outs[1] and all(0 <= t < vocab for row in outs[0] for t in row)
    assert hybrid.steps["strong"] > 0
    # the exactness of the rejection rule on such trees (a q per node, one-hot where deterministic) is
    # tests/test_accept_montecarlo.py's; here: the tree the rule gets is well formed for both kinds of row
    hybrid = HybridProposer(DraftModelProposer(tiny_draft, k=3), num_draft=4)
    hybrid.begin([PROMPTS[0], PROMPTS[3]])
    tree = hybrid.propose([PROMPTS[0], PROMPTS[3]], params, torch.Generator().manual_seed(0))
    lookup_row = tree.tokens[0, 1:5].tolist()
    assert lookup_row == [7, 8, 5, 6]  # "5 6" matched: its continuation, one-hot
    assert all(float(tree.draft_probs[0, i, t]) == 1.0 for i, t in enumerate(lookup_row))
    assert torch.allclose(tree.draft_probs[1, :3].sum(-1), torch.ones(3))  # the sampled chain keeps its q


class Counting(DraftModelProposer):
    """A draft-model proposer that counts its proposes (to see which steps skipped it)."""

    calls = 0

    def propose(self, contexts, params, generator):
        Counting.calls += 1
        return super().propose(contexts, params, generator)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_long_match_verifies_lookup_alone_and_the_drafter_catches_up_after(tiny_target, tiny_draft, temperature):
    """Steps where every row's match reaches ``alone_match`` skip the learned drafter; it feeds what it missed at its
    next step, so greedy output stays the target's and sampling stays reproducible."""
    params = SamplingParams(temperature=temperature, max_new_tokens=24, seed=5)
    steps = {"lookup alone": 0, "other": 0}
    for p in PROMPTS:  # one row a call: at a batch every row must match for a step to skip the drafter
        hybrid = HybridProposer(Counting(tiny_draft, k=3), num_draft=4, alone_match=2)
        Counting.calls = 0
        res = generate_speculative(tiny_target, hybrid, [p], params)
        assert Counting.calls == res.stats.rounds - hybrid.steps["lookup alone"]  # the drafter ran on the others
        steps["lookup alone"] += hybrid.steps["lookup alone"]
        steps["other"] += Counting.calls
        if temperature == 0.0:
            assert res.tokens == generate_vanilla(tiny_target, [p], GREEDY).tokens
        else:
            again = HybridProposer(Counting(tiny_draft, k=3), num_draft=4, alone_match=2)
            assert generate_speculative(tiny_target, again, [p], params).tokens == res.tokens
    assert steps["lookup alone"] > 0 and steps["other"] > 0  # both kinds of step, so the drafter caught up
    alone = HybridProposer(Fixed(), num_draft=4, alone_match=2)
    alone.begin([[5, 6, 7, 8, 9, 5, 6]])
    tree = alone.propose([[5, 6, 7, 8, 9, 5, 6]], SamplingParams(), torch.Generator())
    assert tree.tokens[0].tolist() == [6, 7, 8, 9, 5] and tree.parents[0].tolist() == [-1, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="max_ngram"):
        HybridProposer(Fixed(), alone_match=4, max_ngram=3)


def test_priced_union_keeps_the_nodes_that_pay_on_the_verify_curve():
    # learned: root 7 → 1 (0.9) → 2 (0.8), root → 3 (0.7): four nodes, the curve's first step
    tokens, parents, values = [7, 1, 3, 2], [-1, 0, 0, 1], [1.0, 0.9, 0.7, 0.8]
    # a weak chain whose two new nodes would push the round onto the 8-node step: dropped
    priced = (STEPS, values, [0.1, 0.05])
    assert _union(tokens, parents, [4, 8], 64, lookup_first=False, priced=priced) == (tokens, parents)
    # a likely chain sharing the learned 1 → 2 prefix: the shared nodes take its larger values and its own nodes
    # fill the 8-node step; the least likely learned node (3) comes last but still fits
    priced = (STEPS, values, [0.95, 0.9, 0.85, 0.8, 0.75])
    t, p = _union(tokens, parents, [1, 2, 5, 6, 9], 64, lookup_first=True, priced=priced)
    assert (t, p) == ([7, 1, 3, 2, 5, 6, 9], [-1, 0, 0, 1, 3, 4, 5])
    # the same on a curve where the step to 8 costs too much: the chain's first three nodes and the root
    steep = VerifyPrice({1: 32.0, 4: 35.0, 8: 80.0}, draft_ms=5.0, overhead_ms=1.0)
    t, p = _union(tokens, parents, [1, 2, 5, 6, 9], 64, lookup_first=True, priced=(steep, values, priced[2]))
    assert (t, p) == ([7, 1, 2, 5], [-1, 0, 1, 2])


class Valued(Fixed):
    """`Fixed` with node values, as EAGLE-2 trees carry them."""

    def propose(self, contexts, params, generator):
        tree = super().propose(contexts, params, generator)
        tree.values = torch.tensor([[1.0, 0.6, 0.3]] * len(contexts))
        return tree


def test_a_priced_step_tallies_the_chain_it_verified_and_prices_lookup_alone_steps():
    tally = ChainAcceptance()
    hybrid = HybridProposer(Valued(), num_draft=6, alone_match=3, price=STEPS, chain_acceptance=tally)
    ctx = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]  # "5 6 7" matched: continue 8 9 10 11 12 5
    hybrid.begin([ctx])
    tree = hybrid.propose([ctx], SamplingParams(), torch.Generator())
    # at the prior (0.5, 0.25, ...) only the first three chain tokens pay, on the 4-node step, lookup alone
    assert tree.tokens[0].tolist() == [7, 8, 9, 10] and hybrid.steps["lookup alone"] == 1
    ctx = ctx + [8, 9, 10, 11]  # the round accepted all three and the bonus token was the chain's fourth
    tree = hybrid.propose([ctx], SamplingParams(), torch.Generator())
    assert tally.accepted == {(3, 1): 1, (3, 2): 1, (3, 3): 1, (3, 4): 1} and tally.tried == tally.accepted
    assert tree.num_nodes > 4  # more trust in 3-gram matches: the chain now fills the 8-node step
    unvalued = HybridProposer(Fixed(), price=STEPS)
    unvalued.begin([[1, 2, 3]])
    with pytest.raises(ValueError, match="node values"):
        unvalued.propose([[1, 2, 3]], SamplingParams(), torch.Generator())


@pytest.mark.parametrize("batch", [1, 4])
def test_a_priced_hybrid_is_token_identical(tiny_target, tiny_draft, batch):
    prompts = PROMPTS[:batch]
    expected = [generate_vanilla(tiny_target, [p], GREEDY).tokens[0] for p in prompts]
    tally = ChainAcceptance()
    for _ in range(2):  # the second call starts from what the first tallied
        learned = DraftModelProposer(tiny_draft, tree=DynamicTreeConfig(top_k=2, depth=3, total_tokens=6))
        hybrid = HybridProposer(learned, num_draft=8, budget=64, price=STEPS, chain_acceptance=tally)
        assert generate_speculative(tiny_target, hybrid, prompts, GREEDY).tokens == expected
    assert sum(tally.tried.values()) > 0


def test_a_priced_hybrid_samples_reproducibly_from_a_fresh_tally(tiny_target, tiny_draft):
    """At T > 0 the priced tree is still deterministic (one-hot q), so rejection sampling stays exact; two runs from
    fresh tallies and one seed draw the same tokens (a tally carried over would change the trees, and with them
    which uniforms each step reads)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7)
    outs = []
    for _ in range(2):
        learned = DraftModelProposer(tiny_draft, tree=DynamicTreeConfig(top_k=2, depth=3, total_tokens=6))
        hybrid = HybridProposer(learned, num_draft=8, budget=64, price=STEPS, chain_acceptance=ChainAcceptance())
        outs.append(generate_speculative(tiny_target, hybrid, PROMPTS, params).tokens)
    vocab = tiny_target.model.config.vocab_size
    assert outs[0] == outs[1] and all(0 <= t < vocab for row in outs[0] for t in row)
    assert sum(hybrid.tally.tried.values()) > 0


def test_the_round_account_splits_accepted_drafts_by_match_kind():
    """Each round is judged at the row's next step against what it emitted: drafts accepted (the bonus not counted)
    and the common prefix of prompt lookup's chain with the emitted tokens, by the round's kind of match."""
    hybrid = HybridProposer(Fixed(), num_draft=4, strong_match=2, weak_tokens=1, budget=16)
    gen, params = torch.Generator(), SamplingParams()
    strong, none = [5, 6, 7, 8, 9, 5, 6], [1, 2, 3]  # "5 6" matched: lookup's chain 7 8 9 5; nothing matched
    with pytest.raises(RuntimeError, match="call begin first"):
        hybrid.propose([strong, none], params, gen)
    hybrid.begin([strong, none])
    hybrid.propose([strong, none], params, gen)
    assert hybrid.account.rounds == {}  # nothing emitted yet
    # the strong row emitted 7 8 then 4 (two drafts accepted, lookup's chain held both); the other row emitted 90, 3
    hybrid.propose([strong + [7, 8, 4], none + [90, 3]], params, gen)
    assert hybrid.account.rounds == {"strong": 1, "none": 1}
    assert hybrid.account.accepted == {"strong": 2, "none": 1} and hybrid.account.lookup == {"strong": 2, "none": 0}
    # a step where every row's match is long skips the learned drafter: counted as such at the next step
    alone = HybridProposer(Fixed(), num_draft=4, alone_match=2)
    alone.begin([strong])
    alone.propose([strong], params, gen)
    alone.propose([strong + [7, 1]], params, gen)
    assert alone.account.rounds == {"lookup alone": 1} and alone.account.lookup == {"lookup alone": 1}
    assert alone.account.accepted == {"lookup alone": 1}
