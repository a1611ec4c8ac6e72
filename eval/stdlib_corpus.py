"""The reference corpus: the running interpreter's standard-library ``.py`` files.

Every machine has this corpus, so the reference target, its tokenizer, the held-out prompts and
the benchmarks are reproducible without a hub. File order is the sorted relative path and the
train / held-out split is a hash of that path, so adding or removing one file never moves another
file across the split.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PERCENT = 3
"""Share of files (by path hash) kept out of training: ~50 files, ~1 MB of source."""


@dataclass(frozen=True)
class SourceFile:
    relpath: str
    text: str

    @property
    def heldout(self) -> bool:
        return is_heldout(self.relpath)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELDOUT_PERCENT


def stdlib_files(root: Path | None = None, max_bytes: int = 200_000) -> tuple[list[SourceFile], dict[str, int]]:
    """All stdlib ``.py`` files in sorted path order, with skip counts.

    Files over ``max_bytes`` (generated tables such as unicode data) and files that are not UTF-8
    are skipped and counted; site-packages is never read (it differs between machines).
    """
    root = root or stdlib_root()
    files, skipped = [], {"not_utf8": 0, "too_large": 0, "empty": 0}
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        raw = path.read_bytes()
        if len(raw) > max_bytes:
            skipped["too_large"] += 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        if not text.strip():
            skipped["empty"] += 1
            continue
        files.append(SourceFile(rel, text))
    return files, skipped


def split_files(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not f.heldout]
    heldout = [f for f in files if f.heldout]
    return train, heldout


def heldout_prompts(
    tokenizer, n: int = 32, prompt_tokens: int = 64, continuation_tokens: int = 128, files=None
) -> list[dict]:
    """Prompt/continuation pairs cut from held-out files at line starts.

    Each prompt is ``prompt_tokens`` tokens of real held-out source ending at a newline; the
    reference continuation is the next ``continuation_tokens`` tokens. Files are visited in order and
    each contributes at most two samples, so the prompts cover many modules.
    """
    if files is None:
        _, files = split_files(stdlib_files()[0])
    samples = []
    for f in files:
        lines = f.text.splitlines(keepends=True)
        for start_line in (len(lines) // 3, 2 * len(lines) // 3):
            text = "".join(lines[start_line:])
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) < prompt_tokens + continuation_tokens:
                continue
            prompt_ids = ids[:prompt_tokens]
            # end the prompt on a newline token so continuations start a fresh line
            cut = max((i for i, t in enumerate(prompt_ids) if "\n" in tokenizer.decode([t])), default=-1)
            if cut < prompt_tokens // 2:
                continue
            prompt_ids = ids[: cut + 1]
            samples.append(
                {
                    "source": f.relpath,
                    "prompt": tokenizer.decode(prompt_ids),
                    "prompt_ids": prompt_ids,
                    "reference_ids": ids[cut + 1 : cut + 1 + continuation_tokens],
                }
            )
            if len(samples) == n:
                return samples
    return samples


def distinct_ngram_ratio(ids: list[int], n: int = 4) -> float:
    """Distinct n-grams / total n-grams: 1.0 for text that never repeats, near 0 for loops."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / max(1, len(grams))
