"""Chat training data without hubs: prompts the target writes or templates build, answered by the target itself.

Three kinds of prompts (DESIGN.md §5, REFERENCE.md "Data without hubs"):

- ``magpie``: the target, given only its template up to an open user turn (system turn + ``<|im_start|>user\\n`` for
  ChatML), writes a user request (Magpie, Xu et al. 2024). Sampled (T = 1, top-p 0.95), then filtered: the request
  must end with the end-of-turn token, be 16–1,200 characters, hold no template text, and not repeat an earlier
  request (normalized text, or the same first eight words).
- ``code``: templated tasks around real functions of the held-in (train-split) standard-library files: explain,
  document, review, complete, rewrite, test. The code is in the prompt, as users paste it.
- multi-turn: a share of the conversations gets a second user turn (a follow-up from a fixed list); its answer is
  generated after, and conditioned on, the target's own first answer.

Then the target answers every user turn (self-distillation through `train.answerer`, batched and length-bucketed,
greedy by default: the T = 0 report measures the target's greedy text). Requests are appended per batch to a jsonl
(flushed and fsynced; a torn last line is dropped); answers go to one shard per finished batch. Both resume, so an
interrupted build continues where it stopped. Requests use one seed per batch; greedy answers do not depend on how
the rows were batched (up to rounding-level ties). Under ``accelerate launch`` the ranks share the answering
(disjoint shards) and the main process merges.
A held-out share of the magpie prompts becomes the ``chat`` evaluation set instead (never answered for training).

    python -m train.chat_data --target smollm2-135m-instruct --out outputs/smollm2-data --magpie 2000 --code 1500
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gzip
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eval.measure import prepare_target
from eval.stdlib_corpus import split_files, stdlib_files
from infer.generate import generate_vanilla
from infer.sampling import SamplingParams
from models.target import TargetModel
from train.answerer import AnswerConfig, Job, answer, rank_and_world, read_shards
from train.data import end_of_turn_token_ids, render

CODE_TEMPLATES = (
    "Explain what the following Python function does.\n\n```python\n{code}\n```",
    "Write a docstring for this Python function.\n\n```python\n{code}\n```",
    "Review this Python function and suggest improvements.\n\n```python\n{code}\n```",
    "Rewrite this Python function so that it is easier to read.\n\n```python\n{code}\n```",
    "Write pytest unit tests for this function.\n\n```python\n{code}\n```",
    "Complete the body of this Python function.\n\n```python\n{head}\n```",
    "What could go wrong when calling `{name}`? Here is its code:\n\n```python\n{code}\n```",
)
FOLLOW_UPS = (
    "Can you explain that in simpler terms?",
    "Can you give me a concrete example?",
    "Please make your answer shorter.",
    "What are the most common mistakes to avoid here?",
    "Can you summarize that as a list of key points?",
    "Thanks! Could you go into a bit more detail?",
)


@dataclass
class BuildConfig:
    magpie: int = 2000
    """Self-synthesised requests to keep (training + held-out chat prompts)."""
    heldout_chat: int = 64
    """Of those, kept out of training as the ``chat`` evaluation prompts."""
    code: int = 1500
    """Templated code tasks from held-in stdlib functions."""
    multi_turn: float = 0.2
    """Share of conversations that get a second user turn."""
    answer_temperature: float = 0.0
    """Temperature of the target's answers (0 = greedy)."""
    max_new_tokens: int = 384
    """Cap per answer; answers that hit it are kept and counted."""
    batch_size: int = 32
    """Rows per generate call."""
    answer_limit: int = 0
    """Answer only the first N training conversations (0 = all); the order is a seeded mix of the kinds, so a limit
    keeps their proportions, and a later build with a higher limit (or 0) answers the rest."""
    seed: int = 0


def _append_jsonl(path: Path, rows: list[dict]) -> None:
    """Append whole rows and flush them to disk: a crash loses at most the batch being generated."""
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        f.flush()
        os.fsync(f.fileno())


