"""Train an EAGLE-3 drafter for a frozen target, then measure it with the verify runtime.

    python train/eagle3.py --config recipes/reference/eagle3.yaml [key=value ...]
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml train/eagle3.py --config ...   # 2 CPU ranks
    torchrun --nproc_per_node 2 train/eagle3.py --config ...
    python train/eagle3.py report --drafter DIR [--config recipe.yaml] [report.prompts=8 ...]   # any checkpoint

Top to bottom: parse config → target, tokenizer, data → draft vocabulary + drafter → (offline: feature cache) →
training-time-test loop (EAGLE-3: soft cross-entropy on the draft vocab, step weights 0.8^i, AdamW + warm-up +
cosine, grad clip) with held-out simulated τ → checkpoint + engine exports → τ / speedup report.

Data sharding is explicit: every epoch is one seeded permutation of the samples, cut into global batches of
world × batch_size; rank r takes its slice of each, so resuming at micro-batch m replays nothing and skips nothing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from models.config import parse_cli, save_config, to_dict  # noqa: E402
from models.eagle3 import Eagle3Drafter, read_checkpoint_config  # noqa: E402
from models.export import save_sglang, save_speculators  # noqa: E402
from models.target import TargetConfig, TargetModel, load_tokenizer  # noqa: E402
from train.checkpoint import load_training_state, save_training_state  # noqa: E402
from train.data import DataConfig, build_dataset, collate  # noqa: E402
from train.draft_vocab import build_draft_vocab, count_loss_tokens, coverage  # noqa: E402
from train.eagle3_report import ReportConfig, run_report  # noqa: E402
from train.features import (  # noqa: E402
    FEATURE_DTYPES,
    FeatureCache,
    attention_masks,
    cache_is_valid,
    cache_key,
    collate_features,
    target_signals,
    write_feature_cache,
)
from train.losses import eagle3_ttt_loss, simulated_tau  # noqa: E402
from train.optim import adamw, mixed_precision, set_lr, warmup_cosine  # noqa: E402
from train.self_distill import SelfDistillConfig, load_self_distilled, write_self_distilled  # noqa: E402


# ------------------------------------------------------------------------------------------- config
@dataclass
class DrafterConfig:
    draft_vocab_size: int = 32000
    """Rows of the drafter's lm_head; the most frequent loss-masked training tokens (padded when fewer are seen)."""
    ttt_steps: int = 7
    """Training-time-test unroll length (EAGLE-3 / SpecForge 7; speculators 3)."""
    step_weight: float = 0.8
    """Loss weight of TTT step i is step_weight ** i."""
    init_from: str | None = None
    """Fine-tune an existing drafter checkpoint: its weights and its draft vocabulary are reused (never rebuilt)."""
    norm_before_fc: bool = False
    """Opt-in: RMSNorm over the 3H features before fc."""
    init_head_from_target: bool = False
    """Opt-in warm start (not in EAGLE-3): norm and lm_head rows copied from the target, fc = identity on the last
    tap (see Eagle3Drafter.init_head_from_target). Ignored with init_from."""

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1 or self.ttt_steps < 1 or not 0 < self.step_weight <= 1:
            raise ValueError("need draft_vocab_size >= 1, ttt_steps >= 1 and 0 < step_weight <= 1")


