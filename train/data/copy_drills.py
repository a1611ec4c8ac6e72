"""Copy drills: conversations whose answers copy from the prompt, for a drafter that never learned to.

The target copies: over random tokens followed by the same tokens again, its top-1 continues the copy 0.90 of the
time, and in its answers to translation and summarization prompts it often repeats the source word for word. The
EAGLE-3 shipped before the drills continued such a copy 0.05 of the time (`scripts/copy_probe.py --repeats`):
45 M tokens of ordinary conversations had not formed a copying head in its one layer, yet 75 steps over nothing but
repeated random tokens taught it (docs/decisions.md, "EAGLE-3 learns to copy from drills"). A drill makes copying most of the loss, so the gradient finds it.

Each row is a user turn that holds a passage and an answer that copies from it; the labels are not these answers but
the target's own distribution at every answer position (EAGLE-3 trains on the target's softmax), which over a copy
in progress is the copy's next token. Kinds (``KINDS``):

- ``repeat``: the passage asked back word for word, the answer is the passage;
- ``from``: the passage asked back from a quoted opening of one of its sentences, the answer is the rest of it;
- ``echo``: a request to translate or summarise the passage, answered by repeating it (what the target itself does
  with much of its translation work);
- ``random``: a passage's tokens in random order asked back: no language model can continue it except by copying,
  and its tokens are ordinary ones, which a reduced draft vocabulary can name (half of the drills).

Passages are paragraphs of the user turns of the shipped training folders, so nothing here can reach an evaluation
file (`tests/test_disjointness.py` checks this folder like every other).

    python -m train.data.copy_drills --out train/shipped_data/copy-drills/drills.jsonl.gz --rows 4000
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from train.data.files import read_shard, write_jsonl_gz

SHIPPED = Path("train/shipped_data")
DEFAULT_SOURCES = (
    SHIPPED / "smollm2-135m-instruct-regen/answers/translation",
    SHIPPED / "smollm2-135m-instruct-regen/answers/summarization-qa",
    SHIPPED / "smollm2-135m-instruct-regen/answers/wheel-documents",
    SHIPPED / "smollm2-135m-instruct-regen/answers/debian-reference",
)
KINDS = ("random", "repeat", "random", "from", "random", "echo")
"""The kinds in turn: half are random, where only copying is right."""

REPEAT_SHAPES = (
    "Repeat the following text exactly, without changing a word:\n\n{text}",
    "Copy this text:\n\n{text}",
    "{text}\n\nWrite the text above again, word for word.",
    "Please type out the following passage exactly as it is.\n\n{text}",
)
FROM_SHAPES = (
    'Copy the text below, starting from "{opening}".\n\n{text}',
    '{text}\n\nQuote the passage above from the words "{opening}" to its end.',
)
ECHO_SHAPES = (
    "Translate the following text into English:\n\n{text}",
    "Summarize the following text.\n\n{text}",
    "{text}\n\nRewrite the text above in clear English.",
    "Fix the spelling and grammar of this text:\n\n{text}",
)


def passages(sources: tuple[Path, ...], min_chars: int = 120, max_chars: int = 900) -> list[str]:
    """Paragraphs of the sources' user turns between ``min_chars`` and ``max_chars`` long, each once."""
    seen, out = set(), []
    for folder in sources:
        for shard in sorted(folder.glob("*.jsonl.gz")):
            for row in read_shard(shard):
                for m in row["messages"]:
                    if m["role"] != "user":
                        continue
                    for para in m["content"].split("\n\n"):
                        para = para.strip()
                        if min_chars <= len(para) <= max_chars and para not in seen:
                            seen.add(para)
                            out.append(para)
    return out


def _opening(text: str, rng: random.Random) -> tuple[str, str] | None:
    """(a quoted opening of one of the passage's later sentences, the passage from there on), or None."""
    starts = [i + 2 for i in range(len(text) - 2) if text[i] in ".!?" and text[i + 1] == " "]
    starts = [s for s in starts if len(text) - s >= 60]
    if not starts:
        return None
    s = rng.choice(starts)
    words = text[s:].split(" ")
    return " ".join(words[:4]), text[s:]


def shuffled_passage(text: str, tokenizer, rng: random.Random, max_tokens: int = 160) -> str:
    """The passage's tokens (at most ``max_tokens``) in random order, decoded: text no language model can continue
    except by copying it, made of ordinary tokens (ones a reduced draft vocabulary can name)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    rng.shuffle(ids)
    return tokenizer.decode(ids).replace("\n\n", "\n").strip()


def drills(texts: list[str], tokenizer, rows: int, seed: int = 0) -> Iterator[dict]:
    """``rows`` drills, the kinds in turn (``KINDS``), passages drawn without replacement while they last."""
    rng = random.Random(seed)
    order = rng.sample(range(len(texts)), len(texts))
    for i in range(rows):
        kind = KINDS[i % len(KINDS)]
        text = texts[order[i % len(order)]]
        if kind == "from" and (cut := _opening(text, rng)) is not None:
            opening, answer = cut
            user = rng.choice(FROM_SHAPES).format(opening=opening, text=text)
        elif kind == "echo":
            user, answer = rng.choice(ECHO_SHAPES).format(text=text), text
        elif kind == "random":
            text = shuffled_passage(text, tokenizer, rng)
            user, answer = rng.choice(REPEAT_SHAPES).format(text=text), text
        else:
            kind = "repeat"
            user, answer = rng.choice(REPEAT_SHAPES).format(text=text), text
        yield {
            "id": f"copy-{i}",
            "kind": kind,
            "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
        }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the .jsonl.gz to write")
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct")
    args = ap.parse_args(argv)
    from models.tokenizer import load_tokenizer

    texts = passages(DEFAULT_SOURCES)
    if not texts:
        raise SystemExit(f"no passages in {[str(s) for s in DEFAULT_SOURCES]}")
    rows = list(drills(texts, load_tokenizer(args.tokenizer), args.rows, args.seed))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl_gz(rows, args.out)
    kinds = Counter(r["kind"] for r in rows)
    print(
        f"{args.out}: {len(rows)} drills from {len(texts)} passages; " + ", ".join(f"{k} {n}" for k, n in kinds.items())
    )


if __name__ == "__main__":
    main()
