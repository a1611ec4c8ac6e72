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

Then the target answers every user turn (self-distillation through `train.data.answerer`, batched and length-bucketed,
greedy by default: the T = 0 report measures the target's greedy text). Requests are appended per batch to a jsonl
(flushed and fsynced; a torn last line is dropped); answers go to one shard per finished batch. Both resume, so an
interrupted build continues where it stopped. Requests use one seed per batch; greedy answers do not depend on how
the rows were batched (up to rounding-level ties). Under ``accelerate launch`` the ranks share the answering
(disjoint shards) and the main process merges.
A held-out share of the magpie prompts becomes the ``chat`` evaluation set instead (never answered for training).

    python -m train.data.target_written --target smollm2-135m-instruct --out outputs/smollm2-data --magpie 2000 --code 1500
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eval.stdlib_corpus import split_files, stdlib_files
from infer.continuous import decode_continuous
from infer.sampling import SamplingParams
from infer.serving import prepare_target
from models.target import TargetModel
from train.data.answerer import (
    AnswerConfig,
    Job,
    answer,
    drop_stale,
    end_launched_process,
    rank_and_world,
    read_shards,
)
from train.data.chat_render import end_of_turn_token_ids, render
from train.data.files import append_jsonl, read_jsonl, write_jsonl_gz
from train.data.tasks import (
    MT_FOLLOW_UPS,
    OPENERS,
    SHINGLE,
    TASK_FAMILIES,
    TASK_FAMILY_OF_KIND,
    Disjoint,
    derived_tasks,
    evaluation_prompts,
    math_tasks,
    prose_passages,
    rag_tasks,
    summarization_tasks,
    to_language_tasks,
    write_tasks,
)

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
    qa: int = 600
    """Steered self-written questions (Natural-Questions-like), after the held-out ones."""
    math_reasoning: int = 400
    """Steered self-written math word problems."""
    math_templates: int = 600
    """GSM8K-style word problems from templates."""
    mt_bench: int = 500
    """Steered writing / role-play / reasoning requests, each with an MT-bench-style second turn."""
    summarization: int = 500
    """Summaries of offline prose (pass 1; more come from the target's own articles in pass 2)."""
    rag: int = 400
    """Questions over three offline-prose documents (pass 1; more over the target's articles in pass 2)."""
    translation: int = 800
    """English prose to translate into German / French / Spanish / Italian / Portuguese; pass 2 translates the
    target's translations back into English."""
    articles: int = 800
    """News-style articles for the target to write; pass 2 summarises them and asks questions over them."""
    heldout_per_family: int = 16
    """First steered requests of each task family kept out of training (``families_heldout.jsonl``)."""
    multi_turn: float = 0.2
    """Share of conversations that get a second user turn."""
    answer_temperature: float = 0.0
    """Temperature of the target's answers (0 = greedy)."""
    max_new_tokens: int = 384
    """Cap per answer; answers that hit it are kept and counted."""
    batch_size: int = 128
    """Rows decoded together by the answerer (`train.data.answerer.AnswerConfig.batch_size` says why 128)."""
    answer_limit: int = 0
    """Answer only the first N training conversations (0 = all); the order is a seeded mix of the kinds, so a limit
    keeps their proportions, and a later build with a higher limit (or 0) answers the rest."""
    seed: int = 0


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
def synthesize_requests(
    target: TargetModel, tokenizer, cfg: BuildConfig, path: Path, log=print, task_family: str = "chat", count: int = -1
) -> list[dict]:
    """Magpie: sample user requests from the bare user-turn header until ``count`` (default ``cfg.magpie``) pass the
    filter. A task family with openers (`train.data.tasks.OPENERS`) is steered: each row's user turn starts with one of
    them, and the request is the opener plus what the target wrote after it. Kept requests are appended to ``path``
    16 at a time (resumable: a rerun keeps them and samples the rest)."""
    count = cfg.magpie if count < 0 else count
    header = user_turn_prefix(tokenizer)
    openers = OPENERS.get(task_family, ("",))
    kind = "magpie" if task_family == "chat" else task_family
    stop = tuple(end_of_turn_token_ids(tokenizer)) or (tokenizer.eos_token_id,)
    rows = read_jsonl(path)
    filt = RequestFilter([r["turns"][0] for r in rows])
    flushes = len({r["batch"] for r in rows})
    bar = tqdm(total=count, initial=len(rows), desc=f"{task_family} requests")
    t0, tokens, pending = time.time(), 0, []
    # one random stream per run (a resumed build samples afresh), seeded by where it starts
    seed = cfg.seed * 1_000_003 + len(rows) + TASK_FAMILIES.index(task_family) * 100_003
    rng = random.Random(seed)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=128, seed=seed)

    def flush() -> None:
        nonlocal flushes
        append_jsonl(path, pending)
        rows.extend(pending)
        bar.update(len(pending))
        pending.clear()
        flushes += 1

    attempts = [0]
    limit = 20 * (count - len(rows)) + cfg.batch_size  # the real target keeps ~90 %; a broken one must not loop

    def submit(n: int) -> list[tuple[str, list[int]]]:
        if len(rows) + len(pending) >= count or attempts[0] >= limit:
            return []
        attempts[0] += n
        starts = [rng.choice(openers) for _ in range(n)]
        return [(s, tokenizer(header + s, add_special_tokens=False)["input_ids"]) for s in starts]

    def on_done(start: str, toks: list[int]) -> None:
        nonlocal tokens
        tokens += len(toks)
        complete = bool(toks) and toks[-1] in stop
        text = (start + tokenizer.decode(toks[:-1] if complete else toks, skip_special_tokens=False)).strip()
        if filt.keep(text, complete) and len(rows) + len(pending) < count:
            n = len(rows) + len(pending)
            pending.append({"id": f"{kind}-{n}", "kind": kind, "batch": flushes, "turns": [text]})
            if len(pending) >= 16:
                flush()
                bar.set_postfix(tok_s=f"{tokens / (time.time() - t0):.0f}", rejected=sum(filt.rejected.values()))

    if len(rows) < count:
        # continuous batching: a request that ends frees its slot at once (a static batch waits for its longest,
        # which runs to the 128-token cap whenever one request does)
        decode_continuous(target, submit, on_done, params, stop, cfg.batch_size)
        if pending:
            flush()
        if len(rows) < count:
            log(f"{task_family} requests: stopped after {attempts[0]} samples with {len(rows)} of {count} kept")
    bar.close()
    log(f"{task_family} requests: {len(rows)} kept; rejected this run {filt.rejected}")
    return rows[:count]


