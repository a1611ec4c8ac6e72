"""Ship a trained drafter into the repository: bf16 weights, its engine export, and a model card.

    python scripts/ship_drafter.py --checkpoint outputs/smollm2-eagle3 --out models/smollm2_eagle3 \
        --recipe recipes/smollm2-135m/eagle3.yaml [--note "how it was made, beyond the recipe"]

Floating-point tensors are cast to bf16 (half the size; the drafter computes in the target's dtype after loading,
`from_pretrained` casts back); d2t / t2d stay integer / bool. The checkpoint's own config.json (with its ``drafters``
block) is copied unchanged, and so is the SGLang / vLLM export with its tensors cast the same way (its weights file is
a link to ours when the bytes are the same, as they are for EAGLE-3). The model card
takes its numbers from the checkpoint's ``train_log.jsonl`` and ``recipe.yaml``; nothing in it is typed by hand
except ``--note``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def cast_file(src: Path, dst: Path) -> int:
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in load_file(str(src)).items()}
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst), metadata={"format": "pt"})
    return dst.stat().st_size


def model_card(ckpt: Path, recipe: str, note: str, size: int) -> str:
    config = json.loads((ckpt / "config.json").read_text())
    log = [json.loads(line) for line in (ckpt / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "step" in r]
    evals = [r for r in steps if "eval/acc" in r]
    last = steps[-1]
    info = config["drafters"]
    lines = [
        f"# EAGLE-3 drafter for {info['target_name']}",
        "",
        f"- Target: `{info['target_name']}` (vocab {info['target_vocab_size']:,}, {info['target_num_layers']} layers, "
        f"tokenizer fingerprint `{info['tokenizer_fingerprint']}`), aux layers {info['aux_layer_ids']} "
        f"({info['aux_layer_convention']}).",
        f"- Drafter: one decoder layer of width {config['hidden_size']}, draft vocabulary {config['draft_vocab_size']:,}; "
        f"weights in bf16 ({size / 2**20:.1f} MiB). `export-sglang/` is the SGLang / vLLM `LlamaForCausalLMEagle3` "
        "export of the same weights.",
        f"- Made by `python train/eagle3.py --config {recipe}` (the recipe in `recipe.yaml` here is the exact one "
        f"used): {last['step']} optimizer steps; last logged training loss {last['loss']:.3f}, top-1 accuracy per "
        f"TTT step {last['acc']}.",
    ]
    if evals:
        e = evals[-1]
        lines.append(
            f"- Held-out (teacher-forced) top-1 accuracy per TTT step at step {e['step']}: "
            f"{[round(a, 3) for a in e['eval/acc']]}, simulated τ {e['eval/simulated_tau']:.2f}."
        )
    if note:
        lines.append(f"- {note}")
    lines += ["", "Measured τ and speedup: `report.md` here (the shipped report, with its prompt set and machine)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", required=True, help="the recipe that made it (named in the model card)")
    ap.add_argument("--note", default="", help="one line on how it was made beyond the recipe (resumed runs, stages)")
    args = ap.parse_args(argv)
    ckpt, out = args.checkpoint, args.out
    out.mkdir(parents=True, exist_ok=True)
    size = cast_file(ckpt / "model.safetensors", out / "model.safetensors")
    shutil.copy(ckpt / "config.json", out / "config.json")
    shutil.copy(ckpt / "recipe.yaml", out / "recipe.yaml")
    shutil.copy(ckpt / "train_log.jsonl", out / "train_log.jsonl")
    if (ckpt / "export-sglang").exists():
        exported = out / "export-sglang" / "model.safetensors"
        cast_file(ckpt / "export-sglang" / "model.safetensors", exported)
        # the SGLang / vLLM keys are our own (models/export.py): the same bytes, so the repository keeps one copy
        if exported.read_bytes() == (out / "model.safetensors").read_bytes():
            exported.unlink()
            exported.symlink_to(Path("..") / "model.safetensors")
        config = json.loads((ckpt / "export-sglang" / "config.json").read_text())
        config["torch_dtype"] = "bfloat16"
        (out / "export-sglang" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "README.md").write_text(model_card(ckpt, args.recipe, args.note, size))
    print(f"shipped {ckpt} → {out} ({size / 2**20:.1f} MiB of weights)")


if __name__ == "__main__":
    main()
