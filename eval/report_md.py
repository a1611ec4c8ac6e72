"""Writing a report: ``report.json`` (the rows of `eval.measure.measure` with the report's checks) and ``report.md``.

Schema (shared by all recipes)::

    {"method": "...", "target": "<name_or_path>", "prompt_set": "...", "created": "...", "machine": {...},
     "precision": {...}, <checks>, "results": [{"proposer": "prompt lookup", "setting": "chain 10",
     "category": "all", "temperature": 0.0, "batch_size": 1, "tau": 3.1, "speedup": 2.2, "tokens_per_s": ...,
     "vanilla_tokens_per_s": ..., "alpha": [...], "greedy_identical": 1.0, "divergences": [...], "prompts": 16,
     "max_new_tokens": 128, "lossy": false}, ...]}

The markdown puts every row's lossless evidence in words (`evidence`), the precision sentence
(`precision_words`) and every unexplained divergence beside the table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from eval.rows import LOOKUP_ROW, paired_speedup
from models.precision import machine

DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def evidence(rows: list[dict]) -> str:
    """The lossless evidence of one method, pooled over its rows (one row in a report; categories and cells on a
    board), in words that need no legend: "greedy identical 25 % in bf16, all 6 divergences within bf16 rounding;
    fp32 replay from the first differing token: 6 of 6 identical". A bare "bf16 0.25" read as "lossy" to newcomers.
    Shares are weighted by each row's prompts; at T > 0 the claim is the accept rule's. Rows measured before the
    certificate replayed only the divergences carry the share of a whole fp32 pass ("fp32 100 %")."""
    if any(r["lossy"] for r in rows):
        return "lossy (typical acceptance): no identity claim"
    greedy = [r for r in rows if r["temperature"] == 0 and r.get("greedy_identical") is not None]
    if not greedy:
        return "lossless rule (rejection sampling)" if all(r["temperature"] > 0 for r in rows) else "not compared"
    parts = []
    for dtype in sorted({r["dtype"] for r in greedy}):
        part, dt = [r for r in greedy if r["dtype"] == dtype], DTYPE_SHORT.get(dtype, dtype)
        words = f"greedy identical {_share(part, 'greedy_identical')} in {dt}"
        n, explained = sum(len(r["divergences"]) for r in part), sum(r["explained_divergences"] for r in part)
        if n:
            words += (
                f", {'the' if n == 1 else 'all'} {_count(n, 'divergence')} within {dt} rounding"
                if explained == n
                else f", {n - explained} of {_count(n, 'divergence')} NOT explained by {dt} rounding"
            )
        if dtype != "float32":
            words += _fp32_words(part, n)
        parts.append(words)
    return "; ".join(parts)


def _fp32_words(rows: list[dict], divergences: int) -> str:
    """The fp32 part of `evidence` for rows served below fp32."""
    replayed = [r for r in rows if r.get("fp32_replays") is not None]
    whole = [r for r in rows if "fp32_replays" not in r and r.get("greedy_identical_fp32") is not None]
    words = ""
    if replayed and sum(r["fp32_replays"] for r in replayed):
        same, total = sum(r["fp32_replays_identical"] for r in replayed), sum(r["fp32_replays"] for r in replayed)
        words += f"; fp32 replay from the first differing token: {same} of {total} identical"
    if whole:
        words += f"; fp32 {_share(whole, 'greedy_identical_fp32')}"
    if divergences and not replayed and not whole:
        words += "; fp32 replay not run"
    bad = sum(not d["explained"] for r in replayed + whole for d in r["fp32_divergences"])
    return words + (f" ({_count(bad, 'unexplained divergence')} in fp32)" if bad else "")


def _share(rows: list[dict], key: str) -> str:
    weight = sum(r.get("prompts") or 1 for r in rows)
    return f"{100 * sum(r[key] * (r.get('prompts') or 1) for r in rows) / weight:.0f} %"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _divergence_lines(rows: list[dict]) -> list[str]:
    """Every unexplained divergence by prompt, position, both tokens, the replayed gap and the band."""
    out = []
    for r in rows:
        if r["category"] != "all" and any(x["category"] == "all" for x in rows):
            continue  # the "all" rows hold every divergence once
        for d in r["divergences"] + r["fp32_divergences"]:
            if d["explained"]:
                continue
            prompt = d["prompts"][d["row"]] if d.get("prompts") else f"batch {d['batch']} row {d['row']}"
            gap = "none (one output is a prefix of the other)" if d["gap"] is None else f"{d['gap']:.4g}"
            band = "–" if d["band"] is None else f"{d['band']:.3g}"
            out.append(
                f"- {r['proposer']} ({r['setting']}), T {r['temperature']}, bs {r['batch_size']}, {d['served_dtype']}: "
                f"prompt {prompt or d['batch']}, position {d['position']}, vanilla token {d['vanilla_token']} vs "
                f"{d['candidate_token']}, gap {gap} in {d['replay_dtype']} (band {band})"
            )
    return out


def write_report(
    out_dir: str | Path,
    method: str,
    target_name: str,
    rows: list[dict],
    prompt_set: str = "",
    notes: str = "",
    checks: dict | None = None,
    precision: dict | None = None,
) -> None:
    """``report.json`` (schema above; ``checks`` such as the vanilla check go in as they are; ``precision``: the
    serving choice's `PrecisionChoice.as_dict`) and ``report.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = rows[0]["machine"] if rows else ""
    where = machine(device="cuda" if torch.cuda.is_available() and "cuda" in device.lower() else "cpu").as_dict()
    report = {
        "method": method,
        "target": target_name,
        "prompt_set": prompt_set,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": where,
        "precision": precision,
        **(checks or {}),
        "results": rows,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# {method} report",
        "",
        f"Target: `{target_name}`. Prompts: {prompt_set}. Machine: {where['words']}.",
        "",
        precision_words(rows, precision),
        "",
        *([notes, ""] if notes else []),
        "| category | proposer | setting | T | bs | dtype | τ | speedup | predicted | tokens/s | vanilla tokens/s "
        "(dtype) | α | greedy identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tau = "–" if r["tau"] is None else f"{r['tau']:.2f}"
        pred = "–" if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.2f}x"
        lines.append(
            f"| {r['category']} | {r['proposer']}{' (lossy)' if r['lossy'] else ''} | {r['setting']} | "
            f"{r['temperature']} | {r['batch_size']} | {_short(r['dtype'])} | {tau} | {r['speedup']:.2f}x | {pred} | "
            f"{r['tokens_per_s']:.1f} | {r['vanilla_tokens_per_s']:.1f} ({_short(r['vanilla_dtype'])}) | "
            f"{' '.join(f'{a:.2f}' for a in r['alpha'][:8])} | {evidence([r])} |"
        )
    lines += [
        "",
        "**Greedy identity** (T = 0) compares every answer with vanilla's. Where one diverges, the common prefix is "
        "replayed one precision up (fp32 for bf16, fp64 for fp32): a divergence is *within rounding* when the two "
        "tokens' exact logit gap is inside the served dtype's rounding band there (twice the served dtype's own "
        "error on that gap plus 2 ulps at that logit magnitude; `infer/certificate.py`) or when the method's token "
        "is the exact argmax there (vanilla's rounding parted from it), and *unexplained* "
        "otherwise, which would be a bug. Below fp32, every divergent answer is also decoded again on an fp32 copy of "
        "the target from its first differing token, by vanilla and by the method, where the two must be identical.",
    ]
    lines += _resolution_lines(rows)
    unexplained = _divergence_lines(rows)
    lines += ["", "Unexplained divergences:", "", *unexplained] if unexplained else []
    for name, check in (checks or {}).items():
        if isinstance(check, dict) and "summary" in check:
            lines += ["", f"**{name.replace('_', ' ').capitalize()}**: {check['summary']}"]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _resolution_lines(rows: list[dict]) -> list[str]:
    """Over all prompts, each row's speedup and its ratio to prompt lookup's in the same (T, batch size), with the
    95 % interval of a paired bootstrap over the generate calls (`eval.rows.paired_speedup`): whether the file
    resolves a difference, not only its size."""
    everything = [r for r in rows if r["category"] == "all"]
    lookups = {
        (r["temperature"], r["batch_size"]): r for r in everything if (r["proposer"], r["setting"]) == LOOKUP_ROW
    }
    out = []
    for r in everything:
        if r.get("speedup_interval") is None:
            continue
        lookup = lookups.get((r["temperature"], r["batch_size"]))
        over = "–"
        # a cell reused from an older board has no per-call timings
        if lookup is not None and lookup is not r and len(lookup.get("timed") or []) == len(r["timed"]):
            ratio, low, high = paired_speedup(r["timed"], lookup["timed"])
            over = f"{ratio:.2f}x [{low:.2f}, {high:.2f}]"
        low, high = r["speedup_interval"]
        out.append(
            f"| {r['temperature']} | {r['batch_size']} | {r['proposer']} | {r['setting']} | "
            f"{r['speedup']:.2f}x [{low:.2f}, {high:.2f}] | {over} |"
        )
    if not out:
        return []
    return [
        "",
        f"**Resolution**: over all prompts, 95 % intervals of a paired bootstrap over the generate calls (each call "
        f"against vanilla's, or {LOOKUP_ROW[0]}'s, on the same prompts in the same loop).",
        "",
        f"| T | bs | proposer | setting | speedup [95 %] | over {LOOKUP_ROW[0]} [95 %] |",
        "|---|---|---|---|---|---|",
        *out,
    ]


def _short(dtype: str) -> str:
    return DTYPE_SHORT.get(dtype, dtype)


def precision_words(rows: list[dict], precision: dict | None) -> str:
    """The report's precision sentence: the dtypes of target, drafters and the vanilla baseline, and why."""
    served = sorted({_short(r["dtype"]) for r in rows})
    drafters = sorted({_short(r["drafter_dtype"]) for r in rows})
    vanilla = sorted({_short(r["vanilla_dtype"]) for r in rows})
    words = f"**Precision**: target served in {', '.join(served)}, drafters in {', '.join(drafters)}; the vanilla "
    words += f"baseline (the fastest of our loop and HF generate) ran in {', '.join(vanilla)}"
    if vanilla != served:
        words += " (speculation runs in another dtype than the fastest vanilla: identity is judged in the served dtype)"
    loop = next((r for r in rows if r["batch_size"] == 1 and r["vanilla_loop_ms"]), None)
    if loop is not None:
        ms = loop["vanilla_loop_ms"]
        words += (
            f"; at batch 1 our vanilla ran its {loop['vanilla_loop']} loop, timed faster here in {_short(loop['dtype'])}"
            f" (one-token forward: {', '.join(f'{name} {t:.1f} ms' for name, t in ms.items())})"
        )
    if precision:
        how = {"user": "the user", "cached": "the precision policy, measured earlier on this machine"}
        words += f". Chosen by {how.get(precision['source'], 'the precision policy, ' + precision['source'])}: "
        words += precision["reason"]
    return words + "."
