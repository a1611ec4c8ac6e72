"""Target signals for drafter training: online (a target forward per batch) or offline (cached safetensors shards).

What a drafter step needs from the target, per token: the aux features (A·H) and the target's logits. Offline we
cache the aux features and the final-norm hidden state (H) instead of the logits (V ≫ H: 8× smaller for the
reference target, 30× for Llama-3.1-8B) and recompute ``lm_head(last_hidden)`` during training, which costs one
H×V matmul instead of a whole target forward. Storage is the known pain point of offline EAGLE-3 training
(REFERENCE.md: ~740 GB for ShareGPT at H = 4096), so the writer prints the projected size first and refuses to start
when the disk lacks room.

Cache layout (``<dir>/``): ``shard-r{rank}-{k}.safetensors`` with the samples' tokens concatenated (``input_ids``,
``loss_mask``, optional ``position_ids``, ``aux_hidden``, ``last_hidden``) plus ``offsets`` and ``sample_index``;
``index.json`` (written last, by the main process) lists the shards and a key of everything that determines the
features, so a stale cache is rebuilt instead of silently reused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from models.target import TargetModel, TargetOutput
from train.data.dataset import collate, packed_attention_mask

FEATURE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
INDEX = "index.json"


# ------------------------------------------------------------------------------------------- online
def attention_masks(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(allowed [B, T, T] bool for the drafter, position_ids [B, T], sample_ids [B, T] or None).

    Right-padded rows: causal over the valid keys. Packed rows (``position_ids`` present): block-diagonal causal.
    """
    ids = batch["input_ids"]
    B, T = ids.shape
    if "position_ids" in batch:
        positions = batch["position_ids"]
        return packed_attention_mask(positions)[:, 0], positions, (positions == 0).long().cumsum(-1)
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    allowed = causal[None] & batch["attention_mask"].bool()[:, None, :]
    allowed |= torch.eye(T, dtype=torch.bool, device=ids.device)[None]  # pad queries: never an empty softmax row
    return allowed, torch.arange(T, device=ids.device).expand(B, T), None


