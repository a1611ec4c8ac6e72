"""The one timing loop (eval/measure.py): stops at EOS, counts, the greedy certificate, clear errors; the CLI's
checkout warning (the precision choice: tests/test_precision.py)."""

from itertools import zip_longest

import pytest
import torch

from eval.measure import Candidate, MeasuredPrompt, hf_generate, measure
from eval.report_md import write_report
from infer.generate import generate_vanilla
from infer.proposers import DraftModelProposer
from infer.sampling import SamplingParams
from models.acceptance import acceptance_rates

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 3, 17, 23]]


def _stop_at(target, prompt, index):
    """A token whose first occurrence in the greedy continuation of ``prompt`` is at ``index`` (or later)."""
    ref = generate_vanilla(target, [prompt], SamplingParams(max_new_tokens=30)).tokens[0]
    i = next(i for i in range(index, len(ref)) if ref[i] not in ref[:i])
    return ref, ref[i], i


def test_answers_stop_at_eos_and_no_token_after_it_is_counted(tiny_target, tiny_draft, tmp_path):
    ref, eos, at = _stop_at(tiny_target, PROMPTS[0], 5)
    cands = [
        Candidate("draft model", "chain 3", lambda: DraftModelProposer(tiny_draft, k=3)),
        Candidate("self-draft", "chain 4", lambda: DraftModelProposer(tiny_target.model, k=4)),
    ]
    hf = {"HF prompt lookup": dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=2)}
    rows = measure(
        tiny_target, cands, [MeasuredPrompt(PROMPTS[0], "a")], (eos,), max_new_tokens=30, hf_assisted=hf, log=print
    )
    assert {r["proposer"] for r in rows} == {"prompt lookup", "draft model", "self-draft", "HF prompt lookup"}
    assert next(r for r in rows if r["proposer"] == "HF prompt lookup")["tau"] is None  # HF reports no rounds
    for r in rows:  # every method emitted exactly the answer up to and including EOS, nothing after
        assert r["new_tokens"] == r["vanilla_new_tokens"] == at + 1
        assert r["greedy_identical"] == 1.0 and r["divergences"] == []
    self_draft = next(r for r in rows if r["proposer"] == "self-draft")
    assert self_draft["tau"] > 2.0  # the target drafting for itself: every draft accepted until the stop
    tokens, _ = hf_generate(tiny_target.model, PROMPTS[0], SamplingParams(max_new_tokens=30), (eos,))
    assert tokens == ref[: at + 1]
    write_report(tmp_path, "test", "tiny", rows, prompt_set="two prompts")
    assert "two prompts" in (tmp_path / "report.md").read_text()


def test_rows_per_category_and_the_greedy_certificate(tiny_target, tiny_draft, monkeypatch):
    """Two categories give rows for each and for all. A candidate whose output departs from vanilla (simulated: its
    4th token of the first prompt is replaced) is counted as not identical, and the divergence is located with the
    target's top-2 logit gap there (far above a numerical tie for a random model)."""
    import eval.measure

    real = eval.measure.generate_speculative

    def corrupted(target, proposer, prompts, params, eos_ids=(), spec=None):
        res = real(target, proposer, prompts, params, eos_ids, spec=spec)
        if prompts[0] == PROMPTS[0] and params.max_new_tokens > 4:
            res.tokens[0][3] = (res.tokens[0][3] + 1) % 97
        return res

    monkeypatch.setattr(eval.measure, "generate_speculative", corrupted)
    prompts = [MeasuredPrompt(PROMPTS[0], "a"), MeasuredPrompt(PROMPTS[1], "b")]
    cands = [Candidate("draft model", "chain 4", lambda: DraftModelProposer(tiny_draft, k=4))]
    rows = measure(tiny_target, cands, prompts, (), max_new_tokens=24, include_prompt_lookup=False, log=lambda m: None)
    assert [r["category"] for r in rows] == ["all", "a", "b"]
    total, a, b = rows
    assert total["prompts"] == 2 and total["new_tokens"] == a["new_tokens"] + b["new_tokens"]
    assert total["greedy_identical"] == 0.5 and a["greedy_identical"] == 0.0 and b["greedy_identical"] == 1.0
    (d,) = a["divergences"]
    assert d["position"] == 3 and d["top2_gap"] > 1e-3
    assert b["divergences"] == [] and not total["lossy"]
    # the counts behind α, pooled over categories: the leaderboard's unconditional acceptance reads them
    assert acceptance_rates(total["accepted_at_depth"], total["attempted_at_depth"]) == total["alpha"]
    assert total["verify_steps"] == a["verify_steps"] + b["verify_steps"] >= total["attempted_at_depth"][0] > 0
    assert total["accepted_at_depth"] == [
        x + y for x, y in zip_longest(a["accepted_at_depth"], b["accepted_at_depth"], fillvalue=0)
    ]


