"""Runtime correctness on tiny random models: greedy identity, batching, stop rules, exact acceptance."""

import pytest
import torch

from infer.generate import DecodeState, SpecConfig, generate_speculative, generate_vanilla
from infer.proposer import Proposer
from infer.proposers import DraftModelProposer, PromptLookupProposer
from infer.sampling import SamplingParams
from infer.tree import DraftTree, chain
from infer.tree_search import DynamicTreeConfig

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [11, 3],
    [40, 41, 42, 43, 44, 45, 46, 40, 41, 42, 43, 44, 45, 46, 40, 41, 42],
    [9],
]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


def hf_greedy(model, prompt, n):
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def test_vanilla_matches_hf_generate(tiny_target):
    for p in PROMPTS:
        res = generate_vanilla(tiny_target, [p], GREEDY)
        assert res.tokens[0] == hf_greedy(tiny_target.model, p, GREEDY.max_new_tokens)
        assert res.stats.tau == 1.0


@pytest.mark.parametrize("loop", ["plain", "masked"])
def test_both_batch1_vanilla_loops_match_hf_generate(tiny_target, loop, monkeypatch):
    """Batch-1 vanilla runs whichever loop was timed faster on the machine (`eval.measure.choose_vanilla_loop`):
    each must decode what HF generate does, with τ 1.00."""
    import infer.generate as generate

    monkeypatch.setattr(tiny_target, "vanilla_loop", loop)
    if loop == "masked":  # the masked choice must not fall back to the plain loop
        monkeypatch.setattr(generate, "_vanilla_single", lambda *a: pytest.fail("the plain loop ran"))
    for p in PROMPTS:
        res = generate_vanilla(tiny_target, [p], GREEDY)
        assert res.tokens[0] == hf_greedy(tiny_target.model, p, GREEDY.max_new_tokens)
        assert res.stats.tau == 1.0 and res.stats.rounds == GREEDY.max_new_tokens


def test_vanilla_batch_equals_single_rows(tiny_target):
    singles = [generate_vanilla(tiny_target, [p], GREEDY).tokens[0] for p in PROMPTS]
    batch = generate_vanilla(tiny_target, PROMPTS, GREEDY).tokens
    assert batch == singles
    # a batch of one-token prompts has an empty cache at the first step (it once built a mask without the root)
    ones = [[9], [10]]
    assert generate_vanilla(tiny_target, ones, GREEDY).tokens == [
        generate_vanilla(tiny_target, [p], GREEDY).tokens[0] for p in ones
    ]


