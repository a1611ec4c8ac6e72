"""The one config mechanism, and every shipped recipe loads and validates."""

import importlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from models.config import ConfigError, load_config, parse_cli, save_config, to_dict

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
# recipes/<target>/<method>.yaml → the config class of that method's entry script
METHOD_CONFIGS = {
    "eagle3": ("train.eagle3", "Eagle3RecipeConfig"),
    "draft_model": ("train.draft_model", "DraftModelRecipe"),
    "medusa1": ("train.medusa", "MedusaRecipeConfig"),
    "medusa2": ("train.medusa", "MedusaRecipeConfig"),
    "mtp": ("train.mtp", "MTPRecipeConfig"),
}


@dataclass
class Inner:
    lr: float = 1e-4
    """learning rate"""
    steps: int = 10
    """steps"""

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError("steps must be >= 1")


@dataclass
class Outer:
    name: str = "x"
    """a name"""
    ids: list[int] | None = None
    """optional ids"""
    mode: str = "frozen"
    """mode"""
    inner: Inner = field(default_factory=Inner)
    """nested section"""


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: base\ninner:\n  lr: 0.001\n")
    cfg = parse_cli(Outer, ["--config", str(path), "inner.steps=5", "ids=[1, 2, 3]", "inner.lr=2e-4"])
    assert cfg.name == "base" and cfg.inner.steps == 5 and cfg.inner.lr == 2e-4 and cfg.ids == [1, 2, 3]
    # ints widen to floats; the saved YAML loads back to the same config
    assert parse_cli(Outer, ["inner.lr=1"]).inner.lr == 1.0
    save_config(cfg, tmp_path / "saved.yaml")
    assert to_dict(load_config(Outer, tmp_path / "saved.yaml")) == to_dict(cfg)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inner.stpes=3"], "unknown key"),
        (["inner.steps=abc"], "expected an integer"),
        (["inner.steps=0"], "steps must be >= 1"),
        (["ids=[1, x]"], "expected an integer"),
        (["name"], "key=value"),
        (["--lr", "3"], "unknown flag"),
    ],
)
def test_bad_input_fails_with_a_clear_message(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_cli(Outer, argv)


def test_help_lists_every_setting_with_its_default_and_doc_and_exits(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_cli(Outer, ["inner.lr=1", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "  inner.lr = 0.0001  # learning rate" in out and "  inner.steps = 10  # steps" in out
    assert "  ids = None  # optional ids" in out and "--config FILE.yaml" in out


def _recipe_files():
    return sorted(p for p in RECIPES.rglob("*.yaml"))


@pytest.mark.parametrize("path", _recipe_files(), ids=lambda p: str(p.relative_to(RECIPES)))
def test_every_recipe_loads_and_validates(path):
    text = path.read_text()
    assert text.startswith("#"), "each recipe starts with a comment giving its launch command"
    rel = path.relative_to(RECIPES)
    if rel.parts[0] in ("accelerate", "deepspeed"):
        data = yaml.safe_load(text)
        assert isinstance(data, dict) and data, f"{rel} is empty"
        if rel.parts[0] == "accelerate":
            from accelerate.commands.config.config_args import load_config_from_file

            # what `accelerate launch --config_file` does; raises on unknown keys
            assert load_config_from_file(str(path)).num_processes >= 1
        return
    # recipes/<target>/<method>[-<variant>].yaml is validated by the entry script's own config class
    method = path.stem.split("-")[0]
    assert method in METHOD_CONFIGS, f"no config class registered for method {method!r}"
    module_name, class_name = METHOD_CONFIGS[method]
    cls = getattr(importlib.import_module(module_name), class_name)
    cfg = parse_cli(cls, ["--config", str(path)])
    assert isinstance(cfg, cls)


def test_recipes_exist():
    assert _recipe_files(), "no recipes shipped"


@pytest.mark.parametrize("path", sorted(RECIPES.glob("deepspeed/*.json")), ids=lambda p: p.name)
def test_every_deepspeed_config_is_launched_by_an_accelerate_config_and_builds(path):
    from accelerate.utils import DeepSpeedPlugin

    launchers = [p for p in RECIPES.glob("accelerate/*.yaml") if str(path.relative_to(RECIPES.parent)) in p.read_text()]
    assert launchers, f"no recipes/accelerate config launches {path.name}"
    plugin = DeepSpeedPlugin(hf_ds_config=str(path))
    assert plugin.zero_stage == int(path.stem.removeprefix("zero"))
    # batch sizes and clipping are the recipe's (train/distributed.py fills "auto"); ZeRO-3 must gather to save one file
    assert all(plugin.deepspeed_config[k] == "auto" for k in ("train_micro_batch_size_per_gpu", "gradient_clipping"))
    if plugin.zero_stage == 3:
        assert plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


class _Built(Exception):
    """Stops make_accelerator right after it has chosen the Accelerator's arguments."""


@pytest.mark.parametrize(("device", "cpu"), [("cpu", True), ("auto", False)])
def test_the_accelerator_follows_the_targets_device_where_cuda_exists(monkeypatch, tmp_path, device, cpu):
    # with CUDA present, a target put on the CPU must keep the batches there too (the training loop moves every
    # batch to the accelerator's device, and the target's embedding would then read CUDA indices)
    import train.distributed as distributed
    from models.target import TargetConfig
    from train.config import TrainConfig

    seen = {}

    def record(**kwargs):
        seen.update(kwargs)
        raise _Built

    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed, "Accelerator", record)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    tc = TrainConfig(output_dir=str(tmp_path), mixed_precision="fp32")
    with pytest.raises(_Built):
        distributed.make_accelerator(tc, target=TargetConfig(name_or_path="t", device=device, dtype="float32"))
    assert seen["cpu"] is cpu
