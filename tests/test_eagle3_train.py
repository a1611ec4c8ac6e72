"""EAGLE-3 training: loss masks, schedule, sharding, offline cache (default tier) and whole-recipe runs (integration).

The recipe runs build their own tiny target (2 x 32 Llama + a 300-token BPE trained on a few stdlib files) and call
the real entry script, in-process for one rank and through torchrun / accelerate launch for two.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train.eagle3 as recipe
from models.config import parse_cli
from tests.conftest import recipe_args, run_to_end
from train.losses import TTTTargets, copy_weights, lookup_hits, shift_left, ttt_loss, ttt_targets
from train.optim import warmup_cosine

ROOT = Path(__file__).resolve().parents[1]

RECIPES = sorted((ROOT / "recipes").glob("*/eagle3*.yaml"))


# ----------------------------------------------------------------------------------------- default tier
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_shipped_recipe_parses_and_names_its_launch_command(path):
    cfg = parse_cli(recipe.Eagle3RecipeConfig, ["--config", str(path)])
    assert cfg.drafter.ttt_steps >= 1 and cfg.train.output_dir
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and "train/eagle3.py" in first


def test_recipes_exist_for_smollm2_and_8b_targets():
    assert {p.parent.name for p in RECIPES} >= {"smollm2-135m", "llama3.1-8b", "qwen3-8b"}


def test_epoch_batches_partition_each_global_batch_across_ranks():
    n, world, bs, per_epoch = 23, 2, 3, 23 // 6
    for epoch in range(2):
        seen = []
        for g in range(per_epoch):
            micro = epoch * per_epoch + g
            parts = [recipe.epoch_batch(n, micro, per_epoch, 7, r, world, bs) for r in range(world)]
            assert all(len(p) == bs for p in parts)
            seen += parts[0] + parts[1]
        assert len(set(seen)) == len(seen) == per_epoch * world * bs
    # deterministic (resume replays the same order) and different per epoch
    assert recipe.epoch_batch(n, 1, per_epoch, 7, 0, world, bs) == recipe.epoch_batch(n, 1, per_epoch, 7, 0, world, bs)
    assert recipe.epoch_batch(n, 0, per_epoch, 7, 0, world, bs) != recipe.epoch_batch(
        n, per_epoch, per_epoch, 7, 0, world, bs
    )


def test_held_out_hits_are_kept_per_sample_in_the_order_each_rank_reads_them():
    from types import SimpleNamespace

    from train.config import TrainConfig
    from train.schedule import SampleHits, eval_shares

    tc = TrainConfig(output_dir="unused", batch_size=2, eval_samples=5)
    eval_set = list(range(9))  # only its length matters; the first 5 samples are evaluated
    ranks = [SimpleNamespace(process_index=r, num_processes=2, device="cpu") for r in range(2)]
    assert [eval_shares(a, tc, eval_set) for a in ranks] == [[[0, 2], [4]], [[1, 3]]]

    class OneRank(SimpleNamespace):
        def reduce(self, t, op):  # one process: the sum over ranks is its own table
            assert op == "sum"
            return t

    hits = SampleHits(OneRank(**vars(ranks[1])), tc, eval_set, depth=2)
    scored = torch.tensor([[True, True, False], [False, True, True]])  # sample 1 scores 2 places, sample 3 two
    hits.add([1, 3], 0, scored, torch.tensor([True, False, True, True]))  # row-major: 1 hit of 2, then 2 of 2
    hits.add([1, 3], 1, scored[:, 1:], torch.tensor([False, True, False]))  # 0 of 1, then 1 of 2
    table = hits.total()
    assert table[1] == [[1, 2], [0, 1]] and table[3] == [[2, 2], [1, 2]]
    assert table[0] == table[2] == table[4] == [[0, 0], [0, 0]]  # the other rank's samples: its own table's


def test_held_out_answers_are_walked_one_loss_span_at_a_time():
    """`answer_spans`: every run of loss tokens of one sample is an answer; a packed row's spans stop at their
    sample's end; an answer at a row's first place (nothing before it to draft from) is not decoded.
    `SampleHits.walk` replays each answer's chain on its own row's hits and sums them per sample."""
    from types import SimpleNamespace

    from models.acceptance import walked_chain
    from train.config import TrainConfig
    from train.losses import answer_spans
    from train.schedule import SampleHits

    loss = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0]])
    packed = torch.tensor([[1] * 12, [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]])
    spans = answer_spans(loss, packed)
    assert spans == [[(2, 5), (7, 11)], [(3, 6), (6, 9)]]
    assert answer_spans(loss) == [[(2, 5), (7, 11)], [(3, 9)]]  # unpacked: one answer
    acc = SimpleNamespace(process_index=0, num_processes=1, device="cpu", reduce=lambda t, op: t)
    hits = SampleHits(acc, TrainConfig(output_dir="unused", eval_samples=4), list(range(4)), depth=2)
    by_root = torch.rand(2, 2, 12, generator=torch.Generator().manual_seed(0)) < 0.6
    hits.walk([2, 0], by_root, spans)
    want = [
        [sum(walked_chain(by_root[:, b].tolist(), a, e, 2)[j] for a, e in spans[b]) for j in range(3)] for b in (0, 1)
    ]
    assert hits.walked() == [want[1], [0, 0, 0], want[0], [0, 0, 0]]
    assert want[0][0] == 7 and want[1][0] == 6  # every answer token is counted once


def test_served_path_weights_put_weight_where_the_chain_drafts():
    """`hits_by_root` moves step i's hits from the pair it is trained at to the round whose newest token follows
    it; `served_path_weights` weighs 1 the places the greedy chain's walk drafts from and ``off_path`` the others."""
    from train.losses import answer_spans, hits_by_root, served_path_weights

    # one row of 9 tokens, the answer at [3, 9); two steps, trained at pairs 1..6 (step 0) and 1..5 (step 1)
    masks = [torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 0]]).bool(), torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0, 0]]).bool()]
    #            pair:    1      2      3      4      5      6
    hits = [torch.tensor([True, False, False, True, True, False]), torch.tensor([True, True, False, False, True])]
    by_root = hits_by_root(masks, hits)
    assert by_root[0, 0].tolist() == [False, False, True, False, False, True, True, False, False]
    assert by_root[1, 0].tolist() == [False, False, True, True, False, False, True, False, False]
    # the walk from root 2: both drafts right (3 tokens), root 5: depth 1 right, depth 2 wrong (2 tokens), root 7: a
    # miss, root 8 would draft past the answer's end (its last token, 8, comes from root 7's bonus)
    spans = answer_spans(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]]))
    w = served_path_weights(masks, hits, spans, 0.25)
    # asked: step 0 at pairs 1, 4, 6; step 1 at pairs 1, 4 (roots 2 and 5 accepted their first draft)
    assert w[0].tolist() == [1.0, 0.25, 0.25, 1.0, 0.25, 1.0]
    assert w[1].tolist() == [1.0, 0.25, 0.25, 1.0, 0.25]
    assert all(torch.equal(x, torch.ones_like(x)) for x in served_path_weights(masks, hits, spans, 1.0))


