"""Train DeepSeek-V3-style MTP modules on a frozen target or jointly with it, then measure them as self-speculation.

    python train/mtp.py --config recipes/smollm2-135m/mtp.yaml [key=value ...]          # frozen target
    python train/mtp.py --config recipes/smollm2-135m/mtp-joint.yaml [key=value ...]    # joint: LoRA or full
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml train/mtp.py --config ...   # 2 CPU ranks
    python train/mtp.py report --drafter DIR [--config recipe.yaml] [report.prompts=8 ...]   # eval/report.py

Top to bottom: parse config → target, tokenizer, data → D modules (models/mtp.py; blocks of the target's own layer
class) → loop → checkpoint + DeepSeek-V3 / Qwen3-Next exports → τ / speedup report (the modules as a chain, reused
past D, and a per-depth top-k tree) beside prompt lookup, the small draft model and the drafters in ``report.compare``.

Loss (DeepSeek-V3 §2.2): L = L_main + Σ_d λ_d · CE_d. Depth d (0-based) at position t reads the depth d-1 output at t
(d = 0: the target's signal ``mtp.input_signal`` names, by default its final-norm output, which the engines feed) and
the embedding of token t+1+d, and predicts token t+2+d; CE_d is its mean cross-entropy over the loss tokens. λ is one
value (λ/D for each depth, as DeepSeek-V3 writes it) or one per depth, optionally switched at a step (DeepSeek-V3: 0.3,
then 0.1). L_main, the target's own next-token loss, is there in joint mode only (``target.mode: joint``; LoRA or
full): the target trains with the modules, after ``joint.drafter_warmup_steps`` in which only the modules train
(one `train.joint.JointConfig` and one loop, `train.position_loop`, shared with Medusa-2). The main-loss change is the
quality guard: held-out LM loss and top-1 agreement with the original target, before and after, logged and in the report.
Features are online: every step runs the target (a joint target changes every step, and the offline cache holds no
pre-norm state for ``mtp.input_signal: pre_norm``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402

from eval.report import quality_note  # noqa: E402
from eval.report_config import ReportConfig  # noqa: E402
from infer.mtp_proposer import input_signal  # noqa: E402
from infer.tree_search import expected_accepted  # noqa: E402
from models.acceptance import expected_tokens  # noqa: E402
from models.config import parse_cli  # noqa: E402
from models.mtp import BLOCK_INITS, INPUT_SIGNALS, MTPConfig, MTPDrafter  # noqa: E402
from models.mtp_export import mtp_engine_exports  # noqa: E402
from models.target import TargetConfig, TargetModel  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.data.answerer import end_launched_process  # noqa: E402
from train.data.dataset import DataConfig, collate  # noqa: E402
from train.distributed import make_accelerator  # noqa: E402
from train.features import attention_masks, target_forward  # noqa: E402
from train.finish import report_drafter, save_drafter  # noqa: E402
from train.joint import JointConfig, joint_words, trained_modules  # noqa: E402
from train.loop import LoopResult, TargetAndData, load_target_and_data, start_training  # noqa: E402
from train.losses import position_targets, rank_matches  # noqa: E402
from train.position_loop import PositionTask, train_positions  # noqa: E402
from train.report_mode import report_mode  # noqa: E402
from train.schedule import SampleHits, eval_batches, eval_shares, sample_lengths, to_device  # noqa: E402


# ------------------------------------------------------------------------------------------- config
@dataclass
class ModulesConfig:
    num_modules: int = 1
    """D sequential modules; depth d (1-based) predicts token t+1+d (DeepSeek-V3: D = 1)."""
    block_init: str = "last_layer"
    """Each module's block starts as a copy of the target's last layer ("last_layer") or random ("random")."""
    input_signal: str = MTPConfig.input_signal
    """h^0: the target's final-norm output ("last_hidden", what vLLM / SGLang / transformers feed, so the engine
    exports take it) or its last-layer output before the norm ("pre_norm": drafters' runtime only)."""
    loss_weight: float | list[float] = 0.3
    """λ: one value (each depth weighs λ/D, DeepSeek-V3) or one weight per depth."""
    loss_weight_later: float | list[float] | None = None
    """λ from optimizer step ``switch_step`` on (DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1); None: keep."""
    switch_step: int = 0
    tree_ranks: int = 4
    """Candidates per depth whose held-out accuracy is measured: the expected τ of the chain + top-k sibling tree."""
    init_from: str | None = None
    """Continue from an MTP checkpoint of this target (weights reused; fresh optimizer and schedule)."""

    def __post_init__(self) -> None:
        if self.num_modules < 1 or self.block_init not in BLOCK_INITS:
            raise ValueError(f"need num_modules >= 1 and block_init in {BLOCK_INITS}")
        if self.input_signal not in INPUT_SIGNALS:
            raise ValueError(f"input_signal must be one of {INPUT_SIGNALS}, got {self.input_signal!r}")
        for w in (self.loss_weight, self.loss_weight_later):
            if isinstance(w, list) and len(w) != self.num_modules:
                raise ValueError(f"a per-depth loss weight list needs {self.num_modules} entries, got {w}")
            if w is not None and min(w if isinstance(w, list) else [w]) < 0:
                raise ValueError(f"loss weights must be >= 0, got {w}")
        if self.switch_step < 0 or self.tree_ranks < 1:
            raise ValueError("need switch_step >= 0 and tree_ranks >= 1")

    def weights_at(self, step: int) -> list[float]:
        """λ_d of every depth at optimizer step ``step``."""
        later = self.loss_weight_later is not None and step >= self.switch_step
        w = self.loss_weight_later if later else self.loss_weight
        return list(w) if isinstance(w, list) else [w / self.num_modules] * self.num_modules


@dataclass
class MTPRecipeConfig:
    target: TargetConfig
    data: DataConfig
    """Training data; the loss mask selects the tokens every depth learns."""
    train: TrainConfig
    mtp: ModulesConfig = field(default_factory=ModulesConfig)
    eval_data: DataConfig | None = None
    """Held-out data for per-depth loss / accuracy, simulated τ and (joint) the quality guard."""
    report: ReportConfig = field(default_factory=ReportConfig)
    joint: JointConfig = field(default_factory=JointConfig)
    """Joint mode's settings, used when target.mode is "joint" (DeepSeek-V3: λ0 1, one learning rate)."""

    def __post_init__(self) -> None:
        if self.train.features != "online":
            raise ValueError(
                "MTP trains on online features (train.features=online): the loop runs the target every step (a joint "
                "target changes every step; the offline cache holds no pre-norm state for mtp.input_signal=pre_norm)"
            )


# ------------------------------------------------------------------------------------------ helpers
def modules_on(drafter: MTPDrafter, out, batch: dict, positions: list[torch.Tensor]) -> list[torch.Tensor]:
    """Depth d's logits at ``positions[d]``, from the signal the drafter reads of the target's output (joint
    training's reading)."""
    return run_modules(drafter, input_signal(drafter).of(out), batch, positions)


def run_modules(drafter: MTPDrafter, target_hidden: torch.Tensor, batch: dict, positions: list[torch.Tensor]):
    """Depth d's logits [N_d, V] at ``positions[d]`` [B, T] bool, teacher-forced on the batch's tokens; target_hidden
    [B, T, H] is h^0 (the signal the drafter's input_signal names). ``drafter`` may be its distributed wrapper."""
    allowed, position_ids, _ = attention_masks(batch)
    hidden = target_hidden.to(next(drafter.parameters()).dtype)
    return drafter(hidden, batch["input_ids"], position_ids, allowed, positions)


def depth_targets(batch: dict, D: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(positions, labels) of every depth: depth d at t predicts token t+2+d, a loss token of the same sample."""
    sample_ids = attention_masks(batch)[2]
    return [position_targets(batch["input_ids"], batch["loss_mask"], d, sample_ids) for d in range(D)]


@torch.no_grad()
def evaluate(
    accelerator,
    target: TargetModel,
    drafter: MTPDrafter,
    eval_set,
    tc: TrainConfig,
    R: int,
    pad_id: int,
    per_sample: bool = False,
):
    """Held-out, teacher-forced: every depth's loss and rank accuracy (how often the label is its r-th candidate,
    r < R) → simulated τ of the chain and expected τ of the chain + top-R sibling tree the proposer builds; with
    ``per_sample``, also each sample's top-1 hits and positions per depth (``per_sample``, `SampleHits.total`)."""
    drafter.eval()
    D, signal = drafter.config.num_modules, input_signal(drafter)
    hits, loss = torch.zeros(D, R, device=accelerator.device), torch.zeros(D, device=accelerator.device)
    count = torch.zeros(D, device=accelerator.device)
    samples = SampleHits(accelerator, tc, eval_set, D)
    for ids, batch in zip(eval_shares(accelerator, tc, eval_set), eval_batches(accelerator, tc, eval_set, pad_id)):
        targets = depth_targets(batch, D)
        hidden = signal.of(target_forward(target, batch, logits=False))
        for d, (logits, (positions, labels)) in enumerate(
            zip(run_modules(drafter, hidden, batch, [p for p, _ in targets]), targets)
        ):
            matches = rank_matches(logits, labels[positions], R)
            hits[d] += matches.sum(0)
            loss[d] += F.cross_entropy(logits.float(), labels[positions], reduction="sum")
            count[d] += positions.sum()
            samples.add(ids, d, positions, matches[:, 0])
    hits, loss, count = (accelerator.reduce(x, "sum") for x in (hits, loss, count))
    table = samples.total()
    drafter.train()
    acc = (hits / count.clamp(min=1)[:, None]).tolist()
    tree = [(0,) * d + (r,) for d in range(D) for r in range(R)]  # MTPProposer(top_k=R): chain + leaf siblings
    out = {
        "eval/depth_loss": [round(x, 4) for x in (loss / count.clamp(min=1)).tolist()],
        "eval/acc": [round(a[0], 4) for a in acc],
        "eval/rank_acc": [[round(x, 4) for x in a] for a in acc],
        "eval/simulated_tau": expected_tokens([a[0] for a in acc]),
        f"eval/tree_top{R}_expected_tau": 1 + expected_accepted(acc, tree),
    }
    if per_sample:
        out["per_sample"] = table
    return out


def build_modules(cfg: MTPRecipeConfig, target: TargetModel, tokenizer, log) -> MTPDrafter:
    """Fresh modules from the target (``mtp.init_from`` null) or the checkpoint to continue (refused when its module
    count or input signal differs from the recipe's), in training mode, and their log line."""
    mc = cfg.mtp
    if mc.init_from:
        log(f"modules: continuing from {mc.init_from}")
        drafter = MTPDrafter.from_pretrained(mc.init_from, target, tokenizer)
        if drafter.config.num_modules != mc.num_modules:
            raise SystemExit(
                f"{mc.init_from} has {drafter.config.num_modules} modules, mtp.num_modules is {mc.num_modules}"
            )
        if drafter.config.input_signal != mc.input_signal:  # its modules learned to read that signal
            raise SystemExit(
                f"{mc.init_from} reads the target's {drafter.config.input_signal} signal, mtp.input_signal is "
                f"{mc.input_signal}: set mtp.input_signal={drafter.config.input_signal} to continue it"
            )
    else:
        drafter = MTPDrafter.from_target(target, mc.num_modules, tokenizer, mc.block_init, mc.input_signal)
    drafter.train()
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    joint = joint_words(cfg.target.mode, target)
    log(
        f"modules: {mc.num_modules} x {drafter.config.block_class} ({mc.block_init}), h^0 = the target's "
        f"{input_signal(drafter)}, {trainable / 1e6:.1f} M trainable parameters, λ {mc.weights_at(0)}{joint}"
    )
    return drafter


def modules_task(accelerator, cfg: MTPRecipeConfig, loaded: TargetAndData, drafter: MTPDrafter) -> PositionTask:
    """MTP's part of the shared loop (train/position_loop.py): depth d's (positions, labels), its logits from the
    frozen target's signal, the weights λ_d (logged), the held-out evaluation."""
    mc, target, train_set, pad_id = cfg.mtp, loaded.target, loaded.train_set, loaded.pad_id
    D = mc.num_modules
    signal = input_signal(drafter)  # read off the drafter: the loop's ``model`` may be a distributed wrapper

    def frozen_logits(model, batch, positions):
        with torch.no_grad():
            hidden = signal.of(target_forward(target, batch, logits=False))
        return run_modules(model, hidden, batch, positions)

    return PositionTask(
        name="mtp",
        positions=D,
        position_loss="depth_loss",
        targets=lambda batch: depth_targets(batch, D),
        frozen_logits=frozen_logits,
        batch_of=lambda ids: to_device(collate([train_set[i] for i in ids], pad_id), accelerator.device),
        num_samples=len(train_set),
        weights_at=mc.weights_at,
        evaluate=lambda: evaluate(accelerator, target, drafter, loaded.eval_set, cfg.train, mc.tree_ranks, pad_id),
        log_extra=lambda step: {"lambda": mc.weights_at(step)},
    )


def save_exports(drafter: MTPDrafter, out: Path, log) -> None:
    """Each engine layout where it loads (D > 1: the first module), or the reason it does not; logged either way."""
    for name, write, what in mtp_engine_exports(drafter):
        if write is None:
            log(f"export: {name} left out: {what}")
        else:
            write(out / name)
            log(f"export: {name} written: {what}")


def report_notes(cfg: MTPRecipeConfig, done: LoopResult, before: dict | None, world: int) -> str:
    """The report's words on the run: the held-out accuracy per depth and, in joint mode, the quality guard (held-out
    LM loss and agreement with the original target, before and after), where the run measured them."""
    kind = "joint" if cfg.target.mode == "joint" else "frozen target"
    notes = (
        f"MTP, {cfg.mtp.num_modules} module(s) trained {done.steps} steps ({done.train_seconds / 60:.1f} min, "
        f"world {world}, {kind})."
    )
    last_eval = done.last_eval
    if "eval/acc" in last_eval:
        notes += (
            f" Held-out teacher-forced top-1 accuracy per depth {last_eval['eval/acc']}, simulated τ"
            f" {last_eval['eval/simulated_tau']:.2f}."
        )
    if before and "eval/lm_loss" in last_eval:
        notes += " " + quality_note(before, last_eval)
    return notes


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str]) -> None:
    if argv and argv[0] == "report":
        return report_mode(argv[1:], MTPRecipeConfig)
    cfg = parse_cli(MTPRecipeConfig, argv)
    tc, mc, jc = cfg.train, cfg.mtp, cfg.joint
    joint = cfg.target.mode == "joint"
    if mc.init_from and not (Path(mc.init_from) / "config.json").exists():
        raise SystemExit(f"mtp.init_from={mc.init_from}: no checkpoint there (train it first, or set null)")
    accelerator, log = make_accelerator(tc, find_unused=joint and jc.drafter_warmup_steps > 0, target=cfg.target)
    set_seed(tc.seed)
    t_start = time.time()

    # ---- target, tokenizer, data
    loaded = load_target_and_data(cfg, accelerator, log)
    target, train_set, eval_set = loaded.target, loaded.train_set, loaded.eval_set

    # ---- modules (and, in joint mode, the target that trains with them)
    drafter = build_modules(cfg, target, loaded.tokenizer, log)

    # ---- optimizer, schedule, resume
    model, optimizer, joint_run = trained_modules(
        accelerator, target, drafter, modules_on if joint else None, tc, jc, eval_set, loaded.pad_id
    )
    lengths = sample_lengths(train_set) if tc.group_by_length else None  # dataset order (the feature cache keeps it)
    before = joint_run.before if joint_run else None  # the quality guard's baseline
    plan = start_training(
        accelerator, cfg, model, optimizer, len(train_set), log, "mtp", before=before, lengths=lengths
    )

    # ---- loop (train/position_loop.py, shared with Medusa)
    task = modules_task(accelerator, cfg, loaded, drafter)
    done = train_positions(accelerator, tc, task, plan, lengths, log, joint_run, eval_set is not None)

    # ---- save: resumable state, the target's changes (joint), checkpoint, engine exports
    save_drafter(accelerator, tc, plan, drafter, MTPDrafter, loaded, done, t_start, log, save_exports, joint)
    if not accelerator.is_main_process:
        return
    notes = report_notes(cfg, done, before, accelerator.num_processes)
    log(notes)

    # ---- report: τ and speedup in the verify runtime on held-out prompts (a joint target as it will be served)
    report_drafter(cfg, loaded, MTPDrafter, notes, log, joint)
    end_launched_process(accelerator.num_processes)


if __name__ == "__main__":
    main(sys.argv[1:])