PROPOSERS = {
    "lookup-chain": lambda t, d: PromptLookupProposer(num_draft=5),
    "lookup-tree": lambda t, d: PromptLookupProposer(num_draft=4, num_candidates=3),
    "draft-chain": lambda t, d: DraftModelProposer(d, k=3),
    "draft-static-tree": lambda t, d: DraftModelProposer(
        d, static_paths=[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    ),
    "draft-dynamic-tree": lambda t, d: DraftModelProposer(d, tree=DynamicTreeConfig(top_k=3, depth=4, total_tokens=10)),
    "self-draft-chain": lambda t, d: DraftModelProposer(t.model, k=4),
}


@pytest.mark.parametrize("name", sorted(PROPOSERS))
@pytest.mark.parametrize("batch", [1, 4])
def test_speculative_greedy_is_token_identical(tiny_target, tiny_draft, name, batch):
    prompts = PROMPTS[:batch]
    expected = [generate_vanilla(tiny_target, [p], GREEDY).tokens[0] for p in prompts]
    res = generate_speculative(tiny_target, PROPOSERS[name](tiny_target, tiny_draft), prompts, GREEDY)
    assert res.tokens == expected
    assert res.stats.tau >= 1.0


def test_self_draft_accepts_everything(tiny_target):
    """The target drafting for itself at T=0: every draft is accepted, so τ = k + 1 until the budget."""
    k = 4
    params = SamplingParams(temperature=0.0, max_new_tokens=25)  # 5 rounds x 5 tokens exactly
    res = generate_speculative(tiny_target, DraftModelProposer(tiny_target.model, k=k), [PROMPTS[0]], params)
    assert res.stats.rounds == 5
    assert res.stats.tau == pytest.approx(5.0)
    assert res.stats.alpha == [1.0] * k
    assert res.stats.accepted_per_round == [k] * 5


class OracleProposer(Proposer):
    """Drafts the known greedy continuation, corrupting the draft at a fixed depth."""

    def __init__(self, reference: list[int], prompt_len: int, k: int, wrong_at: int | None):
        self.reference, self.prompt_len, self.k, self.wrong_at = reference, prompt_len, k, wrong_at

    def propose(self, contexts, params, generator):
        done = len(contexts[0]) - self.prompt_len
        draft = self.reference[done : done + self.k]
        draft += [0] * (self.k - len(draft))
        if self.wrong_at is not None:
            draft[self.wrong_at] = (draft[self.wrong_at] + 1) % 97
        return chain(torch.tensor([[contexts[0][-1], *draft]]))


@pytest.mark.parametrize("wrong_at", [0, 1, 2])
def test_oracle_acceptance_is_exact(tiny_target, wrong_at):
    p = PROMPTS[1]
    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    reference = generate_vanilla(tiny_target, [p], SamplingParams(max_new_tokens=40)).tokens[0]
    res = generate_speculative(tiny_target, OracleProposer(reference, len(p), 4, wrong_at), [p], params)
    assert res.tokens[0] == reference[:30]
    # drafts before the corrupted one are accepted, the bonus replaces it: wrong_at + 1 tokens a round
    assert set(res.stats.accepted_per_round) == {wrong_at}
    assert res.stats.tau == pytest.approx(30 / res.stats.rounds)
    assert res.stats.rounds == -(-30 // (wrong_at + 1))


def test_stop_token_inside_accepted_run(tiny_target):
    p = PROMPTS[1]
    reference = generate_vanilla(tiny_target, [p], SamplingParams(max_new_tokens=20)).tokens[0]
    stop = reference[6]
    first = reference.index(stop)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=(stop,))
    for proposer in (DraftModelProposer(tiny_target.model, k=5), OracleProposer(reference, len(p), 5, None)):
        res = generate_speculative(tiny_target, proposer, [p], params)
        assert res.tokens[0] == reference[: first + 1]
    van = generate_vanilla(tiny_target, [p], params)
    assert van.tokens[0] == reference[: first + 1]


@pytest.mark.parametrize("budget", [1, 2, 7])
def test_max_new_tokens_never_exceeded(tiny_target, budget):
    params = SamplingParams(temperature=0.0, max_new_tokens=budget)
    res = generate_speculative(tiny_target, DraftModelProposer(tiny_target.model, k=5), PROMPTS, params)
    assert [len(t) for t in res.tokens] == [budget] * len(PROMPTS)


def test_sampling_rows_are_reproducible_and_in_vocab(tiny_target, tiny_draft):
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=16, seed=3)
    a = generate_speculative(tiny_target, DraftModelProposer(tiny_draft, k=3), PROMPTS, params)
    b = generate_speculative(tiny_target, DraftModelProposer(tiny_draft, k=3), PROMPTS, params)
    assert a.tokens == b.tokens
    assert all(len(t) == 16 and all(0 <= x < 97 for x in t) for t in a.tokens)


def test_typical_acceptance_runs_and_is_labelled(tiny_target):
    res = generate_speculative(
        tiny_target,
        DraftModelProposer(tiny_target.model, k=3),
        [PROMPTS[0]],
        SamplingParams(temperature=0.7, max_new_tokens=12, seed=0),
        spec=SpecConfig(accept="typical"),
    )
    assert len(res.tokens[0]) == 12
    with pytest.raises(ValueError, match="typical"):
        SpecConfig(accept="lossy-thing")


def test_bad_tree_is_rejected():
    with pytest.raises(ValueError, match="parent"):
        DraftTree(torch.tensor([[1, 2]]), torch.tensor([[-1, 1]]), torch.ones(1, 2, dtype=torch.bool))


