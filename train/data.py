"""Training data: chat or raw text → ``input_ids`` + ``loss_mask``, with counted skips.

Formats (auto-detected by column): ShareGPT (``conversations``: list of ``{from, value}``), OpenAI
``messages`` (list of ``{role, content}``) and raw ``text``. Everything goes through one public entry,
:func:`build_dataset`, which returns the tokenised dataset and a summary of what was kept, truncated
and skipped (by reason). Rows are never repaired by guesswork: a row that cannot be masked exactly is
skipped and counted.

Loss-mask convention: ``loss_mask[t] == 1`` means token ``t`` is a training *target* (the logits at
``t - 1`` should predict it); the shift is the consumer's job. For chat rows the mask is 1 exactly on
the assistant contents plus the end-of-turn token the template writes right after them (the model must
learn to stop), and 0 on system/user turns and template text. For raw text every token is a target.

Finding the assistant spans: ``train.chat_render`` (the ``generation`` and ``diff`` methods, their limits).

Segment-wise tokenisation is also what the target sees at inference: the prompt (ending with the
generation prompt) is tokenised on its own and the model then emits the content tokens. A training
sequence therefore can differ from ``tokenizer(rendered_text)`` at span edges; decoding the masked
tokens of a turn gives back exactly its content and end-of-turn text.

Packing (opt-in): consecutive samples are concatenated into rows of at most ``max_length`` tokens
within map batches of 1000 samples; sample boundaries are kept in ``position_ids``, which restart at 0
for every sample. The first token of every packed sample gets ``loss_mask = 0`` (it would otherwise be
trained as a continuation of the previous sample); attention must stay inside a sample, see
:func:`packed_attention_mask`.

Caching: every step is a ``datasets`` map/filter over a dataset loaded through ``load_dataset``, so
results are fingerprinted (function code + arguments, tokenizer included) and a second run with the
same inputs reads the cache files instead of recomputing.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import jinja2
import torch

from train.chat_render import SpanError, diff_spans, generation_spans, has_generation_markers, render

FORMATS = ("auto", "sharegpt", "messages", "text")
SPAN_METHODS = ("auto", "generation", "diff")
SKIP_REASONS = (
    "missing_field",  # conversations/messages/text absent or not a list/str, a message without role or content
    "unknown_role",  # a role outside system/user/assistant (ShareGPT: system/human/user/gpt/assistant)
    "empty_conversation",
    "empty_assistant_turn",  # an assistant turn with no non-whitespace content
    "no_assistant_turn",
    "empty_text",  # raw text that is empty or whitespace
    "template_error",  # the chat template raised (e.g. roles must alternate)
    "span_not_found",  # diff method: prefix test failed or content not found in the rendering
    "over_length",  # truncation to max_length would remove every loss token
)
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
CHAT_ROLES = ("system", "user", "assistant")
_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".json.gz": "json", ".jsonl.gz": "json", ".parquet": "parquet"}
PACK_BATCH_SIZE = 1000


@dataclass
class DataConfig:
    path: str
    """Local .json/.jsonl(.gz)/.parquet file, a directory of such files (one kind), or a hub dataset name."""
    split: str = "train"
    """Split to read (for local files it only names the split the files are loaded into)."""
    format: str = "auto"
    """'sharegpt', 'messages', 'text', or 'auto' (by column: messages, then conversations, then text)."""
    max_length: int = 2048
    """Samples are truncated to this many tokens; a sample left with no loss token is skipped."""
    packing: bool = False
    """Concatenate samples into rows of at most max_length tokens (position_ids restart per sample)."""
    num_proc: int = 1
    """Worker processes for tokenisation (datasets.map)."""
    cache_dir: str | None = None
    """datasets cache directory (None: the datasets default, ~/.cache/huggingface/datasets)."""
    loss_on_all_tokens_for_text: bool = True
    """Raw text: every token is a target, BOS/EOS included; False leaves the added BOS/EOS out of the loss."""
    span_method: str = "auto"
    """How to find assistant spans: 'generation' (template markers), 'diff' (turn-by-turn rendering), or
    'auto' (generation when the template has {% generation %} markers, else diff)."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path must name a file, a directory or a hub dataset")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.span_method not in SPAN_METHODS:
            raise ValueError(f"span_method must be one of {SPAN_METHODS}, got {self.span_method!r}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if self.num_proc < 1:
            raise ValueError(f"num_proc must be >= 1, got {self.num_proc}")


# --------------------------------------------------------------------------- loading
def load_raw(cfg: DataConfig) -> datasets.Dataset:
    """The untokenised rows, through ``load_dataset`` (json/parquet builders for local paths)."""
    path = Path(cfg.path)
    if not path.exists():
        return datasets.load_dataset(cfg.path, split=cfg.split, cache_dir=cfg.cache_dir)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if _builder(p))
    builders = {_builder(p) for p in files}
    if len(builders) != 1 or None in builders:
        raise ValueError(f"{cfg.path}: expected .json/.jsonl(.gz) or .parquet files of one kind, found {files[:5]}")
    builder = builders.pop()
    parts = [
        datasets.load_dataset(builder, data_files={cfg.split: [str(p)]}, split=cfg.split, cache_dir=cfg.cache_dir)
        for p in files
    ]
    # shards written at different times may carry different extra columns (e.g. a later build's "topic"): one
    # load_dataset over all of them refuses to cast; keep the columns every file has, in the first file's order
    common = [c for c in parts[0].column_names if all(c in d.column_names for d in parts)]
    if len(parts) == 1:
        return parts[0]
    return datasets.concatenate_datasets([d.select_columns(common) for d in parts])


