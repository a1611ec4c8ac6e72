"""Train an EAGLE-3 drafter for a frozen target, then measure it with the verify runtime.

    python train/eagle3.py --config recipes/smollm2-135m/eagle3.yaml [key=value ...]
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml train/eagle3.py --config ...   # 2 CPU ranks
    torchrun --nproc_per_node 2 train/eagle3.py --config ...
    python train/eagle3.py report --drafter DIR [--config recipe.yaml] [report.prompts=8 ...]   # eval/report.py

Top to bottom: parse config → target, tokenizer, data → draft vocabulary + drafter → (offline: feature cache) →
training-time-test loop (EAGLE-3: soft cross-entropy on the draft vocab, step weights 0.8^i, AdamW + warm-up +
cosine, grad clip) with held-out simulated τ → checkpoint + engine exports → τ / speedup report.

Sharding, schedule, feature source and metrics log are shared with the other recipes (train/loop.py and the modules
beside it: config, distributed, schedule, progress).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets  # noqa: E402
import torch  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from eval.report_config import ReportConfig  # noqa: E402
from models.acceptance import expected_tokens  # noqa: E402
from models.config import parse_cli  # noqa: E402
from models.eagle3 import Eagle3Drafter  # noqa: E402
from models.eagle3_export import save_sglang, save_speculators  # noqa: E402
from models.target import TargetConfig  # noqa: E402
from models.ttt_attention import IMPLEMENTATIONS  # noqa: E402
from train.checkpoint import save_training_state  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.data.answerer import end_launched_process  # noqa: E402
from train.data.dataset import DataConfig  # noqa: E402
from train.data.self_distill import SelfDistillConfig, load_self_distilled, write_self_distilled  # noqa: E402
from train.distributed import full_state, make_accelerator  # noqa: E402
from train.draft_vocab import build_draft_vocab, count_loss_tokens, coverage  # noqa: E402
from train.features import attention_masks, target_signals  # noqa: E402
from train.finish import report_drafter, save_drafter  # noqa: E402
from train.loop import (  # noqa: E402
    LoopResult,
    TargetAndData,
    TrainingPlan,
    feature_source,
    load_target_and_data,
    start_training,
)
from train.losses import (  # noqa: E402
    TTTLoss,
    answer_spans,
    copy_weights,
    hits_by_root,
    lookup_hits,
    served_path_weights,
    ttt_loss,
    ttt_targets,
)
from train.optim import adamw  # noqa: E402
from train.progress import Progress, record  # noqa: E402
from train.report_mode import report_mode  # noqa: E402
from train.schedule import SampleHits, epoch_batch, eval_batches, eval_shares, sample_lengths, to_device  # noqa: E402


# ------------------------------------------------------------------------------------------- config
@dataclass
class DrafterConfig:
    draft_vocab_size: int = 32000
    """Rows of the drafter's lm_head; the most frequent loss-masked training tokens (padded when fewer are seen)."""
    ttt_steps: int = 7
    """Training-time-test unroll length (EAGLE-3 / SpecForge 7; speculators 3)."""
    step_weight: float = 0.8
    """Loss weight of TTT step i is step_weight ** i."""
    copy_weight: float = 1.0
    """Loss weight of the positions whose token prompt lookup would have proposed (`train.losses.lookup_hits`: a
    copy from the context), relative to the others; 1 is the plain loss. The shipped drafter is right less often
    there than elsewhere (docs/decisions.md, "Where EAGLE-3's first draft misses: it does not copy")."""
    off_path_weight: float = 1.0
    """Loss weight of the (position, step) places a served greedy chain of ``ttt_steps`` drafts would not draft
    from on the batch's text (inside a run its own current drafts would have accepted), relative to the places it
    would (`train.losses.served_path_weights`); 1 is the plain loss. Served rounds start mostly after rejections,
    where teacher-forced gains reached served τ least (docs/decisions.md, "Walked τ"); 0.3 over a 400-step stage
    changed nothing measurable against the plain loss (docs/data_scaling.md, "An eighth stage")."""
    ttt_attention: str = "auto"
    """How the unroll's attention is computed: "flash" (CPU: one flash-kernel pass and a log-sum-exp merge), "dense"
    (the scores written out; any device) or "auto" (flash on CPU, dense elsewhere). Same results
    (`models/ttt_attention.py`)."""
    init_from: str | None = None
    """Fine-tune an existing drafter checkpoint: its weights and its draft vocabulary are reused (unless
    ``rebuild_vocab``)."""
    rebuild_vocab: bool = False
    """With ``init_from``: build the draft vocabulary again from this recipe's data at ``draft_vocab_size``; shared
    tokens keep their trained lm_head rows, new ones start from the target's rows mapped into the trained head's
    space (`Eagle3Drafter.with_draft_vocab`). For a drafter whose vocabulary came from less or other data."""
    norm_before_fc: bool = False
    """Opt-in: RMSNorm over the 3H features before fc."""
    init_head_from_target: bool = False
    """Opt-in warm start (not in EAGLE-3): norm and lm_head rows copied from the target, fc = identity on the last
    tap (see Eagle3Drafter.init_head_from_target). Ignored with init_from."""

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1 or self.ttt_steps < 1 or not 0 < self.step_weight <= 1:
            raise ValueError("need draft_vocab_size >= 1, ttt_steps >= 1 and 0 < step_weight <= 1")
        if self.copy_weight <= 0 or self.off_path_weight <= 0:
            raise ValueError(
                f"drafter.copy_weight and off_path_weight must be > 0, got {self.copy_weight}, {self.off_path_weight}"
            )
        if self.rebuild_vocab and not self.init_from:
            raise ValueError(
                "drafter.rebuild_vocab rebuilds a trained drafter's vocabulary: it needs drafter.init_from"
            )
        if self.ttt_attention not in IMPLEMENTATIONS:
            raise ValueError(f"drafter.ttt_attention must be one of {IMPLEMENTATIONS}, got {self.ttt_attention!r}")


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
    """Opt-in for raw-text data: add the target's own continuations of training prompts (train/data/self_distill.py)."""
    stdlib_corpus_dir: str | None = None
    """Write the reference corpus (stdlib_{train,heldout}_text.jsonl) here first when missing; data.path and
    eval_data.path may then point into it."""