def _read_jsonl(path: Path) -> list[dict]:
    """Rows of a jsonl written by `_append_jsonl`; a torn last line (a crash mid-write) is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def user_turn_prefix(tokenizer) -> str:
    """The template's text up to the content of a first user turn (default system turn included)."""
    marker = "\x00MAGPIE\x00"
    text = render(tokenizer, [{"role": "user", "content": marker}])
    return text[: text.index(marker)]


class RequestFilter:
    """Keeps a synthesised request when it is complete, plausible, and new (see the module docstring)."""

    def __init__(self, seen: list[str] = ()) -> None:
        self.full: set[str] = set()
        self.head: set[str] = set()
        self.rejected: dict[str, int] = {"truncated": 0, "length": 0, "template_text": 0, "duplicate": 0}
        for s in seen:
            self.add(s)

    def add(self, text: str) -> None:
        n = normalize(text)
        self.full.add(n)
        self.head.add(" ".join(n.split()[:8]))

    def keep(self, text: str, complete: bool) -> bool:
        n = normalize(text)
        reason = None
        if not complete:
            reason = "truncated"
        elif not 16 <= len(text.strip()) <= 1200:
            reason = "length"
        elif "<|" in text or "|>" in text or n.startswith(("assistant", "user", "system")):
            reason = "template_text"
        elif n in self.full or " ".join(n.split()[:8]) in self.head:
            reason = "duplicate"
        if reason:
            self.rejected[reason] += 1
            return False
        self.add(text)
        return True


def code_tasks(n: int, seed: int) -> list[dict]:
    """``n`` templated tasks around functions of the train-split stdlib files (4–40 lines each)."""
    train_files, _ = split_files(stdlib_files()[0])
    functions = []
    for f in train_files:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        lines = f.text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno + 1 <= 40:
                body = lines[node.lineno - 1 : node.end_lineno]
                indent = len(body[0]) - len(body[0].lstrip())
                code = "\n".join(line[indent:] for line in body)
                head_end = node.body[0].lineno - node.lineno
                if isinstance(node.body[0], ast.Expr) and isinstance(
                    getattr(node.body[0], "value", None), ast.Constant
                ):
                    head_end = node.body[0].end_lineno - node.lineno + 1  # keep the docstring in the head
                head = "\n".join(line[indent:] for line in body[: max(1, head_end)])
                functions.append({"name": node.name, "code": code, "head": head, "source": f.relpath})
    rng = random.Random(seed)
    rng.shuffle(functions)
    tasks = []
    for i, fn in enumerate(functions[:n]):
        template = CODE_TEMPLATES[i % len(CODE_TEMPLATES)]
        tasks.append({"id": f"code-{i}", "kind": "code", "source": fn["source"], "turns": [template.format(**fn)]})
    return tasks


@torch.no_grad()
def synthesize_requests(target: TargetModel, tokenizer, cfg: BuildConfig, path: Path, log=print) -> list[dict]:
    """Magpie: sample user requests from the bare user-turn header until ``cfg.magpie`` pass the filter."""
    prefix = tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    stop = tuple(end_of_turn_token_ids(tokenizer)) or (tokenizer.eos_token_id,)
    rows = _read_jsonl(path)
    filt = RequestFilter([r["turns"][0] for r in rows])
    batches = len({r["batch"] for r in rows})
    bar = tqdm(total=cfg.magpie, initial=len(rows), desc="magpie requests")
    t0, tokens = time.time(), 0
    while len(rows) < cfg.magpie:
        params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=128, seed=cfg.seed * 1_000_003 + batches)
        out = generate_vanilla(target, [prefix] * cfg.batch_size, params, stop)
        new = []
        for toks in out.tokens:
            tokens += len(toks)
            complete = bool(toks) and toks[-1] in stop
            text = tokenizer.decode(toks[:-1] if complete else toks, skip_special_tokens=False).strip()
            if filt.keep(text, complete) and len(rows) + len(new) < cfg.magpie:
                new.append(
                    {"id": f"magpie-{len(rows) + len(new)}", "kind": "magpie", "batch": batches, "turns": [text]}
                )
        _append_jsonl(path, new)
        rows += new
        batches += 1
        bar.update(len(new))
        bar.set_postfix(tok_s=f"{tokens / (time.time() - t0):.0f}", rejected=sum(filt.rejected.values()))
    bar.close()
    log(f"magpie: {len(rows)} requests kept; rejected this run {filt.rejected}")
    return rows[: cfg.magpie]