def _builder(path: Path) -> str | None:
    """The ``datasets`` builder of a local file by its suffix (``.jsonl.gz``: json, decompressed by datasets)."""
    return _LOCAL_BUILDERS.get("".join(path.suffixes[-2:])) or _LOCAL_BUILDERS.get(path.suffix)


def detect_format(columns: list[str], requested: str = "auto") -> str:
    if requested != "auto":
        required = {"sharegpt": "conversations", "messages": "messages", "text": "text"}[requested]
        if required not in columns:
            raise ValueError(f"format {requested!r} needs a {required!r} column; columns are {columns}")
        return requested
    for column, fmt in (("messages", "messages"), ("conversations", "sharegpt"), ("text", "text")):
        if column in columns:
            return fmt
    hint = ""
    if "prompt" in columns or "turns" in columns:
        hint = " (prompt-only rows are evaluation prompts: give them to the report as report.prompts_path)"
    raise ValueError(f"cannot detect the format: no messages/conversations/text column in {columns}{hint}")


def normalize_conversation(row: dict, fmt: str, prompt_only: bool = False) -> tuple[list[dict] | None, str]:
    """``(messages, "")`` with roles in system/user/assistant, or ``(None, skip_reason)``.

    Trailing non-assistant turns are dropped: they come after the last loss token and carry no signal.
    ``prompt_only`` (regeneration): a row whose last turn is a user turn gets an empty assistant turn after it to be
    answered, so rows of prompts alone (no assistant turn) are regenerated instead of skipped.
    """
    key, role_key, content_key = (
        ("conversations", "from", "value") if fmt == "sharegpt" else ("messages", "role", "content")
    )
    turns = row.get(key)
    if not isinstance(turns, list):
        return None, "missing_field"
    if not turns:
        return None, "empty_conversation"
    messages = []
    for turn in turns:
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get(role_key), str)
            or not isinstance(turn.get(content_key), str)
        ):
            return None, "missing_field"
        role = turn[role_key].lower()
        role = SHAREGPT_ROLES.get(role) if fmt == "sharegpt" else (role if role in CHAT_ROLES else None)
        if role is None:
            return None, "unknown_role"
        if role == "assistant" and not turn[content_key].strip():
            return None, "empty_assistant_turn"
        messages.append({"role": role, "content": turn[content_key]})
    if prompt_only and messages and messages[-1]["role"] == "user":
        messages.append({"role": "assistant", "content": ""})
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0:
        return None, "no_assistant_turn"
    return messages[: last + 1], ""


