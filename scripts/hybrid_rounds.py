"""Where the hybrid's accepted drafts come from: its rounds split by the kind of prompt-lookup match each had, with
the drafts accepted a round and how many of them prompt lookup's chain alone held (`infer.hybrid.RoundAccount`).

    python -m scripts.hybrid_rounds models/smollm2_eagle3 --prompts eval/prompts/specbench_style.jsonl --tree 2 2 4

The hybrid is the report's (the drafter's EAGLE-2 tree and prompt lookup 15, lookup alone at 3-gram matches),
priced as the report prices it: the verify curve timed here, the drafting and bookkeeping time a round from a first
unpriced answer. Answers are the first turns, greedy. The split does not depend on timing except through the
pricing, so it reads the same on a busy machine within the pricing's own noise; the tokens/s printed do not.
"""

from __future__ import annotations

import argparse
import dataclasses

from eval.cost_curve import verify_costs
from eval.prompts import chat_ids, load_prompt_file
from eval.report_config import ReportConfig
from infer.families import family_of, load_drafter
from infer.generate import generate_speculative
from infer.hybrid import HybridProposer, RoundAccount
from infer.pricing import ChainAcceptance, VerifyPrice
from infer.sampling import SamplingParams
from infer.serving import prepare_target
from models.checkpoint import read_checkpoint
from models.loader import load_target
from models.target import TargetConfig
from models.tokenizer import load_tokenizer, stop_ids

VERIFY_NODES = tuple(range(1, 33))
"""Node counts the verify curve is timed at (the priced union never verifies more)."""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter", help="drafter checkpoint folder (a family with an EAGLE-2 tree)")
    ap.add_argument("--prompts", required=True, help="Spec-Bench-format file (first turns are answered)")
    ap.add_argument("--tree", type=int, nargs=3, default=[2, 2, 4], metavar=("TOP_K", "DEPTH", "NODES"))
    ap.add_argument("--lookup", type=int, default=15, help="prompt lookup's chain length in the hybrid")
    ap.add_argument("--alone-match", type=int, default=3, help="lookup alone at matches this long (0: never)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="fastest", help="the target's dtype (fastest: the precision policy's)")
    args = ap.parse_args(argv)
    _, info = read_checkpoint(args.drafter)
    cfg = TargetConfig(name_or_path=info.target_name, aux_layer_ids=info.aux_layer_ids, dtype=args.dtype)
    tokenizer = load_tokenizer(cfg.name_or_path)
    target = load_target(args.drafter, cfg)
    prepare_target(target, log=lambda msg: None)
    drafter = load_drafter(args.drafter, target, tokenizer).eval()
    k, depth, nodes = args.tree
    settings = dataclasses.replace(ReportConfig(), chain_k=0, tree_top_k=k, tree_depth=depth, tree_total_tokens=nodes)
    learned = family_of(drafter).report_proposers(drafter, settings, lambda make, n: n)[-1]
    if learned.setting != settings.tree_name:
        raise SystemExit(f"{args.drafter}: its family drafts no EAGLE-2 tree")
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in load_prompt_file(args.prompts)]
    eos = stop_ids(tokenizer, target.hf_model)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)

    def hybrid(**kw) -> HybridProposer:
        return HybridProposer(learned.make(), num_draft=args.lookup, budget=1 << 10, alone_match=args.alone_match, **kw)

    first = generate_speculative(target, hybrid(), prompts[:1], params, eos).stats  # unpriced: what a round costs
    rounds = max(1, first.rounds)
    curve = verify_costs(target, prompts[0], VERIFY_NODES, 5, aux=True)
    price = VerifyPrice(
        {n: 1e3 * s for n, s in curve.items()}, 1e3 * first.draft_s / rounds, 1e3 * first.bookkeeping_s / rounds
    )
    account, tally = RoundAccount(), ChainAcceptance()
    tokens, seconds, forwards = 0, 0.0, 0
    for ids in prompts:
        stats = generate_speculative(
            target, hybrid(price=price, chain_acceptance=tally, account=account), [ids], params, eos
        ).stats
        tokens, seconds, forwards = tokens + stats.new_tokens, seconds + stats.total_s, forwards + stats.row_forwards
    print(
        f"{args.drafter}, EAGLE-2 k{k} d{depth} n{nodes} + lookup {args.lookup}, priced (drafting "
        f"{price.draft_ms:.2f} ms, bookkeeping {price.overhead_ms:.2f} ms a round; verify ms "
        + " ".join(f"{n}:{price.verify_ms[n]:.1f}" for n in (1, 4, 8, 16, 32))
        + f"): {len(prompts)} answers, τ {tokens / max(1, forwards):.3f}, {tokens / seconds:.1f} tokens/s"
    )
    total = sum(account.rounds.values())
    print("| round kind | share | drafts accepted a round | prompt lookup's chain alone |")
    print("|---|---|---|---|")
    for kind, n in sorted(account.rounds.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {n / total:.0%} | {account.accepted[kind] / n:.2f} | {account.lookup[kind] / n:.2f} |")


if __name__ == "__main__":
    main()
