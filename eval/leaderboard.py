"""The leaderboard: every method against one target, on equal terms, in one folder a reader understands at a glance.

    drafters leaderboard                                   # the shipped drafters and baselines, built-in prompts
    drafters leaderboard drafters=[a,b] prompts_paths=[question.jsonl] temperatures=[0.0] batch_sizes=[1,4]
    python -m eval.leaderboard --config my_board.yaml out=outputs/board budget_min=60

A *cell* is one prompt source (a Spec-Bench-format file, or the built-in categories together) at one batch size, all
temperatures in one run (the sizing, the precision choice and the warm-up are paid once, and the rows still carry
their temperature and category). Each cell is one run of the shared report (`eval.report.run_report`, so `eval.measure`'s interleaved timing,
the cost-curve sizing, the lossless certificate and the report schema): every method is interleaved with vanilla
prompt by prompt, beside prompt lookup, the small draft model, the hybrid proposer and HF's assisted generation
(prompt lookup and assistant model, the outside peer). A finished cell keeps its ``report.json`` under
``cells/<key>/`` and is reused when the same command runs again (a cell whose settings changed runs again); a cell
that fails is reported with its error and the others go on; once ``budget_min`` has passed no new cell starts (the
rest are listed as not run, and a rerun does them).

Outputs: ``leaderboard.md`` (Spec-Bench style: speedup per category, mean τ, overall, the lossless evidence and
the chosen setting of every row), ``leaderboard.csv``, ``leaderboard.json`` (the report schema's rows, each with its
cell) and PNGs: speedup per category per method, acceptance per draft position, speedup against batch size, τ
against prompt length.
"""

from __future__ import annotations

import csv
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from eval.report_md import evidence
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
    sweep_max_new_tokens: int = 64
    """Answer cap in the sweep (a batch-64 call of vanilla in the slower dtype took 4 min at 128 tokens here)."""
    max_new_tokens: int = 128
    compare_settings: int = 1
    """Settings measured for each drafter after the first (eval.report.ReportConfig.compare_settings): 1 gives each
    its family's chain, one row per drafter; 0 every setting its family declares (trees, typical acceptance)."""
    draft_model: str | None = "cut"
    """The small draft-model baseline (a distilled folder, or "cut": the target's first layers, labelled); measured
    at T = 0 only, like HF's assisted generation with it (at T = 1 both ran below vanilla here, 0.71x and 0.47x, at
    the cost of ~5 vanilla calls a prompt)."""
    hf_assisted: bool = True
    """HF's assisted generation at batch 1 (prompt lookup, assistant model) beside ours."""
    hybrid_lookup: int = 10
    """The hybrid row's lookup chain (eval.report.ReportConfig.hybrid_lookup; 0 leaves the row out)."""
    hybrid_alone_match: int = 3
    """Lookup verified alone on matches this long (eval.report.ReportConfig.hybrid_alone_match; 0: never)."""
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
    from eval.report import ReportConfig

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
        hf_assisted=cfg.hf_assisted and cell.batch_size == 1,
        hybrid_lookup=cfg.hybrid_lookup,
        hybrid_alone_match=cfg.hybrid_alone_match,
        # the chosen chain's k - 1 and k + 1 check the sizing (a report's job): a board ranks what would be served;
        # the small draft model is the classic baseline, one row (its chain) is enough to place it
        chain_neighbours=False,
        draft_model_tree=False,
        fp32_certificate=cfg.fp32_certificate,
    )


def _fingerprint(cfg: LeaderboardConfig, cell: Cell) -> dict:
    """What a finished cell was measured with: a cell is reused only when the same settings would run it again."""
    return {"report": asdict(report_config(cfg, cell)), "drafters": cfg.drafters, "target": cfg.target}


def same_settings(stored: dict, now: dict) -> bool:
    """A finished cell's fingerprint against this run's: equal, except that a report setting added to the project
    after the cell ran counts as equal while it holds its default (the cell was measured the way that default
    measures)."""
    from eval.report import ReportConfig

    defaults = asdict(ReportConfig())
    old_report = stored.get("report", {})
    report = {k: v for k, v in now["report"].items() if k in old_report or v != defaults.get(k)}
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


def machines_words(cells: list[dict]) -> str | None:
    """The board's machine: one in words, or, where cells were measured on different kinds, each with its cells."""
    by: dict[str, list[str]] = {}
    for c in cells:
        if c.get("machine"):
            by.setdefault(c["machine"], []).append(c["cell"])
    if len(by) <= 1:
        return next(iter(by), None)
    return "; ".join(f"{m} (cells {', '.join(keys)})" for m, keys in by.items())


