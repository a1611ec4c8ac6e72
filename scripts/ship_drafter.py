"""Ship a trained drafter into the repository: bf16 weights, every engine folder of its family, and a model card.

    python scripts/ship_drafter.py --checkpoint outputs/smollm2-eagle3 --out models/smollm2_eagle3 \
        --recipe recipes/smollm2-135m/eagle3.yaml [--note "how it was made, beyond the recipe"] \
        [--leaderboard docs/leaderboard/leaderboard.json]

Floating-point tensors are cast to bf16 (half the size; the drafter computes in the target's dtype after loading,
`from_pretrained` casts back); integer and bool tensors stay as they are. The checkpoint's own config.json (with its
``drafters`` block), recipe and training log are copied unchanged. ``NOTES.md`` says how the run went, from the
training log and ``--note``; then `eval.publish.publish` writes the engine folders from the bf16 weights (a weights
file equal to ours is a link to it) and the model card (README.md), which quotes NOTES.md. Nothing in either is typed
by hand except ``--note``.
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


def notes(ckpt: Path, recipe: str, note: str, size: int) -> str:
    """NOTES.md: the drafter, the command that made it and what its training log says, in the family's own words
    (its ``drafters`` block names the method; the entry script is ``train/<method>.py``)."""
    config = json.loads((ckpt / "config.json").read_text())
    log = [json.loads(line) for line in (ckpt / "train_log.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in log if "step" in r and "loss" in r]
    evals = [r for r in log if "eval/acc" in r]
    last, info = steps[-1], config["drafters"]
    lines = [
        f"# {info['method']} drafter for {info['target_name']}",
        "",
        f"- Target: `{info['target_name']}` (vocab {info['target_vocab_size']:,}, {info['target_num_layers']} layers, "
        f"tokenizer fingerprint `{info['tokenizer_fingerprint']}`), taps {info['aux_layer_ids'] or 'none'} "
        f"({info['aux_layer_convention']}).",
        f"- Drafter: `{config['architectures'][0]}`, weights in bf16 ({size / 2**20:.1f} MiB).",
        f"- Made by `python train/{info['method']}.py --config {recipe}` (the recipe in `recipe.yaml` here is the exact "
        f"one used): {last['step']} optimizer steps; last logged training loss {last['loss']:.3f}"
        + (f", top-1 accuracy per draft depth {last['acc']}." if "acc" in last else "."),
    ]
    if evals:
        e = evals[-1]
        tau = f", simulated τ {e['eval/simulated_tau']:.2f}" if "eval/simulated_tau" in e else ""
        if "eval/walked_tau" in e:  # the greedy chain replayed on the held-out answers (models.acceptance)
            tau += f", walked τ {e['eval/walked_tau']:.2f}"
        lines.append(
            f"- Held-out (teacher-forced) top-1 accuracy per draft depth at step {e['step']}: "
            f"{[round(a, 3) for a in e['eval/acc']]}{tau}."
        )
    if note:
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from eval.publish import publish

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", required=True, help="the recipe that made it (named in the notes)")
    ap.add_argument("--note", default="", help="one line on how it was made beyond the recipe (resumed runs, stages)")
    ap.add_argument("--leaderboard", type=Path, help="a leaderboard.json whose rows make the card's table")
    ap.add_argument("--layouts", nargs="+", help="engine folders to write (default every one; the card names the rest)")
    args = ap.parse_args(argv)
    ckpt, out = args.checkpoint, args.out
    out.mkdir(parents=True, exist_ok=True)
    size = cast_file(ckpt / "model.safetensors", out / "model.safetensors")
    for name in ("config.json", "recipe.yaml", "train_log.jsonl"):
        shutil.copy(ckpt / name, out / name)
    (out / "NOTES.md").write_text(notes(ckpt, args.recipe, args.note, size))
    publish(out, out, leaderboard=args.leaderboard, layouts=args.layouts)  # engine folders from the bf16 weights, card
    print(f"shipped {ckpt} → {out} ({size / 2**20:.1f} MiB of weights)")


if __name__ == "__main__":
    main()
