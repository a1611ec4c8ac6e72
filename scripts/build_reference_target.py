"""Build the reference target (and the small draft model) from the Python standard library.

    python scripts/build_reference_target.py --preset reference --out assets/reference-target
    python scripts/build_reference_target.py --preset draft --out assets/reference-draft \
        --tokenizer assets/reference-target
    python scripts/build_reference_target.py --preset tiny --out /tmp/tiny-target     # < 1 min

Steps: corpus (stdlib .py files, split by path hash) → byte-level BPE tokenizer with chat template
→ token stream cached as .npy → Llama trained with accelerate (bf16 autocast on CPU, cosine decay,
resumable from ``<out>/work/state``) → bf16 HF checkpoint + model card with measured numbers.
Interrupt at any time and rerun the same command: training resumes from the last saved state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train.optim import adamw, mixed_precision, set_lr, warmup_cosine  # noqa: E402
from train.stdlib_corpus import (  # noqa: E402
    HELDOUT_PERCENT,
    distinct_ngram_ratio,
    heldout_prompts,
    split_files,
    stdlib_files,
)

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# One template for every chat code path. The {% generation %} markers let transformers return the
# assistant mask directly; train/data.py also handles templates without them. The newline after an
# assistant turn is an expression because transformers renders with trim_blocks, which would eat a
# literal newline right after {% endgeneration %}.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass
class Preset:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    max_steps: int
    lr: float
    warmup_steps: int
    eval_windows: int
    tokenizer_bytes: int  # corpus bytes used to train the tokenizer (0 = all of it)
    corpus_bytes: int = 0  # train/held-out source bytes tokenized (0 = all; tiny uses a slice to stay fast)


PRESETS = {
    # tests: trains in well under a minute on 2 cores
    "tiny": Preset(512, 64, 2, 2, 1, 128, 128, 8, 60, 3e-3, 5, 8, 1_000_000, corpus_bytes=2_000_000),
    # shipped default: deep and narrow like served models (see DESIGN.md §5)
    "reference": Preset(8192, 192, 12, 3, 1, 512, 256, 16, 1300, 3e-3, 50, 128, 0),
    # small draft model sharing the reference tokenizer (the "small draft model" baseline)
    "draft": Preset(8192, 128, 2, 2, 1, 384, 256, 16, 600, 3e-3, 30, 128, 0),
}


# --------------------------------------------------------------------------- tokenizer
def build_tokenizer(train_texts: list[str], preset: Preset, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=preset.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )

    def texts():
        budget = preset.tokenizer_bytes or float("inf")
        for t in train_texts:
            if budget <= 0:
                return
            budget -= len(t)
            yield t

    tok.train_from_iterator(texts(), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    hf.save_pretrained(out)
    return hf


def token_stream(tokenizer, texts: list[str]) -> np.ndarray:
    """bos + file + eos for every file, concatenated (uint16: vocab ≤ 65k)."""
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    parts = []
    for ids in enc:
        parts.append(np.array([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id], dtype=np.uint16))
    return np.concatenate(parts)


# --------------------------------------------------------------------------- evaluation
@torch.no_grad()
def heldout_loss(model, stream: np.ndarray, seq_len: int, windows: int) -> float:
    """Mean next-token loss over ``windows`` evenly spaced held-out windows (fp32, deterministic)."""
    model.eval()
    starts = np.linspace(0, len(stream) - seq_len - 1, windows).astype(np.int64)
    losses = []
    for s in starts:
        x = torch.from_numpy(stream[s : s + seq_len].astype(np.int64))[None]
        losses.append(model(input_ids=x, labels=x).loss.float().item())
    return float(np.mean(losses))


@torch.no_grad()
def continuation_quality(model, tokenizer, n_prompts: int = 32, new_tokens: int = 128) -> dict:
    """Distinct-4-gram ratio of greedy continuations of held-out prompts (loops score low)."""
    model.eval()
    prompts = heldout_prompts(tokenizer, n=n_prompts)
    ratios, refs, samples = [], [], []
    for p in prompts:
        x = torch.tensor([p["prompt_ids"]])
        out = model.generate(
            x,
            max_new_tokens=new_tokens,
            do_sample=False,
            min_new_tokens=new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
        gen = out[0, x.shape[1] :].tolist()
        ratios.append(distinct_ngram_ratio(gen))
        refs.append(distinct_ngram_ratio(p["reference_ids"]))
        samples.append({"source": p["source"], "prompt": p["prompt"], "continuation": tokenizer.decode(gen)})
    return {
        "distinct4_greedy": float(np.mean(ratios)),
        "distinct4_reference_text": float(np.mean(refs)),
        "prompts": len(prompts),
        "samples": samples,
    }


# --------------------------------------------------------------------------- training
def _take_bytes(files: list, budget: int) -> list:
    out = []
    for f in files:
        if budget <= 0:
            break
        out.append(f)
        budget -= len(f.text)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="reference")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, help="reuse this tokenizer (draft model shares the target's)")
    ap.add_argument("--max-steps", type=int, help="override the preset's step count")
    ap.add_argument("--save-every", type=int, default=50, help="steps between resumable states")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="auto: bf16 autocast on CUDA or on CPUs with native bf16 (avx512_bf16/amx), else fp32",
    )
    args = ap.parse_args()

    from accelerate import Accelerator
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    preset = PRESETS[args.preset]
    if args.max_steps:
        preset.max_steps = args.max_steps
    out, work = args.out, args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    t_start = time.time()

    # ---- corpus and tokenizer
    files, skipped = stdlib_files()
    train_files, heldout_files = split_files(files)
    print(f"corpus: {len(train_files)} train / {len(heldout_files)} held-out files, skipped {skipped}")
    if args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        tokenizer.save_pretrained(out)
    elif (out / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(out)
    else:
        tokenizer = build_tokenizer([f.text for f in train_files], preset, out)
    if preset.corpus_bytes:
        train_files = _take_bytes(train_files, preset.corpus_bytes)
        heldout_files = _take_bytes(heldout_files, preset.corpus_bytes // 10)
    streams = {}
    for name, fs in (("train", train_files), ("heldout", heldout_files)):
        path = work / f"{name}_tokens.npy"
        if not path.exists():
            np.save(path.with_suffix(".tmp.npy"), token_stream(tokenizer, [f.text for f in fs]))
            os.replace(path.with_suffix(".tmp.npy"), path)
        streams[name] = np.load(path)
    print(f"tokens: train {len(streams['train']):,}  held-out {len(streams['heldout']):,}")

    # ---- model
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {preset.num_layers} x {preset.hidden_size}, {n_params / 1e6:.2f} M parameters")
    optimizer = adamw(model, preset.lr, weight_decay=0.1)
    accelerator = Accelerator(mixed_precision=mixed_precision(args.precision), cpu=not torch.cuda.is_available())
    print(f"precision: {accelerator.mixed_precision}")
    model, optimizer = accelerator.prepare(model, optimizer)
    train_model = torch.compile(model) if args.compile else model

    step = 0
    state_dir = work / "state"
    if (state_dir / "step.json").exists():
        accelerator.load_state(str(state_dir))
        step = json.loads((state_dir / "step.json").read_text())["step"]
        print(f"resumed at step {step}")
    train = streams["train"]
    if step == 0:
        init_loss = heldout_loss(
            accelerator.unwrap_model(model), streams["heldout"], preset.seq_len, min(8, preset.eval_windows)
        )
        (work / "initial_loss.json").write_text(json.dumps({"heldout_loss": init_loss}))

    # ---- loop
    bar = tqdm(total=preset.max_steps, initial=step, desc=f"train {args.preset}")
    t_loop, tokens_seen, loss_ema = time.time(), 0, None
    while step < preset.max_steps:
        # every step draws its windows from a generator seeded by (seed, step): resume is exact
        rng = np.random.default_rng([args.seed, step])
        starts = rng.integers(0, len(train) - preset.seq_len - 1, preset.batch_size)
        x = torch.from_numpy(np.stack([train[s : s + preset.seq_len] for s in starts]).astype(np.int64))
        x = x.to(accelerator.device)
        # linear warm-up, then cosine decay to 10 % of the peak
        set_lr(optimizer, warmup_cosine(step, preset.max_steps, preset.warmup_steps, preset.lr, min_lr_ratio=0.1))
        model.train()
        with accelerator.autocast():
            loss = train_model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += x.numel()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{tokens_seen / (time.time() - t_loop):.0f}")
        if step % args.save_every == 0 or step == preset.max_steps:
            tmp = work / "state.tmp"
            accelerator.save_state(str(tmp))
            (tmp / "step.json").write_text(json.dumps({"step": step}))
            if state_dir.exists():
                os.rename(state_dir, work / "state.old")
            os.rename(tmp, state_dir)
            if (work / "state.old").exists():
                import shutil

                shutil.rmtree(work / "state.old")
    bar.close()
    train_seconds = time.time() - t_loop

    # ---- save (bf16 HF checkpoint) and measure the saved weights
    final = accelerator.unwrap_model(model).to(torch.bfloat16)
    final.config.dtype = "bfloat16"
    final.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    reloaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    loss = heldout_loss(reloaded, streams["heldout"], preset.seq_len, preset.eval_windows)
    quality = continuation_quality(
        reloaded,
        tokenizer,
        n_prompts=32 if args.preset != "tiny" else 4,
        new_tokens=128 if args.preset != "tiny" else 16,
    )
    info = {
        "preset": args.preset,
        "preset_config": asdict(preset),
        "parameters": n_params,
        "train_files": len(train_files),
        "heldout_files": len(heldout_files),
        "heldout_percent": HELDOUT_PERCENT,
        "train_tokens_available": int(len(train)),
        "tokens_trained": int(preset.max_steps * preset.batch_size * preset.seq_len),
        "heldout_loss": loss,
        "heldout_loss_at_init": json.loads((work / "initial_loss.json").read_text())["heldout_loss"]
        if (work / "initial_loss.json").exists()
        else None,
        "heldout_eval": {"seq_len": preset.seq_len, "windows": preset.eval_windows, "dtype": "float32"},
        "distinct4_greedy_128": quality["distinct4_greedy"],
        "distinct4_heldout_reference": quality["distinct4_reference_text"],
        "quality_prompts": quality["prompts"],
        "train_seconds_this_run": round(train_seconds, 1),
        "precision": "bf16 autocast" if accelerator.mixed_precision == "bf16" else "fp32",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    (work / "samples.json").write_text(json.dumps(quality["samples"], indent=2))
    write_model_card(out, info, quality["samples"][:2])
    print(json.dumps({k: v for k, v in info.items() if k != "preset_config"}, indent=2))
    print(f"total {time.time() - t_start:.0f}s")


def write_model_card(out: Path, info: dict, samples: list[dict]) -> None:
    p = info["preset_config"]
    lines = [
        f"# drafters reference {'draft model' if info['preset'] == 'draft' else 'target'} ({info['preset']})",
        "",
        "Llama-architecture causal LM trained by `scripts/build_reference_target.py` on the Python "
        f"{info['python']} standard library's `.py` files ({info['train_files']} train files; "
        f"{info['heldout_files']} held out by path hash, {info['heldout_percent']} %).",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {info['parameters'] / 1e6:.2f} M |",
        f"| shape | {p['num_layers']} layers x {p['hidden_size']} hidden, {p['num_heads']} heads "
        f"({p['num_kv_heads']} kv), MLP {p['intermediate_size']}, vocab {p['vocab_size']} byte-level BPE |",
        f"| training | {p['max_steps']} steps x {p['batch_size']} x {p['seq_len']} tokens = "
        f"{info['tokens_trained'] / 1e6:.1f} M tokens ({info['train_tokens_available'] / 1e6:.1f} M available), "
        f"AdamW lr {p['lr']} cosine to 10 %, {info['precision']} |",
        f"| training time | {info['train_seconds_this_run'] / 60:.1f} min (last run; resumed runs add up) |",
        f"| held-out loss | {info['heldout_loss']:.3f} (fp32, {p['eval_windows']} windows of {p['seq_len']}) |",
        f"| distinct-4-gram ratio, 128-token greedy continuations | {info['distinct4_greedy_128']:.3f} "
        f"(held-out source itself: {info['distinct4_heldout_reference']:.3f}; {info['quality_prompts']} prompts) |",
        "",
        "Weights are stored in bf16. Load with `AutoModelForCausalLM.from_pretrained(path)` and "
        "`AutoTokenizer.from_pretrained(path)`; the tokenizer carries a chat template "
        "(`<|user|>`, `<|assistant|>`, `<|end|>`).",
        "",
        "## Greedy samples (held-out prompts)",
    ]
    for s in samples:
        lines += ["", f"`{s['source']}`", "", "```python", s["prompt"] + "⟨continuation⟩" + s["continuation"], "```"]
    (out / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
