"""Regeneration: an existing chat dataset's assistant turns replaced by the target's own answers (``drafters
regenerate``, `scripts/regenerate.py`), so the drafter trains on the text it will be asked to draft."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import datasets

from models.target import TargetModel
from train.data.answerer import AnswerConfig, Job, answer, read_shards
from train.data.chat_render import render
from train.data.dataset import DataConfig, detect_format, load_raw, normalize_conversation
from train.data.files import read_shard, write_jsonl_atomic

SKIP_REASONS = (
    "missing_field",
    "unknown_role",
    "empty_conversation",
    "empty_assistant_turn",
    "no_assistant_turn",
    "template_error",
    "empty_generation",
    "prompt_too_long",
)
"""Why a row is not written (the summary counts every reason, zeros included)."""


def regenerate_dataset(
    model,
    tokenizer,
    cfg: DataConfig,
    out_path: str | Path,
    *,
    temperature: float = 0.0,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    limit: int | None = None,
    sample: int | None = None,
    seed: int = 0,
    show_progress: bool = True,
    exclude_ids: set[str] = frozenset(),
    stop_loops: int | None = None,
) -> dict:
    """Replace every assistant turn with the target's own answer; write a ``messages`` jsonl atomically.

    Turns are regenerated in order: turn k is generated from the original system/user turns and the
    *regenerated* turns < k. Prompts are batched with left padding. Generation stops at EOS or the
    template's end-of-turn token; special tokens are dropped from the decoded text so control tokens
    never leak into content. A turn that comes out empty, or whose prompt plus ``max_new_tokens``
    exceeds ``cfg.max_length``, ends the conversation before it (the row is kept when it still has a
    regenerated assistant turn, else skipped). Turns that hit ``max_new_tokens`` are kept (counted):
    the template will close them with an end-of-turn token the target did not emit.

    ``limit`` keeps the first rows, ``sample`` a random choice of that many (seeded by ``seed``; the answering takes
    them in that order, so a run stopped early still holds the dataset's mix). A row's scalar fields (a family, a
    source) travel to its output row; its ``id`` as ``source_id``. Rows whose ``id`` is in ``exclude_ids`` (answered
    by an earlier run: `answered_ids`) are dropped before the sample is drawn, and counted. ``stop_loops``: a turn
    ends once that many of its tokens are a loop (`train.data.answerer.AnswerConfig.stop_loops`), counted.

    Rows of prompts alone (user turns without answers, Spec-Bench ``turns`` or a ``prompt`` column) are answered.
    The answering is `train.data.answerer`'s (the project's KV-cached loop, length-bucketed batches): each finished
    batch is a shard under ``<out_path>.shards/``; a rerun with the same arguments answers only what no shard holds,
    and the output file appears (atomically, in input order) only when all rows are done, the shards then removed.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    raw = load_raw(cfg)
    if "messages" not in raw.column_names and "conversations" not in raw.column_names:
        raw = _prompt_rows_as_messages(raw)
    fmt = detect_format(raw.column_names, cfg.format)
    if fmt == "text":
        raise ValueError("regeneration needs chat data (messages, sharegpt, or prompt / turns rows), got raw text")
    if render(tokenizer, [{"role": "user", "content": "x"}], True) == render(
        tokenizer, [{"role": "user", "content": "x"}]
    ):
        raise ValueError("the chat template ignores add_generation_prompt; cannot prompt the target for a turn")
    if limit is not None and sample is not None:
        raise ValueError("give limit (the first rows) or sample (a random choice), not both")
    excluded = 0
    if exclude_ids:
        if "id" not in raw.column_names:
            raise ValueError("exclude_ids needs rows with an id column")
        keep = [i for i, rid in enumerate(raw["id"]) if str(rid) not in exclude_ids]
        excluded = len(raw) - len(keep)
        raw = raw.select(keep)
    if sample is not None:
        if sample < 1:
            raise ValueError(f"sample must be >= 1, got {sample}")
        raw = raw.shuffle(seed=seed).select(range(min(sample, len(raw))))
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    skipped = Counter({reason: 0 for reason in SKIP_REASONS})
    jobs = _jobs(raw, fmt, skipped)
    if not isinstance(model, TargetModel):
        model = TargetModel(model)
    out_path = Path(out_path)
    shards = out_path.with_name(out_path.name + ".shards")
    settings = AnswerConfig(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        batch_size=batch_size,
        max_length=cfg.max_length,
        seed=seed,
        stop_loops=stop_loops,
    )
    # one process answers all and writes the file (the shards still make it resumable)
    counts = answer(model, tokenizer, jobs, settings, shards, "regenerate", lambda m: None, show_progress, (0, 1))
    rows = read_shards(shards)
    written = [rows[j.id] for j in jobs if j.id in rows]
    for reason, name in (("empty_answer", "empty_generation"), ("prompt_too_long", None), ("template_error", None)):
        skipped[name or reason] += counts[f"no_answer_{reason}"]  # ended before any answer: the row is skipped
    cut_short = sum("ended" in row for row in written)
    write_jsonl_atomic([{k: v for k, v in row.items() if k not in ("id", "ended")} for row in written], out_path)
    shutil.rmtree(shards)
    return {
        "rows_read": len(raw),
        "rows_excluded": excluded,
        "rows_written": len(written),
        "turns_regenerated": counts["answers"],
        "turns_hit_max_new_tokens": counts["hit_max_new_tokens"],
        "turns_stopped_in_a_loop": counts["loop_stopped"],
        "rows_cut_short": cut_short,
        "skipped": dict(skipped),
        "tokens_per_s": counts["tokens_per_s"],
    }


