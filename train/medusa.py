"""Train Medusa heads on a frozen target (Medusa-1) or together with it (Medusa-2), then measure them.

    python train/medusa.py --config recipes/smollm2-135m/medusa1.yaml [key=value ...]
    python train/medusa.py --config recipes/smollm2-135m/medusa2.yaml [key=value ...]    # joint: LoRA or full
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml train/medusa.py --config ...   # 2 CPU ranks
    python train/medusa.py report --drafter DIR [--config recipe.yaml] [report.prompts=8 ...]   # eval/report.py

Top to bottom: parse config → target, tokenizer, data → heads → (offline: the feature cache, shareable with the
EAGLE-3 recipe on the same target and data) → loop (Σ_k w^k CE_k on the assistant tokens, head k predicting token
t+2+k from the final-norm hidden state at t; AdamW + warm-up + cosine, grad clip) with held-out top-k accuracy per
head → static tree chosen from those accuracies under a node budget → checkpoint + vLLM / original exports →
τ / speedup report beside prompt lookup, the small draft model and the drafters in ``report.compare``.

Medusa-2 (``target.mode: joint``, Cai et al. 2024 §2.3.2): loss = L_LM + λ0 · Σ_k w^k L_k, the heads trained alone
for ``joint.drafter_warmup_steps`` first, λ0 warmed up (constant / linear / sine), the heads' learning rate ×
``joint.drafter_lr_multiplier`` (one `train.joint.JointConfig` and one loop, `train.position_loop`, shared with MTP); L_LM is the cross-entropy on the data or (``joint.lm_loss: kl``) the KL from the
original target's next-token distribution (self-distillation, which keeps the target's outputs). Quality guard: the
held-out LM loss and the top-1 agreement with the original target, before and after, logged and in the report.
The checkpoint carries the target's changes (a LoRA adapter or the full weights, ``<out>/target``); the report and
`models.loader.load_target` apply them.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402

from eval.report import quality_note  # noqa: E402
from eval.report_config import ReportConfig  # noqa: E402
from infer.tree_search import best_rank_paths, expected_accepted  # noqa: E402
from models.acceptance import expected_tokens  # noqa: E402
from models.config import parse_cli  # noqa: E402
from models.medusa import MedusaDrafter  # noqa: E402
from models.medusa_export import medusa_original_refusal, save_medusa_original, save_medusa_vllm  # noqa: E402
from models.target import TargetConfig  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.data.answerer import end_launched_process  # noqa: E402
from train.data.dataset import DataConfig  # noqa: E402
from train.distributed import make_accelerator  # noqa: E402
from train.features import final_hidden  # noqa: E402
from train.finish import report_drafter, save_drafter  # noqa: E402
from train.joint import JointConfig, joint_words, trained_modules  # noqa: E402
from train.loop import LoopResult, TargetAndData, feature_source, load_target_and_data, start_training  # noqa: E402
from train.losses import position_targets, rank_matches  # noqa: E402
from train.position_loop import PositionTask, train_positions  # noqa: E402
from train.report_mode import report_mode  # noqa: E402
from train.schedule import SampleHits, eval_batches, eval_shares, sample_lengths, to_device  # noqa: E402


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
class MedusaJointConfig(JointConfig):
    """Medusa-2's defaults (Cai et al. 2024 §2.3.2): λ0 0.2, the heads at 4x the target's learning rate; the fields,
    the schedule and the loop are `train.joint.JointConfig`'s, shared with MTP."""

    lambda0: float = 0.2
    drafter_lr_multiplier: float = 4.0


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
    joint: MedusaJointConfig = field(default_factory=MedusaJointConfig)
    """Medusa-2 settings, used when target.mode is "joint"."""

    def __post_init__(self) -> None:
        if self.target.mode == "joint" and self.train.features == "offline":
            raise ValueError("joint training changes the target's features every step: use train.features=online")


# ------------------------------------------------------------------------------------------ helpers
def heads_on(heads: MedusaDrafter, out, batch: dict, positions: list[torch.Tensor]) -> list[torch.Tensor]:
    """Head k's logits at ``positions[k]``, from the target's final-norm hidden state (joint training's reading)."""
    return heads([out.last_hidden[p] for p in positions])


