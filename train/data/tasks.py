"""Training requests for the task families users bring, built offline: steered self-written requests and templated
tasks over text every machine has.

A drafter accepts what it has seen the target do. Spec-Bench's six task families (multi-turn conversation, translation,
summarization, question answering, math reasoning, retrieval-augmented answers with the documents in the prompt),
plus chat and code, each get requests here (docs/decisions.md, "Breadth of training requests"):

- **steered Magpie** (``qa``, ``math_reasoning``, ``mt_bench``): the target writes a user request after its bare
  user header followed by a family's opener ("Who was", "A farmer", "Pretend you are", …), the way Magpie's authors
  steer it to a task; ``mt_bench`` requests always get a second turn (MT-bench's rewrite / constrain / continue
  follow-ups);
- **templated tasks over offline prose** (``summarization``, ``rag``, ``translation``): paragraphs of the Python
  documentation every interpreter ships (`pydoc_data.topics`, the reference manual as plain text) and of the
  train-split standard-library module docstrings, to summarise, to translate into another language, or to answer a
  question about among distractor documents;
- **derived tasks** (second pass, on the target's own first-pass answers): news-style articles the target wrote
  (``write`` requests over a topic list) become passages to summarise and retrieve from, and its translations into
  German / French / Spanish / Italian / Portuguese become texts to translate back into English, as in WMT's
  German-to-English;
- ``math_reasoning`` also gets GSM8K-style word problems from templates with random names and numbers.

Disjoint from evaluation: a request sharing any run of `SHINGLE` words with an evaluation prompt (every file under
``eval/prompts/`` and ``docs/reports/*.jsonl``) is dropped and counted; passages are split train / held-out by a
hash of their source, as the stdlib corpus is.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from eval.stdlib_corpus import split_files, stdlib_files

TASK_FAMILIES = ("chat", "code", "mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
"""The task families (not to be confused with drafter families, `infer.families`): Spec-Bench's six plus chat and
code. A row's ``kind`` is its task family, except the bare Magpie requests (``magpie``,
the chat family) and the first-pass ``article`` requests (chat-like writing whose answers seed summarization and
RAG)."""
TASK_FAMILY_OF_KIND = {"magpie": "chat", "article": "chat"}

OPENERS = {
    "qa": (
        "What is",
        "Who was",
        "When did",
        "Where is",
        "How many",
        "Why do",
        "Which",
        "What are",
        "How does",
        "Who invented",
        "What was the",
        "In which country",
        "How long",
        "What causes",
    ),
    "math_reasoning": (
        "A farmer",
        "Sarah has",
        "If a train",
        "Solve",
        "A store sells",
        "John buys",
        "A rectangle",
        "Tom is",
        "There are",
        "A recipe",
        "Lisa earns",
        "A car travels",
        "What is the sum",
        "A class of",
    ),
    "mt_bench": (
        "Write a",
        "Compose",
        "Pretend you are",
        "Imagine",
        "Describe",
        "Explain",
        "Give me",
        "Draft an email",
        "Create a",
        "Suggest",
        "Write a persuasive",
        "Extract",
        "Compare",
        "Act as",
    ),
}
"""Text that starts the user turn the target then completes (steered Magpie), per family."""

MT_FOLLOW_UPS = (
    "Now rewrite your answer so that a ten-year-old could understand it.",
    "Make your answer shorter, about three sentences, and add a title at the top.",
    "Rewrite your previous answer as a numbered list.",
    "Now do the same again, but in a more formal tone.",
    "Continue your answer with one more paragraph.",
    "Can you check your answer for mistakes and correct them?",
    "Now write it from the point of view of someone who disagrees.",
    "Summarize your previous answer in one sentence.",
)

SUMMARY_TEMPLATES = (
    "Summarize the following article in three sentences:\n\n{text}",
    "Write a short summary of the following text.\n\n{text}",
    "Summarize this passage in one paragraph:\n\n{text}",
    "What are the main points of the following text? Answer with a short list.\n\n{text}",
    "{text}\n\nSummarize the text above in two sentences.",
    "Give a one-sentence headline and a two-sentence summary of this article:\n\n{text}",
)
RAG_QUESTIONS = (
    "What does the documentation say about {title}?",
    "What is {title}, according to the documents?",
    "Which document talks about {title}, and what does it say?",
    "Using the documents, explain {title} in a few sentences.",
    "What are the key facts about {title} in these documents?",
)
RAG_ENDINGS = ("Answer using only the documents.", "Base your answer only on the documents above.")
LANGUAGES = ("German", "French", "Spanish", "Italian", "Portuguese")
TO_LANGUAGE = "Translate the following English text into {lang}:\n\n{text}"
FROM_LANGUAGE = "Translate the following {lang} text into English:\n\n{text}"

WRITE_TEMPLATES = (
    "Write a short news article about {topic} in {place}.",
    "Write a news report of about 200 words about {topic} in {place}.",
    "Write an informative article for a newspaper in {place} about {topic}.",
    "Write a short encyclopedia entry about {topic}.",
    "Write a blog post about {topic}, as seen by someone living in {place}.",
)
PLACES = (
    "a small coastal town",
    "Manchester",
    "a mountain village",
    "Toronto",
    "a farming region",
    "Melbourne",
    "a university town",
    "Cape Town",
    "an island community",
    "Denver",
    "a river city",
    "Dublin",
    "a desert town",
    "Singapore",
    "a lakeside village",
    "Glasgow",
    "a busy capital city",
    "Auckland",
    "a northern town",
    "Chicago",
)
TOPICS = (
    "a new city park opening",
    "a school science fair",
    "a storm that closed the roads",
    "a local bakery's anniversary",
    "a marathon in the city centre",
    "a museum exhibition of old maps",
    "a train line that reopened",
    "a volunteer beach clean-up",
    "a farmers' market moving to a new square",
    "a library that extended its hours",
    "a small company building electric bikes",
    "a hospital opening a new wing",
    "a drought affecting farmers",
    "a university discovering a new species of frog",
    "a town festival of music",
    "a bridge repair project",
    "a chess tournament for children",
    "a recycling programme in schools",
    "a solar farm on old farmland",
    "a zoo welcoming a baby elephant",
    "a film shot in a small village",
    "a heatwave and how people cope",
    "a new bus route for rural towns",
    "an astronomy club seeing a comet",
    "a flood warning system",
    "a football club's surprising win",
    "a cooking competition for students",
    "a ban on plastic bags",
    "a historic lighthouse being restored",
    "a rise in bicycle commuting",
    "the history of the printing press",
    "how vaccines are developed",
    "the water cycle",
    "coral reefs and why they matter",
    "the invention of the telephone",
    "volcanoes and how they form",
    "the Silk Road",
    "the life of honeybees",
    "how airplanes fly",
    "the Roman aqueducts",
)

SHINGLE = 8
"""Words in a run that may not appear both in a training request and in an evaluation prompt."""
HELDOUT_PERCENT = 5
PROSE_WORDS = (20, 220)


@dataclass(frozen=True)
class Passage:
    source: str
    title: str
    text: str


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def shingles(text: str, n: int = SHINGLE) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def evaluation_prompts(root: Path | None = None) -> list[str]:
    """Every user turn of every evaluation prompt file the project ships (Spec-Bench format jsonl). The other
    built-in categories are disjoint by construction: HumanEval stubs are never templated, and ``copy`` / ``long``
    use the stdlib corpus's held-out files, which `prose_passages` and the code tasks leave out."""
    root = root or Path(__file__).resolve().parents[2]
    texts = []
    for path in sorted([*root.glob("eval/prompts/*.jsonl"), *root.glob("docs/reports/*.jsonl")]):
        for line in path.read_text(encoding="utf-8").splitlines():
            texts += json.loads(line).get("turns", [])  # rows without turns (benchmark logs) are not prompts
    return texts


