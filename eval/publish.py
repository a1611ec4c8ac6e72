"""``drafters publish CHECKPOINT``: a drafter folder ready for a model hub, with a model card that says what it is,
how it was made, what it measured and how to load it.

What the folder holds:

- the drafters format (``config.json`` with its ``drafters`` block, ``model.safetensors``), plus the run's
  ``recipe.yaml`` and ``train_log.jsonl`` where the checkpoint has them;
- every engine folder of the drafter's family (``export-*/``, each with its README giving the engine, the version
  read and the flags), written here from the checkpoint's weights in their stored dtype by the family's declaration
  (`infer.family.DrafterFamily.engine_exports`, `models.export`), not copied from what a training run left: a run
  made before a layout existed, or with exports off, still publishes every folder;
- ``README.md``, the model card: YAML front matter (license, base model, tags, library), then the files of the folder
  (exactly those, each said in words), the target, the data, the recipe and how it trained, the τ and speedup table
  of its latest measurement (the checkpoint's ``report.json``, or a leaderboard's ``leaderboard.json`` rows of this
  drafter and the baselines, each row naming its prompt category), with its prompt set, machine and lossless
  evidence, the engine folders written and the layouts refused with each reason, and how to load it.

With ``push_to`` and a Hugging Face token (``HF_TOKEN`` or a saved login) it uploads through ``huggingface_hub``;
without a token, or when the hub cannot be reached, it says so and stops after writing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from eval.leaderboard_tables import category_of, category_rows
from eval.report_md import evidence
from infer.families import family_of, load_drafter
from models.checkpoint import CONFIG_NAME, TARGET_DIR, WEIGHTS_NAME, TargetInfo, read_checkpoint
from models.export import EngineExport
from models.loader import load_target
from models.reference import REFERENCE_TARGETS
from models.target import TargetConfig, TargetModel

RUN_FILES = ("recipe.yaml", "train_log.jsonl", "report.json", "report.md", "NOTES.md")
"""Files of the run copied beside the weights; ``NOTES.md`` (how the run went, in words) becomes the card's notes."""
FILE_WORDS = {
    CONFIG_NAME: "the drafter's config with its `drafters` block (method, target, taps)",
    WEIGHTS_NAME: "the drafter's weights (drafters format)",
    "recipe.yaml": "the exact recipe of the training run",
    "train_log.jsonl": "the training log, one JSON line per logged step",
    "report.json": "the checkpoint's own measurement (rows of the report schema)",
    "report.md": "that measurement as a table",
    "NOTES.md": "how the run went, in words (the Notes below)",
    "README.md": "this card",
    TARGET_DIR: "the target's weights as joint training changed them (`models.loader.load_target` applies them)",
}
"""What each file a published folder may hold is, in the card's words (an ``export-*`` folder is said by its family)."""
TARGET_LICENSES = {"smollm2-135m-instruct": "apache-2.0"}
"""Licenses of the reference targets (a drafter trained on a target's outputs is published under the target's)."""


def base_model(info: TargetInfo) -> str:
    """The hub id of the target, where it has one (a reference target's short name → its hub id)."""
    name = Path(info.target_name).name if Path(info.target_name).exists() else info.target_name
    return REFERENCE_TARGETS[name].hub_id if name in REFERENCE_TARGETS else info.target_name


def _results(
    folder: Path, leaderboard: Path | None, method: str, report: Path | None = None
) -> tuple[list[dict], dict]:
    """(rows, header) of the latest measurement: a leaderboard's rows of this method and the baselines, a report.json
    given by path, or the checkpoint's own report."""
    if leaderboard is not None:  # this drafter's rows (and its hybrid) beside the baselines, not other drafters'
        board = json.loads(leaderboard.read_text())
        # the batch sweep's rows stay on the leaderboard: the card's table is the batch-1 comparison
        mine = [r for r in category_rows(board["results"]) if not r.get("sweep") and (r["proposer"] in (method, f"{method} + prompt lookup")
                or r["proposer"] == "prompt lookup" or r["proposer"].startswith(("draft model", "HF ")))]  # fmt: skip
        return mine, {k: board.get(k) for k in ("target", "machine", "created")} | {
            "prompt_set": f"leaderboard {leaderboard.name} ({', '.join(sorted({r['source'] for r in mine}))})"
        }
    report = report or folder / "report.json"
    if not report.exists():
        return [], {}
    data = json.loads(report.read_text())
    head = {k: data.get(k) for k in ("target", "machine", "created", "prompt_set")}
    if isinstance(head["machine"], dict):  # reports since the precision policy: the machine as a dict with its words
        head["machine"] = head["machine"].get("words")
    return data["results"], head


