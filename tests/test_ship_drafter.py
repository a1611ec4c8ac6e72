"""The notes `scripts/ship_drafter.py` writes beside a shipped drafter come from its training log alone."""

from __future__ import annotations

import json

from scripts.ship_drafter import notes


def test_the_notes_quote_the_logs_last_step_and_last_held_out_evaluation(tmp_path):
    info = {
        "method": "eagle3",
        "target_name": "tiny",
        "target_vocab_size": 97,
        "target_num_layers": 2,
        "tokenizer_fingerprint": "abc",
        "aux_layer_ids": [0, 1, 2],
        "aux_layer_convention": "after layer",
    }
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Eagle3Drafter"], "drafters": info}))
    log = [
        {"step": 10, "loss": 5.25, "acc": [0.5, 0.4]},
        {"step": 10, "eval/acc": [0.61, 0.52], "eval/simulated_tau": 1.93, "eval/walked_tau": 1.71},
        {"step": 20, "loss": 4.5, "acc": [0.6, 0.5]},
    ]
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    text = notes(tmp_path, "recipes/x.yaml", "a note", 2**20)
    assert "20 optimizer steps; last logged training loss 4.500, top-1 accuracy per draft depth [0.6, 0.5]." in text
    assert "at step 10: [0.61, 0.52], simulated τ 1.93, walked τ 1.71." in text
    assert text.endswith("- a note\n")
    # a log written before the walk was kept: the line stops at the simulated τ
    del log[1]["eval/walked_tau"]
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    assert "at step 10: [0.61, 0.52], simulated τ 1.93.\n" in notes(tmp_path, "recipes/x.yaml", "", 2**20)