class Disjoint:
    """Drops (and counts) texts that share a `SHINGLE`-word run with any evaluation prompt."""

    def __init__(self, eval_texts: list[str]) -> None:
        self.banned = set().union(*(shingles(t) for t in eval_texts)) if eval_texts else set()
        self.dropped = 0

    def ok(self, text: str) -> bool:
        if shingles(text) & self.banned:
            self.dropped += 1
            return False
        return True


def _heldout(source: str) -> bool:
    return int.from_bytes(hashlib.sha256(source.encode()).digest()[:4], "little") % 100 < HELDOUT_PERCENT


def _prose(paragraph: str) -> str | None:
    """A paragraph of running prose (no code, grammar, tables, markup or URLs), whitespace collapsed, or None."""
    lines = paragraph.splitlines()
    if any(line.startswith(("  ", "\t", ">>>", "* ", "- ", "|", "+", "=", "#", "..")) for line in lines):
        return None  # indented code, bullet lists, tables, headings, reST directives
    text = " ".join(line.strip() for line in lines)
    if re.search(r"https?://|::=|\{|\}|\[\d|__\w+__|\w\(\)", text) or text.endswith("::"):
        return None
    n = len(text.split())
    letters = sum(c.isalpha() or c.isspace() for c in text) / max(1, len(text))
    if not PROSE_WORDS[0] <= n <= PROSE_WORDS[1] or letters < 0.9 or not text[0].isupper():
        return None
    return re.sub(r"\*+|\"", "", text)


