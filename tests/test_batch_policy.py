"""Batch-aware speculation (infer/batch_policy.py, eval.batch_sizing.batch_length / size_batch_policy): the chain length
per batch size, off where the cost curve says it cannot pay, applied per generate call without changing outputs."""

import pytest
import torch

from eval.batch_sizing import AUTO_MARGIN, batch_length, size_batch_policy
from infer.batch_policy import BatchAwareProposer, BatchPolicy
from infer.generate import generate_speculative, generate_vanilla
from infer.proposers import DraftModelProposer, PromptLookupProposer
from infer.sampling import SamplingParams
from tests.test_generate import GREEDY, PROMPTS


def test_the_policy_never_lengthens_the_chain_as_the_batch_grows():
    policy = BatchPolicy({1: 4, 4: 2, 16: 3, 64: 0})  # a noisy measurement at 16 must not switch it back up
    assert policy.lengths == {1: 4, 4: 2, 16: 2, 64: 0}
    # between measured sizes: the next size up (the conservative one); past the largest: the largest's
    assert [policy.length_for(b) for b in (1, 2, 4, 5, 16, 17, 64, 200)] == [4, 2, 2, 2, 2, 0, 0, 0]
    assert policy.words() == "bs1:chain 4, bs4:chain 2, bs16:chain 2, bs64:off"
    with pytest.raises(ValueError):
        BatchPolicy({})
    with pytest.raises(ValueError):
        BatchPolicy({0: 1})


def test_a_flat_verify_curve_speculates_and_a_linear_one_switches_off():
    alpha = [0.6, 0.5, 0.4, 0.3]
    # weight-bound (batch 1 on a CPU): 5 tokens cost what 1 does; with a cheap draft step the longest chain wins
    flat = {n: 0.030 for n in range(1, 6)}
    k, pred = batch_length(alpha, 0.0005, flat, 0.001, vanilla_step_s=0.030)
    assert k == 4 and pred[4] == pytest.approx((1 + 0.6 + 0.3 + 0.12 + 0.036) * 0.030 / (4 * 0.0005 + 0.030 + 0.001))
    # a dearer draft step (2 ms) makes the fourth draft, accepted 3.6 % of rounds, cost more than it brings
    assert batch_length(alpha, 0.002, flat, 0.001, vanilla_step_s=0.030)[0] == 3
    # compute-bound (a large batch): every token costs the same share, so no chain beats vanilla
    linear = {n: 0.30 * n for n in range(1, 6)}
    k, pred = batch_length(alpha, 0.01, linear, 0.005, vanilla_step_s=0.30)
    assert k == 0 and max(pred.values()) < 1
    # a chain that would win by less than the margin stays off too
    barely = {n: 0.030 * (1 + 0.6 / (1 + AUTO_MARGIN / 2)) if n > 1 else 0.030 for n in range(1, 3)}
    assert batch_length([0.6], 0.0, barely, 0.0, vanilla_step_s=0.030)[0] == 0


def test_a_length_capped_by_a_smaller_batch_must_clear_the_margin_itself():
    """Lengths never grow with the batch, so a larger batch chooses among the lengths up to the smaller one's, and
    that choice must promise the margin on its own: a longer chain's promise does not switch a shorter one on."""
    alpha = [0.6, 0.5, 0.4]
    # one draft barely pays (its extra verify token costs half a step), three pay well (the curve is flat after)
    curve = {1: 0.030, 2: 0.045, 3: 0.045, 4: 0.045}
    k, pred = batch_length(alpha, 0.0, curve, 0.0, vanilla_step_s=0.030)
    assert k == 3 and pred[3] >= 1 + AUTO_MARGIN > pred[1]
    assert batch_length(alpha, 0.0, curve, 0.0, vanilla_step_s=0.030, longest=1)[0] == 0
    assert batch_length(alpha, 0.0, curve, 0.0, vanilla_step_s=0.030, longest=0)[0] == 0
    assert batch_length(alpha, 0.0, curve, 0.0, vanilla_step_s=0.030, longest=4)[0] == 3


@pytest.mark.parametrize("lengths", [{1: 3, 4: 0}, {1: 3, 4: 2}])
def test_the_batch_aware_proposer_is_vanilla_where_the_policy_is_off(tiny_target, lengths):
    policy = BatchPolicy(lengths)
    expected = generate_vanilla(tiny_target, PROMPTS[:4], GREEDY)
    res = generate_speculative(tiny_target, BatchAwareProposer(lambda k: PromptLookupProposer(num_draft=k), policy),
                               PROMPTS[:4], GREEDY)  # fmt: skip
    assert res.tokens == expected.tokens
    if lengths[4] == 0:  # the plain vanilla loop ran: one token per forward, no draft time
        assert res.stats.tau == 1.0 and res.stats.draft_s == 0.0 and res.stats.rounds == expected.stats.rounds
    single = generate_speculative(
        tiny_target, BatchAwareProposer(lambda k: PromptLookupProposer(num_draft=k), policy), PROMPTS[:1], GREEDY
    )
    assert single.tokens == generate_vanilla(tiny_target, PROMPTS[:1], GREEDY).tokens


