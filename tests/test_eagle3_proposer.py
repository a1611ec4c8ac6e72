"""EAGLE-3 proposer in the verify runtime: greedy token identity (chain, trees; bs 1 and 3) and an overfit stand-in
whose acceptance is known (a drafter trained to 100 % TTT accuracy on the exact sequence it then drafts)."""

from __future__ import annotations

import pytest
import torch

from infer.eagle3_proposer import Eagle3Proposer
from infer.generate import generate_speculative, generate_vanilla
from infer.sampling import SamplingParams
from infer.tree_search import DynamicTreeConfig
from models.acceptance import walked_chain
from models.eagle3 import Eagle3Drafter
from train.draft_vocab import build_draft_vocab
from train.losses import ttt_loss, ttt_targets

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [11, 3, 4],
    [9],  # one token: no features before the first verify round
    [40, 41, 42, 43, 44, 45, 46, 40, 41, 42, 43, 44, 45, 46, 40, 41, 42],
]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)
SETTINGS = {
    "chain": dict(k=3),
    "dynamic-tree": dict(tree=DynamicTreeConfig(top_k=3, depth=4, total_tokens=10)),
    "static-tree": dict(static_paths=[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
}


@pytest.fixture(scope="module")
def random_drafter(tiny_target):
    """Random weights and a draft vocabulary of 60 of the 97 ids (so d2t is not the identity)."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=60)
    counts = torch.randint(1, 100, (97,))
    drafter.set_draft_vocab(*build_draft_vocab(counts, 60))
    return drafter


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_token_identical_to_vanilla(tiny_target, random_drafter, setting, batch):
    prompts = PROMPTS[:batch] if batch == 1 else PROMPTS[1:4]
    expected = [generate_vanilla(tiny_target, [p], GREEDY).tokens[0] for p in prompts]
    proposer = Eagle3Proposer(random_drafter, **SETTINGS[setting])
    res = generate_speculative(tiny_target, proposer, prompts, GREEDY)
    assert res.tokens == expected
    assert res.stats.tau >= 1.0


def test_drafts_only_draft_vocab_tokens(tiny_target, random_drafter):
    proposer = Eagle3Proposer(random_drafter, tree=DynamicTreeConfig(top_k=4, depth=3, total_tokens=12))
    proposer.begin([PROMPTS[0]])
    out = tiny_target(torch.tensor([PROMPTS[0][:-1]]))
    proposer.observe(out.aux_hidden, torch.tensor([len(PROMPTS[0]) - 1]))
    tree = proposer.propose([PROMPTS[0]], GREEDY, torch.Generator())
    assert tree.tokens.shape == (1, 12)
    assert bool(random_drafter.t2d[tree.tokens[0, 1:]].all())
    assert proposer.kv_valid.shape[1] == len(PROMPTS[0]) - 1  # draft slots closed again, pairs kept


def _overfit(target, drafter, ids: list[int], ttt_steps: int, max_steps: int = 1000) -> list[float]:
    """Train the drafter on one sequence until every TTT step predicts the target's argmax everywhere."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = target(x)
    T = x.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None]
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    drafter.train()
    for _ in range(max_steps):
        # sharpened labels: overfitting only needs the target's argmax, and near-one-hot labels get there fastest
        targets = ttt_targets(out.logits * 20, lambda v: v, torch.ones_like(x), drafter.t2d, ttt_steps)
        logits = drafter(out.aux_hidden, x, torch.arange(T)[None], allowed, ttt_steps, targets.masks)
        res = ttt_loss(logits, targets)
        if bool((res.step_correct == res.step_count).all()):
            break
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    drafter.eval()
    return (res.step_correct / res.step_count).tolist()


def test_overfit_drafter_is_accepted_at_every_depth(tiny_target):
    """Known acceptance: after training to 100 % TTT accuracy on the target's own greedy continuation, every draft
    of a chain / tree of depth k is accepted each round (τ = k + 1) while the drafts stay inside the trained text."""
    prompt = PROMPTS[0]
    cont = generate_vanilla(tiny_target, [prompt], SamplingParams(max_new_tokens=24)).tokens[0]
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=97)
    k = 3
    acc = _overfit(tiny_target, drafter, prompt + cont, ttt_steps=k)
    assert acc == [1.0] * k
    params = SamplingParams(max_new_tokens=16)
    for proposer in (
        Eagle3Proposer(drafter, k=k),
        Eagle3Proposer(drafter, tree=DynamicTreeConfig(top_k=2, depth=k, total_tokens=8)),
    ):
        res = generate_speculative(tiny_target, proposer, [prompt], params)
        assert res.tokens[0] == cont[:16]
        assert res.stats.alpha == [1.0] * k
        assert res.stats.tau == 16 / 4  # 4 rounds of k + 1 tokens