@torch.no_grad()
def evaluate(
    accelerator, target, model: MedusaDrafter, eval_set, cfg: MedusaRecipeConfig, pad_id: int, per_sample: bool = False
) -> dict:
    """Held-out rank accuracy of every head (how often the label is its r-th candidate, r < tree_ranks), summed over
    ranks → simulated τ of the chain and the static tree that maximises the expected accepted length; with
    ``per_sample``, also each sample's top-1 hits and positions per head (``per_sample``, `SampleHits.total`)."""
    model.eval()
    K, R = model.config.num_heads, cfg.heads.tree_ranks
    hits = torch.zeros(K, R, device=accelerator.device)
    count = torch.zeros(K, device=accelerator.device)
    samples = SampleHits(accelerator, cfg.train, eval_set, K)
    for ids, batch in zip(
        eval_shares(accelerator, cfg.train, eval_set), eval_batches(accelerator, cfg.train, eval_set, pad_id)
    ):
        hidden = final_hidden(target, batch).to(next(model.parameters()).dtype)  # as the training step reads it
        targets = [position_targets(batch["input_ids"], batch["loss_mask"], k) for k in range(K)]
        logits = model([hidden[positions] for positions, _ in targets])  # forward: FSDP gathers its shards there
        for k, (positions, labels) in enumerate(targets):
            matches = rank_matches(logits[k], labels[positions], R)
            hits[k] += matches.sum(0)
            count[k] += positions.sum()
            samples.add(ids, k, positions, matches[:, 0])
    hits, count = accelerator.reduce(hits, "sum"), accelerator.reduce(count, "sum")
    table = samples.total()
    model.train()
    acc = (hits / count.clamp(min=1)[:, None]).tolist()
    paths = best_rank_paths(acc, cfg.heads.tree_nodes)
    out = {
        "eval/acc": [round(a[0], 4) for a in acc],
        "eval/rank_acc": [[round(x, 4) for x in a] for a in acc],
        "eval/simulated_tau": expected_tokens([a[0] for a in acc]),
        "eval/tree_expected_tau": 1 + expected_accepted(acc, paths),
        "tree_paths": [list(p) for p in paths],
    }
    if per_sample:
        out["per_sample"] = table
    return out


def build_heads(cfg: MedusaRecipeConfig, target, tokenizer, log) -> MedusaDrafter:
    """Fresh heads from the target (``heads.init_from`` null) or the checkpoint to continue, and their log line."""
    hc = cfg.heads
    if hc.init_from:
        log(f"heads: continuing from {hc.init_from}")
        heads = MedusaDrafter.from_pretrained(hc.init_from, target, tokenizer)
    else:
        heads = MedusaDrafter.from_target(target, hc.num_heads, hc.num_layers, hc.shared_head, tokenizer)
    trainable = sum(p.numel() for p in heads.parameters() if p.requires_grad)
    joint = joint_words(cfg.target.mode, target)
    log(
        f"heads: {hc.num_heads} x {hc.num_layers} ResBlock, {'shared' if hc.shared_head else 'per-head'} lm_head, "
        f"{trainable / 1e6:.1f} M trainable parameters{joint}"
    )
    return heads


def heads_task(
    accelerator, cfg: MedusaRecipeConfig, loaded: TargetAndData, heads: MedusaDrafter, samples, collate_fn
) -> PositionTask:
    """Medusa's part of the shared loop (train/position_loop.py): head k's (positions, labels), its logits from the
    frozen target's final-norm hidden state, the weights w^k, the held-out evaluation."""
    K, target, pad_id = cfg.heads.num_heads, loaded.target, loaded.pad_id

    def frozen_logits(model, batch, positions):
        hidden = final_hidden(target, batch).to(next(heads.parameters()).dtype)
        return model([hidden[p] for p in positions])

    return PositionTask(
        name="medusa",
        positions=K,
        position_loss="head_loss",
        targets=lambda batch: [position_targets(batch["input_ids"], batch["loss_mask"], k) for k in range(K)],
        frozen_logits=frozen_logits,
        batch_of=lambda ids: to_device(collate_fn([samples[i] for i in ids], pad_id), accelerator.device),
        num_samples=len(samples),
        weights_at=lambda step: [cfg.heads.head_weight**k for k in range(K)],
        evaluate=lambda: evaluate(accelerator, target, heads, loaded.eval_set, cfg, pad_id),
    )