def split_heldout(requests: list[dict], heldout: int) -> tuple[list[dict], list[dict]]:
    """The first ``heldout`` requests (as random as any: each batch is sampled afresh) are evaluation prompts, the
    rest train. Taking a prefix keeps the split fixed when a later build asks for more requests."""
    return requests[heldout:], requests[:heldout]


def main_process_first() -> contextlib.AbstractContextManager:
    """The main process runs the block first, the others once it is done (a no-op on one process)."""
    if rank_and_world()[1] == 1:
        return contextlib.nullcontext()
    from accelerate import PartialState

    return PartialState().main_process_first()


def answer_conversations(
    target: TargetModel, tokenizer, convs: list[dict], cfg: BuildConfig, out: Path, log=print
) -> dict:
    """Answer every user turn of every conversation with the target (`train.data.answerer`: batched, length-bucketed,
    one shard per finished batch under ``out``, resumable, ranks sharing the work). A row on disk whose prompt is no
    longer its conversation's is dropped first and answered again (`drop_stale`).

    Row format: ``{"id", "kind", "messages": [...]}`` (roles user/assistant; the template adds its system turn).
    A conversation whose first answer is empty is skipped and counted; one whose second answer is empty keeps its
    first exchange."""
    jobs = [
        Job(
            c["id"],
            [[{"role": "user", "content": t}] for t in c["turns"]],
            meta={k: v for k, v in c.items() if k not in ("id", "turns", "batch")},
        )
        for c in convs
    ]
    rank, _ = rank_and_world()
    with main_process_first():  # the other ranks read the shards only once they are rewritten
        if rank == 0:
            drop_stale(out, jobs, log)
    settings = AnswerConfig(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.answer_temperature, batch_size=cfg.batch_size, seed=cfg.seed
    )
    return answer(target, tokenizer, jobs, settings, out, desc=out.name, log=log)


