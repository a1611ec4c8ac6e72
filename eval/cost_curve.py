"""Verify-cost curve: what one target forward over n draft tokens costs, next to what a draft step costs.

Sizing a tree needs these numbers, not FLOPs: at batch 1 on a CPU a forward is dominated by per-op dispatch and
weight reads, and the marginal cost of one more verified token decides whether a deeper tree pays. Speculative
decoding wins ``τ · t(1) / (t_draft + t(n) + bookkeeping)`` per round, so the curve ``t(n) / t(1)`` and the draft
step cost bound what any drafter can reach.

Usage::

    python -m eval.cost_curve                                      # reference target (SmolLM2), outputs/cost_curve
    python -m eval.cost_curve --drafter models/smollm2_eagle3 --draft DIR --target any/folder --out DIR

Times are medians over ``--reps`` repetitions, with the sizes interleaved within each repetition so that machine
noise hits every size alike. Writes ``cost_curve.json`` and ``cost_curve.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from eval.measure import prepare_target
from eval.stdlib_corpus import heldout_prompts
from infer.generate import DecodeState, generate_speculative, prefill, verify_tree
from infer.proposer import Proposer, TargetSignal
from infer.sampling import SamplingParams
from infer.timing import timed
from infer.tree import chain
from models.target import TargetConfig, TargetModel, load_tokenizer

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def expected_tokens(alpha: list[float], k: int) -> float:
    """Tokens per round of a k-draft chain with per-depth acceptance α (bonus included): 1 + Σ_i Π_{j≤i} α_j."""
    total, run = 1.0, 1.0
    for a in alpha[:k]:
        run *= a
        total += run
    return total


def best_chain_length(
    alpha: list[float], draft_step_s: float, verify_s: dict[int, float], overhead_s: float = 0.0
) -> tuple[int, dict[int, float]]:
    """The chain length k maximising tokens per second, E(k) / (k·t_draft + t_verify(k + 1) + overhead), over the k
    for which α and the verify cost of k + 1 tokens are known (Sequoia's rule for chains). Returns (k, rate by k)."""
    rates = {
        k: expected_tokens(alpha, k) / (k * draft_step_s + verify_s[k + 1] + overhead_s)
        for k in range(1, len(alpha) + 1)
        if k + 1 in verify_s
    }
    if not rates:
        raise ValueError("need acceptance for depth 1 and the verify cost of 2 tokens at least")
    return max(rates, key=rates.get), rates


def size_chain(
    target: TargetModel,
    make: Callable[[int], Proposer],
    prompts: list[list[int]],
    max_k: int,
    eos_ids: tuple[int, ...],
    log: Callable[[str], None] = print,
) -> tuple[int, str]:
    """Pick a proposer's chain length on this machine: a pilot run at ``max_k`` (two prompts, 64 tokens) gives its
    per-depth acceptance, draft-step and bookkeeping costs; `verify_costs` gives t_verify(n) here and now; the
    length with the best predicted rate wins (`best_chain_length`). Returns (k, a one-line account)."""
    stats = [
        generate_speculative(target, make(max_k), [p], SamplingParams(max_new_tokens=64), eos_ids).stats
        for p in prompts[:2]
    ]
    rounds = max(1, sum(s.rounds for s in stats))
    att = [sum(s.attempted_at_depth[i] for s in stats if i < len(s.attempted_at_depth)) for i in range(max_k)]
    acc = [sum(s.accepted_at_depth[i] for s in stats if i < len(s.accepted_at_depth)) for i in range(max_k)]
    alpha = [a / t if t else 0.0 for a, t in zip(acc, att)]
    draft_step = sum(s.draft_s for s in stats) / rounds / max_k
    overhead = sum(s.bookkeeping_s for s in stats) / rounds
    curve = verify_costs(target, prompts[0], tuple(range(1, max_k + 2)), reps=5, aux=make(1).signal is TargetSignal.AUX)
    k, rates = best_chain_length(alpha, draft_step, curve, overhead)
    account = (
        f"chain length {k} of 1..{max_k} (pilot α {' '.join(f'{a:.2f}' for a in alpha)}, draft step "
        f"{1e3 * draft_step:.1f} ms, verify ms {' '.join(f'{n}:{1e3 * t:.0f}' for n, t in curve.items())}; predicted "
        f"tokens/s by k {' '.join(f'{i}:{r:.1f}' for i, r in rates.items())})"
    )
    log(f"cost curve: {account}")
    return k, account


@torch.inference_mode()
def verify_costs(target: TargetModel, context: list[int], sizes: tuple[int, ...], reps: int, aux: bool) -> dict:
    """Median seconds of ``verify_tree`` over a chain of n nodes after ``context``; the cache is cut back after
    each call so every call sees the same context length."""
    state = DecodeState([context], SamplingParams(max_new_tokens=1), (), target.device)
    prefill(target, state, capture_aux=aux)
    S = state.kv_valid.shape[1]
    trees = {n: chain(torch.randint(0, target.vocab_size, (1, n), device=target.device)) for n in sizes}

    def run(n: int) -> None:
        verify_tree(target, state, trees[n], capture_aux=aux)
        for layer in state.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :S], layer.values[:, :, :S]

    for n in sizes:  # warm-up
        run(n)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(reps):
        for n in sizes:
            times[n].append(timed(lambda n=n: run(n), target.device))
    if any(layer.keys.shape[2] != S for layer in state.cache.layers):
        raise RuntimeError("the cache grew during timing: later sizes saw a longer context")
    return {n: statistics.median(t) for n, t in times.items()}