def answered_ids(paths: list[str | Path]) -> set[str]:
    """The ``source_id`` of every row in these answered files (.jsonl or .jsonl.gz) or folders of them, searched
    recursively: the rows an earlier run already regenerated."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.name.endswith((".jsonl", ".jsonl.gz")))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no answered file or folder at {p}")
    return {str(row["source_id"]) for f in files for row in read_shard(f) if "source_id" in row}


def _jobs(raw: datasets.Dataset, fmt: str, skipped: Counter) -> list[Job]:
    """One job per conversation (its row number is its id), counting the rows that give none in ``skipped``: the
    system / user messages before each original assistant turn are a segment, and the target answers after each
    (turn k sees the regenerated turns < k); trailing turns without an answer are dropped."""
    conversations = []
    for row in raw:
        messages, reason = normalize_conversation(row, fmt, prompt_only=True)
        if messages is None:
            skipped[reason] += 1
        else:
            meta = {("source_id" if k == "id" else k): v for k, v in row.items() if isinstance(v, (str, int, float))}
            conversations.append((messages, meta))
    jobs = []
    for i, (messages, meta) in enumerate(conversations):
        segments, current = [], []
        for m in messages:
            if m["role"] == "assistant":
                segments.append(current)
                current = []
            else:
                current.append(m)
        if segments:
            jobs.append(Job(str(i), segments, meta=meta))
        else:
            skipped["no_assistant_turn"] += 1
    return jobs


def _prompt_rows_as_messages(raw: datasets.Dataset) -> datasets.Dataset:
    """Spec-Bench ``turns`` (user turns) or ``prompt`` rows → ``messages`` rows of user turns, for regeneration."""
    if "turns" in raw.column_names:
        key = "turns"
    elif "prompt" in raw.column_names:
        key = "prompt"
    else:
        return raw  # detect_format names what is missing

    def to_messages(value) -> dict:
        turns = value if isinstance(value, list) else [value]
        msgs = [{"role": "user", "content": t} for t in turns if isinstance(t, str)]
        # one answer slot after each user turn except the last (normalize_conversation adds that one)
        out = []
        for i, m in enumerate(msgs):
            out.append(m)
            if i + 1 < len(msgs):
                out.append({"role": "assistant", "content": "(to be regenerated)"})
        return {"messages": out}

    return raw.map(to_messages, input_columns=key, remove_columns=raw.column_names)