@dataclass
class TrainConfig:
    output_dir: str
    """Checkpoint, exports, logs, resumable state and report go here."""
    features: str = "online"
    """"online": a target forward per batch; "offline": features cached to disk once, then read every epoch."""
    features_dir: str | None = None
    """Offline cache directory (default <output_dir>/features)."""
    feature_dtype: str = "bfloat16"
    """Dtype of cached features ("bfloat16", "float16", "float32")."""
    epochs: float = 10.0
    """Passes over the training samples (SpecForge 10; fractions allowed)."""
    max_steps: int | None = None
    """Cap on optimizer steps (None: epochs decide)."""
    max_train_samples: int | None = None
    """Train on a seeded random subset of N samples (None: all)."""
    batch_size: int = 1
    """Samples per rank per micro-batch (SpecForge 1)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    lr: float = 1e-4
    """Peak learning rate (SpecForge 1e-4)."""
    warmup_ratio: float = 0.015
    """Share of steps of linear warm-up (SpecForge 1.5 %)."""
    min_lr_ratio: float = 0.0
    """Cosine decays to min_lr_ratio · lr."""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices (SpecForge 0)."""
    grad_clip: float = 0.5
    """Max gradient norm (SpecForge 0.5)."""
    mixed_precision: str = "auto"
    """"auto" (bf16 on CUDA / bf16-capable CPUs, else fp32), "bf16" or "fp32"."""
    seed: int = 0
    log_every: int = 10
    """Optimizer steps between log lines (loss and top-1 accuracy per TTT step)."""
    eval_every: int = 0
    """Optimizer steps between held-out evaluations (simulated τ); 0 = only at the end."""
    eval_samples: int = 64
    """Held-out samples per evaluation."""
    save_every: int = 0
    """Optimizer steps between resumable states; 0 = only at the end."""
    log_with: str | None = None
    """Accelerate tracker ("tensorboard", "wandb", ...); None: stdout + <output_dir>/train_log.jsonl only."""
    export: bool = True
    """Also write the SGLang/vLLM and speculators exports next to the checkpoint."""

    def __post_init__(self) -> None:
        if self.features not in ("online", "offline"):
            raise ValueError(f"features must be 'online' or 'offline', got {self.features!r}")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ValueError(f"feature_dtype must be one of {list(FEATURE_DTYPES)}")
        if self.mixed_precision not in ("auto", "bf16", "fp32"):
            raise ValueError("mixed_precision must be 'auto', 'bf16' or 'fp32'")
        if self.epochs <= 0 or self.batch_size < 1 or self.grad_accum < 1 or self.lr <= 0:
            raise ValueError("need epochs > 0, batch_size >= 1, grad_accum >= 1, lr > 0")
        if not 0 <= self.warmup_ratio < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("warmup_ratio must be in [0, 1) and min_lr_ratio in [0, 1]")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("max_steps must be >= 1 or None")


@dataclass
class Eagle3RecipeConfig:
    target: TargetConfig
    """The frozen target (aux_layer_ids: EAGLE-3's low / mid / high taps by default)."""
    data: DataConfig
    """Training data; the loss mask selects the tokens the drafter learns (and the draft vocabulary)."""
    train: TrainConfig
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    eval_data: DataConfig | None = None
    """Held-out data for the simulated τ (None: no held-out evaluation)."""
    report: ReportConfig = field(default_factory=ReportConfig)
    self_distill: SelfDistillConfig = field(default_factory=SelfDistillConfig)
    """Opt-in for raw-text data: add the target's own continuations of training prompts (train/self_distill.py)."""
    stdlib_corpus_dir: str | None = None
    """Write the reference corpus (stdlib_{train,heldout}_text.jsonl) here first when missing; data.path and
    eval_data.path may then point into it."""


@dataclass
class ReportOnlyConfig:
    target: TargetConfig | None = None
    """Target to measure against (None: the checkpoint's target_name and aux ids)."""
    report: ReportConfig = field(default_factory=ReportConfig)


# --------------------------------------------------------------------------------------------- helpers
@functools.lru_cache(maxsize=2)
def _epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    # one permutation per epoch, not per micro-batch: O(N) each, and the 8B recipes' N is ~1e6 (read-only result)
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def epoch_batch(num_samples: int, micro: int, per_epoch: int, seed: int, rank: int, world: int, bs: int) -> list[int]:
    """Sample indices of this rank's micro-batch number ``micro`` (global batches of world·bs, seeded per epoch)."""
    epoch, g = divmod(micro, per_epoch)
    start = g * world * bs + rank * bs
    return _epoch_order(num_samples, seed, epoch)[start : start + bs].tolist()


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def build_drafter(
    cfg: Eagle3RecipeConfig, target: TargetModel, tokenizer, train_set, eval_set, out: Path, log
) -> Eagle3Drafter:
    """Fine-tune start, resume, or fresh drafter; the draft vocabulary is built once and then always reused."""
    if cfg.drafter.init_from:
        log(f"drafter: fine-tuning {cfg.drafter.init_from} (weights and draft vocabulary reused)")
        return Eagle3Drafter.from_pretrained(cfg.drafter.init_from, target, tokenizer)
    drafter = Eagle3Drafter.from_target(
        target, cfg.drafter.draft_vocab_size, tokenizer, norm_before_fc=cfg.drafter.norm_before_fc
    )
    vocab_file = out / "draft_vocab.safetensors"
    counts = count_loss_tokens(train_set, target.vocab_size)
    if vocab_file.exists():
        maps = load_file(str(vocab_file))
        d2t, t2d = maps["d2t"], maps["t2d"]
        log(f"draft vocabulary reused from {vocab_file}")
    else:
        d2t, t2d = build_draft_vocab(counts, cfg.drafter.draft_vocab_size)
    drafter.set_draft_vocab(d2t, t2d)
    if cfg.drafter.init_head_from_target:
        drafter.init_head_from_target(target)
    heldout = ""
    if eval_set is not None:  # coverage of unseen answers: what the served drafter can reach at all
        heldout = f" and {coverage(count_loss_tokens(eval_set, target.vocab_size), drafter.t2d.cpu()):.1%} of the held-out ones"
    log(
        f"draft vocabulary: {cfg.drafter.draft_vocab_size} of {target.vocab_size} ids cover "
        f"{coverage(counts, drafter.t2d.cpu()):.1%} of the training targets{heldout}"
    )
    return drafter


