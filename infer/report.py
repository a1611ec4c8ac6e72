"""The τ + speedup report every recipe ends with (``report.json`` + ``report.md``).

Schema (shared by all recipes)::

    {"method": "eagle3", "target": "<name_or_path>", "created": "...", "machine": "...",
     "results": [{"proposer": "eagle3", "setting": "chain 5", "temperature": 0.0, "batch_size": 1,
                  "tau": 3.1, "speedup": 2.2, "tokens_per_s": ..., "vanilla_tokens_per_s": ...,
                  "alpha": [...], "greedy_identical": 1.0, "prompts": 16, "max_new_tokens": 128,
                  "lossy": false}, ...]}

Every report measures prompt lookup beside the drafter in the same run, so copy-heavy output (which
flatters every drafter) is visible. Speedups are against the faster of our vanilla loop and HF
``generate`` measured in the same run, with methods interleaved prompt by prompt.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.generate import GenerationStats, Proposer, SpecConfig, generate_speculative, generate_vanilla
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


def _hf_generate_seconds(model, prompt: list[int], params: SamplingParams) -> tuple[int, float]:
    kw = dict(
        max_new_tokens=params.max_new_tokens, min_new_tokens=params.max_new_tokens, pad_token_id=0, eos_token_id=None
    )
    if params.greedy:
        kw["do_sample"] = False
    else:
        kw.update(do_sample=True, temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
    t = time.perf_counter()
    out = model.generate(torch.tensor([prompt], device=next(model.parameters()).device), **kw)
    return out.shape[1] - len(prompt), time.perf_counter() - t


@torch.no_grad()
def measure(
    target: TargetModel,
    candidates: list[Candidate],
    prompts: list[list[int]],
    temperatures: tuple[float, ...] = (0.0,),
    max_new_tokens: int = 128,
    batch_sizes: tuple[int, ...] = (1,),
    include_prompt_lookup: bool = True,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Run vanilla, HF generate (bs 1) and every candidate on the same prompts; return result rows."""
    if include_prompt_lookup:
        candidates = [Candidate("prompt lookup", "chain 10", lambda: PromptLookupProposer(num_draft=10))] + candidates
    rows: list[dict] = []
    # warm-up outside the timed region
    generate_vanilla(target, [prompts[0]], SamplingParams(max_new_tokens=4))
    for temp in temperatures:
        for bs in batch_sizes:
            batches = [prompts[i : i + bs] for i in range(0, len(prompts) - bs + 1, bs)] or [prompts[:bs]]
            van_tok = van_s = hf_tok = hf_s = 0
            acc = {c.proposer + c.setting: [0, 0.0, [], 0, 0] for c in candidates}
            for bi, batch in enumerate(batches):
                params = SamplingParams(temperature=temp, max_new_tokens=max_new_tokens, seed=bi)
                van = generate_vanilla(target, batch, params)
                van_tok += sum(map(len, van.tokens))
                van_s += van.stats.total_s
                if bs == 1:
                    t, s = _hf_generate_seconds(target.model, batch[0], params)
                    hf_tok += t
                    hf_s += s
                for c in candidates:
                    res = generate_speculative(target, c.make(), batch, params, spec=c.spec)
                    a = acc[c.proposer + c.setting]
                    a[0] += sum(map(len, res.tokens))
                    a[1] += res.stats.total_s
                    a[2].append(res.stats)
                    if params.greedy:
                        a[3] += sum(x == y for x, y in zip(res.tokens, van.tokens))
                        a[4] += len(batch)
            vanilla_tps = van_tok / van_s
            base = max(vanilla_tps, hf_tok / hf_s if hf_s else 0.0)
            for c in candidates:
                tok, sec, stats, same, compared = acc[c.proposer + c.setting]
                merged = GenerationStats(
                    new_tokens=sum(s.new_tokens for s in stats), row_forwards=sum(s.row_forwards for s in stats)
                )
                att = [
                    sum(s.attempted_at_depth[k] for s in stats if k < len(s.attempted_at_depth))
                    for k in range(max(len(s.attempted_at_depth) for s in stats))
                ]
                accd = [
                    sum(s.accepted_at_depth[k] for s in stats if k < len(s.accepted_at_depth)) for k in range(len(att))
                ]
                row = {
                    "proposer": c.proposer,
                    "setting": c.setting,
                    "temperature": temp,
                    "batch_size": bs,
                    "tau": merged.tau,
                    "speedup": (tok / sec) / base,
                    "tokens_per_s": tok / sec,
                    "vanilla_tokens_per_s": base,
                    "our_vanilla_tokens_per_s": vanilla_tps,
                    "hf_generate_tokens_per_s": hf_tok / hf_s if hf_s else None,
                    "alpha": [a / t if t else 0.0 for a, t in zip(accd, att)],
                    "greedy_identical": same / compared if compared else None,
                    "prompts": sum(len(b) for b in batches),
                    "max_new_tokens": max_new_tokens,
                    "lossy": bool(c.spec and c.spec.accept == "typical"),
                }
                rows.append(row)
                log(
                    f"T={temp} bs={bs} {c.proposer} ({c.setting}): τ {row['tau']:.2f}, "
                    f"{row['tokens_per_s']:.1f} tok/s, speedup {row['speedup']:.2f}x"
                    + (f", greedy identical {row['greedy_identical']:.2f}" if compared else "")
                )
    return rows


def write_report(out_dir: str | Path, method: str, target_name: str, rows: list[dict], notes: str = "") -> None:
    """``report.json`` (schema above) and a markdown table ``report.md`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "method": method,
        "target": target_name,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()} torch {torch.__version__} threads {torch.get_num_threads()}",
        "results": rows,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# {method} report",
        "",
        f"Target: `{target_name}`. {notes}".strip(),
        "",
        "| proposer | setting | T | bs | τ | speedup | tokens/s | vanilla tokens/s | α | greedy identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gi = "–" if r["greedy_identical"] is None else f"{r['greedy_identical']:.2f}"
        lines.append(
            f"| {r['proposer']}{' (lossy)' if r['lossy'] else ''} | {r['setting']} | {r['temperature']} | "
            f"{r['batch_size']} | {r['tau']:.2f} | {r['speedup']:.2f}x | {r['tokens_per_s']:.1f} | "
            f"{r['vanilla_tokens_per_s']:.1f} | {' '.join(f'{a:.2f}' for a in r['alpha'][:8])} | {gi} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
