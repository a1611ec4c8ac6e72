"""The reshaped prompts: every article, review group and German review asked again in shapes other than the text
tier's and the evaluation files' own, deterministically, and a clear error where a folder holds no material."""

import gzip
import json
from pathlib import Path

import pytest

from train.data import reshaped
from train.data.text_tier import EVAL_RAG, EVAL_RAG_QUESTIONS, EVAL_SUMMARIZE, EVAL_TRANSLATE, SUMMARIZE


def _row(rid: str, user: str) -> dict:
    return {"id": rid, "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "x"}]}


def _folder(tmp_path: Path) -> Path:
    rows = [_row(f"xsum-{i}", SUMMARIZE.format(article=f"Article number {i} about a storm.")) for i in range(3)]
    rows += [_row(f"multiemo-{i}", f"{reshaped.ENGLISH_PREFIX}French:\n\nEnglish review {i}.") for i in range(7)]
    rows += [_row(f"multiemo-de-{i}", f"{reshaped.GERMAN_PREFIX}\n\nDeutsche Bewertung {i}.") for i in range(4)]
    rows.append(_row("other", "Write a short news article that begins with this summary.\n\nSummary: s"))
    folder = tmp_path / "shards"
    folder.mkdir()
    with gzip.open(folder / "shard-0.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return folder


def test_every_item_is_asked_in_new_shapes_and_nothing_else(tmp_path):
    found = reshaped.material(reshaped.source_rows([_folder(tmp_path)]))
    assert {k: len(v) for k, v in found.items()} == {"article": 3, "english": 7, "german": 4}
    rows = reshaped.build(found, seed=0)
    families = [r["family"] for r in rows]
    # two shapes per article, two questions per group of three reviews (the seventh review is left over)
    assert families.count("summarization") == 6 and families.count("rag") == 4 and families.count("translation") == 4
    users = [r["messages"][0]["content"] for r in rows]
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)
    for i in range(3):  # one article's two prompts are two different shapes
        mine = [u for u in users if f"Article number {i} " in u]
        assert len(mine) == 2 and mine[0] != mine[1]
    rag = [u for u in users if "English review" in u]
    assert all(sum(f"English review {k}." in u for k in range(7)) == 3 for u in rag)
    # the evaluation files' wordings stay unseen
    eval_heads = [EVAL_SUMMARIZE, EVAL_TRANSLATE, EVAL_RAG]
    assert not any(h.split("{")[0].strip() in u for h in eval_heads for u in users)
    assert not any(q in u for q in EVAL_RAG_QUESTIONS for u in users)
    assert rows == reshaped.build(found, seed=0) and rows != reshaped.build(found, seed=1)


def test_a_folder_without_material_is_an_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.jsonl.gz"):
        list(reshaped.source_rows([empty]))
    out = tmp_path / "p.jsonl.gz"
    folder = tmp_path / "only-articles"
    folder.mkdir()
    with gzip.open(folder / "s.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps(_row("a", SUMMARIZE.format(article="A."))) + "\n")
    with pytest.raises(SystemExit, match="no english, german material"):
        reshaped.main(["--out", str(out), "--sources", str(folder)])
    assert not out.exists()
