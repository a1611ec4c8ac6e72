"""Audit of self-distilled data: is every answer the target's own greedy text?

A teacher-forced pass over each conversation gives, for every answer token, how far its logit lies below the top
one (the gap). A greedy answer's tokens are the argmax wherever it was written, so its gaps are zero up to the
rounding of the dtype and batch it was written in; an answer corrupted while it was written (a cache that misaligned
its rows, a dtype that broke down) leaves the argmax at the point of corruption and stays away from it. The last
token of an answer is not checked: the template closes an answer cut at its token cap with an end token the target
did not choose.

The answers are stored as text, and the text re-encodes to the tokenizer's own split, which is not always the one
the target wrote: SmolLM2 writes "\\n\\n" before a numbered list, and the text encodes as "\\n", "\\n"; teacher-forced
on that split, the target's next choice lies far from the list's "1" (gaps of 2 to 6). So where a gap is over the
threshold and a token the target could have chosen there, or up to a few tokens before, spells the start of the text
that follows, that split is replayed and the check goes on from it (`resplit`, counted per conversation).

    python -m train.data.audit --target smollm2-135m-instruct --data train/shipped_data/smollm2-135m-instruct-v2/answers \\
        [--threshold 1.0] [--drop]

``--drop`` rewrites each shard without its failing conversations as soon as it is audited (atomically; their ids
and gaps go to the report), so that the build that wrote them answers them again on its next run (it answers every
job no shard holds). The report ends each file with a closing line; a rerun skips the files it closed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from train.data.dataset import resolve_span_method, tokenize_conversation
from train.data.files import read_shard, rewrite_shard

THRESHOLD = 1.0
"""Logit gap (top logit minus the token's) above which a token is not the target's greedy choice. Audited in bf16,
SmolLM2's greedy answers written in fp32 or bf16 at batch 48 show gaps of at most 0.875 once the target's own token
split is replayed; answers a misaligned cache had corrupted show gaps up to 30, most above 8 (`docs/decisions.md`,
"A join misaligned the target's cache"). A conversation dropped wrongly costs only its answering again."""


def answer_positions(loss_mask: list[int]) -> list[int]:
    """Positions p whose next token p + 1 is an answer token, the last token of each answer left out."""
    out = []
    for i in range(1, len(loss_mask)):
        if loss_mask[i] and i + 1 < len(loss_mask) and loss_mask[i + 1]:
            out.append(i - 1)
    return out


RESPLITS = 64
"""Most re-splits replayed per conversation (a bound on the forward passes one conversation can cost)."""
LOOKBACK = 4
"""Checked positions before a large gap searched for the target's own split of the text (`_resplit_behind`)."""


@torch.no_grad()
def token_logits(model, ids: list[int], positions: list[int], device: str = "cpu") -> torch.Tensor:
    """The target's logits (fp32, on the CPU) at each of ``positions`` of one teacher-forced sequence."""
    x = torch.tensor([ids], device=device)
    hidden = model.model(input_ids=x).last_hidden_state[0, positions]
    return model.lm_head(hidden).float().cpu()


def resplit(tokenizer, ids: list[int], mask: list[int], p: int, choice: int) -> tuple[list[int], list[int]] | None:
    """The sequence as the target would have split the text after position ``p``, or None where it would not.

    The answerer stores text, and re-encoding it need not give back the tokens the target chose: it may emit " the"
    then "ft" where the text encodes as " theft", or "\\n\\n" where the text encodes as "\\n", "\\n". Where the target's
    choice at ``p`` spells the start of the answer text that follows (compared in the tokenizer's own byte-level
    token strings), that choice is put in place and the rest of this answer encoded again after it."""
    end = p + 1
    while end < len(ids) and mask[end]:
        end += 1
    rest = "".join(tokenizer.convert_ids_to_tokens(ids[p + 1 : end]))
    mine = tokenizer.convert_ids_to_tokens(choice)
    if not rest.startswith(mine) or len(mine) >= len(rest):
        return None
    after = rest[len(mine) :]
    new = tokenizer(tokenizer.convert_tokens_to_string([after]), add_special_tokens=False)["input_ids"]
    if "".join(tokenizer.convert_ids_to_tokens(new)) != after:  # the choice ended inside a character: not replayable
        return None
    return ids[: p + 1] + [choice] + new + ids[end:], mask[: p + 1] + [1] * (1 + len(new)) + mask[end:]


def _resplit_behind(tokenizer, ids, mask, positions, logits, k, threshold) -> tuple[int, tuple | None]:
    """A replayable split (`resplit`) at checked position ``k`` or up to ``LOOKBACK`` positions before it in the same
    answer, the nearest first, by a token within ``threshold`` of the top logit there (what the target could have
    chosen, given rounding): where the text encodes "\\n", "\\n" the target may have chosen "\\n\\n" in a near tie,
    and the wrong context then shows as a large gap one or two tokens later."""
    for j in range(k, max(k - LOOKBACK - 1, -1), -1):
        if positions[k] - positions[j] != k - j:  # an earlier answer
            break
        values, tokens = (t.tolist() for t in logits[j].topk(min(8, logits.shape[1])))
        for value, token in zip(values, tokens):
            if values[0] - value > threshold:
                break
            if token != ids[positions[j] + 1]:
                split = resplit(tokenizer, ids, mask, positions[j], token)
                if split is not None:
                    return j, split
    return k, None


def audit_row(model, tokenizer, row: dict, span_method: str, threshold: float, device: str = "cpu") -> dict:
    """The row's id, answer tokens checked, the largest gap, the first answer token above ``threshold`` and how many
    times the target's own split of the text was replayed (`resplit`)."""
    ids, mask = tokenize_conversation(tokenizer, row["messages"], span_method)
    gaps: list[float] = []  # of the checked positions, in order
    resplits, start, failed = 0, 0, False
    while True:
        positions = [p for p in answer_positions(mask) if p >= start]
        logits = token_logits(model, ids, positions, device) if positions else torch.zeros(0, 1)
        top = logits.max(-1).values
        nxt = torch.tensor([ids[p + 1] for p in positions], dtype=torch.long)
        row_gaps = (top - logits.gather(1, nxt[:, None])[:, 0]).tolist() if positions else []
        for k, gap in enumerate(row_gaps):
            if gap <= threshold or failed:  # past a failure no replay changes the verdict: the rest is only counted
                continue
            j, split = _resplit_behind(tokenizer, ids, mask, positions, logits, k, threshold)
            if split is not None and resplits < RESPLITS:
                (ids, mask), resplits, start = split, resplits + 1, positions[j]
                gaps += row_gaps[:j]
                break
            failed = True
        else:
            gaps += row_gaps
            break
    above = [k for k, g in enumerate(gaps) if g > threshold]
    return {
        "id": row.get("id"),
        "checked": len(gaps),
        "max_gap": round(max(gaps), 3) if gaps else 0.0,
        "above": len(above),
        "first_above": above[0] if above else None,
        "resplits": resplits,
    }


def shard_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(p)
        files += [p] if p.is_file() else sorted(p.rglob("*.jsonl.gz"))  # a folder: the answerer's shards
    return files


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="HF checkpoint directory or reference target name")
    ap.add_argument("--data", required=True, nargs="+", help="shard files (.jsonl.gz) or folders of them")
    ap.add_argument("--threshold", type=float, default=THRESHOLD)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--report", type=Path, help="one json line per conversation (default: <first data path>.audit.jsonl)"
    )
    ap.add_argument("--drop", action="store_true", help="rewrite the shards without the conversations that fail")
    args = ap.parse_args(argv)

    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.reference import resolve_target

    path = resolve_target(args.target)
    tokenizer = AutoTokenizer.from_pretrained(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(device).eval()
    span_method = resolve_span_method(tokenizer)
    files = shard_files(args.data)
    report = args.report or Path(str(args.data[0]).rstrip("/") + ".audit.jsonl")
    # resumable: a file whose closing line is in the report was audited (and, with --drop, rewritten) already
    lines = [json.loads(line) for line in report.open()] if report.exists() else []
    done = {r["file"]: r for r in lines if "audited" in r}
    total = sum(r["audited"] for r in done.values())
    bad = sum(r["failing"] for r in done.values())
    with report.open("a") as out:
        for f in tqdm([f for f in files if str(f) not in done], desc="audit: files"):
            rows = read_shard(f)
            failed = set()
            for i, row in enumerate(rows):
                result = {"file": str(f), "row": i} | audit_row(
                    model, tokenizer, row, span_method, args.threshold, device
                )
                out.write(json.dumps(result) + "\n")
                if result["above"]:
                    failed.add(i)
            if args.drop and failed:
                rewrite_shard(f, [r for i, r in enumerate(rows) if i not in failed])
            # the file's closing line, written once it is audited (and rewritten): a rerun skips the file
            out.write(json.dumps({"file": str(f), "audited": len(rows), "failing": len(failed), "dropped": args.drop}))
            out.write("\n")
            out.flush()
            total, bad = total + len(rows), bad + len(failed)
    summary = {"conversations": total, "failing": bad, "threshold": args.threshold, "report": str(report)}
    if args.drop:
        summary["dropped"] = bad
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    result = main()
    sys.exit(1 if result["failing"] and "dropped" not in result else 0)  # failures left in place fail the command
