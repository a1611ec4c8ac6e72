"""The reference target builder (tiny preset, integration) and the shipped reference models."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import REFERENCE_DRAFT, REFERENCE_TARGET, ROOT
from train.stdlib_corpus import distinct_ngram_ratio, is_heldout, split_files, stdlib_files


def test_split_is_deterministic_and_disjoint():
    files, skipped = stdlib_files()
    train, heldout = split_files(files)
    assert train and heldout and set(skipped) == {"not_utf8", "too_large", "empty"}
    assert not {f.relpath for f in train} & {f.relpath for f in heldout}
    assert [f.relpath for f in files] == sorted(f.relpath for f in files)
    assert all(is_heldout(f.relpath) for f in heldout)
    assert 0.01 < len(heldout) / len(files) < 0.06


def test_distinct_ngram_ratio():
    assert distinct_ngram_ratio([1, 2, 3, 4, 5, 6]) == 1.0
    assert distinct_ngram_ratio([1, 2] * 20) == pytest.approx(2 / 37)


@pytest.mark.integration
def test_tiny_build_trains_resumes_and_loads(tmp_path):
    out = tmp_path / "tiny"
    cmd = [sys.executable, str(ROOT / "scripts" / "build_reference_target.py"), "--preset", "tiny", "--out", str(out)]
    first = subprocess.run(cmd + ["--max-steps", "20", "--save-every", "10"], capture_output=True, text=True, cwd=ROOT)
    assert first.returncode == 0, first.stderr[-2000:]
    assert json.loads((out / "work" / "state" / "step.json").read_text()) == {"step": 20}
    second = subprocess.run(cmd + ["--max-steps", "40", "--save-every", "10"], capture_output=True, text=True, cwd=ROOT)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed at step 20" in second.stdout
    info = json.loads((out / "build_info.json").read_text())
    assert info["heldout_loss"] < info["heldout_loss_at_init"] - 0.5  # the tiny target learns
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (out / name).exists()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.num_hidden_layers == 2 and len(tok) == model.config.vocab_size
    assert next(model.parameters()).dtype == torch.bfloat16  # shipped weights are bf16


@pytest.mark.parametrize("path", [REFERENCE_TARGET, REFERENCE_DRAFT], ids=["target", "draft"])
def test_shipped_model_reproduces_recorded_heldout_loss(path):
    if not (path / "model.safetensors").exists():
        pytest.fail(f"{path} is not built; run scripts/build_reference_target.py (see README)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scripts.build_reference_target import heldout_loss, token_stream

    info = json.loads((path / "build_info.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template and tok.eos_token_id is not None and tok.bos_token_id is not None
    _, heldout = split_files(stdlib_files()[0])
    stream = token_stream(tok, [f.text for f in heldout])
    ev = info["heldout_eval"]
    loss = heldout_loss(model, np.asarray(stream), ev["seq_len"], ev["windows"])
    assert loss == pytest.approx(info["heldout_loss"], abs=2e-3)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
