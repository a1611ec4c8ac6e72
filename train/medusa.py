"""Train Medusa heads on a frozen target (Medusa-1), then measure them with the verify runtime.

    python train/medusa.py --config recipes/smollm2-135m/medusa1.yaml [key=value ...]
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml train/medusa.py --config ...   # 2 CPU ranks
    python train/medusa.py report --drafter DIR [--config recipe.yaml] [report.prompts=8 ...]   # any checkpoint

Top to bottom: parse config → target, tokenizer, data → heads → (offline: the feature cache, shareable with the
EAGLE-3 recipe on the same target and data) → loop (Σ_k w^k CE_k on the assistant tokens, head k predicting token
t+2+k from the final-norm hidden state at t; AdamW + warm-up + cosine, grad clip) with held-out top-k accuracy per
head → static tree chosen from those accuracies under a node budget → checkpoint + vLLM / original exports →
τ / speedup report beside prompt lookup, the small draft model and the drafters in ``report.compare``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from infer.tree_search import best_rank_paths, expected_accepted  # noqa: E402
from models.config import parse_cli, save_config  # noqa: E402
from models.export import save_medusa_original, save_medusa_vllm  # noqa: E402
from models.medusa import MedusaDrafter  # noqa: E402
from models.target import TargetConfig, TargetModel, load_tokenizer  # noqa: E402
from train.checkpoint import load_training_state, save_training_state  # noqa: E402
from train.data import DataConfig, build_dataset, collate  # noqa: E402
from train.features import final_hidden  # noqa: E402
from train.loop import (  # noqa: E402
    TrainConfig,
    check_sharding,
    epoch_batch,
    feature_source,
    make_accelerator,
    record,
    schedule,
    to_device,
)
from train.losses import medusa_head_targets, rank_hits, simulated_tau  # noqa: E402
from train.optim import adamw, set_lr, warmup_cosine  # noqa: E402
from train.report import ReportConfig, report_main, run_report  # noqa: E402


# ------------------------------------------------------------------------------------------- config
@dataclass
class HeadsConfig:
    num_heads: int = 4
    """K heads; head k predicts token t+2+k (Medusa: 3–5)."""
    num_layers: int = 1
    """ResBlocks per head (Medusa: 1)."""
    shared_head: bool = False
    """Project every head through the target's own lm_head (frozen, not saved) instead of per-head copies."""
    head_weight: float = 0.8
    """Loss weight of head k is head_weight ** k (Medusa: 0.8^k; 1.0 = the unweighted sum)."""
    tree_nodes: int = 16
    """Node budget (root excluded) of the static tree chosen from held-out accuracies; 0: no tree."""
    tree_ranks: int = 4
    """Candidates per head whose held-out accuracy is measured (the tree's widest fan-out)."""
    init_from: str | None = None
    """Continue from an existing Medusa checkpoint (weights reused; fresh optimizer and schedule)."""

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0 or not 0 < self.head_weight <= 1:
            raise ValueError("need num_heads >= 1, num_layers >= 0 and 0 < head_weight <= 1")
        if self.tree_nodes < 0 or self.tree_ranks < 1:
            raise ValueError("need tree_nodes >= 0 and tree_ranks >= 1")


@dataclass
class MedusaRecipeConfig:
    target: TargetConfig
    """The frozen target (Medusa-1)."""
    data: DataConfig
    """Training data; the loss mask selects the tokens the heads learn."""
    train: TrainConfig
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    eval_data: DataConfig | None = None
    """Held-out data for per-head accuracy, the simulated τ and the static tree (None: no tree)."""
    report: ReportConfig = field(default_factory=ReportConfig)

    def __post_init__(self) -> None:
        if self.target.mode != "frozen":
            raise ValueError("train/medusa.py trains Medusa-1 heads on a frozen target (target.mode: frozen)")


