"""The automatic precision choices, and the bf16 paths they lead to, on every machine.

A CPU with fast bf16 (avx512_bf16 / AMX) makes ``target.dtype: fastest`` and ``train.mixed_precision: auto`` pick
bf16; one without picks fp32. ``$DRAFTERS_CPU_BF16=fast`` forces the first answer, so these tests run the bf16 target,
bf16 autocast, an engine under bf16 and the report's certificate in bf16 wherever the suite runs (tiny models keep it
cheap where bf16 is slow). Tests that compare numbers pin fp32 instead (tests/conftest.py `tiny_run_args`)."""

import json

import pytest
import torch

from models.target import CPU_BF16_ENV, TargetConfig, TargetModel, cpu_bf16_is_fast
from tests.conftest import recipe_args, run_to_end, tiny_llama
from tests.test_mtp_train import mtp_args
from train.optim import mixed_precision


def test_the_environment_forces_the_choice_and_refuses_nonsense(monkeypatch, tmp_path):
    never = lambda dtype: pytest.fail("a forced choice measures nothing")  # noqa: E731
    tiny_llama().save_pretrained(tmp_path)
    cfg = TargetConfig(name_or_path=str(tmp_path), dtype="fastest", device="cpu")
    for value, bf16 in (("fast", True), ("slow", False), ("FAST", True)):
        monkeypatch.setenv(CPU_BF16_ENV, value)
        assert cpu_bf16_is_fast("fpu avx2", timer=never) is bf16
        assert mixed_precision("auto") == ("bf16" if bf16 else "no") or torch.cuda.is_available()
        assert TargetModel.from_config(cfg).dtype == (torch.bfloat16 if bf16 else torch.float32)
    monkeypatch.setenv(CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match="DRAFTERS_CPU_BF16 must be 'fast', 'slow'"):
        cpu_bf16_is_fast()


def _automatic(args: list[str]) -> list[str]:
    """`tiny_run_args` with the pinned precision handed back to the automatic choice."""
    return [a for a in args if a not in ("target.dtype=float32", "train.mixed_precision=fp32")] + [
        "target.dtype=fastest",
        "train.mixed_precision=auto",
    ]


@pytest.mark.integration
def test_eagle3_recipe_where_the_automatic_choice_is_bf16(tiny_recipe, tmp_path, monkeypatch):
    """The whole EAGLE-3 recipe as a user with fast bf16 runs it: bf16 target and autocast, and a report whose T = 0
    rows carry the dtype-aware certificate: nothing unexplained, fp32 identity 1.0."""
    monkeypatch.setenv(CPU_BF16_ENV, "fast")  # a fresh process: accelerate's state is per process
    out = tmp_path / "bf16"
    printed = run_to_end("eagle3.py", _automatic(recipe_args(tiny_recipe, out, "train.max_steps=2")))
    assert "precision bf16" in printed
    rows = json.loads((out / "report.json").read_text())["results"]
    assert rows and all(r["dtype"] == "bfloat16" for r in rows)
    greedy = [r for r in rows if r["temperature"] == 0.0]
    # fp32 rounding (~1e-5 between row counts here) may still flip a near-tie of a random tiny model: explained then
    assert greedy and all(r["unexplained_divergences"] == 0 and r["greedy_identical_fp32"] is not None for r in greedy)
    assert all(r["explained_divergences"] == len(r["divergences"]) for r in greedy)


@pytest.mark.integration
def test_an_engine_under_bf16_autocast(tiny_recipe, tmp_path, monkeypatch):
    """MTP on two CPU ranks under ZeRO-2 with the automatic choices forced to bf16: it trains (finite losses) and
    its one-file checkpoint loads for the bf16 target."""
    from models.mtp import MTPDrafter

    monkeypatch.setenv(CPU_BF16_ENV, "fast")  # run_entry passes the environment to every rank
    out = tmp_path / "zero2"
    args = mtp_args(tiny_recipe, out, "train.max_steps=2", "train.batch_size=1", "report.enabled=false")
    run_to_end("mtp.py", _automatic(args), "zero2")
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses and all(torch.isfinite(torch.tensor(x)) for x in losses)
    target = TargetModel.from_config(TargetConfig(name_or_path=str(tiny_recipe / "target"), dtype="fastest"))
    assert target.dtype == torch.bfloat16
    MTPDrafter.from_pretrained(out, target)
