"""Every turn of every evaluation prompt file the project ships shares no 13-word run with any training file
(the GPT-3 contamination convention), and the check that says so can fail."""

from pathlib import Path

import pytest

from train.data.text_tier import CONTAMINATION_N, contaminated, conversation_texts

ROOT = Path(__file__).resolve().parents[1]


def evaluation_turns() -> list[tuple[str, str]]:
    """(file:question_id, turn) for every turn of every Spec-Bench-format file in eval/prompts/."""
    import json

    turns = []
    for path in sorted((ROOT / "eval" / "prompts").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            turns += [(f"{path.name}:{row['question_id']}", t) for t in row["turns"]]
    return turns


def shipped_training_files() -> list[Path]:
    """Conversations the shipped recipes train on (held-out answers and request lists excluded: the request lists
    hold the held-out requests the evaluation files are made of)."""
    files = sorted((ROOT / "train" / "shipped_data").rglob("*.jsonl.gz"))
    return [p for p in files if "heldout" not in p.name and "heldout" not in p.parent.name]


def test_no_evaluation_turn_shares_a_13_gram_with_the_shipped_training_files():
    turns = evaluation_turns()
    files = shipped_training_files()
    assert len(turns) >= 100 and len(files) >= 12  # every file found: v1 train and the v2 answer shards
    hit = contaminated([t for _, t in turns], conversation_texts(files))
    assert not hit, [turns[i][0] for i in sorted(hit)]


@pytest.mark.skipif(not (ROOT / "outputs/text-tier/train").is_dir(), reason="text tier not built here")
def test_no_evaluation_turn_shares_a_13_gram_with_the_text_tier():
    turns = evaluation_turns()
    hit = contaminated(
        [t for _, t in turns], conversation_texts(sorted((ROOT / "outputs/text-tier/train").glob("*.gz")))
    )
    assert not hit, [turns[i][0] for i in sorted(hit)]


def test_the_check_flags_a_shared_13_gram_and_not_a_12_gram():
    turn = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    words = turn.split()
    assert contaminated([turn], iter(["prefix " + " ".join(words[1:14]) + " suffix"])) == {0}
    assert contaminated([turn], iter([" ".join(words[:12]), " ".join(words[2:14])])) == set()
    assert CONTAMINATION_N == 13