def test_off_path_weight_weighs_the_trained_loss_by_the_walk_of_the_batchs_own_drafts(tiny_target):
    """`ttt_step` with ``drafter.off_path_weight``: the loss it backpropagates is the TTT loss weighted by
    `served_path_weights` of its own top-1 drafts, on a partly trained drafter (hits and misses, so the walk is not
    every place at depth 1 alone)."""
    from accelerate import Accelerator

    from infer.generate import generate_vanilla
    from infer.sampling import SamplingParams
    from models.eagle3 import Eagle3Drafter
    from tests.test_eagle3_proposer import PROMPTS, _overfit
    from train.features import target_signals
    from train.losses import answer_spans, served_path_weights

    prompt = PROMPTS[0]
    cont = generate_vanilla(tiny_target, [prompt], SamplingParams(max_new_tokens=24)).tokens[0]
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=97)
    _overfit(tiny_target, drafter, prompt + cont, ttt_steps=3, max_steps=25)
    ids = torch.tensor([prompt + cont])
    loss_mask = (torch.arange(ids.shape[1]) >= len(prompt)).long()[None]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    accelerator = Accelerator(cpu=True)
    plain = recipe.ttt_step(accelerator, drafter, tiny_target, batch, recipe.DrafterConfig(ttt_steps=3))
    dc = recipe.DrafterConfig(ttt_steps=3, off_path_weight=0.3)
    weighted = recipe.ttt_step(accelerator, drafter, tiny_target, batch, dc)
    # the same loss recomputed here from the same forward
    aux, last = target_signals(tiny_target, batch)
    allowed, positions, _ = recipe.attention_masks(batch)
    labels = recipe.ttt_targets(last, tiny_target.lm_head, loss_mask, drafter.t2d, 3)
    with torch.no_grad():
        logits = drafter(aux, ids, positions, allowed, 3, labels.masks)
    top1 = [lg.argmax(-1) == labels.top[i] for i, lg in enumerate(logits)]
    w = served_path_weights(labels.masks, top1, answer_spans(loss_mask), 0.3)
    assert any(bool((x == 1).any() and (x < 1).any()) for x in w)  # the walk splits the places
    expected = recipe.ttt_loss(logits, labels, dc.step_weight, w)
    torch.testing.assert_close(weighted.loss, expected.loss)
    assert not torch.allclose(weighted.loss, plain.loss)


