"""Runtime benchmark of the drafter-free proposers on the reference target (prints measured numbers; not a test).

    python -m eval.bench_runtime --out outputs/bench                 # SmolLM2, chat + code prompts, T 0 and 1, bs 1/4
    python -m eval.bench_runtime --prompts 2 --max-new-tokens 32 --out /tmp/bench --batch-sizes 1   # smoke

Everything goes through the one timing loop (``eval.measure``): our vanilla loop and HF ``generate`` (the faster is
the baseline), prompt lookup as a chain and a tree, the small draft model when given (``--draft``), and HF's own
assisted generation (``prompt_lookup_num_tokens``, ``assistant_model``) on the same prompts, interleaved prompt by
prompt; answers stop at the target's EOS; greedy identity with vanilla is checked for every prompt at T = 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from eval.measure import Candidate, MeasuredPrompt, measure
from eval.prompts import CATEGORIES, builtin_prompts, chat_ids
from eval.report_md import write_report
from infer.forward_cost import quiet_routing
from infer.proposers import DraftModelProposer, PromptLookupProposer
from infer.serving import serving_targets
from infer.tree_search import DynamicTreeConfig
from models.target import TargetConfig, TargetModel
from models.tokenizer import load_tokenizer, stop_ids


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="short name, folder or hub id")
    ap.add_argument("--draft", default=None, help="small draft model sharing the tokenizer (folder or hub id)")
    ap.add_argument("--categories", default="chat,code", help=f"built-in prompt categories, of {CATEGORIES}")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--out", type=Path, default=Path("outputs") / "bench_runtime")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    ap.add_argument("--dtype", default="fastest", help="target dtype (fastest: the precision policy's serving choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(args.target)
    target = TargetModel.from_config(
        TargetConfig(name_or_path=args.target, dtype=args.dtype, device="cpu"), "serve", prepare=quiet_routing
    )
    target, vanilla_target = serving_targets(target)
    prompts = [
        MeasuredPrompt(chat_ids(tokenizer, [{"role": "user", "content": p.turns[0]}]), p.category)
        for c in args.categories.split(",")
        for p in builtin_prompts(c, args.prompts)
    ]
    candidates = [
        Candidate("prompt lookup", "tree 3x6", lambda: PromptLookupProposer(num_draft=6, num_candidates=3)),
    ]
    hf_assisted = {"HF prompt lookup (10)": dict(prompt_lookup_num_tokens=10, max_matching_ngram_size=2)}
    if args.draft:
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=target.dtype).eval()
        tree = DynamicTreeConfig(top_k=3, depth=4, total_tokens=8)
        candidates += [
            Candidate("draft model", "chain 3", lambda: DraftModelProposer(draft, k=3)),
            Candidate("draft model", "EAGLE-2 k3 d4 n8", lambda: DraftModelProposer(draft, tree=tree)),
        ]
        hf_assisted["HF assisted (draft model)"] = dict(assistant_model=draft)
    rows = measure(
        target,
        candidates,
        prompts,
        stop_ids(tokenizer, target.model),
        temperatures=tuple(float(t) for t in args.temperatures.split(",")),
        max_new_tokens=args.max_new_tokens,
        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
        hf_assisted=hf_assisted,
        vanilla_target=vanilla_target,
    )
    prompt_set = f"built-in {args.categories}"
    write_report(
        args.out, "runtime benchmark", args.target, rows, prompt_set=prompt_set, precision=target.precision.as_dict()
    )
    print(f"wrote {args.out / 'report.md'} and {args.out / 'report.json'}")


if __name__ == "__main__":
    main()
