"""Vanilla and speculative generation over one KV-cache layout.

KV layout (both loops): the target's HF cache (`infer.attention.SlackCache`) holds ``S`` slots per row, shared by the
batch; ``kv_valid[b, s]`` says whether slot ``s`` of row ``b`` holds one of that row's tokens.
Prompts are left-padded (invalid slots on the left); after a speculative round every row keeps
only its accepted path, written into the first slots of the round's tree region, so rows that
accepted fewer tokens leave invalid "holes" there. Holes are never attended to (the 4D mask
closes them) and never shift positions (``position_ids`` are explicit: a row's position is the
number of its valid slots), so a row's tokens and logits do not depend on the rest of the batch.
This costs O(accepted) copies per round instead of re-packing the whole cache.

The last accepted token of each row (the *root*) is not in the cache: it is node 0 of the next
verify forward. Prefill therefore writes ``prompt[:-1]``, and every target forward after it emits
at least one token, so vanilla decoding has τ = 1.00 exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from infer.accept import AcceptResult, accept_typical
from infer.attention import SlackCache, additive_mask
from infer.kernels import compact_kv, verify_greedy, verify_rejection
from infer.proposer import Proposer, TargetSignal
from infer.sampling import SamplingParams, sample_from_probs, target_probs, warp_logits
from infer.tree import DraftTree
from models.acceptance import acceptance_rates
from models.target import TargetModel
from models.timing import clock


# ----------------------------------------------------------------------------------------- results
@dataclass
class GenerationStats:
    """Counters of one generate call. τ and α follow DESIGN.md §4 (bonus token included in τ)."""

    new_tokens: int = 0
    """Tokens emitted over all rows."""
    row_forwards: int = 0
    """Σ over target verify forwards of the rows active in it (prefill excluded)."""
    rounds: int = 0
    """Target verify forwards (batched)."""
    accepted_per_round: list[int] = field(default_factory=list)
    """Accepted draft tokens per (round, row), bonus excluded."""
    attempted_at_depth: list[int] = field(default_factory=list)
    """[k] how often depth k+1 was reachable (all shallower positions accepted and a draft existed)."""
    accepted_at_depth: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0
    total_s: float = 0.0
    tree_nodes: int = 0
    """Nodes per verify forward (root included); 1 for vanilla."""

    @property
    def tau(self) -> float:
        return self.new_tokens / max(1, self.row_forwards)

    @property
    def alpha(self) -> list[float]:
        return acceptance_rates(self.accepted_at_depth, self.attempted_at_depth)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: emitted tokens / wall time (prefill included, as a user sees it)."""
        return self.new_tokens / max(1e-9, self.total_s)

    def step_costs(self) -> dict[str, float]:
        """Mean seconds per round of draft and verify (the inputs of the predicted speedup)."""
        r = max(1, self.rounds)
        return {"draft_s": self.draft_s / r, "verify_s": self.verify_s / r, "bookkeeping_s": self.bookkeeping_s / r}

    def predicted_speedup(self, vanilla_step_s: float) -> float:
        """τ · t_target(1 token) / (t_draft + t_verify(tree)) per round (DESIGN.md §4)."""
        c = self.step_costs()
        return self.tau * vanilla_step_s / max(1e-12, c["draft_s"] + c["verify_s"])

    def record_acceptance(self, accepted: int, tree_depth: int) -> None:
        self.accepted_per_round.append(accepted)
        while len(self.attempted_at_depth) < tree_depth:
            self.attempted_at_depth.append(0)
            self.accepted_at_depth.append(0)
        for k in range(min(accepted + 1, tree_depth)):
            self.attempted_at_depth[k] += 1
            self.accepted_at_depth[k] += int(k < accepted)

    def as_dict(self) -> dict:
        return {
            "tau": self.tau,
            "alpha": self.alpha,
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "tokens_per_s": self.tokens_per_s,
            "tree_nodes": self.tree_nodes,
            "time_s": {
                "prefill": self.prefill_s,
                "draft": self.draft_s,
                "verify": self.verify_s,
                "bookkeeping": self.bookkeeping_s,
                "total": self.total_s,
            },
        }