@torch.inference_mode()
def vanilla_step_cost(model, context: list[int], reps: int) -> float:
    """Median seconds of one cached single-token forward without a mask (the batch-1 vanilla loop's step)."""
    cache = DynamicCache()
    model(input_ids=torch.tensor([context[:-1]]), cache=cache, use_cache=True)
    x = torch.tensor([[context[-1]]])

    def run() -> None:
        model(input_ids=x, cache=cache, use_cache=True)
        cache.crop(-1)  # transformers 5: a negative count removes that many tokens

    run()
    return statistics.median(timed(run, model.device) for _ in range(reps))


@torch.inference_mode()
def eagle3_step_costs(target: TargetModel, drafter_dir: str, context_len: int, reps: int) -> dict:
    """Median seconds of one EAGLE-3 drafter step (1 new token, ``context_len`` cached pairs): module and fused."""
    from models.eagle3 import Eagle3Drafter, FusedStep

    drafter = Eagle3Drafter.from_pretrained(drafter_dir, target).eval()
    fused, cfg = FusedStep(drafter), drafter.config
    kv = torch.randn(1, cfg.num_key_value_heads, context_len, cfg.head_dim)
    args = (
        torch.randn(1, 1, cfg.hidden_size),
        torch.tensor([[1]]),
        torch.tensor([[context_len]]),
        torch.ones(1, 1, context_len + 1, dtype=torch.bool),
        kv,
        kv.clone(),
    )
    out = {}
    for name, step in (("module", drafter.step), ("fused", fused.step)):
        step(*args)
        out[name] = statistics.median(timed(lambda step=step: step(*args), target.device) for _ in range(reps))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="short name, folder or hub id")
    ap.add_argument("--draft", default=None, help="small draft model sharing the target's tokenizer (optional)")
    ap.add_argument("--drafter", default=None, help="EAGLE-3 checkpoint whose step to time (optional)")
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="outputs/cost_curve", help="folder for cost_curve.json / cost_curve.md")
    args = ap.parse_args(argv)

    tokenizer = load_tokenizer(args.target)
    aux = None
    if args.drafter:
        from models.eagle3 import read_checkpoint_config

        aux = read_checkpoint_config(args.drafter)[1].aux_layer_ids
    target = TargetModel.from_config(TargetConfig(name_or_path=args.target, dtype="float32", aux_layer_ids=aux))
    # every model is loaded and checked against the target before any timing (a mismatch fails in seconds)
    draft = None
    if args.draft:
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
        if draft.get_output_embeddings().weight.shape[0] != target.vocab_size:
            raise SystemExit(
                f"--draft {args.draft} has a vocabulary of {draft.get_output_embeddings().weight.shape[0]} tokens, "
                f"the target {target.vocab_size}: a draft model must share the target's tokenizer"
            )
    if args.drafter:
        from models.eagle3 import Eagle3Drafter

        Eagle3Drafter.from_pretrained(args.drafter, target, tokenizer)  # raises on a drafter of another target
    ids = [t for p in heldout_prompts(tokenizer, n=8) for t in p["prompt_ids"]]
    if len(ids) < args.context + 1:
        raise SystemExit(f"held-out prompts give {len(ids)} tokens, fewer than --context {args.context}")
    context = ids[: args.context + 1]
    prepare_target(target)  # the same routed kernels as every report (infer/kernels/cpu_linear.py)
    print(f"target {args.target}, context {args.context}, {args.reps} reps, torch threads {torch.get_num_threads()}")

    result = {
        "target": args.target,
        "context": args.context,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "vanilla_step_s": vanilla_step_cost(target.model, context, args.reps),
        "verify_s": verify_costs(target, context, SIZES, args.reps, aux=False),
        "verify_with_features_s": verify_costs(target, context, SIZES, args.reps, aux=True),
    }
    if draft is not None:
        result["draft_model_step_s"] = vanilla_step_cost(draft, context, args.reps)
    if args.drafter:
        result["eagle3_step_s"] = eagle3_step_costs(target, args.drafter, args.context, args.reps)

    t1 = result["vanilla_step_s"]
    lines = [
        f"# Verify-cost curve ({time.strftime('%Y-%m-%d')})",
        "",
        f"Target `{args.target}`, fp32, {result['machine']}, torch threads {result['threads']}, "
        f"{args.context} tokens in the cache, medians of {args.reps} interleaved repetitions "
        "(`python -m eval.cost_curve`).",
        "",
        f"Vanilla step (1 token, no mask): {1e3 * t1:.2f} ms.",
        "",
        "| verified tokens n | verify ms | × vanilla step | with EAGLE-3 features ms |",
        "|---|---|---|---|",
    ]
    for n in SIZES:
        v, vf = result["verify_s"][n], result["verify_with_features_s"][n]
        lines.append(f"| {n} | {1e3 * v:.2f} | {v / t1:.2f} | {1e3 * vf:.2f} |")
    lines.append("")
    if "draft_model_step_s" in result:
        s = result["draft_model_step_s"]
        lines.append(f"Draft model step (1 token): {1e3 * s:.2f} ms = {s / t1:.2f} × the vanilla step.")
    if "eagle3_step_s" in result:
        e = result["eagle3_step_s"]
        lines.append(
            f"EAGLE-3 drafter step (1 token): {1e3 * e['fused']:.2f} ms fused, {1e3 * e['module']:.2f} ms module path "
            f"= {e['fused'] / t1:.2f} × the vanilla step."
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost_curve.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "cost_curve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