def add_follow_ups(convs: list[dict], share: float, seed: int) -> list[dict]:
    """A second user turn: always for ``mt_bench`` (MT-bench's rewrite / constrain follow-ups), for ``share`` of
    the chat, code and question-answering requests; the templated tasks over passages stay single-turn."""
    rng = random.Random(seed + 11)
    out = []
    for c in convs:
        c = dict(c, turns=list(c["turns"]))
        if c["kind"] == "mt_bench":
            c["turns"].append(rng.choice(MT_FOLLOW_UPS))
        elif c["kind"] in ("magpie", "code", "qa") and rng.random() < share:
            c["turns"].append(rng.choice(FOLLOW_UPS))
        out.append(c)
    return out


def task_requests(target: TargetModel, tokenizer, cfg: BuildConfig, out_dir: Path, log=print) -> dict:
    """Every first-pass request of the build by task family: self-written (Magpie, bare for chat, steered for qa / math /
    mt_bench) and templated (code, math word problems, summaries, RAG and translations over offline prose, articles
    to write). Returns ``{"train": [...], "heldout": {family: [...]}, "dropped_as_eval_overlap": n}``; held-out
    requests are the first ``cfg.heldout_per_family`` of each steered task family (the first ``cfg.heldout_chat`` for
    chat), never trained on."""
    chat = synthesize_requests(target, tokenizer, cfg, out_dir / "magpie_requests.jsonl", log)
    train, chat_heldout = split_heldout(chat, cfg.heldout_chat)
    heldout = {"chat": chat_heldout}
    steered = {"qa": cfg.qa, "math_reasoning": cfg.math_reasoning, "mt_bench": cfg.mt_bench}
    for task_family, n in steered.items():
        if n:
            rows = synthesize_requests(
                target,
                tokenizer,
                cfg,
                out_dir / f"{task_family}_requests.jsonl",
                log,
                task_family,
                n + cfg.heldout_per_family,
            )
            train_rows, heldout[task_family] = split_heldout(rows, cfg.heldout_per_family)
            train += train_rows
    train += code_tasks(cfg.code, cfg.seed) + math_tasks(cfg.math_templates, cfg.seed)
    if cfg.summarization or cfg.rag or cfg.translation:
        passages = prose_passages("train")
        train += summarization_tasks(passages, cfg.summarization, cfg.seed) + rag_tasks(passages, cfg.rag, cfg.seed)
        train += to_language_tasks(passages, cfg.translation, cfg.seed)
    train += write_tasks(cfg.articles, cfg.seed)
    disjoint = Disjoint(evaluation_prompts())
    train = [c for c in train if all(disjoint.ok(t) for t in c["turns"])]
    return {"train": train, "heldout": heldout, "dropped_as_eval_overlap": disjoint.dropped}


