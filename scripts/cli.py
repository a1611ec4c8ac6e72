"""The ``drafters`` command.

drafters get-target [NAME] [--out DIR] [--force]        # build a reference target's HF folder (default smollm2-135m-instruct)
drafters quickstart [--skip-training] [--prompts N]     # target, one chat answer, a short EAGLE-3 run, τ + speedup
drafters report --drafter DIR [key=value ...]            # τ / speedup report of any checkpoint (eval/report.py)
drafters leaderboard [key=value ...]                     # every method, categories x T x batch sizes (eval/leaderboard.py)
drafters publish CHECKPOINT [--out DIR] [--push-to REPO]   # a hub-ready folder with its model card (eval/publish.py)
drafters bench [args of eval.bench_runtime]              # runtime benchmark of the drafter-free proposers
drafters build-data [args of train.data.target_written] # self-synthesised, self-distilled chat data (resumable)
drafters bench-answerer [args of train.data.answerer]    # self-distillation answer tokens/s beside this machine's limit
drafters regenerate [args of scripts/regenerate.py]      # self-distillation of an existing chat dataset
drafters estimate --target CONFIG --recipe YAML [...]    # memory / cache size / tokens per GPU-hour, before a run
drafters precision [TARGET] [--refresh]                  # the dtype this machine serves, distils and trains in, and why
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICK_RECIPE = ROOT / "recipes" / "smollm2-135m" / "eagle3.yaml"
SHIPPED_DRAFTER = ROOT / "models" / "smollm2_eagle3"
SHIPPED_DATA = ROOT / "train" / "shipped_data" / "smollm2-135m-instruct"
DRAFT_MODEL = ROOT / "outputs" / "smollm2-draft-model"


def other_checkout(cwd: Path) -> Path | None:
    """The drafters checkout ``cwd`` lies in, when it is not the one this command runs from (else None).

    An editable install runs the code of the folder it was installed from; in another clone that is surprising.
    """
    for folder in [cwd, *cwd.parents]:
        pyproject = folder / "pyproject.toml"
        if pyproject.exists():
            try:
                name = tomllib.loads(pyproject.read_text()).get("project", {}).get("name")
            except tomllib.TOMLDecodeError:
                return None
            if name == "drafters" and folder.resolve() != ROOT:
                return folder
            return None
    return None


def get_target(argv: list[str]) -> None:
    from models.reference import REFERENCE_TARGETS, build_target

    ap = argparse.ArgumentParser(prog="drafters get-target")
    ap.add_argument("name", nargs="?", default="smollm2-135m-instruct", choices=sorted(REFERENCE_TARGETS))
    ap.add_argument("--out", type=Path, help="folder to write (default: the cache, see models/reference.py)")
    ap.add_argument("--force", action="store_true", help="rebuild even when the folder is complete")
    args = ap.parse_args(argv)
    print(build_target(args.name, args.out, force=args.force))


def quickstart(argv: list[str]) -> None:
    """The main job, small: get the target, answer one prompt, train a short EAGLE-3 run, measure it beside the
    shipped drafter, prompt lookup, the small draft model and HF generate on held-out chat prompts."""
    ap = argparse.ArgumentParser(prog="drafters quickstart")
    ap.add_argument("--skip-training", action="store_true", help="no short training run (a one-minute look)")
    ap.add_argument("--prompts", type=int, default=4, help="held-out chat prompts to measure")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--train-samples", type=int, default=64, help="conversations of the short training run")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "quickstart")
    ap.add_argument(
        "--dtype",
        default="fastest",
        choices=["fastest", "float32", "bfloat16"],
        help="the target's dtype: fastest = the precision policy's serving choice for this machine",
    )
    args = ap.parse_args(argv)

    import torch

    from eval.measure import Candidate, MeasuredPrompt, measure
    from eval.prompts import builtin_prompts, chat_ids
    from eval.report_md import write_report
    from infer.eagle3_proposer import Eagle3Proposer
    from infer.generate import generate_vanilla
    from infer.proposers import DraftModelProposer
    from infer.sampling import SamplingParams
    from infer.serving import quiet_routing, serving_targets
    from models.checkpoint import read_checkpoint
    from models.eagle3 import Eagle3Drafter
    from models.target import TargetConfig, TargetModel, load_tokenizer, stop_ids

    t0 = time.time()
    name = "smollm2-135m-instruct"
    tokenizer = load_tokenizer(name)
    # the precision policy's serving choice (models/precision.py; measured once per machine, then cached), sized
    # with the shipped drafter's held-out acceptance; --dtype makes it the user's choice
    shipped_acceptance = read_checkpoint(SHIPPED_DRAFTER)[1].heldout_acceptance if SHIPPED_DRAFTER.exists() else None
    cfg = TargetConfig(name_or_path=name, dtype=args.dtype, device="cpu")
    target = TargetModel.from_config(cfg, "serve", prepare=quiet_routing, acceptance=shipped_acceptance or None)
    target, vanilla_target = serving_targets(target, shipped_acceptance or None, lambda m: None)
    print(target.precision.line())
    eos = stop_ids(tokenizer, target.model)
    n_params = sum(p.numel() for p in target.model.parameters()) / 1e6
    print(f"target {name}: {n_params:.1f} M parameters in {target.precision.dtype}, loaded in {time.time() - t0:.0f} s")
    prompts = builtin_prompts("chat", args.prompts)
    first = chat_ids(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}])
    out = generate_vanilla(target, [first], SamplingParams(max_new_tokens=args.max_new_tokens), eos)
    print(
        f"\n--- held-out request ---\n{prompts[0].turns[0]}\n--- greedy answer ---\n{tokenizer.decode(out.tokens[0])}\n"
    )

    candidates = []
    if SHIPPED_DRAFTER.exists():
        shipped = Eagle3Drafter.from_pretrained(SHIPPED_DRAFTER, target, tokenizer).eval()
        candidates.append(Candidate("eagle3 (shipped)", "chain 3", lambda: Eagle3Proposer(shipped, k=3)))
    if not args.skip_training:
        from train.eagle3 import main as train_eagle3

        run = args.out / "eagle3-short"
        print(f"short EAGLE-3 run on {args.train_samples} shipped conversations (online features) → {run}")
        train_eagle3(
            [
                "--config",
                str(QUICK_RECIPE),
                f"train.output_dir={run}",
                f"data.path={SHIPPED_DATA / 'train.jsonl.gz'}",
                f"eval_data.path={SHIPPED_DATA / 'heldout.jsonl.gz'}",
                "train.features=online",
                f"train.max_train_samples={args.train_samples}",
                "train.epochs=1",
                "train.batch_size=4",
                "train.eval_every=0",
                "train.eval_samples=16",
                "train.save_every=0",
                "train.export=false",
                "report.enabled=false",
            ]
        )
        short = Eagle3Drafter.from_pretrained(run, target, tokenizer).eval()
        candidates.append(Candidate("eagle3 (short run)", "chain 3", lambda: Eagle3Proposer(short, k=3)))
    if DRAFT_MODEL.exists():  # built by recipes/smollm2-135m/draft_model.yaml (distilled, ~5 min)
        from transformers import AutoModelForCausalLM

        draft, how = AutoModelForCausalLM.from_pretrained(DRAFT_MODEL, dtype=target.dtype).eval(), "distilled"
    else:  # the same cut without its distillation: instant, and still a real small model on the tokenizer
        from models.draft_model import cut_target

        draft, how = cut_target(target, 2).eval(), "not distilled"
    candidates.append(Candidate(f"draft model (2 layers, {how})", "chain 1", lambda: DraftModelProposer(draft, k=1)))
    measured = [MeasuredPrompt(chat_ids(tokenizer, [{"role": "user", "content": p.turns[0]}]), "chat") for p in prompts]
    rows = measure(target, candidates, measured, eos, max_new_tokens=args.max_new_tokens, vanilla_target=vanilla_target)
    prompt_set = f"built-in chat ({len(measured)})"
    write_report(args.out, "quickstart", name, rows, prompt_set=prompt_set, precision=target.precision.as_dict())
    print_closing_table(rows)
    print(
        f"\n{len(measured)} held-out chat prompts, T=0, answers stop at EOS (cap {args.max_new_tokens}); "
        f"report in {args.out}; {(time.time() - t0) / 60:.1f} min in all; torch threads {torch.get_num_threads()}"
    )


def print_closing_table(rows: list[dict]) -> None:
    """The quick start's table: vanilla, then every method with its lossless evidence in words (a bare "0.25" read as
    "lossy" where every divergence was a bf16 rounding tie and the fp32 replay was identical)."""
    from eval.leaderboard import evidence

    w = max(34, *(len(f"{r['proposer']} ({r['setting']})") + 2 for r in rows))
    print(f"\n{'method':<{w}}{'dtype':>7}{'tau':>6}{'tokens/s':>10}{'speedup':>9}  lossless evidence")
    base, short = rows[0]["vanilla_tokens_per_s"], {"float32": "fp32", "bfloat16": "bf16"}
    vanilla = short.get(rows[0]["vanilla_dtype"], rows[0]["vanilla_dtype"])
    print(f"{'vanilla (faster of ours / HF)':<{w}}{vanilla:>7}{1.0:>6.2f}{base:>10.1f}{1.0:>8.2f}x  –")
    for r in rows:
        label, dtype = f"{r['proposer']} ({r['setting']})", short.get(r["dtype"], r["dtype"])
        print(f"{label:<{w}}{dtype:>7}{r['tau']:>6.2f}{r['tokens_per_s']:>10.1f}{r['speedup']:>8.2f}x  {evidence([r])}")


def precision(argv: list[str]) -> None:
    """The precision policy's choice for each workload on this machine, with the measurements behind it."""
    ap = argparse.ArgumentParser(prog="drafters precision")
    ap.add_argument("target", nargs="?", default="smollm2-135m-instruct", help="short name, folder or hub id")
    ap.add_argument("--refresh", action="store_true", help="measure again (drop this machine's cached curves)")
    ap.add_argument("--json", type=Path, help="also write the choices here")
    args = ap.parse_args(argv)

    import json

    import torch
    from transformers import AutoConfig

    from infer.serving import quiet_routing
    from models.precision import WORKLOADS, choose, machine
    from models.reference import resolve_target

    config = AutoConfig.from_pretrained(resolve_target(args.target))
    print(f"machine: {machine().words()}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    choices = {}
    for workload in WORKLOADS:
        choice = choose(workload, config, device, prepare=quiet_routing, refresh=args.refresh)
        choices[workload] = choice.as_dict()
        print(choice.line())
    if args.json:
        args.json.write_text(json.dumps({"target": args.target, "choices": choices}, indent=2) + "\n")


def _run_script(path: Path, argv: list[str]) -> None:
    sys.argv = [str(path), *argv]
    runpy.run_path(str(path), run_name="__main__")


def _report(argv: list[str]) -> None:
    # called, not run as __main__: its config dataclasses must resolve their annotations in their own module
    from eval.report import report_main

    report_main(argv)


def _leaderboard(argv: list[str]) -> None:
    from eval.leaderboard import main as leaderboard_main

    leaderboard_main(argv)


def _run_module(name: str, argv: list[str]) -> None:
    sys.argv = [name, *argv]
    runpy.run_module(name, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "get-target": get_target,
        "quickstart": quickstart,
        "report": _report,
        "leaderboard": _leaderboard,
        "publish": lambda a: _run_module("eval.publish", a),
        "bench": lambda a: _run_module("eval.bench_runtime", a),
        "build-data": lambda a: _run_module("train.data.target_written", a),
        "bench-answerer": lambda a: _run_module("train.data.answerer", a),
        "regenerate": lambda a: _run_script(ROOT / "scripts" / "regenerate.py", a),
        "estimate": lambda a: _run_script(ROOT / "scripts" / "estimate.py", a),
        "precision": precision,
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    elsewhere = other_checkout(Path.cwd())
    if elsewhere is not None:
        print(
            f"warning: you are in the drafters checkout {elsewhere}, but this `drafters` runs the code of {ROOT} "
            f"(where it was installed from). Run `pip install -e .` here, or `python -m scripts.cli ...`.",
            file=sys.stderr,
        )
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
