"""Audit of self-distilled data: is every answer the target's own greedy text?

A teacher-forced pass over each conversation gives, for every answer token, how far its logit lies below the top
one (the gap). A greedy answer's tokens are the argmax wherever it was written, so its gaps are zero up to the
rounding of the dtype and batch it was written in; an answer corrupted while it was written (a cache that misaligned
its rows, a dtype that broke down) leaves the argmax at the point of corruption and stays away from it. The last
token of an answer is not checked: the template closes an answer cut at its token cap with an end token the target
did not choose. An answer cut mid-word can also re-tokenize differently at its last word (seen on an 8-token cap;
none of the target-written tier's audited conversations failed that way).

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
SmolLM2's greedy answers written in fp32 or bf16 at batch 48 showed gaps of at most 0.875; answers a misaligned cache
had corrupted showed 1.06 to 30, most above 8, and kept their gaps when audited in fp32 (`docs/decisions.md`, "A join
misaligned the target's cache"). A conversation dropped wrongly costs only its answering again."""


def answer_positions(loss_mask: list[int]) -> list[int]:
    """Positions p whose next token p + 1 is an answer token, the last token of each answer left out."""
    out = []
    for i in range(1, len(loss_mask)):
        if loss_mask[i] and i + 1 < len(loss_mask) and loss_mask[i + 1]:
            out.append(i - 1)
    return out


@torch.no_grad()
def token_gaps(model, ids: list[int], positions: list[int], device: str = "cpu") -> torch.Tensor:
    """Gap (top logit minus the next token's) at each of ``positions`` of one teacher-forced sequence."""
    x = torch.tensor([ids], device=device)
    hidden = model.model(input_ids=x).last_hidden_state[0, positions]
    logits = model.lm_head(hidden).float().cpu()
    nxt = torch.tensor([ids[p + 1] for p in positions])
    return logits.max(-1).values - logits.gather(1, nxt[:, None])[:, 0]


def audit_row(model, tokenizer, row: dict, span_method: str, threshold: float, device: str = "cpu") -> dict:
    """The row's id, answer tokens checked, the largest gap and the first answer token above ``threshold``."""
    ids, mask = tokenize_conversation(tokenizer, row["messages"], span_method)
    positions = answer_positions(mask)
    gaps = token_gaps(model, ids, positions, device) if positions else torch.zeros(0)
    above = (gaps > threshold).nonzero()[:, 0].tolist()
    return {
        "id": row.get("id"),
        "checked": len(positions),
        "max_gap": round(float(gaps.max()), 3) if len(gaps) else 0.0,
        "above": len(above),
        "first_above": above[0] if above else None,
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