# ------------------------------------------------------------------------------------------ tables
def method_of(r: dict) -> str:
    return f"{r['proposer']} ({r['setting']})"


def category_rows(rows: list[dict]) -> list[dict]:
    """Rows of one category each: a cell's per-category rows, and its "all" row only where it has one category."""
    by_cell: dict[str, set] = {}
    for r in rows:
        by_cell.setdefault(r["cell"], set()).add(r["category"])
    return [r for r in rows if r["category"] != "all" or by_cell[r["cell"]] == {"all"}]


def category_of(r: dict) -> str:
    """The prompt category of a row: its own, or, for a one-category cell's "all" row, the cell's source (a built-in
    category, or a prompt file's name)."""
    if r["category"] != "all" or "source" not in r:
        return r["category"]
    return r["source"].split(":", 1)[1] if r["source"].startswith("builtin:") else Path(r["source"]).stem


def overall(rows: list[dict]) -> dict:
    """Over categories: tokens/s over the union of answers against vanilla's, and the token-weighted τ."""
    tok = sum(r["new_tokens"] for r in rows)
    secs = sum(r["new_tokens"] / r["tokens_per_s"] for r in rows)
    vtok = sum(r["vanilla_new_tokens"] for r in rows)
    vsecs = sum(r["vanilla_new_tokens"] / r["vanilla_tokens_per_s"] for r in rows)
    with_tau = [r for r in rows if r.get("tau")]
    rounds = sum(r["new_tokens"] / r["tau"] for r in with_tau)
    return {
        "speedup": (tok / secs) / (vtok / vsecs) if secs and vsecs else None,
        "tau": sum(r["new_tokens"] for r in with_tau) / rounds if rounds else None,
    }


def tables(board: dict) -> list[tuple[float, int, list[str], list[dict]]]:
    """Per (T, batch size): the categories and one entry per method with its per-category speedups and overall."""
    rows = category_rows([r for r in board["results"] if not r.get("sweep")])
    out = []
    for temp in sorted({r["temperature"] for r in rows}):
        for bs in sorted({r["batch_size"] for r in rows}):
            part = [r for r in rows if r["temperature"] == temp and r["batch_size"] == bs]
            cats = sorted({category_of(r) for r in part})
            entries = {}
            for r in part:
                e = entries.setdefault(method_of(r), {"method": method_of(r), "by_category": {}, "rows": []})
                e["by_category"][category_of(r)] = r["speedup"]
                e["rows"].append(r)
            for e in entries.values():
                e |= overall(e["rows"])
                e["evidence"] = evidence(e["rows"])
            ranked = sorted(entries.values(), key=lambda e: -(e["speedup"] or 0))
            out.append((temp, bs, cats, ranked))
    return out


def sweep_table(board: dict) -> tuple[list[int], list[dict]]:
    """The batch-aware sweep: (batch sizes, one entry per method with its speedup by batch size), best at batch 1
    first; ([], []) when the run has no sweep."""
    rows = [r for r in board["results"] if r.get("sweep") and r["category"] == "all"]
    sizes = sorted({r["batch_size"] for r in rows})
    entries: dict[str, dict] = {}
    for r in rows:
        e = entries.setdefault(method_of(r), {"method": method_of(r), "by_batch": {}, "rows": []})
        e["by_batch"][r["batch_size"]] = r["speedup"]
        e["rows"].append(r)
    for e in entries.values():
        e["evidence"] = evidence(e.pop("rows"))
    return sizes, sorted(entries.values(), key=lambda e: -e["by_batch"].get(sizes[0], 0) if sizes else 0)


def _sweep_lines(board: dict) -> list[str]:
    sizes, entries = sweep_table(board)
    if not sizes:
        return []
    sweep = next(c for c in board["cells"] if c.get("sweep"))
    on = (
        f" (measured on {sweep['machine']})"
        if sweep.get("machine") and sweep["machine"] != board.get("machine")
        else ""
    )
    lines = [
        f"Batch-aware speculation{on}: T = 0, `{sweep['source']}` prompts cycled to fill each batch; speedup over vanilla "
        "at the same batch size. The auto row's chain length per batch size was chosen from the cost curve measured "
        "at that batch size (off where it promised less than the margin; `checks.batch_policy` of the cell's report). "
        "Off, it is vanilla's own loop, so its distance from 1.00x is timing noise; the last row gives vanilla's spread "
        "between repeats of the same batch.",
        "",
        "| method | " + " | ".join(f"bs {b}" for b in sizes) + " | lossless evidence |",
        "|---" * (len(sizes) + 2) + "|",
    ]
    for e in entries:
        per = " | ".join(f"{e['by_batch'][b]:.2f}x" if b in e["by_batch"] else "—" for b in sizes)
        lines.append(f"| {e['method']} | {per} | {e['evidence']} |")
    spread = sweep_noise(board)
    if spread:
        per = " | ".join(f"±{spread[b]:.0%}" if spread.get(b) is not None else "—" for b in sizes)
        lines.append(f"| *noise: vanilla's own spread over the repeats* | {per} | |")
    return lines