@torch.no_grad()
def evaluate(accelerator, target, drafter, eval_set, cfg: Eagle3RecipeConfig, pad_id: int) -> dict:
    """Teacher-forced top-1 agreement per TTT step on held-out samples (sharded, summed over ranks) → simulated τ."""
    model = accelerator.unwrap_model(drafter).eval()
    n = min(len(eval_set), cfg.train.eval_samples)
    correct = torch.zeros(cfg.drafter.ttt_steps, device=accelerator.device)
    count = torch.zeros_like(correct)
    mine = list(range(accelerator.process_index, n, accelerator.num_processes))
    for s in range(0, len(mine), cfg.train.batch_size):
        batch = to_device(
            collate([eval_set[i] for i in mine[s : s + cfg.train.batch_size]], pad_id), accelerator.device
        )
        aux, target_logits = target_signals(target, batch)
        allowed, positions, sample_ids = attention_masks(batch)
        with accelerator.autocast():
            logits = model(aux.to(model.fc.weight.dtype), batch["input_ids"], positions, allowed, cfg.drafter.ttt_steps)
        res = eagle3_ttt_loss(logits, target_logits, batch["loss_mask"], model.t2d, sample_ids)
        correct += res.step_correct
        count += res.step_count
    correct, count = accelerator.reduce(correct, "sum"), accelerator.reduce(count, "sum")
    model.train()
    alphas = (correct / count.clamp(min=1)).tolist()
    return {"eval/acc": alphas, "eval/simulated_tau": simulated_tau(alphas)}


