"""The greedy certificate (infer/certificate.py): a divergence from vanilla is explained by the served dtype's
rounding only when the replayed exact gap is inside that dtype's band; a wrong token never is."""

import copy

import pytest
import torch

from eval.measure import Candidate, MeasuredPrompt, measure
from infer.accept import AcceptResult
from infer.certificate import Certifier, compare_greedy, replay_dtype, rounding_band, ulp
from infer.generate import generate_vanilla
from infer.proposers import DraftModelProposer
from infer.sampling import SamplingParams
from models.target import TargetModel
from tests.conftest import tiny_llama

PROMPT = [4, 8, 15, 16, 23]


def test_ulp_and_band_follow_the_dtype_and_the_magnitude():
    assert ulp(torch.bfloat16, 20.0) == 0.125 and ulp(torch.bfloat16, -17.5) == 0.125  # spacing at 16..32
    assert ulp(torch.bfloat16, 1.5) == 2**-7 and ulp(torch.float32, 1.0) == 2**-23
    assert ulp(torch.float16, 1000.0) == 0.5
    assert rounding_band(torch.bfloat16, 20.0, served_error=0.01) == pytest.approx(0.02 + 0.25)
    assert rounding_band(torch.float32, 20.0, 0.0) == pytest.approx(2 * 2**-19)
    assert replay_dtype(torch.bfloat16) == torch.float32 and replay_dtype(torch.float32) == torch.float64


def test_identical_prefix_and_wrong_token_in_fp32(tiny_target):
    model = tiny_target.model
    ref = generate_vanilla(tiny_target, [PROMPT], SamplingParams(max_new_tokens=8)).tokens[0]
    same = compare_greedy(model, PROMPT, ref, list(ref))
    assert same.identical and same.explained and same.first_divergence is None
    prefix = compare_greedy(model, PROMPT, ref, ref[:5])
    assert not prefix.identical and not prefix.explained  # stopping early is never rounding
    other = list(ref)
    other[3] = (other[3] + 1) % tiny_target.vocab_size
    got = compare_greedy(model, PROMPT, ref, other)
    logits = model(input_ids=torch.tensor([PROMPT + ref[:3]])).logits[0, -1].double()
    assert got.first_divergence == 3 and (got.reference_token, got.candidate_token) == (ref[3], other[3])
    assert got.gap == pytest.approx(float(logits[ref[3]] - logits[other[3]]), abs=1e-5)
    assert got.replay_dtype == "float64" and got.band < 1e-4 and not got.explained
    assert not got.candidate_exact
    # the other way round: vanilla's side holds the wrong token and the method the exact greedy one. However far
    # outside the band, the method was right there: vanilla's run parted from the exact argmax
    flipped = compare_greedy(model, PROMPT, other, ref)
    assert flipped.gap == pytest.approx(-got.gap, abs=1e-5) and abs(flipped.gap) > flipped.band
    assert flipped.candidate_exact and flipped.explained and flipped.as_dict()["candidate_exact"]


def _near_tie_target(dtype: torch.dtype) -> tuple[TargetModel, int, int, int]:
    """A tiny target whose lm_head has two rows 1e-4 apart (relative), so those tokens' logits differ far less than
    a bf16 ulp; returns (target, position where vanilla picks one of them, vanilla's token there, the other)."""
    model = tiny_llama(seed=3)
    ref = generate_vanilla(TargetModel(copy.deepcopy(model)), [PROMPT], SamplingParams(max_new_tokens=12)).tokens[0]
    a = ref[2]
    b = next(t for t in range(model.config.vocab_size) if t not in ref)
    with torch.no_grad():
        model.lm_head.weight[b] = model.lm_head.weight[a] * (1 + 1e-4)
    target = TargetModel(model.to(dtype))
    ref = generate_vanilla(target, [PROMPT], SamplingParams(max_new_tokens=12)).tokens[0]
    pos = next(i for i, t in enumerate(ref) if t in (a, b))
    return target, pos, ref[pos], b if ref[pos] == a else a


