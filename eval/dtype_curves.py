"""What each dtype costs on this machine: square-GEMM rates and the real target's decode forward by row count.

    python -m eval.dtype_curves [--target smollm2-135m-instruct] [--dtypes float32,bfloat16] [--rows 1,2,4,8,16]
                                [--prefix 200] [--reps 12] [--out outputs/dtype_curves.json]

The measurements behind a precision decision, in the form docs/decisions.md quotes them: GEMM GFLOP/s at n = 512 /
1024 / 2048 per dtype, and the plain HF forward of the whole target (no kernel routing, no tree mask) after a ``--prefix``
-token cache at each row count, median of ``--reps``. It prints numbers and writes them; it decides nothing (the
decision is `models.precision`, which times the target's layer shapes the way the runtime serves them). Where bf16
is emulated (no avx512_bf16 / amx_bf16) its forwards take seconds: ``--bf16-reps`` keeps that part short.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from models.logits_to_keep import last_positions
from models.precision import machine
from models.reference import resolve_target
from models.timing import best_of, gemm_gflops, gemm_seconds


@torch.inference_mode()
def forward_ms(model, rows: list[int], prefix: int, reps: int) -> dict[int, float]:
    """Median ms of one cached forward of ``rows`` new tokens after ``prefix`` tokens (cache cut back each time)."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    cache = DynamicCache(config=model.config)
    ids = torch.randint(vocab, (1, prefix), generator=g)
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=last_positions(1, prefix))
    out = {}
    for m in rows:
        x = torch.randint(vocab, (1, m), generator=g)
        pos = torch.arange(prefix, prefix + m)[None]

        def step(x=x, pos=pos, m=m) -> None:
            model(input_ids=x, position_ids=pos, cache=cache, use_cache=True)
            cache.crop(-m)

        out[m] = 1e3 * best_of(step, reps).median
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--bf16-reps", type=int, default=None, help="reps for bf16 (default --reps; fewer where emulated)")
    ap.add_argument("--out", type=Path, default=Path("outputs") / "dtype_curves.json")
    args = ap.parse_args(argv)
    where = machine()
    print(f"machine: {where.words()}")
    result: dict = {"machine": where.as_dict(), "target": args.target, "prefix": args.prefix, "gemm_gflops": {}}
    dtypes = args.dtypes.split(",")
    for name in dtypes:
        dtype = getattr(torch, name)
        sizes = (512,) if name != "float32" and not where.native_bf16 else (512, 1024, 2048)
        result["gemm_gflops"][name] = {n: gemm_gflops(gemm_seconds(dtype, n).median, n) for n in sizes}
        print(f"GEMM {name}: " + ", ".join(f"n={n} {g:.1f} GFLOP/s" for n, g in result["gemm_gflops"][name].items()))
    rows = [int(r) for r in args.rows.split(",")]
    result["forward_ms"] = {}
    for name in dtypes:
        model = AutoModelForCausalLM.from_pretrained(resolve_target(args.target), dtype=getattr(torch, name)).eval()
        reps = args.reps if name == "float32" or args.bf16_reps is None else args.bf16_reps
        t0 = time.perf_counter()
        result["forward_ms"][name] = forward_ms(model, rows, args.prefix, reps)
        curve = result["forward_ms"][name]
        print(
            f"{name} forward after {args.prefix} tokens, median of {reps}: "
            + ", ".join(f"t({m}) {ms:.1f}" for m, ms in curve.items())
            + f" ms ({time.perf_counter() - t0:.0f} s)"
        )
        del model
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
