"""scripts/estimate.py: parameter counts equal the modules this project builds; sizes move the right way."""

from __future__ import annotations

import json

import pytest
import yaml

from models.eagle3 import Eagle3Drafter
from models.medusa import MedusaDrafter
from models.mtp import MTPDrafter
from models.target import TargetModel
from scripts.estimate import SMOLLM2, Shape, estimate, load_recipe, main
from tests.conftest import ROOT, tiny_llama

RECIPES = ROOT / "recipes"


def trained(module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_llama(vocab=97, layers=3, hidden=32))


def shape_of(target: TargetModel) -> Shape:
    return Shape.of(target.config.to_dict())


def test_target_parameter_count_is_exact(target):
    assert shape_of(target).params == sum(p.numel() for p in target.parameters())


def test_drafter_parameter_counts_equal_the_built_modules(target):
    shape = shape_of(target)
    eagle = load_recipe(RECIPES / "smollm2-135m" / "eagle3.yaml")
    eagle["drafter"]["draft_vocab_size"] = 64
    built = Eagle3Drafter.from_target(target, draft_vocab_size=64)
    assert estimate(shape, eagle).trainable == trained(built)

    medusa = load_recipe(RECIPES / "smollm2-135m" / "medusa1.yaml")
    for shared in (True, False):
        medusa["heads"].update(shared_head=shared, num_heads=3, num_layers=2)
        built = MedusaDrafter.from_target(target, num_heads=3, num_layers=2, shared_head=shared)
        assert estimate(shape, medusa).trainable == trained(built)

    mtp = load_recipe(RECIPES / "smollm2-135m" / "mtp.yaml")
    assert estimate(shape, mtp).trainable == trained(MTPDrafter.from_target(target, num_modules=2))


def test_joint_lora_counts_the_adapters(target):
    shape = shape_of(target)
    recipe = load_recipe(RECIPES / "smollm2-135m" / "mtp-joint.yaml")
    recipe["target"]["lora_rank"] = 4
    lora = TargetModel(tiny_llama(vocab=97, layers=3, hidden=32), mode="joint", lora_rank=4)
    want = trained(lora) + trained(MTPDrafter.from_target(target, num_modules=2))
    assert estimate(shape, recipe).trainable == want


def test_sizes_move_with_the_recipe():
    shape = Shape.of(SMOLLM2)
    assert abs(shape.params - 134_515_008) < 1e3  # SmolLM2-135M's parameter count (tied head)
    recipe = load_recipe(RECIPES / "smollm2-135m" / "mtp.yaml")
    one, two = estimate(shape, recipe), None
    recipe["mtp"]["num_modules"] = 3
    two = estimate(shape, recipe)
    assert two.trainable == 3 * one.trainable // 2 and two.flops_per_token > one.flops_per_token
    assert one.cache_bytes_per_token is None  # MTP trains online only
    recipe["data"]["max_length"] *= 2
    assert sum(estimate(shape, recipe).memory.values()) > sum(two.memory.values())
    eagle = load_recipe(RECIPES / "smollm2-135m" / "eagle3.yaml")
    assert estimate(shape, eagle).cache_bytes_per_token == (3 * 576 + 576) * 2  # bf16 taps + final hidden


def test_cli_prints_memory_cache_and_throughput(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                **SMOLLM2,
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
                "tie_word_embeddings": False,
            }
        )
    )
    main(["--target", str(config), "--recipe", str(RECIPES / "llama3.1-8b" / "eagle3.yaml"), "--tokens", "270e6"])
    out = capsys.readouterr().out
    assert "target: 8.03 B parameters" in out and "GB of 80" in out and "TB for one epoch" in out
    main(
        [
            "--target",
            str(config),
            "--recipe",
            str(RECIPES / "llama3.1-8b" / "mtp.yaml"),
            "--tokens",
            "1e6",
            "--calibrate",
            "300",
            "--calibrate-recipe",
            str(RECIPES / "smollm2-135m" / "mtp.yaml"),
        ]
    )
    out = capsys.readouterr().out
    assert "calibrated: 300 tokens/s" in out and "not used by this method" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"target": {}, "data": {}, "train": {}}))
    with pytest.raises(SystemExit, match="no drafter / heads / mtp section"):
        main(["--target", str(config), "--recipe", str(bad)])