def build(target: TargetModel, tokenizer, cfg: BuildConfig, out_dir: Path, log=print) -> dict:
    """Both passes, resumable; writes ``train.jsonl.gz`` (training conversations), ``heldout.jsonl.gz`` (the
    held-out chat requests answered, for held-out metrics), ``chat_heldout.jsonl`` (those requests in Spec-Bench
    format, the ``chat`` evaluation prompts) and ``families_heldout.jsonl`` (every held-out request, category = its
    family: a Spec-Bench-format file disjoint from training) into ``out_dir`` once the answers are complete.

    Pass 1 answers every request (`task_requests`); pass 2 answers the tasks derived from pass-1 answers
    (`train.data.tasks.derived_tasks`: translations back into English, summaries of and RAG over the articles the
    target wrote)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    _, world = rank_and_world()
    state = None
    if world > 1:
        from accelerate import PartialState

        state = PartialState()
    with main_process_first():  # the main process writes the requests; the others then read the finished files
        requests = task_requests(target, tokenizer, cfg, out_dir, log)
    heldout = requests["heldout"]
    convs = add_follow_ups(requests["train"], cfg.multi_turn, cfg.seed)
    follow_up_check = Disjoint(evaluation_prompts())  # the follow-ups come from a fixed list: check every turn again
    convs = [c for c in convs if all(follow_up_check.ok(t) for t in c["turns"])]
    if follow_up_check.dropped:
        log(f"{follow_up_check.dropped} conversations dropped: a follow-up turn overlaps an evaluation prompt")
    random.Random(cfg.seed + 13).shuffle(convs)
    if cfg.answer_limit:
        convs = convs[: cfg.answer_limit]
    # held-out requests answered too: held-out data for the simulated τ and vocabulary coverage, never trained on
    answer_conversations(target, tokenizer, heldout["chat"], cfg, out_dir / "answers_heldout", log)
    counts = answer_conversations(target, tokenizer, convs, cfg, out_dir / "answers", log)
    if state is not None:  # every rank's pass-1 shards must be there before pass 2 is derived from them
        state.wait_for_everyone()
    answered = read_shards(out_dir / "answers")
    rows = [answered[c["id"]] for c in convs if c["id"] in answered]
    disjoint = Disjoint(evaluation_prompts())
    derived = [c for c in derived_tasks(rows, cfg.seed) if all(disjoint.ok(t) for t in c["turns"])]
    counts_derived = answer_conversations(target, tokenizer, derived, cfg, out_dir / "answers_derived", log)
    if state is not None:
        state.wait_for_everyone()
        if not state.is_main_process:
            return {"this_run": counts}
    answered_derived = read_shards(out_dir / "answers_derived")
    rows += [answered_derived[c["id"]] for c in derived if c["id"] in answered_derived]
    write_jsonl_gz(rows, out_dir / "train.jsonl.gz")
    held = read_shards(out_dir / "answers_heldout")
    write_jsonl_gz([held[c["id"]] for c in heldout["chat"] if c["id"] in held], out_dir / "heldout.jsonl.gz")
    for name, families in (("chat_heldout.jsonl", ("chat",)), ("families_heldout.jsonl", tuple(heldout))):
        with open(out_dir / name, "w", encoding="utf-8") as f:
            f.writelines(
                json.dumps({"question_id": r["id"], "category": fam, "turns": r["turns"]}, ensure_ascii=False) + "\n"
                for fam in families
                for r in heldout[fam]
            )
    by_family = task_family_counts(rows, tokenizer)
    summary = {
        "conversations": len(rows),
        "by_kind": {k: sum(r["kind"] == k for r in rows) for k in sorted({r["kind"] for r in rows})},
        "by_family": by_family,
        "answer_tokens": sum(f["answer_tokens"] for f in by_family.values()),
        "multi_turn": sum(len(r["messages"]) > 2 for r in rows),
        "heldout_chat_prompts": len(heldout["chat"]),
        "heldout_by_family": {k: len(v) for k, v in heldout.items()},
        "dropped_as_eval_overlap": requests["dropped_as_eval_overlap"] + disjoint.dropped,
        "this_run": {"first_pass": counts, "derived": counts_derived},
        "minutes_this_run": round((time.time() - t0) / 60, 1),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "README.md").write_text(data_card(rows, heldout["chat"], cfg, summary, str(target.name_or_path)))
    log(json.dumps(summary))
    return summary


def task_family_counts(rows: list[dict], tokenizer) -> dict[str, dict]:
    """Per task family: conversations, answers and answer tokens (the target's tokenizer)."""
    out: dict[str, dict] = {}
    for r in rows:
        fam = TASK_FAMILY_OF_KIND.get(r["kind"], r["kind"])
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        entry = out.setdefault(fam, {"conversations": 0, "answers": 0, "answer_tokens": 0})
        entry["conversations"] += 1
        entry["answers"] += len(answers)
        entry["answer_tokens"] += sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers)
    return {f: out[f] for f in TASK_FAMILIES if f in out}


