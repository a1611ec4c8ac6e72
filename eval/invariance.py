"""Is a row computed alone the same as that row computed among k + 1? Per component and end to end, fp32 and bf16,
with the shape-invariant mode (infer/kernels/shape_invariant.py) off and on.

    python -m eval.invariance                    # the table: tiny and medium random Llamas, fp32 and bf16
    python -m eval.invariance --cost             # + what the mode costs: ms per forward, tokens/s
    python -m eval.invariance --only-cost --threads 1 --sizes '' --target smollm2-135m-instruct --dtypes float32

"Alone" is how vanilla decoding computes a token (one row per forward; for attention HF's batch-1 path: no mask,
exactly the keys before it); "among" is row j of a verify forward over a chain of k + 1 tokens (4D additive mask
over a cache with k - j masked columns). A cell gives the fraction of rows that are bitwise equal and the largest
|difference|. Inputs of the component rows are random at the model's shapes; the end-to-end rows run the model:
"logits" compares each position's logits from 1-token forwards with the same positions' logits from one
``verify_tree`` forward over the chain; "greedy answers" compares whole greedy answers of ``generate_vanilla`` and
``generate_speculative`` (prompt lookup, chain of k) on repetitive prompts. RMSNorm, rotary and SiLU are not changed
by the mode (their "on" cells repeat the "off" ones).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import eager_attention_forward

from infer.generate import DecodeState, generate_speculative, generate_vanilla, prefill, verify_tree
from infer.kernels import cpu_linear
from infer.kernels.shape_invariant import DEFAULT_ROWS, blocked_linear, install, invariant_attention, uninstall
from infer.proposers import PromptLookupProposer
from infer.sampling import SamplingParams
from infer.serving import prepare_target
from infer.tree import chain
from models.logits_to_keep import last_positions
from models.target import DTYPES, TargetConfig, TargetModel
from models.timing import Timing, timed

K = 4
"""Drafts per verify: rows are compared alone and among a chain of K + 1."""
CONTEXTS = (20, 60, 120, 250)
"""Tokens in the cache before the chain (``--contexts``): bf16 sdpa rows differed at some lengths and not at others
(medium model: 20, 60, 250 yes, 35, 120 no), so attention and logits cells pool several."""
ROTARY_POSITION = 120
"""First position of the rotary cell's chain."""

SIZES = {"tiny": dict(vocab=97, layers=2, hidden=32), "medium": dict(vocab=4096, layers=4, hidden=256)}


