"""The leaderboard read back as tables: the per-category tables and the batch sweep's (`tables`, `sweep_table`), and
the files made of them: ``leaderboard.md``, ``leaderboard.csv`` and the README's headline block (`update_readme`).
Each reads a board (``leaderboard.json``: `eval.leaderboard.collect`); the plots of the same board are in
`eval.leaderboard_plots`."""

from __future__ import annotations

import csv
from pathlib import Path

from eval.report_md import evidence


def machines_words(cells: list[dict]) -> str | None:
    """The board's machine: one in words, or, where cells were measured on different kinds, each with its cells."""
    by: dict[str, list[str]] = {}
    for c in cells:
        if c.get("machine"):
            by.setdefault(c["machine"], []).append(c["cell"])
    if len(by) <= 1:
        return next(iter(by), None)
    return "; ".join(f"{m} (cells {', '.join(keys)})" for m, keys in by.items())


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


def has_sweep(board: dict) -> bool:
    """A batch sweep worth a plot: sweep rows at more than one batch size."""
    return len({r["batch_size"] for r in board["results"] if r.get("sweep")}) > 1


def write_markdown(board: dict, path: Path) -> None:
    """leaderboard.md: a table per (T, batch size), the sweep's table, the cells not measured, and the plots' names."""
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
    """leaderboard.csv: every row of the board, the columns of `CSV_FIELDS`."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in board["results"]:
            w.writerow({k: r.get(k) for k in CSV_FIELDS})