def test_length_grouped_batches_are_disjoint_across_ranks_and_pad_less():
    """`train.group_by_length`: every epoch still gives each rank disjoint samples (the same sample count), the
    order replays on resume, and a batch's samples have similar lengths (less padding than the random order)."""
    from train.schedule import GROUP_MEGABATCH

    n, world, bs = 1000, 2, 4
    per_epoch = n // (world * bs)
    lengths = torch.randint(10, 900, (n,), generator=torch.Generator().manual_seed(0))

    def padded(order_lengths):
        return sum(max(b) * len(b) for b in order_lengths)

    for epoch in range(2):
        grouped, plain = [], []
        for g in range(per_epoch):
            micro = epoch * per_epoch + g
            parts = [recipe.epoch_batch(n, micro, per_epoch, 7, r, world, bs, lengths) for r in range(world)]
            assert not set(parts[0]) & set(parts[1]) and all(len(p) == bs for p in parts)
            grouped += parts
            plain += [recipe.epoch_batch(n, micro, per_epoch, 7, r, world, bs) for r in range(world)]
        flat = [i for p in grouped for i in p]
        assert len(set(flat)) == len(flat) == per_epoch * world * bs
        waste = padded([[int(lengths[i]) for i in b] for b in grouped]) / padded(
            [[int(lengths[i]) for i in b] for b in plain]
        )
        assert waste < 0.75  # uniform lengths: grouping within 50 global batches leaves far less padding
    again = recipe.epoch_batch(n, 3, per_epoch, 7, 1, world, bs, lengths)
    assert again == recipe.epoch_batch(n, 3, per_epoch, 7, 1, world, bs, lengths) and GROUP_MEGABATCH == 50


def test_training_state_survives_an_interrupted_save(tmp_path):
    from accelerate import Accelerator

    from train.checkpoint import load_training_state, save_training_state

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 2))
    save_training_state(acc, tmp_path, {"step": 3})
    # interrupted between the two renames of the next save: the previous state exists only as state.old
    os.rename(tmp_path / "state", tmp_path / "state.old")
    with torch.no_grad():
        model.weight.zero_()
    assert load_training_state(acc, tmp_path) == {"step": 3}
    assert model.weight.abs().sum() > 0  # the weights came back from state.old
    save_training_state(acc, tmp_path, {"step": 4})
    # interrupted after its last rename, before removing state.old: the next save must still go through
    shutil.copytree(tmp_path / "state", tmp_path / "state.old")
    save_training_state(acc, tmp_path, {"step": 5})
    assert load_training_state(acc, tmp_path) == {"step": 5} and not (tmp_path / "state.old").exists()


