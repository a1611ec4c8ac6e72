"""Which samples each rank trains on, and when: the step schedule, explicit epoch sharding (one seeded permutation per
epoch, cut into global batches of world × batch_size, rank r taking its slice of each, so resuming at micro-batch m
replays nothing and skips nothing), length-grouped batches, the check that ranks never share a sample, and the
held-out batches.
"""

from __future__ import annotations

import functools

import torch
from accelerate import Accelerator

from models.acceptance import walked_chain
from train.config import TrainConfig
from train.data.dataset import collate


@functools.lru_cache(maxsize=2)
def _epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    # one permutation per epoch, not per micro-batch: O(N) each, and the 8B recipes' N is ~1e6 (read-only result)
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


GROUP_MEGABATCH = 50
"""Global batches per length group of `group_by_length` (HF's LengthGroupedSampler uses 50 too)."""
_GROUPED: dict[tuple, torch.Tensor] = {}


def _grouped_order(lengths: torch.Tensor, seed: int, epoch: int, group: int) -> torch.Tensor:
    """The epoch's random order, sorted by length (longest first) within chunks of GROUP_MEGABATCH global batches,
    cut into global batches of ``group``, whose order is shuffled (seeded; the short last batch stays last, where
    the epoch's remainder is dropped). Every rank computes the same order, so their slices stay disjoint."""
    key = (lengths.data_ptr(), lengths.numel(), seed, epoch, group)
    if key not in _GROUPED:
        perm = _epoch_order(lengths.numel(), seed, epoch)
        chunks = [c[lengths[c].argsort(descending=True, stable=True)] for c in perm.split(group * GROUP_MEGABATCH)]
        batches = list(torch.cat(chunks).split(group))
        full = [b for b in batches if len(b) == group]
        shuffle = torch.randperm(len(full), generator=torch.Generator().manual_seed(seed * 100_019 + epoch))
        _GROUPED.clear()
        _GROUPED[key] = torch.cat([full[i] for i in shuffle.tolist()] + batches[len(full) :])
    return _GROUPED[key]


def sample_lengths(train_set) -> torch.Tensor:
    """Tokens per sample of a tokenized dataset (`group_by_length`)."""
    return torch.tensor([len(ids) for ids in train_set["input_ids"]])


def epoch_batch(
    num_samples: int,
    micro: int,
    per_epoch: int,
    seed: int,
    rank: int,
    world: int,
    bs: int,
    lengths: torch.Tensor | None = None,
) -> list[int]:
    """Sample indices of this rank's micro-batch number ``micro`` (global batches of world·bs, seeded per epoch);
    with ``lengths`` (`TrainConfig.group_by_length`), batches of similar length."""
    epoch, g = divmod(micro, per_epoch)
    start = g * world * bs + rank * bs
    if lengths is None:
        order = _epoch_order(num_samples, seed, epoch)
    else:
        order = _grouped_order(lengths, seed, epoch, world * bs)
    return order[start : start + bs].tolist()


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def schedule(tc: TrainConfig, num_samples: int, world: int) -> tuple[int, int, int]:
    """(micro-batches per epoch per rank, optimizer steps, warm-up steps); the remainder of an epoch is dropped on
    every rank alike."""
    per_epoch = num_samples // (world * tc.batch_size)
    if per_epoch == 0:
        raise SystemExit(f"{num_samples} samples are fewer than one global batch ({world} x {tc.batch_size})")
    total_steps = int(tc.epochs * per_epoch) // tc.grad_accum
    total_steps = min(total_steps, tc.max_steps or total_steps)
    warmup = max(1, round(tc.warmup_ratio * total_steps)) if tc.warmup_ratio else 0
    return per_epoch, total_steps, warmup