def sweep_noise(board: dict) -> dict[int, float | None]:
    """Per sweep batch size: vanilla's widest relative spread of tokens/s over the repeats of one batch (half of
    (max - min) / mean, as ±), the band a sweep speedup is read against; {} for a sweep without repeats."""
    rows = [r for r in board["results"] if r.get("sweep") and r["category"] == "all"]
    out = {r["batch_size"]: r.get("vanilla_repeat_spread") for r in rows}
    return {b: (v / 2 if v is not None else None) for b, v in out.items()} if any(out.values()) else {}


def write_markdown(board: dict, path: Path) -> None:
    lines = [
        f"# Leaderboard: speculative decoding on {board.get('target')}",
        "",
        f"Machine: {board.get('machine')}. Made {board['created']} by `drafters leaderboard` (eval/leaderboard.py).",
        "Speedup: tokens/s over the fastest vanilla of this run (our KV-cached loop or HF `generate`, in the dtype "
        "where it is fastest), every method interleaved with vanilla prompt by prompt, answers stopping at EOS. "
        "τ counts the bonus token (vanilla = 1.00). Overall: tokens/s over all answers of the table.",
    ]
    for temp, bs, cats, entries in tables(board):
        lines += ["", f"## T = {temp:g}, batch size {bs}", ""]
        lines.append("| method | " + " | ".join(cats) + " | mean τ | overall | lossless evidence |")
        lines.append("|---" * (len(cats) + 4) + "|")
        for e in entries:
            per = " | ".join(f"{e['by_category'][c]:.2f}x" if c in e["by_category"] else "—" for c in cats)
            tau = f"{e['tau']:.2f}" if e["tau"] else "—"
            lines.append(f"| {e['method']} | {per} | {tau} | {e['speedup']:.2f}x | {e['evidence']} |")
    sweep = _sweep_lines(board)
    lines += ["", "## Speedup against batch size", "", *sweep] if sweep else []
    bad = [c for c in board["cells"] if c["status"] in ("failed", "not run")]
    if bad:
        lines += ["", "## Cells not measured", ""]
        lines += [f"- `{c['cell']}`: {c['status']} ({c.get('why', '')})" for c in bad]
    plots = ["speedup_by_category", "acceptance_by_position", "tau_by_prompt_length"]
    plots += ["speedup_by_batch"] if has_sweep(board) else []
    lines += ["", f"Plots: {', '.join(f'`{p}.png`' for p in plots)}. Per-cell reports (with the sizing and the "
              "certificate): `cells/*/report.md`."]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


README_BEGIN = "<!-- leaderboard:begin -->"
README_END = "<!-- leaderboard:end -->"


def readme_table(board: dict) -> str:
    """The headline table: every method's overall speedup and mean τ per (T, batch size), with the machine, target
    and prompts it was measured on (generated: the README's block is this text, a test compares them)."""
    lines = [f"Measured by `drafters leaderboard` on {board.get('target')}, {board.get('machine')}, {board['created']}; "
             f"prompts: {', '.join(sorted({c['source'] for c in board['cells']}))}.", ""]  # fmt: skip
    for temp, bs, _, entries in tables(board):
        lines += [f"| T = {temp:g}, batch {bs} | overall speedup | mean τ | lossless evidence |", "|---|---|---|---|"]
        for e in entries:
            tau = f"{e['tau']:.2f}" if e["tau"] else "—"
            lines.append(f"| {e['method']} | {e['speedup']:.2f}x | {tau} | {e['evidence']} |")
        lines.append("")
    lines += _sweep_lines(board)
    return "\n".join(lines).strip()


def update_readme(board: dict, path: Path) -> None:
    """Replace the block between the markers of ``path`` by `readme_table` (the markers must be there)."""
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise ValueError(f"{path} has no {README_BEGIN} ... {README_END} block for the leaderboard table")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    path.write_text(f"{head}{README_BEGIN}\n{readme_table(board)}\n{README_END}{tail}")