def test_warmup_cosine_schedule():
    lrs = [warmup_cosine(s, 100, 10, 1e-3, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)


def _dense_loss(draft, target_logits, loss_mask, t2d, sample_ids=None, step_weight=0.8):
    """The TTT loss with the draft logits given at every position (as a test writes them) and the target's logits
    as its "hidden" state (an identity head)."""
    targets = ttt_targets(target_logits, lambda x: x, loss_mask, t2d, len(draft), sample_ids)
    return ttt_loss([d[m] for d, m in zip(draft, targets.masks)], targets, step_weight)


def test_ttt_loss_masks_shift_vocab_and_samples():
    V, T = 6, 6
    t2d = torch.tensor([True, True, False, True, True, True])
    target_logits = torch.zeros(1, T, V)
    target_logits[0, torch.arange(T), torch.tensor([1, 2, 3, 4, 5, 0])] = 10.0  # argmax per position
    draft = [torch.zeros(1, T, 5, requires_grad=True) for _ in range(2)]
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    res = _dense_loss(draft, target_logits, loss_mask, t2d)
    # step i at t: label = target position t+1+i (its argmax must be draftable: id 2 is not), token t+2+i < T
    assert res.step_count.tolist() == [3, 3]  # step 0: t = 1, 2, 3 (t = 0 labels id 2); step 1: t = 0, 1, 2
    sample_ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    res2 = _dense_loss(draft, target_logits, loss_mask, t2d, sample_ids)
    assert res2.step_count.tolist() == [1, 0]  # t and t+2+i in one sample: only step 0 at t = 3
    res.loss.backward()
    assert draft[0].grad is not None and draft[1].grad.abs().sum() > 0
    assert shift_left(torch.tensor([[1, 2, 3]]), 2).tolist() == [[3, 0, 0]]


def test_ttt_loss_weights_steps_by_point_eight():
    target_logits = torch.randn(1, 8, 4)
    t2d = torch.ones(4, dtype=torch.bool)
    draft = [torch.randn(1, 8, 4) for _ in range(3)]
    res = _dense_loss(draft, target_logits, torch.ones(1, 8), t2d, step_weight=0.8)
    expected = sum(0.8**i * loss for i, loss in enumerate(res.step_loss.tolist()))
    assert float(res.loss) == pytest.approx(expected, rel=1e-5)


def test_the_head_runs_only_where_a_label_is_read_and_the_loss_is_the_dense_one():
    """`ttt_targets` runs the target's head on the positions whose next token is trained, and the drafter's
    logits are computed at the trained positions only; loss, gradients and agreement equal a dense computation
    (softmax over every position, masked afterwards) written out here."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, V, steps = 2, 9, 5, 7, 3
    hidden = torch.randn(B, T, H, generator=gen)
    head = torch.randn(V, H, generator=gen)
    t2d = torch.tensor([True, True, False, True, True, False, True])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1, 0, 0]])
    sample_ids = torch.tensor([[0] * 9, [0, 0, 0, 0, 1, 1, 1, 1, 1]])
    rows_seen = []

    def target_head(x):
        rows_seen.append(x.shape[0])
        return x @ head.t()

    draft = [torch.randn(B, T, int(t2d.sum()), generator=gen, requires_grad=True) for _ in range(steps)]
    targets = ttt_targets(hidden, target_head, loss_mask, t2d, steps, sample_ids)
    res = ttt_loss([d[m] for d, m in zip(draft, targets.masks)], targets, 0.8)
    assert rows_seen == [int(shift_left(loss_mask, 1).sum())]  # 9 of 18 positions
    res.loss.backward()
    sparse_grads = [d.grad.clone() for d in draft]

    # dense reference
    for d in draft:
        d.grad = None
    logits = hidden @ head.t()
    target_draft, draftable = logits[..., t2d], t2d[logits.argmax(-1)]
    total, counts, correct = 0.0, [], []
    for i, d in enumerate(draft):
        mask = shift_left(loss_mask.bool(), 2 + i, False) & shift_left(draftable, 1 + i, False)
        mask &= shift_left(sample_ids, 2 + i, -1) == sample_ids
        labels = shift_left(target_draft, 1 + i).softmax(-1)
        per = -(labels * torch.log_softmax(d, -1)).sum(-1)
        total = total + 0.8**i * (per * mask).sum() / mask.sum().clamp(min=1)
        counts.append(int(mask.sum()))
        correct.append(int(((d.argmax(-1) == shift_left(target_draft.argmax(-1), 1 + i)) & mask).sum()))
    total.backward()
    assert res.step_count.tolist() == counts and res.step_correct.tolist() == correct and counts[0] > 0
    assert float(res.loss) == pytest.approx(float(total), rel=1e-6)
    for sparse, d in zip(sparse_grads, draft):
        torch.testing.assert_close(sparse, d.grad)


def test_offline_cache_round_trip_and_disk_refusal(tmp_path, tiny_target, monkeypatch):
    import datasets
    from accelerate import Accelerator

    from train import features

    rows = [{"input_ids": list(range(3, 3 + n)), "loss_mask": [1] * n} for n in (5, 9, 4)]
    ds = datasets.Dataset.from_list(rows)
    acc = Accelerator(cpu=True)
    features.write_feature_cache(acc, tiny_target, ds, tmp_path, "k1", "float32", batch_size=2, log=lambda m: None)
    assert features.cache_is_valid(tmp_path, "k1") and not features.cache_is_valid(tmp_path, "other")
    cache = features.FeatureCache(tmp_path)
    assert len(cache) == 3 and cache[1]["input_ids"].tolist() == rows[1]["input_ids"]
    out = tiny_target(torch.tensor([rows[1]["input_ids"]]))
    torch.testing.assert_close(cache[1]["aux_hidden"], out.aux_hidden[0], rtol=1e-5, atol=1e-5)
    batch = features.collate_features([cache[0], cache[1]], pad_id=0)
    aux, last_hidden = features.target_signals(tiny_target, batch)
    torch.testing.assert_close(tiny_target.lm_head(last_hidden[1]), out.logits[0], rtol=1e-4, atol=1e-4)
    assert aux.shape == (2, 9, out.aux_hidden.shape[-1])
    # the writer refuses before any compute when the disk lacks room
    monkeypatch.setattr(features.shutil, "disk_usage", lambda p: type("U", (), {"free": 10})())
    with pytest.raises(SystemExit, match="not enough disk"):
        features.write_feature_cache(acc, tiny_target, ds, tmp_path / "b", "k2", log=lambda m: None)
    assert not list((tmp_path / "b").glob("*.safetensors"))


def test_a_disk_that_fills_while_the_cache_is_written_leaves_no_cache_that_loads(tmp_path, tiny_target, monkeypatch):
    """ENOSPC on the second shard (the disk filled after the up-front check): a clear stop, the half shard removed,
    and the earlier cache in that folder (another key) no longer taken as valid; a rerun with room writes it whole."""
    import errno

    import datasets
    from accelerate import Accelerator

    from train import features

    ds = datasets.Dataset.from_list([{"input_ids": list(range(3, 3 + n)), "loss_mask": [1] * n} for n in (5, 9, 4)])
    acc = Accelerator(cpu=True)
    quiet = {"log": lambda m: None, "batch_size": 1, "shard_tokens": 1}  # one shard per sample
    features.write_feature_cache(acc, tiny_target, ds, tmp_path, "old", "float32", **quiet)
    real_save, calls = features.save_file, []

    def fills_up(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            open(path, "wb").write(b"half a shard")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(tensors, path)

    monkeypatch.setattr(features, "save_file", fills_up)
    with pytest.raises(SystemExit, match=r"disk filled while writing the feature cache .* shard 1 of rank 0 failed"):
        features.write_feature_cache(acc, tiny_target, ds, tmp_path, "new", "float32", **quiet)
    assert not Path(calls[1]).exists()
    assert not features.cache_is_valid(tmp_path, "new") and not features.cache_is_valid(tmp_path, "old")
    monkeypatch.setattr(features, "save_file", real_save)
    features.write_feature_cache(acc, tiny_target, ds, tmp_path, "new", "float32", **quiet)
    assert features.cache_is_valid(tmp_path, "new") and len(features.FeatureCache(tmp_path)) == 3


def test_self_distilled_rows_are_the_targets_greedy_continuations(tmp_path, tiny_target):
    import datasets

    from infer.generate import generate_vanilla
    from infer.sampling import SamplingParams
    from train.data.self_distill import SelfDistillConfig, load_self_distilled, write_self_distilled

    features = datasets.Features(
        {"input_ids": datasets.List(datasets.Value("int32")), "loss_mask": datasets.List(datasets.Value("int8"))}
    )
    rows = [{"input_ids": list(range(1 + i, 12 + i)), "loss_mask": [1] * 11} for i in range(5)]
    ds = datasets.Dataset.from_list(rows, features=features)
    cfg = SelfDistillConfig(samples=3, prompt_tokens=6, new_tokens=5, batch_size=2)
    write_self_distilled(tiny_target, ds, cfg, tmp_path / "sd.jsonl", pad_id=0, log=lambda m: None)
    out = load_self_distilled(tmp_path / "sd.jsonl", features, cache_dir=str(tmp_path / "cache"))
    assert len(out) == 3 and all(len(r) == 11 for r in out["input_ids"]) and all(all(m) for m in out["loss_mask"])
    for ids in out["input_ids"]:
        prompt = ids[:6]
        assert prompt in [r["input_ids"][:6] for r in rows]
        assert ids[6:] == generate_vanilla(tiny_target, [prompt], SamplingParams(max_new_tokens=5)).tokens[0]
    # more samples than prompts: one continuation per prompt, and the shortfall is said
    said: list[str] = []
    write_self_distilled(
        tiny_target,
        ds,
        SelfDistillConfig(samples=9, prompt_tokens=6, new_tokens=2),
        tmp_path / "b.jsonl",
        0,
        log=said.append,
    )
    assert len((tmp_path / "b.jsonl").read_text().splitlines()) == 5
    assert "asked for 9 samples, but only 5" in said[0]


# ------------------------------------------------------------------------------------ whole recipe runs
def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.integration
def test_recipe_trains_saves_exports_reports_and_resumes(tiny_recipe, tmp_path, capsys):
    out = tmp_path / "run"
    recipe.main(recipe_args(tiny_recipe, out, "train.max_steps=4"))
    printed = capsys.readouterr().out
    assert re.search(
        r"draft vocabulary: 128 of \d+ ids cover [\d.]+% of the training targets and [\d.]+% of the held-out", printed
    )
    assert re.search(r"measure: \d+ prompts x \d+ generate calls .* at most ~\d+ min", printed)  # said before it runs
    for name in (
        "config.json",
        "model.safetensors",
        "recipe.yaml",
        "draft_vocab.safetensors",
        "report.json",
        "report.md",
        "export-sglang/model.safetensors",
        "export-speculators/config.json",
        "state/step.json",
    ):
        assert (out / name).exists(), name
    log = read_log(out)
    assert log[0]["sharding"]["world"] == 1
    steps = [r for r in log if "step" in r]
    assert [r["step"] for r in steps] == [2, 4] and len(steps[-1]["acc"]) == 3 and "eval/simulated_tau" in steps[-1]
    report = json.loads((out / "report.json").read_text())
    rows = [r for r in report["results"] if r["proposer"] == "eagle3"]
    greedy = [r for r in rows if r["temperature"] == 0.0]
    # the sized chain, its neighbour lengths (predicted beside measured speedup) and the sized EAGLE-2 tree
    settings = {r["setting"] for r in greedy}
    assert sum(s.startswith("EAGLE-2") for s in settings) == 1 and 2 <= sum(s.startswith("chain") for s in settings)
    assert all(r["greedy_identical"] == 1.0 and r["unexplained_divergences"] == 0 for r in greedy)
    sizing = report["sizing"]["chains"]
    assert sum(e["chosen"] for e in sizing) == 1 and all(e["measured_speedup"] > 0 for e in sizing)
    assert report["vanilla_check"]["fastest_forward_ms"] > 0
    sampled = [r for r in rows if r["temperature"] == 1.0]  # the recipe also reports T = 1 (no identity check there)
    assert len(sampled) == len(greedy) and all(r["greedy_identical"] is None and r["tau"] >= 1.0 for r in sampled)
    block = json.loads((out / "config.json").read_text())["drafters"]  # held-out acceptance recorded at save
    assert len(block["heldout_acceptance"]) == 3 and block["heldout_samples"] == 4
    assert len((out / "self_distill.jsonl").read_text().splitlines()) == 6
    first = load_file(str(out / "model.safetensors"))

    # resume: the same command with more steps continues at step 4 and changes only trainable weights
    recipe.main(recipe_args(tiny_recipe, out, "train.max_steps=8", "report.enabled=false"))
    assert "resumed at step 4" in capsys.readouterr().out
    assert [r["step"] for r in read_log(out) if "step" in r] == [2, 4, 6, 8]
    second = load_file(str(out / "model.safetensors"))
    assert torch.equal(first["d2t"], second["d2t"]) and torch.equal(first["t2d"], second["t2d"])
    for k in ("fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight"):
        assert not torch.equal(first[k], second[k]), k
    from transformers import AutoModelForCausalLM

    target_embed = AutoModelForCausalLM.from_pretrained(tiny_recipe / "target").get_input_embeddings().weight
    state = load_file(str(out / "state" / "model.safetensors"))  # accelerate's resumable state holds every weight
    assert torch.equal(state["embed_tokens.weight"], target_embed)  # frozen: still the target's

    # report mode on the saved checkpoint, target taken from its drafters block
    recipe.main(
        [
            "report",
            "--drafter",
            str(out),
            "report.prompt_source=stdlib",
            "report.prompts=2",
            "report.max_new_tokens=8",
            "report.chain_k=2",
            "report.chain_from_cost_curve=false",
            "report.tree_total_tokens=0",
            "report.draft_model=null",
        ]
    )
    rows = json.loads((out / "report.json").read_text())["results"]
    assert [r["setting"] for r in rows] == ["chain 10", "chain 2", "chain 2 + lookup 10, alone at 3-gram matches"]
    assert rows[1]["greedy_identical"] == rows[2]["greedy_identical"] == 1.0


@pytest.mark.integration
def test_a_fine_tune_says_its_vocabulary_coverage_and_a_rebuilt_one_saves_and_resumes(tiny_recipe, tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    quiet = ("report.enabled=false", "train.export=false", "self_distill.samples=0")
    recipe.main(recipe_args(tiny_recipe, first, "train.max_steps=2", *quiet))
    capsys.readouterr()
    again = (f"drafter.init_from={first}", "drafter.rebuild_vocab=true", "drafter.draft_vocab_size=200", *quiet)
    recipe.main(recipe_args(tiny_recipe, second, "train.max_steps=2", *again))
    printed = capsys.readouterr().out
    assert re.search(
        r"over a rebuilt draft vocabulary\); its draft vocabulary of 128 ids covers [\d.]+% of the training targets",
        printed,
    )
    assert re.search(r"draft vocabulary: 200 of \d+ ids cover", printed)
    saved, vocab = load_file(str(second / "model.safetensors")), load_file(str(second / "draft_vocab.safetensors"))
    assert saved["lm_head.weight"].shape[0] == 200 and torch.equal(saved["d2t"], vocab["d2t"])
    recipe.main(recipe_args(tiny_recipe, second, "train.max_steps=4", *again))
    printed = capsys.readouterr().out
    assert "resumed at step 2" in printed and "draft vocabulary reused from" in printed
    assert torch.equal(load_file(str(second / "model.safetensors"))["t2d"], vocab["t2d"])
    # a plain fine-tune says how much of its new data the reused vocabulary covers
    recipe.main(recipe_args(tiny_recipe, tmp_path / "third", "train.max_steps=1", f"drafter.init_from={first}", *quiet))
    assert re.search(r"vocabulary reused\); its draft vocabulary of 128 ids covers [\d.]+%", capsys.readouterr().out)
    with pytest.raises(ValueError, match="needs drafter.init_from"):
        parse_cli(recipe.Eagle3RecipeConfig, recipe_args(tiny_recipe, tmp_path / "x", "drafter.rebuild_vocab=true"))


@pytest.mark.integration
def test_offline_features_match_online_losses(tiny_recipe, tmp_path):
    common = ("train.max_steps=2", "train.log_every=1", "report.enabled=false", "train.export=false")
    recipe.main(recipe_args(tiny_recipe, tmp_path / "online", *common))
    recipe.main(
        recipe_args(tiny_recipe, tmp_path / "offline", *common, "train.features=offline", "train.feature_dtype=float32")
    )
    assert (tmp_path / "offline" / "features" / "index.json").exists()
    online = [r for r in read_log(tmp_path / "online") if "step" in r]
    offline = [r for r in read_log(tmp_path / "offline") if "step" in r]
    # pinned: same init, same batches; cached fp32 features reproduce the online losses
    for a, b in zip(online, offline):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


@pytest.mark.integration
def test_copy_weight_reweights_the_loss_of_the_same_forward(tiny_recipe, tmp_path):
    common = ("train.max_steps=1", "train.log_every=1", "report.enabled=false", "train.export=false")
    recipe.main(recipe_args(tiny_recipe, tmp_path / "plain", *common))
    recipe.main(recipe_args(tiny_recipe, tmp_path / "copy", *common, "drafter.copy_weight=4.0"))
    (plain,) = [r for r in read_log(tmp_path / "plain") if "step" in r]
    (copy,) = [r for r in read_log(tmp_path / "copy") if "step" in r]
    assert copy["acc"] == plain["acc"]  # same init, same batch: the same drafts
    assert copy["loss"] != pytest.approx(plain["loss"], rel=1e-4)  # weighted otherwise


@pytest.mark.integration
def test_two_cpu_ranks_through_torchrun_train_on_disjoint_shards(tiny_recipe, tmp_path):
    """torchrun without accelerate's launcher (the engines' launches: tests/test_engines.py)."""
    out = tmp_path / "torchrun"
    args = recipe_args(tiny_recipe, out, "train.max_steps=2", "report.enabled=false", "train.export=false")
    run_to_end("eagle3.py", args, "torchrun")
    sharding = read_log(out)[0]["sharding"]
    assert sharding["world"] == 2 and "MULTI_CPU" in sharding["distributed_type"]
    assert sharding["distinct_over_ranks"] == sharding["total_over_ranks"] == 2 * sharding["samples_per_rank"]
    assert (out / "model.safetensors").exists()


@pytest.mark.integration
def test_draft_model_is_cut_from_the_target_and_distilled(tiny_recipe, tmp_path):
    """train/draft_model.py on the tiny target: the first layer plus norm and tied head; the layer and norm trained,
    the embedding (= head) still the target's; the folder loads as a plain causal LM and drafts losslessly."""
    from transformers import AutoModelForCausalLM

    from infer.generate import generate_speculative, generate_vanilla
    from infer.proposers import DraftModelProposer
    from infer.sampling import SamplingParams
    from models.target import TargetModel
    from train import draft_model

    out = tmp_path / "draft"
    draft_model.main(
        [
            "--config",
            str(ROOT / "recipes" / "smollm2-135m" / "draft_model.yaml"),
            f"target.name_or_path={tiny_recipe / 'target'}",
            "target.device=cpu",
            "target.dtype=float32",  # the weights are compared with the fp32 target's
            f"data.path={tiny_recipe / 'train.jsonl'}",
            "data.format=text",
            "data.max_length=64",
            f"data.cache_dir={tiny_recipe / 'hf-cache'}",
            f"train.output_dir={out}",
            "train.layers=1",
            "train.steps=3",
            "train.batch_size=2",
            "train.log_every=1",
        ]
    )
    target = AutoModelForCausalLM.from_pretrained(tiny_recipe / "target")
    draft = AutoModelForCausalLM.from_pretrained(out)
    assert draft.config.num_hidden_layers == 1 and (out / "README.md").exists()
    t, d = target.state_dict(), draft.state_dict()
    assert torch.equal(d["model.embed_tokens.weight"], t["model.embed_tokens.weight"])
    assert torch.equal(d["lm_head.weight"], t["lm_head.weight"])  # the head stays the target's too
    assert not torch.equal(d["model.layers.0.mlp.up_proj.weight"], t["model.layers.0.mlp.up_proj.weight"])
    prompt, params = [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=12)
    wrapped = TargetModel(target)
    ref = generate_vanilla(wrapped, [prompt], params).tokens
    assert generate_speculative(wrapped, DraftModelProposer(draft, k=3), [prompt], params).tokens == ref


