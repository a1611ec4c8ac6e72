"""Opt-in self-distilled samples for raw-text drafter training: training prompts continued by the target itself.

A drafter is measured on the target's own continuations (greedy, T = 0, in the reference report); a weak target's
greedy text repeats itself far more than real code does (distinct-4-gram ratio 0.3 vs 0.85 for the reference target).
Chat recipes regenerate the assistant turns (``scripts/regenerate.py``, REFERENCE.md); raw-text recipes get the same
effect here: the first ``prompt_tokens`` tokens of random training samples, continued by the target for
``new_tokens`` tokens, every token a training target. Written once to a jsonl (``input_ids`` + ``loss_mask``) and
reused on resume.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import datasets

from models.target import TargetModel
from train.data.answerer import AnswerConfig, Job, answer, read_shards


@dataclass
class SelfDistillConfig:
    samples: int = 0
    """Self-distilled samples added to the training set (0 = off)."""
    prompt_tokens: int = 64
    """Leading tokens of a training sample used as the prompt."""
    new_tokens: int = 192
    """Tokens the target generates after each prompt."""
    temperature: float = 0.0
    """0 = greedy (what a T = 0 report measures); > 0 samples."""
    batch_size: int = 32
    """Prompts per batched generate call."""

    def __post_init__(self) -> None:
        if self.samples < 0 or self.prompt_tokens < 1 or self.new_tokens < 1 or self.batch_size < 1:
            raise ValueError("need samples >= 0 and prompt_tokens, new_tokens, batch_size >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")


def write_self_distilled(
    target: TargetModel,
    train_set: datasets.Dataset,
    cfg: SelfDistillConfig,
    path: str | Path,
    pad_id: int,
    seed: int = 0,
    log=print,
) -> None:
    """Continue ``cfg.samples`` random training prompts with the target (`train.data.answerer`: batched, one shard per
    finished batch under ``<path>.shards/``, resumable) and write them as one jsonl of ``input_ids`` + ``loss_mask``
    rows. ``pad_id`` is unused (the answerer's slot layout needs none); kept for the entry scripts' call."""
    rows = train_set.shuffle(seed=seed + 1).filter(lambda ids: len(ids) > cfg.prompt_tokens, input_columns="input_ids")
    if len(rows) < cfg.samples:  # one continuation per prompt: a small split caps the count, said once here
        log(
            f"self-distillation: asked for {cfg.samples} samples, but only {len(rows)} training samples are longer "
            f"than prompt_tokens={cfg.prompt_tokens}; generating {len(rows)}"
        )
    prompts = [ids[: cfg.prompt_tokens] for ids in rows.select(range(min(cfg.samples, len(rows))))["input_ids"]]
    jobs = [Job(str(i), prompt_ids=list(p)) for i, p in enumerate(prompts)]
    settings = AnswerConfig(
        new_tokens=cfg.new_tokens, temperature=cfg.temperature, batch_size=cfg.batch_size, seed=seed
    )
    path = Path(path)
    shards = path.with_name(path.name + ".shards")
    answer(target, None, jobs, settings, shards, desc="self-distillation", log=log, share=(0, 1))  # main process only
    done = read_shards(shards)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps({k: done[j.id][k] for k in ("input_ids", "loss_mask")}) + "\n" for j in jobs)
    tmp.replace(path)
    shutil.rmtree(shards)


def load_self_distilled(
    path: str | Path, features: datasets.Features, cache_dir: str | None = None
) -> datasets.Dataset:
    """The written rows with the training set's features (through load_dataset, so the fingerprint is the file's)."""
    return datasets.load_dataset("json", data_files=str(path), split="train", features=features, cache_dir=cache_dir)
