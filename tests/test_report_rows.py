"""The report's rows, everything but timing, pinned: `eval.report.run_report` on the tiny chat target, compared
field by field with ``tests/data/report_rows.json``, which the report wrote before its steps were split into a plan
(reading, serving, sizing, candidates), the timing loop and the row building. Anything the split changes in what is
measured (a proposer, a setting, a prompt, a token count, an acceptance tally, the identity evidence) fails here.

Regenerate the file only when a change of the rows is meant::

    DRAFTERS_WRITE_GOLDEN=1 python -m pytest -q tests/test_report_rows.py -k golden

Timing decides nothing in these rows: the chain length and tree are fixed (``chain_from_cost_curve`` off), the target
is pinned to fp32 (greedy answers and T = 1 draws seeded per batch), and the HF rows at T > 0, which draw from torch's
global generator, keep only what does not depend on the draw.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from eval.report import ReportConfig, run_report
from models.eagle3 import Eagle3Drafter
from models.mtp import MTPDrafter
from models.target import TargetConfig, TargetModel, load_tokenizer
from tests.conftest import ROOT

GOLDEN = ROOT / "tests" / "data" / "report_rows.json"
FIELDS = (
    "proposer",
    "setting",
    "category",
    "temperature",
    "batch_size",
    "tau",
    "alpha",
    "accepted_at_depth",
    "attempted_at_depth",
    "verify_steps",
    "new_tokens",
    "vanilla_new_tokens",
    "greedy_identical",
    "prompts",
    "lossy",
    "max_new_tokens",
    "evidence",
)
"""What the golden file keeps of each row (``evidence``: `evidence_words` of the row)."""
QUESTIONS = [
    {"question_id": "w1", "category": "writing", "turns": ["Write a short note about the sea."]},
    {"question_id": "w2", "category": "writing", "turns": ["Describe a quiet morning.", "Now make it shorter."]},
    {"question_id": "c1", "category": "coding", "turns": ["def add(a, b):\n    return a + b\nExplain this function."]},
]
"""Two categories (rows for all prompts and for each), one question with two turns."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


def report_rows(root: Path, out: Path) -> list[dict]:
    """The report of a seeded EAGLE-3 drafter (chain and EAGLE-2 tree) beside an MTP one, the undistilled cut as a
    draft model and HF's assisted peers, on `QUESTIONS` at T 0 and 1 (batch size 1): the rows' kept
    fields (`FIELDS`)."""
    from eval.measure import evidence_words

    path = str(root / "target")
    target = TargetModel.from_config(TargetConfig(name_or_path=path, dtype="float32", device="cpu"))
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = CHAT_TEMPLATE  # the recipe fixture's tokenizer has none; the prompt file needs one
    (out / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=32, tokenizer=tokenizer)
    MTPDrafter.from_target(target, 1, tokenizer).save_pretrained(out / "mtp")
    cfg = ReportConfig(
        prompts_path=str(out / "questions.jsonl"),
        max_new_tokens=8,
        chain_k=2,
        chain_from_cost_curve=False,
        tree_top_k=2,
        tree_depth=2,
        tree_total_tokens=4,
        draft_model="cut",
        draft_model_layers=1,
        hf_assisted=True,
        compare=[str(out / "mtp")],
        batch_sizes=[1],
        temperatures=[0.0, 1.0],
    )
    torch.manual_seed(0)
    rows = run_report(target, drafter, tokenizer, cfg, out / "report", log=lambda msg: None)
    kept = []
    for r in rows:
        row = {k: r.get(k) for k in FIELDS if k != "evidence"} | {"evidence": evidence_words(r)}
        if r["tau"] is None and r["temperature"] > 0:  # HF sampling from torch's global generator
            row["new_tokens"] = None
        kept.append(row)
    return kept


def _same(got, want, where: str) -> None:
    if isinstance(want, float) and isinstance(got, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), where
    elif isinstance(want, list) and isinstance(got, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_report_rows_match_the_golden_file(tiny_recipe, tmp_path):
    rows = report_rows(tiny_recipe, tmp_path)
    if os.environ.get("DRAFTERS_WRITE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert [(r["proposer"], r["setting"], r["category"], r["temperature"], r["batch_size"]) for r in rows] == [
        (r["proposer"], r["setting"], r["category"], r["temperature"], r["batch_size"]) for r in golden
    ]
    for got, want in zip(rows, golden):
        where = f"{want['proposer']} / {want['setting']} [{want['category']}] T {want['temperature']} bs {want['batch_size']}"
        for key in FIELDS:
            _same(got[key], want[key], f"{where}: {key}")
