"""Expected tokens of a chain, per-depth acceptance from pooled tallies and greedy chains replayed on teacher-forced
hits (models/acceptance.py): the one formula, the one aggregation and the one replay that training's simulated and
walked τ, the precision policy, the cost curve and the reports share."""

import pytest

from infer.stats import GenerationStats, depth_tallies
from models.acceptance import Walk, acceptance_rates, expected_tokens, walked_chain


def test_expected_tokens_of_a_chain():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([1.0, 1.0, 1.0]) == 4.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.5, 0.5, 0.5], 2) == 1 + 0.5 + 0.25  # the first k depths only
    assert expected_tokens((0.8, 0.5), 5) == pytest.approx(1 + 0.8 + 0.4)


def test_acceptance_is_pooled_over_calls_before_dividing():
    """One call reached depth 2 once and accepted; another reached it three times and never accepted: α_2 is 1 / 4,
    not the mean of per-call rates (0.5)."""
    a, b = GenerationStats(), GenerationStats()
    a.record_acceptance(2, 2)  # depth 1 and 2 attempted and accepted
    for _ in range(3):
        b.record_acceptance(1, 2)  # depth 1 accepted, depth 2 attempted and rejected
    b.record_acceptance(0, 2)  # depth 1 rejected
    accepted, attempted = depth_tallies([a, b])
    assert (accepted, attempted) == ([4, 1], [5, 4])
    assert acceptance_rates(accepted, attempted) == [0.8, 0.25]
    assert depth_tallies([a, b], 3) == ([4, 1, 0], [5, 4, 0]) and acceptance_rates([0], [0]) == [0.0]
    assert b.alpha == [0.75, 0.0] and depth_tallies([]) == ([], [])


def test_a_walked_chain_accepts_each_rounds_run_of_hits_and_moves_past_its_bonus_token():
    # an answer at positions [3, 13); hits[i][r]: the depth-(i+1) draft of the round whose newest token is r is right
    T = 14
    hits = [[False] * T for _ in range(3)]
    for i, r in [(0, 2), (1, 2), (2, 2), (0, 6), (1, 6), (0, 8), (2, 8)]:
        hits[i][r] = True
    # rounds at r = 2 (3 drafts + bonus: 4 tokens), 6 (2 + 1), 9 (0 + 1: the hits at 8 are never asked), 10, 11:
    # the answer's 10 tokens in 5 rounds, 2 of them with an accepted first draft
    assert walked_chain(hits, 3, 13, 3) == Walk(10, 5, 2)
    # a chain of 2 stops at two drafts in the first round, and the rounds after it start elsewhere: 2, 5, 6, 9, 10, 11
    assert walked_chain(hits, 3, 13, 2) == Walk(10, 6, 2)
    # an answer that ends inside a round: the round's tokens stop at the answer's end
    assert walked_chain(hits, 3, 5, 3) == Walk(2, 1, 1)
    # nothing right: one token a round
    assert walked_chain([[False] * T], 1, T, 1) == Walk(T - 1, T - 1, 0)
    with pytest.raises(ValueError, match=r"need 0 < start <= end and 1 <= k <= 3 depths, got \[0, 5\), k=3"):
        walked_chain(hits, 0, 5, 3)
    with pytest.raises(ValueError, match="k=4"):
        walked_chain(hits, 3, 5, 4)
