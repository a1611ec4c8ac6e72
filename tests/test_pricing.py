"""Pricing a round's node count on a stepped verify curve (infer/pricing.py)."""

import pytest

from infer.pricing import ChainAcceptance, VerifyPrice

# the shape measured on SmolLM2 in bf16: flat up to the routed matmuls' padded row counts 4, 8 and 16
STEPS = VerifyPrice({1: 32.0, 4: 35.0, 8: 39.0, 16: 48.0}, draft_ms=5.0, overhead_ms=1.0)


def test_cost_is_the_smallest_measured_count_that_holds_the_nodes():
    assert STEPS.cost(1, drafted=False) == 33.0
    assert STEPS.cost(3, drafted=False) == STEPS.cost(4, drafted=False) == 36.0
    assert STEPS.cost(5, drafted=True) == 45.0
    # a larger count timed cheaper caps the smaller one (best-of timings err upwards)
    assert VerifyPrice({4: 40.0, 8: 38.0}).cost(3, drafted=False) == 38.0
    with pytest.raises(ValueError, match="measured up to 16"):
        STEPS.cost(17, drafted=False)
    with pytest.raises(ValueError):
        VerifyPrice({})


def test_best_count_keeps_what_pays_on_the_curve():
    # three likely nodes fill the 4-node step
    assert STEPS.best_count([0.9, 0.8, 0.7], drafted=True) == 4
    # nodes that are rarely right do not pay for the step from 1 to 4 nodes
    assert STEPS.best_count([0.05, 0.01, 0.01], drafted=False) == 1
    # a weak fourth node would push the round onto the 8-node step: cut
    assert STEPS.best_count([0.9, 0.8, 0.7, 0.1], drafted=True) == 4
    # likely nodes past the step pay for it and fill it
    assert STEPS.best_count([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], drafted=True) == 8
    # the drafter's sunk time makes a larger step cheaper relative to the round: same nodes, larger count
    values = [0.9, 0.8, 0.7, 0.1, 0.1, 0.05, 0.05]
    assert STEPS.best_count(values, drafted=False) == 4
    assert VerifyPrice(STEPS.verify_ms, draft_ms=20.0, overhead_ms=1.0).best_count(values, drafted=True) == 8
    # never more nodes than the curve was measured for
    assert STEPS.best_count([1.0] * 40, drafted=True) == 16


def test_chain_acceptance_tallies_emitted_tokens_and_borrows_the_rate_before_it():
    tally = ChainAcceptance()
    assert tally.values(3, 2) == [0.5, 0.25]  # the prior: 0.5 a position
    tally.record(3, [10, 11, 12], emitted=[10, 11, 99, 4])  # two right, the third judged wrong by the bonus token
    assert (tally.tried, tally.accepted) == ({(3, 1): 1, (3, 2): 1, (3, 3): 1}, {(3, 1): 1, (3, 2): 1})
    tally.record(3, [10, 11, 12], emitted=[10])  # the row stopped after one token: nothing past it is judged
    assert tally.tried[(3, 2)] == 1 and tally.accepted[(3, 1)] == 2
    rates = tally.rates(3, 4)
    assert rates[0] == pytest.approx((2 + 2 * 0.5) / (2 + 2))
    assert rates[1] == pytest.approx((1 + 2 * rates[0]) / (1 + 2))
    assert rates[2] == pytest.approx((0 + 2 * rates[1]) / (1 + 2))
    assert rates[3] == pytest.approx(rates[2])  # never tried: the rate before it, not the 0.5 prior
    assert tally.values(3, 4) == pytest.approx(
        [rates[0], rates[0] * rates[1], rates[0] * rates[1] * rates[2], rates[0] * rates[1] * rates[2] * rates[3]]
    )
    assert tally.values(2, 1) == [0.5]  # other n-gram sizes keep their own cells