def report_main(argv: list[str]) -> None:
    """``report --drafter DIR [--config FILE] [overrides]``: measure any checkpoint with the verify runtime."""
    args, drafter_dir = list(argv), None
    if "--drafter" in args:
        i = args.index("--drafter")
        drafter_dir, args = args[i + 1], args[:i] + args[i + 2 :]
    recipe = any(a == "--config" or a.startswith("--config=") for a in args)
    cfg = parse_cli(Eagle3RecipeConfig if recipe else ReportOnlyConfig, args)
    drafter_dir = drafter_dir or cfg.report.drafter_dir or (cfg.train.output_dir if recipe else None)
    if drafter_dir is None:
        raise SystemExit("report mode needs --drafter DIR (or --config with train.output_dir / report.drafter_dir)")
    _, info = read_checkpoint_config(drafter_dir)
    target_cfg = cfg.target or TargetConfig(name_or_path=info.target_name, aux_layer_ids=info.aux_layer_ids)
    if target_cfg.aux_layer_ids is None:
        target_cfg.aux_layer_ids = info.aux_layer_ids
    tokenizer = load_tokenizer(target_cfg.name_or_path)
    target = TargetModel.from_config(target_cfg)
    drafter = Eagle3Drafter.from_pretrained(drafter_dir, target, tokenizer)
    eval_set = build_dataset(cfg.eval_data, tokenizer)[0] if recipe and cfg.eval_data is not None else None
    run_report(target, drafter, tokenizer, cfg.report, cfg.report.output_dir or drafter_dir, eval_set)


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str]) -> None:
    if argv and argv[0] == "report":
        return report_main(argv[1:])
    cfg = parse_cli(Eagle3RecipeConfig, argv)
    tc = cfg.train
    out = Path(tc.output_dir)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=mixed_precision(tc.mixed_precision),
        log_with=tc.log_with,
        project_dir=str(out),
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    set_seed(tc.seed)
    log_file = out / "train_log.jsonl"

    def log(msg: str) -> None:
        if accelerator.is_main_process:
            print(msg, flush=True)

    log(
        f"world {world} ({accelerator.distributed_type}), precision {accelerator.mixed_precision}, "
        f"device {accelerator.device}, threads/rank {torch.get_num_threads()}"
    )
    t_start = time.time()

    # ---- target, tokenizer, data
    tokenizer = load_tokenizer(cfg.target.name_or_path, cfg.target.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    target = TargetModel.from_config(cfg.target)
    with accelerator.main_process_first():
        if cfg.stdlib_corpus_dir and accelerator.is_main_process:
            from train.data import build_stdlib_samples

            for split in ("train", "heldout"):
                if not (Path(cfg.stdlib_corpus_dir) / f"stdlib_{split}_text.jsonl").exists():
                    log(
                        f"reference corpus ({split}): {build_stdlib_samples(tokenizer, split, out_dir=cfg.stdlib_corpus_dir)}"
                    )
        train_set, summary = build_dataset(cfg.data, tokenizer)
        eval_set = build_dataset(cfg.eval_data, tokenizer)[0] if cfg.eval_data is not None else None
    prompt_pool = train_set  # self-distillation draws its prompts from the whole split, not the subset below
    # a seeded random subset: the corpus is in file order, its head is a few modules
    if tc.max_train_samples is not None:
        train_set = train_set.shuffle(seed=tc.seed).select(range(min(tc.max_train_samples, len(train_set))))
    log(
        f"data: {summary['kept']} samples kept of {summary['rows']} ({summary['loss_tokens']:,} loss tokens), "
        f"skipped { ({k: v for k, v in summary['skipped'].items() if v}) }; training on {len(train_set)}"
    )
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "recipe.yaml")
    if cfg.self_distill.samples:
        if cfg.data.packing:
            raise SystemExit("self_distill adds unpacked samples; it cannot be combined with data.packing")
        distilled = out / "self_distill.jsonl"
        if accelerator.is_main_process and not distilled.exists():
            write_self_distilled(target, prompt_pool, cfg.self_distill, distilled, pad_id, tc.seed, log)
        accelerator.wait_for_everyone()
        extra = load_self_distilled(distilled, train_set.features, cfg.data.cache_dir)
        train_set = datasets.concatenate_datasets([train_set, extra])
        log(f"self-distillation: +{len(extra)} target continuations → {len(train_set)} training samples")

    # ---- draft vocabulary + drafter
    drafter = build_drafter(cfg, target, tokenizer, train_set, eval_set, out, log).to(accelerator.device)
    if accelerator.is_main_process and not (out / "draft_vocab.safetensors").exists():
        save_file({"d2t": drafter.d2t.cpu(), "t2d": drafter.t2d.cpu()}, str(out / "draft_vocab.safetensors"))

    # ---- features: online (target forward per batch) or offline (cache once, read every epoch)
    samples, collate_fn = train_set, collate
    if tc.features == "offline":
        cache_dir = Path(tc.features_dir or out / "features")
        key = cache_key(target, train_set._fingerprint, tc.feature_dtype, len(train_set))
        if not cache_is_valid(cache_dir, key):
            write_feature_cache(
                accelerator, target, train_set, cache_dir, key, tc.feature_dtype, pad_id=pad_id, log=log
            )
        samples, collate_fn = FeatureCache(cache_dir), collate_features
        log(f"features: offline cache {cache_dir} ({len(samples)} samples)")

    # ---- optimizer, schedule, resume
    optimizer = adamw(drafter, tc.lr, tc.weight_decay)
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    per_epoch = len(samples) // (world * tc.batch_size)  # the remainder of each epoch is dropped on every rank alike
    if per_epoch == 0:
        raise SystemExit(f"{len(samples)} samples are fewer than one global batch ({world} x {tc.batch_size})")
    total_steps = int(tc.epochs * per_epoch) // tc.grad_accum
    total_steps = min(total_steps, tc.max_steps or total_steps)
    warmup = max(1, round(tc.warmup_ratio * total_steps)) if tc.warmup_ratio else 0
    counters = load_training_state(accelerator, out) or {"step": 0}
    step = counters["step"]
    log(
        f"train: {total_steps} optimizer steps ({per_epoch} micro-batches/epoch/rank, batch {tc.batch_size} x "
        f"{tc.grad_accum} accum x {world} ranks), warm-up {warmup}, ttt {cfg.drafter.ttt_steps}"
        + (f"; resumed at step {step}" if step else "")
    )
    if accelerator.is_main_process and tc.log_with:
        accelerator.init_trackers("eagle3", config={k: str(v) for k, v in to_dict(cfg).items()})

    # ---- check the sharding this run really got: every rank's first-epoch samples, disjoint across ranks
    mine = torch.tensor(
        [
            i
            for m in range(per_epoch)
            for i in epoch_batch(len(samples), m, per_epoch, tc.seed, rank, world, tc.batch_size)
        ]
    )
    every = accelerator.gather(mine.to(accelerator.device)).cpu()
    sharding = {
        "world": world,
        "distributed_type": str(accelerator.distributed_type),
        "samples_per_rank": len(mine),
        "distinct_over_ranks": int(every.unique().numel()),
        "total_over_ranks": int(every.numel()),
    }
    if sharding["distinct_over_ranks"] != sharding["total_over_ranks"]:
        raise RuntimeError(f"ranks would train on overlapping samples: {sharding}")
    log(json.dumps({"sharding": sharding}))
    if accelerator.is_main_process:
        with open(log_file, "a") as f:
            f.write(json.dumps({"sharding": sharding}) + "\n")

    # ---- training-time-test loop
    model = accelerator.unwrap_model(drafter)
    k = cfg.drafter.ttt_steps
    stats = torch.zeros(2 + 2 * k, device=accelerator.device)  # loss sum, micro-batches, correct_i, count_i
    tokens, t_loop, micro = 0, time.time(), step * tc.grad_accum
    bar = tqdm(total=total_steps, initial=step, desc="eagle3", disable=not accelerator.is_main_process)
    while step < total_steps:
        ids = epoch_batch(len(samples), micro, per_epoch, tc.seed, rank, world, tc.batch_size)
        batch = to_device(collate_fn([samples[i] for i in ids], pad_id), accelerator.device)
        aux, target_logits = target_signals(target, batch)
        allowed, positions, sample_ids = attention_masks(batch)
        sync = (micro + 1) % tc.grad_accum == 0
        with contextlib.nullcontext() if sync else accelerator.no_sync(drafter), accelerator.autocast():
            logits = drafter(aux.to(model.fc.weight.dtype), batch["input_ids"], positions, allowed, k)
            res = eagle3_ttt_loss(
                logits, target_logits, batch["loss_mask"], model.t2d, sample_ids, cfg.drafter.step_weight
            )
            accelerator.backward(res.loss / tc.grad_accum)
        stats += torch.cat([res.loss.detach().reshape(1), stats.new_ones(1), res.step_correct, res.step_count])
        tokens += int(batch["attention_mask"].sum())
        micro += 1
        if not sync:
            continue
        set_lr(optimizer, warmup_cosine(step, total_steps, warmup, tc.lr, tc.min_lr_ratio))
        grad_norm = accelerator.clip_grad_norm_(drafter.parameters(), tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        do_eval = eval_set is not None and (step == total_steps or (tc.eval_every and step % tc.eval_every == 0))
        if step % tc.log_every == 0 or step == total_steps or do_eval:
            total = accelerator.reduce(stats, "sum")  # collective: every rank reaches it at the same step
            acc = (total[2 : 2 + k] / total[2 + k :].clamp(min=1)).tolist()
            metrics = {
                "step": step,
                "loss": float(total[0] / total[1]),
                "acc": [round(a, 4) for a in acc],
                "lr": optimizer.param_groups[0]["lr"],
                "grad_norm": float(grad_norm),
                "tokens_per_s": round(tokens * world / (time.time() - t_loop), 1),
            }
            if do_eval:
                metrics.update(evaluate(accelerator, target, drafter, eval_set, cfg, pad_id))
            log(json.dumps(metrics))
            if accelerator.is_main_process:
                with open(log_file, "a") as f:
                    f.write(json.dumps(metrics) + "\n")
                if tc.log_with:
                    accelerator.log({n: v for n, v in metrics.items() if not isinstance(v, list)}, step=step)
            stats.zero_()
        if tc.save_every and step % tc.save_every == 0 and step < total_steps:
            save_training_state(accelerator, out, {"step": step})
    bar.close()
    train_s = time.time() - t_loop

    # ---- save: resumable state, own-format checkpoint, engine exports
    save_training_state(accelerator, out, {"step": step})
    accelerator.end_training()
    if not accelerator.is_main_process:
        return
    model.save_pretrained(out)
    if tc.export:
        save_sglang(model, out / "export-sglang")
        save_speculators(model, out / "export-speculators")
    log(
        f"saved {out} (+ exports) after {train_s / 60:.1f} min of training, {(time.time() - t_start) / 60:.1f} min total"
    )

    # ---- report: τ and speedup in the verify runtime on held-out prompts
    if cfg.report.enabled:
        run_report(
            target,
            model,
            tokenizer,
            cfg.report,
            out,
            eval_set,
            notes=f"Drafter trained {step} steps ({train_s / 60:.1f} min, world {world}).",
            log=log,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