# --------------------------------------------------------------------------- assistant spans
def tokenize_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Tokenise ``text`` piece by piece, cut at the span edges; mask 1 on tokens inside spans."""
    ids: list[int] = []
    mask: list[int] = []
    cursor = 0
    for start, end in [*spans, (len(text), len(text))]:
        for piece, flag in ((text[cursor:start], 0), (text[start:end], 1)):
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids += piece_ids
                mask += [flag] * len(piece_ids)
        cursor = end
    return ids, mask


def resolve_span_method(tokenizer, requested: str = "auto") -> str:
    if requested == "auto":
        return "generation" if has_generation_markers(tokenizer.get_chat_template()) else "diff"
    if requested == "generation" and not has_generation_markers(tokenizer.get_chat_template()):
        raise ValueError("span_method='generation' needs a chat template with {% generation %} markers")
    return requested


def tokenize_conversation(tokenizer, messages: list[dict], span_method: str) -> tuple[list[int], list[int]]:
    text, spans = (generation_spans if span_method == "generation" else diff_spans)(tokenizer, messages)
    return tokenize_spans(tokenizer, text, spans)


# --------------------------------------------------------------------------- rows
def _tokenize_row(
    row: dict, tokenizer, fmt: str, span_method: str, max_length: int, loss_on_all_tokens_for_text: bool
) -> dict[str, Any]:
    """One raw row → ids, mask and a skip reason ("" when kept). Runs inside ``datasets.map``."""
    skipped = {"input_ids": [], "loss_mask": [], "truncated": False, "length": 0, "n_loss": 0}
    if fmt == "text":
        text = row.get("text")
        if not isinstance(text, str):
            return {**skipped, "skip_reason": "missing_field"}
        if not text.strip():
            return {**skipped, "skip_reason": "empty_text"}
        # bos + text + eos, the layout of the reference target's pretraining stream
        head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        tail = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids = head + tokenizer(text, add_special_tokens=False)["input_ids"] + tail
        edge = 1 if loss_on_all_tokens_for_text else 0
        mask = [edge] * len(head) + [1] * (len(ids) - len(head) - len(tail)) + [edge] * len(tail)
    else:
        messages, reason = normalize_conversation(row, fmt)
        if messages is None:
            return {**skipped, "skip_reason": reason}
        try:
            ids, mask = tokenize_conversation(tokenizer, messages, span_method)
        except SpanError:
            return {**skipped, "skip_reason": "span_not_found"}
        except jinja2.TemplateError:  # the template's raise_exception(...), e.g. roles must alternate
            return {**skipped, "skip_reason": "template_error"}
    truncated = len(ids) > max_length
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return {**skipped, "skip_reason": "over_length"}
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "truncated": truncated,
        "length": len(ids),
        "n_loss": sum(mask),
        "skip_reason": "",
    }


def _pack(batch: dict[str, list], max_length: int) -> dict[str, list]:
    """Greedy, order-preserving packing of one map batch into rows of at most ``max_length`` tokens."""
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "position_ids": []}
    ids: list[int] = []
    mask: list[int] = []
    pos: list[int] = []
    for sample_ids, sample_mask in zip(batch["input_ids"], batch["loss_mask"]):
        if ids and len(ids) + len(sample_ids) > max_length:
            rows["input_ids"].append(ids)
            rows["loss_mask"].append(mask)
            rows["position_ids"].append(pos)
            ids, mask, pos = [], [], []
        ids.extend(sample_ids)
        mask.extend([0, *sample_mask[1:]])  # the first token has no in-sample predecessor
        pos.extend(range(len(sample_ids)))
    if ids:
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
        rows["position_ids"].append(pos)
    return rows


def build_dataset(cfg: DataConfig, tokenizer) -> tuple[datasets.Dataset, dict]:
    """Tokenised dataset (``input_ids``, ``loss_mask``, plus ``position_ids`` when packed) and a summary.

    The summary holds: format, span_method, rows read, samples kept, truncated, skipped (every reason
    in :data:`SKIP_REASONS`, zeros included), tokens and loss tokens of the kept samples, and (packed)
    the number of packed rows.
    """
    raw = load_raw(cfg)
    fmt = detect_format(raw.column_names, cfg.format)
    span_method = "text" if fmt == "text" else resolve_span_method(tokenizer, cfg.span_method)
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("int8")),
            "truncated": datasets.Value("bool"),
            "length": datasets.Value("int32"),
            "n_loss": datasets.Value("int32"),
            "skip_reason": datasets.Value("string"),
        }
    )
    tokenized = raw.map(
        _tokenize_row,
        fn_kwargs={
            "tokenizer": tokenizer,
            "fmt": fmt,
            "span_method": span_method,
            "max_length": cfg.max_length,
            "loss_on_all_tokens_for_text": cfg.loss_on_all_tokens_for_text,
        },
        remove_columns=raw.column_names,
        features=features,
        num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
        desc=f"tokenize ({fmt}, {span_method})",
    )
    reasons = Counter(tokenized["skip_reason"])
    kept = tokenized.filter(lambda reason: reason == "", input_columns="skip_reason", desc="drop skipped rows")
    summary = {
        "format": fmt,
        "span_method": span_method,
        "rows": len(raw),
        "kept": len(kept),
        "truncated": sum(kept["truncated"]),
        "skipped": {reason: reasons.get(reason, 0) for reason in SKIP_REASONS},
        "tokens": sum(kept["length"]),
        "loss_tokens": sum(kept["n_loss"]),
    }
    dataset = kept.remove_columns(["truncated", "length", "n_loss", "skip_reason"])
    if cfg.packing:
        dataset = dataset.map(
            _pack,
            fn_kwargs={"max_length": cfg.max_length},
            batched=True,
            batch_size=PACK_BATCH_SIZE,
            remove_columns=dataset.column_names,
            features=datasets.Features(
                {
                    "input_ids": datasets.List(datasets.Value("int32")),
                    "loss_mask": datasets.List(datasets.Value("int8")),
                    "position_ids": datasets.List(datasets.Value("int32")),
                }
            ),
            desc="pack",
        )
        summary["packed_rows"] = len(dataset)
    return dataset, summary


def collate(batch: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples: ``input_ids`` (pad_id), ``attention_mask`` and ``loss_mask`` (0 on pads),
    and ``position_ids`` (0 on pads) when the samples are packed. All ``[B, T]`` int64 / bool-like int."""
    width = max(len(sample["input_ids"]) for sample in batch)
    keys = ["input_ids", "loss_mask"] + (["position_ids"] if "position_ids" in batch[0] else [])
    out = {key: torch.zeros(len(batch), width, dtype=torch.long) for key in keys}
    out["input_ids"].fill_(pad_id)
    out["attention_mask"] = torch.zeros(len(batch), width, dtype=torch.long)
    for i, sample in enumerate(batch):
        n = len(sample["input_ids"])
        for key in keys:
            out[key][i, :n] = torch.as_tensor(sample[key], dtype=torch.long)
        out["attention_mask"][i, :n] = 1
    return out