def test_sampled_calls_under_the_policy_keep_vanilla_s_seeded_draws_when_off(tiny_target):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    off = BatchAwareProposer(lambda k: PromptLookupProposer(num_draft=k), BatchPolicy({1: 0}))
    assert generate_speculative(tiny_target, off, PROMPTS[:2], params).tokens == (
        generate_vanilla(tiny_target, PROMPTS[:2], params).tokens
    )


def test_size_batch_policy_measures_every_batch_size_and_records_its_costs(tiny_target, tiny_draft):
    from infer.serving import dtype_copy

    logs = []
    sizing = size_batch_policy(
        tiny_target,
        lambda k: DraftModelProposer(tiny_draft, k=k),
        PROMPTS[:2],
        alpha=[0.5, 0.4, 0.3],
        max_k=3,
        batch_sizes=(1, 4),
        eos_ids=(),
        log=logs.append,
        baseline=dtype_copy(tiny_target, torch.bfloat16, lambda m: None),  # vanilla in another dtype, timed too
    )
    assert set(sizing.baseline_faster) == {1, 4}
    assert set(sizing.by_batch) == {1, 4} and set(sizing.policy.lengths) == {1, 4}
    cap = None
    for b in (1, 4):
        m = sizing.by_batch[b]
        assert set(m["verify_ms"]) == {1, 2, 3, 4} and m["vanilla_ms"] > 0 and m["draft_step_ms"] > 0
        pred = m["predicted_speedup"]
        own = max(pred, key=pred.get) if max(pred.values()) >= 1 + AUTO_MARGIN else 0
        cap = own if cap is None else min(cap, own)
        assert set(pred) == {1, 2, 3} and m["k"] == sizing.policy.lengths[b] == cap
        assert m["vanilla_dtype"] == ("bfloat16" if sizing.baseline_faster[b] else "float32")
    assert "batch policy" in logs[0] and "bs 4:" in logs[0]


def test_a_category_smaller_than_the_batch_is_cycled_to_fill_it():
    from eval.measure import MeasuredPrompt, batches_of

    prompts = [MeasuredPrompt([i], "a") for i in range(3)] + [MeasuredPrompt([9], "b")]
    batches = batches_of(prompts, 4)
    assert [[p.ids[0] for p in b] for b in batches] == [[0, 1, 2, 0], [9, 9, 9, 9]]
    assert [[p.ids[0] for p in b] for b in batches_of(prompts, 2)] == [[0, 1], [2], [9, 9]]


def test_a_call_left_off_decodes_on_the_faster_vanilla_copy_the_policy_names(tiny_target):
    from infer.serving import dtype_copy

    bf16 = dtype_copy(tiny_target, torch.bfloat16, lambda m: None)
    policy = BatchPolicy({1: 2, 4: 0})
    make = lambda k: PromptLookupProposer(num_draft=k)  # noqa: E731
    proposer = BatchAwareProposer(make, policy, {1: None, 4: bf16})
    res = generate_speculative(tiny_target, proposer, PROMPTS[:4], GREEDY)
    assert not proposer.drafts and proposer.vanilla_target is bf16
    assert res.tokens == generate_vanilla(bf16, PROMPTS[:4], GREEDY).tokens
    # at batch 1 the chain runs on the served target: greedy identical to its vanilla
    proposer = BatchAwareProposer(make, policy, {1: None, 4: bf16})
    res = generate_speculative(tiny_target, proposer, PROMPTS[:1], GREEDY)
    assert proposer.drafts and proposer.vanilla_target is None
    assert res.tokens == generate_vanilla(tiny_target, PROMPTS[:1], GREEDY).tokens


def test_the_report_judges_a_call_on_the_faster_copy_against_that_copy_s_vanilla(tiny_target):
    from eval.measure import Candidate, MeasuredPrompt, measure
    from models.target import TargetModel
    from tests.conftest import tiny_llama

    # a stand-in for "the target in the dtype vanilla is fastest in" whose greedy answers differ from the served
    # target's (a tiny bf16 copy answers the same): judged against the served vanilla, the row would diverge
    other = TargetModel(tiny_llama(seed=1))
    prompts = [MeasuredPrompt(p, "all") for p in PROMPTS[:2]]
    assert (
        generate_vanilla(other, PROMPTS[:2], GREEDY).tokens != generate_vanilla(tiny_target, PROMPTS[:2], GREEDY).tokens
    )
    make = lambda k: PromptLookupProposer(num_draft=k)  # noqa: E731
    auto = Candidate("auto", "off", lambda: BatchAwareProposer(make, BatchPolicy({1: 0}), {1: other}))
    rows = measure(tiny_target, [auto], prompts, (), max_new_tokens=GREEDY.max_new_tokens,
                   include_prompt_lookup=False, fp32_certificate=False, vanilla_target=other, log=lambda m: None)  # fmt: skip
    row = next(r for r in rows if r["proposer"] == "auto")
    assert row["greedy_identical"] == 1.0 and row["unexplained_divergences"] == 0 and row["tau"] == 1.0
