"""The ``drafters`` command.

drafters quickstart [--max-new-tokens N] [--prompts N]   # reference target: sample + τ + speedup
drafters bench [args of eval.bench_runtime]               # full runtime benchmark
drafters build-target [args of scripts/build_reference_target.py]
drafters regenerate [args of scripts/regenerate.py]       # self-distillation of a chat dataset
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quickstart(argv: list[str]) -> None:
    """Load the shipped reference target and draft model, continue held-out code, report τ and speedup."""
    ap = argparse.ArgumentParser(prog="drafters quickstart")
    ap.add_argument("--target", default=str(ROOT / "models" / "reference_target"))
    ap.add_argument("--draft", default=str(ROOT / "models" / "reference_draft"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from infer.generate import generate_speculative, generate_vanilla
    from infer.proposers import DraftModelProposer, PromptLookupProposer
    from infer.sampling import SamplingParams
    from models.target import TargetModel, load_tokenizer
    from train.stdlib_corpus import heldout_prompts

    t0 = time.time()
    tokenizer = load_tokenizer(args.target)
    target = TargetModel(AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32))
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    n_target = sum(p.numel() for p in target.model.parameters()) / 1e6
    n_draft = sum(p.numel() for p in draft.parameters()) / 1e6
    print(
        f"reference target {n_target:.1f} M params, draft model {n_draft:.1f} M params "
        f"(loaded in {time.time() - t0:.1f}s)"
    )
    samples = heldout_prompts(tokenizer, n=args.prompts)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    eos = (tokenizer.eos_token_id,)

    first = samples[0]
    out = generate_vanilla(target, [first["prompt_ids"]], params, eos)
    print(
        f"\n--- held-out prompt ({first['source']}) ---\n{first['prompt']}"
        f"\n--- greedy continuation ---\n{tokenizer.decode(out.tokens[0])}\n"
    )

    methods = {
        "vanilla": None,
        "prompt lookup": lambda: PromptLookupProposer(num_draft=10),
        "draft model (chain 4)": lambda: DraftModelProposer(draft, k=4),
    }
    totals = {m: [0, 0.0, 0, True] for m in methods}  # tokens, seconds, forwards, identical
    for s in samples:
        ref = generate_vanilla(target, [s["prompt_ids"]], params, eos)
        for name, make in methods.items():
            res = ref if make is None else generate_speculative(target, make(), [s["prompt_ids"]], params, eos)
            t = totals[name]
            t[0] += len(res.tokens[0])
            t[1] += res.stats.total_s
            t[2] += res.stats.row_forwards
            t[3] &= res.tokens[0] == ref.tokens[0]
    base = totals["vanilla"][0] / totals["vanilla"][1]
    print(f"{'method':<24}{'tau':>6}{'tokens/s':>10}{'speedup':>9}  greedy identical")
    for name, (tok, sec, fwd, same) in totals.items():
        print(f"{name:<24}{tok / fwd:>6.2f}{tok / sec:>10.1f}{tok / sec / base:>8.2f}x  {same}")
    print(
        f"\n{len(samples)} held-out prompts, T=0, max_new_tokens {args.max_new_tokens}; full benchmark: drafters bench"
    )


def _run_script(path: Path, argv: list[str]) -> None:
    sys.argv = [str(path), *argv]
    runpy.run_path(str(path), run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "quickstart": quickstart,
        "bench": lambda a: _run_module("eval.bench_runtime", a),
        "build-target": lambda a: _run_script(ROOT / "scripts" / "build_reference_target.py", a),
        "regenerate": lambda a: _run_script(ROOT / "scripts" / "regenerate.py", a),
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    commands[argv[0]](argv[1:])


def _run_module(name: str, argv: list[str]) -> None:
    sys.argv = [name, *argv]
    runpy.run_module(name, run_name="__main__")


if __name__ == "__main__":
    main()
