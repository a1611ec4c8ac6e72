"""Expected tokens of a chain and per-depth acceptance from pooled tallies (models/acceptance.py), the one formula and
the one aggregation that training's simulated τ, the precision policy, the cost curve and the reports share."""

import pytest

from infer.stats import GenerationStats, depth_tallies
from models.acceptance import acceptance_rates, expected_tokens


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