# --------------------------------------------------------------------------------------------- helpers
def reference_corpus_writer(cfg: Eagle3RecipeConfig, log) -> Callable[[object], None] | None:
    """``load_target_and_data``'s ``prepare``: write each missing split of the reference corpus into
    ``stdlib_corpus_dir`` (None when the recipe names no such folder)."""
    if not cfg.stdlib_corpus_dir:
        return None

    def write_corpus(tokenizer) -> None:
        from train.data.stdlib_samples import build_stdlib_samples

        for split in ("train", "heldout"):
            if not (Path(cfg.stdlib_corpus_dir) / f"stdlib_{split}_text.jsonl").exists():
                written = build_stdlib_samples(tokenizer, split, out_dir=cfg.stdlib_corpus_dir)
                log(f"reference corpus ({split}): {written}")

    return write_corpus


def build_drafter(cfg: Eagle3RecipeConfig, loaded: TargetAndData, log) -> Eagle3Drafter:
    """Fine-tune start, resume, or fresh drafter; the draft vocabulary is built once and then always reused."""
    target, tokenizer, eval_set = loaded.target, loaded.tokenizer, loaded.eval_set
    counts = count_loss_tokens(loaded.train_set, target.vocab_size)
    heldout_counts = None if eval_set is None else count_loss_tokens(eval_set, target.vocab_size)

    def covered(t2d: torch.Tensor) -> str:
        # coverage of unseen answers: what the served drafter can reach at all
        heldout = "" if heldout_counts is None else f" and {coverage(heldout_counts, t2d):.1%} of the held-out ones"
        return f"{coverage(counts, t2d):.1%} of the training targets{heldout}"

    if cfg.drafter.init_from:
        # fp32 weights to train, as a fresh drafter's (the loader places a drafter in the target's dtype)
        drafter = Eagle3Drafter.from_pretrained(cfg.drafter.init_from, target, tokenizer).float()
        how = "over a rebuilt draft vocabulary" if cfg.drafter.rebuild_vocab else "weights and draft vocabulary reused"
        # a vocabulary chosen from other data can miss much of this data's targets (docs/decisions.md)
        log(
            f"drafter: fine-tuning {cfg.drafter.init_from} ({how}); its draft vocabulary of "
            f"{drafter.config.draft_vocab_size} ids covers {covered(drafter.t2d.cpu())}"
        )
        if not cfg.drafter.rebuild_vocab:
            return drafter
    else:
        drafter = Eagle3Drafter.from_target(
            target, cfg.drafter.draft_vocab_size, tokenizer, norm_before_fc=cfg.drafter.norm_before_fc
        )
    vocab_file = Path(cfg.train.output_dir) / "draft_vocab.safetensors"
    if vocab_file.exists():
        maps = load_file(str(vocab_file))
        d2t, t2d = maps["d2t"], maps["t2d"]
        log(f"draft vocabulary reused from {vocab_file}")
    else:
        d2t, t2d = build_draft_vocab(counts, cfg.drafter.draft_vocab_size)
    if cfg.drafter.init_from:
        drafter = drafter.with_draft_vocab(d2t, t2d, target)
    else:
        drafter.set_draft_vocab(d2t, t2d)
        if cfg.drafter.init_head_from_target:
            drafter.init_head_from_target(target)
    log(
        f"draft vocabulary: {cfg.drafter.draft_vocab_size} of {target.vocab_size} ids cover {covered(drafter.t2d.cpu())}"
    )
    return drafter


