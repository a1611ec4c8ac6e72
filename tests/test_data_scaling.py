"""The data-scaling curve (`scripts/data_scaling.py`) of one tiny EAGLE-3 run with `train.snapshot_steps`: every
snapshot and the finished run's own checkpoint become a row, with the tokens each has read counted from the run's
seeded order, its held-out acceptance and its served τ on a Spec-Bench-format file."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

import train.eagle3 as recipe
from scripts import data_scaling
from tests.conftest import ROOT, recipe_args
from train.data.dataset import DataConfig, build_dataset

# one epoch of 12 samples in batches of 2: 6 optimizer steps, no max_steps (the run ends with its epoch)
RUN = ["self_distill.samples=0", "train.group_by_length=true", "report.enabled=false", "train.export=false"]


@pytest.mark.integration
def test_snapshots_and_the_finished_run_become_the_curves_rows(tiny_recipe, tmp_path):
    # the prompt file is decoded through the chat template; the tiny tokenizer has none, so give it a plain one
    target = tmp_path / "target"
    shutil.copytree(tiny_recipe / "target", target)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    tok.save_pretrained(target)
    data = tmp_path / "train12.jsonl"
    data.write_text("".join((tiny_recipe / "train.jsonl").read_text().splitlines(keepends=True)[:12]))
    out = tmp_path / "run"
    args = [*recipe_args(tiny_recipe, out, *RUN), f"target.name_or_path={target}", f"data.path={data}"]
    recipe.main([*args, "train.snapshot_steps=[2, 4, 6]"])  # 6: the last step, a snapshot too
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == ["step-2", "step-4", "step-6"]
    final, early = load_file(out / "model.safetensors"), load_file(out / "snapshots" / "step-2" / "model.safetensors")
    assert any(not early[k].equal(final[k]) for k in final)  # a snapshot is the weights of its step, not the end's

    prompts = tmp_path / "questions.jsonl"
    turns = [("qa", "def read the file and return its lines"), ("math", "import os\nimport sys\n")]
    rows = [{"question_id": f"q{i}", "category": c, "turns": [t]} for i, (c, t) in enumerate(turns)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = tmp_path / "curve"
    config = str(ROOT / "recipes" / "smollm2-135m" / "eagle3.yaml")
    overrides = [a for a in args[2:] if not a.startswith("report.")]  # the run's own settings, as the script takes them

    def measure(into, *extra):
        data_scaling.main(["--config", config, "--prompts", str(prompts), "--out", str(into), *overrides, *extra])

    small = ["--max-new-tokens", "8", "--chain", "2", "--heldout-samples", "4"]
    measure(curve, *small)

    measured = json.loads((curve / "curve.json").read_text())["rows"]
    answers = json.loads((curve / "curve.json").read_text())["meta"]["answers"]
    assert len(answers) == 2 and all(0 < len(a) <= 8 for a in answers)
    # the finished run is its last row, once, though its last step has a snapshot too
    assert [r["name"] for r in measured] == ["step-2", "step-4", "step-6"]
    assert measured[-1]["path"] == str(out)
    tokens = [r["tokens"] for r in measured]
    assert tokens[0] < tokens[1] < tokens[2]
    # the whole epoch read every sample once (12 = 6 batches of 2, nothing dropped), whatever the order
    train_set, _ = build_dataset(DataConfig(str(data), format="text", max_length=96), tok)
    assert len(train_set) == 12 and tokens[2] == sum(len(r["input_ids"]) for r in train_set)
    assert all(0 < r["loss_tokens"] <= r["tokens"] for r in measured)
    for r in measured:
        assert len(r["heldout_alpha"]) == 3 and all(0.0 <= a <= 1.0 for a in r["heldout_alpha"])
        assert r["served"]["tau"] >= 1.0 and len(r["served"]["alpha"]) == 2
        assert set(r["served"]["tau_by_category"]) == {"qa", "math"}
        counts = r["served"]["per_prompt"]  # what a paired comparison resamples: each prompt's own counts
        assert [p["id"] for p in counts] == ["q0", "q1"]
        assert sum(p["tokens"] for p in counts) / sum(p["forwards"] for p in counts) == r["served"]["tau"]
        assert sum(p["accepted1"] for p in counts) / sum(p["attempted1"] for p in counts) == r["served"]["alpha"][0]
        held = r["heldout_per_sample"]  # and each held-out sample's hits and positions per draft position
        assert len(held) == 4 and all(len(s) == 3 for s in held)
        for k, a in enumerate(r["heldout_alpha"]):
            assert sum(s[k][0] for s in held) / max(1, sum(s[k][1] for s in held)) == pytest.approx(a)
        # the same evaluation on the target's greedy answers to the two prompts: one sample per prompt, scored on
        # its answer tokens only
        unseen = r["unseen_per_sample"]
        assert len(unseen) == 2 and len(r["unseen_alpha"]) == 3
        for s, answer in zip(unseen, answers):
            assert 0 < s[0][1] <= len(answer) and 0 <= s[0][0] <= s[0][1]
        for k, a in enumerate(r["unseen_alpha"]):
            assert sum(s[k][0] for s in unseen) / max(1, sum(s[k][1] for s in unseen)) == pytest.approx(a)
        # and each answer's greedy chain replayed on those hits: every answer token once, at most a chain's worth of
        # drafts and the bonus token a round (the recipe's 3 TTT steps)
        assert [w[0] for w in r["unseen_walked"]] == [len(a) for a in answers]
        assert all(w[0] / 4 <= w[1] <= w[0] and w[2] <= w[1] for w in r["unseen_walked"])
        assert len(r["heldout_walked"]) == 4 and all(w[1] <= w[0] for w in r["heldout_walked"])
    header, _, *lines = (curve / "curve.md").read_text().splitlines()
    assert all(line.count("|") == header.count("|") for line in lines) and len(lines) == 3
    assert "held-out α3" in header and "served α2" in header and "served α3" not in header
    assert header.endswith("| held-out walked τ | unseen walked τ |")
    assert (curve / "curve.png").stat().st_size > 0

    # measured rows are kept: a second call measures nothing again and draws the same table
    table = (curve / "curve.md").read_text()
    measure(curve, *small)
    assert json.loads((curve / "curve.json").read_text())["rows"] == measured
    assert (curve / "curve.md").read_text() == table
    # a row stored without per-prompt or per-sample counts is measured again where its checkpoint is here, and kept
    # as it was where it is not; a baseline adds each row's paired gains over it
    stored = json.loads((curve / "curve.json").read_text())
    del stored["rows"][0]["served"]["per_prompt"]
    del stored["rows"][1]["heldout_per_sample"]
    del stored["rows"][2]["unseen_per_sample"]
    del stored["rows"][2]["heldout_walked"]
    gone = {**stored["rows"][1], "name": "deleted-run", "path": str(tmp_path / "nowhere")}
    stored["rows"].append(gone)
    (curve / "curve.json").write_text(json.dumps(stored))
    measure(curve, *small, "--baseline", "step-2")
    again = json.loads((curve / "curve.json").read_text())["rows"]
    assert sorted(r["name"] for r in again) == ["deleted-run", "step-2", "step-4", "step-6"]
    assert all(data_scaling.counted(r) for r in again if r["name"] != "deleted-run")
    assert next(r for r in again if r["name"] == "deleted-run") == gone
    # the answers are the stored ones, not decoded again: every row, old or new, is scored on the same text
    assert json.loads((curve / "curve.json").read_text())["meta"]["answers"] == answers
    header, _, *lines = (curve / "curve.md").read_text().splitlines()
    assert "held-out α1 over step-2 (95 %)" in header and "served τ over step-2 (95 %)" in header
    assert "unseen α1 over step-2 (95 %)" in header and "unseen walked τ over step-2 (95 %)" in header
    assert all(line.count("|") == header.count("|") for line in lines)
    with pytest.raises(SystemExit, match="--baseline nothing: no checkpoint of that name"):  # refused before measuring
        measure(tmp_path / "unmeasured", *small, "--baseline", "nothing")
    # the stored answers are to this file at 8 tokens: longer answers would not pair with them, so they are refused
    with pytest.raises(SystemExit, match="holds answers to 2 prompts of .* at 8 tokens: measure .* at 6 into another"):
        measure(curve, "--max-new-tokens", "6", "--chain", "2", "--heldout-samples", "4")
    assert not (tmp_path / "unmeasured" / "curve.json").exists()

    # a run that trained on other samples than the recipe's data gives (self-distilled ones, another file) is refused:
    # its snapshots' token counts would be wrong
    fewer = tmp_path / "train10.jsonl"
    fewer.write_text("".join(data.read_text().splitlines(keepends=True)[:10]))
    with pytest.raises(SystemExit, match="trained on 12 samples per epoch, the recipe's data gives 10 here"):
        measure(tmp_path / "other", f"data.path={fewer}")
    # an epoch covers whole global batches: read with another batch size, the same data covers 10 of its 12 samples
    with pytest.raises(SystemExit, match=r"gives 10 here \(12 samples, batch 5 x 1 ranks\)"):
        measure(tmp_path / "batch5", "train.batch_size=5")


def _row(
    name: str, counts: list[tuple[int, int, int, int]], held: list[tuple[int, int]], tokens: int | None = None
) -> dict:
    """A measured row with per-prompt (tokens, forwards, accepted1, attempted1) of prompts p0, p1, ... and per
    held-out sample (hits, positions) at the first draft position; its unseen α1 counts are twice each prompt's
    served first-draft counts (every answer position scored, where served α1 scores a round's first), its unseen
    walks the served counts (served on the answers' own text) and its held-out walks two tokens a round."""
    keys = ("tokens", "forwards", "accepted1", "attempted1")
    per_prompt = [{"id": f"p{i}", **dict(zip(keys, c))} for i, c in enumerate(counts)]
    tau = sum(c[0] for c in counts) / sum(c[1] for c in counts)
    served = {"tau": tau, "alpha": [0.5], "stopped_at_eos": 0, "per_prompt": per_prompt}
    alpha = sum(h for h, _ in held) / sum(n for _, n in held)
    per_sample = [[[h, n]] for h, n in held]
    return {
        "name": name,
        "tokens": tokens,
        "heldout_alpha": [alpha],
        "heldout_per_sample": per_sample,
        "served": served,
        "unseen_alpha": [sum(c[2] for c in counts) / sum(c[3] for c in counts)],
        "unseen_per_sample": [[[2 * c[2], 2 * c[3]]] for c in counts],
        "heldout_walked": [[2 * n, n, h] for h, n in held],
        "unseen_walked": [[c[0], c[1], c[2]] for c in counts],
    }


def test_the_table_gives_each_rows_gains_over_the_baseline_with_their_paired_intervals():
    # prompts of very different difficulty, every one answered 0.2 tokens a forward better: the gain is 0.2 in every
    # resampling, so its interval is that point (an unpaired comparison would spread it over the prompts' range);
    # held-out samples alike, each 1 hit in 10 better
    base_held = [(2, 10), (8, 10), (5, 10), (3, 10), (6, 10)]
    base = _row("shipped", [(12, 10, 2, 10), (30, 10, 8, 10), (20, 10, 5, 10), (14, 10, 3, 10)], base_held)
    better_held = [(h + 1, n) for h, n in base_held]
    better = _row(
        "step-10", [(14, 10, 3, 10), (32, 10, 9, 10), (22, 10, 6, 10), (16, 10, 4, 10)], better_held, tokens=1000
    )
    unknown = _row("step-5", [(1, 1, 0, 1)], [(1, 2)], tokens=500)
    del unknown["served"]["per_prompt"]  # its held-out samples are fewer than the baseline's: not paired either
    header, _, *lines = data_scaling.table([base, unknown, better], {"prompts": 4}, baseline="shipped").splitlines()
    assert header.endswith(
        "| held-out α1 over shipped (95 %) | served τ over shipped (95 %) | served α1 over shipped (95 %) "
        "| unseen α1 over shipped (95 %) | held-out walked τ over shipped (95 %) "
        "| unseen walked τ over shipped (95 %) |"
    )
    cells = {line.split(" | ")[0].strip("| "): line.split(" | ")[-6:] for line in lines}
    exact = ["+0.100 [+0.100, +0.100]", "+0.200 [+0.200, +0.200]", "+0.100 [+0.100, +0.100]"]
    # held-out walks of two tokens a round on both sides: no gain; the unseen walks gain what the served τ does
    walked = ["+0.000 [+0.000, +0.000]", "+0.200 [+0.200, +0.200] |"]
    assert cells["step-10"] == [*exact, "+0.100 [+0.100, +0.100]", *walked]
    # step-5's single prompt does not pair with the baseline's four, for unseen α1 as for the served figures
    assert cells["step-5"] == ["—"] * 5 + ["— |"] and cells["shipped"] == ["—"] * 5 + ["— |"]
    assert lines[0].split(" | ")[-10] == "0.45"  # the baseline's unseen α1 column: 18 of 40
    assert lines[0].split(" | ")[-8:-6] == ["2.00", "1.90"]  # its walked τ: held-out (100 / 50), unseen (76 / 40)
    with pytest.raises(SystemExit, match="--baseline nothing: no checkpoint of that name"):
        data_scaling.table([base, better], {"prompts": 4}, baseline="nothing")
    assert data_scaling._signed(-0.0001) == "+0.000" and data_scaling._signed(-0.021) == "-0.021"


def test_a_paired_gain_carried_by_one_prompt_has_an_interval_that_reaches_below_zero():
    from eval.rows import paired_ratio_gain

    base = [(20, 10)] * 8
    ours = [(60, 10)] + [(19, 10)] * 7  # one prompt far better, seven a little worse
    gain, low, high = paired_ratio_gain(ours, base)
    assert gain == pytest.approx(193 / 80 - 2)
    assert low == pytest.approx(-0.1) and high > gain  # a third of the resamplings miss the one prompt
    assert paired_ratio_gain(base, base) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same prompts on both sides: 8 against 7"):
        paired_ratio_gain(base, base[:7])


def test_a_curve_with_only_extra_checkpoints_is_tabled_and_not_drawn(tmp_path):
    row = {"name": "shipped", "path": "x", "step": None, "heldout_alpha": [0.6, 0.5], "served": {"tau": 1.6}}
    data_scaling.draw([row], tmp_path)
    assert not (tmp_path / "curve.png").exists()
    with_step = {**row, "name": "step-10", "step": 10, "tokens": 1000}
    data_scaling.draw([row, with_step], tmp_path)
    assert (tmp_path / "curve.png").exists()