def prose_passages(split: str = "train") -> list[Passage]:
    """Paragraphs of prose from the Python reference manual (`pydoc_data.topics`) and the standard library's module
    docstrings, in a fixed order, of one split (``train`` or ``heldout``, by a hash of the source)."""
    import pydoc_data.topics as topics

    out: list[Passage] = []
    for key in sorted(topics.topics):
        title = key.replace("-", " ")
        for i, para in enumerate(re.split(r"\n\s*\n", topics.topics[key])):
            text = _prose(para)
            if text:
                out.append(Passage(f"pydoc:{key}:{i}", title, text))
    files, _ = split_files(stdlib_files()[0])  # the stdlib corpus's held-out files are evaluation prompts
    for f in files:
        try:
            doc = ast.get_docstring(ast.parse(f.text)) or ""
        except SyntaxError:
            continue
        title = f.relpath.removesuffix(".py").replace("/", ".").removesuffix(".__init__") + " module"
        for i, para in enumerate(re.split(r"\n\s*\n", doc)):
            text = _prose(para)
            if text:
                out.append(Passage(f"stdlib:{f.relpath}:{i}", title, text))
    keep_heldout = split == "heldout"
    return [p for p in out if _heldout(p.source.rsplit(":", 1)[0]) == keep_heldout]


def _group(passages: list[Passage], rng: random.Random, words: tuple[int, int]) -> str:
    """Consecutive paragraphs of one source from a random start, up to ``words[1]`` words (at least ``words[0]``)."""
    for _ in range(20):
        i = rng.randrange(len(passages))
        src = passages[i].source.rsplit(":", 1)[0]
        parts, n = [], 0
        while i < len(passages) and passages[i].source.rsplit(":", 1)[0] == src:
            w = len(passages[i].text.split())
            if parts and n + w > words[1]:
                break
            parts.append(passages[i].text)
            n += w
            i += 1
        if n >= words[0]:
            return "\n\n".join(parts)
    return passages[rng.randrange(len(passages))].text


def summarization_tasks(passages: list[Passage], n: int, seed: int) -> list[dict]:
    rng = random.Random(seed * 7 + 1)
    return [
        {
            "id": f"summarization-{i}",
            "kind": "summarization",
            "turns": [SUMMARY_TEMPLATES[i % len(SUMMARY_TEMPLATES)].format(text=_group(passages, rng, (120, 420)))],
        }
        for i in range(n)
    ]


def rag_prompt(documents: list[str], question: str, ending: str) -> str:
    docs = "\n\n".join(f"Document {k + 1}: {d}" for k, d in enumerate(documents))
    return f"{docs}\n\nQuestion: {question}\n\n{ending}"


def rag_tasks(passages: list[Passage], n: int, seed: int, prefix: str = "rag") -> list[dict]:
    """A question about one passage's topic, asked over it and two distractors in random order."""
    rng = random.Random(seed * 7 + 2)
    tasks = []
    for i in range(n):
        gold, *others = rng.sample(passages, 3)
        docs = [gold.text, *(o.text for o in others)]
        rng.shuffle(docs)
        question = RAG_QUESTIONS[i % len(RAG_QUESTIONS)].format(title=gold.title)
        prompt = rag_prompt(docs, question, RAG_ENDINGS[i % len(RAG_ENDINGS)])
        tasks.append({"id": f"{prefix}-{i}", "kind": "rag", "turns": [prompt]})
    return tasks


def to_language_tasks(passages: list[Passage], n: int, seed: int) -> list[dict]:
    """English prose to translate into another language (first pass; the answers seed `from_language_tasks`)."""
    rng = random.Random(seed * 7 + 3)
    short = [p for p in passages if len(p.text.split()) <= 110] or passages
    return [
        {
            "id": f"translation-out-{i}",
            "kind": "translation",
            "lang": LANGUAGES[i % len(LANGUAGES)],
            "turns": [TO_LANGUAGE.format(lang=LANGUAGES[i % len(LANGUAGES)], text=rng.choice(short).text)],
        }
        for i in range(n)
    ]