def test_vanilla_in_its_fastest_dtype_is_the_baseline_when_serving_in_another(tiny_target, tmp_path):
    """Speculation served in fp32 with vanilla also timed on a bf16 copy: the speedup is over the faster of the two,
    greedy identity is judged against the served dtype's vanilla, and the rows say which dtype the baseline ran in."""
    from infer.serving import dtype_copy

    other = dtype_copy(tiny_target, torch.bfloat16, lambda m: None)
    cands = [Candidate("self-draft", "chain 2", lambda: DraftModelProposer(tiny_target.model, k=2))]
    rows = measure(tiny_target, cands, [MeasuredPrompt(PROMPTS[1])], (), max_new_tokens=12, vanilla_target=other)
    for r in rows:
        by = r["vanilla_tokens_per_s_by_dtype"]
        assert set(by) == {"float32", "bfloat16"} and r["vanilla_tokens_per_s"] == max(by.values())
        assert r["vanilla_dtype"] == max(by, key=by.get) and r["dtype"] == "float32"
        assert r["greedy_identical"] == 1.0  # against fp32 vanilla, the served dtype
        # the prediction's vanilla step is the faster dtype's, like the measured speedup's baseline
        assert r["step_ms"]["vanilla"] <= r["vanilla_ms"]["forward"]
    write_report(tmp_path, "test", "tiny", rows)
    assert "vanilla baseline (the fastest of our loop and HF generate) ran in" in (tmp_path / "report.md").read_text()


def test_an_empty_prompt_set_is_a_clear_error(tiny_target):
    with pytest.raises(ValueError, match="prompt set is empty"):
        measure(tiny_target, [], [], (2,))


def test_cli_warns_when_run_from_another_checkout(tmp_path):
    from scripts.cli import ROOT, other_checkout

    clone = tmp_path / "clone"
    (clone / "train").mkdir(parents=True)
    (clone / "pyproject.toml").write_text('[project]\nname = "drafters"\n')
    assert other_checkout(clone / "train") == clone
    assert other_checkout(ROOT) is None and other_checkout(ROOT / "train") is None
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert other_checkout(tmp_path / "elsewhere") is None


def test_the_sizing_reads_the_cost_curve_fitted_monotone():
    """A 2-token verify timed below vanilla's step (a disturbed step, or a shape vanilla could run too) lowers
    vanilla's step to it: a chain's predicted speedup is then at most the tokens it yields, never a gain from the
    shape. Read raw, the same curve predicts more than the accepted tokens can give."""
    from eval.cost_curve import best_chain_length, fitted_costs
    from models.acceptance import expected_tokens

    curve, vanilla = {1: 0.050, 2: 0.040, 3: 0.090, 4: 0.060}, 0.045
    fit, fit_vanilla = fitted_costs(curve, vanilla)
    assert fit == {1: 0.040, 2: 0.040, 3: 0.060, 4: 0.060} and fit_vanilla == 0.040
    alpha = [0.5, 0.5, 0.5]
    _, rates = best_chain_length(alpha, 0.0, fit)
    assert all(rates[k] * fit_vanilla <= expected_tokens(alpha, k) + 1e-12 for k in rates)
    _, raw = best_chain_length(alpha, 0.0, curve)
    assert raw[1] * vanilla > expected_tokens(alpha, 1)
    assert fitted_costs({2: 0.05, 4: 0.07}, 0.04) == ({2: 0.05, 4: 0.07}, 0.04)  # a monotone curve is kept