def save_draft_vocab(accelerator, drafter: Eagle3Drafter, out: Path) -> None:
    """``<out>/draft_vocab.safetensors``, written once by the main process: a resumed run reads it back
    (`build_drafter`), so the vocabulary never changes under trained weights."""
    if accelerator.is_main_process and not (out / "draft_vocab.safetensors").exists():
        save_file({"d2t": drafter.d2t.cpu(), "t2d": drafter.t2d.cpu()}, str(out / "draft_vocab.safetensors"))


@torch.no_grad()
def evaluate(
    accelerator, target, drafter, eval_set, cfg: Eagle3RecipeConfig, pad_id: int, per_sample: bool = False
) -> dict:
    """Teacher-forced top-1 agreement per TTT step on held-out samples (sharded, summed over ranks) → simulated τ,
    and the walked τ: each answer's greedy chain of ``ttt_steps`` drafts replayed on those hits
    (`models.acceptance.walked_chain`), what serving the same text gives. With ``per_sample``, also each sample's
    hits and positions per step (``per_sample``, `SampleHits.total`) and its walked chains (``walked``,
    `SampleHits.walked`)."""
    model = accelerator.unwrap_model(drafter).eval()
    k = cfg.drafter.ttt_steps
    hits = SampleHits(accelerator, cfg.train, eval_set, k)
    for ids, batch in zip(
        eval_shares(accelerator, cfg.train, eval_set), eval_batches(accelerator, cfg.train, eval_set, pad_id)
    ):
        aux, last_hidden = target_signals(target, batch)
        allowed, positions, sample_ids = attention_masks(batch)
        labels = ttt_targets(last_hidden, target.lm_head, batch["loss_mask"], model.t2d, k, sample_ids)
        with accelerator.autocast():
            features = aux.to(model.fc.weight.dtype)
            logits = model(features, batch["input_ids"], positions, allowed, k, labels.masks, cfg.drafter.ttt_attention)
        top1 = [step_logits.argmax(-1) == labels.top[i] for i, step_logits in enumerate(logits)]
        for i, hit in enumerate(top1):  # ttt_loss's top-1 agreement, kept per sample
            hits.add(ids, i, labels.masks[i], hit)
        hits.walk(ids, hits_by_root(labels.masks, top1), answer_spans(batch["loss_mask"], sample_ids))
    table, walked = hits.total(), hits.walked()
    model.train()
    correct = [sum(s[i][0] for s in table) for i in range(k)]
    count = [sum(s[i][1] for s in table) for i in range(k)]
    alphas = [c / max(n, 1) for c, n in zip(correct, count)]
    tokens, rounds = sum(w[0] for w in walked), sum(w[1] for w in walked)
    out = {
        "eval/acc": alphas,
        "eval/simulated_tau": expected_tokens(alphas),
        "eval/walked_tau": tokens / max(rounds, 1),
    }
    if per_sample:
        out["per_sample"], out["walked"] = table, walked
    return out


