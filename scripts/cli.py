"""The ``drafters`` command.

drafters get-target [NAME] [--out DIR] [--force]        # build a reference target's HF folder (default smollm2-135m-instruct)
drafters quickstart [--skip-training] [--prompts N]     # target, one chat answer, a short EAGLE-3 run, τ + speedup
drafters report --drafter DIR [key=value ...]            # τ / speedup report of any checkpoint (eval/report.py)
drafters leaderboard [key=value ...]                     # every method, categories x T x batch sizes (eval/leaderboard.py)
drafters publish CHECKPOINT [--out DIR] [--push-to REPO]   # a hub-ready folder with its model card (eval/publish.py)
drafters bench [args of eval.bench_runtime]              # runtime benchmark of the drafter-free proposers
drafters build-data [args of train.data.target_written] # self-synthesised, self-distilled chat data (resumable)
drafters bench-answerer [args of train.data.answerer]    # self-distillation answer tokens/s beside this machine's limit
drafters bench-train [args of train.bench_ttt]          # EAGLE-3 training tokens/s, recipe variants interleaved
drafters regenerate [args of scripts/regenerate.py]      # self-distillation of an existing chat dataset
drafters audit-data [args of train.data.audit]           # are self-distilled answers the target's greedy text?
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the commands import their modules when run: `drafters --help` stays instant
    import torch

    from eval.measure import Candidate
    from models.target import TargetModel

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_DRAFTERS = sorted(p.parent for p in (ROOT / "models").glob("*/config.json"))
"""The drafters shipped in models/ (each folder with a config.json), as the leaderboard finds them."""
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


def quickstart_args(argv: list[str]) -> argparse.Namespace:
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
    return ap.parse_args(argv)


def quickstart(argv: list[str]) -> None:
    """The main job, small: get the target, answer one prompt, train a short run of the quick-start recipe, measure
    it beside the shipped drafters, prompt lookup, the small draft model and HF generate on held-out chat prompts."""
    args = quickstart_args(argv)

    import torch

    from eval.measure import MeasuredPrompt, measure
    from eval.prompts import builtin_prompts, chat_ids
    from eval.report_md import write_report

    t0 = time.time()
    name = "smollm2-135m-instruct"
    target, vanilla_target, tokenizer, eos = quick_target(name, args.dtype, t0)
    prompts = builtin_prompts("chat", args.prompts)
    measured = [MeasuredPrompt(chat_ids(tokenizer, [{"role": "user", "content": p.turns[0]}]), "chat") for p in prompts]
    show_first_answer(target, tokenizer, eos, prompts[0].turns[0], measured[0].ids, args.max_new_tokens)

    candidates = shipped_candidates(target, tokenizer)
    if not args.skip_training:
        candidates.append(short_run_candidate(target, tokenizer, args.out, args.train_samples))
    candidates.append(draft_model_candidate(target))
    rows = measure(target, candidates, measured, eos, max_new_tokens=args.max_new_tokens, vanilla_target=vanilla_target)
    prompt_set = f"built-in chat ({len(measured)})"
    write_report(args.out, "quickstart", name, rows, prompt_set=prompt_set, precision=target.precision.as_dict())
    print_closing_table(rows)
    print(
        f"\n{len(measured)} held-out chat prompts, T=0, answers stop at EOS (cap {args.max_new_tokens}); "
        f"report in {args.out}; {(time.time() - t0) / 60:.1f} min in all; torch threads {torch.get_num_threads()}"
    )


def quick_target(name: str, dtype: str, t0: float) -> tuple[TargetModel, TargetModel, object, list[int]]:
    """(served target, the vanilla baseline's target, tokenizer, stop ids) of the quick start, in the precision
    policy's serving choice (models/precision.py; measured once per machine, then cached), sized with the first
    shipped drafter's held-out acceptance; ``dtype`` other than "fastest" makes it the user's choice."""
    from infer.forward_cost import quiet_routing
    from infer.serving import serving_targets
    from models.checkpoint import read_checkpoint
    from models.target import TargetConfig, TargetModel
    from models.tokenizer import load_tokenizer, stop_ids

    tokenizer = load_tokenizer(name)
    shipped_acceptance = read_checkpoint(SHIPPED_DRAFTERS[0])[1].heldout_acceptance if SHIPPED_DRAFTERS else None
    cfg = TargetConfig(name_or_path=name, dtype=dtype, device="cpu")
    target = TargetModel.from_config(cfg, "serve", prepare=quiet_routing, acceptance=shipped_acceptance or None)
    target, vanilla_target = serving_targets(target, shipped_acceptance or None, lambda m: None)
    print(target.precision.line())
    n_params = sum(p.numel() for p in target.model.parameters()) / 1e6
    print(f"target {name}: {n_params:.1f} M parameters in {target.precision.dtype}, loaded in {time.time() - t0:.0f} s")
    return target, vanilla_target, tokenizer, stop_ids(tokenizer, target.model)


def show_first_answer(
    target: TargetModel, tokenizer, eos: list[int], request: str, ids: list[int], max_new_tokens: int
) -> None:
    """The target's greedy answer to the first held-out request: what the drafters below must reproduce."""
    from infer.generate import generate_vanilla
    from infer.sampling import SamplingParams

    out = generate_vanilla(target, [ids], SamplingParams(max_new_tokens=max_new_tokens), eos)
    print(f"\n--- held-out request ---\n{request}\n--- greedy answer ---\n{tokenizer.decode(out.tokens[0])}\n")


def chain_candidate(drafter: torch.nn.Module, label: str, k: int) -> Candidate:
    """An `eval.measure.Candidate` of ``drafter``'s chain of ``k`` (its family's `DrafterFamily.chain`)."""
    from eval.measure import Candidate
    from infer.families import family_of

    fam = family_of(drafter)
    return Candidate(f"{fam.method} ({label})", f"chain {k}", lambda: fam.chain(drafter, k))


def shipped_candidates(target: TargetModel, tokenizer) -> list[Candidate]:
    """Every drafter shipped in models/ as a chain of 3."""
    from infer.families import load_drafter

    return [chain_candidate(load_drafter(p, target, tokenizer).eval(), "shipped", 3) for p in SHIPPED_DRAFTERS]


def short_run_candidate(target: TargetModel, tokenizer, out: Path, samples: int) -> Candidate:
    """A short run of the quick-start recipe (train.recipes.QUICK_START_RECIPE) on the shipped conversations, online
    features, no export or report, as a chain of 3."""
    from infer.families import load_drafter
    from train.recipes import QUICK_START_RECIPE, entry_of

    entry = entry_of(QUICK_START_RECIPE)
    run = out / f"{entry.family.method}-short"
    print(f"short {entry.family.method} run on {samples} shipped conversations (online features) → {run}")
    overrides = [f"train.output_dir={run}", f"data.path={SHIPPED_DATA / 'train.jsonl.gz'}"]
    overrides += [f"eval_data.path={SHIPPED_DATA / 'heldout.jsonl.gz'}", "train.features=online"]
    overrides += [f"train.max_train_samples={samples}", "train.epochs=1", "train.batch_size=4", "train.eval_every=0"]
    overrides += ["train.eval_samples=16", "train.save_every=0", "train.export=false", "report.enabled=false"]
    entry.main(["--config", str(QUICK_START_RECIPE), *overrides])
    return chain_candidate(load_drafter(run, target, tokenizer).eval(), "short run", 3)


def draft_model_candidate(target: TargetModel) -> Candidate:
    """The 2-layer draft model: distilled when recipes/smollm2-135m/draft_model.yaml has built it (~5 min), else the
    same cut without its distillation (instant, and still a real small model on the tokenizer)."""
    from eval.measure import Candidate
    from infer.proposers import DraftModelProposer

    if DRAFT_MODEL.exists():
        from transformers import AutoModelForCausalLM

        draft, how = AutoModelForCausalLM.from_pretrained(DRAFT_MODEL, dtype=target.dtype).eval(), "distilled"
    else:
        from models.draft_model import cut_target

        draft, how = cut_target(target, 2).eval(), "not distilled"
    return Candidate(f"draft model (2 layers, {how})", "chain 1", lambda: DraftModelProposer(draft, k=1))


def print_closing_table(rows: list[dict]) -> None:
    """The quick start's table: vanilla, then every method with its lossless evidence in words (a bare "0.25" read as
    "lossy" where every divergence was a bf16 rounding tie and the fp32 replay was identical)."""
    from eval.report_md import evidence

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

    from infer.forward_cost import quiet_routing
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
        "bench-train": lambda a: _run_module("train.bench_ttt", a),
        "regenerate": lambda a: _run_script(ROOT / "scripts" / "regenerate.py", a),
        "audit-data": lambda a: _run_module("train.data.audit", a),
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
