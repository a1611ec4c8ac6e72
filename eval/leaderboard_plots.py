"""The leaderboard's plots (PNG) of a board (``leaderboard.json``: `eval.leaderboard.collect`): speedup per category,
acceptance per draft position, τ against prompt length, and speedup against batch size where the board has a sweep.
Each panel holds at most `SERIES_PER_PANEL` series and every plot is titled with the target and the machine."""

from __future__ import annotations

from pathlib import Path

from eval.leaderboard_tables import (
    category_of,
    category_rows,
    has_sweep,
    machines_words,
    method_of,
    overall,
    sweep_noise,
)

SERIES_PER_PANEL = 6
"""At most this many series share one panel: 11 bars per category in paired shades could not be told apart."""


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