def add_self_distilled(accelerator, cfg: Eagle3RecipeConfig, loaded: TargetAndData, log) -> datasets.Dataset:
    """The training set plus the target's own continuations of prompts of the whole training split
    (``self_distill``), written once by the main process to ``<output_dir>/self_distill.jsonl`` and read back by
    every rank."""
    if cfg.data.packing:
        raise SystemExit("self_distill adds unpacked samples; it cannot be combined with data.packing")
    distilled = Path(cfg.train.output_dir) / "self_distill.jsonl"
    if accelerator.is_main_process and not distilled.exists():
        write_self_distilled(
            loaded.target, loaded.full_set, cfg.self_distill, distilled, loaded.pad_id, cfg.train.seed, log
        )
    accelerator.wait_for_everyone()
    extra = load_self_distilled(distilled, loaded.train_set.features, cfg.data.cache_dir)
    train_set = datasets.concatenate_datasets([loaded.train_set, extra])
    log(f"self-distillation: +{len(extra)} target continuations → {len(train_set)} training samples")
    return train_set


def save_exports(drafter: Eagle3Drafter, out: Path, log) -> None:
    """The engines' folders beside the checkpoint: SGLang's and the speculators' (vLLM's) layouts, both always
    written (nothing to log)."""
    save_sglang(drafter, out / "export-sglang")
    save_speculators(drafter, out / "export-speculators")


# ------------------------------------------------------------------------------------------------ loop
def ttt_step(accelerator, drafter, target, batch: dict[str, torch.Tensor], dc: DrafterConfig) -> TTTLoss:
    """One micro-batch of training-time test: the target's signals, the labels, the drafter unrolled
    ``dc.ttt_steps`` times on its own outputs, the step-weighted soft cross-entropy and its backward (the optimizer
    step is the caller's). ``drafter`` as accelerate prepared it."""
    model = accelerator.unwrap_model(drafter)
    aux, last_hidden = target_signals(target, batch)
    allowed, positions, sample_ids = attention_masks(batch)
    labels = ttt_targets(last_hidden, target.lm_head, batch["loss_mask"], model.t2d, dc.ttt_steps, sample_ids)
    with accelerator.accumulate(drafter), accelerator.autocast():  # no all-reduce before the boundary
        features = aux.to(model.fc.weight.dtype)
        logits = drafter(features, batch["input_ids"], positions, allowed, dc.ttt_steps, labels.masks, dc.ttt_attention)
        weights = None
        if dc.copy_weight != 1.0:
            hits = lookup_hits(batch["input_ids"], sample_ids)
            weights = copy_weights(hits, labels.masks, dc.copy_weight)
        if dc.off_path_weight != 1.0:
            top1 = [step_logits.detach().argmax(-1) == labels.top[i] for i, step_logits in enumerate(logits)]
            spans = answer_spans(batch["loss_mask"], sample_ids)
            path = served_path_weights(labels.masks, top1, spans, dc.off_path_weight)
            weights = path if weights is None else [w * p for w, p in zip(weights, path)]
        res = ttt_loss(logits, labels, dc.step_weight, weights)
        accelerator.backward(res.loss)  # divided by train.grad_accum there
    return res