CSV_FIELDS = ("cell", "category", "temperature", "batch_size", "proposer", "setting", "speedup", "tau",
              "tokens_per_s", "vanilla_tokens_per_s", "vanilla_dtype", "dtype", "greedy_identical",
              "greedy_identical_fp32", "unexplained_divergences", "lossy", "prompts", "new_tokens")  # fmt: skip


def write_csv(board: dict, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in board["results"]:
            w.writerow({k: r.get(k) for k in CSV_FIELDS})


# ------------------------------------------------------------------------------------------- plots
SERIES_PER_PANEL = 6
"""At most this many series share one panel: 11 bars per category in paired shades could not be told apart."""


def has_sweep(board: dict) -> bool:
    """A batch sweep worth a plot: sweep rows at more than one batch size."""
    return len({r["batch_size"] for r in board["results"] if r.get("sweep")}) > 1


def write_plots(board: dict, out: Path) -> list[Path]:
    """The plots (PNG), each titled with the target and the machine: speedup per category, acceptance per draft
    position, τ against prompt length, and speedup against batch size where the board has a sweep (a stale one is
    removed otherwise: a batch plot of batch 1 alone says nothing)."""
    import matplotlib

    matplotlib.use("Agg")

    name = Path(str(board.get("target"))).name
    title = f"{name} on {machines_words([c for c in board['cells'] if not c.get('sweep')]) or board.get('machine')}"
    rows = category_rows([r for r in board["results"] if not r.get("sweep")])
    first_t = min((r["temperature"] for r in rows), default=0.0)
    base = [r for r in rows if r["batch_size"] == 1 and r["temperature"] == first_t]
    head = f"T = {first_t:g}, batch 1\n{title}"
    paths = [_plot_speedup_by_category(base, head, out / "speedup_by_category.png"),
             _plot_acceptance(base, head, out / "acceptance_by_position.png"),
             _plot_tau_by_prompt_length(base, head, out / "tau_by_prompt_length.png")]  # fmt: skip
    batch_png = out / "speedup_by_batch.png"
    if has_sweep(board):
        paths.append(_plot_speedup_by_batch(board, name, batch_png))
    else:
        batch_png.unlink(missing_ok=True)
    return paths


def _panels(series: list[str]) -> list[list[str]]:
    """``series`` cut into panels of at most `SERIES_PER_PANEL`, evenly."""
    n = max(1, -(-len(series) // SERIES_PER_PANEL))
    size = -(-len(series) // n) if series else 1
    return [series[i : i + size] for i in range(0, len(series), size)] or [[]]


def _plot_speedup_by_category(base: list[dict], head: str, path: Path) -> Path:
    """Horizontal bars: one row of bars per method (fastest overall on top), one bar per category, each bar with its
    value written at its end; vanilla's 1.00x as a line."""
    import matplotlib.pyplot as plt

    methods = sorted(
        {method_of(r) for r in base}, key=lambda m: overall([r for r in base if method_of(r) == m])["speedup"] or 0
    )
    groups = _panels(sorted({category_of(r) for r in base}))
    fig, axes = plt.subplots(1, len(groups), figsize=(7.5 * len(groups), 0.55 * len(methods) + 2.2), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, cats in zip(axes[0], groups):
        height = 0.8 / max(1, len(cats))
        for i, c in enumerate(cats):
            vals = {method_of(r): r["speedup"] for r in base if category_of(r) == c}
            ys = [j - (i - (len(cats) - 1) / 2) * height for j, m in enumerate(methods) if m in vals]  # first on top
            bars = ax.barh(ys, [vals[m] for m in methods if m in vals], height, label=c, color=colors[i % len(colors)])
            ax.bar_label(bars, fmt="%.2fx", fontsize=7, padding=2)
        ax.axvline(1.0, color="black", lw=0.8, ls="--")
        ax.set_yticks(range(len(methods)), [_wrap(m) for m in methods], fontsize=7)
        ax.set_xlim(0, 1.18 * max((r["speedup"] for r in base), default=1.0))
        ax.set_xlabel("speedup over the fastest vanilla (x); dashed: vanilla = 1.00x")
        ax.legend(title="prompt category", fontsize=7, title_fontsize=7, loc="lower right")
    fig.suptitle(f"Speedup per prompt category, {head}", fontsize=9)
    return _save(fig, path)


def _wrap(label: str, width: int = 44) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(label, width))


def _plot_acceptance(base: list[dict], head: str, path: Path) -> Path:
    """Acceptance per draft position, categories pooled. With the rows' counts: unconditional, the share of verify
    steps whose draft at position k was accepted (what a reader expects: it can only fall with k). A board made before
    the counts were kept has only the conditional α_k (accepted among the rounds that reached position k), so it is
    plotted under that name, with a note that deep points rest on the few rounds that reached them."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    drafted = [r for r in base if r.get("alpha")]
    counted = all(r.get("verify_steps") for r in drafted)
    methods = sorted({method_of(r) for r in drafted})
    groups = _panels(methods)
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 5.5), squeeze=False)
    for ax, group in zip(axes[0], groups):
        for m in group:
            mine = [r for r in drafted if method_of(r) == m]
            depth = max(len(r["alpha"]) for r in mine)
            if counted:
                steps = sum(r["verify_steps"] for r in mine)
                ys = [sum(r["accepted_at_depth"][k] for r in mine if k < len(r["accepted_at_depth"])) / steps
                      for k in range(depth)]  # fmt: skip
                label = f"{_wrap(m, 60)} ({steps} verify steps)"
            else:
                ys = [sum(r["alpha"][k] for r in mine if k < len(r["alpha"])) / sum(k < len(r["alpha"]) for r in mine)
                      for k in range(depth)]  # fmt: skip
                label = _wrap(m, 60)
            ax.plot(range(1, depth + 1), ys, marker="o", label=label)
        ax.set_ylim(0, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position k (depth in the verified draft)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1)
    if counted:
        axes[0][0].set_ylabel("share of verify steps that accepted position k")
        note = "unconditional: every verify step counts at every position"
    else:
        axes[0][0].set_ylabel("conditional α_k = accepted / rounds that reached position k")
        note = ("conditional: α_k counts only the rounds whose drafts before k were all accepted;\n"
                "this board kept no attempt counts, so a deep point may rest on a handful of rounds")  # fmt: skip
    fig.suptitle(f"Acceptance per draft position, {note}\n{head}", fontsize=9)
    return _save(fig, path)


def _plot_tau_by_prompt_length(base: list[dict], head: str, path: Path) -> Path:
    """τ of every generate call against its prompt length, one point per call."""
    import matplotlib.pyplot as plt

    calls = [r for r in base if r.get("per_call") and r.get("tau")]
    groups = _panels(sorted({method_of(r) for r in calls}))
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 5.5), squeeze=False, sharey=True)
    for ax, group in zip(axes[0], groups):
        for m in group:
            pts = [(c[0], c[1] / c[2]) for r in calls if method_of(r) == m for c in r["per_call"] if c[2]]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, label=_wrap(m, 60), alpha=0.7)
        ax.set_xlabel("prompt length (tokens)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1)
    axes[0][0].set_ylabel("τ: tokens per target forward (vanilla = 1)")
    fig.suptitle(f"τ against prompt length, one point per answer, {head}", fontsize=9)
    return _save(fig, path)


def _plot_speedup_by_batch(board: dict, name: str, path: Path) -> Path:
    """The sweep: each method's speedup against batch size, values written at the points, vanilla's spread shaded."""
    import matplotlib.pyplot as plt

    swept = [r for r in board["results"] if r.get("sweep") and r["category"] == "all"]
    sweep_cell = next((c for c in board["cells"] if c.get("sweep")), {})
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for m in sorted({method_of(r) for r in swept}):
        pts = sorted((r["batch_size"], r["speedup"]) for r in swept if method_of(r) == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=_wrap(m, 60))
        for x, y in pts:
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    noise = sweep_noise(board)
    sizes = sorted(b for b, v in noise.items() if v is not None)
    if sizes:  # an error bar at 1.00x per batch size: a speedup inside it is vanilla's own noise
        ax.errorbar(sizes, [1.0] * len(sizes), yerr=[noise[b] for b in sizes], fmt="none", ecolor="grey", capsize=8,
                    lw=2, label="vanilla's own spread over repeats (±)")  # fmt: skip
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    batch_sizes = sorted({r["batch_size"] for r in swept})
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.set_xlabel("batch size (rows decoded together)")
    ax.set_ylabel("speedup over vanilla at that batch size (x)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1)
    ax.set_title(f"Speedup against batch size, T = 0\n{name} on {sweep_cell.get('machine') or board.get('machine')}",
                 fontsize=9)  # fmt: skip
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_outputs(board: dict, out: Path) -> None:
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
    from models.target import TargetConfig, load_tokenizer

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
