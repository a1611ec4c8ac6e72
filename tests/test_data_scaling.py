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
    header, _, *lines = (curve / "curve.md").read_text().splitlines()
    assert all(line.count("|") == header.count("|") for line in lines) and len(lines) == 3
    assert "held-out α3" in header and "served α2" in header and "served α3" not in header
    assert (curve / "curve.png").stat().st_size > 0

    # measured rows are kept: a second call measures nothing again and draws the same table
    table = (curve / "curve.md").read_text()
    measure(curve, *small)
    assert json.loads((curve / "curve.json").read_text())["rows"] == measured
    assert (curve / "curve.md").read_text() == table

    # a run that trained on other samples than the recipe's data gives (self-distilled ones, another file) is refused:
    # its snapshots' token counts would be wrong
    fewer = tmp_path / "train10.jsonl"
    fewer.write_text("".join(data.read_text().splitlines(keepends=True)[:10]))
    with pytest.raises(SystemExit, match="trained on 12 samples per epoch, the recipe's data gives 10 here"):
        measure(tmp_path / "other", f"data.path={fewer}")
    # an epoch covers whole global batches: read with another batch size, the same data covers 10 of its 12 samples
    with pytest.raises(SystemExit, match=r"gives 10 here \(12 samples, batch 5 x 1 ranks\)"):
        measure(tmp_path / "batch5", "train.batch_size=5")


def test_a_curve_with_only_extra_checkpoints_is_tabled_and_not_drawn(tmp_path):
    row = {"name": "shipped", "path": "x", "step": None, "heldout_alpha": [0.6, 0.5], "served": {"tau": 1.6}}
    data_scaling.draw([row], tmp_path)
    assert not (tmp_path / "curve.png").exists()
    with_step = {**row, "name": "step-10", "step": 10, "tokens": 1000}
    data_scaling.draw([row, with_step], tmp_path)
    assert (tmp_path / "curve.png").exists()
