"""The slot layout every KV cache of the runtime shares, and the two operations on it that several caches need.

A cache here (the target's, infer/generate.py; an EAGLE-3 drafter's, an MTP depth's, a draft model's, in their
proposers) holds S slots per row, shared by the batch; ``valid[b, s]`` says whether slot s holds one of row b's
tokens. Positions are explicit, so an invalid slot (a *hole*: padding of a row that fed fewer tokens than the others,
a draft slot closed after verification) changes nothing a row computes; it costs memory and attention width only.

- `additive_mask`: which slots each query may read (bool) → the 4D additive mask HF attention takes.
- `drop_holes`: once holes dominate a cache, left-align every row's valid slots with one gather per tensor
  (`infer.kernels.compact_kv`, the gather the verify step's compaction uses too).
- `SlackCache`: the target's HF cache with spare slots, so a step writes its new slots in place.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from infer.kernels import compact_kv


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, q, k] → additive float mask [B, 1, q, k] (0 where allowed, dtype-min elsewhere), the form HF
    attention takes for a custom 4D mask (eager and sdpa alike; DESIGN.md §7)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def drop_holes(valid: torch.Tensor, caches: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Drop the holes of a cache once they dominate: ``valid`` [B, S] bool and the cache's keys / values, each
    [B, nkv, S, d] (any number of them: one pair per layer) → each row's valid slots in order, left-aligned, in
    ``max_b used_b`` slots, shorter rows padded with invalid slots.

    Below S > 2·used + 64 everything is returned as given (the same objects): a gather every round would cost more
    than attending over the holes, and a long generation still never grows its cache without bound."""
    S, used = valid.shape[1], int(valid.sum(1).max())
    if S <= 2 * used + 64:
        return valid, caches
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :used]  # valid slots first, in order
    return valid.gather(1, order), [compact_kv(kv, order) for kv in caches]


class SlackLayer(DynamicLayer):
    """A `DynamicLayer` whose keys / values live in a buffer with spare slots, so `update` writes the new slots in
    place instead of `torch.cat`-ing the whole layer (which copies every cached slot of every row, every step: at
    batch 32 and 687 slots that was 62 % of a SmolLM2 decode step here, 1 GB copied per step). ``keys`` / ``values``
    are views of the buffer's first ``n`` slots, so everything that reads or assigns them as tensors (the mask sizes,
    row selection, the verify step's compaction and truncation) works unchanged; assigning a prefix view of the
    buffer only moves ``n``, anything else becomes the new buffer."""

    GROWTH = 1.5
    MIN_SLACK = 64

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        # slots in use, per buffer: assigning ``keys`` must not change what ``values`` reads (code that sets one and
        # then reads the other, such as a join that left-pads both, would otherwise read spare slots as values)
        self._n = {"_k": 0, "_v": 0}
        super().__init__()

    @staticmethod
    def _prefix_of(t: torch.Tensor, buf: torch.Tensor | None) -> bool:
        return (
            buf is not None
            and t.dim() == 4
            and t.data_ptr() == buf.data_ptr()
            and t.stride() == buf.stride()
            and t.shape[:2] == buf.shape[:2]
            and t.shape[3] == buf.shape[3]
            and t.shape[2] <= buf.shape[2]
        )

    def _get(self, name: str) -> torch.Tensor | None:
        buf = getattr(self, name)
        return buf if buf is None or buf.dim() != 4 else buf[:, :, : self._n[name]]

    def _set(self, name: str, t: torch.Tensor | None) -> None:
        if t is not None and self._prefix_of(t, getattr(self, name)):
            self._n[name] = t.shape[2]
            return
        setattr(self, name, t)
        self._n[name] = t.shape[2] if t is not None and t.dim() == 4 else 0

    @classmethod
    def room(cls, n: int) -> int:
        """Slots a buffer gets when it must hold ``n``: room for the steps that follow without a copy each."""
        return max(int(n * cls.GROWTH), n + cls.MIN_SLACK)

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, n: int) -> None:
        """Take ``keys`` / ``values`` (one shape, [B, heads, slots, dim]) as the buffers, their first ``n`` slots in
        use: a caller that assembles a layer (a join of rows) gives it spare slots at once."""
        if keys.shape != values.shape or not 0 <= n <= keys.shape[2]:
            raise ValueError(f"buffers of shapes {tuple(keys.shape)} / {tuple(values.shape)} cannot hold {n} slots")
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._k, self._v = keys, values
        self._n = {"_k": n, "_v": n}

    keys = property(lambda self: self._get("_k"), lambda self, t: self._set("_k", t))
    values = property(lambda self: self._get("_v"), lambda self, t: self._set("_v", t))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, add = self._n["_k"], key_states.shape[2]
        if self._n["_v"] != n:
            raise RuntimeError(
                f"cache layer holds {n} key slots but {self._n['_v']} value slots: one was assigned alone"
            )
        if self._k is None or self._k.dim() != 4 or n + add > self._k.shape[2]:
            cap = self.room(n + add)
            k = key_states.new_empty(*key_states.shape[:2], cap, key_states.shape[3])
            v = value_states.new_empty(*value_states.shape[:2], cap, value_states.shape[3])
            if n:
                k[:, :, :n] = self._k[:, :, :n]
                v[:, :, :n] = self._v[:, :, :n]
            self._k, self._v = k, v
        self._k[:, :, n : n + add] = key_states
        self._v[:, :, n : n + add] = value_states
        self._n = {"_k": n + add, "_v": n + add}
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (spare slots included, so the next update needs no new buffer). Where every row that
        changes place comes from past the kept count (rows dropped by moving the last live ones into their places,
        `infer.generate.DecodeState.drop_finished`), only those rows' used slots are copied, in place; any other
        selection copies the kept rows into a new buffer."""
        if self._k is None or self._k.dim() != 4:
            return
        kept = indices.shape[0]
        moved = (indices != torch.arange(kept, device=indices.device)).nonzero().flatten()
        if bool((indices[moved] >= kept).all()):
            for name in ("_k", "_v"):
                buf, n = getattr(self, name), self._n[name]
                buf[moved, :, :n] = buf[indices[moved], :, :n]
            self._k, self._v = self._k[:kept], self._v[:kept]
        else:
            self._k, self._v = self._k.index_select(0, indices), self._v.index_select(0, indices)

    def drop_front(self, slots: int) -> None:
        """Forget the first ``slots`` slots of every row (no copy: the buffer becomes a view that starts later)."""
        if slots and self._k is not None and self._k.dim() == 4:
            self._k, self._v = self._k[:, :, slots:], self._v[:, :, slots:]
            self._n = {name: n - slots for name, n in self._n.items()}


class SlackCache(DynamicCache):
    """An HF cache of `SlackLayer`s (one per decoder layer, made on first use): the runtime's target cache."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=SlackLayer)

    def drop_front(self, slots: int) -> None:
        for layer in self.layers:
            layer.drop_front(slots)
