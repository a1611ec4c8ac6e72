"""Vanilla decoding with continuous batching: the throughput loop of self-distillation (`train/data/answerer.py`).

Rows live in the KV slot layout of `infer.generate` (left-padded, explicit positions, a validity mask per slot), which
is what lets a prompt join a running batch: its cache is left-padded to the batch's width and concatenated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infer.attention import SlackLayer
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
    stop_row: Callable[[object, list[int]], bool] | None = None,
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
    rounding. One random stream serves all rows (T > 0 samples are not tied to a row's batch). ``stop_row(key,
    tokens)``, asked after every step for every live row, ends a row there when it returns True (e.g. an answer
    caught in a loop); its answer goes to ``on_done`` like any other. On the CPU the one-token
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
            done = vanilla_round(target, state, params, gen, stats)
            if stop_row is not None and state.active:
                cut = [stop_row(keys[row], state.new_tokens[row]) for row in state.active]
                done += [row for row, c in zip(state.active, cut) if c]
                state.drop_finished(cut)
            for row in done:
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
    parts: list[DecodeState] = []
    order: list[int] = []
    for group in length_groups([len(p) for p in prompts]):
        part = DecodeState([prompts[i] for i in group], params, eos_ids, target.device)
        prefill(target, part)
        parts.append(part)
        order += group
    base = 0 if state is None else len(state.contexts)
    keys.update({base + j: new_keys[i] for j, i in enumerate(order)})
    if state is None or not state.active:
        fresh = _stack_rows(parts)
        if state is not None:  # keep row ids unique across the run
            fresh.contexts = state.contexts + fresh.contexts
            fresh.new_tokens = state.new_tokens + fresh.new_tokens
            fresh.active = [base + r for r in fresh.active]
        return fresh
    return _stack_rows([state, *parts])


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


def _stack_rows(sides: list[DecodeState]) -> DecodeState:
    """The rows of ``sides`` in one state, the first's (row ids continue across them), every cache left-padded to one
    width. Each layer is built once, with room to grow (`SlackLayer.adopt`): appending one side at a time copied the
    rows gathered so far at every prefill group and left buffers without spare slots, so the next step copied them
    all again (a 128-prompt join of many small groups spent more time in these copies than in its prefill)."""
    state = sides[0]
    if len(sides) == 1:
        return state
    width = max(s.kv_valid.shape[1] for s in sides)
    rows = [s.kv_valid.shape[0] for s in sides]
    starts = [sum(rows[:i]) for i in range(len(sides))]
    kv_valid = state.kv_valid.new_zeros(sum(rows), width)
    for s, at, r in zip(sides, starts, rows):
        kv_valid[at : at + r, width - s.kv_valid.shape[1] :] = s.kv_valid
    # prompts of one token prefill nothing: such a side has no cache layers, and every slot of its rows is invalid
    cache = next((s.cache for s in sides if s.cache.layers), state.cache)
    for i, layer in enumerate(cache.layers):
        ref = layer.keys
        room = SlackLayer.room(width)
        k = ref.new_empty(sum(rows), ref.shape[1], room, ref.shape[3])
        v = torch.empty_like(k)
        for s, at, r in zip(sides, starts, rows):
            n = s.cache.layers[i].keys.shape[2] if s.cache.layers else 0
            # padding slots are masked, but a masked slot's value is still multiplied by its zero weight: no garbage
            k[at : at + r, :, : width - n] = 0.0
            v[at : at + r, :, : width - n] = 0.0
            if n:
                k[at : at + r, :, width - n : width] = s.cache.layers[i].keys
                v[at : at + r, :, width - n : width] = s.cache.layers[i].values
        layer.adopt(k, v, width)
    state.cache = cache
    state.kv_valid = kv_valid
    for s in sides[1:]:
        base = len(state.contexts)
        state.contexts += s.contexts
        state.new_tokens += s.new_tokens
        state.active += [base + r for r in s.active]
    return state
