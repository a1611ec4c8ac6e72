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

Finding the assistant spans: `train.data.chat_render` (the ``generation`` and ``diff`` methods, their limits).

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

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import jinja2
import torch

from train.data.chat_render import SpanError, diff_spans, generation_spans, has_generation_markers
from train.data.loops import trim_loop_tails

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
    extra_paths: list[str] = field(default_factory=list)
    """More local files or directories read after ``path``, as one dataset with it (e.g. two data tiers): every
    file keeps the columns all files share."""
    repeats: list[int] = field(default_factory=list)
    """How many times each of ``path`` and ``extra_paths`` is read, in that order (empty: once each): a mixing weight,
    so a small folder of new material is not drowned by the large ones beside it."""
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
    loop_tail_keep: int | None = None
    """Where a loss span (an assistant turn, a raw text) ends repeating itself (`train.data.loops.loop_tail`), keep
    only this many tokens of the repetition and drop the rest from the sample (None: keep everything). A greedy
    target often writes to its length cap in a loop; a drafter served beside prompt lookup is not the one that
    drafts there, and those tokens cost training time without teaching it anything new."""

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
        if self.loop_tail_keep is not None and self.loop_tail_keep < 0:
            raise ValueError(f"loop_tail_keep must be >= 0 or None, got {self.loop_tail_keep}")
        if self.repeats and (len(self.repeats) != 1 + len(self.extra_paths) or min(self.repeats) < 1):
            raise ValueError(
                f"repeats needs a count >= 1 for path and each of extra_paths ({1 + len(self.extra_paths)}), "
                f"got {self.repeats}"
            )


# --------------------------------------------------------------------------- loading
def load_raw(cfg: DataConfig) -> datasets.Dataset:
    """The untokenised rows, through ``load_dataset`` (json/parquet builders for local paths)."""
    path = Path(cfg.path)
    if not path.exists():
        if cfg.extra_paths or cfg.repeats:
            raise ValueError(f"extra_paths and repeats need local files: {cfg.path} is not one")
        return datasets.load_dataset(cfg.path, split=cfg.split, cache_dir=cfg.cache_dir)
    files = []
    paths = [path, *map(Path, cfg.extra_paths)]
    for p, times in zip(paths, cfg.repeats or [1] * len(paths)):
        if not p.exists():
            raise ValueError(f"{p}: no such file or directory (data.extra_paths)")
        files += ([p] if p.is_file() else sorted(f for f in p.rglob("*") if _builder(f))) * times
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
    row: dict,
    tokenizer,
    fmt: str,
    span_method: str,
    max_length: int,
    loss_on_all_tokens_for_text: bool,
    loop_tail_keep: int | None = None,
) -> dict[str, Any]:
    """One raw row → ids, mask and a skip reason ("" when kept). Runs inside ``datasets.map``."""
    skipped = {"input_ids": [], "loss_mask": [], "truncated": False, "length": 0, "n_loss": 0, "loop_dropped": 0}
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
    dropped = 0
    if loop_tail_keep is not None:
        ids, mask, dropped = trim_loop_tails(ids, mask, loop_tail_keep)
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
        "loop_dropped": dropped,
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
    in :data:`SKIP_REASONS`, zeros included), tokens and loss tokens of the kept samples, the loop tokens dropped
    (``loop_tail_keep``), and (packed) the number of packed rows.
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
            "loop_dropped": datasets.Value("int32"),
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
            "loop_tail_keep": cfg.loop_tail_keep,
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
        "loop_tokens_dropped": sum(kept["loop_dropped"]),
    }
    dataset = kept.remove_columns(["truncated", "length", "n_loss", "loop_dropped", "skip_reason"])
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