def random_llama(vocab: int, layers: int, hidden: int, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama (head_dim 8 tiny, 64 medium) whose lm_head is scaled so logits reach 16-32 as in real models
    (where a bf16 ulp is 0.125-0.25): random init alone gives logits of ~0.3, where bf16 rounding is finer."""
    torch.manual_seed(seed)
    heads = max(4, hidden // 64)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0 / (0.02 * hidden**0.5))  # logit std ~8
    return model


def compare_rows(alone: Callable[[int], torch.Tensor], together: torch.Tensor) -> tuple[float, float]:
    """(fraction of rows j with alone(j) bitwise equal to together[j], max |alone(j) - together[j]|)."""
    a = torch.stack([alone(j) for j in range(together.shape[0])]).float()
    t = together.float()
    return float((a == t).flatten(1).all(1).float().mean()), float((a - t).abs().max())


def merge(cells: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.mean(c[0] for c in cells), max(c[1] for c in cells)


# ------------------------------------------------------------------------------------------------------ components
def linear_cell(model: PreTrainedModel, dtype: torch.dtype, layout: str, on: bool, rows: int) -> tuple[float, float]:
    """Every weight shape of the model, through one layout: F.linear or a cpu_linear layout (rows padded to their
    bucket as cpu_linear does); with the mode, in blocks of ``rows`` rows."""
    cells, seen = [], set()
    for module in model.modules():
        if not isinstance(module, nn.Linear) or tuple(module.weight.shape) in seen:
            continue
        seen.add(tuple(module.weight.shape))
        if layout == "linear":
            f = lambda b, m=module: F.linear(b, m.weight, m.bias)
        else:
            f = lambda b, m=module: cpu_linear.small_rows_linear(m, b, (layout,) * len(cpu_linear.BUCKETS))
        g = (lambda b, f=f: blocked_linear(b, f, rows)) if on else f
        x = torch.randn(K + 1, module.in_features, dtype=dtype)
        cells.append(compare_rows(lambda j, g=g, x=x: g(x[j : j + 1])[0], g(x)))
    return merge(cells)


def rms_norm_cell(model: PreTrainedModel, dtype: torch.dtype) -> tuple[float, float]:
    x = torch.randn(1, K + 1, model.config.hidden_size, dtype=dtype)
    norm = model.model.norm
    return compare_rows(lambda j: norm(x[:, j : j + 1])[0, 0], norm(x)[0])


def rotary_cell(model: PreTrainedModel, dtype: torch.dtype) -> tuple[float, float]:
    x = torch.zeros(1, dtype=dtype)
    pos = torch.arange(ROTARY_POSITION, ROTARY_POSITION + K + 1)[None]
    rotary = model.model.rotary_emb

    def cos_sin(p: torch.Tensor) -> torch.Tensor:
        return torch.cat(rotary(x, p), -1)[0]

    return compare_rows(lambda j: cos_sin(pos[:, j : j + 1])[0], cos_sin(pos))


def silu_cell(model: PreTrainedModel, dtype: torch.dtype) -> tuple[float, float]:
    mlp = model.model.layers[0].mlp
    gate, up = (torch.randn(K + 1, mlp.intermediate_size, dtype=dtype) for _ in range(2))
    return compare_rows(lambda j: (mlp.act_fn(gate[j : j + 1]) * up[j : j + 1])[0], mlp.act_fn(gate) * up)


def attention_cell(
    model: PreTrainedModel, dtype: torch.dtype, impl: str, on: bool, context: int
) -> tuple[float, float]:
    """Row j alone: its query over exactly its context + j + 1 keys (sdpa: no mask, as HF's batch-1 decode step;
    eager: HF's all-open mask); among: the verify call over context + K + 1 keys with the chain's additive mask."""
    module = model.model.layers[0].self_attn
    cfg = model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, module.head_dim
    S = context + K + 1
    q = torch.randn(1, hq, K + 1, d, dtype=dtype)
    k, v = (torch.randn(1, hkv, S, d, dtype=dtype) for _ in range(2))
    allowed = torch.ones(K + 1, S, dtype=torch.bool)
    allowed[:, context:] = torch.ones(K + 1, K + 1, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, K + 1, S, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    fn = invariant_attention if on else {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}[impl]

    def alone(j: int) -> torch.Tensor:
        n = context + j + 1
        own = None if (impl == "sdpa" and not on) else torch.zeros(1, 1, 1, n, dtype=dtype)
        return fn(module, q[:, :, j : j + 1], k[:, :, :n], v[:, :, :n], own, scaling=module.scaling)[0][0, 0]

    return compare_rows(alone, fn(module, q, k, v, mask, scaling=module.scaling)[0][0])


# ------------------------------------------------------------------------------------------------------ end to end
@torch.inference_mode()
def logits_cell(target: TargetModel, context: int, trials: int = 4) -> tuple[float, float]:
    """Logits of positions context - 1 .. context + K - 1 from 1-token forwards (the batch-1 vanilla loop's calls)
    against the same positions from one verify forward over the chain, after the runtime's prefill."""
    cells = []
    for _ in range(trials):
        seq = torch.randint(0, target.vocab_size, (context + K,)).tolist()
        cache = DynamicCache()
        keep = last_positions(1, context - 1)
        target.model(input_ids=torch.tensor([seq[: context - 1]]), cache=cache, use_cache=True, logits_to_keep=keep)
        alone = [
            target.model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1]
            for t in seq[context - 1 :]
        ]
        state = DecodeState([seq[:context]], SamplingParams(), (), target.device)
        prefill(target, state)
        together = verify_tree(target, state, chain(torch.tensor([seq[context - 1 :]]))).logits[0]
        cells.append(compare_rows(lambda j, a=alone: a[j], together))
    return merge(cells)


def repetitive_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Random phrases said three times: prompt lookup then drafts a mix of right and wrong tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (10,), generator=g).tolist() * 3 for _ in range(n)]