def target_forward(target: TargetModel, batch: dict[str, torch.Tensor], logits: bool = True) -> TargetOutput:
    """One target forward over a collated batch (right-padded, or packed with a block-diagonal mask); gradients
    follow the caller's grad mode.

    ``logits=False``: the head runs on the last position only (the offline cache stores the final-norm hidden state
    instead, and a 49k-wide head over every token costs ~10 % of SmolLM2's forward)."""
    keep = 0 if logits else 1
    if "position_ids" in batch:
        allowed = packed_attention_mask(batch["position_ids"])
        mask = torch.zeros(allowed.shape, dtype=target.dtype, device=allowed.device)
        mask = mask.masked_fill(~allowed, torch.finfo(target.dtype).min)
        return target(batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"], logits_to_keep=keep)
    return target(batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=keep)


@torch.no_grad()
def target_signals(target: TargetModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux features [B, T, A·H], final-norm hidden [B, T, H]) from the cached features or one target forward; the
    target's head runs later, only where a loss reads it (`train.losses.ttt_targets`)."""
    if "aux_hidden" in batch:
        return batch["aux_hidden"], batch["last_hidden"].to(target.dtype)
    out = target_forward(target, batch, logits=False)
    return out.aux_hidden, out.last_hidden


def final_hidden(target: TargetModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The target's final-norm hidden state [B, T, H] (what its lm_head reads; Medusa's input), from the cached
    features or one target forward. Gradients flow into the target when it is trainable (joint training)."""
    if "last_hidden" in batch:
        return batch["last_hidden"].to(target.dtype)
    with torch.set_grad_enabled(target.mode != "frozen" and torch.is_grad_enabled()):
        return target_forward(target, batch, logits=False).last_hidden


# ------------------------------------------------------------------------------------------ offline
def projected_bytes(num_tokens: int, hidden_size: int, num_aux: int, dtype: str) -> int:
    """Disk bytes of a cache: (A + 1)·H feature values per token plus ids (int32), mask and positions."""
    elem = torch.finfo(FEATURE_DTYPES[dtype]).bits // 8
    return num_tokens * ((num_aux + 1) * hidden_size * elem + 4 + 1 + 4)


def cache_key(target: TargetModel, dataset_fingerprint: str, dtype: str, num_samples: int) -> str:
    payload = json.dumps(
        [
            str(target.name_or_path),
            target.aux_layer_ids,
            target.vocab_size,
            target.hidden_size,
            dataset_fingerprint,
            dtype,
            num_samples,
        ]
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def cache_is_valid(out_dir: str | Path, key: str) -> bool:
    index = Path(out_dir) / INDEX
    return index.exists() and json.loads(index.read_text()).get("key") == key


@torch.no_grad()
def write_feature_cache(
    accelerator: Accelerator,
    target: TargetModel,
    dataset,
    out_dir: str | Path,
    key: str,
    dtype: str = "bfloat16",
    batch_size: int = 8,
    pad_id: int = 0,
    shard_tokens: int = 1 << 20,
    log=print,
) -> None:
    """Run the target over ``dataset`` (rows rank::world on each rank) and write shards + index.json.

    Raises SystemExit before any compute when the projected size exceeds the free disk space (plus 5 % margin).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [len(x) for x in dataset["input_ids"]]
    num_tokens = sum(lengths)
    need = projected_bytes(num_tokens, target.hidden_size, len(target.aux_layer_ids), dtype)
    _check_disk(out, need, f"{len(dataset)} samples, {num_tokens:,} tokens", dtype, log)
    if accelerator.is_main_process:  # from here until the new index is written, no run takes this cache as valid
        (out / INDEX).unlink(missing_ok=True)
    accelerator.wait_for_everyone()
    for stale in out.glob(f"shard-r{accelerator.process_index}-*.safetensors"):
        stale.unlink()
    torch_dtype = FEATURE_DTYPES[dtype]
    rows = list(range(accelerator.process_index, len(dataset), accelerator.num_processes))
    # batches of similar length: right padding costs a full target forward per padded token (the shards record
    # each sample's index, so the order on disk does not matter)
    rows.sort(key=lambda i: lengths[i])
    rank = accelerator.process_index
    shard: dict[str, list] = {}
    shard_id, shard_len = 0, 0
    bar = tqdm(total=len(rows), desc="offline features", disable=not accelerator.is_main_process)
    for start in range(0, len(rows), batch_size):
        idx = rows[start : start + batch_size]
        samples = [dataset[i] for i in idx]
        batch = {k: v.to(target.device) for k, v in collate(samples, pad_id).items()}
        fwd = target_forward(target, batch, logits=False)
        for j, i in enumerate(idx):
            n = len(samples[j]["input_ids"])
            parts = {
                "input_ids": batch["input_ids"][j, :n].to(torch.int32),
                "loss_mask": batch["loss_mask"][j, :n].to(torch.int8),
                "aux_hidden": fwd.aux_hidden[j, :n].to(torch_dtype),
                "last_hidden": fwd.last_hidden[j, :n].to(torch_dtype),
            }
            if "position_ids" in batch:
                parts["position_ids"] = batch["position_ids"][j, :n].to(torch.int32)
            for name, value in parts.items():
                shard.setdefault(name, []).append(value.cpu())
            shard.setdefault("sample_index", []).append(i)
            shard_len += n
        if shard_len >= shard_tokens:
            _save_shard(out, rank, shard_id, shard, need)
            shard, shard_id, shard_len = {}, shard_id + 1, 0
        bar.update(len(idx))
    bar.close()
    if shard:
        _save_shard(out, rank, shard_id, shard, need)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shards = sorted(p.name for p in out.glob("shard-r*-*.safetensors"))
        index = {
            "key": key,
            "shards": shards,
            "samples": len(dataset),
            "tokens": num_tokens,
            "dtype": dtype,
            "bytes": sum((out / s).stat().st_size for s in shards),
        }
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        log(f"offline features written: {index['bytes'] / 2**30:.2f} GiB in {len(shards)} shards")
    accelerator.wait_for_everyone()


def _check_disk(out: Path, need: int, what: str, dtype: str, log) -> None:
    """Stop before any compute when the projected cache (``need`` bytes) would not fit in the free space (+ 5 %)."""
    free = shutil.disk_usage(out).free
    log(f"offline features: {what} → projected {need / 2**30:.2f} GiB ({dtype}) in {out}; free {free / 2**30:.1f} GiB")
    if need * 1.05 > free:
        raise SystemExit(
            f"not enough disk for the feature cache: need {need / 2**30:.2f} GiB, {free / 2**30:.1f} GiB free in {out}"
        )


def _save_shard(out: Path, rank: int, shard_id: int, shard: dict[str, list], need: int) -> None:
    """One shard file of rank ``rank``: every sample's tensors concatenated, with their offsets and sample indices.
    A disk that fills now stops the run (``need``: the projected cache size, for the message)."""
    lengths = torch.tensor([len(x) for x in shard["input_ids"]])
    tensors = {name: torch.cat(parts) for name, parts in shard.items() if name != "sample_index"}
    tensors["offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    tensors["sample_index"] = torch.tensor(shard["sample_index"], dtype=torch.long)
    path = out / f"shard-r{rank}-{shard_id:05d}.safetensors"
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        # the disk filled after the check (another writer, a quota): the half shard goes, and with no index.json
        # written the partial cache is never read; the next run writes it again
        path.unlink(missing_ok=True)
        written = sum(p.stat().st_size for p in out.glob("shard-r*-*.safetensors"))
        raise SystemExit(
            f"the disk filled while writing the feature cache in {out}: shard {shard_id} of rank {rank} failed "
            f"({e.strerror}) with {written / 2**30:.2f} GiB of the projected {need / 2**30:.2f} GiB written. Free "
            "space (or set train.features_dir elsewhere) and run again; the incomplete cache is not used"
        ) from e


# ----------------------------------------------------------------------------------------- reading
class FeatureCache(torch.utils.data.Dataset):
    """The cached samples in dataset order; each item holds tokens plus ``aux_hidden`` [T, A·H] / ``last_hidden`` [T, H]."""

    def __init__(self, out_dir: str | Path) -> None:
        self.dir = Path(out_dir)
        index = json.loads((self.dir / INDEX).read_text())
        entries = []
        for name in index["shards"]:
            with safe_open(str(self.dir / name), "pt") as f:
                offsets = f.get_tensor("offsets").tolist()
                sample_index = f.get_tensor("sample_index").tolist()
            entries += [(i, name, offsets[j], offsets[j + 1]) for j, i in enumerate(sample_index)]
        entries.sort()
        if [e[0] for e in entries] != list(range(index["samples"])):
            raise ValueError(f"{self.dir}: shards do not hold samples 0..{index['samples'] - 1} exactly once")
        self.entries = [e[1:] for e in entries]
        self._files: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        name, start, end = self.entries[i]
        if name not in self._files:  # safe_open memory-maps the file; keep one handle per shard
            self._files[name] = safe_open(str(self.dir / name), "pt")
        f = self._files[name]
        return {k: f.get_slice(k)[start:end] for k in f.keys() if k not in ("offsets", "sample_index")}


def collate_features(samples: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad cached samples: the token fields as `train.data.collate`, features with zeros [B, T, ·]."""
    batch = collate(
        [
            {k: samples[i][k].tolist() for k in samples[i] if k in ("input_ids", "loss_mask", "position_ids")}
            for i in range(len(samples))
        ],
        pad_id,
    )
    T = batch["input_ids"].shape[1]
    for name in ("aux_hidden", "last_hidden"):
        width = samples[0][name].shape[-1]
        out = torch.zeros(len(samples), T, width, dtype=samples[0][name].dtype)
        for i, sample in enumerate(samples):
            out[i, : sample[name].shape[0]] = sample[name]
        batch[name] = out
    return batch
