"""Writing and reading the jsonl files a data build leaves: whole files written beside their final name and renamed
(a reader never sees half a file), and files appended to batch by batch (a crash loses at most the batch in hand)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path


def write_jsonl_atomic(rows: list[dict], path: Path) -> None:
    """Write to ``<path>.tmp`` then rename, so a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(tmp, path)


def write_jsonl_gz(rows: list[dict], path: Path) -> None:
    """Deterministic gzip (no timestamp in the header) of a jsonl, written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
    os.replace(tmp, path)


def read_shard(path: Path) -> list[dict]:
    """Every row of a whole shard file (``.jsonl.gz`` or ``.jsonl``, written atomically: no torn lines)."""
    with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def rewrite_shard(path: Path, rows: list[dict]) -> None:
    """Replace a shard's rows atomically, in its own format (deterministic gzip for ``.gz``); a shard left with no
    rows is removed (the answerer numbers new shards after the highest one on disk, so none is ever overwritten)."""
    if not rows:
        path.unlink()
    elif path.suffix == ".gz":
        write_jsonl_gz(rows, path)
    else:
        write_jsonl_atomic(rows, path)


def append_jsonl(path: Path, rows: list[dict]) -> None:
    """Append whole rows and flush them to disk: a crash loses at most the batch being generated."""
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a jsonl written by `append_jsonl`; a torn last line (a crash mid-write) is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows
