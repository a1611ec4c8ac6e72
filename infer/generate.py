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

What a call reports is in `infer.stats`; vanilla decoding with continuous batching, on this layout, in
`infer.continuous`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from infer.accept import AcceptResult, accept_typical
from infer.attention import SlackCache, additive_mask
from infer.kernels import compact_kv, verify_greedy, verify_rejection
from infer.proposer import Proposer, TargetSignal
from infer.sampling import SamplingParams, greedy_ids, sample_from_probs, target_probs, warp_logits
from infer.stats import GenerationResult, GenerationStats
from infer.tree import DraftTree
from models.logits_to_keep import last_positions
from models.target import TargetModel, TargetOutput
from models.timing import clock


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
        """Remove finished rows from the batch and the cache; returns ``keep`` (new batch index j holds old row
        ``keep[j]``) or None. The live rows past the new batch's end move into the finished rows' places, so a cache
        moves only those rows (`infer.attention.SlackLayer.batch_select_indices`), not every row behind the first
        finished one: at batch 96 a drop that copied the whole cache was 4 % of the answerer's time."""
        if not any(finished):
            return None
        live = len(finished) - sum(finished)
        order = list(range(live))
        for hole, row in zip(
            (i for i in range(live) if finished[i]), (i for i in range(live, len(finished)) if not finished[i])
        ):
            order[hole] = row
        keep = torch.tensor(order, dtype=torch.long, device=self.device)
        self.active = [self.active[i] for i in keep.tolist()]
        for layer in self.cache.layers:
            layer.batch_select_indices(keep)
        self.kv_valid = self.kv_valid.index_select(0, keep)
        return keep


@torch.no_grad()
def prefill(target: TargetModel, state: DecodeState, capture_aux: bool = False) -> TargetOutput | None:
    """Write ``prompt[:-1]`` of every row into the cache (left-padded). Returns the TargetOutput (None when every
    prompt is one token: nothing to write)."""
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
def seeded_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator:
    """The one random stream of a decoding call: ``params.seed`` fixes it, else torch's global generator seeds it."""
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


def _next_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """logits [B, V] → [B] token ids (argmax at T = 0, else a sample of the warped distribution)."""
    if params.greedy:
        return greedy_ids(logits)
    u = torch.rand(logits.shape[0], generator=gen, device=logits.device)
    return sample_from_probs(warp_logits(logits, params).softmax(-1), u)


def _vanilla_single(target: TargetModel, prompt: list[int], params: SamplingParams, stop: set[int]) -> GenerationResult:
    """Batch 1: the leanest loop HF offers (no mask, implicit positions, the sampled tensor fed back)."""
    stats = GenerationStats(tree_nodes=1)
    t0 = clock(target.device)
    gen = seeded_generator(params, target.device)
    model, cache = target.model, SlackCache()
    if len(prompt) > 1:  # logits of the prompt are never read (HF generate skips them too)
        model(
            input_ids=torch.tensor([prompt[:-1]], device=target.device),
            cache=cache,
            use_cache=True,
            logits_to_keep=last_positions(1, len(prompt) - 1, target.device),
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
    gen = seeded_generator(params, target.device)
    prefill(target, state)
    stats.prefill_s = clock(target.device) - t0
    while state.active:
        vanilla_round(target, state, params, gen, stats)
    stats.total_s = clock(target.device) - t0
    return GenerationResult(state.new_tokens, stats)


def vanilla_round(
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


def verify_tree(target: TargetModel, state: DecodeState, tree: DraftTree, capture_aux: bool = False) -> TargetOutput:
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
        keys, values = layer.keys, layer.values  # read once: a layer's properties slice its buffers on every read
        if moved:  # write the accepted path over the start of the tree region
            keys[:, :, S_old : S_old + L] = compact_kv(keys[:, :, S_old:], keep)
            values[:, :, S_old : S_old + L] = compact_kv(values[:, :, S_old:], keep)
        layer.keys, layer.values = keys[:, :, : S_old + L], values[:, :, : S_old + L]  # views, no copy
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
    gen = seeded_generator(params, target.device)
    proposer.begin([list(c) for c in state.contexts])
    if not proposer.drafts:
        return generate_vanilla(proposer.vanilla_target or target, prompts, params, eos_ids)
    _prefill_observed(target, proposer, state)
    stats.prefill_s = clock(target.device) - t0
    while state.active:
        _speculative_round(target, proposer, state, params, spec, gen, stats)
    stats.total_s = clock(target.device) - t0
    return GenerationResult(state.new_tokens, stats)


def _prefill_observed(target: TargetModel, proposer: Proposer, state: DecodeState) -> None:
    """`prefill`, handing the proposer the signal it declared for every prompt token the cache took."""
    signal = proposer.signal
    out = prefill(target, state, capture_aux=signal is TargetSignal.AUX)
    if signal is not TargetSignal.NONE and out is not None:
        # prefill is left-padded; observe() takes each row's signal from index 0
        lengths, width = state.lengths, state.kv_valid.shape[1]
        idx = (width - lengths[:, None] + torch.arange(width, device=lengths.device)[None]).clamp(max=width - 1)
        _observe(proposer, out, idx, lengths)


def _speculative_round(
    target: TargetModel,
    proposer: Proposer,
    state: DecodeState,
    params: SamplingParams,
    spec: SpecConfig,
    gen: torch.Generator,
    stats: GenerationStats,
) -> None:
    """One round over every active row: propose a tree, verify it in one target forward, accept a path and a bonus
    token, keep the path in the cache, emit it, and drop the rows that finished."""
    signal = proposer.signal
    td = clock(target.device)
    tree = proposer.propose([state.contexts[r] for r in state.active], params, gen)
    stats.draft_s += clock(target.device) - td

    tv = clock(target.device)
    # only the aux taps need asking for: the other signals come with every forward (final-norm hook)
    out = verify_tree(target, state, tree, capture_aux=signal is TargetSignal.AUX)
    stats.verify_s += clock(target.device) - tv

    tb = clock(target.device)
    n = tree.tokens.shape[1]
    stats.tree_nodes = max(stats.tree_nodes, n)
    result = _accept(tree, out.logits, params, spec, gen)
    lengths = keep_accepted(state, result, n)
    if signal is not TargetSignal.NONE:
        _observe(proposer, out, result.path[:, : int(lengths.max())].clamp(min=0), lengths)
    finished = _emit_accepted(state, tree, result, lengths, stats)
    keep = state.drop_finished(finished)
    if keep is not None:
        proposer.drop_rows(keep)
    stats.bookkeeping_s += clock(target.device) - tb


def _accept(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, spec: SpecConfig, gen: torch.Generator
) -> AcceptResult:
    """The accept rule that ``spec`` and the temperature name (typical, greedy or rejection sampling), on the verify
    logits [B, n, V]; its uniforms come from ``gen``, so a seed fixes every round."""
    B, n = tree.tokens.shape
    if spec.accept == "typical":
        return accept_typical(
            tree,
            logits,
            params,
            torch.rand(B, n, generator=gen, device=gen.device),
            spec.typical_epsilon,
            spec.typical_delta,
        )
    if params.greedy:
        return verify_greedy(tree, logits)
    return verify_rejection(
        tree,
        target_probs(logits, params),
        torch.rand(B, n, generator=gen, device=gen.device),
        torch.rand(B, n, generator=gen, device=gen.device),
    )


def _observe(proposer: Proposer, out: TargetOutput, nodes: torch.Tensor, lengths: torch.Tensor) -> None:
    """Hand the proposer its signal at ``nodes`` [B, L] (indices into each row's tokens of the forward ``out``), of
    which the first ``lengths`` [B] entered the cache."""
    feats = proposer.signal.of(out)
    proposer.observe(feats.gather(1, nodes[..., None].expand(-1, -1, feats.shape[-1])), lengths)


def _emit_accepted(
    state: DecodeState, tree: DraftTree, result: AcceptResult, lengths: torch.Tensor, stats: GenerationStats
) -> list[bool]:
    """Every row emits its accepted draft tokens and the bonus token; the round's acceptance goes into ``stats``.
    Returns which rows finished."""
    B = tree.tokens.shape[0]
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
    return finished
