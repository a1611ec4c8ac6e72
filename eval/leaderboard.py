"""The leaderboard: every method against one target, on equal terms, in one folder a reader understands at a glance.

    drafters leaderboard                                   # the shipped drafters and baselines, built-in prompts
    drafters leaderboard drafters=[a,b] prompts_paths=[question.jsonl] temperatures=[0.0] batch_sizes=[1,4]
    python -m eval.leaderboard --config my_board.yaml out=outputs/board budget_min=60

A *cell* is one prompt source (a Spec-Bench-format file, or the built-in categories together) at one batch size, all
temperatures in one run (the sizing, the precision choice and the warm-up are paid once, and the rows still carry
their temperature and category). Each cell is one run of the shared report (`eval.report.run_report`, so
`eval.measure`'s interleaved timing, the cost-curve sizing, the lossless certificate and the report schema): every
method is interleaved with vanilla prompt by prompt, beside prompt lookup, the small draft model, the hybrid proposer
and HF's assisted generation (prompt lookup and assistant model, the outside peer). A finished cell keeps its
``report.json`` under ``cells/<key>/`` and is reused when the same command runs again (a cell whose settings changed
runs again); a cell that fails is reported with its error and the others go on; once ``budget_min`` has passed no new
cell starts (the rest are listed as not run, and a rerun does them).

Outputs: ``leaderboard.md`` (Spec-Bench style: speedup per category, mean τ, overall, the lossless evidence and
the chosen setting of every row), ``leaderboard.csv``, ``leaderboard.json`` (the report schema's rows, each with its
cell) and PNGs: speedup per category per method, acceptance per draft position, speedup against batch size, τ
against prompt length. This module runs the cells and gathers the board; `eval.leaderboard_tables` writes its tables
(markdown, csv, the README block) and `eval.leaderboard_plots` its plots.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from eval.leaderboard_plots import write_plots
from eval.leaderboard_tables import machines_words, update_readme, write_csv, write_markdown
from models.config import parse_cli

SHIPPED_DRAFTERS = sorted(str(p.parent) for p in (Path(__file__).resolve().parents[1] / "models").glob("*/config.json"))
"""The drafters the repository ships (the checkpoint folders under models/), measured by a run without arguments."""


@dataclass
class LeaderboardConfig:
    target: str | None = None
    """Target (short name, folder or hub id); None: the first drafter's ``target_name``."""
    drafters: list[str] = field(default_factory=lambda: list(SHIPPED_DRAFTERS))
    """Drafter checkpoints (any family); the first one's settings also make the hybrid row."""
    prompts_paths: list[str] = field(default_factory=list)
    """Spec-Bench-format jsonl files ({question_id, category, turns}); each is one cell per T and batch size."""
    categories: list[str] = field(default_factory=lambda: ["chat", "code"])
    """Built-in categories (eval/prompts.py), one cell each per T and batch size; [] for files only."""
    prompts: int | None = 3
    """Prompts per built-in category (None: 16), each with its turns. The no-argument board's size on a 2-core CPU:
    with both temperatures, the shipped drafters, every baseline and the sweep, 3 per category keeps it within 30
    minutes (the count is stated on the board)."""
    file_prompts: int | None = None
    """The first N questions of each prompt file; None measures every file whole (a file is the user's choice of
    what to measure, so it is never cut silently)."""
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """Temperatures measured in every ordinary cell: T = 0 (greedy, with the token-identity check) and T = 1 (lossless
    rejection sampling, whose claim is the accept rule's); [0.0] halves a cell's timing loop."""
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    batch_sweep: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    """Batch sizes of the batch-aware sweep, one more cell ([] leaves it out): at T = 0 on ``sweep_category``,
    vanilla, prompt lookup, the first drafter's sized chain and its batch-aware policy (report.batch_auto) at every
    size, the prompts cycled to fill a batch. Trees, the hybrid, the draft model and HF's peers stay out of it: at
    batch 64 each of them costs minutes on a CPU, and the sweep's question is when speculation stops paying."""
    sweep_category: str = "chat"
    sweep_repeats: int = 3
    """Every method decodes each sweep batch this many times in turn (one call is one timing: vanilla against
    itself moved 20 % between two calls here); the sweep table gives vanilla's spread over them, the noise band."""
    sweep_max_new_tokens: int = 32
    """Answer cap in the sweep: a batch-64 round of the sweep's methods took 2.7 min at 64 tokens here, half the
    sweep's decoding; 32 decode steps still time the batched verify against vanilla's batched step."""
    max_new_tokens: int = 96
    """Answer cap of the ordinary cells (answers stop at EOS before it where the target ends them)."""
    compare_settings: int = 1
    """Settings measured for each drafter after the first (eval.report_config.ReportConfig.compare_settings): 1 gives
    each its family's chain, one row per drafter; 0 every setting its family declares (trees, typical acceptance)."""
    draft_model: str | None = "cut"
    """The small draft-model baseline (a distilled folder, or "cut": the target's first layers, labelled); measured
    at T = 0 only (at T = 1 it and HF's assisted generation with it ran below vanilla here, 0.71x and 0.47x, at the
    cost of ~5 vanilla calls a prompt)."""
    hf_assisted: bool = True
    """HF's assisted generation at batch 1 beside ours: its prompt lookup. Its assisted generation with the
    undistilled draft model is left out (eval.report_config.ReportConfig.hf_assisted_draft_model): it ran at 0.23x
    here, ~4 vanilla calls a prompt, and the draft model's own row places that baseline."""
    hybrid_lookup: int = 10
    """The hybrid row's lookup chain (eval.report_config.ReportConfig.hybrid_lookup; 0 leaves the row out)."""
    hybrid_alone_match: int = 3
    """Lookup verified alone on matches this long (eval.report_config.ReportConfig.hybrid_alone_match; 0: never)."""
    fp32_certificate: bool = True
    reuse_other_machines: bool = False
    """Reuse finished cells measured on another kind of machine (another CPU model or instruction set): off, such a
    cell is measured again, since a speedup is a property of the machine; on, the board names each cell's machine."""
    budget_min: float = 45.0
    """No new cell starts after this many minutes (finished cells are kept; a rerun does the rest)."""
    out: str = "outputs/leaderboard"
    readme: str | None = None
    """A README whose block between `README_BEGIN` and `README_END` is replaced by the leaderboard's headline table
    (the repository's README shows the shipped drafters' run this way)."""