def test_a_bf16_near_tie_is_explained_and_a_wrong_token_is_not():
    target, pos, picked, twin = _near_tie_target(torch.bfloat16)
    ref = generate_vanilla(target, [PROMPT], SamplingParams(max_new_tokens=12)).tokens[0]
    certifier = Certifier(target.model)
    tie = list(ref)
    tie[pos] = twin
    got = certifier.compare(PROMPT, ref, tie)
    assert got.served_dtype == "bfloat16" and got.replay_dtype == "float32"
    assert abs(got.gap) < ulp(torch.bfloat16, 1.0) and got.explained  # far inside one bf16 ulp
    wrong = list(ref)
    logits = certifier.last_logits(certifier.replica(), PROMPT + ref[:pos])
    wrong[pos] = int(logits.argmin())
    bad = certifier.compare(PROMPT, ref, wrong)
    assert bad.gap > 10 * bad.band and not bad.candidate_exact and not bad.explained


def _accept_every_draft(tree, logits):
    """A deliberately wrong greedy rule: every draft of a chain is accepted, the bonus is the target's argmax."""
    B, n = tree.tokens.shape
    path = torch.arange(n).expand(B, n).clone()
    return AcceptResult(path, torch.full((B,), n), logits[:, -1].argmax(-1))


@pytest.mark.parametrize("wrong_rule", [False, True])
def test_bf16_report_explains_rounding_and_catches_a_wrong_rule(tiny_draft, monkeypatch, wrong_rule):
    """Served in bf16: the correct rule's divergences (if this CPU's bf16 produces any) are all explained and each
    one's fp32 replay from its first differing token is identical; a rule that accepts every draft is reported as
    unexplained in both dtypes."""
    import infer.generate

    if wrong_rule:
        monkeypatch.setattr(infer.generate, "verify_greedy", _accept_every_draft)
    target = TargetModel(tiny_llama(seed=0).to(torch.bfloat16))
    prompts = [MeasuredPrompt([5, 6, 7, 8, 5, 6, 7, 8], "a", "q1"), MeasuredPrompt([11, 3, 17, 23], "b", "q2")]
    cands = [Candidate("draft model", "chain 3", lambda: DraftModelProposer(tiny_draft, k=3))]
    rows = measure(target, cands, prompts, (), max_new_tokens=16, include_prompt_lookup=False, log=lambda m: None)
    total = next(r for r in rows if r["category"] == "all")
    assert total["dtype"] == "bfloat16"
    # every divergent answer (batch 1, no repeats: each one distinct) replayed once in fp32, nothing else
    assert total["fp32_replays"] == len(total["divergences"])
    if wrong_rule:
        assert total["unexplained_divergences"] > 0 and total["fp32_replays_identical"] < total["fp32_replays"]
        d = next(d for d in total["divergences"] if not d["explained"])
        assert d["prompts"][d["row"]] in ("q1", "q2") and d["gap"] > d["band"]
        # the fp32 replay's divergences are placed in the whole answer, at or after where the served one began
        first = {d["row"]: d["position"] for d in total["divergences"]}
        assert total["fp32_divergences"] and all(
            f["position"] is None or f["position"] >= first[f["row"]] for f in total["fp32_divergences"]
        )
    else:
        assert total["unexplained_divergences"] == 0 and total["fp32_replays_identical"] == total["fp32_replays"]
        assert total["explained_divergences"] == len(total["divergences"])
        assert total["greedy_identical_fp32"] == (1.0 if total["divergences"] else None)


def test_a_replay_starts_at_the_first_differing_token_with_the_rest_of_the_budget():
    from eval.measure import replays_of

    prompts, reference, got = [[1, 2], [3]], [[5, 6, 7], [8, 9]], [[5, 6, 4], [8]]
    divergences = [
        {"batch": 0, "category": "a", "prompts": ["p", "q"], "row": 0, "position": 2},
        {"batch": 0, "category": "a", "prompts": ["p", "q"], "row": 1, "position": None},  # one output a prefix
    ]
    first, second = replays_of("m / chain 3", "a", 2, prompts, reference, got, divergences, max_new_tokens=8)
    assert first.prefix == (1, 2, 5, 6) and first.start == 2 and first.budget == 6 and first.where["row"] == 0
    assert second.prefix == (3, 8) and second.start == 1 and second.budget == 7  # from the end of the shorter answer
    # the same divergence seen again (a batch repeat) is one replay
    again = replays_of("m / chain 3", "a", 2, prompts, reference, got, divergences[:1], max_new_tokens=8)
    assert len(dict.fromkeys([first, second, *again])) == 2
