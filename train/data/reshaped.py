"""Prompts in other shapes over material the regenerated tier already holds, for the target to answer.

The text tier asks each family in one wording: an article is summarised "in one sentence", a German review is
translated after "Translate the following German text into English:", and RAG is disfl_qa's passages with a span
as the answer. A drafter that has read the target's answers to one wording per family meets other wordings when it
serves (a multi-sentence summary, questions over several reviews), and its acceptance there is what lags (the
summarization and translation families on the project's evaluation files). This module asks the same articles and
reviews again in several shapes, so the target's answers to them can be regenerated (`scripts/regenerate.py`):

- summarization: every article summarised again, in two shapes drawn from ``SUMMARY_SHAPES``;
- rag: the English reviews, three to a prompt, each group asked two questions of ``REVIEW_QUESTIONS`` in one of the
  ``REVIEW_LAYOUTS``;
- translation: every German review translated again, in a shape of ``TRANSLATE_SHAPES``.

The material comes only from shipped training rows (the text tier's `train` split), so nothing new can touch an
evaluation file; `tests/test_disjointness.py` checks the regenerated folder like every other. The evaluation files'
own wordings (`train.data.text_tier.EVAL_*`) are not among the shapes: they stay unseen.

    python -m train.data.reshaped --out outputs/reshaped/prompts.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from train.data.files import write_jsonl_gz

REGEN = Path("train/shipped_data/smollm2-135m-instruct-regen/answers")
DEFAULT_SOURCES = (REGEN / "summarization-qa", REGEN / "translation")

ARTICLE_PREFIX = "Summarize the following article in one sentence."
ENGLISH_PREFIX = "Translate the following English text into "
GERMAN_PREFIX = "Translate the following German text into English:"

SUMMARY_SHAPES = (
    "Write a summary of this article in three or four sentences.\n\n{article}",
    "What are the main points of the article below? List them briefly.\n\n{article}",
    "{article}\n\nSum up the article above in a short paragraph.",
    "Read this news report and explain in a few sentences what happened and why it matters.\n\n{article}",
    "Article:\n{article}\n\nWrite a headline for this article, then summarize it in two sentences.",
)
REVIEW_LAYOUTS = (
    "Here are some customer reviews.\n\n{documents}\n\nBased only on these reviews: {question}",
    "{documents}\n\nUsing the reviews above, answer the following. {question}",
    "Answer the question from the opinions below.\n\nQuestion: {question}\n\n{documents}",
)
REVIEW_LABELS = ("Review {k}: {text}", "Opinion {k}:\n{text}", "[{k}] {text}")
REVIEW_QUESTIONS = (
    "Which reviewer sounds the most satisfied, and why?",
    "Summarize what the reviewers liked and what they disliked.",
    "Do the reviews agree with each other? Explain briefly.",
    "What would you tell a friend who asks whether to go there, judging by these reviews?",
    "Name one complaint and one compliment that appear in the reviews.",
    "What is the overall tone of each review: positive, negative or mixed?",
)
TRANSLATE_SHAPES = (
    "Translate into English:\n\n{text}",
    "{text}\n\nTranslate the text above from German to English.",
    "What does this German text say? Give an English translation.\n\n{text}",
    "Render the following German passage in natural English.\n\n{text}",
)
REVIEWS_PER_PROMPT = 3


def source_rows(folders: list[Path]) -> Iterator[dict]:
    """Every row of every ``*.jsonl.gz`` shard under these folders, in a stable order."""
    for folder in folders:
        shards = sorted(folder.glob("*.jsonl.gz"))
        if not shards:
            raise FileNotFoundError(f"{folder}: no *.jsonl.gz shards")
        for shard in shards:
            with gzip.open(shard, "rt", encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        yield json.loads(line)


def material(rows: Iterator[dict]) -> dict[str, list[tuple[str, str]]]:
    """(source id, text) of the articles, English reviews and German reviews in these rows' first user turns."""
    out: dict[str, list[tuple[str, str]]] = {"article": [], "english": [], "german": []}
    for row in rows:
        head, _, body = row["messages"][0]["content"].partition("\n\n")
        rid = row.get("source_id") or row["id"]
        if not body.strip():
            continue
        if head == ARTICLE_PREFIX:
            out["article"].append((rid, body.strip()))
        elif head.startswith(ENGLISH_PREFIX):
            out["english"].append((rid, body.strip()))
        elif head == GERMAN_PREFIX:
            out["german"].append((rid, body.strip()))
    return out


def prompt_row(family: str, source: str, rid: str, user: str) -> dict:
    """A row of one user turn, answered by `scripts/regenerate.py` (rows of prompts alone are answered)."""
    return {"id": rid, "family": family, "source": source, "messages": [{"role": "user", "content": user}]}


def write_prompts(rows: list[dict], out: Path) -> None:
    """``rows`` of `prompt_row` into ``out`` (.jsonl.gz, its folder made), and their count per family and source
    printed: what every prompt builder over new material ends with."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl_gz(rows, out)
    counts = Counter((r["family"], r["source"]) for r in rows)
    print(json.dumps({f"{family} {source}": n for (family, source), n in sorted(counts.items())}, indent=2))
    print(f"wrote {len(rows)} prompts to {out}")


def build(found: dict[str, list[tuple[str, str]]], seed: int = 0) -> list[dict]:
    """The reshaped prompts, deterministic in ``seed``; shapes are drawn without repeats within one item."""
    rng = random.Random(seed)
    rows = []
    for rid, article in found["article"]:
        for k, shape in enumerate(rng.sample(SUMMARY_SHAPES, 2)):
            rows.append(prompt_row("summarization", "reshaped/xsum", f"{rid}-sum{k}", shape.format(article=article)))
    reviews = list(found["english"])
    rng.shuffle(reviews)
    for g in range(0, len(reviews) - REVIEWS_PER_PROMPT + 1, REVIEWS_PER_PROMPT):
        group = reviews[g : g + REVIEWS_PER_PROMPT]
        label = rng.choice(REVIEW_LABELS)
        documents = "\n\n".join(label.format(k=k + 1, text=text) for k, (_, text) in enumerate(group))
        for k, question in enumerate(rng.sample(REVIEW_QUESTIONS, 2)):
            user = rng.choice(REVIEW_LAYOUTS).format(documents=documents, question=question)
            rows.append(prompt_row("rag", "reshaped/multiemo", f"reviews-{group[0][0]}-q{k}", user))
    for rid, text in found["german"]:
        rows.append(
            prompt_row("translation", "reshaped/multiemo", f"{rid}-de", rng.choice(TRANSLATE_SHAPES).format(text=text))
        )
    rng.shuffle(rows)  # the answerer takes rows in order: a run stopped early still holds every family
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output .jsonl.gz of prompts")
    ap.add_argument("--sources", type=Path, nargs="+", default=list(DEFAULT_SOURCES), help="folders of shards")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    found = material(source_rows(args.sources))
    empty = [k for k, v in found.items() if not v]
    if empty:
        raise SystemExit(f"no {', '.join(empty)} material found in {[str(s) for s in args.sources]}")
    print(json.dumps({"material": {k: len(v) for k, v in found.items()}}))
    write_prompts(build(found, args.seed), args.out)


if __name__ == "__main__":
    main()
