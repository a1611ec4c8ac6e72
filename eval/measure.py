"""The one timing loop: τ, speedup and greedy identity of proposers against vanilla (``report.json`` + ``report.md``).

Recipes' reports and the quick start call `measure` and `write_report`. Schema (shared by all recipes)::

    {"method": "eagle3", "target": "<name_or_path>", "prompt_set": "...", "created": "...", "machine": "...",
     "results": [{"proposer": "eagle3", "setting": "chain 5", "category": "all", "temperature": 0.0,
                  "batch_size": 1, "tau": 3.1, "speedup": 2.2, "tokens_per_s": ..., "vanilla_tokens_per_s": ...,
                  "alpha": [...], "greedy_identical": 1.0, "divergences": [...], "prompts": 16,
                  "max_new_tokens": 128, "lossy": false}, ...]}

Conventions (DESIGN.md §4): every answer stops at the target's EOS / stop ids (a token after a stop is never
emitted, so never counted); τ counts the bonus token; speedup is tokens/s over the faster of our vanilla loop and
HF ``generate`` measured in the same run, with all methods interleaved prompt by prompt; at T = 0 every prompt's
output is compared with vanilla, and a divergence is reported with the target's top-2 logit gap (a numerical tie
or a bug, ``eval.lossless``). Prompt lookup is always measured beside the drafter, so copy-heavy output (which
flatters every drafter) is visible. Rows are given for all prompts and for each category.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.certificate import TIE_GAP, compare_greedy
from infer.generate import GenerationStats, SpecConfig, generate_speculative, generate_vanilla
from infer.kernels.cpu_linear import install as install_cpu_linear
from infer.proposer import Proposer
from infer.proposers import PromptLookupProposer
from infer.sampling import SamplingParams
from models.target import TargetModel


@dataclass
class Candidate:
    proposer: str
    """Name in the report, e.g. "eagle3"."""
    setting: str
    """Tree setting in words, e.g. "chain 5" or "EAGLE-2 k4 d5 n16"."""
    make: Callable[[], Proposer]
    """Builds a fresh proposer (one per generate call)."""
    spec: SpecConfig | None = None


@dataclass
class MeasuredPrompt:
    ids: list[int]
    category: str = "all"


def stop_ids(tokenizer, model) -> tuple[int, ...]:
    """EOS of the tokenizer and of the model's generation config (a list for chat models such as Llama-3)."""
    eos = model.generation_config.eos_token_id
    ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    return tuple(sorted(i for i in ids if i is not None))


def prepare_target(target: TargetModel, log: Callable[[str], None] = print) -> None:
    """On the CPU, route the target's small-row matmuls to the layout measured faster here (infer/kernels/
    cpu_linear.py); vanilla, HF generate and every proposer then run the same target."""
    if target.device.type == "cpu":
        install_cpu_linear(target.model, log)