def greedy_cell(target: TargetModel, prompts: list[list[int]], max_new_tokens: int = 32) -> tuple[int, int]:
    """(answers identical between generate_vanilla and chain-of-K prompt-lookup speculative decoding, prompts)."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    same = 0
    for p in prompts:
        vanilla = generate_vanilla(target, [p], params).tokens
        same += generate_speculative(target, PromptLookupProposer(num_draft=K), [p], params).tokens == vanilla
    return same, len(prompts)


# ------------------------------------------------------------------------------------------------------ the table
def load_models(sizes: list[str], target: str | None) -> list[tuple[str, Callable[[torch.dtype], PreTrainedModel]]]:
    """(label, build(dtype)) for the random Llamas named in ``sizes`` and, when given, a real target."""
    out = []
    for size in sizes:
        c = SIZES[size]
        out.append((f"{size} ({c['layers']}×{c['hidden']}, V {c['vocab']})", lambda d, c=c: random_llama(**c).to(d)))
    if target is not None:
        dtype_name = lambda d: str(d).removeprefix("torch.")
        build = lambda d: TargetModel.from_config(TargetConfig(name_or_path=target, dtype=dtype_name(d))).model
        out.append((target, build))
    return out


def table(
    models: list[tuple[str, Callable[[torch.dtype], PreTrainedModel]]],
    dtypes: list[torch.dtype],
    rows: int,
    contexts: tuple[int, ...],
) -> None:
    """Print the table, one model at a time."""
    columns = [(d, on) for d in dtypes for on in (False, True)]
    head = " | ".join(f"{str(d).removeprefix('torch.')} {'on' if on else 'off'}" for d, on in columns)
    lines = [
        f"Bitwise-equal rows / max |Δ|, alone vs row j of {K + 1}, after {', '.join(map(str, contexts))} tokens "
        f"(mode rows={rows}, torch threads {torch.get_num_threads()}).",
        "",
        f"| model | component | {head} |",
        "|---|---|" + "---|" * len(columns),
    ]
    components: list[tuple[str, Callable[[PreTrainedModel, torch.dtype, bool], tuple[float, float]]]] = [
        ("linear F.linear", lambda m, d, on: linear_cell(m, d, "linear", on, rows)),
        ("linear x @ Wᵀ (cpu_linear x_wt)", lambda m, d, on: linear_cell(m, d, "x_wt", on, rows)),
        ("linear (W @ xᵀ)ᵀ (cpu_linear w_x)", lambda m, d, on: linear_cell(m, d, "w_x", on, rows)),
        ("attention sdpa", lambda m, d, on: merge([attention_cell(m, d, "sdpa", on, c) for c in contexts])),
        ("attention eager", lambda m, d, on: merge([attention_cell(m, d, "eager", on, c) for c in contexts])),
        ("RMSNorm", lambda m, d, on: rms_norm_cell(m, d)),
        ("rotary cos/sin", lambda m, d, on: rotary_cell(m, d)),
        ("SiLU(gate)·up", lambda m, d, on: silu_cell(m, d)),
    ]
    for label, build in models:
        built = {d: build(d) for d in dtypes}
        with torch.inference_mode():
            for name, cell in components:
                cells = []
                for d, on in columns:
                    torch.manual_seed(0)
                    cells.append(cell(built[d], d, on))
                lines.append(f"| {label} | {name} | " + " | ".join(f"{e:.2f} / {x:.1e}" for e, x in cells) + " |")
        logit_cells, greedy_cells = [], []
        for d, on in columns:
            target = TargetModel(built[d])
            prompts = repetitive_prompts(target.vocab_size, 6)
            if on:
                install(target.model, rows)
            torch.manual_seed(0)
            logit_cells.append(merge([logits_cell(target, c, trials=2) for c in contexts]))
            greedy_cells.append(greedy_cell(target, prompts))
            if on:
                uninstall(target.model)
        cells = " | ".join(f"{e:.2f} / {x:.1e}" for e, x in logit_cells)
        lines.append(f"| {label} | end to end: logits | {cells} |")
        cells = " | ".join(f"{s}/{n}" for s, n in greedy_cells)
        lines.append(f"| {label} | end to end: greedy answers identical | {cells} |")
        print("\n".join(lines), flush=True)
        lines = []


# ------------------------------------------------------------------------------------------------------ the cost
def _with_mode(target: TargetModel, rows: int | None, fn: Callable[[], object]) -> object:
    """``fn()`` with the mode off (rows None) or installed with ``rows``."""
    if rows is None:
        return fn()
    install(target.model, rows)
    try:
        return fn()
    finally:
        uninstall(target.model)


@torch.inference_mode()
def forward_times(
    target: TargetModel, ids: list[int], settings: list[int | None], reps: int
) -> dict[int | None, dict[str, float]]:
    """Median seconds per setting of the batch-1 vanilla step ("vanilla": one token, no mask) and of a verify forward
    over a chain of n tokens (str(n)), after ``ids``. Settings and sizes are interleaved in every repetition, so
    machine noise hits them alike; the caches are cut back after each call."""
    sizes = (1, K + 1, 8)
    cache = DynamicCache()
    keep = last_positions(1, len(ids) - 1)
    target.model(input_ids=torch.tensor([ids[:-1]]), cache=cache, use_cache=True, logits_to_keep=keep)
    state = DecodeState([ids], SamplingParams(), (), target.device)
    prefill(target, state)
    S = state.kv_valid.shape[1]
    trees = {n: chain(torch.randint(0, target.vocab_size, (1, n))) for n in sizes}
    x = torch.tensor([ids[-1:]])

    def vanilla_step() -> None:
        target.model(input_ids=x, cache=cache, use_cache=True)
        cache.crop(-1)

    def verify(n: int) -> None:
        verify_tree(target, state, trees[n])
        for layer in state.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :S], layer.values[:, :, :S]

    calls = {"vanilla": vanilla_step, **{str(n): lambda n=n: verify(n) for n in sizes}}
    times: dict[int | None, dict[str, list[float]]] = {r: {c: [] for c in calls} for r in settings}
    for rep in range(reps + 1):  # the first round warms up
        for rows in settings:
            for name, call in calls.items():
                seconds = _with_mode(target, rows, lambda call=call: timed(call, target.device))
                if rep:
                    times[rows][name].append(seconds)
    return {r: {c: Timing(tuple(t)).median for c, t in by.items()} for r, by in times.items()}


def cost(
    target: TargetModel,
    label: str,
    settings: list[int | None],
    prompts: list[list[int]],
    max_new_tokens: int,
    reps: int,
    context: int,
) -> list[str]:
    """Per setting (None = mode off, else the mode's block rows): `forward_times`, and tokens/s of vanilla and of
    chain-of-K prompt lookup with the settings interleaved prompt by prompt (prefill included, as a user sees it).
    cpu_linear's routing stays installed throughout, as in every report."""
    ids = (prompts[0] * (context // len(prompts[0]) + 1))[:context]
    params = SamplingParams(max_new_tokens=max_new_tokens)
    steps = forward_times(target, ids, settings, reps)
    stats: dict[int | None, tuple[list, list]] = {rows: ([], []) for rows in settings}
    for p in prompts:
        for rows in settings:
            van, spec = _with_mode(
                target,
                rows,
                lambda p=p: (
                    generate_vanilla(target, [p], params).stats,
                    generate_speculative(target, PromptLookupProposer(num_draft=K), [p], params).stats,
                ),
            )
            stats[rows][0].append(van)
            stats[rows][1].append(spec)

    def rate(runs: list) -> float:
        return sum(s.new_tokens for s in runs) / sum(s.total_s for s in runs)

    lines = []
    for rows in settings:
        t, (van, spec) = steps[rows], stats[rows]
        lines.append(
            f"| {label} | {'off' if rows is None else f'on, rows {rows}'} | "
            + " | ".join(f"{1e3 * t[c]:.2f}" for c in ("vanilla", "1", str(K + 1), "8"))
            + f" | {rate(van):.1f} | {rate(spec):.1f} | {statistics.mean(s.tau for s in spec):.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,medium", help=f"random Llamas, of {list(SIZES)} ('' for none)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="the mode's block row count in the table")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="tokens in the cache before the chain")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    ap.add_argument("--cost", action="store_true", help="also time t(n) and tokens/s, mode off and on")
    ap.add_argument("--only-cost", action="store_true", help="skip the invariance table")
    ap.add_argument("--target", default=None, help="a real target too (folder, hub id or reference short name)")
    ap.add_argument("--cost-context", type=int, default=200, help="tokens in the cache when timing t(n)")
    ap.add_argument("--cost-rows", default="1,8", help="block row counts of the mode to time beside the mode off")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes, dtypes = [s for s in args.sizes.split(",") if s], [DTYPES[d] for d in args.dtypes.split(",")]
    contexts = tuple(int(c) for c in args.contexts.split(","))
    models = load_models(sizes, args.target)
    if not args.only_cost:
        table(models, dtypes, args.rows, contexts)
    if not (args.cost or args.only_cost):
        return
    lines = [
        "",
        f"Cost (ms per forward after {args.cost_context} tokens, medians of {args.reps}; tokens/s of {args.prompts} "
        f"prompts × {args.max_new_tokens} tokens, chain-{K} prompt lookup; torch threads {torch.get_num_threads()}).",
        "",
        f"| model | mode | vanilla step | verify t(1) | t({K + 1}) | t(8) | vanilla tok/s | chain-{K} tok/s | τ |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, build in models:
        for d in dtypes:
            target = TargetModel(build(d))
            prepare_target(target, log=lambda msg: None)
            prompts = repetitive_prompts(target.vocab_size, args.prompts, seed=1)
            lines += cost(
                target,
                f"{name} {str(d).removeprefix('torch.')}",
                [None, *(int(r) for r in args.cost_rows.split(","))],
                prompts,
                args.max_new_tokens,
                args.reps,
                args.cost_context,
            )
            cpu_linear.uninstall(target.model)
            print("\n".join(lines), flush=True)
            lines = []


if __name__ == "__main__":
    main()