@dataclass(frozen=True)
class Cell:
    source: str
    """A prompt file's path, or ``builtin:<category>[,<category>...]``."""
    temperatures: tuple[float, ...]
    batch_size: int
    sweep: tuple[int, ...] = ()
    """The batch-aware sweep's batch sizes (``batch_size`` is then the largest); () for an ordinary cell."""

    @property
    def categories(self) -> list[str]:
        """The built-in categories of a ``builtin:`` source ([] for a file)."""
        return self.source.split(":", 1)[1].split(",") if self.source.startswith("builtin:") else []

    @property
    def key(self) -> str:
        name = Path(self.source).stem if not self.categories else "-".join(self.categories)
        temps = "-".join(f"{t:g}" for t in self.temperatures)
        if self.sweep:
            return f"{name}__T{temps}__sweep_bs{'-'.join(map(str, self.sweep))}"
        return f"{name}__T{temps}__bs{self.batch_size}"


def cells_of(cfg: LeaderboardConfig) -> list[Cell]:
    sources = [*cfg.prompts_paths, *([f"builtin:{','.join(cfg.categories)}"] if cfg.categories else [])]
    if not sources:
        raise ValueError("the leaderboard needs prompts_paths or categories")
    if not cfg.temperatures:
        raise ValueError("the leaderboard needs at least one temperature")
    temps = tuple(sorted(set(cfg.temperatures)))
    cells = [Cell(s, temps, b) for s in sources for b in cfg.batch_sizes]
    if cfg.batch_sweep:
        sweep = tuple(sorted(set(cfg.batch_sweep)))
        cells.append(Cell(f"builtin:{cfg.sweep_category}", (0.0,), sweep[-1], sweep))
    return cells