def check_sharding(
    accelerator: Accelerator, tc: TrainConfig, num_samples: int, per_epoch: int, lengths: torch.Tensor | None = None
) -> dict:
    """Every rank's first-epoch samples, gathered: raises if two ranks would train on the same sample."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = torch.tensor(
        [
            i
            for m in range(per_epoch)
            for i in epoch_batch(num_samples, m, per_epoch, tc.seed, rank, world, tc.batch_size, lengths)
        ]
    )
    every = accelerator.gather(mine.to(accelerator.device)).cpu()
    sharding = {
        "world": world,
        "distributed_type": str(accelerator.distributed_type),
        "samples_per_rank": len(mine),
        "distinct_over_ranks": int(every.unique().numel()),
        "total_over_ranks": int(every.numel()),
    }
    if sharding["distinct_over_ranks"] != sharding["total_over_ranks"]:
        raise RuntimeError(f"ranks would train on overlapping samples: {sharding}")
    return sharding


def eval_shares(accelerator: Accelerator, tc: TrainConfig, eval_set) -> list[list[int]]:
    """This rank's share of the first ``tc.eval_samples`` held-out samples, as the index lists `eval_batches`
    collates, batch by batch (rank r takes samples r, r + world, ...)."""
    n = min(len(eval_set), tc.eval_samples)
    mine = list(range(accelerator.process_index, n, accelerator.num_processes))
    return [mine[s : s + tc.batch_size] for s in range(0, len(mine), tc.batch_size)]


def eval_batches(accelerator: Accelerator, tc: TrainConfig, eval_set, pad_id: int):
    """Collated batches of this rank's share of the first ``tc.eval_samples`` held-out samples (callers sum their
    counts and reduce them over ranks), in the order of `eval_shares`."""
    for ids in eval_shares(accelerator, tc, eval_set):
        yield to_device(collate([eval_set[i] for i in ids], pad_id), accelerator.device)


class SampleHits:
    """Top-1 hits and scored positions per held-out sample and draft position, ``counts`` [n, depth, 2] (hits,
    positions), summed over ranks by `total`. Two drafters evaluated on the same held-out samples give two such
    tables whose rows pair up: what a paired interval of their acceptance gain needs
    (`eval.rows.paired_ratio_gain`); the summed table divides to the evaluation's own per-position accuracy."""

    def __init__(self, accelerator: Accelerator, tc: TrainConfig, eval_set, depth: int):
        self.accelerator = accelerator
        n = min(len(eval_set), tc.eval_samples)
        self.counts = torch.zeros(n, depth, 2, dtype=torch.long, device=accelerator.device)
        self.walks = torch.zeros(n, 3, dtype=torch.long, device=accelerator.device)

    def add(self, ids: list[int], depth: int, scored: torch.Tensor, hit: torch.Tensor) -> None:
        """One batch at one draft position: ``ids`` its rows' sample indices (`eval_shares`), ``scored`` [B, T] bool
        the places scored there, ``hit`` [N] bool whether each was a top-1 hit, in ``scored``'s row-major order
        (the order ``logits[scored]`` has)."""
        index = torch.as_tensor(ids, device=self.counts.device)
        rows = scored.nonzero(as_tuple=True)[0]
        self.counts[:, depth, 0].index_add_(0, index[rows], hit.long())
        self.counts[:, depth, 1].index_add_(0, index, scored.sum(1).long())

    def walk(self, ids: list[int], by_root: torch.Tensor, spans: list[list[tuple[int, int]]]) -> None:
        """One batch's answers (``spans``, `train.losses.answer_spans`) decoded by greedy chains as deep as the
        evaluation, replayed on its hits (``by_root`` [depth, B, T], `train.losses.hits_by_root`;
        `models.acceptance.walked_chain`)."""
        maps = by_root.permute(1, 0, 2).tolist()  # plain lists: the walk reads them one by one
        for b, sample in enumerate(ids):
            for start, end in spans[b]:
                w = walked_chain(maps[b], start, end, len(maps[b]))
                self.walks[sample] += torch.tensor(w, device=self.walks.device)

    def total(self) -> list[list[list[int]]]:
        """The table summed over ranks, as nested lists (sample, position, (hits, positions))."""
        return self.accelerator.reduce(self.counts, "sum").tolist()

    def walked(self) -> list[list[int]]:
        """Each sample's replayed chains summed over its answers and over ranks: (tokens, rounds, rounds whose first
        draft was accepted); τ and served-style α1 are ratios of their sums."""
        return self.accelerator.reduce(self.walks, "sum").tolist()
