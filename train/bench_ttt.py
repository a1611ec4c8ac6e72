"""Training throughput of an EAGLE-3 recipe: its own batches through its own training step, with variants of the
recipe's ``drafter`` section interleaved batch by batch so that the machine's drift hits every variant alike.

    python -m train.bench_ttt --config recipes/smollm2-135m/eagle3-cpu-text.yaml --batches 6 \\
        --variant dense drafter.ttt_attention=dense --variant flash drafter.ttt_attention=flash [key=value ...]
    drafters bench-train ...   (the same)

What a step is: everything an optimizer step of a training run with ``grad_accum`` 1 does (`train.eagle3.ttt_step`:
the target's forward, the labels, the unroll, the loss and its backward; then gradient clipping and AdamW), timed by
`models.timing.clock`. Every variant starts from the same drafter (the recipe's ``init_from``, or a fresh one from
the recipe's seed) and reads the same batches: the recipe's seeded (length-grouped) order from its first micro-batch.
One batch per variant runs first as a warm-up and is not counted. Tokens are the batch's real tokens (padding
excluded), as the training log counts them. The mean loss per variant is printed beside the speed: variants that
compute the same thing must agree on it to the rounding of the precision they run in.

Variants may change ``drafter.*`` keys only (the target, data and batches are shared); ``--variant NAME`` with no
override runs the recipe as it is. Nothing is written except the recipe copy in a temporary output folder.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass

import torch
from accelerate.utils import set_seed

from models.config import parse_cli
from models.timing import timed
from train.data.dataset import collate
from train.distributed import make_accelerator
from train.eagle3 import Eagle3RecipeConfig, build_drafter, reference_corpus_writer, ttt_step
from train.loop import load_target_and_data
from train.optim import adamw
from train.schedule import epoch_batch, sample_lengths, schedule, to_device


@dataclass
class VariantResult:
    name: str
    overrides: list[str]
    tokens: int
    seconds: float
    per_batch: list[float]
    """tokens/s of each counted batch."""
    losses: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def line(self) -> str:
        per = sorted(self.per_batch)
        return (
            f"{self.name:>12}: {self.tokens_per_s:7.1f} tokens/s over {self.tokens:,} tokens in {self.seconds:.1f} s "
            f"(per batch {per[0]:.0f}-{per[-1]:.0f}, median {statistics.median(per):.0f}); "
            f"mean loss {sum(self.losses) / len(self.losses):.4f}   [{' '.join(self.overrides) or 'the recipe'}]"
        )


def parse_variants(pairs: list[list[str]]) -> dict[str, list[str]]:
    """``--variant NAME key=value ...`` groups → {name: overrides}; only ``drafter.*`` keys may differ."""
    variants: dict[str, list[str]] = {}
    for name, *overrides in pairs:
        if name in variants:
            raise SystemExit(f"variant {name!r} given twice")
        bad = [o for o in overrides if not o.startswith("drafter.") or "=" not in o]
        if bad:
            raise SystemExit(f"variant {name!r}: only drafter.KEY=VALUE overrides may differ between variants: {bad}")
        variants[name] = overrides
    if not variants:
        raise SystemExit("give at least one --variant NAME [drafter.key=value ...]")
    return variants


def bench(argv: list[str]) -> list[VariantResult]:
    parser = argparse.ArgumentParser(prog="bench_ttt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--batches", type=int, default=6, help="counted batches per variant (after one warm-up)")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"))
    args, overrides = parser.parse_known_args(argv)
    if args.batches < 1:
        raise SystemExit("--batches must be at least 1")
    variants = parse_variants(args.variant)
    with tempfile.TemporaryDirectory() as out:
        base = [*overrides, f"train.output_dir={out}", "train.grad_accum=1", "train.log_with=null"]
        configs = {
            name: parse_cli(Eagle3RecipeConfig, ["--config", args.config, *base, *o]) for name, o in variants.items()
        }
        cfg = next(iter(configs.values()))
        tc = cfg.train
        accelerator, log = make_accelerator(tc, target=cfg.target)
        if accelerator.num_processes != 1:
            raise SystemExit("bench_ttt times one process")
        loaded = load_target_and_data(cfg, accelerator, log, reference_corpus_writer(cfg, log))
        lengths = sample_lengths(loaded.train_set) if tc.group_by_length else None
        per_epoch = schedule(tc, len(loaded.train_set), 1)[0]
        n = args.batches + 1
        order = [
            epoch_batch(len(loaded.train_set), m, per_epoch, tc.seed, 0, 1, tc.batch_size, lengths) for m in range(n)
        ]
        batches = [
            to_device(collate([loaded.train_set[i] for i in ids], loaded.pad_id), accelerator.device) for ids in order
        ]
        runs = {}
        for name, vcfg in configs.items():
            set_seed(tc.seed)  # a fresh drafter starts from the same weights in every variant
            drafter = build_drafter(vcfg, loaded, log).to(accelerator.device)
            optimizer = adamw(drafter, tc.lr, tc.weight_decay)
            runs[name] = (vcfg, drafter, optimizer, VariantResult(name, variants[name], 0, 0.0, [], []))

        def step(name: str, batch: dict[str, torch.Tensor]) -> None:
            vcfg, drafter, optimizer, result = runs[name]
            res = ttt_step(accelerator, drafter, loaded.target, batch, vcfg.drafter)
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), tc.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result.losses.append(float(res.loss.detach()))

        for b, batch in enumerate(batches):
            tokens = int(batch["attention_mask"].sum())
            for name in list(runs)[:: -1 if b % 2 else 1]:  # alternate who goes first
                seconds = timed(lambda n=name, x=batch: step(n, x), accelerator.device)
                result = runs[name][3]
                if b == 0:  # warm-up: kernels chosen, buffers allocated
                    result.losses.clear()
                    continue
                result.tokens += tokens
                result.seconds += seconds
                result.per_batch.append(tokens / seconds)
        results = [run[3] for run in runs.values()]
    shape = f"batch {tc.batch_size}, {args.batches} batches after a warm-up, ttt {cfg.drafter.ttt_steps}"
    print(f"EAGLE-3 training throughput ({args.config}; {shape}; {loaded.target.precision.line()}):")
    for result in results:
        print(result.line())
    return results


def main(argv: list[str] | None = None) -> None:
    bench(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