def results_table(rows: list[dict]) -> str:
    """Markdown: every row of the measurement at batch 1 (T, prompt category, method, setting, τ, speedup, evidence),
    by T and category, fastest first."""
    lines = ["| T | category | method | setting | τ | speedup | lossless evidence |", "|---|---|---|---|---|---|---|"]
    shown = [r for r in rows if r.get("batch_size", 1) == 1]
    for r in sorted(shown, key=lambda r: (r["temperature"], category_of(r), -r["speedup"])):
        tau = f"{r['tau']:.2f}" if r.get("tau") else "—"
        lines.append(
            f"| {r['temperature']:g} | {category_of(r)} | {r['proposer']} | {r['setting']} | {tau} | "
            f"{r['speedup']:.2f}x | {evidence([r])} |"
        )
    return "\n".join(lines)


def _training(folder: Path) -> str:
    log = folder / "train_log.jsonl"
    if not log.exists():
        return "No training log in the checkpoint."
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step" in r and "loss" in r]
    if not steps:
        return "The training log holds no step."
    last = steps[-1]
    rates = [r["tokens_per_s"] for r in steps if "tokens_per_s" in r]
    held = next((r["eval/acc"] for r in reversed(rows) if r.get("eval/acc")), None)
    words = f"{last['step']} optimizer steps; last logged loss {last['loss']:.3f}"
    if rates:
        words += f"; {min(rates):.0f}–{max(rates):.0f} training tokens/s"
    if held:
        words += f"; held-out top-1 accuracy per draft depth {', '.join(f'{a:.3f}' for a in held)}"
    return words + "."


def _recipe(folder: Path) -> tuple[str, str | None, list[str]]:
    """(recipe in a code block, data path, extra data paths) of the run, where the checkpoint kept its recipe."""
    path = folder / "recipe.yaml"
    if not path.exists():
        return "The checkpoint holds no recipe.", None, []
    text = path.read_text()
    section = (yaml.safe_load(text) or {}).get("data", {})
    return f"```yaml\n{text.strip()}\n```", section.get("path"), list(section.get("extra_paths") or [])


def files_section(folder: Path, exports: list[EngineExport]) -> str:
    """The folder's files, exactly those there (README.md included, written last), each in words."""
    said = {e.folder: e.what for e in exports}
    names = sorted({p.name for p in folder.iterdir()} | {"README.md"})
    return "\n".join(f"- `{n}{'/' if (folder / n).is_dir() else ''}`: {said.get(n) or FILE_WORDS.get(n, 'a file of the run')}"
                     for n in names)  # fmt: skip


def engines_section(folder: Path, exports: list[EngineExport]) -> str:
    """Each engine folder written (its README) and each layout refused for this drafter, with the reason."""
    written = [e for e in exports if e.write is not None and (folder / e.folder).is_dir()]
    parts = [f"### `{e.folder}/`\n\n{(folder / e.folder / 'README.md').read_text().strip()}" for e in written]
    left = [f"- `{e.folder}/`: {e.what}." for e in exports if e.write is not None and e not in written]
    if left:
        parts.append("Layouts this drafter takes that this folder leaves out (to keep it small); "
                     "`drafters publish <this folder> --out <folder>` writes every one:\n\n" + "\n".join(left))  # fmt: skip
    refused = [f"- `{e.folder}/` is not here: {e.what}." for e in exports if e.write is None]
    if refused:
        parts.append("Layouts of this family refused for this drafter (written by no one, so nothing to load):\n\n"
                     + "\n".join(refused))  # fmt: skip
    return "\n\n".join(parts) or "The drafter's family declares no engine layout: it serves in drafters' runtime."