def _forced_hits(target, drafter, ids: list[int], prompt_len: int, k: int) -> torch.Tensor:
    """[k, T] bool: the training evaluation's top-1 agreement of TTT step i at position t (it drafts token t+2+i),
    over the answer ``ids[prompt_len:]``; False where nothing is trained (a label outside the answer or the draft
    vocabulary: a chain can never be accepted there either)."""
    x = torch.tensor([ids])
    T = x.shape[1]
    with torch.no_grad():
        out = target(x)
        loss_mask = (torch.arange(T) >= prompt_len).long()[None]
        targets = ttt_targets(out.logits, lambda v: v, loss_mask, drafter.t2d, k)
        allowed = torch.ones(T, T, dtype=torch.bool).tril()[None]
        logits = drafter(out.aux_hidden, x, torch.arange(T)[None], allowed, k, targets.masks)
    hits = torch.zeros(k, T, dtype=torch.bool)
    for i in range(k):
        hits[i, targets.masks[i][0]] = logits[i].argmax(-1) == targets.top[i]
    return hits


def test_a_served_chain_accepts_exactly_what_the_teacher_forced_hits_predict(tiny_target):
    """Serving and training agree: a partly trained drafter's chain, round by round, accepts the run of TTT steps
    that the training evaluation scores correct at the round's position. The runtime drafts the first answer token
    too (its drafter has read the prompt's features up to the second-to-last token), so the first round starts at
    the last prompt token; every round then moves past its accepted drafts and the bonus token. A rollback or
    feature-bookkeeping slip after a rejection would change the rounds that follow."""
    prompt = PROMPTS[0]
    cont = generate_vanilla(tiny_target, [prompt], SamplingParams(max_new_tokens=32)).tokens[0]
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=97)
    k = 3
    _overfit(tiny_target, drafter, prompt + cont, ttt_steps=k, max_steps=25)  # stopped early: right about half the time
    ids, P = prompt + cont, len(prompt)
    hits = _forced_hits(tiny_target, drafter, ids, P, k)
    expected, j = [], P - 1  # j: the newest token the target has given
    while j < len(ids) - 1:
        a = 0
        while a < k and j + 1 + a < len(ids) and hits[a, j - 1]:
            a += 1
        expected.append(a)
        j += a + 1
    # rejected rounds, partly accepted ones and rounds after them: the walk below can disagree with the runtime
    assert 0 in expected and any(0 < a < k for a in expected) and len(expected) > 8
    res = generate_speculative(tiny_target, Eagle3Proposer(drafter, k=k), [prompt], SamplingParams(max_new_tokens=32))
    assert res.tokens[0] == cont
    assert res.stats.accepted_per_round == expected
    # the library's replay (the training evaluation's walked τ) gives the served run's tokens, forwards and α1
    by_root = torch.nn.functional.pad(hits, (1, 0))[:, :-1]  # pair t drafts for the round whose newest token is t+1
    walk = walked_chain(by_root.tolist(), P, len(ids), k)
    assert (walk.tokens, walk.rounds) == (res.stats.new_tokens, res.stats.row_forwards) == (len(cont), len(expected))
    assert walk.first == sum(a > 0 for a in expected)


def test_teacher_forced_first_drafts_are_the_served_ones_at_every_position(tiny_target, random_drafter):
    sequence = PROMPTS[3]
    drafts = random_drafter.first_drafts(tiny_target, sequence)
    for t in range(2, len(sequence)):
        context = sequence[:t]  # the served round that drafts token t: the target has cached context[:-1]
        proposer = Eagle3Proposer(random_drafter, k=1)
        proposer.begin([context])
        proposer.observe(tiny_target(torch.tensor([context[:-1]])).aux_hidden, torch.tensor([t - 1]))
        tree = proposer.propose([context], GREEDY, torch.Generator())
        assert int(drafts[t]) == int(tree.tokens[0, 1]), t
