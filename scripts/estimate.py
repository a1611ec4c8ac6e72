"""Size a drafter training run before starting it: memory per GPU, offline feature-cache size, tokens per GPU-hour.

    python scripts/estimate.py --target path/to/config.json --recipe recipes/llama3.1-8b/eagle3.yaml \
        [--tokens 270e6 | --samples 270000 --tokens-per-sample 1000] [--gpus 8] [--tflops 160] \
        [--calibrate 230 --calibrate-recipe recipes/smollm2-135m/eagle3.yaml]
    drafters estimate ...   (the same)

Only the target's config.json is read (no weights). Parameter counts are exact for the layouts this project builds
(Llama-style decoder layers: q/k/v/o, gate/up/down; the tests check them against the built modules); FLOPs are the
matmul count per training token (2 per multiply-add; forward + backward = 3x forward for trained weights, 2x for frozen
weights a gradient passes through, 1x for a target run without a graph); memory is weights + optimizer state
(fp32 master, gradient and two AdamW moments: 16 bytes per trained parameter) + the logits that dominate the
activations (fp32, with their gradient) + the target's activations (with a graph only in joint mode, flash-style
attention: ~34 bytes · tokens · hidden per layer in bf16, Korthikanti et al. 2022).

Throughput: tokens/s = sustained FLOP/s ÷ FLOPs per token. The sustained rate is ``--tflops`` per GPU (default 160:
the 8B recipes' assumption of ~1.3 PFLOP/s on 8 x H100), or calibrated: ``--calibrate R`` says a run of
``--calibrate-recipe`` on SmolLM2-135M measured R tokens/s per device on the machine class you will use, and the
estimate scales it by the ratio of FLOPs per token (small models run at lower utilisation, so this is optimistic
for the small run and conservative for the large one).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infer.families import FAMILIES, recipe_family  # noqa: E402
from models.sizing import ADAM_BYTES, BYTES, GB, RunSizes, Shape  # noqa: E402

SMOLLM2 = {  # SmolLM2-135M-Instruct's config.json (the reference target), for calibration without its folder
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
SIZED = tuple(f for f in FAMILIES if f.estimate is not None)
"""The families whose declaration sizes a run (`infer.family.DrafterFamily.estimate`)."""


@dataclass
class Estimate:
    method: str
    trainable: int
    flops_per_token: float
    memory: dict[str, float]  # GB per GPU, by part
    cache_bytes_per_token: int | None  # offline features; None: this method trains online only


def estimate(shape: Shape, recipe: dict) -> Estimate:
    """Sizes of one recipe (a parsed YAML mapping) on ``shape``; memory for DDP (each GPU holds the whole drafter).
    The drafter's share comes from the recipe's family (its section's sizes), the target's and the optimizer's from
    here."""
    t, tr = recipe["target"], recipe["train"]
    fam = recipe_family(recipe, SIZED)
    ctx = recipe["data"].get("max_length", 2048) / 2  # causal attention: the average query sees half the row
    online = tr.get("features", "online") == "online"
    run = RunSizes(
        shape=shape,
        tokens=recipe["data"].get("max_length", 2048) * tr.get("batch_size", 1),
        context=ctx,
        loss_share=0.6,  # share of a chat row that is answer tokens (the shipped and 8B data: 55-65 %)
        weight_bytes=BYTES.get(t.get("dtype", "bfloat16"), 2),
        feature_bytes=BYTES.get(tr.get("feature_dtype", "bfloat16"), 2),
        online=online,
        target_forward_flops=shape.forward_flops(ctx) if online else 0.0,
    )
    joint = t.get("mode", "frozen") == "joint"
    mem = {"target weights": shape.params * run.weight_bytes * GB}
    own = fam.estimate(recipe[fam.recipe_section], run)
    mem.update(own.memory)
    trainable, flops = own.trainable, own.flops_per_token
    if joint:
        lora = t.get("lora_rank", 0)
        trainable += lora * shape.L * shape.lora_width(t.get("lora_target_modules")) if lora else shape.params
        flops += 2 * shape.forward_flops(ctx)  # the target's backward runs too (joint training is online)
        if not lora:
            mem["frozen original (KL / quality guard)"] = shape.params * run.weight_bytes * GB
        mem["target activations (with graph)"] = 34 * run.tokens * shape.H * shape.L * GB
    else:
        mem["target activations (no graph)"] = run.tokens * (4 * shape.H + 3 * shape.I) * run.weight_bytes * GB
    mem["trainable weights + AdamW"] = trainable * ADAM_BYTES * GB
    return Estimate(fam.method, trainable, flops, mem, own.cache_bytes_per_token)


def load_recipe(path: str | Path) -> dict:
    recipe = yaml.safe_load(Path(path).read_text())
    if not isinstance(recipe, dict) or not {"target", "data", "train"} <= recipe.keys():
        raise SystemExit(f"{path}: not a training recipe (needs target, data and train sections)")
    try:
        recipe_family(recipe, SIZED)
    except ValueError as e:
        raise SystemExit(f"{path}: {e}; the estimator sizes {', '.join(f.method for f in SIZED)}") from None
    return recipe


def load_shape(path: str | Path) -> Shape:
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not p.exists():
        raise SystemExit(f"{path}: no config.json (give the target's config.json or its folder)")
    return Shape.of(json.loads(p.read_text()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target's config.json (or its folder); no weights needed")
    ap.add_argument("--recipe", required=True, help="a training recipe YAML of a family the estimator sizes")
    ap.add_argument("--tokens", type=float, help="training tokens per epoch")
    ap.add_argument("--samples", type=float, help="samples per epoch (with --tokens-per-sample)")
    ap.add_argument("--tokens-per-sample", type=float, default=1000.0)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu-memory", type=float, default=80.0, help="GB per GPU")
    ap.add_argument("--tflops", type=float, default=160.0, help="sustained TFLOP/s per GPU")
    ap.add_argument("--calibrate", type=float, help="tokens/s per device measured for --calibrate-recipe on SmolLM2")
    ap.add_argument("--calibrate-recipe", help="the recipe that --calibrate was measured with (SmolLM2-135M)")
    args = ap.parse_args(argv)

    shape, recipe = load_shape(args.target), load_recipe(args.recipe)
    est = estimate(shape, recipe)
    tokens = args.tokens or (args.samples * args.tokens_per_sample if args.samples else None)
    total = sum(est.memory.values())
    print(f"target: {shape.params / 1e9:.2f} B parameters (H {shape.H}, {shape.L} layers, vocab {shape.V})")
    print(f"{est.method}: {est.trainable / 1e6:.1f} M trained parameters; {est.flops_per_token / 1e9:.1f} GFLOP/token")
    print(f"memory per GPU (DDP, batch {recipe['train'].get('batch_size', 1)} x {recipe['data'].get('max_length')}):")
    for part, size in est.memory.items():
        print(f"  {part:<40} {size:7.1f} GB")
    fits = "fits" if total <= 0.9 * args.gpu_memory else "does NOT fit: lower batch/length, shard (ZeRO/FSDP) or LoRA"
    print(f"  {'total':<40} {total:7.1f} GB of {args.gpu_memory:.0f} → {fits}")

    if args.calibrate is not None:
        if not args.calibrate_recipe:
            raise SystemExit("--calibrate needs --calibrate-recipe (the SmolLM2 recipe the rate was measured with)")
        small = estimate(Shape.of(SMOLLM2), load_recipe(args.calibrate_recipe))
        flops_s = args.calibrate * small.flops_per_token
        how = f"calibrated: {args.calibrate:.0f} tokens/s x {small.flops_per_token / 1e9:.2f} GFLOP/token on SmolLM2"
    else:
        flops_s, how = args.tflops * 1e12, f"assumed {args.tflops:.0f} TFLOP/s sustained per GPU"
    per_gpu = flops_s / est.flops_per_token
    print(f"throughput: {per_gpu:,.1f} tokens/s = {per_gpu * 3600:,.0f} tokens per GPU-hour ({how})")
    if tokens:
        hours = tokens / (per_gpu * args.gpus) / 3600
        print(
            f"one epoch of {tokens / 1e6:.0f} M tokens: {hours:.2f} h on {args.gpus} GPUs ({hours * args.gpus:.1f} GPU-h)"
        )
        if est.cache_bytes_per_token is None:
            print("offline features: not used by this method (it trains online)")
        else:
            size = tokens * est.cache_bytes_per_token / 1e12
            print(f"offline features: {est.cache_bytes_per_token / 1024:.1f} KB/token → {size:.2f} TB for one epoch")


if __name__ == "__main__":
    main()