def packed_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask ``[B, 1, T, T]`` (True = may attend) from per-sample ``position_ids [B, T]``.

    A new sample starts wherever the position is 0, so each padding position (0 from :func:`collate`)
    is its own one-token sample and never attends to real tokens.
    """
    segment = (position_ids == 0).cumsum(-1)
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(position_ids.shape[-1], position_ids.shape[-1], dtype=torch.bool).tril()
    return (same & causal)[:, None]


# --------------------------------------------------------------------------- reference target samples
def _write_jsonl_atomic(rows: list[dict], path: Path) -> None:
    """Write to ``<path>.tmp`` then rename, so a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(tmp, path)


def _line_ends(text: str) -> list[int]:
    """Character positions where lines start, plus ``len(text)``: the allowed cut points."""
    cuts = [0] + [m.end() for m in re.finditer("\n", text)]
    return cuts if cuts[-1] == len(text) else [*cuts, len(text)]


def _extend(cuts: list[int], token_starts: list[int], i: int, budget: int) -> int:
    """Largest line index ``j >= i`` with about ``budget`` tokens or fewer between cuts ``i`` and ``j``."""
    j = i
    while j + 1 < len(cuts) and (
        bisect.bisect_left(token_starts, cuts[j + 1]) - bisect.bisect_left(token_starts, cuts[i]) <= budget
    ):
        j += 1
    return j


