"""The reference target's corpus as training samples: files of the Python standard library (train / held-out split by
`eval.stdlib_corpus`) cut at line starts into raw-text chunks and into chat samples (a few lines of source, then the
true next lines as the answer)."""

from __future__ import annotations

import bisect
import re
from pathlib import Path

from eval.stdlib_corpus import split_files, stdlib_files
from train.data.files import write_jsonl_atomic


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
    write_jsonl_atomic(text_rows, text_path)
    write_jsonl_atomic(chat_rows, chat_path)
    return {
        "text_path": str(text_path),
        "chat_path": str(chat_path),
        "files": len(files),
        "text_rows": len(text_rows),
        "chat_rows": len(chat_rows),
    }
