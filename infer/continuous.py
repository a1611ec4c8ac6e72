"""Vanilla decoding with continuous batching: the throughput loop of self-distillation (`train/data/answerer.py`).

Rows live in the KV slot layout of `infer.generate` (left-padded, explicit positions, a validity mask per slot), which
is what lets a prompt join a running batch: its cache is left-padded to the batch's width and concatenated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infer.generate import DecodeState, prefill, seeded_generator, vanilla_round
from infer.kernels.cpu_decode_attention import one_pass_decode
from infer.sampling import SamplingParams
from infer.stats import GenerationStats
from models.target import TargetModel
from models.timing import clock


def decode_continuous(
    target: TargetModel,
    submit: Callable[[int], list[tuple[object, list[int]]]],
    on_done: Callable[[object, list[int]], None],
    params: SamplingParams,
    eos_ids: tuple[int, ...],
    batch_size: int,
    refill: int | None = None,
) -> GenerationStats:
    """Vanilla decoding with continuous batching: a row that finishes frees its slot for the next prompt at once, so
    a batch does not shrink to its longest answer (the throughput of batched self-distillation, where answer
    lengths vary 10x).

    ``submit(n)`` hands up to n ``(key, prompt)`` pairs (fewer or none when nothing is waiting); ``on_done(key,
    tokens)`` receives each answer as it finishes (it may make new prompts available to ``submit``, e.g. the next
    turn of a conversation). New prompts are prefilled together and joined to the running batch once ``refill``
    slots are free (default a quarter of the batch): every join left-pads the shorter cache to the longer, so a join
    per freed slot would copy the cache too often. Tokens and logits of a row do not depend on its neighbours (the
    slot layout of `infer.generate`), so greedy answers equal those of one-at-a-time decoding up to the kernels'
    rounding. One random stream serves all rows (T > 0 samples are not tied to a row's batch). On the CPU the one-token
    steps attend through `infer.kernels.cpu_decode_attention` (off with ``DRAFTERS_CPU_DECODE_ATTENTION=0``)."""
    refill = max(1, refill if refill is not None else batch_size // 4)
    stats = GenerationStats(tree_nodes=1)
    t0 = clock(target.device)
    gen = seeded_generator(params, target.device)
    state: DecodeState | None = None
    keys: dict[int, object] = {}
    with one_pass_decode(target.model):  # on the CPU, the batched step attends in one read of the cache
        while True:
            free = batch_size - (len(state.active) if state is not None else 0)
            if state is None or not state.active or free >= refill:
                new = submit(free) if free else []
                if new:
                    tp = clock(target.device)
                    state = _join(target, state, [p for _, p in new], params, eos_ids, keys, [k for k, _ in new])
                    stats.prefill_s += clock(target.device) - tp
            if state is None or not state.active:
                break
            for row in vanilla_round(target, state, params, gen, stats):
                on_done(keys.pop(row), state.new_tokens[row])
                state.new_tokens[row] = state.contexts[row] = []  # answered: release its text
            if state.active:  # slots no live row holds (left padding of rows that finished) would be attended forever
                unused = int(state.kv_valid.any(0).int().argmax())
                if unused:
                    state.cache.drop_front(unused)
                    state.kv_valid = state.kv_valid[:, unused:]
    stats.total_s = clock(target.device) - t0
    return stats


def _join(
    target: TargetModel,
    state: DecodeState | None,
    prompts: list[list[int]],
    params: SamplingParams,
    eos_ids: tuple[int, ...],
    keys: dict[int, object],
    new_keys: list[object],
) -> DecodeState:
    """``state`` with ``prompts`` prefilled and appended as new rows (their row ids continue the old ones, in the
    order of `length_groups`); the caches are left-padded to one width (invalid slots) and concatenated along the
    batch. Prompts are prefilled in groups of similar length, so the prefill computes few padding positions (a
    join's prompts span several times their shortest length: padded to the longest, a quarter of the prefill's work
    was padding)."""
    fresh: DecodeState | None = None
    order: list[int] = []
    for group in length_groups([len(p) for p in prompts]):
        part = DecodeState([prompts[i] for i in group], params, eos_ids, target.device)
        prefill(target, part)
        fresh = part if fresh is None else _append_rows(fresh, part)
        order += group
    base = 0 if state is None else len(state.contexts)
    keys.update({base + j: new_keys[i] for j, i in enumerate(order)})
    if state is None or not state.active:
        if state is not None:  # keep row ids unique across the run
            fresh.contexts = state.contexts + fresh.contexts
            fresh.new_tokens = state.new_tokens + fresh.new_tokens
            fresh.active = [base + r for r in fresh.active]
        return fresh
    return _append_rows(state, fresh)


PREFILL_PADDING = 0.1
"""The padding a prefill group may compute, as a fraction of its prompts' tokens (`length_groups`)."""
PREFILL_MIN_TOKENS = 256
"""A group smaller than this (count x longest) takes the next prompt whatever its padding: a forward over fewer rows
costs about its fixed overhead."""


def length_groups(
    lengths: list[int], padding: float = PREFILL_PADDING, min_tokens: int = PREFILL_MIN_TOKENS
) -> list[list[int]]:
    """Indices of ``lengths`` shortest first, cut into consecutive groups whose padded size (count x longest) is
    within ``padding`` of their total length or below ``min_tokens``: each group is one prefill."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        padded = (len(groups[-1]) + 1) * lengths[i] if groups else 0
        if groups and padded <= max((1 + padding) * (total + lengths[i]), min_tokens):
            groups[-1].append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


def _append_rows(state: DecodeState, fresh: DecodeState) -> DecodeState:
    """``fresh``'s rows appended to ``state``'s (row ids continue), both caches left-padded to one width."""
    base = len(state.contexts)
    width = max(state.kv_valid.shape[1], fresh.kv_valid.shape[1])

    def left_pad(t: torch.Tensor, dim: int, fill) -> torch.Tensor:
        missing = width - t.shape[dim]
        if missing == 0:
            return t
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([torch.full(shape, fill, dtype=t.dtype, device=t.device), t], dim)

    state.kv_valid = torch.cat([left_pad(state.kv_valid, 1, False), left_pad(fresh.kv_valid, 1, False)], 0)
    # prompts of one token prefill nothing: such a side has no cache layers, and every slot of its rows is invalid
    cache = state.cache if state.cache.layers else fresh.cache
    for i, layer in enumerate(cache.layers):
        kv = []
        for side in (state, fresh):
            if side.cache.layers:
                kv.append((side.cache.layers[i].keys, side.cache.layers[i].values))
            else:
                rows = len(side.active)
                kv.append(tuple(t.new_zeros(rows, t.shape[1], 0, t.shape[3]) for t in (layer.keys, layer.values)))
        layer.keys = torch.cat([left_pad(k, 2, 0.0) for k, _ in kv], 0)
        layer.values = torch.cat([left_pad(v, 2, 0.0) for _, v in kv], 0)
    state.cache = cache
    state.contexts += fresh.contexts
    state.new_tokens += fresh.new_tokens
    state.active += [base + r for r in fresh.active]
    return state
