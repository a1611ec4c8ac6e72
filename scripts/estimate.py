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

from models.target import DEFAULT_LORA_TARGET_MODULES  # noqa: E402

BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fastest": 2, "auto": 2}
ADAM_BYTES = 16  # fp32 master weight + fp32 gradient + AdamW m and v
SMOLLM2 = {  # SmolLM2-135M-Instruct's config.json (the reference target), for calibration without its folder
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


@dataclass
class Shape:
    """The target's shape from its config.json (text part of a multimodal config)."""

    H: int
    I: int  # noqa: E741 (the paper's name for the MLP width)
    L: int
    heads: int
    kv_heads: int
    head_dim: int
    V: int
    tied: bool

    @classmethod
    def of(cls, config: dict) -> Shape:
        c = config.get("text_config", config)
        heads = c["num_attention_heads"]
        return cls(
            H=c["hidden_size"],
            I=c["intermediate_size"],
            L=c["num_hidden_layers"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            V=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings", False)),
        )

    def layer(self, input_width: int | None = None) -> int:
        """Weights of one decoder layer (q/k/v read ``input_width``, default H; two RMSNorms)."""
        x = input_width or self.H
        attn = (
            x * self.heads * self.head_dim + 2 * x * self.kv_heads * self.head_dim + self.heads * self.head_dim * self.H
        )
        return attn + 3 * self.H * self.I + 2 * self.H

    def lora_width(self, modules: list[str] | None = None) -> int:
        """Σ (in + out) over one layer's LoRA-wrapped projections: rank r adds r · this per layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        dims = {"q_proj": (self.H, q), "k_proj": (self.H, kv), "v_proj": (self.H, kv), "o_proj": (q, self.H)}
        dims.update(gate_proj=(self.H, self.I), up_proj=(self.H, self.I), down_proj=(self.I, self.H))
        modules = list(modules or DEFAULT_LORA_TARGET_MODULES)
        if set(modules) - dims.keys():
            raise SystemExit(f"LoRA modules {sorted(set(modules) - dims.keys())}: the estimator knows {sorted(dims)}")
        return sum(sum(dims[m]) for m in modules)

    @property
    def params(self) -> int:
        """All target parameters (embedding, layers, final norm, head unless tied)."""
        return self.V * self.H * (1 if self.tied else 2) + self.L * self.layer() + self.H

    def forward_flops(self, context: float) -> float:
        """Forward FLOPs per token: every matmul weight once, the head, causal attention over ``context`` keys."""
        return 2 * (self.L * self.layer() + self.V * self.H) + 4 * self.L * self.heads * self.head_dim * context


@dataclass
class Estimate:
    method: str
    trainable: int
    flops_per_token: float
    memory: dict[str, float]  # GB per GPU, by part
    cache_bytes_per_token: int | None  # offline features; None: this method trains online only


def estimate(shape: Shape, recipe: dict) -> Estimate:
    """Sizes of one recipe (a parsed YAML mapping) on ``shape``; memory for DDP (each GPU holds the whole drafter)."""
    t, tr = recipe["target"], recipe["train"]
    seq = recipe["data"].get("max_length", 2048) * tr.get("batch_size", 1)
    ctx = recipe["data"].get("max_length", 2048) / 2  # causal attention: the average query sees half the row
    loss_share = 0.6  # share of a chat row that is answer tokens (the shipped and 8B data: 55-65 %)
    wbytes = BYTES.get(t.get("dtype", "bfloat16"), 2)
    joint = t.get("mode", "frozen") == "joint"
    H, V = shape.H, shape.V
    gb = 1e-9
    mem = {"target weights": shape.params * wbytes * gb}
    online = tr.get("features", "online") == "online"
    target_fwd = shape.forward_flops(ctx) if online else 0.0

    if "drafter" in recipe:  # EAGLE-3
        d, method = recipe["drafter"], "eagle3"
        n, Vd, A = d.get("ttt_steps", 7), d.get("draft_vocab_size", 32000), 3
        step = shape.layer(2 * H) + Vd * H + 2 * H  # layer on [emb; h], head, hidden + final norms
        trainable = A * H * H + step
        flops = target_fwd + 6 * A * H * H + n * (6 * step + 12 * H * ctx)
        if not online:
            flops += 2 * V * H  # the target's head recomputed from the cached final hidden state
        mem["frozen embedding copy"] = V * H * wbytes * gb
        mem["logits (target + draft steps, fp32)"] = seq * (2 * V + n * 2 * Vd) * 4 * gb
        cache = (A * H + H) * BYTES.get(tr.get("feature_dtype", "bfloat16"), 2)
    elif "heads" in recipe:  # Medusa
        h, method = recipe["heads"], "medusa"
        K, R, shared = h.get("num_heads", 4), h.get("num_layers", 1), h.get("shared_head", False)
        trainable = K * R * (H * H + H) + (0 if shared else K * V * H)
        head = (4 if shared else 6) * V * H * loss_share  # a frozen shared head: forward + input gradient
        flops = target_fwd + K * (6 * R * H * H + head)
        mem["logits (heads, fp32)"] = seq * loss_share * K * V * 4 * 2 * gb
        cache = H * BYTES.get(tr.get("feature_dtype", "bfloat16"), 2)
    else:  # MTP
        m, method = recipe["mtp"], "mtp"
        D = m.get("num_modules", 1)
        module = shape.layer() + 2 * H * H + 2 * H  # block + eh_proj + enorm / hnorm
        trainable = D * module
        flops = target_fwd + D * (6 * module + 4 * V * H * loss_share + 12 * shape.heads * shape.head_dim * ctx)
        mem["logits (depths, fp32)"] = seq * loss_share * D * V * 4 * 2 * gb
        cache = None
    if joint:
        lora = t.get("lora_rank", 0)
        trainable += lora * shape.L * shape.lora_width(t.get("lora_target_modules")) if lora else shape.params
        flops += 2 * shape.forward_flops(ctx)  # the target's backward runs too (joint training is online)
        if not lora:
            mem["frozen original (KL / quality guard)"] = shape.params * wbytes * gb
        mem["target activations (with graph)"] = 34 * seq * H * shape.L * gb
    else:
        mem["target activations (no graph)"] = seq * (4 * H + 3 * shape.I) * wbytes * gb
    mem["trainable weights + AdamW"] = trainable * ADAM_BYTES * gb
    return Estimate(method, trainable, flops, mem, cache)


def load_recipe(path: str | Path) -> dict:
    recipe = yaml.safe_load(Path(path).read_text())
    if not isinstance(recipe, dict) or not {"target", "data", "train"} <= recipe.keys():
        raise SystemExit(f"{path}: not a training recipe (needs target, data and train sections)")
    if not {"drafter", "heads", "mtp"} & recipe.keys():
        raise SystemExit(f"{path}: no drafter / heads / mtp section: the estimator sizes EAGLE-3, Medusa and MTP")
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
    ap.add_argument("--recipe", required=True, help="a recipe YAML (EAGLE-3, Medusa or MTP)")
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