def split_heldout(requests: list[dict], heldout: int) -> tuple[list[dict], list[dict]]:
    """The first ``heldout`` requests (as random as any: each batch is sampled afresh) are evaluation prompts, the
    rest train. Taking a prefix keeps the split fixed when a later build asks for more requests."""
    return requests[heldout:], requests[:heldout]


def answer_conversations(
    target: TargetModel, tokenizer, convs: list[dict], cfg: BuildConfig, out: Path, log=print
) -> dict:
    """Answer every user turn of every conversation with the target (`train.answerer`: batched, length-bucketed,
    one shard per finished batch under ``out``, resumable, ranks sharing the work).

    Row format: ``{"id", "kind", "messages": [...]}`` (roles user/assistant; the template adds its system turn).
    A conversation whose first answer is empty is skipped and counted; one whose second answer is empty keeps its
    first exchange."""
    jobs = [
        Job(c["id"], [[{"role": "user", "content": t}] for t in c["turns"]], meta={"kind": c["kind"]}) for c in convs
    ]
    settings = AnswerConfig(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.answer_temperature, batch_size=cfg.batch_size, seed=cfg.seed
    )
    return answer(target, tokenizer, jobs, settings, out, desc=out.name, log=log)


def add_follow_ups(convs: list[dict], share: float, seed: int) -> list[dict]:
    rng = random.Random(seed + 11)
    out = []
    for c in convs:
        c = dict(c, turns=list(c["turns"]))
        if rng.random() < share:
            c["turns"].append(rng.choice(FOLLOW_UPS))
        out.append(c)
    return out


def write_gz(rows: list[dict], path: Path) -> None:
    """Deterministic gzip (no timestamp in the header) of a jsonl, written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
    os.replace(tmp, path)


def build(target: TargetModel, tokenizer, cfg: BuildConfig, out_dir: Path, log=print) -> dict:
    """Both stages, resumable; writes ``train.jsonl.gz`` (training conversations), ``heldout.jsonl.gz`` (the
    held-out requests answered, for held-out metrics) and ``chat_heldout.jsonl`` (the held-out requests in
    Spec-Bench format, the ``chat`` evaluation prompts) into ``out_dir`` once the answers are complete."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    _, world = rank_and_world()
    state = None
    if world > 1:  # the main process writes the requests; the others then read the finished file
        from accelerate import PartialState

        state = PartialState()
    with state.main_process_first() if state is not None else contextlib.nullcontext():
        requests = synthesize_requests(target, tokenizer, cfg, out_dir / "magpie_requests.jsonl", log)
    train_requests, heldout = split_heldout(requests, cfg.heldout_chat)
    convs = add_follow_ups(train_requests + code_tasks(cfg.code, cfg.seed), cfg.multi_turn, cfg.seed)
    random.Random(cfg.seed + 13).shuffle(convs)
    if cfg.answer_limit:
        convs = convs[: cfg.answer_limit]
    # held-out requests answered too: held-out data for the simulated τ and vocabulary coverage, never trained on
    answer_conversations(target, tokenizer, heldout, cfg, out_dir / "answers_heldout", log)
    counts = answer_conversations(target, tokenizer, convs, cfg, out_dir / "answers", log)
    if state is not None:  # every rank's shards must be there before the merge
        state.wait_for_everyone()
        if not state.is_main_process:
            return {"this_run": counts}
    answered = read_shards(out_dir / "answers")
    rows = [answered[c["id"]] for c in convs if c["id"] in answered]
    write_gz(rows, out_dir / "train.jsonl.gz")
    held = read_shards(out_dir / "answers_heldout")
    write_gz([held[c["id"]] for c in heldout if c["id"] in held], out_dir / "heldout.jsonl.gz")
    with open(out_dir / "chat_heldout.jsonl", "w", encoding="utf-8") as f:
        f.writelines(
            json.dumps({"question_id": r["id"], "category": "chat", "turns": r["turns"]}, ensure_ascii=False) + "\n"
            for r in heldout
        )
    summary = {
        "conversations": len(rows),
        "by_kind": {k: sum(r["kind"] == k for r in rows) for k in ("magpie", "code")},
        "multi_turn": sum(len(r["messages"]) > 2 for r in rows),
        "heldout_chat_prompts": len(heldout),
        "this_run": counts,
        "minutes_this_run": round((time.time() - t0) / 60, 1),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "README.md").write_text(data_card(rows, heldout, cfg, tokenizer, str(target.name_or_path)))
    log(json.dumps(summary))
    return summary


