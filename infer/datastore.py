"""A datastore of the target's own text: the continuation of the latest place where the running context's last
n tokens occurred in it.

Prompt lookup copies from the prompt and the answer so far; a datastore copies from text written before, as REST
(He et al. 2024, "REST: Retrieval-Based Speculative Decoding") and SuffixDecoding (Oliaro et al. 2024, its global
tree of earlier outputs) do. Built from the target's own answers (the target-written training tiers), it holds the
target's stock phrases, list scaffolds and closing lines, the text an answer repeats from answers before it rather
than from its prompt. Deterministic: a proposer drafting from it verifies its chains as one-hot q, lossless at every
temperature.

Index: for every n in ``min_ngram..max_ngram`` a 64-bit polynomial hash of every n-gram of the concatenated
sequences, sorted, each key keeping the position after its latest occurrence; a lookup is one binary search per n,
longest n first, and the n-gram found is compared with the context's tail, so a hash collision is a miss, never a
wrong match.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

_SEP = -1  # between sequences: no n-gram and no continuation crosses it
_MULT = 0x100000001B3  # the FNV-1 64-bit prime: a multiplier that mixes every token into the key
_MASK = (1 << 64) - 1


class Datastore:
    """n-gram index over token sequences; `match` returns the longest n-gram's continuation."""

    def __init__(self, sequences: list[list[int]], num_draft: int = 10, min_ngram: int = 2, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if num_draft < 1:
            raise ValueError("num_draft must be >= 1")
        flat: list[int] = []
        for seq in sequences:
            if seq and min(seq) < 0:
                raise ValueError("token ids must be >= 0")
            flat += seq
            flat.append(_SEP)
        self.tokens = np.asarray(flat, dtype=np.int64)
        self.num_draft, self.min_ngram, self.max_ngram = num_draft, min_ngram, max_ngram
        self.index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for n in range(min_ngram, max_ngram + 1):
            self.index[n] = self._index(n)

    def __len__(self) -> int:
        """Tokens held (separators excluded)."""
        return int((self.tokens != _SEP).sum())

    def _index(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(sorted keys, the position after each key's latest occurrence)."""
        t = self.tokens
        if len(t) < n + 1:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        windows = np.lib.stride_tricks.sliding_window_view(t, n)[:-1]  # each window needs a next token
        ends = np.arange(n, len(t))  # the continuation's first position
        keep = (windows != _SEP).all(axis=1) & (t[ends] != _SEP)
        keys = _keys(windows[keep])
        ends = ends[keep]
        order = np.lexsort((ends, keys))  # by key, then position: a key's latest occurrence comes last
        keys, ends = keys[order], ends[order]
        last = np.ones(len(keys), dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]
        return keys[last], ends[last]

    def match(self, ctx: list[int]) -> tuple[int, list[int]]:
        """(n, continuation): the longest n-gram of ``ctx``'s tail found (0: none) and up to ``num_draft`` tokens
        that followed its latest occurrence, cut at the end of its sequence."""
        for n in range(min(self.max_ngram, len(ctx)), self.min_ngram - 1, -1):
            tail = ctx[-n:]
            keys, ends = self.index[n]
            key = _key(tail)
            i = int(np.searchsorted(keys, np.uint64(key)))
            if i < len(keys) and int(keys[i]) == key and self.tokens[ends[i] - n : ends[i]].tolist() == tail:
                cont = self.tokens[ends[i] : ends[i] + self.num_draft].tolist()
                if _SEP in cont:
                    cont = cont[: cont.index(_SEP)]
                return n, cont
        return 0, []

    @classmethod
    def from_conversations(cls, folders: list[str | Path], tokenizer, **kwargs) -> Datastore:
        """Every assistant turn of the ``messages`` rows in these folders' ``*.jsonl.gz`` / ``*.jsonl`` shards, each
        tokenized on its own (as the target emits an answer after its generation prompt)."""
        sequences: list[list[int]] = []
        for folder in folders:
            shards = sorted(Path(folder).glob("*.jsonl.gz")) + sorted(Path(folder).glob("*.jsonl"))
            if not shards:
                raise FileNotFoundError(f"datastore: no *.jsonl.gz or *.jsonl shards in {folder}")
            for shard in shards:
                for row in _rows(shard):
                    for m in row.get("messages") or []:
                        if m.get("role") == "assistant" and m.get("content"):
                            sequences.append(tokenizer.encode(m["content"], add_special_tokens=False))
        if not sequences:
            raise ValueError(f"datastore: no assistant turns in {[str(f) for f in folders]}")
        return cls(sequences, **kwargs)


def _rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _keys(windows: np.ndarray) -> np.ndarray:
    """Each row of n token ids hashed to a uint64 (arithmetic mod 2**64, as `_key` computes it for one n-gram)."""
    keys = np.zeros(len(windows), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(windows.shape[1]):
            keys = keys * np.uint64(_MULT) + windows[:, j].astype(np.uint64)
    return keys


def _key(tokens: list[int]) -> int:
    key = 0
    for t in tokens:
        key = (key * _MULT + t) & _MASK
    return key