def train_ttt(
    accelerator,
    cfg: Eagle3RecipeConfig,
    plan: TrainingPlan,
    loaded: TargetAndData,
    samples,
    collate_fn,
    lengths,
    log,
) -> LoopResult:
    """Training-time test (EAGLE-3): per micro-batch the target's signals, the drafter unrolled ``ttt_steps`` times
    on its own outputs, the step-weighted soft cross-entropy; at each optimizer step the log line, the held-out
    evaluation, the resumable state and the snapshots when due."""
    tc, out = cfg.train, Path(cfg.train.output_dir)
    target, pad_id, eval_set = loaded.target, loaded.pad_id, loaded.eval_set
    rank, world = accelerator.process_index, accelerator.num_processes
    drafter, optimizer = plan.model, plan.optimizer
    model = accelerator.unwrap_model(drafter)
    k = cfg.drafter.ttt_steps
    progress = Progress(
        accelerator, tc, plan.total_steps, plan.warmup, plan.start_step, k, "eagle3", position_loss="step_loss"
    )
    micro = plan.start_step * tc.grad_accum
    while progress.step < plan.total_steps:
        ids = epoch_batch(len(samples), micro, plan.per_epoch, tc.seed, rank, world, tc.batch_size, lengths)
        batch = to_device(collate_fn([samples[i] for i in ids], pad_id), accelerator.device)
        res = ttt_step(accelerator, drafter, target, batch, cfg.drafter)
        progress.add(
            res.loss, res.step_correct, res.step_count, int(batch["attention_mask"].sum()), None, res.step_loss
        )
        micro += 1
        if not accelerator.sync_gradients:
            continue
        progress.optimizer_step(drafter, optimizer)
        do_log, do_eval = progress.due(eval_set is not None)
        if do_log:
            metrics = progress.metrics()
            if do_eval:
                metrics.update(evaluate(accelerator, target, drafter, eval_set, cfg, pad_id))
            record(accelerator, tc, metrics, log)
        if progress.save_due():
            save_training_state(accelerator, out, {"step": progress.step}, tc.keep_states)
        if progress.snapshot_due():
            snapshot = full_state(accelerator, drafter)
            if accelerator.is_main_process:
                model.save_pretrained(out / "snapshots" / f"step-{progress.step}", snapshot)
    return LoopResult(progress.step, progress.close())


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str]) -> None:
    if argv and argv[0] == "report":
        return report_mode(argv[1:], Eagle3RecipeConfig)
    cfg = parse_cli(Eagle3RecipeConfig, argv)
    tc = cfg.train
    accelerator, log = make_accelerator(tc, target=cfg.target)
    set_seed(tc.seed)
    t_start = time.time()

    # ---- target, tokenizer, data (+ the target's own continuations, opt-in)
    loaded = load_target_and_data(cfg, accelerator, log, reference_corpus_writer(cfg, log))
    if cfg.self_distill.samples:
        loaded.train_set = add_self_distilled(accelerator, cfg, loaded, log)

    # ---- draft vocabulary + drafter
    drafter = build_drafter(cfg, loaded, log).to(accelerator.device)
    save_draft_vocab(accelerator, drafter, Path(tc.output_dir))

    # ---- features: online (target forward per batch) or offline (cache once, read every epoch)
    samples, collate_fn = feature_source(accelerator, tc, loaded.target, loaded.train_set, loaded.pad_id, log)

    # ---- optimizer, schedule, resume, the sharding this run really got
    optimizer = adamw(drafter, tc.lr, tc.weight_decay)
    # dataset order (the feature cache keeps it)
    lengths = sample_lengths(loaded.train_set) if tc.group_by_length else None
    detail = f", ttt {cfg.drafter.ttt_steps}"
    plan = start_training(accelerator, cfg, drafter, optimizer, len(samples), log, "eagle3", detail, lengths=lengths)

    # ---- training-time-test loop
    done = train_ttt(accelerator, cfg, plan, loaded, samples, collate_fn, lengths, log)

    # ---- save: resumable state, own-format checkpoint, engine exports
    model = accelerator.unwrap_model(plan.model)
    save_drafter(accelerator, tc, plan, model, Eagle3Drafter, loaded, done, t_start, log, save_exports)
    if not accelerator.is_main_process:
        return

    # ---- report: τ and speedup in the verify runtime on held-out prompts
    world = accelerator.num_processes
    notes = f"Drafter trained {done.steps} steps ({done.train_seconds / 60:.1f} min, world {world})."
    report_drafter(cfg, loaded, Eagle3Drafter, notes, log)
    end_launched_process(accelerator.num_processes)


if __name__ == "__main__":
    main(sys.argv[1:])