def report_config(cfg: LeaderboardConfig, cell: Cell):
    """The shared report's settings for one cell."""
    from eval.report_config import ReportConfig

    by_file = not cell.categories
    if cell.sweep:
        return ReportConfig(
            categories=cell.categories,
            prompts=cfg.prompts,
            max_new_tokens=cfg.sweep_max_new_tokens,
            temperatures=[0.0],
            batch_sizes=list(cell.sweep),
            batch_repeats=cfg.sweep_repeats,
            tree_total_tokens=0,
            draft_model=None,
            hybrid_lookup=0,
            chain_neighbours=False,
            batch_auto=True,
            fp32_certificate=cfg.fp32_certificate,
        )
    return ReportConfig(
        prompts_path=cell.source if by_file else None,
        categories=["chat"] if by_file else cell.categories,
        prompts=cfg.file_prompts if by_file else cfg.prompts,
        max_new_tokens=cfg.max_new_tokens,
        temperatures=list(cell.temperatures),
        batch_sizes=[cell.batch_size],
        compare=list(cfg.drafters[1:]),
        compare_settings=cfg.compare_settings,
        draft_model=cfg.draft_model,
        draft_model_sampled=False,
        hf_assisted_draft_model=False,
        hf_assisted=cfg.hf_assisted and cell.batch_size == 1,
        hybrid_lookup=cfg.hybrid_lookup,
        hybrid_alone_match=cfg.hybrid_alone_match,
        # the chosen chain's k - 1 and k + 1 check the sizing (a report's job): a board ranks what would be served;
        # the small draft model is the classic baseline, one row (its chain) is enough to place it
        chain_neighbours=False,
        draft_model_tree=False,
        fp32_certificate=cfg.fp32_certificate,
    )


def weights_digest(folder: str) -> str:
    """sha256 over a drafter folder's config.json and model.safetensors: a drafter trained again under the same path
    is another drafter."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        path = Path(folder) / name
        if path.exists():
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def _fingerprint(cfg: LeaderboardConfig, cell: Cell) -> dict:
    """What a finished cell was measured with: a cell is reused only when the same settings and the same drafter
    weights would run it again."""
    return {
        "report": asdict(report_config(cfg, cell)),
        "drafters": cfg.drafters,
        "drafter_weights": [weights_digest(d) for d in cfg.drafters],
        "target": cfg.target,
    }


def same_settings(stored: dict, now: dict) -> bool:
    """A finished cell's fingerprint against this run's: equal, except that a report setting added to the project
    after the cell ran counts as equal while it is off (False, None, 0 or empty): a feature added off measures the
    way the cell was measured. One added on (the priced hybrid) changes what a row runs, so the cell runs again."""
    old_report = stored.get("report", {})
    report = {k: v for k, v in now["report"].items() if k in old_report or v not in (False, None, 0, [], (), "")}
    return {**stored, "report": old_report} == {**now, "report": report}


def machine_key(machine: dict) -> tuple:
    """What makes two machines the same kind for a speedup: device, CPU model, the flags that matter, threads."""
    return (machine.get("device"), machine.get("name"), tuple(machine.get("flags") or ()), machine.get("threads"))


def _cell_machine(folder: Path) -> dict | None:
    """The machine a finished cell's report was measured on (its report.json's ``machine``)."""
    machine = json.loads((folder / "report.json").read_text()).get("machine")
    return machine if isinstance(machine, dict) else None


def run_cells(cfg: LeaderboardConfig, run_cell, log=print, here: dict | None = None) -> list[dict]:
    """Every cell, resumable: ``run_cell(cell, folder) -> rows`` measures one; returns one status per cell
    (``done`` / ``reused`` / ``failed`` with the error / ``not run`` past the budget). ``here``: this machine
    (`models.precision.machine().as_dict()`); a cell measured on another kind is reused only with
    ``reuse_other_machines``."""
    from models.precision import machine

    here = here or machine().as_dict()
    out = Path(cfg.out)
    statuses, t0 = [], time.time()
    cells = cells_of(cfg)
    bar = tqdm(cells, desc="leaderboard cells")
    for cell in bar:
        folder = out / "cells" / cell.key
        stamp = folder / "cell.json"
        fingerprint = _fingerprint(cfg, cell)
        entry = {
            "cell": cell.key,
            "source": cell.source,
            "temperatures": list(cell.temperatures),
            "batch_size": cell.batch_size,
            "sweep": list(cell.sweep),
        }
        if (
            (folder / "report.json").exists()
            and stamp.exists()
            and same_settings(json.loads(stamp.read_text()), fingerprint)
        ):
            there = _cell_machine(folder)
            if there is None or machine_key(there) == machine_key(here) or cfg.reuse_other_machines:
                statuses.append(entry | {"status": "reused"})
                continue
            log(f"leaderboard: cell {cell.key} was measured on {there.get('words')}, not this machine: measuring again")
        if (time.time() - t0) / 60 > cfg.budget_min:
            statuses.append(entry | {"status": "not run", "why": f"past the {cfg.budget_min:g}-minute budget"})
            continue
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.json").unlink(missing_ok=True)
        started = time.time()
        try:
            run_cell(cell, folder)
        except Exception as e:  # a failing cell is reported, the others go on
            (folder / "error.txt").write_text(traceback.format_exc())
            log(f"leaderboard: cell {cell.key} failed: {type(e).__name__}: {e}")
            statuses.append(entry | {"status": "failed", "why": f"{type(e).__name__}: {e}"})
            continue
        (folder / "error.txt").unlink(missing_ok=True)
        stamp.write_text(json.dumps(fingerprint, indent=1) + "\n")
        statuses.append(entry | {"status": "done", "minutes": round((time.time() - started) / 60, 1)})
        bar.set_postfix(last=cell.key)
    return statuses


def collect(cfg: LeaderboardConfig, statuses: list[dict]) -> dict:
    """leaderboard.json: the report schema's rows of every finished cell (each tagged with its cell)."""
    out, rows, head = Path(cfg.out), [], {}
    for st in statuses:
        path = out / "cells" / st["cell"] / "report.json"
        if st["status"] in ("done", "reused") and path.exists():
            report = json.loads(path.read_text())
            head = head or {k: report.get(k) for k in ("target", "precision")}
            m = report.get("machine")
            st["machine"] = m.get("words", str(m)) if isinstance(m, dict) else m  # the tables and plots say words
            for r in report["results"]:
                rows.append(r | {"cell": st["cell"], "source": st["source"], "sweep": bool(st.get("sweep"))})
    return {**head, "machine": machines_words(statuses), "created": time.strftime("%Y-%m-%d %H:%M"),
            "config": asdict(cfg), "cells": statuses, "results": rows}  # fmt: skip


