"""The "small draft model" baseline: the target's first layers plus its own norm and head, distilled briefly.

    python train/draft_model.py --config recipes/smollm2-135m/draft_model.yaml [key=value ...]

Why this model: hubs are out of reach here and no smaller model shares SmolLM2's tokenizer, so the draft is cut from
the target itself (as layer-skipping self-speculation does): embedding, decoder layers 0..K-1, final norm and the
tied head, a standard ``LlamaForCausalLM`` any engine loads as an assistant model. Cut at layer K without training,
its next-token guesses are poor (the final norm and head expect layer N's output), so the K layers and the norm are
distilled for a few minutes toward the target's next-token distribution (KL on assistant tokens of the shipped
chat data); the embedding / head stays the target's and frozen. Its step costs K/N of the layers plus the whole
49k-wide head, which bounds how much any such draft can save on this target (docs/smollm2.md has the numbers).

Top to bottom: config → target, tokenizer, data → cut → distillation loop → save (HF folder + model card).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from models.config import parse_cli, save_config  # noqa: E402
from models.draft_model import cut_target  # noqa: E402
from models.target import TargetConfig, TargetModel  # noqa: E402
from models.tokenizer import load_tokenizer  # noqa: E402
from train.data.dataset import DataConfig, build_dataset, collate  # noqa: E402
from train.optim import adamw, set_lr, warmup_cosine  # noqa: E402


@dataclass
class DraftTrainConfig:
    output_dir: str
    """The HF folder of the draft model (config, weights, tokenizer, README)."""
    layers: int = 2
    """Decoder layers kept from the bottom of the target."""
    steps: int = 300
    """Optimizer steps of distillation."""
    batch_size: int = 8
    lr: float = 1e-3
    warmup_ratio: float = 0.05
    seed: int = 0
    log_every: int = 25

    def __post_init__(self) -> None:
        if self.layers < 1 or self.steps < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError("need layers, steps, batch_size >= 1 and lr > 0")


@dataclass
class DraftModelRecipe:
    target: TargetConfig
    data: DataConfig
    train: DraftTrainConfig


def main(argv: list[str]) -> None:
    cfg = parse_cli(DraftModelRecipe, argv)
    tc, out = cfg.train, Path(cfg.train.output_dir)
    torch.manual_seed(tc.seed)
    t0 = time.time()

    # ---- target, tokenizer, data, the cut model
    tokenizer = load_tokenizer(cfg.target.name_or_path)
    target = TargetModel.from_config(cfg.target, workload="train")
    print(target.precision.line())
    data, summary = build_dataset(cfg.data, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    draft = cut_target(target, tc.layers).to(target.device).train()
    draft.get_input_embeddings().requires_grad_(False)  # embedding and head stay the target's (tied or not)
    draft.get_output_embeddings().requires_grad_(False)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    print(
        f"draft: layers 0..{tc.layers - 1} of {target.num_layers}, {trainable / 1e6:.1f} M trainable parameters; "
        f"data {summary['kept']} samples ({summary['loss_tokens']:,} loss tokens)"
    )
    optimizer = adamw(draft, tc.lr, 0.0)
    warmup = max(1, round(tc.warmup_ratio * tc.steps))
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(tc.seed))

    # ---- distillation: KL(target ‖ draft) of the next-token distributions on assistant tokens
    bar, tokens, t_loop = tqdm(range(tc.steps), desc="draft model"), 0, time.time()
    for step in bar:
        ids = order[(step * tc.batch_size + torch.arange(tc.batch_size)) % len(data)].tolist()
        batch = {k: v.to(target.device) for k, v in collate([data[i] for i in ids], pad_id).items()}
        with torch.no_grad():
            teacher = target(batch["input_ids"], attention_mask=batch["attention_mask"], capture_aux=False).logits
        student = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        mask = batch["loss_mask"][:, 1:].bool()  # logits at t predict token t+1
        kl = F.kl_div(
            student[:, :-1][mask].float().log_softmax(-1),
            teacher[:, :-1][mask].float().log_softmax(-1),
            log_target=True,
            reduction="batchmean",
        )
        set_lr(optimizer, warmup_cosine(step, tc.steps, warmup, tc.lr, 0.1))
        kl.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += int(batch["attention_mask"].sum())
        with torch.no_grad():
            agree = (student[:, :-1][mask].argmax(-1) == teacher[:, :-1][mask].argmax(-1)).float().mean()
        bar.set_postfix(
            kl=f"{kl.item():.3f}", top1=f"{agree.item():.2f}", tok_s=f"{tokens / (time.time() - t_loop):.0f}"
        )
        if (step + 1) % tc.log_every == 0:
            print(json.dumps({"step": step + 1, "kl": round(kl.item(), 4), "top1_agreement": round(agree.item(), 4)}))

    # ---- save: a plain HF folder, loadable as an assistant model by any engine
    out.mkdir(parents=True, exist_ok=True)
    draft.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_config(cfg, out / "recipe.yaml")
    minutes = (time.time() - t0) / 60
    (out / "README.md").write_text(
        f"# Small draft model for {cfg.target.name_or_path}\n\n"
        f"Layers 0..{tc.layers - 1} of the target's {target.num_layers}, its final norm and tied head, the layers and "
        f"norm distilled for {tc.steps} steps of {tc.batch_size} conversations (KL to the target's next-token "
        f"distribution on assistant tokens; last batch top-1 agreement {agree.item():.2f}), {minutes:.1f} min in all. "
        f"Built by `python train/draft_model.py` (train/draft_model.py explains the choice).\n"
    )
    print(f"saved {out} after {minutes:.1f} min")


if __name__ == "__main__":
    main(sys.argv[1:])
