"""`drafters publish` (eval/publish.py): a hub-ready folder with its model card, and no push without a token."""

import json

import pytest
import yaml

from eval.publish import publish, push
from models.eagle3 import Eagle3Drafter

ROW = {
    "proposer": "eagle3", "setting": "chain 3", "category": "all", "temperature": 0.0, "batch_size": 1, "tau": 1.85,
    "speedup": 1.08, "greedy_identical": 1.0, "unexplained_divergences": 0, "lossy": False, "dtype": "bfloat16",
    "divergences": [{"explained": True}], "explained_divergences": 1, "greedy_identical_fp32": 1.0,
    "fp32_divergences": [],
}  # fmt: skip


def test_publish_writes_the_card_weights_and_exports_and_does_not_push_without_a_token(
    tiny_target, tmp_path, monkeypatch
):
    ckpt = tmp_path / "ckpt"
    Eagle3Drafter.from_target(tiny_target, draft_vocab_size=16).save_pretrained(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["drafters"]["target_name"] = "smollm2-135m-instruct"  # a reference target: the card names its hub id
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "report.json").write_text(
        json.dumps({"machine": "test CPU", "prompt_set": "6 questions", "created": "today", "results": [ROW]})
    )
    (ckpt / "recipe.yaml").write_text("data:\n  path: train/shipped_data/x/train.jsonl.gz\n")
    (ckpt / "train_log.jsonl").write_text(
        json.dumps({"step": 10, "loss": 2.5, "tokens_per_s": 250.0}) + "\n"
        + json.dumps({"step": 10, "loss": 2.4, "eval/acc": [0.5, 0.4]}) + "\n"
    )  # fmt: skip
    (ckpt / "export-sglang").mkdir()
    (ckpt / "export-sglang" / "README.md").write_text("SGLang: --speculative-algorithm EAGLE3")
    out = publish(ckpt, tmp_path / "published")
    for name in ("config.json", "model.safetensors", "recipe.yaml", "export-sglang/README.md", "README.md"):
        assert (out / name).exists(), name
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "drafters" and "eagle3" in front["tags"]
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and front["license"] == "apache-2.0"
    assert "datasets" not in front  # local data is described in the body, not named as a hub dataset
    evidence = "bf16 1.00 (1 diverged: 1 within bf16 rounding, 0 unexplained); fp32 1.00"
    assert f"| 0 | all | eagle3 | chain 3 | 1.85 | 1.08x | {evidence} |" in card
    assert "SGLang: --speculative-algorithm EAGLE3" in card and "Prompt set: 6 questions" in card
    assert "held-out top-1 accuracy per draft depth 0.500, 0.400" in card and "250–250 training tokens/s" in card

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    said = []
    assert push(out, "someone/drafter", log=said.append) is False and "no Hugging Face token" in said[0]

    with pytest.raises(FileNotFoundError):  # not a drafters checkpoint: refused before anything is written
        publish(tmp_path / "export-less", tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()