def hf_generate(model, prompt: list[int], params: SamplingParams, eos_ids: tuple[int, ...], **assist):
    """HF ``generate`` on one prompt with the same stop ids and sampling; (new tokens, seconds)."""
    kw = dict(max_new_tokens=params.max_new_tokens, eos_token_id=list(eos_ids) or None, pad_token_id=0)
    if params.greedy:
        kw["do_sample"] = False
    else:
        kw.update(do_sample=True, temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
    t = time.perf_counter()
    out = model.generate(torch.tensor([prompt], device=next(model.parameters()).device), **kw, **assist)
    seconds = time.perf_counter() - t
    new = out[0, len(prompt) :].tolist()
    stop = next((i for i, tok in enumerate(new) if tok in eos_ids), None)
    return (new if stop is None else new[: stop + 1]), seconds


def alpha_of(stats: list[GenerationStats]) -> list[float]:
    """Per-depth acceptance α_k aggregated over generate calls (DESIGN.md §4)."""
    depth = max((len(s.attempted_at_depth) for s in stats), default=0)
    att = [sum(s.attempted_at_depth[k] for s in stats if k < len(s.attempted_at_depth)) for k in range(depth)]
    acc = [sum(s.accepted_at_depth[k] for s in stats if k < len(s.accepted_at_depth)) for k in range(depth)]
    return [a / t if t else 0.0 for a, t in zip(acc, att)]


class _Tally:
    """Tokens, seconds, stats and identity counts of one method at one (T, bs), split by category."""

    def __init__(self) -> None:
        self.by_cat: dict[str, dict] = {}

    def add(self, cat: str, tokens: int, seconds: float, stats: GenerationStats | None, same=0, compared=0, div=None):
        t = self.by_cat.setdefault(cat, {"tokens": 0, "s": 0.0, "stats": [], "same": 0, "compared": 0, "div": []})
        t["tokens"] += tokens
        t["s"] += seconds
        if stats is not None:
            t["stats"].append(stats)
        t["same"] += same
        t["compared"] += compared
        t["div"] += div or []

    def merged(self, cat: str) -> dict:
        if cat != "all":
            return self.by_cat[cat]
        out = {"tokens": 0, "s": 0.0, "stats": [], "same": 0, "compared": 0, "div": []}
        for t in self.by_cat.values():
            for k in out:
                out[k] = out[k] + t[k]
        return out


def estimate_minutes(step_s: float, prompts: int, calls_per_prompt: int, max_new_tokens: int) -> float:
    """Upper bound of a report's length: every call runs to max_new_tokens at the vanilla step time."""
    return step_s * prompts * calls_per_prompt * max_new_tokens / 60


@torch.no_grad()
def measure(
    target: TargetModel,
    candidates: list[Candidate],
    prompts: list[MeasuredPrompt],
    eos_ids: tuple[int, ...],
    temperatures: tuple[float, ...] = (0.0,),
    max_new_tokens: int = 128,
    batch_sizes: tuple[int, ...] = (1,),
    include_prompt_lookup: bool = True,
    hf_assisted: dict[str, dict] | None = None,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Run vanilla, HF generate (bs 1) and every candidate on the same prompts; return result rows.

    ``hf_assisted``: name → extra ``generate`` kwargs (e.g. ``prompt_lookup_num_tokens``, ``assistant_model``),
    timed at bs 1 beside the rest (HF reports no τ, so those rows have ``tau`` None)."""
    if not prompts:
        raise ValueError("no prompts to measure: the prompt set is empty")
    prepare_target(target, log)
    if include_prompt_lookup:
        candidates = [Candidate("prompt lookup", "chain 10", lambda: PromptLookupProposer(num_draft=10))] + candidates
    for c in candidates:  # one-off costs (allocator, first kernels) outside the timed region
        generate_speculative(target, c.make(), [prompts[0].ids], SamplingParams(max_new_tokens=4), eos_ids)
    t = time.perf_counter()
    generate_vanilla(target, [prompts[0].ids], SamplingParams(max_new_tokens=8))
    step_s = (time.perf_counter() - t) / 8
    hf_assisted = hf_assisted or {}
    calls = len(temperatures) * sum(2 + len(candidates) + len(hf_assisted) for _ in batch_sizes)
    log(
        f"measure: {len(prompts)} prompts x {calls} generate calls of up to {max_new_tokens} tokens; "
        f"vanilla step {step_s * 1000:.0f} ms → at most ~{estimate_minutes(step_s, len(prompts), calls, max_new_tokens):.0f} min "
        f"(answers that stop at EOS take less)"
    )
    rows: list[dict] = []
    cats = sorted({p.category for p in prompts})
    for temp in temperatures:
        for bs in batch_sizes:
            # batches never mix categories, so each category's rows come from its own prompts only
            batches = [
                [p for p in prompts if p.category == cat][i : i + bs]
                for cat in cats
                for i in range(0, sum(p.category == cat for p in prompts), bs)
            ]
            van, hf = _Tally(), _Tally()
            acc = {c.proposer + c.setting: _Tally() for c in candidates}
            assisted = {name: _Tally() for name in hf_assisted} if bs == 1 else {}
            for bi, batch in enumerate(batches):
                cat, ids = batch[0].category, [p.ids for p in batch]
                params = SamplingParams(temperature=temp, max_new_tokens=max_new_tokens, seed=bi)
                ref = generate_vanilla(target, ids, params, eos_ids)
                van.add(cat, sum(map(len, ref.tokens)), ref.stats.total_s, ref.stats)
                if bs == 1:
                    toks, s = hf_generate(target.model, ids[0], params, eos_ids)
                    hf.add(cat, len(toks), s, None)
                    for name, kw in hf_assisted.items():
                        toks, s = hf_generate(target.model, ids[0], params, eos_ids, **kw)
                        same = int(toks == ref.tokens[0]) if params.greedy else 0
                        assisted[name].add(cat, len(toks), s, None, same, int(params.greedy))
                for c in candidates:
                    res = generate_speculative(target, c.make(), ids, params, eos_ids, spec=c.spec)
                    same, div = 0, []
                    if params.greedy:
                        for j, (x, y) in enumerate(zip(res.tokens, ref.tokens)):
                            if x == y:
                                same += 1
                                continue
                            cmp = compare_greedy(target.model, ids[j], y, x)
                            div.append(
                                {"batch": bi, "row": j, "position": cmp.first_divergence, "top2_gap": cmp.top2_gap}
                            )
                    acc[c.proposer + c.setting].add(
                        cat,
                        sum(map(len, res.tokens)),
                        res.stats.total_s,
                        res.stats,
                        same,
                        len(batch) if params.greedy else 0,
                        div,
                    )
            for cat in ["all", *cats] if len(cats) > 1 else ["all"]:
                v, h = van.merged(cat), hf.merged(cat)
                vanilla_tps = v["tokens"] / v["s"]
                hf_tps = h["tokens"] / h["s"] if h["s"] else None
                base = max(vanilla_tps, hf_tps or 0.0)
                n_prompts = sum(len(b) for b in batches if cat in ("all", b[0].category))
                # one vanilla step (a target forward over one token per row), the t_target(1) of DESIGN.md §4
                vanilla_step = sum(s.verify_s for s in v["stats"]) / max(1, sum(s.rounds for s in v["stats"]))
                common = {
                    "category": cat,
                    "temperature": temp,
                    "batch_size": bs,
                    "vanilla_new_tokens": v["tokens"],
                    "vanilla_tokens_per_s": base,
                    "our_vanilla_tokens_per_s": vanilla_tps,
                    "hf_generate_tokens_per_s": hf_tps,
                    "vanilla_mean_answer_tokens": v["tokens"] / n_prompts,
                    "prompts": n_prompts,
                    "max_new_tokens": max_new_tokens,
                }
                named = [(c.proposer, c.setting, acc[c.proposer + c.setting], c) for c in candidates]
                named += [(name, "HF generate", tally, None) for name, tally in assisted.items()]
                for proposer, setting, tally, c in named:
                    m = tally.merged(cat)
                    row = {
                        "proposer": proposer,
                        "setting": setting,
                        **common,
                        "new_tokens": m["tokens"],
                        "tokens_per_s": m["tokens"] / m["s"],
                        "speedup": (m["tokens"] / m["s"]) / base,
                        "greedy_identical": m["same"] / m["compared"] if m["compared"] else None,
                        "divergences": m["div"],
                        "lossy": bool(c and c.spec and c.spec.accept == "typical"),
                        # HF's assisted generation reports no rounds: no τ, α or step costs for those rows
                        "tau": None,
                        "alpha": [],
                        "predicted_speedup": None,
                        "step_ms": None,
                    }
                    if m["stats"]:
                        merged = GenerationStats(
                            new_tokens=sum(s.new_tokens for s in m["stats"]),
                            row_forwards=sum(s.row_forwards for s in m["stats"]),
                            rounds=sum(s.rounds for s in m["stats"]),
                            draft_s=sum(s.draft_s for s in m["stats"]),
                            verify_s=sum(s.verify_s for s in m["stats"]),
                            bookkeeping_s=sum(s.bookkeeping_s for s in m["stats"]),
                        )
                        row["tau"] = merged.tau
                        row["alpha"] = alpha_of(m["stats"])
                        row["predicted_speedup"] = merged.predicted_speedup(vanilla_step)
                        row["step_ms"] = {k: 1e3 * x for k, x in merged.step_costs().items()} | {
                            "vanilla": 1e3 * vanilla_step
                        }
                    rows.append(row)
                    _log_row(log, row)
    return rows


def _log_row(log: Callable[[str], None], row: dict) -> None:
    tau = "–" if row["tau"] is None else f"{row['tau']:.2f}"
    gi = row["greedy_identical"]
    log(
        f"T={row['temperature']} bs={row['batch_size']} [{row['category']}] {row['proposer']} ({row['setting']}): "
        f"τ {tau}, {row['tokens_per_s']:.1f} tok/s, speedup {row['speedup']:.2f}x"
        + (f", greedy identical {gi:.2f}" if gi is not None else "")
    )


def write_report(
    out_dir: str | Path, method: str, target_name: str, rows: list[dict], prompt_set: str = "", notes: str = ""
) -> None:
    """``report.json`` (schema above) and a markdown table ``report.md`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "method": method,
        "target": target_name,
        "prompt_set": prompt_set,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()} torch {torch.__version__} threads {torch.get_num_threads()}",
        "results": rows,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# {method} report",
        "",
        f"Target: `{target_name}`. Prompts: {prompt_set}. {notes}".strip(),
        "",
        "| category | proposer | setting | T | bs | τ | speedup | predicted | tokens/s | vanilla tokens/s | α | "
        "greedy identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gi = "–" if r["greedy_identical"] is None else f"{r['greedy_identical']:.2f}"
        if r["divergences"]:
            ties = sum(d["top2_gap"] is not None and d["top2_gap"] < TIE_GAP for d in r["divergences"])
            gi += f" ({len(r['divergences'])} diverged, {ties} at a numerical tie)"
        tau = "–" if r["tau"] is None else f"{r['tau']:.2f}"
        pred = "–" if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.2f}x"
        lines.append(
            f"| {r['category']} | {r['proposer']}{' (lossy)' if r['lossy'] else ''} | {r['setting']} | "
            f"{r['temperature']} | {r['batch_size']} | {tau} | {r['speedup']:.2f}x | {pred} | {r['tokens_per_s']:.1f} | "
            f"{r['vanilla_tokens_per_s']:.1f} | {' '.join(f'{a:.2f}' for a in r['alpha'][:8])} | {gi} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