def test_chain_length_from_the_cost_curve():
    from eval.cost_curve import best_chain_length

    # flat verify cost: deeper always pays while acceptance is positive
    k, _ = best_chain_length([0.8, 0.8, 0.8], 0.001, {n: 0.05 for n in range(1, 6)})
    assert k == 3
    # a step in the curve after 2 tokens (as on this CPU): one draft wins unless acceptance is high
    curve = {1: 0.05, 2: 0.06, 3: 0.09, 4: 0.09, 5: 0.095}
    k, rates = best_chain_length([0.5, 0.4, 0.3, 0.3], 0.002, curve)
    assert k == 1 and rates[1] == pytest.approx(1.5 / 0.062)
    assert best_chain_length([0.95, 0.95, 0.95, 0.95], 0.002, curve)[0] == 4


def test_pilot_acceptance_is_shrunk_toward_the_checkpoints_heldout_acceptance():
    """A 10-attempt pilot that happened to reject depth 3 cannot outvote 64 held-out samples; a pilot of thousands of
    attempts decides by itself; no prior leaves the pilot's rates."""
    from eval.cost_curve import PRIOR_WEIGHT, best_chain_length, shrunk_alpha

    prior = [0.45, 0.38, 0.36, 0.33]
    small = shrunk_alpha([3, 2, 0], [10, 3, 2], prior, prior_samples=64)
    assert small[2] == pytest.approx((0 + 64 * 0.36) / (2 + 64)) and small[2] > 0.3
    big = shrunk_alpha([900, 0], [3000, 900], prior, prior_samples=64)
    assert big[0] == pytest.approx(0.3, abs=0.01) and big[1] < 0.03
    assert shrunk_alpha([1, 0], [2, 1], None, 0) == [0.5, 0.0]
    assert shrunk_alpha([0], [0], [0.5], 10_000) == [0.5] and PRIOR_WEIGHT < 10_000  # the weight is capped
    # on a flat verify curve the shrunk acceptance picks a long chain where the raw pilot picked 1
    flat = {n: 0.035 for n in range(1, 7)}
    pilot = ([3, 0, 0, 0], [10, 3, 0, 0])
    assert best_chain_length(shrunk_alpha(*pilot, None, 0), 0.001, flat)[0] == 1
    assert best_chain_length(shrunk_alpha(*pilot, prior, 64), 0.001, flat)[0] == 3


def test_the_pilot_takes_one_prompt_of_each_block_of_a_file_listed_by_family():
    """A Spec-Bench file lists its families in blocks (here 6 x 4 prompts, each tagged by its family): the pilot's
    6 prompts are one of each, not the first block's; a file of no more prompts than the pilot takes them all."""
    from eval.cost_curve import pilot_context, pilot_prompts

    blocks = [[family, i] for family in range(6) for i in range(4)]
    assert [p[0] for p in pilot_prompts(blocks, 6)] == [0, 1, 2, 3, 4, 5]
    assert [p[0] for p in pilot_prompts([[f] for f in range(6) for _ in range(80)], 6)] == [0, 1, 2, 3, 4, 5]
    assert pilot_prompts(blocks[:3], 6) == blocks[:3]
    # the verify curve is timed after the pilot prompt of median length, not after the file's first
    lengths = [[7] * n for n in (3, 50, 9, 400, 20, 120) for _ in range(4)]
    assert len(pilot_context(lengths)) == 20