def data_card(rows: list[dict], heldout: list[dict], cfg: BuildConfig, tokenizer, target_name: str) -> str:
    """What the data is, how it was made and how big it is (token counts with the target's tokenizer)."""
    answers = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    answer_tokens = sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers)
    kinds = {k: sum(r["kind"] == k for r in rows) for k in ("magpie", "code")}
    two_turn = sum(len(r["messages"]) > 2 for r in rows)
    return f"""# Self-distilled chat data for {target_name}

Built without any hub by `python -m train.chat_data` (train/chat_data.py; resumable, seed {cfg.seed}) with
magpie {cfg.magpie}, heldout_chat {cfg.heldout_chat}, code {cfg.code}, multi_turn {cfg.multi_turn}, max_new_tokens
{cfg.max_new_tokens}, answer_limit {cfg.answer_limit or "none"} (0 or none: every training conversation answered;
a limit answers a seeded mix of that many, and a rerun with a higher one answers more). The rows:

- {kinds["magpie"]} requests the target wrote itself from the bare ChatML user header (Magpie: T = 1, top-p 0.95,
  filtered for completeness, length, template text and near-duplicates);
- {kinds["code"]} templated code tasks (explain / document / review / rewrite / test / complete) around functions of
  the train split of the Python standard library (`eval/stdlib_corpus.py`);
- {two_turn} of the conversations ({two_turn / max(1, len(rows)):.0%}) have a second user turn, answered after the
  target's own first answer;
- every answer written by the target, T = {cfg.answer_temperature} (0 = greedy), at most {cfg.max_new_tokens} tokens.

`train.jsonl.gz`: {len(rows)} conversations, {len(answers)} assistant turns, {answer_tokens:,} answer tokens
(`messages` rows; the template adds its default system turn). `heldout.jsonl.gz`: the {len(heldout)} held-out
requests answered the same way, for held-out metrics only. The same requests are the `chat` evaluation prompts
(`eval/prompts/chat_heldout.jsonl`); they are the first {len(heldout)} requests synthesised and never in
`train.jsonl.gz` (tests/test_reference.py checks it). License: the target's (Apache-2.0); stdlib code: PSF.
"""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="short name, folder or hub id")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--dtype", default="fastest", help="target dtype (fastest: the precision policy's distill choice)")
    for name, default in vars(BuildConfig()).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from models.target import TargetConfig, load_tokenizer

    cfg = BuildConfig(**{k: getattr(args, k) for k in vars(BuildConfig())})
    tokenizer = load_tokenizer(args.target)
    target = TargetModel.from_config(TargetConfig(name_or_path=args.target, dtype=args.dtype), "distill")
    prepare_target(target)  # the routed CPU kernels (infer/kernels/cpu_linear.py) for the batched decode
    print(target.precision.line())
    return build(target, tokenizer, cfg, args.out)


if __name__ == "__main__":
    main()
