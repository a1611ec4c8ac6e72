"""Runtime benchmark on the shipped reference target (prints measured numbers; not a unit test).

    python -m eval.bench_runtime                       # full run, writes docs/bench_runtime.{md,json}
    python -m eval.bench_runtime --prompts 4 --max-new-tokens 32 --out /tmp/bench   # smoke

What it measures, all in one process with the methods interleaved prompt by prompt:
1. bs = 1, T ∈ {0, 1}: our KV-cached vanilla loop vs HF ``generate`` (tokens/s); the faster of the
   two is the baseline of every speedup in the same table.
2. Our prompt lookup and draft-model proposers (chain and tree) vs HF assisted generation
   (``prompt_lookup_num_tokens``, ``assistant_model``) on the same prompts: τ, tokens/s, speedup.
3. Greedy identity with vanilla at T = 0 for every prompt and method (first divergence and the
   target's top-2 logit gap there when it happens).
4. bs ∈ {1, 4, 16}: vanilla vs speculative throughput (T = 0).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eval.lossless import compare_greedy
from infer.generate import GenerationStats, Proposer, generate_speculative, generate_vanilla
from infer.proposers import DraftModelProposer, PromptLookupProposer
from infer.sampling import SamplingParams
from infer.tree_search import DynamicTreeConfig
from models.target import TargetModel, load_tokenizer
from train.stdlib_corpus import heldout_prompts

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    method: str
    temperature: float
    batch_size: int
    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    stats: list[GenerationStats] = field(default_factory=list)
    identical: int = 0
    compared: int = 0
    ties: int = 0
    notes: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(1e-9, self.seconds)

    @property
    def tau(self) -> float | None:
        return self.tokens / self.forwards if self.forwards else None

    def alpha(self) -> list[float]:
        att, acc = [], []
        for s in self.stats:
            for k, (a, t) in enumerate(zip(s.accepted_at_depth, s.attempted_at_depth)):
                if k == len(att):
                    att.append(0)
                    acc.append(0)
                att[k] += t
                acc[k] += a
        return [a / t if t else 0.0 for a, t in zip(acc, att)]


def hf_generate(model, prompt: list[int], params: SamplingParams, **assist) -> tuple[list[int], float]:
    ids = torch.tensor([prompt])
    kw = dict(
        max_new_tokens=params.max_new_tokens, min_new_tokens=params.max_new_tokens, pad_token_id=0, eos_token_id=None
    )
    if params.greedy:
        kw.update(do_sample=False)
    else:
        kw.update(do_sample=True, temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
    t = time.perf_counter()
    out = model.generate(ids, **kw, **assist)
    return out[0, len(prompt) :].tolist(), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ROOT / "models" / "reference_target"))
    ap.add_argument("--draft", default=str(ROOT / "models" / "reference_draft"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--out", default=str(ROOT / "docs"))
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(args.target)
    target = TargetModel(AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32))
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    prompts = [p["prompt_ids"] for p in heldout_prompts(tokenizer, n=args.prompts)]
    print(
        f"target {args.target}: {sum(p.numel() for p in target.model.parameters()) / 1e6:.2f} M params; "
        f"draft {sum(p.numel() for p in draft.parameters()) / 1e6:.2f} M; {len(prompts)} held-out prompts; "
        f"max_new_tokens {args.max_new_tokens}; torch threads {torch.get_num_threads()}"
    )

    ours: dict[str, callable] = {
        "prompt lookup (chain 10)": lambda: PromptLookupProposer(num_draft=10, max_ngram=3),
        "prompt lookup (tree 3x6)": lambda: PromptLookupProposer(num_draft=6, max_ngram=3, num_candidates=3),
        "draft model (chain 4)": lambda: DraftModelProposer(draft, k=4),
        "draft model (EAGLE-2 tree k4 d5 n16)": lambda: DraftModelProposer(
            draft, tree=DynamicTreeConfig(top_k=4, depth=5, total_tokens=16)
        ),
    }
    hf_assisted = {
        "HF prompt lookup (10)": dict(prompt_lookup_num_tokens=10, max_matching_ngram_size=2),
        "HF assisted (draft model)": dict(assistant_model=draft),
    }
    results: list[dict] = []
    lines = [
        f"# Runtime benchmark ({time.strftime('%Y-%m-%d')})",
        "",
        f"Machine: {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
        f"fp32. Target `{Path(args.target).name}`, draft `{Path(args.draft).name}`, {len(prompts)} held-out "
        f"prompts, max_new_tokens {args.max_new_tokens}. Speedup = tokens/s over the faster vanilla "
        "(ours or HF generate) in the same run; τ includes the bonus token.",
        "",
    ]

    for temp in [float(t) for t in args.temperatures.split(",")]:
        params = SamplingParams(temperature=temp, max_new_tokens=args.max_new_tokens, seed=0)
        rows = {m: Row(m, temp, 1) for m in ["vanilla (ours)", "HF generate", *ours, *hf_assisted]}
        # warm-up (allocator, lazy init) outside the timed loop
        generate_vanilla(target, [prompts[0]], SamplingParams(max_new_tokens=4))
        for i, prompt in enumerate(prompts):
            p_seeded = SamplingParams(**{**params.__dict__, "seed": i})
            van = generate_vanilla(target, [prompt], p_seeded)
            r = rows["vanilla (ours)"]
            r.tokens += len(van.tokens[0])
            r.seconds += van.stats.total_s
            r.forwards += van.stats.row_forwards
            toks, sec = hf_generate(target.model, prompt, p_seeded)
            rows["HF generate"].tokens += len(toks)
            rows["HF generate"].seconds += sec
            for name, make in ours.items():
                res = generate_speculative(target, make(), [prompt], p_seeded)
                r = rows[name]
                r.tokens += len(res.tokens[0])
                r.seconds += res.stats.total_s
                r.forwards += res.stats.row_forwards
                r.stats.append(res.stats)
                if params.greedy:
                    cmp = compare_greedy(target.model, prompt, van.tokens[0], res.tokens[0])
                    r.compared += 1
                    r.identical += int(cmp.identical)
                    r.ties += int(cmp.numerical_tie)
                    if not cmp.identical:
                        print(
                            f"  [{name}] prompt {i}: first divergence at token {cmp.first_divergence}, "
                            f"target top-2 gap {cmp.top2_gap:.3g} ({'numerical tie' if cmp.numerical_tie else 'BUG'})"
                        )
            for name, kw in hf_assisted.items():
                toks, sec = hf_generate(target.model, prompt, p_seeded, **kw)
                rows[name].tokens += len(toks)
                rows[name].seconds += sec
            print(f"  T={temp} prompt {i + 1}/{len(prompts)} done", flush=True)
        base = max(rows["vanilla (ours)"].tokens_per_s, rows["HF generate"].tokens_per_s)
        vanilla_step = rows["vanilla (ours)"].seconds / max(1, rows["vanilla (ours)"].forwards)
        lines += [
            f"## bs = 1, T = {temp}",
            "",
            "| method | τ | tokens/s | speedup | α (per depth) | predicted | efficiency | greedy identical |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in rows.items():
            speed = r.tokens_per_s / base
            pred = eff = None
            if r.stats:
                agg = GenerationStats(
                    new_tokens=r.tokens,
                    row_forwards=r.forwards,
                    rounds=sum(s.rounds for s in r.stats),
                    draft_s=sum(s.draft_s for s in r.stats),
                    verify_s=sum(s.verify_s for s in r.stats),
                )
                pred = agg.predicted_speedup(vanilla_step)
                eff = (r.tokens_per_s / rows["vanilla (ours)"].tokens_per_s) / pred
            alpha = r.alpha()
            ident = f"{r.identical}/{r.compared}" + (f" ({r.ties} ties)" if r.ties else "") if r.compared else "–"
            lines.append(
                f"| {name} | {r.tau:.2f} | {r.tokens_per_s:.1f} | {speed:.2f}x | "
                f"{' '.join(f'{a:.2f}' for a in alpha[:6]) or '–'} | "
                f"{f'{pred:.2f}x' if pred else '–'} | {f'{eff:.2f}' if eff else '–'} | {ident} |"
                if r.tau is not None
                else f"| {name} | – | {r.tokens_per_s:.1f} | {speed:.2f}x | – | – | – | – |"
            )
            results.append(
                {
                    "method": name,
                    "temperature": temp,
                    "batch_size": 1,
                    "tau": r.tau,
                    "tokens_per_s": r.tokens_per_s,
                    "speedup": speed,
                    "alpha": alpha,
                    "vanilla_tokens_per_s": base,
                    "predicted_speedup": pred,
                    "efficiency": eff,
                    "greedy_identical": (r.identical / r.compared) if r.compared else None,
                    "prompts": len(prompts),
                    "max_new_tokens": args.max_new_tokens,
                }
            )
        lines.append("")
        print("\n".join(lines[-len(rows) - 4 :]), flush=True)

    # ---- batch throughput (T = 0)
    lines += [
        "## Throughput by batch size (T = 0)",
        "",
        "| batch | method | τ | tokens/s | speedup vs vanilla bs |",
        "|---|---|---|---|---|",
    ]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        batch = [prompts[i % len(prompts)] for i in range(bs)]
        van = generate_vanilla(target, batch, params)
        specs: dict[str, Proposer] = {
            "prompt lookup (chain 10)": PromptLookupProposer(num_draft=10, max_ngram=3),
            "draft model (chain 4)": DraftModelProposer(draft, k=4),
        }
        lines.append(f"| {bs} | vanilla (ours) | 1.00 | {van.stats.tokens_per_s:.1f} | 1.00x |")
        results.append(
            {
                "method": "vanilla (ours)",
                "temperature": 0.0,
                "batch_size": bs,
                "tau": 1.0,
                "tokens_per_s": van.stats.tokens_per_s,
                "speedup": 1.0,
            }
        )
        for name, prop in specs.items():
            res = generate_speculative(target, prop, batch, params)
            same = sum(a == b for a, b in zip(res.tokens, van.tokens))
            sp = res.stats.tokens_per_s / van.stats.tokens_per_s
            lines.append(
                f"| {bs} | {name} | {res.stats.tau:.2f} | {res.stats.tokens_per_s:.1f} | {sp:.2f}x "
                f"(greedy identical {same}/{bs}) |"
            )
            results.append(
                {
                    "method": name,
                    "temperature": 0.0,
                    "batch_size": bs,
                    "tau": res.stats.tau,
                    "tokens_per_s": res.stats.tokens_per_s,
                    "speedup": sp,
                    "vanilla_tokens_per_s": van.stats.tokens_per_s,
                    "greedy_identical": same / bs,
                }
            )
        print("\n".join(lines[-3:]), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_runtime.md").write_text("\n".join(lines) + "\n")
    (out / "bench_runtime.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out / 'bench_runtime.md'} and {out / 'bench_runtime.json'}")


if __name__ == "__main__":
    main()
