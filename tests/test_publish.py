"""`drafters publish` (eval/publish.py): a hub-ready folder with its model card, and no push without a token."""

import json

import pytest
import yaml

from eval.publish import publish, push
from models.eagle3 import Eagle3Drafter

ROW = {
    "proposer": "eagle3", "setting": "chain 3", "category": "all", "temperature": 0.0, "batch_size": 1, "tau": 1.85,
    "speedup": 1.08, "greedy_identical": 0.75, "prompts": 4, "unexplained_divergences": 0, "lossy": False, "dtype": "bfloat16",
    "divergences": [{"explained": True}], "explained_divergences": 1, "greedy_identical_fp32": 1.0,
    "fp32_divergences": [],
}  # fmt: skip


def _checkpoint(tiny_target, tmp_path, rows, **drafter):
    ckpt = tmp_path / "ckpt"
    Eagle3Drafter.from_target(tiny_target, draft_vocab_size=16, **drafter).save_pretrained(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["drafters"]["target_name"] = "smollm2-135m-instruct"  # a reference target: the card names its hub id
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "report.json").write_text(
        json.dumps({"machine": "test CPU", "prompt_set": "6 questions", "created": "today", "results": rows})
    )
    (ckpt / "recipe.yaml").write_text(
        "data:\n  path: train/shipped_data/x/train.jsonl.gz\n  extra_paths: [train/shipped_data/y/answers]\n"
    )
    (ckpt / "train_log.jsonl").write_text(
        json.dumps({"step": 10, "loss": 2.5, "tokens_per_s": 250.0}) + "\n"
        + json.dumps({"step": 10, "loss": 2.4, "eval/acc": [0.5, 0.4]}) + "\n"
    )  # fmt: skip
    return ckpt


def test_publish_writes_every_engine_folder_and_a_card_of_exactly_the_folder(tiny_target, tmp_path, monkeypatch):
    ckpt = _checkpoint(tiny_target, tmp_path, [ROW])
    # a training run's leftover: publish writes every engine folder itself, so this one is replaced, not shipped
    (ckpt / "export-sglang").mkdir()
    (ckpt / "export-sglang" / "README.md").write_text("left by an older run")
    out = publish(ckpt, tmp_path / "published", target=tiny_target)
    for name in ("config.json", "model.safetensors", "recipe.yaml", "README.md"):
        assert (out / name).exists(), name
    for folder in ("export-sglang", "export-speculators"):  # both EAGLE-3 layouts, the checkpoint had one
        config = json.loads((out / folder / "config.json").read_text())
        assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in tiny_target.aux_layer_ids]
        assert (out / folder / "model.safetensors").exists()
    assert "left by an older run" not in (out / "export-sglang" / "README.md").read_text()
    # SGLang's keys are ours: the same bytes, kept once
    assert (out / "export-sglang" / "model.safetensors").is_symlink()
    assert not (out / "export-speculators" / "model.safetensors").is_symlink()  # its keys differ (layers.0.)

    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "drafters" and "eagle3" in front["tags"]
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and front["license"] == "apache-2.0"
    assert "datasets" not in front  # local data is described in the body, not named as a hub dataset
    assert "`train/shipped_data/x/train.jsonl.gz`, `train/shipped_data/y/answers`; their data cards" in card
    files = card.split("## Files\n\n", 1)[1].split("\n\n", 1)[0]
    listed = {line.split("`")[1].rstrip("/") for line in files.splitlines()}
    assert listed == {p.name for p in out.iterdir()}  # every file there, and nothing that is not
    assert "### `export-sglang/`" in card and "### `export-speculators/`" in card
    assert "--speculative-algorithm EAGLE3" in card and "Prompt set: 6 questions" in card
    assert "training log says why" not in card and "refused" not in card  # nothing was refused, so nothing says so
    evidence = "greedy identical 75 % in bf16, the 1 divergence within bf16 rounding; fp32 100 %"
    assert f"| 0 | all | eagle3 | chain 3 | 1.85 | 1.08x | {evidence} |" in card
    assert "held-out top-1 accuracy per draft depth 0.500, 0.400" in card and "250–250 training tokens/s" in card

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    said = []
    assert push(out, "someone/drafter", log=said.append) is False and "no Hugging Face token" in said[0]

    with pytest.raises(FileNotFoundError):  # not a drafters checkpoint: refused before anything is written
        publish(tmp_path / "export-less", tmp_path / "nothing", target=tiny_target)
    assert not (tmp_path / "nothing").exists()


def test_a_refused_layout_is_named_with_its_reason_and_card_rows_name_their_category(tiny_target, tmp_path):
    ckpt = _checkpoint(tiny_target, tmp_path, [], norm_before_fc=True)  # a norm the engines' format has no key for
    board = tmp_path / "leaderboard.json"
    chat = ROW | {"cell": "chat__T0__bs1", "source": "builtin:chat", "speedup": 1.2}
    code = ROW | {"cell": "code__T0__bs1", "source": "builtin:code", "speedup": 0.9}
    board.write_text(json.dumps({"target": "t", "machine": "m", "created": "now", "results": [chat, code]}))
    out = publish(ckpt, ckpt, leaderboard=board, target=tiny_target)  # in place: the checkpoint's own card
    assert not list(out.glob("export-*"))
    card = (out / "README.md").read_text()
    assert "- `export-sglang/` is not here: norm_before_fc drafters have no key" in card
    assert "- `export-speculators/` is not here:" in card
    assert (
        "| 0 | chat | eagle3 | chain 3 | 1.85 | 1.20x |" in card
        and "| 0 | code | eagle3 | chain 3 | 1.85 | 0.90x |" in card
    )
    assert "| all |" not in card


def test_layouts_left_out_are_named_in_the_card_and_an_unknown_one_is_refused(tiny_target, tmp_path):
    ckpt = _checkpoint(tiny_target, tmp_path, [ROW])
    out = publish(ckpt, tmp_path / "small", target=tiny_target, layouts=["export-speculators"])
    assert sorted(p.name for p in out.glob("export-*")) == ["export-speculators"]
    card = (out / "README.md").read_text()
    assert "### `export-speculators/`" in card and "### `export-sglang/`" not in card
    left = card.split("leaves out", 1)[1]
    assert "- `export-sglang/`:" in left and "writes every one" in left and "is not here" not in card
    with pytest.raises(ValueError, match="no such layout for this drafter: \\['export-trt'\\]"):
        publish(ckpt, out, target=tiny_target, layouts=["export-trt"])
    assert (out / "export-speculators" / "model.safetensors").exists()  # refused before anything was removed