def model_card(
    folder: Path,
    info: TargetInfo,
    exports: list[EngineExport],
    leaderboard: Path | None = None,
    report: Path | None = None,
) -> str:
    """The model card (README.md) of a published folder whose engine folders ``exports`` are written."""
    rows, head = _results(folder, leaderboard, info.method, report)
    recipe, data, extra = _recipe(folder)
    base = base_model(info)
    front = {
        "license": TARGET_LICENSES.get(Path(info.target_name).name, "other"),
        **({"base_model": base} if base else {}),  # a target without a name (built in memory) has no hub id
        "library_name": "drafters",
        "pipeline_tag": "text-generation",
        "tags": ["speculative-decoding", info.method, "drafter"],
    }
    if data and re.fullmatch(r"[\w.-]+/[\w-]+", data):  # a hub dataset id; a local file is described below
        front["datasets"] = [data]
    table = results_table(rows) if rows else "Not measured yet: run `drafters report --drafter <this folder>`."
    notes = f"\n## Notes\n\n{(folder / 'NOTES.md').read_text().strip()}\n" if (folder / "NOTES.md").exists() else ""
    return f"""---
{yaml.safe_dump(front, sort_keys=False).strip()}
---

# {info.method} drafter for {base}

A speculative-decoding drafter ({info.method}) for `{base}`, trained and measured with drafters (its runtime
verifies the drafts losslessly: at T = 0 the output is the target's own greedy text, at T > 0 the accept rule keeps
the target's distribution).

- **Target**: `{info.target_name}` (vocab {info.target_vocab_size:,}, {info.target_num_layers} layers, hidden
  {info.target_hidden_size}, tokenizer fingerprint `{info.tokenizer_fingerprint}`); feature taps
  {info.aux_layer_ids or "none"} ({info.aux_layer_convention}).
- **Data**: {", ".join(f"`{d}`" for d in [data, *extra]) if data else "see the recipe"}; {"their data cards are the READMEs beside them" if extra else "its data card is the README beside it"}.
- **Training**: {_training(folder)}

## Files

{files_section(folder, exports)}

## Measured τ and speedup

Prompt set: {head.get("prompt_set", "—")}. Machine: {head.get("machine", "—")}. Measured {head.get("created", "—")}.
τ counts the bonus token (vanilla = 1.00); speedup is tokens/s over the fastest vanilla of the same run (our
KV-cached loop or HF `generate`), answers stopping at EOS, every method interleaved with vanilla prompt by prompt.
Lossless evidence at T = 0: the share of answers identical to vanilla's greedy answer in the served dtype, whether
each divergence lies within that dtype's rounding (the target's top-2 logits tied there), and the same answers
replayed in fp32.

{table}

## How to load

In drafters: `drafters report --drafter <this folder>` measures it;
`infer.families.load_drafter("<this folder>", target, tokenizer)` loads it for `infer.generate.generate_speculative`.
The engine folders below were written from this folder's weights by `drafters publish` (`models/export.py`; which
engine source reads which field: `docs/exports.md` of drafters).

{engines_section(folder, exports)}

## Recipe

{recipe}
{notes}"""


def _stored_dtype(weights: Path) -> torch.dtype:
    """The dtype the checkpoint stores its floating-point weights in (a shipped drafter keeps bf16: half the bytes)."""
    return next(t.dtype for t in load_file(str(weights)).values() if t.is_floating_point())


def write_engine_folders(
    drafter: torch.nn.Module, out: Path, dtype: torch.dtype, layouts: Sequence[str] | None = None
) -> list[EngineExport]:
    """Every engine folder of the drafter's family into ``out``, in ``dtype`` (only those named in ``layouts`` when
    given); an ``export-*`` folder already there is replaced, so the folder holds what these weights make and nothing
    a training run left. A weights file equal tensor for tensor to ``out``'s own becomes a link to it (EAGLE-3's
    SGLang keys are ours: one copy in a repository)."""
    exports = family_of(drafter).engine_exports(drafter.to(dtype))
    unknown = set(layouts or ()) - {e.folder for e in exports}
    if unknown:  # before anything on disk is touched
        raise ValueError(f"no such layout for this drafter: {sorted(unknown)}; it has {[e.folder for e in exports]}")
    for stale in out.glob("export-*"):
        shutil.rmtree(stale)
    for e in exports:
        if e.write is None or (layouts is not None and e.folder not in layouts):
            continue
        written = e.write(out / e.folder) / WEIGHTS_NAME
        if written.exists() and _same_tensors(written, out / WEIGHTS_NAME):
            written.unlink()
            written.symlink_to(Path("..") / WEIGHTS_NAME)
    return exports


def _same_tensors(a: Path, b: Path) -> bool:
    """Same names, dtypes and values (the files' headers may differ: ours names the method in its metadata)."""
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