def set_static_tree(heads: MedusaDrafter, last_eval: dict, log) -> None:
    """The static tree the last held-out evaluation chose (none without held-out data) into the heads' config, which
    the checkpoint carries."""
    heads.config.tree_paths = last_eval.get("tree_paths", [])
    if heads.config.tree_paths:
        log(f"static tree: {len(heads.config.tree_paths)} nodes, expected τ {last_eval['eval/tree_expected_tau']:.2f}")


def save_exports(heads: MedusaDrafter, out: Path, log) -> None:
    """Each engine layout where its loader builds the heads as trained; otherwise the reason, logged."""
    save_medusa_vllm(heads, out / "export-vllm")
    why = medusa_original_refusal(heads)
    if why is None:
        save_medusa_original(heads, out / "export-medusa")
    else:
        log(f"export: export-medusa left out: {why}")


def report_notes(joint: bool, done: LoopResult, before: dict | None, world: int, log) -> str:
    """The report's words on the run; where the run measured Medusa-2's quality guard (held-out LM loss and
    agreement with the original target, before and after), they carry it and are logged."""
    minutes = done.train_seconds / 60
    notes = f"Medusa-{2 if joint else 1} heads trained {done.steps} steps ({minutes:.1f} min, world {world})."
    if before and "eval/lm_loss" in done.last_eval:
        notes += " " + quality_note(before, done.last_eval)
        log(notes)
    return notes


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str]) -> None:
    if argv and argv[0] == "report":
        return report_mode(argv[1:], MedusaRecipeConfig)
    cfg = parse_cli(MedusaRecipeConfig, argv)
    tc, hc, joint = cfg.train, cfg.heads, cfg.target.mode == "joint"
    if hc.init_from and not (Path(hc.init_from) / "config.json").exists():
        raise SystemExit(f"heads.init_from={hc.init_from}: no checkpoint there (train it first, or set null)")
    warmup_phase = joint and cfg.joint.drafter_warmup_steps > 0
    # the target's parameters idle in warm-up, which DDP must be told
    accelerator, log = make_accelerator(tc, find_unused=warmup_phase, target=cfg.target)
    set_seed(tc.seed)
    t_start = time.time()

    # ---- target, tokenizer, data
    loaded = load_target_and_data(cfg, accelerator, log)
    target, train_set, eval_set = loaded.target, loaded.train_set, loaded.eval_set

    # ---- heads (and, for Medusa-2, the target that trains with them)
    heads = build_heads(cfg, target, loaded.tokenizer, log)
    samples, collate_fn = feature_source(accelerator, tc, target, train_set, loaded.pad_id, log)

    # ---- optimizer, schedule, resume
    model, optimizer, joint_run = trained_modules(
        accelerator, target, heads, heads_on if joint else None, tc, cfg.joint, eval_set, loaded.pad_id
    )
    lengths = sample_lengths(train_set) if tc.group_by_length else None  # dataset order (the feature cache keeps it)
    before = joint_run.before if joint_run else None  # the quality guard's baseline
    plan = start_training(
        accelerator, cfg, model, optimizer, len(samples), log, "medusa", before=before, lengths=lengths
    )

    # ---- loop (train/position_loop.py, shared with MTP)
    task = heads_task(accelerator, cfg, loaded, heads, samples, collate_fn)
    done = train_positions(accelerator, tc, task, plan, lengths, log, joint_run, eval_set is not None)

    # ---- save: checkpoint with its static tree, resumable state, the target's changes (Medusa-2), engine exports
    set_static_tree(heads, done.last_eval, log)
    save_drafter(accelerator, tc, plan, heads, MedusaDrafter, loaded, done, t_start, log, save_exports, joint)
    if not accelerator.is_main_process:
        return
    notes = report_notes(joint, done, before, accelerator.num_processes, log)

    # ---- report: τ and speedup in the verify runtime on held-out prompts (a joint target as it will be served)
    report_drafter(cfg, loaded, MedusaDrafter, notes, log, joint)
    end_launched_process(accelerator.num_processes)


if __name__ == "__main__":
    main(sys.argv[1:])
