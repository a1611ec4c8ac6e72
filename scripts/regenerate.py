"""Self-distillation: regenerate every assistant turn of a chat dataset with the target.

    python scripts/regenerate.py --target smollm2-135m-instruct \
        --data data/sharegpt.jsonl --out data/sharegpt_regen.jsonl --temperature 0.8

A drafter is trained to predict the *target's* tokens, so answers written by another model (ShareGPT,
UltraChat) are replaced by the target's own (EAGLE/Medusa practice, temperature ~0.8). Turns are
regenerated in order, each from the regenerated earlier turns; rows of prompts alone (``turns`` / ``prompt``
columns, or user turns without answers) are answered. Finished batches go to ``<out>.partial`` as they complete and a
rerun resumes there; the ``messages`` jsonl is written atomically at the end, and a run that writes nothing exits 1. The logic lives in ``train.data.regenerate.regenerate_dataset``; this file is the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train.data.dataset import DataConfig  # noqa: E402
from train.data.regenerate import answered_ids, regenerate_dataset  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="HF checkpoint directory (or hub name) of the target")
    ap.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="chat dataset: jsonl/json/parquet file, directory or hub name; more local files or directories are read "
        "as one dataset with the first",
    )
    ap.add_argument("--out", required=True, type=Path, help="output .jsonl (messages format)")
    ap.add_argument("--format", default="auto", choices=["auto", "sharegpt", "messages"])
    ap.add_argument("--split", default="train")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=2048, help="prompt + new tokens must fit")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--limit", type=int, help="regenerate only the first N rows")
    ap.add_argument("--sample", type=int, help="regenerate a random N rows (seeded by --seed), in that order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--exclude",
        nargs="+",
        default=[],
        help="answered files or folders (searched recursively): rows whose id is a source_id there are not answered "
        "again, and the sample is drawn from the rest",
    )
    ap.add_argument(
        "--stop-loops",
        type=int,
        help="end a turn once this many of its last tokens repeat the answer's own earlier text (a greedy loop; "
        "train/data/loops.py), counted; unset: every turn runs to an end token or --max-new-tokens",
    )
    ap.add_argument(
        "--dtype",
        default="fastest",
        choices=["fastest", "float32", "bfloat16", "float16"],
        help="fastest: the precision policy's choice for batched decoding (models/precision.py)",
    )
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    from models.precision import choose, user_choice
    from models.reference import resolve_target

    path = resolve_target(args.target)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if args.dtype == "fastest":
        choice = choose("distill", AutoConfig.from_pretrained(path), device)
    else:
        choice = user_choice("distill", args.dtype, f"--dtype {args.dtype}")
    print(choice.line())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, choice.dtype)).to(device)
    cfg = DataConfig(
        path=args.data[0], extra_paths=args.data[1:], split=args.split, format=args.format, max_length=args.max_length
    )
    counts = regenerate_dataset(
        model,
        tokenizer,
        cfg,
        args.out,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        limit=args.limit,
        sample=args.sample,
        seed=args.seed,
        exclude_ids=answered_ids(args.exclude) if args.exclude else frozenset(),
        stop_loops=args.stop_loops,
    )
    print(json.dumps(counts, indent=2))
    if counts["rows_written"] == 0:
        raise SystemExit(f"no rows regenerated from {args.data}: every row was skipped ({counts['skipped']})")
    print(f"wrote {counts['rows_written']} rows to {args.out}")
    return counts


if __name__ == "__main__":
    main()