def publish(
    checkpoint: str | Path,
    out_dir: str | Path,
    leaderboard: str | Path | None = None,
    report: str | Path | None = None,
    target: TargetModel | None = None,
    layouts: Sequence[str] | None = None,
) -> Path:
    """Write the publishable folder of ``checkpoint`` into ``out_dir`` (the checkpoint folder itself is allowed:
    its engine folders and card are rewritten in place). The card's table: ``leaderboard`` (a leaderboard.json), else
    ``report`` (a report.json), else the checkpoint's own report.json. ``target``: the target the drafter loads on
    (default: the one its ``drafters`` block names, in fp32 on the CPU: only the exports' shapes and the target's
    own tensors some layouts carry are read from it). ``layouts``: the engine folders to write (default every one);
    the card names those left out. Returns ``out_dir``."""
    src, out = Path(checkpoint), Path(out_dir)
    _, info = read_checkpoint(src)  # refuses a folder that is not a drafters checkpoint, before anything is written
    if target is None:
        cfg = TargetConfig(info.target_name, dtype="float32", device="cpu", aux_layer_ids=info.aux_layer_ids or None)
        target = load_target(src, cfg)
    drafter = load_drafter(src, target)  # a target the drafter does not fit is refused here, before any write
    out.mkdir(parents=True, exist_ok=True)
    if src.resolve() != out.resolve():
        for name in (CONFIG_NAME, WEIGHTS_NAME, *RUN_FILES):
            if (src / name).exists():
                shutil.copy2(src / name, out / name)
        if (src / TARGET_DIR).exists():  # a jointly trained target's changes ride along (`load_target` applies them)
            shutil.copytree(src / TARGET_DIR, out / TARGET_DIR, dirs_exist_ok=True)
    exports = write_engine_folders(drafter, out, _stored_dtype(src / WEIGHTS_NAME), layouts)
    board = Path(leaderboard) if leaderboard is not None else None
    measured = Path(report) if report is not None else None
    (out / "README.md").write_text(model_card(out, info, exports, board, measured))
    return out


def push(folder: Path, repo_id: str, log=print) -> bool:
    """Upload ``folder`` to the hub as ``repo_id`` where a token and a network are there; otherwise say why."""
    from huggingface_hub import HfApi, get_token

    token = os.environ.get("HF_TOKEN") or get_token()
    if not token:
        log(f"not pushed: no Hugging Face token (set HF_TOKEN or run `hf auth login`); {folder} is ready to upload")
        return False
    try:
        api = HfApi(token=token)
        api.create_repo(repo_id, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id)
    except Exception as e:  # no network, no rights: the folder on disk is the result
        log(f"not pushed to {repo_id}: {type(e).__name__}: {e}; {folder} is ready to upload")
        return False
    log(f"pushed {folder} to https://huggingface.co/{repo_id}")
    return True


def main(argv: list[str] | None = None) -> Path:
    import argparse

    ap = argparse.ArgumentParser(prog="drafters publish", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--out", type=Path, help="folder to write (default: <checkpoint>-published)")
    ap.add_argument("--leaderboard", type=Path, help="a leaderboard.json whose rows make the card's table")
    ap.add_argument("--report", type=Path, help="a report.json for the card's table (default: the checkpoint's)")
    ap.add_argument("--layouts", nargs="+", help="engine folders to write (default every one; the card names the rest)")
    ap.add_argument("--push-to", help="hub repo id to upload to (needs a token and a network)")
    ap.add_argument("--target", help="the target to load the drafter on (default: the one its checkpoint names)")
    args = ap.parse_args(argv)
    target = None
    if args.target:
        info = read_checkpoint(args.checkpoint)[1]
        cfg = TargetConfig(args.target, dtype="float32", device="cpu", aux_layer_ids=info.aux_layer_ids or None)
        target = load_target(args.checkpoint, cfg)
    out = publish(args.checkpoint, args.out or args.checkpoint.with_name(args.checkpoint.name + "-published"),
                  args.leaderboard, args.report, target, args.layouts)  # fmt: skip
    print(f"published {args.checkpoint} into {out} (model card: {out / 'README.md'})")
    if args.push_to:
        push(out, args.push_to)
    else:
        print("not pushed: no --push-to repo id given")
    return out


if __name__ == "__main__":
    main()