def test_a_larger_tree_wins_only_where_its_paired_gain_clears_the_pilots_spread():
    """Rates per pilot prompt, smallest setting first. A larger setting whose mean gain is within one standard
    error of zero stays behind, even where its pooled mean is higher; one that is steadily faster on every prompt
    wins, and the next larger is then judged against it."""
    from eval.cost_curve import paired_choice

    small = [10.0, 10.0, 10.0, 10.0]
    noisy = [14.0, 7.0, 13.0, 7.0]  # gains +0.4 -0.3 +0.3 -0.3: mean 0.025, standard error 0.18
    steady = [11.0, 11.0, 10.9, 11.1]  # gains 0.1 0.1 0.09 0.11: mean 0.1, standard error 0.004
    assert paired_choice({"n4": small, "n8": noisy}) == "n4"
    assert paired_choice({"n4": small, "n8": steady}) == "n8"
    assert paired_choice({"n4": small, "n8": steady, "n12": [12.1, 12.1, 12.0, 12.2]}) == "n12"
    # n12 is 10 % above n4 on every prompt but no better than n8: judged against the n8 kept, it stays behind
    assert paired_choice({"n4": small, "n8": steady, "n12": [11.0, 10.9, 11.0, 11.0]}) == "n8"
    assert paired_choice({"n4": small, "n12": [11.0, 10.9, 11.0, 11.0]}) == "n12"
    assert paired_choice({"n4": small, "n8": [9.0, 9.5, 9.0, 9.8]}) == "n4"
    assert paired_choice({"n4": [10.0], "n8": [10.5]}) == "n8"  # one prompt: no spread, the rate decides


def test_tree_sizing_pilots_every_setting_and_rates_it_on_the_verify_curve(tiny_target, monkeypatch):
    """The target drafting for itself accepts whatever of its greedy path the tree kept, so each setting's pilot τ
    is well above 2 and at most its depth + 1; the choice is the setting of the grid with the best predicted rate."""
    import eval.cost_curve
    from eval.cost_curve import PILOT_PROMPTS, paired_choice, size_tree, tree_name
    from infer.tree_search import DynamicTreeConfig

    monkeypatch.setattr(eval.cost_curve, "PILOT_TOKENS", 24)

    grid = (DynamicTreeConfig(2, 2, 4), DynamicTreeConfig(2, 4, 8))
    sizing = size_tree(
        tiny_target, lambda t: DraftModelProposer(tiny_target.model, tree=t), PROMPTS, (), grid, log=lambda m: None
    )
    assert set(sizing.rates) == {tree_name(g) for g in grid} and sizing.tree in grid
    assert tree_name(sizing.tree) == paired_choice(sizing.per_prompt)
    assert all(len(r) == min(len(PROMPTS), PILOT_PROMPTS) for r in sizing.per_prompt.values())
    for g in grid:
        assert 2.0 < sizing.tau[tree_name(g)] <= g.depth + 1
        assert sizing.predicted_speedup(tree_name(g)) > 0
    assert set(sizing.verify_s) == {1, 4, 8} and sizing.vanilla_step_s > 0  # the curve it was rated on


def test_sizing_predicts_against_the_faster_vanilla_of_the_two_dtypes(tiny_target):
    """With vanilla's target in another dtype (the report's baseline), a sizing's predicted speedup is over the
    faster of the two vanilla steps, as the measured speedup is."""
    from eval.cost_curve import _fastest_vanilla, vanilla_step_cost
    from infer.serving import dtype_copy

    other = dtype_copy(tiny_target, torch.bfloat16, lambda m: None)
    assert _fastest_vanilla(1e-12, other, PROMPTS[0]) == 1e-12  # the served step was faster
    assert _fastest_vanilla(60.0, other, PROMPTS[0]) < 60.0  # the other dtype's step (milliseconds) was
    assert _fastest_vanilla(60.0, None, PROMPTS[0]) == 60.0 and vanilla_step_cost(other, PROMPTS[0], 2) > 0


