"""The run's accelerator and the engines that split it over ranks: DDP, DeepSpeed (ZeRO) and FSDP, on GPUs and on CPU
ranks (DESIGN.md §7); what a recipe needs to know of the split (``sharded``, ``full_state``), the DeepSpeed batch
settings filled from the recipe, and the optimizer's share of the trained weights on each rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs

from models.allocator import keep_freed_memory
from models.target import TargetConfig
from train.config import TrainConfig
from train.optim import mixed_precision


def _engine_requested() -> str | None:
    """ "deepspeed" / "fsdp" when ``accelerate launch`` was given such a config (it says so in the environment)."""
    for name in ("DEEPSPEED", "FSDP"):
        if os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true":
            return name.lower()
    return None


def make_accelerator(
    tc: TrainConfig, find_unused: bool = False, target: TargetConfig | None = None
) -> tuple[Accelerator, Callable[[str], None]]:
    """The run's Accelerator and a ``log`` that prints on the main process only. ``find_unused``: some trainable
    parameters get no gradient in some steps (Medusa-2's heads warm-up), which DDP must be told.

    Gradient accumulation is accelerate's (``accumulate``): it skips DDP's all-reduce between boundaries and tells
    DeepSpeed where they are, which runs the update inside ``backward``.

    CPU ranks under DeepSpeed / FSDP (DESIGN.md §7): accelerate's ``cpu=True`` turns both engines off, and without
    it accelerate finds no device and reports one process. So without CUDA an engine run asks for the gloo backend
    explicitly, which gives the real world size; FSDP, which accelerate enables for accelerator devices only, is
    then switched on here for the CPU ranks (``_fsdp_on_cpu``)."""
    keep_freed_memory()  # a training step allocates its big tensors anew each time (models/allocator.py)
    engine = _engine_requested()
    # A recipe that puts the target on the CPU trains there too, also where CUDA exists: the batches follow the
    # accelerator's device, and the target's forward needs them on its own.
    on_cpu = not torch.cuda.is_available() or (target is not None and target.device == "cpu")
    autocast, precision = mixed_precision(tc.mixed_precision, target)
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)] if find_unused else []
    if engine and on_cpu:
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    accelerator = Accelerator(
        cpu=on_cpu and engine is None,
        mixed_precision=autocast,
        gradient_accumulation_steps=tc.grad_accum,
        log_with=tc.log_with,
        project_dir=tc.output_dir,
        kwargs_handlers=handlers or None,
    )
    if engine == "fsdp" and accelerator.distributed_type == DistributedType.NO and accelerator.num_processes > 1:
        _fsdp_on_cpu(accelerator)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # accelerate registers its DeepSpeed config with transformers, and under ZeRO-3 from_pretrained would then
        # partition the frozen target as it loads; only the trained drafter goes to the engine
        from transformers.integrations import unset_hf_deepspeed_config

        accelerator.state.deepspeed_plugin.dschf = None
        unset_hf_deepspeed_config()

    def log(msg: str) -> None:
        if accelerator.is_main_process:
            print(msg, flush=True)

    log(
        f"world {accelerator.num_processes} ({accelerator.distributed_type}), precision {accelerator.mixed_precision}, "
        f"device {accelerator.device}, threads/rank {torch.get_num_threads()}"
    )
    log(precision.line())
    return accelerator, log


def _fsdp_on_cpu(accelerator: Accelerator) -> None:
    """FSDP for CPU ranks: accelerate has the process group (gloo, real world size) and the launcher's FSDP settings
    in the environment, but enables FSDP only for GPU-like device types; the plugin it would build is set here."""
    from accelerate.state import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def sharded(accelerator: Accelerator) -> bool:
    """True when the engine splits the trained weights across ranks (ZeRO-3, FSDP): the module in hand is then not
    the whole drafter, and saving it needs ``full_state`` first."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.state.deepspeed_plugin.zero_stage == 3
    return False


def full_state(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Collective (every rank calls it): the whole state dict of a sharded ``model`` on the main process (None on the
    others, and None when nothing is sharded: the module in hand is then complete)."""
    if not sharded(accelerator):
        return None
    state = accelerator.get_state_dict(model)
    return {k: v.detach().cpu().clone() for k, v in state.items()} if accelerator.is_main_process else None


def fill_deepspeed_config(accelerator: Accelerator, tc: TrainConfig) -> None:
    """The recipe decides batch size, accumulation and clipping; a DeepSpeed JSON leaves them "auto" (the shipped
    ones do) or must agree. Without a dataloader in ``prepare`` accelerate cannot fill "auto" batch sizes itself."""
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    wanted = {
        "train_micro_batch_size_per_gpu": tc.batch_size,
        "gradient_accumulation_steps": tc.grad_accum,
        "train_batch_size": tc.batch_size * tc.grad_accum * accelerator.num_processes,
        "gradient_clipping": tc.grad_clip,
    }
    for key, value in wanted.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
        elif float(ds[key]) != value:
            raise SystemExit(
                f"the DeepSpeed config sets {key}={ds[key]} but the recipe gives {value} (train.batch_size, "
                'train.grad_accum, train.grad_clip and the world size): set it to "auto" or change the recipe'
            )


def optimizer_numel(accelerator: Accelerator, optimizer: torch.optim.Optimizer, trainable: int) -> dict:
    """Parameter elements the optimizer updates on this rank, summed over ranks, beside the trainable count: DDP
    holds world × trainable, ZeRO / FSDP about trainable (partitions, plus padding), and a frozen target never
    appears (it would add its whole size)."""
    from torch.distributed.tensor import DTensor

    inner = optimizer.optimizer  # under accelerate's wrapper
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # ZeRO's flat fp32 partitions: ZeRO-1/2 keep them in its torch optimizer's groups, ZeRO-3 hands them to it
        # only during the step
        if accelerator.state.deepspeed_plugin.zero_stage == 3:
            params = inner.fp32_partitioned_groups_flat
        else:
            params = [p for group in inner.optimizer.param_groups for p in group["params"]]
    else:
        params = [p for group in inner.param_groups for p in group["params"]]
    # FSDP's parameters are DTensors, whose numel() is the global size
    mine = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    total = accelerator.reduce(torch.tensor([mine], device=accelerator.device), "sum")
    return {"trainable_numel": trainable, "optimizer_numel_over_ranks": int(total.item())}