# ------------------------------------------------------------------------------------------ helpers
def head_losses(model, hidden: torch.Tensor, batch: dict, num_heads: int, weight: float) -> dict:
    """Σ_k weight^k · CE_k, head k on the positions it is trained on (its label a loss token). ``model`` may be the
    distributed wrapper: all heads run in one forward call."""
    targets = [medusa_head_targets(batch["input_ids"], batch["loss_mask"], k) for k in range(num_heads)]
    logits = model([hidden[positions] for positions, _ in targets])
    loss = hidden.new_zeros(())
    correct, count = [], []
    for k, ((positions, labels), head_logits) in enumerate(zip(targets, logits)):
        want, n = labels[positions], positions.sum()
        loss = loss + weight**k * F.cross_entropy(head_logits.float(), want, reduction="sum") / n.clamp(min=1)
        correct.append((head_logits.detach().argmax(-1) == want).sum())
        count.append(n)
    return {"loss": loss, "correct": torch.stack(correct), "count": torch.stack(count)}


@torch.no_grad()
def evaluate(accelerator, target, model: MedusaDrafter, eval_set, cfg: MedusaRecipeConfig, pad_id: int) -> dict:
    """Held-out rank accuracy of every head (how often the label is its r-th candidate, r < tree_ranks), summed over
    ranks → simulated τ of the chain and the static tree that maximises the expected accepted length."""
    model.eval()
    K, R = model.config.num_heads, cfg.heads.tree_ranks
    hits = torch.zeros(K, R, device=accelerator.device)
    count = torch.zeros(K, device=accelerator.device)
    n = min(len(eval_set), cfg.train.eval_samples)
    mine = list(range(accelerator.process_index, n, accelerator.num_processes))
    bs = cfg.train.batch_size
    for s in range(0, len(mine), bs):
        batch = to_device(collate([eval_set[i] for i in mine[s : s + bs]], pad_id), accelerator.device)
        hidden = final_hidden(target, batch)
        for k in range(K):
            positions, labels = medusa_head_targets(batch["input_ids"], batch["loss_mask"], k)
            hits[k] += rank_hits(model.head_logits(k, hidden[positions]), labels[positions], R)
            count[k] += positions.sum()
    hits, count = accelerator.reduce(hits, "sum"), accelerator.reduce(count, "sum")
    model.train()
    acc = (hits / count.clamp(min=1)[:, None]).tolist()
    paths = best_rank_paths(acc, cfg.heads.tree_nodes)
    return {
        "eval/acc": [round(a[0], 4) for a in acc],
        "eval/rank_acc": [[round(x, 4) for x in a] for a in acc],
        "eval/simulated_tau": simulated_tau([a[0] for a in acc]),
        "eval/tree_expected_tau": 1 + expected_accepted(acc, paths),
        "tree_paths": [list(p) for p in paths],
    }


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str]) -> None:
    if argv and argv[0] == "report":
        return report_main(argv[1:], MedusaRecipeConfig)
    cfg = parse_cli(MedusaRecipeConfig, argv)
    tc, hc = cfg.train, cfg.heads
    out = Path(tc.output_dir)
    accelerator, log = make_accelerator(tc)
    rank, world = accelerator.process_index, accelerator.num_processes
    set_seed(tc.seed)
    t_start = time.time()

    # ---- target, tokenizer, data
    tokenizer = load_tokenizer(cfg.target.name_or_path, cfg.target.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    target = TargetModel.from_config(cfg.target)
    with accelerator.main_process_first():
        train_set, summary = build_dataset(cfg.data, tokenizer)
        eval_set = build_dataset(cfg.eval_data, tokenizer)[0] if cfg.eval_data is not None else None
    if tc.max_train_samples is not None:
        train_set = train_set.shuffle(seed=tc.seed).select(range(min(tc.max_train_samples, len(train_set))))
    log(
        f"data: {summary['kept']} samples kept of {summary['rows']} ({summary['loss_tokens']:,} loss tokens), "
        f"skipped { ({k: v for k, v in summary['skipped'].items() if v}) }; training on {len(train_set)}"
    )
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "recipe.yaml")

    # ---- heads
    if hc.init_from:
        log(f"heads: continuing from {hc.init_from}")
        model = MedusaDrafter.from_pretrained(hc.init_from, target, tokenizer)
    else:
        model = MedusaDrafter.from_target(target, hc.num_heads, hc.num_layers, hc.shared_head, tokenizer)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(
        f"heads: {hc.num_heads} x {hc.num_layers} ResBlock, {'shared' if hc.shared_head else 'per-head'} lm_head, "
        f"{trainable / 1e6:.1f} M trainable parameters"
    )
    samples, collate_fn = feature_source(accelerator, tc, target, train_set, pad_id, log)

    # ---- optimizer, schedule, resume
    optimizer = adamw(model, tc.lr, tc.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    per_epoch, total_steps, warmup = schedule(tc, len(samples), world)
    counters = load_training_state(accelerator, out) or {"step": 0}
    step = counters["step"]
    log(
        f"train: {total_steps} optimizer steps ({per_epoch} micro-batches/epoch/rank, batch {tc.batch_size} x "
        f"{tc.grad_accum} accum x {world} ranks), warm-up {warmup}" + (f"; resumed at step {step}" if step else "")
    )
    record(accelerator, tc, {"sharding": check_sharding(accelerator, tc, len(samples), per_epoch)}, log)

    # ---- loop
    heads = accelerator.unwrap_model(model)
    K = hc.num_heads
    stats = torch.zeros(2 + 2 * K, device=accelerator.device)  # loss sum, micro-batches, correct_k, count_k
    tokens, t_loop, micro, last_eval = 0, time.time(), step * tc.grad_accum, {}
    bar = tqdm(total=total_steps, initial=step, desc="medusa", disable=not accelerator.is_main_process)
    while step < total_steps:
        ids = epoch_batch(len(samples), micro, per_epoch, tc.seed, rank, world, tc.batch_size)
        batch = to_device(collate_fn([samples[i] for i in ids], pad_id), accelerator.device)
        hidden = final_hidden(target, batch).to(next(heads.parameters()).dtype)
        sync = (micro + 1) % tc.grad_accum == 0
        with contextlib.nullcontext() if sync else accelerator.no_sync(model), accelerator.autocast():
            res = head_losses(model, hidden, batch, K, hc.head_weight)
            accelerator.backward(res["loss"] / tc.grad_accum)
        stats += torch.cat([res["loss"].detach().reshape(1), stats.new_ones(1), res["correct"], res["count"]])
        tokens += int(batch["attention_mask"].sum())
        micro += 1
        if not sync:
            continue
        set_lr(optimizer, warmup_cosine(step, total_steps, warmup, tc.lr, tc.min_lr_ratio))
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        do_eval = eval_set is not None and (step == total_steps or (tc.eval_every and step % tc.eval_every == 0))
        if step % tc.log_every == 0 or step == total_steps or do_eval:
            total = accelerator.reduce(stats, "sum")
            metrics = {
                "step": step,
                "loss": float(total[0] / total[1]),
                "acc": [round(a, 4) for a in (total[2 : 2 + K] / total[2 + K :].clamp(min=1)).tolist()],
                "lr": optimizer.param_groups[0]["lr"],
                "grad_norm": float(grad_norm),
                "tokens_per_s": round(tokens * world / (time.time() - t_loop), 1),
            }
            if do_eval:
                last_eval = evaluate(accelerator, target, heads, eval_set, cfg, pad_id)
                metrics.update({k: v for k, v in last_eval.items() if k != "tree_paths"})
            record(accelerator, tc, metrics, log)
            stats.zero_()
        if tc.save_every and step % tc.save_every == 0 and step < total_steps:
            save_training_state(accelerator, out, {"step": step})
    bar.close()
    train_s = time.time() - t_loop

    # ---- save: resumable state, checkpoint with its static tree, engine exports
    save_training_state(accelerator, out, {"step": step})
    accelerator.end_training()
    if not accelerator.is_main_process:
        return
    heads.config.tree_paths = last_eval.get("tree_paths", [])
    if heads.config.tree_paths:
        log(f"static tree: {len(heads.config.tree_paths)} nodes, expected τ {last_eval['eval/tree_expected_tau']:.2f}")
    heads.save_pretrained(out)
    if tc.export:
        save_medusa_vllm(heads, out / "export-vllm")
        save_medusa_original(heads, out / "export-medusa")
    log(
        f"saved {out} (+ exports) after {train_s / 60:.1f} min of training, {(time.time() - t_start) / 60:.1f} min total"
    )

    # ---- report: τ and speedup in the verify runtime on held-out prompts
    if cfg.report.enabled:
        run_report(
            target,
            heads,
            tokenizer,
            cfg.report,
            out,
            eval_set,
            notes=f"Medusa-1 heads trained {step} steps ({train_s / 60:.1f} min, world {world}).",
            log=log,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