def test_batch1_vanilla_takes_the_loop_timed_faster_and_a_dtype_copy_chooses_anew(tiny_target, monkeypatch):
    """`choose_vanilla_loop` times both batch-1 loops' one-token forwards and keeps the faster; the sizing's vanilla
    step is then that loop's. Simulated: a stand-in makes one loop 100 ms slower, each way round (a margin no loaded CI host reaches with the
    tiny target's own step)."""
    import time

    import eval.cost_curve as cost_curve
    import infer.serving as serving
    from eval.cost_curve import step_costs
    from infer.serving import choose_vanilla_loop, dtype_copy

    monkeypatch.setattr(tiny_target, "vanilla_loop", "plain")
    monkeypatch.setattr(tiny_target, "vanilla_loop_ms", {})
    real = serving.vanilla_steps
    for slow, fast in (("plain", "masked"), ("masked", "plain")):

        def steps(target, context, slow=slow):
            got = real(target, context)
            step = got[slow]
            got[slow] = lambda: (time.sleep(0.1), step())
            return got

        monkeypatch.setattr(serving, "vanilla_steps", steps)
        monkeypatch.setattr(cost_curve, "vanilla_steps", steps)
        ms = choose_vanilla_loop(tiny_target, PROMPTS, 8, lambda m: None)
        assert tiny_target.vanilla_loop == fast and ms[slow] > 100 > ms[fast] and tiny_target.vanilla_loop_ms == ms
        _, vanilla = step_costs(tiny_target, PROMPTS[0], (1, 2), reps=2, aux=False)
        assert vanilla < 0.1  # the chosen (fast) loop's step, not the slow one's
    copy = dtype_copy(tiny_target, torch.bfloat16, lambda m: None)
    assert copy.vanilla_loop == "plain" and copy.vanilla_loop_ms == {}  # timed in fp32: not a bf16 choice


def test_a_direct_measure_call_chooses_the_batch1_loop_and_rows_name_it(tiny_target, tiny_draft, monkeypatch):
    monkeypatch.setattr(tiny_target, "vanilla_loop_ms", {})
    monkeypatch.setattr(tiny_target, "vanilla_loop", "plain")
    prompts = [MeasuredPrompt(p) for p in PROMPTS[:2]]
    make = lambda: DraftModelProposer(tiny_draft, k=2)  # noqa: E731
    rows = measure(
        tiny_target, [Candidate("draft", "chain 2", make)], prompts, (), max_new_tokens=8, log=lambda m: None
    )
    assert set(tiny_target.vanilla_loop_ms) == {"plain", "masked"}
    assert all(r["vanilla_loop"] == tiny_target.vanilla_loop and r["vanilla_loop_ms"] for r in rows)


def test_the_vanilla_check_times_the_loop_in_turn_with_its_bare_forward_and_flags_overhead(tiny_target, monkeypatch):
    """The loop side of the check is run then and there (not the measured run's mean, which carries the host's load):
    a loop that spends 30 ms a step beyond its forward is reported as not at its best."""
    import eval.cost_curve as cost_curve
    from eval.cost_curve import CHECK_TOKENS, vanilla_check

    row = {
        "vanilla_mean_answer_tokens": 20.0,
        "vanilla_ms": {"forward": 5.0, "bookkeeping": 0.5, "prefill_total": 10.0, "total": 200.0},
    }
    real = cost_curve.generate_vanilla

    def slow_loop(*args):
        res = real(*args)
        res.stats.bookkeeping_s += 0.03 * res.stats.rounds
        return res

    monkeypatch.setattr(cost_curve, "generate_vanilla", slow_loop)
    check = vanilla_check(tiny_target, PROMPTS, row, reps=3)
    assert not check["loop_within_noise"] and check["loop_step_ms"] > 30 > check["bare_forward_ms"]
    assert "overhead (the loop is not at its best)" in check["summary"] and f"{CHECK_TOKENS} tokens" in check["summary"]
    assert set(check["forward_ms_by_loop"]) == {"plain", "masked"} and check["measured_step_ms"] == 5.5
    assert sorted(check["verify_ms"]) == [1, 2, 3, 4, 6, 8]