def depth_tallies(stats: Iterable[GenerationStats], depth: int | None = None) -> tuple[list[int], list[int]]:
    """(accepted, attempted) per draft depth, summed over generate calls, to ``depth`` (default: the deepest any call
    reached); `models.acceptance.acceptance_rates` turns them into α."""
    stats = list(stats)
    if depth is None:
        depth = max((len(s.attempted_at_depth) for s in stats), default=0)
    accepted = [sum(s.accepted_at_depth[k] for s in stats if k < len(s.accepted_at_depth)) for k in range(depth)]
    attempted = [sum(s.attempted_at_depth[k] for s in stats if k < len(s.attempted_at_depth)) for k in range(depth)]
    return accepted, attempted


@dataclass
class GenerationResult:
    tokens: list[list[int]]
    """New tokens per row (prompt excluded), stop token included, never more than max_new_tokens."""
    stats: GenerationStats


# ---------------------------------------------------------------------------------------- KV state
class DecodeState:
    """Per-row bookkeeping shared by the vanilla and speculative loops (see the module docstring)."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams, eos_ids: tuple[int, ...], device):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | set(eos_ids)
        self.device = device
        self.contexts = [list(p) for p in prompts]  # prompt + emitted tokens; last one is the root
        self.new_tokens: list[list[int]] = [[] for _ in prompts]
        self.active = list(range(len(prompts)))  # original row ids of the rows still in the batch
        self.cache = SlackCache()
        self.kv_valid = torch.zeros(len(prompts), 0, dtype=torch.bool, device=device)

    @property
    def lengths(self) -> torch.Tensor:
        """[B_active] tokens of each row in the cache = position of its root."""
        return self.kv_valid.sum(1)

    @property
    def roots(self) -> torch.Tensor:
        return torch.tensor([self.contexts[r][-1] for r in self.active], device=self.device)

    def emit(self, row: int, tokens: list[int]) -> bool:
        """Append tokens to batch row ``row`` honouring stop ids and the budget; True if it finished."""
        rid = self.active[row]
        out = self.new_tokens[rid]
        for t in tokens:
            if len(out) >= self.params.max_new_tokens:
                return True
            out.append(t)
            self.contexts[rid].append(t)
            if t in self.stop_ids:
                return True
        return len(out) >= self.params.max_new_tokens

    def drop_finished(self, finished: list[bool]) -> torch.Tensor | None:
        """Remove finished rows from the batch and the cache; returns the kept batch indices or None."""
        if not any(finished):
            return None
        keep = torch.tensor([i for i, f in enumerate(finished) if not f], dtype=torch.long, device=self.device)
        self.active = [self.active[i] for i in keep.tolist()]
        for layer in self.cache.layers:
            layer.batch_select_indices(keep)
        self.kv_valid = self.kv_valid.index_select(0, keep)
        return keep


@torch.no_grad()
def prefill(target: TargetModel, state: DecodeState, capture_aux: bool = False):
    """Write ``prompt[:-1]`` of every row into the cache (left-padded). Returns the TargetOutput."""
    body = [state.contexts[r][:-1] for r in state.active]
    width = max(len(b) for b in body)
    if width == 0:
        return None
    B = len(body)
    ids = torch.zeros(B, width, dtype=torch.long, device=state.device)
    valid = torch.zeros(B, width, dtype=torch.bool, device=state.device)
    for i, b in enumerate(body):
        if b:
            ids[i, width - len(b) :] = torch.tensor(b, device=state.device)
            valid[i, width - len(b) :] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    causal = torch.ones(width, width, dtype=torch.bool, device=state.device).tril()
    # padded query rows see themselves only, so no softmax row is empty (their outputs are unused)
    allowed = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=state.device)[None]
    out = target(
        ids,
        attention_mask=additive_mask(allowed, target.dtype),
        position_ids=positions,
        past_key_values=state.cache,
        use_cache=True,
        capture_aux=capture_aux,
        logits_to_keep=1,  # nothing reads prefill logits: the root's come with the first verify
    )
    state.kv_valid = valid
    return out


# ----------------------------------------------------------------------------------------- vanilla
def _seeded_generator(params: SamplingParams, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


def _next_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """logits [B, V] → [B] token ids (argmax at T = 0, else a sample of the warped distribution)."""
    if params.greedy:
        return logits.argmax(-1)
    u = torch.rand(logits.shape[0], generator=gen, device=logits.device)
    return sample_from_probs(warp_logits(logits, params).softmax(-1), u)


def _vanilla_single(target: TargetModel, prompt: list[int], params: SamplingParams, stop: set[int]) -> GenerationResult:
    """Batch 1: the leanest loop HF offers (no mask, implicit positions, the sampled tensor fed back)."""
    stats = GenerationStats(tree_nodes=1)
    t0 = clock(target.device)
    gen = _seeded_generator(params, target.device)
    model, cache = target.model, SlackCache()
    if len(prompt) > 1:  # logits of the prompt are never read (HF generate skips them too)
        model(
            input_ids=torch.tensor([prompt[:-1]], device=target.device), cache=cache, use_cache=True, logits_to_keep=1
        )
    x = torch.tensor([[prompt[-1]]], device=target.device)
    stats.prefill_s = clock(target.device) - t0
    out: list[int] = []
    while True:
        tv = clock(target.device)
        logits = model(input_ids=x, cache=cache, use_cache=True).logits[:, -1]
        tb = clock(target.device)
        stats.verify_s += tb - tv
        nxt = _next_token(logits, params, gen)
        token = int(nxt)
        out.append(token)
        stats.bookkeeping_s += clock(target.device) - tb
        if token in stop or len(out) >= params.max_new_tokens:
            break
        x = nxt.view(1, 1)
    stats.rounds = stats.row_forwards = stats.new_tokens = len(out)
    stats.total_s = clock(target.device) - t0
    return GenerationResult([out], stats)


@torch.inference_mode()
def generate_vanilla(
    target: TargetModel, prompts: list[list[int]], params: SamplingParams, eos_ids: tuple[int, ...] = ()
) -> GenerationResult:
    """KV-cached autoregressive decoding: the baseline of every speedup.

    Batches use the shared left-padded slot layout with a 4D mask so rows never see each other's padding. Batch 1
    takes the loop ``target.vanilla_loop`` names: "plain" (`_vanilla_single`, no mask) or "masked" (the batched loop
    on one row), whichever `infer.serving.choose_vanilla_loop` timed faster here. Neither wins everywhere: plain was
    faster in fp32 on an AVX2 EPYC, masked in bf16 on an AVX-512-BF16 one (docs/decisions.md).
    """
    state = DecodeState(prompts, params, eos_ids, target.device)
    if len(prompts) == 1 and target.vanilla_loop == "plain":
        return _vanilla_single(target, prompts[0], params, state.stop_ids)
    stats = GenerationStats(tree_nodes=1)
    t0 = clock(target.device)
    gen = _seeded_generator(params, target.device)
    prefill(target, state)
    stats.prefill_s = clock(target.device) - t0
    while state.active:
        _vanilla_step(target, state, params, gen, stats)
    stats.total_s = clock(target.device) - t0
    return GenerationResult(state.new_tokens, stats)


def _vanilla_step(
    target: TargetModel, state: DecodeState, params: SamplingParams, gen: torch.Generator, stats: GenerationStats
) -> list[int]:
    """One batched vanilla forward over every active row's root; emits a token per row, drops the rows that
    finished and returns their row ids."""
    tv = clock(target.device)
    logits = _masked_forward(target, state)
    stats.verify_s += clock(target.device) - tv
    tb = clock(target.device)
    nxt = _next_token(logits, params, gen)
    state.kv_valid = _with_root_slot(state.kv_valid)
    stats.rounds += 1
    stats.row_forwards += len(state.active)
    finished = [state.emit(i, [t]) for i, t in enumerate(nxt.tolist())]
    stats.new_tokens += len(finished)
    done = [state.active[i] for i, f in enumerate(finished) if f]
    state.drop_finished(finished)
    stats.bookkeeping_s += clock(target.device) - tb
    return done


def _with_root_slot(kv_valid: torch.Tensor) -> torch.Tensor:
    """[B, S] → [B, S + 1]: the slots plus the root's, valid (``ones_like(kv_valid[:, :1])`` would add no column to
    the empty cache of one-token prompts)."""
    return torch.cat([kv_valid, kv_valid.new_ones(kv_valid.shape[0], 1)], 1)


def _masked_forward(target: TargetModel, state: DecodeState) -> torch.Tensor:
    """Logits [B, V] of every active row's root, one token a row, in the slot layout (the cache grows by one slot)."""
    allowed = _with_root_slot(state.kv_valid)[:, None, :]
    return target.model(
        input_ids=state.roots[:, None],
        attention_mask=additive_mask(allowed, target.dtype),
        position_ids=state.lengths[:, None],
        cache=state.cache,
        use_cache=True,
    ).logits[:, -1]