def write_tasks(n: int, seed: int) -> list[dict]:
    """News-style articles for the target to write (first pass; the answers seed the derived summaries and RAG)."""
    rng = random.Random(seed * 7 + 4)
    return [
        {
            "id": f"write-{i}",
            "kind": "article",
            "topic": TOPICS[i % len(TOPICS)],
            "turns": [rng.choice(WRITE_TEMPLATES).format(topic=TOPICS[i % len(TOPICS)], place=rng.choice(PLACES))],
        }
        for i in range(n)
    ]


NAMES = ("Maria", "Ahmed", "Lena", "Kenji", "Olivia", "Pedro", "Aisha", "Tom", "Grace", "Ivan", "Nora", "Sam")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "flowers", "shells", "coins")
MATH_TEMPLATES = (
    "{a} has {x} {item}. {b} gives {a} {y} more, and then {a} gives away {z}. How many {item} does {a} have now?",
    "A shop sells {item} for ${p} each. {a} buys {x} of them and pays with a ${bill} bill. How much change does {a} "
    "get?",
    "{a} reads {x} pages every day. The book has {big} pages. After {y} days, how many pages are left to read?",
    "There are {x} rows of chairs with {y} chairs in each row. If {z} chairs are taken, how many chairs are free?",
    "{a} walks {x} kilometers on Monday and {y} kilometers on Tuesday. {b} walks twice as far as {a} in total. How "
    "far does {b} walk?",
    "A box holds {y} {item}. {a} has {big} {item}. How many full boxes can {a} fill, and how many {item} are left "
    "over?",
    "{a} earns ${p} an hour and works {x} hours a week. After {y} weeks, {a} spends ${z} on a gift. How much money "
    "is left?",
    "A train leaves at {h}:00 and travels for {x} hours and {m} minutes. At what time does it arrive?",
)


def math_tasks(n: int, seed: int) -> list[dict]:
    """GSM8K-style word problems with random names, items and numbers (the target solves them)."""
    rng = random.Random(seed * 7 + 5)
    tasks = []
    for i in range(n):
        a, b = rng.sample(NAMES, 2)
        values = dict(
            a=a,
            b=b,
            item=rng.choice(ITEMS),
            x=rng.randint(3, 40),
            y=rng.randint(2, 25),
            z=rng.randint(1, 12),
            p=rng.randint(2, 15),
            bill=rng.choice((50, 100)),
            big=rng.randint(120, 600),
            h=rng.randint(5, 14),
            m=rng.choice((10, 15, 20, 30, 45)),
        )
        text = MATH_TEMPLATES[i % len(MATH_TEMPLATES)].format(**values)
        tasks.append({"id": f"math-template-{i}", "kind": "math_reasoning", "turns": [text]})
    return tasks


def derived_tasks(first_pass: list[dict], seed: int, rag_share: float = 0.5) -> list[dict]:
    """Second-pass tasks from answered first-pass rows: each translation into another language becomes a text to
    translate back into English (when it is long enough and not a copy of its English source); each written article
    becomes a text to summarise, or, for ``rag_share`` of them, a gold document among two other articles."""
    rng = random.Random(seed * 7 + 6)
    out, articles = [], []
    for row in first_pass:
        answer = next((m["content"] for m in row["messages"] if m["role"] == "assistant"), "").strip()
        if len(answer.split()) < 20:
            continue
        if row["id"].startswith("translation-out-"):
            source = row["messages"][0]["content"].split("\n\n", 1)[-1]
            if len(shingles(answer, 4) & shingles(source, 4)) > 0.5 * max(1, len(shingles(answer, 4))):
                continue  # the target copied the English instead of translating
            out.append(
                {
                    "id": "translation-in-" + row["id"].removeprefix("translation-out-"),
                    "kind": "translation",
                    "turns": [FROM_LANGUAGE.format(lang=row["lang"], text=answer)],
                }
            )
        elif row["id"].startswith("write-"):
            articles.append((row["id"], row["topic"], answer))
    for k, (rid, topic, text) in enumerate(articles):
        if rng.random() < rag_share and len(articles) >= 3:
            others = [a[2] for a in rng.sample(articles, 3) if a[0] != rid][:2]
            docs = [text, *others]
            rng.shuffle(docs)
            question = RAG_QUESTIONS[k % len(RAG_QUESTIONS)].format(title=topic)
            prompt = rag_prompt(docs, question, RAG_ENDINGS[k % len(RAG_ENDINGS)])
            out.append({"id": "rag-" + rid, "kind": "rag", "turns": [prompt]})
        else:
            template = SUMMARY_TEMPLATES[k % len(SUMMARY_TEMPLATES)]
            out.append({"id": "summarization-" + rid, "kind": "summarization", "turns": [template.format(text=text)]})
    return out