def write_outputs(board: dict, out: Path) -> None:
    """leaderboard.json, .csv and .md into ``out``, and the plots where the board has rows."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "leaderboard.json").write_text(json.dumps(board, indent=1) + "\n")
    write_csv(board, out / "leaderboard.csv")
    write_markdown(board, out / "leaderboard.md")
    if board["results"]:
        write_plots(board, out)


# -------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    from eval.report import run_report
    from infer.families import load_drafter
    from infer.forward_cost import quiet_routing
    from models.checkpoint import read_checkpoint
    from models.loader import load_target
    from models.target import TargetConfig
    from models.tokenizer import load_tokenizer

    cfg = parse_cli(LeaderboardConfig, sys.argv[1:] if argv is None else argv)
    if not cfg.drafters:
        raise SystemExit("the leaderboard needs at least one drafter checkpoint (drafters=[DIR,...])")
    first = cfg.drafters[0]
    _, info = read_checkpoint(first)
    target_cfg = TargetConfig(name_or_path=cfg.target or info.target_name, aux_layer_ids=info.aux_layer_ids or None)
    tokenizer = load_tokenizer(target_cfg.name_or_path)
    target = load_target(first, target_cfg, prepare=quiet_routing, acceptance=info.heldout_acceptance or None)
    drafter = load_drafter(first, target, tokenizer)

    def run_cell(cell: Cell, folder: Path) -> list[dict]:
        return run_report(target, drafter, tokenizer, report_config(cfg, cell), folder, drafter_dir=first)

    statuses = run_cells(cfg, run_cell)
    board = collect(cfg, statuses)
    write_outputs(board, Path(cfg.out))
    if cfg.readme:
        update_readme(board, Path(cfg.readme))
    done = sum(s["status"] in ("done", "reused") for s in statuses)
    print(f"leaderboard: {done}/{len(statuses)} cells; written to {cfg.out}/leaderboard.md")
    return board


if __name__ == "__main__":
    main()