def test_cost_curve_times_every_size_at_a_fixed_context(tiny_target):
    """eval/cost_curve's timers: one entry per size; verify_costs raises if the cache is not cut back after each
    call (every size must see the same context)."""
    from eval.cost_curve import step_costs, vanilla_step_cost, verify_costs

    context = PROMPTS[2]
    costs = verify_costs(tiny_target, context, (1, 3, 8), reps=2, aux=True)
    assert sorted(costs) == [1, 3, 8] and all(c > 0 for c in costs.values())
    assert all(vanilla_step_cost(tiny_target, context, 2, loop) > 0 for loop in ("plain", "masked"))
    # the sizing's curve: the same verify sizes with vanilla's own step timed in turn beside them
    curve, vanilla = step_costs(tiny_target, context, (1, 2), reps=2, aux=False)
    assert sorted(curve) == [1, 2] and vanilla > 0


def test_drop_holes_left_aligns_each_rows_valid_entries_once_holes_dominate():
    from infer.attention import drop_holes

    B, nkv, S, d = 2, 2, 140, 3
    keys = torch.arange(B * nkv * S * d, dtype=torch.float32).reshape(B, nkv, S, d)
    values = -keys
    valid = torch.zeros(B, S, dtype=torch.bool)
    valid[0, [3, 50, 99]] = True  # 3 used of 140 slots: 140 > 2·3 + 64, so it packs
    valid[1, [7, 8]] = True
    ok, (k, v) = drop_holes(valid, [keys, values])
    assert k.shape == (B, nkv, 3, d) and ok.tolist() == [[True, True, True], [True, True, False]]
    assert torch.equal(k[0], keys[0][:, [3, 50, 99]]) and torch.equal(v[1, :, :2], values[1][:, [7, 8]])
    few = valid.clone()
    few[0, :40] = True  # 40 + 64 used-equivalent: below the threshold, nothing moves
    same_valid, same = drop_holes(few, [keys, values])
    assert same_valid is few and same[0] is keys and same[1] is values


def test_slack_cache_writes_in_place_and_reads_like_a_dynamic_cache():
    """`SlackCache` (the target's cache): each update lands in spare slots of one buffer (no copy of the old slots),
    keys / values read back exactly what a DynamicCache holds, and the runtime's edits (a prefix view assigned back,
    row selection, dropping leading slots) keep the two in step."""
    from transformers import DynamicCache

    from infer.attention import SlackCache

    slack, dyn = SlackCache(), DynamicCache()
    gen = torch.Generator().manual_seed(0)
    buffers = set()
    for width in (5, 1, 1, 3, 1):
        k, v = torch.randn(3, 2, width, 4, generator=gen), torch.randn(3, 2, width, 4, generator=gen)
        ks, vs = slack.update(k, v, 0)
        kd, vd = dyn.update(k, v, 0)
        assert torch.equal(ks, kd) and torch.equal(vs, vd)
        buffers.add(slack.layers[0]._k.data_ptr())
    assert len(buffers) == 1  # 11 slots fit the first buffer's slack: nothing was reallocated
    layer, ref = slack.layers[0], dyn.layers[0]
    layer.keys, layer.values = layer.keys[:, :, :8], layer.values[:, :, :8]  # the verify step's truncation
    ref.keys, ref.values = ref.keys[:, :, :8], ref.values[:, :, :8]
    assert layer.get_seq_length() == 8 and layer._k.data_ptr() in buffers
    keep = torch.tensor([0, 2])
    layer.batch_select_indices(keep)
    ref.batch_select_indices(keep)
    slack.drop_front(3)
    ref.keys, ref.values = ref.keys[:, :, 3:], ref.values[:, :, 3:]
    k, v = torch.randn(2, 2, 2, 4, generator=gen), torch.randn(2, 2, 2, 4, generator=gen)
    ks, vs = slack.update(k, v, 0)
    kd, vd = dyn.update(k, v, 0)
    assert ks.shape == (2, 2, 7, 4) and torch.equal(ks, kd) and torch.equal(vs, vd)
    layer.keys = kd.clone()  # a tensor that is not a view of the buffer replaces it
    assert torch.equal(layer.keys, kd) and layer._k.data_ptr() not in buffers