def test_lookup_hits_mark_the_tokens_a_two_then_one_gram_match_proposes():
    #        0  1  2  3  4  5  6  7  8
    ids = [[5, 6, 7, 5, 6, 7, 6, 9, 5]]
    hits = lookup_hits(torch.tensor(ids))
    # at 4 the 2-gram (7, 5) is new and the 1-gram 5 proposes 6 (from 0-1): a hit; at 5 (5, 6) proposes 7: a hit;
    # at 6 (6, 7) proposes 5 (from 1-3): a miss; at 7 (7, 6) is new and 6 proposes 7 (from 4-5): a miss;
    # at 8 nothing has followed 9
    assert hits[0].tolist() == [False, False, False, False, True, True, False, False, False]
    # a packed second sample sees nothing of the first
    packed = lookup_hits(torch.tensor([[5, 6, 7, 5, 6, 7]]), torch.tensor([[0, 0, 0, 1, 1, 1]]))
    assert packed[0].tolist() == [False] * 6


def test_copy_weights_read_the_token_each_step_predicts_and_ones_give_the_plain_loss():
    hits = torch.tensor([[False, False, True, False, True, False]])
    masks = [
        torch.tensor([[True, True, True, True, False, False]]),
        torch.tensor([[True, True, True, False, False, False]]),
    ]
    w = copy_weights(hits, masks, 3.0)
    assert w[0].tolist() == [3.0, 1.0, 3.0, 1.0]  # step 0 at t reads token t+2
    assert w[1].tolist() == [1.0, 3.0, 1.0]  # step 1 at t reads token t+3
    torch.manual_seed(0)
    logits = [torch.randn(4, 7), torch.randn(3, 7)]
    targets = TTTTargets(
        masks, [torch.randn(4, 7).softmax(-1), torch.randn(3, 7).softmax(-1)], [torch.zeros(4), torch.zeros(3)]
    )
    plain = ttt_loss(logits, targets)
    torch.testing.assert_close(
        ttt_loss(logits, targets, position_weights=copy_weights(hits, masks, 1.0)).loss, plain.loss
    )
    weighted = ttt_loss(logits, targets, step_weight=1.0, position_weights=w)
    ce0 = -(targets.labels[0] * logits[0].log_softmax(-1)).sum(-1)
    ce1 = -(targets.labels[1] * logits[1].log_softmax(-1)).sum(-1)
    torch.testing.assert_close(weighted.loss, (w[0] * ce0).sum() / w[0].sum() + (w[1] * ce1).sum() / w[1].sum())
