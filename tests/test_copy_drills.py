"""Copy drills: every answer is a copy of text its prompt holds, the kinds come in turn, and the build is seeded."""

import gzip
import json
import random

from scripts.copy_probe import random_repeats
from train.data.copy_drills import KINDS, _opening, drills, passages


class _Tokenizer:
    """One id per word: the word's position in a growing list (shuffled passages need only encode and decode)."""

    def __init__(self) -> None:
        self.words: list[str] = []

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        ids = []
        for w in text.split(" "):
            if w not in self.words:
                self.words.append(w)
            ids.append(self.words.index(w))
        return {"input_ids": ids}

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


TEXTS = [
    f"Passage {i} opens here. It has a second sentence that runs long enough to be quoted from its start. And a third."
    for i in range(40)
]


def test_every_answer_is_copied_from_its_prompt_and_the_kinds_come_in_turn():
    rows = list(drills(TEXTS, _Tokenizer(), rows=16, seed=3))
    assert [r["kind"] for r in rows[: len(KINDS)]] == list(KINDS)
    for r in rows:
        user, answer = (m["content"] for m in r["messages"])
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert answer and answer in user
        if r["kind"] == "from":
            assert answer != user and not answer.startswith("Passage")  # a later sentence, not the whole passage
        if r["kind"] == "random":  # a passage's words in another order
            assert sorted(answer.split(" ")) in [sorted(t.split(" ")) for t in TEXTS] and answer not in TEXTS
    assert rows == list(drills(TEXTS, _Tokenizer(), rows=16, seed=3))
    assert rows != list(drills(TEXTS, _Tokenizer(), rows=16, seed=4))


def test_an_opening_quotes_a_later_sentence_or_none_when_there_is_none():
    opening, rest = _opening(TEXTS[0], random.Random(0))
    assert rest.startswith(opening) and TEXTS[0].endswith(rest) and rest != TEXTS[0]
    assert _opening("One short sentence without a follower.", random.Random(0)) is None


def test_passages_are_user_paragraphs_of_bounded_length_each_once(tmp_path):
    long_para, short_para = "x" * 200, "too short"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"{long_para}\n\n{short_para}"},
                {"role": "assistant", "content": "y" * 300},
            ]
        },
        {"messages": [{"role": "user", "content": long_para}]},
    ]
    folder = tmp_path / "answers"
    folder.mkdir()
    with gzip.open(folder / "shard-0.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    assert passages((folder,), min_chars=100, max_chars=250) == [long_para]


def test_random_repeats_give_a_passage_twice_and_score_the_second_copy():
    pool = [7, 11, 13, 17]
    for sequence, start in random_repeats(pool, n=3, length=10):
        assert sequence[:10] == sequence[10:] and start == 12
        assert set(sequence) <= set(pool)