def test_dropping_finished_rows_moves_only_the_rows_past_the_new_end():
    """`DecodeState.drop_finished` fills the finished rows' places with the live rows past the batch's new end, and
    the slack cache then copies only those rows' used slots, in its own buffer. Any other selection gathers a new
    buffer. Both read back what a plain row selection of the cache gives, and later updates append in place."""
    state = DecodeState([[1, 2, 3]] * 6, SamplingParams(max_new_tokens=4), (), "cpu")
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, 2, 5, 4, generator=gen), torch.randn(6, 2, 5, 4, generator=gen)
    state.cache.update(k, v, 0)
    valid = torch.arange(5)[None, :] >= torch.arange(6)[:, None] % 3  # rows differ in their left padding
    state.kv_valid = valid
    layer = state.cache.layers[0]
    buffer = layer._k.data_ptr()
    keep = state.drop_finished([False, True, False, True, False, False])
    assert keep.tolist() == [0, 4, 2, 5] and state.active == [0, 4, 2, 5]
    assert torch.equal(layer.keys, k[keep]) and torch.equal(layer.values, v[keep])
    assert torch.equal(state.kv_valid, valid[keep]) and layer._k.data_ptr() == buffer
    k2, v2 = torch.randn(4, 2, 1, 4, generator=gen), torch.randn(4, 2, 1, 4, generator=gen)
    ks, vs = state.cache.update(k2, v2, 0)
    assert torch.equal(ks, torch.cat([k[keep], k2], 2)) and torch.equal(vs, torch.cat([v[keep], v2], 2))
    assert layer._k.data_ptr() == buffer
    swap = torch.tensor([1, 0, 2])  # moved rows come from inside the kept ones: gathered into a new buffer
    layer.batch_select_indices(swap)
    assert torch.equal(layer.keys, ks[swap]) and torch.equal(layer.values, vs[swap])
    assert layer._k.data_ptr() != buffer


def test_draft_model_cache_drops_its_holes_and_stays_token_identical(tiny_target, tiny_draft):
    """A dynamic tree closes ~10 draft slots a round; once they dominate, the draft model's cache is re-packed
    (infer.attention.drop_holes over every layer) and the answer is still the target's own."""
    widths = []

    class Recording(DraftModelProposer):
        def _close_draft_slots(self) -> None:
            super()._close_draft_slots()
            widths.append((self.kv_valid.shape[1], self.cache.layers[0].keys.shape[2]))

    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    proposer = Recording(tiny_draft, tree=DynamicTreeConfig(top_k=3, depth=4, total_tokens=10))
    res = generate_speculative(tiny_target, proposer, [PROMPTS[1]], params)
    assert res.tokens[0] == generate_vanilla(tiny_target, [PROMPTS[1]], params).tokens[0]
    assert all(w == k for w, k in widths)  # mask and every layer's cache agree
    assert any(after < before for (before, _), (after, _) in zip(widths, widths[1:]))  # it did re-pack
    assert max(w for w, _ in widths) <= 2 * (len(PROMPTS[1]) + 40) + 64 + 9  # bounded: never past the threshold


@pytest.mark.parametrize("seed", range(4))
def test_warping_keeps_the_tokens_hf_warpers_keep_including_ties_at_the_nucleus_edge(seed):
    """Temperature, top-k and top-p against transformers' warpers, on logits drawn from a coarse grid so that many
    tokens tie, also at the top-p edge (where a choice among equal logits must be made: the higher ids stay)."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from infer.sampling import warp_logits

    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 6, (8, 40), generator=g).float() / 2  # ~7 tokens per value
    for params in (
        SamplingParams(temperature=0.8, top_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=0.7, top_k=12, top_p=0.6),
    ):
        hf = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
        if params.top_k:
            hf = TopKLogitsWarper(params.top_k)(None, hf)
        if params.top_p < 1.0:
            hf = TopPLogitsWarper(params.top_p)(None, hf)
        ours = warp_logits(logits, params)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(hf)), params
        torch.testing.assert_close(ours.softmax(-1), hf.softmax(-1))