def build_stdlib_samples(
    tokenizer,
    split: str = "train",
    *,
    out_dir: str | Path,
    files: list | None = None,
    max_files: int | None = None,
    chunk_tokens: int = 512,
    prompt_tokens: int = 64,
    continuation_tokens: int = 128,
    samples_per_file: int = 2,
) -> dict:
    """Write the reference target's corpus as raw-text and chat samples (jsonl) for one split.

    - ``stdlib_<split>_text.jsonl``: ``{"text", "source"}``, each file cut at line starts into chunks of
      at most ~``chunk_tokens`` tokens (so truncation does not throw away the rest of a long file; a
      single longer line stays whole and is truncated later).
    - ``stdlib_<split>_chat.jsonl``: ``{"messages", "source"}``: user = whole lines of source, at most
      ~``prompt_tokens`` tokens (at least half of that); assistant = the true next lines, at most
      ~``continuation_tokens`` tokens; ``samples_per_file`` cuts per file at evenly spaced lines.

    Cuts are made at line starts in the text, not at token boundaries: byte-level BPE glues a newline
    to the next line's indentation, so token boundaries rarely fall at line starts. Token counts come
    from the whole file's tokenisation (tokens starting between two cuts), hence "about".
    ``files`` (``eval.stdlib_corpus.SourceFile``s) replaces the stdlib walk; otherwise the split comes
    from ``eval.stdlib_corpus`` (path hash). Returns the paths and counts.
    """
    from eval.stdlib_corpus import split_files, stdlib_files

    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if files is None:
        train_files, heldout_files = split_files(stdlib_files()[0])
        files = train_files if split == "train" else heldout_files
    files = files[:max_files] if max_files is not None else files
    text_rows, chat_rows = [], []
    for f in files:
        token_starts = [
            s for s, _ in tokenizer(f.text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        ]
        cuts = _line_ends(f.text)
        i = 0
        while i < len(cuts) - 1:
            j = max(i + 1, _extend(cuts, token_starts, i, chunk_tokens))
            if f.text[cuts[i] : cuts[j]].strip():
                text_rows.append({"text": f.text[cuts[i] : cuts[j]], "source": f.relpath})
            i = j
        for k in range(1, samples_per_file + 1):
            a = (len(cuts) - 1) * k // (samples_per_file + 1)
            b = _extend(cuts, token_starts, a, prompt_tokens)
            c = _extend(cuts, token_starts, b, continuation_tokens)
            prompt, continuation = f.text[cuts[a] : cuts[b]], f.text[cuts[b] : cuts[c]]
            n_prompt = bisect.bisect_left(token_starts, cuts[b]) - bisect.bisect_left(token_starts, cuts[a])
            if n_prompt < prompt_tokens // 2 or not prompt.strip() or not continuation.strip():
                continue
            chat_rows.append(
                {
                    "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": continuation}],
                    "source": f.relpath,
                }
            )
    out_dir = Path(out_dir)
    text_path, chat_path = out_dir / f"stdlib_{split}_text.jsonl", out_dir / f"stdlib_{split}_chat.jsonl"
    _write_jsonl_atomic(text_rows, text_path)
    _write_jsonl_atomic(chat_rows, chat_path)
    return {
        "text_path": str(text_path),
        "chat_path": str(chat_path),
        "files": len(files),
        "text_rows": len(text_rows),
        "chat_rows": len(chat_rows),
    }


