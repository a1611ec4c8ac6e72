"""GPU tier, end to end: the verify runtime and the EAGLE-3 recipe on CUDA tensors (Triton kernels dispatched).

The CPU tiers test the same code on the torch path; these check that the CUDA path gives the same tokens: greedy
speculative output equals vanilla on CUDA, and vanilla on CUDA equals vanilla on the CPU (fp32, TF32 off, logits
sharpened so greedy choices are far from ties). Skipped without CUDA.
"""

from __future__ import annotations

import json

import pytest
import torch

import train.eagle3 as recipe
from infer.eagle3_proposer import Eagle3Proposer
from infer.generate import generate_speculative, generate_vanilla
from infer.proposers import DraftModelProposer
from infer.sampling import SamplingParams
from infer.tree_search import DynamicTreeConfig
from models.eagle3 import Eagle3Drafter
from models.target import TargetModel
from tests.conftest import recipe_args, tiny_llama
from tests.test_eagle3_proposer import PROMPTS, SETTINGS
from tests.test_generate import PROPOSERS
from train.draft_vocab import build_draft_vocab

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
TREE = DynamicTreeConfig(top_k=3, depth=4, total_tokens=10)


@pytest.fixture(scope="module")
def cuda_models():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu_target = TargetModel(tiny_llama(seed=0))
    target = TargetModel(tiny_llama(seed=0)).cuda()
    draft = tiny_llama(layers=1, hidden=32, seed=1).cuda()
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=60)
    drafter.set_draft_vocab(*build_draft_vocab(torch.randint(1, 100, (97,)), 60))
    return cpu_target, target, draft, drafter.cuda()


def proposers(target, draft, drafter) -> dict:
    """Every proposer shape of the CPU identity tests (tests/test_generate.py, tests/test_eagle3_proposer.py)."""
    return {name: make(target, draft) for name, make in PROPOSERS.items()} | {
        f"eagle3-{name}": Eagle3Proposer(drafter, **kw) for name, kw in SETTINGS.items()
    }


def test_cuda_vanilla_equals_cpu_vanilla(cuda_models):
    cpu_target, target, _, _ = cuda_models
    for p in PROMPTS:
        assert generate_vanilla(target, [p], GREEDY).tokens == generate_vanilla(cpu_target, [p], GREEDY).tokens
    assert generate_vanilla(target, PROMPTS, GREEDY).tokens == generate_vanilla(cpu_target, PROMPTS, GREEDY).tokens


@pytest.mark.parametrize("batch", [1, 4])
def test_cuda_speculative_greedy_is_token_identical(cuda_models, batch):
    _, target, draft, drafter = cuda_models
    prompts = PROMPTS[:batch]
    expected = [generate_vanilla(target, [p], GREEDY).tokens[0] for p in prompts]
    for name, proposer in proposers(target, draft, drafter).items():
        res = generate_speculative(target, proposer, prompts, GREEDY)
        assert res.tokens == expected, name
        assert res.stats.tau >= 1.0, name
    self_draft = generate_speculative(target, DraftModelProposer(target.model, k=4), prompts, GREEDY)
    assert self_draft.stats.tau > 4.0  # the target drafting for itself is accepted (nearly) always


def test_cuda_sampling_is_reproducible_and_in_vocab(cuda_models):
    _, target, draft, drafter = cuda_models
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=16, seed=3)
    for make in (lambda: DraftModelProposer(draft, tree=TREE), lambda: Eagle3Proposer(drafter, k=3)):
        a = generate_speculative(target, make(), PROMPTS, params)
        b = generate_speculative(target, make(), PROMPTS, params)
        assert a.tokens == b.tokens
        assert all(len(t) == 16 and all(0 <= x < 97 for x in t) for t in a.tokens)


def test_cuda_recipe_trains_in_bf16_and_reports(tiny_recipe, tmp_path, capsys):
    """The reference recipe on a tiny target, on CUDA: bf16 autocast training, export, report with identity."""
    out = tmp_path / "run"
    recipe.main(recipe_args(tiny_recipe, out, "train.max_steps=6", "target.device=cuda", "train.mixed_precision=bf16"))
    printed = capsys.readouterr().out
    assert "precision bf16" in printed and "device cuda" in printed
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "step" in r]
    assert steps[-1]["step"] == 6 and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    rows = json.loads((out / "report.json").read_text())["results"]
    greedy = [r for r in rows if r["proposer"] == "eagle3" and r["temperature"] == 0.0]
    assert greedy and all(r["greedy_identical"] == 1.0 for r in greedy)
