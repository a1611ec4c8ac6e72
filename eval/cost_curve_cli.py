"""The verify-cost curve of a target on this machine, with a draft model's and a drafter's step beside it
(the timers are `eval.cost_curve`'s, the ones the report sizes its settings with).

Usage::

    python -m eval.cost_curve_cli                                  # reference target (SmolLM2), outputs/cost_curve
    python -m eval.cost_curve_cli --drafter models/smollm2_eagle3 --draft DIR --target any/folder --out DIR

Times are the fastest of ``--reps`` repetitions (a drafter's step: the median), with the sizes interleaved within
each repetition so that machine noise hits every size alike. Writes ``cost_curve.json`` and ``cost_curve.md`` into
``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from eval.cost_curve import vanilla_step_cost, verify_costs
from eval.stdlib_corpus import heldout_prompts
from infer import forward_cost
from infer.families import family_of, load_drafter
from infer.serving import prepare_target
from models.checkpoint import read_checkpoint
from models.target import TargetConfig, TargetModel
from models.tokenizer import load_tokenizer

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
"""Verified-token counts of the curve ``python -m eval.cost_curve_cli`` writes."""


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="short name, folder or hub id")
    ap.add_argument("--draft", default=None, help="small draft model sharing the target's tokenizer (optional)")
    ap.add_argument(
        "--drafter", default=None, help="drafter checkpoint whose draft step to time, any family (optional)"
    )
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="outputs/cost_curve", help="folder for cost_curve.json / cost_curve.md")
    ap.add_argument("--dtype", default="fastest", help="target dtype (fastest: the precision policy's serving choice)")
    return ap.parse_args(argv)


def _load_models(
    args: argparse.Namespace,
) -> tuple[TargetModel, torch.nn.Module | None, torch.nn.Module | None, PreTrainedTokenizerBase]:
    """(target, draft model or None, drafter or None, tokenizer): every model loaded and checked against the target
    before any timing, so that a mismatch fails in seconds."""
    tokenizer = load_tokenizer(args.target)
    aux = read_checkpoint(args.drafter)[1].aux_layer_ids if args.drafter else None
    target = TargetModel.from_config(
        TargetConfig(name_or_path=args.target, dtype=args.dtype, aux_layer_ids=aux),
        "serve",
        prepare=forward_cost.quiet_routing,
    )
    print(target.precision.line())
    draft = None
    if args.draft:
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=target.dtype).eval()
        if draft.get_output_embeddings().weight.shape[0] != target.vocab_size:
            raise SystemExit(
                f"--draft {args.draft} has a vocabulary of {draft.get_output_embeddings().weight.shape[0]} tokens, "
                f"the target {target.vocab_size}: a draft model must share the target's tokenizer"
            )
    drafter = load_drafter(args.drafter, target, tokenizer).eval() if args.drafter else None  # raises on a mismatch
    return target, draft, drafter, tokenizer


def _context(tokenizer: PreTrainedTokenizerBase, tokens: int) -> list[int]:
    """``tokens`` + 1 tokens of held-out standard-library text: ``tokens`` in the cache, then the timed forward."""
    ids = [t for p in heldout_prompts(tokenizer, n=8) for t in p["prompt_ids"]]
    if len(ids) < tokens + 1:
        raise SystemExit(f"held-out prompts give {len(ids)} tokens, fewer than --context {tokens}")
    return ids[: tokens + 1]


def measure_curve(
    target: TargetModel,
    context: list[int],
    reps: int,
    draft: torch.nn.Module | None = None,
    drafter: torch.nn.Module | None = None,
) -> dict:
    """cost_curve.json without the target's name: vanilla's step, the verify curve over `SIZES` with and without the
    aux-layer taps, and where given the draft model's step and the drafter's (its family's ``step_timings``, when
    the family declares them)."""
    result = {
        "context": len(context) - 1,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "vanilla_step_s": vanilla_step_cost(target, context, reps),
        "verify_s": verify_costs(target, context, SIZES, reps, aux=False),
        "verify_with_features_s": verify_costs(target, context, SIZES, reps, aux=True),
    }
    if draft is not None:
        result["draft_model_step_s"] = vanilla_step_cost(TargetModel(draft), context, reps, "plain")
    family = family_of(drafter) if drafter is not None else None
    if family is not None and family.step_timings is not None:
        result["drafter_step_s"] = family.step_timings(drafter, target, len(context) - 1, reps)
    return result


def curve_markdown(result: dict, dtype: str, reps: int, method: str | None = None) -> list[str]:
    """cost_curve.md's lines: the verify curve as a table against vanilla's step, then the draft steps (``method``:
    the drafter's family, naming its row)."""
    t1 = result["vanilla_step_s"]
    lines = [
        f"# Verify-cost curve ({time.strftime('%Y-%m-%d')})",
        "",
        f"Target `{result['target']}`, {dtype}, {result['machine']}, torch threads {result['threads']}, "
        f"{result['context']} tokens in the cache, the fastest of {reps} interleaved repetitions "
        "(`python -m eval.cost_curve_cli`).",
        "",
        f"Vanilla step (1 token, no mask): {1e3 * t1:.2f} ms.",
        "",
        "| verified tokens n | verify ms | × vanilla step | with aux-layer features ms |",
        "|---|---|---|---|",
    ]
    for n in SIZES:
        v, vf = result["verify_s"][n], result["verify_with_features_s"][n]
        lines.append(f"| {n} | {1e3 * v:.2f} | {v / t1:.2f} | {1e3 * vf:.2f} |")
    lines.append("")
    if "draft_model_step_s" in result:
        s = result["draft_model_step_s"]
        lines.append(f"Draft model step (1 token): {1e3 * s:.2f} ms = {s / t1:.2f} × the vanilla step.")
    if "drafter_step_s" in result:
        paths = result["drafter_step_s"]
        lines.append(
            f"{method} drafter step (1 token), median by path: "
            + ", ".join(f"{name} {1e3 * s:.2f} ms = {s / t1:.2f} × the vanilla step" for name, s in paths.items())
            + "."
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    target, draft, drafter, tokenizer = _load_models(args)
    context = _context(tokenizer, args.context)
    prepare_target(target)  # the same routed kernels as every report (infer/kernels/cpu_linear.py)
    print(f"target {args.target}, context {args.context}, {args.reps} reps, torch threads {torch.get_num_threads()}")
    result = {"target": args.target} | measure_curve(target, context, args.reps, draft, drafter)
    method = family_of(drafter).method if drafter is not None else None
    dtype = str(target.dtype).removeprefix("torch.")
    lines = curve_markdown(result, dtype, args.reps, method)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost_curve.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "cost_curve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