# --------------------------------------------------------------------------- self-distillation
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
    seed: int = 0,
    show_progress: bool = True,
) -> dict:
    """Replace every assistant turn with the target's own answer; write a ``messages`` jsonl atomically.

    Turns are regenerated in order: turn k is generated from the original system/user turns and the
    *regenerated* turns < k. Prompts are batched with left padding. Generation stops at EOS or the
    template's end-of-turn token; special tokens are dropped from the decoded text so control tokens
    never leak into content. A turn that comes out empty, or whose prompt plus ``max_new_tokens``
    exceeds ``cfg.max_length``, ends the conversation before it (the row is kept when it still has a
    regenerated assistant turn, else skipped). Turns that hit ``max_new_tokens`` are kept (counted):
    the template will close them with an end-of-turn token the target did not emit.

    Rows of prompts alone (user turns without answers, Spec-Bench ``turns`` or a ``prompt`` column) are answered.
    The answering is `train.answerer`'s (the project's KV-cached loop, length-bucketed batches): each finished batch
    is a shard under ``<out_path>.shards/``; a rerun with the same arguments answers only what no shard holds, and
    the output file appears (atomically, in input order) only when all rows are done, the shards then removed.
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
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    reasons = (
        "missing_field",
        "unknown_role",
        "empty_conversation",
        "empty_assistant_turn",
        "no_assistant_turn",
        "template_error",
        "empty_generation",
        "prompt_too_long",
    )
    skipped = Counter({reason: 0 for reason in reasons})
    conversations = []
    for row in raw:
        messages, reason = normalize_conversation(row, fmt, prompt_only=True)
        if messages is None:
            skipped[reason] += 1
        else:
            conversations.append(messages)
    from models.target import TargetModel
    from train.answerer import AnswerConfig, Job, answer, read_shards

    # one job per conversation: the system / user messages before each original assistant turn are a segment, and the
    # target answers after each (turn k sees the regenerated turns < k); trailing turns without an answer are dropped
    jobs = []
    for i, messages in enumerate(conversations):
        segments, current = [], []
        for m in messages:
            if m["role"] == "assistant":
                segments.append(current)
                current = []
            else:
                current.append(m)
        if segments:
            jobs.append(Job(str(i), segments))
        else:
            skipped["no_assistant_turn"] += 1
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
    )
    # one process answers all and writes the file (the shards still make it resumable)
    counts = answer(model, tokenizer, jobs, settings, shards, "regenerate", lambda m: None, show_progress, (0, 1))
    rows = read_shards(shards)
    written = [rows[j.id] for j in jobs if j.id in rows]
    for reason, name in (("empty_answer", "empty_generation"), ("prompt_too_long", None), ("template_error", None)):
        skipped[name or reason] += counts[f"no_answer_{reason}"]  # ended before any answer: the row is skipped
    cut_short = sum("ended" in row for row in written)
    _write_jsonl_atomic([{"messages": row["messages"]} for row in written], out_path)
    shutil.rmtree(shards)
    return {
        "rows_read": len(raw),
        "rows_written": len(written),
        "turns_regenerated": counts["answers"],
        "turns_hit_max_new_tokens": counts["hit_max_new_tokens"],
        "rows_cut_short": cut_short,
        "skipped": dict(skipped),
        "tokens_per_s": counts["tokens_per_s"],
    }


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
