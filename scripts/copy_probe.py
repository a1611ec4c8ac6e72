"""Does a drafter copy? Its first draft, teacher-forced on the target's features over the target's greedy
answers to a prompt file, split by whether prompt lookup would have proposed the token there
(`train.losses.lookup_hits`: a 2-gram, else 1-gram match in the context).

    python -m scripts.copy_probe --prompts eval/prompts/specbench_style.jsonl models/smollm2_eagle3 [OTHER_DIR ...]

The drafter's class gives the first drafts (``first_drafts(target, sequence)``; the families with a teacher-forced
first draft have it).

Every drafter reads the same answers (the target's greedy text, first turns, up to ``--max-new-tokens``), so rows
compare. ``--repeats N`` also asks each drafter to continue N runs of random tokens (drawn from those answers) given
twice in a row, where a copying model is right and no language model can be: the row's ``repeat`` accuracy, with
the target's own top-1 over the same positions printed beside it. Accuracy here is what served greedy decoding
accepts at the first draft position of each round, counted at every answer position instead of once a round; it
does not depend on timing, so this may run beside other work.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from eval.prompts import chat_ids, load_prompt_file
from infer.families import load_drafter
from infer.generate import generate_vanilla
from infer.sampling import SamplingParams
from models.checkpoint import read_checkpoint
from models.loader import load_target
from models.target import TargetConfig, TargetModel
from models.tokenizer import load_tokenizer, stop_ids
from train.losses import lookup_hits


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafters", nargs="+", help="drafter checkpoint folders (the same target)")
    ap.add_argument("--prompts", required=True, help="Spec-Bench-format file (first turns are answered)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=0, help="random passages given twice (0: none)")
    ap.add_argument("--out", help="write the rows as JSON here too")
    args = ap.parse_args(argv)
    _, info = read_checkpoint(args.drafters[0])
    cfg = TargetConfig(name_or_path=info.target_name, aux_layer_ids=info.aux_layer_ids)
    tokenizer = load_tokenizer(cfg.name_or_path)
    target = load_target(args.drafters[0], cfg)
    answers = []  # (family, sequence, prompt length)
    for p in load_prompt_file(args.prompts):
        ids = chat_ids(tokenizer, [{"role": "user", "content": p.turns[0]}])
        result = generate_vanilla(target, [ids], SamplingParams(temperature=0.0), stop_ids(tokenizer, target.hf_model))
        answers.append((p.category, ids + list(result.tokens[0][: args.max_new_tokens]), len(ids)))
    repeats = random_repeats(sorted({t for _, seq, n in answers for t in seq[n:]}), args.repeats)
    if repeats:
        print(f"target top-1 over the second copies: {target_repeat_accuracy(target, repeats):.3f}")
    rows = []
    for path in args.drafters:
        drafter = load_drafter(path, target, tokenizer).eval()
        first_drafts = getattr(drafter, "first_drafts", None)  # a user's folder: say so rather than fail inside
        if first_drafts is None:
            raise SystemExit(f"{path}: {type(drafter).__name__} has no teacher-forced first draft (first_drafts)")
        tally: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for family, sequence, prompt_len in answers:
            drafts = first_drafts(target, sequence)
            hits = lookup_hits(torch.tensor([sequence]))[0]
            for t in range(max(prompt_len, 2), len(sequence)):
                right = int(drafts[t] == sequence[t])
                for key in ("all", family, "lookup right" if hits[t] else "lookup wrong"):
                    tally[key][0] += right
                    tally[key][1] += 1
        for sequence, start in repeats:
            right = (first_drafts(target, sequence)[start:] == torch.tensor(sequence[start:])).tolist()
            tally["repeat"][0] += sum(right)
            tally["repeat"][1] += len(right)
        row = {"drafter": path, **{k: {"accuracy": a / n, "positions": n} for k, (a, n) in tally.items()}}
        rows.append(row)
        print(path, " ".join(f"{k} {v['accuracy']:.3f} ({v['positions']})" for k, v in row.items() if k != "drafter"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "rows": rows}, f, indent=1)


def random_repeats(pool: list[int], n: int, length: int = 48, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (sequence, first scored position): ``length`` ids drawn from ``pool`` (the tokens of the target's
    answers, which a reduced draft vocabulary mostly names) given twice; scored from the second copy's third token on,
    where a 2-gram match exists (a draft for position t comes from the pair of token t-1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = [pool[i] for i in torch.randint(0, len(pool), (length,), generator=g).tolist()]
        out.append((ids + ids, length + 2))
    return out


@torch.no_grad()
def target_repeat_accuracy(target: TargetModel, repeats: list[tuple[list[int], int]]) -> float:
    """The target's own top-1 agreement with the copy over the positions `random_repeats` scores."""
    right = total = 0
    for sequence, start in repeats:
        top = target(torch.tensor([sequence], device=target.device)).logits[0].argmax(-1).cpu()
        right += int((top[start - 1 : -1] == torch.tensor(sequence[start:])).sum())
        total += len(sequence) - start
    return right / total


if __name__ == "__main__":
    main()
