"""The data-scaling curve of one training run: for each snapshot (``<run>/snapshots/step-N``, written by
``train.snapshot_steps``) and the final checkpoint, the tokens it has read, its held-out acceptance per draft
position (teacher-forced, the training evaluation) and its served τ and acceptance per position on a prompt file
(greedy chain in the verify runtime, answers stopping at EOS or the cap), and for EAGLE-3 its walked τ on both
(each answer's greedy chain replayed on the teacher-forced hits: served τ on a text fixed for every row; `GAINS`).
The recipe's family (the one whose section its YAML has, e.g. an EAGLE-3 recipe's ``drafter``) gives the config,
the held-out evaluation and the chain (`train.recipes.TrainingEntry`, `infer.family.DrafterFamily.chain`).

    python -m scripts.data_scaling --config recipes/smollm2-135m/eagle3-text.yaml \
        --prompts eval/prompts/specbench_unseen.jsonl --out docs/data_scaling [--extra shipped=models/smollm2_eagle3]

τ and acceptance do not depend on timing, so this may run beside other work; speedups come from the report
(``python train/<method>.py report``), which times every row against vanilla in one quiet run. Results are appended to
``<out>/curve.json`` one checkpoint at a time (a checkpoint already there is not measured again), then the table
``<out>/curve.md`` and the plot ``<out>/curve.png`` are drawn from it. With ``--baseline NAME`` the table also gives
each row's held-out α1, served τ and α1, unseen α1 and walked τ gains over that checkpoint with 95 % intervals from
a paired bootstrap over the held-out samples or the prompts (both drafters read each held-out sample and answer each
prompt alike, so a gain is judged against its own spread, not the file's). Unseen α is the held-out evaluation run
on the target's greedy answers to the prompt file (teacher-forced, every answer position; the answers are written into
``curve.json`` once and every later row is scored on them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

import torch

from eval.prompts import chat_ids, load_prompt_file
from eval.rows import alpha_of, paired_ratio_gain
from infer.families import family_of, load_drafter
from infer.generate import generate_speculative, generate_vanilla
from infer.proposer import Proposer
from infer.sampling import SamplingParams
from infer.stats import depth_tallies
from models.config import parse_cli
from models.target import TargetModel
from models.tokenizer import stop_ids
from train.distributed import make_accelerator
from train.loop import load_target_and_data
from train.recipes import TrainingEntry, entry_of
from train.schedule import epoch_batch, sample_lengths, schedule


def tokens_read(cfg: Any, train_set, step: int, world: int) -> tuple[int, int]:
    """(tokens, loss tokens) of the micro-batches a run of this recipe on ``world`` processes reads, over all of them,
    in its first ``step`` optimizer steps (the order is the loop's own, seeded)."""
    tc = cfg.train
    lengths = sample_lengths(train_set) if tc.group_by_length else None
    per_epoch, _, _ = schedule(tc, len(train_set), world)
    tokens = loss_tokens = 0
    for micro in range(step * tc.grad_accum):
        for rank in range(world):
            for i in epoch_batch(len(train_set), micro, per_epoch, tc.seed, rank, world, tc.batch_size, lengths):
                tokens += len(train_set[i]["input_ids"])
                loss_tokens += sum(train_set[i]["loss_mask"])
    return tokens, loss_tokens


def run_world(run: Path, cfg: Any, train_set) -> int:
    """The run's process count, from the sharding line its training log starts with; refuses a run whose first epoch
    covered other samples than this recipe's data gives here (its own generated samples, say), whose counts would be
    wrong. An epoch covers whole global batches, so a remainder smaller than one is left out on both sides."""
    log = run / "train_log.jsonl"
    if not log.exists():
        raise SystemExit(f"{run}: no training log (run the recipe first; its output_dir holds the snapshots)")
    first = json.loads(log.read_text().splitlines()[0])["sharding"]
    world = first["world"]
    per_epoch, _, _ = schedule(cfg.train, len(train_set), world)
    expected = per_epoch * cfg.train.batch_size * world
    if first["total_over_ranks"] != expected:
        raise SystemExit(
            f"{run} trained on {first['total_over_ranks']} samples per epoch, the recipe's data gives {expected} here "
            f"({len(train_set)} samples, batch {cfg.train.batch_size} x {world} ranks): the tokens each snapshot read "
            "cannot be counted (were samples generated during the run, or the batch size overridden?)"
        )
    return world


def served(
    target: TargetModel,
    make: Callable[[], Proposer],
    tokenizer,
    prompts,
    first_turns: list[list[int]],
    max_new_tokens: int,
) -> dict:
    """Greedy decoding of every prompt's first turn (``first_turns``, its chat ids) with a fresh proposer from
    ``make`` each (the family's chain): τ (bonus included) and α per position, and each prompt's counts (for `gains`
    against another checkpoint)."""
    stops = stop_ids(tokenizer, target.model)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    stats, by_category, per_prompt = [], {}, []
    for p, ids in zip(prompts, first_turns):
        out = generate_speculative(target, make(), [ids], params, stops)
        stats.append(out.stats)
        by_category.setdefault(p.category, []).append(out.stats)
        accepted, attempted = depth_tallies([out.stats], 1)
        per_prompt.append(
            {
                "id": p.question_id,
                "tokens": out.stats.new_tokens,
                "forwards": out.stats.row_forwards,
                "accepted1": accepted[0],
                "attempted1": attempted[0],
            }
        )
    tau = sum(s.new_tokens for s in stats) / max(1, sum(s.row_forwards for s in stats))
    per_cat = {c: sum(s.new_tokens for s in v) / max(1, sum(s.row_forwards for s in v)) for c, v in by_category.items()}
    stopped = sum(1 for s in stats if s.new_tokens < max_new_tokens)
    return {
        "tau": tau,
        "alpha": alpha_of(stats),
        "tau_by_category": per_cat,
        "stopped_at_eos": stopped,
        "per_prompt": per_prompt,
    }


def answered(target: TargetModel, tokenizer, first_turns: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy answer to every first turn (vanilla decoding, up to ``max_new_tokens``)."""
    stops = stop_ids(tokenizer, target.model)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return [list(generate_vanilla(target, [ids], params, stops).tokens[0]) for ids in first_turns]


def answer_samples(first_turns: list[list[int]], answers: list[list[int]]) -> list[dict]:
    """Each first turn and its answer as a sample a held-out evaluation reads: the loss on the answer."""
    return [{"input_ids": ids + a, "loss_mask": [0] * len(ids) + [1] * len(a)} for ids, a in zip(first_turns, answers)]


class Paired(NamedTuple):
    """A figure `gains` compares: a ratio of sums over units two rows share (held-out samples, prompts)."""

    key_in_row: str
    """The row's entry that holds the units: a row measured before it was kept lacks it (and is measured again)."""

    units: Callable[[dict], list | None]
    """The row's units, each with its counts (None: the row was stored without them)."""
    num: Callable[[Any], int]
    den: Callable[[Any], int]
    key: Callable[[Any], Any] | None = None
    """What names a unit, where rows could list other units (prompts by id); held-out samples are the first n of
    the recipe's held-out set, named by their place."""
    every_family: bool = True
    """Whether every family's row has it; a row of a family without it keeps None there."""


GAINS = {
    "held-out α1": Paired(
        "heldout_per_sample", lambda r: r.get("heldout_per_sample"), lambda s: s[0][0], lambda s: s[0][1]
    ),
    "served τ": Paired(
        "served",
        lambda r: r["served"].get("per_prompt"),
        itemgetter("tokens"),
        itemgetter("forwards"),
        itemgetter("id"),
    ),
    "served α1": Paired(
        "served",
        lambda r: r["served"].get("per_prompt"),
        itemgetter("accepted1"),
        itemgetter("attempted1"),
        itemgetter("id"),
    ),
    "unseen α1": Paired(
        "unseen_per_sample", lambda r: r.get("unseen_per_sample"), lambda s: s[0][0], lambda s: s[0][1]
    ),
    "held-out walked τ": Paired(
        "heldout_walked", lambda r: r.get("heldout_walked"), itemgetter(0), itemgetter(1), every_family=False
    ),
    "unseen walked τ": Paired(
        "unseen_walked", lambda r: r.get("unseen_walked"), itemgetter(0), itemgetter(1), every_family=False
    ),
}
"""The figures `gains` compares. Served α1 is counted once a round, at the round's first draft, so which answer
positions it scores depends on the drafter: one that accepts further moves its rounds' starts to the positions after
its misses, which are harder. Unseen α1 scores the first draft at every position of the target's greedy answers to
the same prompts (teacher-forced, as held-out α1 is on the held-out set), the same positions for every drafter. Both
teacher-forced figures count the positions whose target token the draft vocabulary holds (`train.losses.ttt_targets`),
so they pair drafters of one vocabulary; served α1 counts every round.

Walked τ is served τ without the text's own swings: each answer's greedy chain replayed on the teacher-forced hits
(`models.acceptance.walked_chain`; a chain as deep as the recipe's unroll, where served τ's is ``--chain``), on the
same text for every drafter; served τ decodes each drafter's own text, which at bf16 parts from the reference answer
at near-ties and then differs in how hard it is to draft. On the held-out set it is the served τ of answers of the
training kind; on the unseen file, of the prompts' answers."""


def counted(row: dict) -> bool:
    """Whether ``row`` keeps every count `gains` pairs (rows measured before the counts were kept do not)."""
    return all(g.units(row) if g.every_family else g.key_in_row in row for g in GAINS.values())


def gains(row: dict, base: dict) -> dict[str, tuple[float, float, float] | None]:
    """``row``'s held-out α1 and served τ and α1 over ``base``'s, each as (gain, low, high) with a 95 % paired
    bootstrap interval over the held-out samples or the prompts (`eval.rows.paired_ratio_gain`); None for a figure
    either row lacks counts for, or whose units differ (other prompts, another number of held-out samples)."""
    out = {}
    for name, g in GAINS.items():
        ours, theirs = g.units(row), g.units(base)
        same = bool(ours) and bool(theirs) and len(ours) == len(theirs)
        if same and g.key is not None:
            same = [g.key(u) for u in ours] == [g.key(u) for u in theirs]
        pairs = [[(g.num(u), g.den(u)) for u in side] for side in (ours, theirs)] if same else None
        out[name] = paired_ratio_gain(*pairs) if pairs else None
    return out


def checkpoint_of(entry: TrainingEntry, path: Path, target: TargetModel, tokenizer) -> torch.nn.Module:
    """The drafter at ``path``, which must be of the recipe's family: its held-out evaluation runs the recipe's
    own loss on it. In fp32 whatever dtype the loader serves it in (its target's): the loss runs under the recipe's
    mixed precision, as in training, and every row of a curve is measured alike."""
    drafter = load_drafter(path, target, tokenizer)
    if family_of(drafter) is not entry.family:
        raise SystemExit(f"{path}: a {family_of(drafter).method} drafter; the recipe trains {entry.family.method}")
    return drafter.float()


def draw(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    curve = sorted((r for r in rows if r.get("tokens")), key=lambda r: r["tokens"])
    if not curve:  # only --extra checkpoints so far (the run's first snapshot not yet written): no axis to draw on
        print(f"{out / 'curve.png'} not drawn: no snapshot of the run measured yet")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["tokens"] / 1e6 for r in curve]
    depth = max(len(r["heldout_alpha"]) for r in curve)
    for k in range(depth):
        left.plot(x, [r["heldout_alpha"][k] for r in curve], marker="o", label=f"position {k + 1}")
    left.set(xscale="log", xlabel="training tokens read (M)", ylabel="held-out top-1 agreement", ylim=(0, 1))
    left.set_title("held-out acceptance per draft position\n(teacher-forced)")
    left.legend(fontsize=8)
    right.plot(x, [r["served"]["tau"] for r in curve], marker="o", color="k", label="this run")
    for r in rows:
        if not r.get("tokens"):
            right.axhline(r["served"]["tau"], ls="--", lw=1, color="gray")
            right.annotate(r["name"], (x[0], r["served"]["tau"]), fontsize=8, va="bottom")
    for xi, r in zip(x, curve):
        right.annotate(f"{r['served']['tau']:.2f}", (xi, r["served"]["tau"]), fontsize=8, va="bottom")
    # τ is at least 1 (the bonus token): from there, a noisy flat curve is not drawn as a steep one
    top = max(r["served"]["tau"] for r in rows)
    right.set(xscale="log", xlabel="training tokens read (M)", ylabel="τ (tokens per verify, bonus included)")
    right.set_ylim(1.0, top + 0.25 * (top - 1.0) + 0.05)
    right.set_title("served τ, greedy chain, unseen prompt file")
    for ax in (left, right):  # plain numbers at a few sizes: the default log labels overlap on a one-decade axis
        ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.1, 0.2, 0.5, 1, 2, 5, 10]))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=120)


