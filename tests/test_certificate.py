"""The greedy certificate (infer/certificate.py): first divergence and the target's top-2 logit gap there."""

import torch

from infer.certificate import TIE_GAP, compare_greedy
from infer.generate import generate_vanilla
from infer.sampling import SamplingParams


def test_first_divergence_and_the_targets_top2_gap_there(tiny_target):
    model = tiny_target.model
    prompt = [4, 8, 15, 16, 23]
    ref = generate_vanilla(tiny_target, [prompt], SamplingParams(max_new_tokens=8)).tokens[0]
    same = compare_greedy(model, prompt, ref, list(ref))
    assert same.identical and same.first_divergence is None and not same.numerical_tie
    assert not compare_greedy(model, prompt, ref, ref[:5]).identical  # a prefix is not identical, but no divergence
    other = list(ref)
    other[3] = (other[3] + 1) % tiny_target.vocab_size
    got = compare_greedy(model, prompt, ref, other)
    logits = model(input_ids=torch.tensor([prompt + ref[:3]])).logits[0, -1]
    top = logits.topk(2).values
    assert got.first_divergence == 3 and abs(got.top2_gap - float(top[0] - top[1])) < 1e-5
    assert got.top2_gap > TIE_GAP and not got.numerical_tie  # the sharpened tiny target never ties