VANILLA_LOOPS = ("plain", "masked")
"""The batch-1 vanilla loops (`generate_vanilla`)."""


@torch.inference_mode()
def vanilla_steps(target: TargetModel, context: list[int]) -> dict[str, Callable[[], None]]:
    """For timing: each batch-1 vanilla loop's one-token forward after ``context`` (prefilled here), as a call that
    cuts its cache back, so every call sees the same context. Sampling is left out: both loops sample alike."""
    if len(context) < 2:
        raise ValueError("vanilla_steps needs a context of at least 2 tokens (one to prefill, one to decode)")
    device = target.device
    plain = SlackCache()
    target.model(input_ids=torch.tensor([context[:-1]], device=device), cache=plain, use_cache=True)
    x = torch.tensor([[context[-1]]], device=device)
    state = DecodeState([context], SamplingParams(max_new_tokens=1), (), device)
    prefill(target, state)
    slots = state.kv_valid.shape[1]

    @torch.inference_mode()
    def plain_step() -> None:
        target.model(input_ids=x, cache=plain, use_cache=True)
        plain.crop(-1)  # transformers 5: a negative count removes that many tokens

    @torch.inference_mode()
    def masked_step() -> None:
        _masked_forward(target, state)
        for layer in state.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :slots], layer.values[:, :, :slots]

    return {"plain": plain_step, "masked": masked_step}


