"""The one answerer: the target writes the text its drafter trains on, for every self-distillation path.

Chat data (`train.data.target_written`), regeneration of an existing chat dataset (`train.data.regenerate`,
``drafters regenerate``) and raw-text continuations (`train.data.self_distill`) all hand their work here as `Job`s:

- a chat job is a list of *segments*, the system / user messages that come before each answer; the answers are
  written in order, answer k seeing the target's own answers before it (turn-by-turn self-distillation);
- a continuation job is a token prefix continued for exactly ``new_tokens`` tokens (raw text: no stop token).

How it runs: the project's KV-cached vanilla loop with continuous batching (`infer.continuous.decode_continuous`: a
finished row's slot takes the next prompt at once, so a batch never idles down to its longest answer, and new
prompts join in groups of similar length, so little is left-padded), in the dtype the caller loaded the target in
(the precision policy's ``distill`` choice by default). Kernel routing (`infer.serving.prepare_target`) is the
caller's to install: the entry points that only answer do; a training run's self-distillation does not, because the
routing's layouts are chosen by timing and the run's target must compute the same numbers in every run. Every ``batch_size`` finished jobs become one shard file, written atomically
(``shard-r<rank>-<n>.jsonl.gz``), so a crash loses at most the jobs in flight and a rerun skips every job already in a
shard. Under ``accelerate launch`` (or torchrun) rank r of w answers jobs r, r + w, …: the ranks write disjoint
shards, and `read_shards` returns every rank's rows. A progress bar shows answer tokens/s.

Greedy answers do not depend on the batching (up to the kernels' rounding); at T > 0 one random stream serves the
run, so a resumed run samples afresh.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import torch
from tqdm.auto import tqdm

from infer.continuous import decode_continuous
from infer.sampling import SamplingParams
from infer.serving import prepare_target  # prepare_target: the entry points below
from models.allocator import keep_freed_memory, release_freed_memory
from models.target import TargetModel
from models.timing import best_gemm_rate
from models.tokenizer import stop_ids
from train.data.chat_render import end_of_turn_token_ids, render
from train.data.files import read_shard, rewrite_shard
from train.data.loops import LoopWatch


@dataclass
class Job:
    """One piece of work: ``segments`` (chat) or ``prompt_ids`` (continuation), never both."""

    id: str
    segments: list[list[dict]] = field(default_factory=list)
    """Chat: the messages before each answer (system / user roles); one answer is written after each segment."""
    prompt_ids: list[int] | None = None
    """Continuation: token ids to continue for ``AnswerConfig.new_tokens`` tokens."""
    meta: dict = field(default_factory=dict)
    """Copied into the output row (e.g. ``kind``)."""

    def __post_init__(self) -> None:
        if bool(self.segments) == (self.prompt_ids is not None):
            raise ValueError(f"job {self.id!r}: give chat segments or prompt_ids, exactly one of them")


@dataclass
class AnswerConfig:
    max_new_tokens: int = 384
    """Cap per chat answer; answers that reach it are kept and counted."""
    new_tokens: int = 192
    """Continuations: exactly this many tokens (no stop token)."""
    temperature: float = 0.0
    """0 = greedy (what a T = 0 report measures); > 0 samples."""
    batch_size: int = 128
    """Rows decoded together (continuous batching: the slots of the running batch). 128: on the 2-core AVX-512-BF16
    EPYC in bf16, 384 chat requests capped at 192 tokens ran at 469 / 550 / 640 / 655 answer tokens/s at batch 32 /
    48 / 96 / 128, and with the cheaper attention the 600 shipped requests at 424 / 394 against 438 / 433 for batch
    96 against 128, alternating (docs/decisions.md, "One answerer"): more rows spread each step's fixed costs. A
    cache of 128 rows of 1,400 slots is ~4 GB in bf16."""
    refill: int | None = None
    """Free slots before waiting prompts join the running batch (None: a quarter of the batch); ``batch_size`` is
    static batching (a batch runs until its longest answer ends), for comparison."""
    max_length: int | None = None
    """Chat: a prompt whose length plus max_new_tokens exceeds this ends its conversation there (counted)."""
    length_window: int | None = None
    """New prompts are taken in the order given, sorted by length only within consecutive windows of this many
    (None: 4 x batch_size), so similar lengths still join together while every prefix of the answers keeps the mix
    of the jobs (sorting the whole set answered the shortest task families first: a build stopped early had no
    code, summarization, RAG or translation answers)."""
    seed: int = 0
    stop_loops: int | None = None
    """Chat: end an answer once this many of its last tokens are a loop (`train.data.loops.loop_tail`), its slot
    freed for the next prompt, counted as ``loop_stopped`` (None: answers run to an end token or the cap). A greedy
    answer caught in a loop never leaves it; what a drafter trains on keeps only the loop's first tokens
    (``data.loop_tail_keep``), so the rest need not be decoded."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.new_tokens < 1 or self.batch_size < 1:
            raise ValueError("max_new_tokens, new_tokens and batch_size must be >= 1")
        if self.stop_loops is not None and self.stop_loops < 1:
            raise ValueError(f"stop_loops must be >= 1 (or None), got {self.stop_loops}")
        if self.length_window is not None and self.length_window < 1:
            raise ValueError(f"length_window must be >= 1 (or None), got {self.length_window}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


ENDINGS = ("empty_answer", "prompt_too_long", "template_error")
"""Why a conversation ends before its last segment; a row that ends early carries ``"ended": reason``."""


def answer_stop_ids(tokenizer, model) -> tuple[int, ...]:
    """Where a chat answer ends: the tokenizer's and the generation config's EOS and the template's end-of-turn
    token(s) (the one definition every self-distillation path uses)."""
    return tuple(sorted({*stop_ids(tokenizer, model), *end_of_turn_token_ids(tokenizer)}))


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes (``accelerate launch`` / torchrun set RANK and WORLD_SIZE)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def end_launched_process(num_processes: int) -> None:
    """End a process of a launched run (``num_processes`` > 1) once its work is done, without the interpreter's
    teardown; a one-process run returns. The process group's gloo worker threads outlive ``destroy_process_group``
    (the group object lives on while the engine holds it), and one of them can still be releasing a finished
    collective's work when the interpreter finalizes: releasing it drops tensors that need the GIL, a thread taking
    the GIL during finalization is ended with a forced unwind, and the unwind through a noexcept frame calls
    ``std::terminate`` ("terminate called without an active exception", SIGABRT), after every step and save had
    completed; the launcher then fails the whole run (docs/decisions.md, "A known flake, understood"). So every
    rank's last act is ``os._exit(0)``: its output is flushed first, and every file it wrote is closed by then. Here
    beside `rank_and_world`, as the data build's launched processes end the same way."""
    if num_processes == 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def read_shards(out_dir: str | Path) -> dict[str, dict]:
    """Every row written so far under ``out_dir`` (all ranks), by job id."""
    return {row["id"]: row for shard in sorted(_shards(Path(out_dir))) for row in read_shard(shard)}


def _user_turns(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


def drop_stale(out_dir: str | Path, jobs: list[Job], log: Callable[[str], None] = print) -> int:
    """Remove from ``out_dir``'s shards every chat row whose user turns are not its job's (a row that ended early:
    the turns it holds). The answerer resumes by job id, so without this a prompt that changed since its row was written
    keeps the old answer: a pass-2 task quotes a pass-1 answer, and that answer may have been written again (an
    audit removed it). Run it on one process before `answer`; returns the number of rows removed."""
    wanted = {j.id: _user_turns([m for seg in j.segments for m in seg]) for j in jobs if j.prompt_ids is None}
    removed = 0
    for shard in sorted(_shards(Path(out_dir))):
        rows = read_shard(shard)
        keep = []
        for r in rows:
            turns, job = _user_turns(r.get("messages", [])), wanted.get(r["id"])
            # a row holds every turn of its job, or fewer when its conversation ended early (``ended`` says why)
            if job is None or turns == job or ("ended" in r and turns == job[: len(turns)]):
                keep.append(r)
        if len(keep) < len(rows):
            rewrite_shard(shard, keep)
            removed += len(rows) - len(keep)
    if removed:
        log(f"{Path(out_dir).name}: {removed} rows dropped, their prompts changed since they were answered")
    return removed


def _shards(out_dir: Path, rank: int | None = None) -> list[Path]:
    """Shard files (``.jsonl.gz``; plain ``.jsonl`` from earlier builds are read too) of one rank or of all."""
    stem = "shard-r*" if rank is None else f"shard-r{rank:02d}-*"
    return [*out_dir.glob(stem + ".jsonl"), *out_dir.glob(stem + ".jsonl.gz")]


def _write_shard(out_dir: Path, rank: int, number: int, rows: list[dict]) -> None:
    """Compressed (deterministic gzip: no timestamp), so a build's shards can be committed as they come."""
    path = out_dir / f"shard-r{rank:02d}-{number:07d}.jsonl.gz"
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
        f.write(gzip.compress(data, mtime=0))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _seed(cfg: AnswerConfig, first_id: str, rank: int) -> int:
    """The run's random stream: from the config's seed, the first job and the rank (ranks sample apart)."""
    return int(hashlib.sha256(f"{cfg.seed}:{first_id}:{rank}".encode()).hexdigest()[:8], 16)


@torch.no_grad()
def answer(
    target: TargetModel,
    tokenizer,  # None for continuation jobs only
    jobs: list[Job],
    cfg: AnswerConfig,
    out_dir: str | Path,
    desc: str = "answers",
    log: Callable[[str], None] = print,
    progress: bool = True,
    share: tuple[int, int] | None = None,
) -> dict:
    """Answer this rank's share of ``jobs`` that no shard in ``out_dir`` holds yet; returns this run's counts.
    ``share``: (rank, world) of this call; None reads them from the environment (`rank_and_world`), (0, 1) answers
    everything here (a caller that runs on one process of a launch).

    Chat rows: ``{"id", **meta, "messages": [...]}`` with every segment's messages followed by the target's answer;
    a conversation ends before a turn whose answer is empty, whose prompt is too long (``cfg.max_length``) or whose
    template fails (`ENDINGS`: the row then carries ``"ended"``; counted as ``<reason>``, or ``no_answer_<reason>``
    when it had no answer yet and is not written). Continuation rows: ``{"id", **meta,
    "input_ids": prompt + continuation, "loss_mask": [1, ...]}``.

    Decoding is continuous (`infer.continuous.decode_continuous`): a row that finishes frees its slot for the next
    prompt, and a conversation's next turn joins the queue as soon as its answer is in (ahead of new conversations,
    so finished rows, and shards, keep coming). Every ``batch_size`` finished jobs are one shard."""
    keep_freed_memory()  # every join and step allocates its big tensors anew (models/allocator.py)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rank, world = share or rank_and_world()
    done = set(read_shards(out_dir))
    mine = [j for i, j in enumerate(jobs) if i % world == rank and j.id not in done]
    if len({j.prompt_ids is None for j in mine}) > 1:
        raise ValueError("one call answers chat jobs or continuation jobs, not both")
    chat = bool(mine) and mine[0].prompt_ids is None
    stop = answer_stop_ids(tokenizer, target.model) if chat else ()  # continuations run their full length
    share = sum(1 for i in range(len(jobs)) if i % world == rank)
    name = desc if world == 1 else f"{desc} (rank {rank}/{world})"
    bar = tqdm(total=share, initial=share - len(mine), desc=name, disable=not progress)
    text = target.config.get_text_config()
    probe = functools.partial(_gemm_rate, target.dtype, text.hidden_size, text.intermediate_size)
    if mine:
        probe()  # the machine's rate before the run: the limit is the best rate seen (`machine_limit`)
    run = _Answering(tokenizer, cfg, out_dir, rank, chat, stop, bar, probe)
    run.start(mine)
    params = SamplingParams(
        temperature=cfg.temperature,
        max_new_tokens=cfg.max_new_tokens if chat else cfg.new_tokens,
        seed=_seed(cfg, mine[0].id if mine else "", rank),
    )
    try:
        if mine:
            stop_row = run.looping if chat and cfg.stop_loops is not None else None
            decode_continuous(target, run.submit, run.on_done, params, stop, cfg.batch_size, cfg.refill, stop_row)
    finally:  # a run stopped by Ctrl-C (or a crash) keeps its finished rows and still says how fast it went
        run.flush(1)
        bar.close()
        seconds = time.time() - run.t0
        rate = run.counts["answer_tokens"] / max(seconds, 1e-9)
        counts = dict(run.counts, seconds=round(seconds, 1), tokens_per_s=round(rate, 1))
        if counts["answers"]:
            counts |= machine_limit(target, counts)
        log(f"{desc}: {json.dumps(counts)}")
        if counts["answers"]:
            log(f"{desc}: {limit_words(counts)}")
    return counts


def window_sorted(prompts: list[tuple[str, list[int]]], window: int) -> list[tuple[str, list[int]]]:
    """``prompts`` (job id, prompt ids) shortest first within each run of ``window`` consecutive ones, the runs in
    their given order: a batch joins prompts of similar length (little left padding) without the whole set's
    shortest kind going first."""
    return [
        kp for i in range(0, len(prompts), window) for kp in sorted(prompts[i : i + window], key=lambda kp: len(kp[1]))
    ]


class _Answering:
    """One `answer` call in flight: the prompts waiting to be decoded (a conversation's next turn ahead of new jobs),
    the conversations, the finished rows not yet in a shard, and the counts."""

    def __init__(
        self, tokenizer, cfg: AnswerConfig, out_dir: Path, rank: int, chat: bool, stop, bar, probe: Callable[[], float]
    ) -> None:
        self.tokenizer, self.cfg, self.chat, self.stop, self.bar = tokenizer, cfg, chat, stop, bar
        self.probe = probe  # the machine's GEMM rate, sampled at shards (`_gemm_rate`: at most once a minute)
        self.out_dir, self.rank = out_dir, rank
        self.counts: Counter = Counter(rows_written=0, answer_tokens=0, answers=0, hit_max_new_tokens=0, loop_stopped=0)
        self.counts.update({f"{pre}{r}": 0 for pre in ("", "no_answer_") for r in ENDINGS})
        # after the highest number on disk, not the count: an audit may have removed a shard (`train.data.audit`)
        self.shard_no = 1 + max(
            (int(p.name.split(".")[0].rsplit("-", 1)[1]) for p in _shards(out_dir, rank)), default=-1
        )
        self.finished: list[dict] = []
        self.convs: dict[str, _Conversation] = {}
        self.queue: list[tuple[str, list[int]]] = []  # (job id, prompt): next turns first, then new jobs by length
        self.fresh: list[tuple[str, list[int]]] = []
        self.watches: dict[str, LoopWatch] = {}  # the answers in flight, where ``cfg.stop_loops`` is set
        self.t0 = time.time()

    def start(self, jobs: list[Job]) -> None:
        """Every job's first prompt, in the jobs' order sorted by length within windows (`window_sorted`)."""
        self.convs = {j.id: _Conversation(j) for j in jobs}
        for job in jobs:
            if not self.chat:
                self.fresh.append((job.id, list(job.prompt_ids)))
                continue
            prompt = self.convs[job.id].next_prompt(self.tokenizer, self.cfg)
            if prompt is None:
                self.counts[self.convs[job.id].ending_key()] += 1
                self.finish(None)
            else:
                self.fresh.append((job.id, prompt))
        self.fresh = window_sorted(self.fresh, self.cfg.length_window or 4 * self.cfg.batch_size)

    def flush(self, at_least: int) -> None:
        if len(self.finished) >= max(at_least, 1):
            _write_shard(self.out_dir, self.rank, self.shard_no, self.finished)
            self.shard_no += 1
            self.counts["rows_written"] += len(self.finished)
            self.finished.clear()
            self.probe()

    def finish(self, row: dict | None) -> None:
        if row is not None:
            self.finished.append(row)
        self.bar.update(1)
        self.bar.set_postfix(tok_s=f"{self.counts['answer_tokens'] / max(time.time() - self.t0, 1e-9):.0f}")
        self.flush(self.cfg.batch_size)

    def submit(self, n: int) -> list[tuple[str, list[int]]]:
        # a join is where the cache is rebuilt at a new width: the heap keeps every freed block (keep_freed_memory),
        # and over a run of long prompts the fragments grew past the machine (24 GB at batch 128, 20 GB at batch 64
        # within 11 minutes, killed for memory); past half the machine they are handed back here
        release_freed_memory()
        out = self.queue[:n]
        del self.queue[:n]
        while len(out) < n and self.fresh:
            out.append(self.fresh.pop(0))
        self.counts["prompt_tokens"] += sum(len(p) for _, p in out)  # every turn's prompt is prefilled whole
        return out

    def looping(self, key: str, toks: list[int]) -> bool:
        """Whether the answer in flight for ``key`` has reached ``cfg.stop_loops`` tokens of loop."""
        if key not in self.watches:
            self.watches[key] = LoopWatch()
        return self.watches[key].update(toks) >= self.cfg.stop_loops

    def on_done(self, key: str, toks: list[int]) -> None:
        self.counts["answer_tokens"] += len(toks)
        self.counts["answers"] += 1
        conv = self.convs[key]
        if not self.chat:
            ids = list(conv.job.prompt_ids) + toks
            return self.finish({"id": key, **conv.job.meta, "input_ids": ids, "loss_mask": [1] * len(ids)})
        complete = bool(toks) and toks[-1] in self.stop
        watch = self.watches.pop(key, None)  # a conversation's next answer is watched afresh
        looped = not complete and watch is not None and watch.run >= self.cfg.stop_loops
        self.counts["loop_stopped"] += int(looped)
        self.counts["hit_max_new_tokens"] += int(not complete and not looped)
        text = self.tokenizer.decode(toks[:-1] if complete else toks, skip_special_tokens=True).strip()
        conv.add_answer(text)
        prompt = conv.next_prompt(self.tokenizer, self.cfg) if conv.ended is None else None
        if prompt is not None:
            self.queue.append((key, prompt))
            return
        if conv.ended is not None:
            self.counts[conv.ending_key()] += 1
        self.finish(conv.row())


class _Conversation:
    """A chat job in flight: the messages so far, the next segment, and why it ended early (if it did)."""

    def __init__(self, job: Job) -> None:
        self.job, self.messages, self.turn, self.answered = job, [], 0, 0
        self.ended: str | None = None

    def next_prompt(self, tokenizer, cfg: AnswerConfig) -> list[int] | None:
        """The token ids of the next turn's prompt, or None when the conversation is over (``ended`` says why when
        it ended early)."""
        if self.turn >= len(self.job.segments):
            return None
        self.messages += self.job.segments[self.turn]
        self.turn += 1
        try:
            text = render(tokenizer, self.messages, add_generation_prompt=True)
        except jinja2.TemplateError:
            self.ended = "template_error"
            return None
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if cfg.max_length is not None and len(ids) + cfg.max_new_tokens > cfg.max_length:
            self.ended = "prompt_too_long"
            return None
        return ids

    def add_answer(self, text: str) -> None:
        if not text:
            self.ended = "empty_answer"
            return
        self.messages.append({"role": "assistant", "content": text})
        self.answered += 1

    def ending_key(self) -> str:
        return ("" if self.answered else "no_answer_") + str(self.ended)

    def row(self) -> dict | None:
        if not self.answered:
            return None
        last = max(k for k, m in enumerate(self.messages) if m["role"] == "assistant")
        row = {"id": self.job.id, **self.job.meta, "messages": self.messages[: last + 1]}
        return row | ({"ended": self.ended} if self.ended else {})


# --------------------------------------------------------------------------------------------------
# Benchmark: answer tokens/s beside the machine's own limit
# --------------------------------------------------------------------------------------------------


def decode_flops_per_token(config, context: int) -> float:
    """Multiply-adds x 2 of one decoded token: every weight matrix once (embedding lookup excluded, the head
    included) plus attention over ``context`` cached tokens (QK^T and PV: 4 · layers · context · heads · head_dim)."""
    text = config.get_text_config()
    h, layers, inter = text.hidden_size, text.num_hidden_layers, text.intermediate_size
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", heads) or heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    per_layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * inter
    return 2.0 * (layers * per_layer + h * text.vocab_size) + 4.0 * layers * context * heads * head_dim


RATE_EVERY_S = 60.0
"""A run probes the machine's GEMM rate again at its next shard once the last probe is this old (`_gemm_rate`). A probe
took 0.06-0.1 s in bf16 and 0.22 s in fp32 on a 2-core AMX Xeon: under 0.4 % of the run's time at this spacing."""

_best_rates: dict[tuple, tuple[float, float]] = {}
"""(dtype, hidden, intermediate) → (the best GEMM rate probed in this process, `time.monotonic` of the last probe)."""


def _gemm_rate(dtype: torch.dtype, hidden: int, intermediate: int) -> float:
    """FLOP/s of the fastest of three GEMMs in ``dtype``: squares of 1024 and 2048, and the target's own MLP projection
    over 512 rows; the best such rate probed in this process, probed again where the last probe is `RATE_EVERY_S`
    old. A limit must not be slower than some of the work it bounds: the best rate the cores reach on such dense work
    is the bound, whichever shape reaches it here, and whenever in the run. One probe is not enough on a shared host:
    on a 2-core AMX Xeon the same probe read 840 to 2,145 GFLOP/s in consecutive runs, and a run measured against a
    probe taken in a slow minute read 38 % of its limit where the next run's read 14 % (docs/decisions.md)."""
    key = (dtype, hidden, intermediate)
    best, last = _best_rates.get(key, (0.0, -float("inf")))
    if time.monotonic() - last >= RATE_EVERY_S:
        shapes = ((1024, 1024, 1024), (2048, 2048, 2048), (512, hidden, intermediate))
        best = max(best, best_gemm_rate(dtype, shapes)[0])
        _best_rates[key] = (best, time.monotonic())
    return best


def machine_limit(target: TargetModel, counts: dict) -> dict:
    """The run's work against this machine's limit: its FLOPs (every prompt's prefill, then every answer token's
    decode step, attention at the mean context included; `decode_flops_per_token`) over the best GEMM rate probed
    in this process (`_gemm_rate`: before the run, at its shards, and now) is the fastest this work could go;
    ``ratio_to_limit`` = measured answer tokens/s over that limit's."""
    answers, answer_tokens = counts["answers"], counts["answer_tokens"]
    prompt = counts.get("prompt_tokens", 0) / answers  # mean prompt of one answer
    text = target.config.get_text_config()
    head = 2.0 * text.hidden_size * text.vocab_size  # a prefill keeps one position's logits
    prefill = counts.get("prompt_tokens", 0) * (decode_flops_per_token(target.config, int(prompt / 2)) - head)
    decode = answer_tokens * decode_flops_per_token(target.config, int(prompt + answer_tokens / answers / 2))
    rate = _gemm_rate(target.dtype, text.hidden_size, text.intermediate_size)
    flops_per_answer_token = (prefill + decode) / max(answer_tokens, 1)
    limit = rate / flops_per_answer_token
    return {
        "gemm_gflops": round(rate / 1e9, 1),
        "gflop_per_answer_token": round(flops_per_answer_token / 1e9, 3),
        "limit_tokens_per_s": round(limit, 1),
        "ratio_to_limit": round(counts["tokens_per_s"] / limit, 3),
    }


def limit_words(counts: dict) -> str:
    return (
        f"{counts['tokens_per_s']:.1f} answer tokens/s against this machine's limit of {counts['limit_tokens_per_s']:.0f} "
        f"for the same work (GEMM {counts['gemm_gflops']:.0f} GFLOP/s over {counts['gflop_per_answer_token']:.2f} "
        f"GFLOP per answer token, prefill included): {counts['ratio_to_limit']:.0%} of it"
    )


def main(argv: list[str] | None = None) -> dict:
    """``python -m train.data.answerer`` / ``drafters bench-answerer``: answer N training requests and print answer
    tokens/s beside this machine's limit for the same work (`machine_limit`: its prefill and decode FLOPs over the best
    GEMM rate probed before and during the run) and their ratio."""
    import argparse
    import gzip

    from models.target import TargetConfig

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument(
        "--data", default=str(Path(__file__).parents[1] / "shipped_data" / "smollm2-135m-instruct" / "train.jsonl.gz")
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=AnswerConfig.batch_size)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="fastest", help="fastest: the precision policy's distill choice")
    ap.add_argument("--static", action="store_true", help="static batching (refill = batch size), for comparison")
    ap.add_argument("--out", type=Path, default=Path("outputs") / "answerer_bench")
    args = ap.parse_args(argv)

    from models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.target)
    target = TargetModel.from_config(TargetConfig(name_or_path=args.target, dtype=args.dtype), "distill")
    prepare_target(target)
    print(target.precision.line())
    with gzip.open(args.data, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line, _ in zip(f, range(args.requests))]
    jobs = [Job(r["id"], [[m for m in r["messages"] if m["role"] == "user"][:1]]) for r in rows]
    out = args.out / f"run-{int(time.time())}"
    refill = args.batch_size if args.static else None
    cfg = AnswerConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, refill=refill)
    counts = answer(target, tokenizer, jobs, cfg, out)
    result = {
        **counts,
        "dtype": str(target.dtype).removeprefix("torch."),
        "batch_size": args.batch_size,
        "batching": "static" if args.static else "continuous",
    }
    print(f"at batch {args.batch_size} ({result['batching']} batching) in {result['dtype']}: {limit_words(counts)}")
    with open(args.out / "results.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