def data_card(rows: list[dict], heldout: list[dict], cfg: BuildConfig, summary: dict, target_name: str) -> str:
    """What the data is, how it was made and how big it is, per task family (token counts with the target's tokenizer)."""
    settings = ", ".join(f"{k} {v}" for k, v in vars(cfg).items())
    table = "\n".join(
        f"| {fam} | {c['conversations']:,} | {c['answers']:,} | {c['answer_tokens']:,} |"
        for fam, c in summary["by_family"].items()
    )
    kinds = ", ".join(f"{k} {n:,}" for k, n in summary["by_kind"].items())
    return f"""# Self-distilled chat data for {target_name}

Built without any hub by `python -m train.data.target_written` (train/data/target_written.py, train/data/tasks.py;
resumable) with
{settings}.

| family | conversations | answers | answer tokens |
|---|---|---|---|
{table}
| **all** | {len(rows):,} | {sum(c["answers"] for c in summary["by_family"].values()):,} | {summary["answer_tokens"]:,} |

Rows by kind: {kinds}. {summary["multi_turn"]:,} conversations have a second user turn, answered after the target's
own first answer.

- chat: requests the target wrote itself from the bare ChatML user header (Magpie: T = 1, top-p 0.95, filtered for
  completeness, length, template text and near-duplicates), and news-style articles it was asked to write;
- qa, math_reasoning, mt_bench: requests it wrote after a family's opener (steered Magpie); math also GSM8K-style
  templated word problems; every mt_bench request has an MT-bench-style second turn;
- code: templated tasks (explain / document / review / rewrite / test / complete) around functions of the train
  split of the Python standard library (`eval/stdlib_corpus.py`);
- summarization, rag, translation: templated tasks over prose of the Python reference manual and the standard
  library's docstrings (train split), and, in a second pass, over the target's own answers: its articles to
  summarise or to answer questions over, its translations to translate back into English;
- every answer written by the target, T = {cfg.answer_temperature} (0 = greedy), at most {cfg.max_new_tokens} tokens.

Disjoint from evaluation: {summary["dropped_as_eval_overlap"]} requests that shared an
{SHINGLE}-word run with an evaluation prompt file were dropped. Held out (never in `train.jsonl.gz`):
{", ".join(f"{k} {v}" for k, v in summary["heldout_by_family"].items())} requests, in `families_heldout.jsonl`
(Spec-Bench format); the {len(heldout)} chat ones are also `chat_heldout.jsonl` and, answered, `heldout.jsonl.gz`.
License: the target's (Apache-2.0); Python documentation and code: PSF.
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
    from models.target import TargetConfig
    from models.tokenizer import load_tokenizer

    cfg = BuildConfig(**{k: getattr(args, k) for k in vars(BuildConfig())})
    tokenizer = load_tokenizer(args.target)
    target = TargetModel.from_config(TargetConfig(name_or_path=args.target, dtype=args.dtype), "distill")
    prepare_target(target)  # the routed CPU kernels (infer/kernels/cpu_linear.py) for the batched decode
    print(target.precision.line())
    written = build(target, tokenizer, cfg, args.out)
    end_launched_process(rank_and_world()[1])  # several processes under `accelerate launch`: no interpreter teardown
    return written


if __name__ == "__main__":
    main()