def decode_continuous(
    target: TargetModel,
    submit: Callable[[], list[tuple[object, list[int]]]],
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
    slot layout above), so greedy answers equal those of one-at-a-time decoding up to the kernels' rounding. One
    random stream serves all rows (T > 0 samples are not tied to a row's batch)."""
    refill = max(1, refill if refill is not None else batch_size // 4)
    stats = GenerationStats(tree_nodes=1)
    t0 = clock(target.device)
    gen = _seeded_generator(params, target.device)
    state: DecodeState | None = None
    keys: dict[int, object] = {}
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
        for row in _vanilla_step(target, state, params, gen, stats):
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
    """``state`` with ``prompts`` prefilled and appended as new rows (their row ids continue the old ones); the two
    caches are left-padded to one width (invalid slots) and concatenated along the batch."""
    fresh = DecodeState(prompts, params, eos_ids, target.device)
    prefill(target, fresh)
    if state is None or not state.active:
        base = 0 if state is None else len(state.contexts)
        if state is not None:  # keep row ids unique across the run
            fresh.contexts = state.contexts + fresh.contexts
            fresh.new_tokens = state.new_tokens + fresh.new_tokens
            fresh.active = [base + r for r in fresh.active]
        keys.update({base + i: k for i, k in enumerate(new_keys)})
        return fresh
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
    if not fresh.cache.layers:  # prompts of one token: nothing was prefilled, every slot of theirs is invalid
        fresh_kv = [(layer.keys[:0], layer.values[:0]) for layer in state.cache.layers]
        fresh_kv = [
            (k.new_zeros(len(prompts), *k.shape[1:]), v.new_zeros(len(prompts), *v.shape[1:])) for k, v in fresh_kv
        ]
    else:
        fresh_kv = [(layer.keys, layer.values) for layer in fresh.cache.layers]
    for layer, (k, v) in zip(state.cache.layers, fresh_kv):
        layer.keys = torch.cat([left_pad(layer.keys, 2, 0.0), left_pad(k, 2, 0.0)], 0)
        layer.values = torch.cat([left_pad(layer.values, 2, 0.0), left_pad(v, 2, 0.0)], 0)
    state.contexts += fresh.contexts
    state.new_tokens += fresh.new_tokens
    state.active += [base + r for r in fresh.active]
    keys.update({base + i: k for i, k in enumerate(new_keys)})
    return state


# ------------------------------------------------------------------------------------- speculative
@dataclass
class SpecConfig:
    accept: str = "auto"
    """"auto" (greedy at T=0, rejection sampling otherwise; both lossless) or "typical" (Medusa; lossy)."""
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3

    def __post_init__(self) -> None:
        if self.accept not in ("auto", "typical"):
            raise ValueError(f"accept must be 'auto' or 'typical', got {self.accept!r}")


def verify_tree(target: TargetModel, state: DecodeState, tree: DraftTree, capture_aux: bool = False):
    """One target forward over every row's tree: 4D ancestor mask, positions = root position + depth."""
    B, n = tree.tokens.shape
    anc = tree.ancestor_mask() & (tree.valid[:, None, :] | torch.eye(n, dtype=torch.bool, device=tree.tokens.device))
    allowed = torch.cat([state.kv_valid[:, None, :].expand(B, n, -1), anc], dim=2)
    positions = state.lengths[:, None] + tree.depths()
    return target(
        tree.tokens,
        attention_mask=additive_mask(allowed, target.dtype),
        position_ids=positions,
        past_key_values=state.cache,
        use_cache=True,
        capture_aux=capture_aux,
    )


def keep_accepted(state: DecodeState, result: AcceptResult, n: int) -> torch.Tensor:
    """Compact the tree region of the cache to each row's accepted path; returns the path lengths."""
    S_old = state.kv_valid.shape[1]
    L = int(result.length.max())
    keep = result.path[:, :L].clamp(min=0)  # -1 padding → node 0; those slots are marked invalid below
    steps = torch.arange(L, device=keep.device)[None]
    new_valid = steps < result.length[:, None]
    # chains (and trees whose first branch won) accept nodes 0..L-1, already in place: then only truncate
    moved = not bool(((keep == steps) | ~new_valid).all())
    for layer in state.cache.layers:
        if moved:  # write the accepted path over the start of the tree region
            layer.keys[:, :, S_old : S_old + L] = compact_kv(layer.keys[:, :, S_old:], keep)
            layer.values[:, :, S_old : S_old + L] = compact_kv(layer.values[:, :, S_old:], keep)
        layer.keys, layer.values = layer.keys[:, :, : S_old + L], layer.values[:, :, : S_old + L]  # views, no copy
    state.kv_valid = torch.cat([state.kv_valid, new_valid], 1)
    return result.length


@torch.inference_mode()
def generate_speculative(
    target: TargetModel,
    proposer: Proposer,
    prompts: list[list[int]],
    params: SamplingParams,
    eos_ids: tuple[int, ...] = (),
    spec: SpecConfig | None = None,
) -> GenerationResult:
    """Draft → verify the whole tree in one target forward → accept → keep the accepted path.

    Lossless with ``spec.accept == "auto"``: token-identical to vanilla at T = 0 (up to numerical
    ties) and distributed exactly as the target's warped distribution at T > 0. When both run under
    ``infer.kernels.shape_invariant`` (opt-in), the logits too are bitwise vanilla's, so ties cannot part them.
    """
    spec = spec or SpecConfig()
    stats = GenerationStats()
    t0 = clock(target.device)
    state = DecodeState(prompts, params, eos_ids, target.device)
    gen = _seeded_generator(params, target.device)
    proposer.begin([list(c) for c in state.contexts])
    if not proposer.drafts:
        return generate_vanilla(proposer.vanilla_target or target, prompts, params, eos_ids)
    signal = proposer.signal
    aux = signal is TargetSignal.AUX  # the other signals come with every forward (final-norm hook)
    out = prefill(target, state, capture_aux=aux)
    if signal is not TargetSignal.NONE and out is not None:
        # prefill is left-padded; observe() takes each row's signal from index 0
        lengths, width = state.lengths, state.kv_valid.shape[1]
        idx = (width - lengths[:, None] + torch.arange(width, device=lengths.device)[None]).clamp(max=width - 1)
        feats = signal.of(out)
        proposer.observe(feats.gather(1, idx[..., None].expand(-1, -1, feats.shape[-1])), lengths)
    stats.prefill_s = clock(target.device) - t0

    while state.active:
        td = clock(target.device)
        tree = proposer.propose([state.contexts[r] for r in state.active], params, gen)
        stats.draft_s += clock(target.device) - td

        tv = clock(target.device)
        out = verify_tree(target, state, tree, capture_aux=aux)
        stats.verify_s += clock(target.device) - tv

        tb = clock(target.device)
        B, n = tree.tokens.shape
        stats.tree_nodes = max(stats.tree_nodes, n)
        if spec.accept == "typical":
            result = accept_typical(
                tree,
                out.logits,
                params,
                torch.rand(B, n, generator=gen, device=gen.device),
                spec.typical_epsilon,
                spec.typical_delta,
            )
        elif params.greedy:
            result = verify_greedy(tree, out.logits)
        else:
            result = verify_rejection(
                tree,
                target_probs(out.logits, params),
                torch.rand(B, n, generator=gen, device=gen.device),
                torch.rand(B, n, generator=gen, device=gen.device),
            )
        lengths = keep_accepted(state, result, n)
        if signal is not TargetSignal.NONE:
            idx = result.path[:, : int(lengths.max())].clamp(min=0)
            feats = signal.of(out)
            proposer.observe(feats.gather(1, idx[..., None].expand(-1, -1, feats.shape[-1])), lengths)

        depth = int(tree.depths().masked_fill(~tree.valid, 0).max())
        finished = []
        path, length, bonus = result.path.tolist(), lengths.tolist(), result.bonus.tolist()
        tokens = tree.tokens.tolist()
        for i in range(B):
            accepted = [tokens[i][j] for j in path[i][1 : length[i]]]
            before = len(state.new_tokens[state.active[i]])
            finished.append(state.emit(i, accepted + [bonus[i]]))
            stats.new_tokens += len(state.new_tokens[state.active[i]]) - before
            stats.record_acceptance(length[i] - 1, depth)
        stats.rounds += 1
        stats.row_forwards += B
        keep = state.drop_finished(finished)
        if keep is not None:
            proposer.drop_rows(keep)
        stats.bookkeeping_s += clock(target.device) - tb
    stats.total_s = clock(target.device) - t0
    return GenerationResult(state.new_tokens, stats)
