"""`drafters bench-train`: the recipe's own step, variants interleaved on the same batches and weights."""

from __future__ import annotations

import pytest

from tests.conftest import recipe_args
from train.bench_ttt import bench, parse_variants


def test_variants_read_the_same_batches_and_agree_on_the_loss(tiny_recipe, tmp_path, capsys):
    args = [
        *recipe_args(tiny_recipe, tmp_path / "unused"),
        "--batches",
        "2",
        "--variant",
        "dense",
        "drafter.ttt_attention=dense",
        "--variant",
        "flash",
        "drafter.ttt_attention=flash",
    ]
    dense, flash = bench(args)
    assert dense.tokens == flash.tokens > 0 and len(dense.per_batch) == len(flash.per_batch) == 2
    assert dense.seconds > 0 and flash.seconds > 0
    # fp32 (the test recipe pins it): the two attentions compute the same loss, step after step
    for a, b in zip(dense.losses, flash.losses, strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    printed = capsys.readouterr().out
    assert "dense:" in printed and "flash:" in printed and "tokens/s" in printed


def test_variants_may_differ_in_the_drafter_only():
    assert parse_variants([["a"], ["b", "drafter.ttt_steps=2"]]) == {"a": [], "b": ["drafter.ttt_steps=2"]}
    with pytest.raises(SystemExit, match="only drafter"):
        parse_variants([["a", "train.lr=1"]])
    with pytest.raises(SystemExit, match="twice"):
        parse_variants([["a"], ["a"]])