def _signed(x: float) -> str:
    """``x`` to 3 decimals with its sign, rounded first: -0.0001 reads +0.000, not -0.000."""
    return f"{round(x, 3) + 0.0:+.3f}"


def _walked_tau(walks: list[list[int]] | None) -> str:
    """Walked τ from each sample's (tokens, rounds, ...) replayed chains; "—" for a row without them."""
    return f"{sum(w[0] for w in walks) / max(1, sum(w[1] for w in walks)):.2f}" if walks else "—"


def table(rows: list[dict], meta: dict, baseline: str | None = None) -> str:
    """The curve's rows as a markdown table; with ``baseline`` (a row's name), each row's served τ and α1 gain over
    that row with its 95 % paired interval (`gains`)."""
    # the held-out evaluation unrolls the recipe's positions, the served chain its own length: each has its columns
    held = max(len(r["heldout_alpha"]) for r in rows)
    depth = max(len(r["served"]["alpha"]) for r in rows)
    head = ["checkpoint", "tokens read", "loss tokens", *(f"held-out α{k + 1}" for k in range(held))]
    head += ["served τ", *(f"served α{k + 1}" for k in range(depth)), "unseen α1", "answers at EOS"]
    head += ["held-out walked τ", "unseen walked τ"]
    base = next((r for r in rows if r["name"] == baseline), None)
    if baseline is not None and base is None:
        raise SystemExit(f"--baseline {baseline}: no checkpoint of that name in the curve")
    if base is not None:
        head += [f"{name} over {baseline} (95 %)" for name in GAINS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: r.get("tokens") or 0):
        cells = [r["name"], f"{r['tokens']:,}" if r.get("tokens") else "—"]
        cells += [f"{r['loss_tokens']:,}" if r.get("loss_tokens") else "—"]
        cells += [f"{a:.2f}" for a in r["heldout_alpha"]] + [""] * (held - len(r["heldout_alpha"]))
        cells += [f"{r['served']['tau']:.2f}"] + [f"{a:.2f}" for a in r["served"]["alpha"]]
        cells += [""] * (depth - len(r["served"]["alpha"]))
        cells += [f"{r['unseen_alpha'][0]:.2f}" if r.get("unseen_alpha") else "—"]
        cells += [f"{r['served']['stopped_at_eos']}/{meta['prompts']}"]
        cells += [_walked_tau(r.get(key)) for key in ("heldout_walked", "unseen_walked")]
        if base is not None:
            found = gains(r, base) if r is not base else dict.fromkeys(GAINS)
            cells += [f"{_signed(g[0])} [{_signed(g[1])}, {_signed(g[2])}]" if g else "—" for g in found.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's recipe (its output_dir holds the snapshots)")
    parser.add_argument("--prompts", required=True, help="Spec-Bench-format file (first turns are decoded)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--chain", type=int, default=4, help="draft tokens per verify")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--heldout-samples", type=int, default=128)
    parser.add_argument("--extra", action="append", default=[], help="NAME=DIR: another checkpoint beside the run")
    parser.add_argument(
        "--baseline", help="a checkpoint's name (e.g. an --extra's): the table gives every row's served gain over it"
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    args = parser.parse_args(argv)
    entry = entry_of(args.config)
    if entry.family.chain is None:
        raise SystemExit(f"{args.config}: the {entry.family.method} family declares no chain proposer to measure")
    cfg = parse_cli(entry.config_class, ["--config", args.config, *args.overrides, "report.enabled=false"])
    cfg.train.eval_samples = args.heldout_samples
    run = Path(cfg.train.output_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    accelerator, log = make_accelerator(cfg.train, target=cfg.target)
    loaded = load_target_and_data(cfg, accelerator, log, None)
    tokenizer, pad_id, target = loaded.tokenizer, loaded.pad_id, loaded.target
    train_set, eval_set = loaded.train_set, loaded.eval_set
    prompts = load_prompt_file(args.prompts)
    meta = {"prompts": len(prompts), "file": args.prompts, "chain": args.chain, "max_new_tokens": args.max_new_tokens}
    store = out / "curve.json"
    stored = json.loads(store.read_text()) if store.exists() else {}
    rows = stored.get("rows", [])
    # the greedy answers every row's unseen α is scored on, written once: rows measured later (on another day, even
    # another CPU, whose bf16 answers could differ) are scored on the same text, so they pair
    before = stored.get("meta", {})
    answers = before.get("answers")
    if answers is not None and any(before.get(k) != meta[k] for k in ("prompts", "file", "max_new_tokens")):
        raise SystemExit(
            f"{store} holds answers to {before.get('prompts')} prompts of {before.get('file')} at "
            f"{before.get('max_new_tokens')} tokens: measure {args.prompts} at {args.max_new_tokens} into another --out"
        )
    first_turns = [chat_ids(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    if answers is None:
        with torch.inference_mode():
            answers = answered(target, tokenizer, first_turns, args.max_new_tokens)
    meta["answers"] = answers
    unseen = answer_samples(first_turns, answers)
    unseen_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_samples=len(unseen)))
    # a row stored before its counts were kept is measured again where its checkpoint is here, so it can be paired
    done = {r["name"] for r in rows if counted(r)}
    checkpoints = sorted(run.glob("snapshots/step-*"), key=lambda p: int(p.name.split("-")[1]))
    todo = {p.name: (p, int(p.name.split("-")[1])) for p in checkpoints}
    # The run's own folder holds the final checkpoint only once the run has finished; while it trains, its state
    # has moved past the weights saved there, so the folder is measured only when its step is the last one. It
    # stands for a snapshot of that same step (one row per step).
    state = run / "state" / "step.json"
    last = json.loads(state.read_text())["step"] if state.exists() else None
    world = run_world(run, cfg, train_set)
    _, total_steps, _ = schedule(cfg.train, len(train_set), world)
    if (run / "model.safetensors").exists() and last == total_steps:
        todo[f"step-{last}"] = (run, last)
    for name, d in (e.split("=", 1) for e in args.extra):
        if name in todo:
            raise SystemExit(f"--extra {name}={d}: the run has a checkpoint of that name")
        todo[name] = (Path(d), None)
    if args.baseline is not None and args.baseline not in {*todo, *done}:  # before minutes of measuring, not after
        raise SystemExit(f"--baseline {args.baseline}: no checkpoint of that name in the curve")
    for name, (path, step) in todo.items():
        if name in done:
            continue
        t0 = time.time()
        drafter = checkpoint_of(entry, path, target, tokenizer).to(accelerator.device)
        row = {"name": name, "path": str(path), "step": step}
        if step is not None:
            row["tokens"], row["loss_tokens"] = tokens_read(cfg, train_set, step, world)
        row["heldout_alpha"], row["heldout_per_sample"], row["heldout_walked"] = entry.heldout_acceptance(
            accelerator, target, drafter, eval_set, cfg, pad_id
        )
        row["unseen_alpha"], row["unseen_per_sample"], row["unseen_walked"] = entry.heldout_acceptance(
            accelerator, target, drafter, unseen, unseen_cfg, pad_id
        )
        with torch.inference_mode():
            chain = partial(entry.family.chain, drafter, args.chain)
            row["served"] = served(target, chain, tokenizer, prompts, first_turns, args.max_new_tokens)
        rows = [r for r in rows if r["name"] != name] + [row]
        store.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        log(
            f"{name}: τ {row['served']['tau']:.2f}, held-out α {[round(a, 2) for a in row['heldout_alpha']]}, "
            f"unseen α {[round(a, 2) for a in row['unseen_alpha']]} "
            f"({time.time() - t0:.0f} s)"
        )
    text = table(rows, meta, args.baseline)
    (out / "curve.md").write_text(text)
    draw(rows, out)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
