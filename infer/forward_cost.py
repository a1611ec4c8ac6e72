"""What one target forward costs the way the runtime runs it: the one function every cost of a forward is timed with.

`forward_timings` prefills a context into the runtime's own cache (`infer.generate.prefill`), then times, interleaved,
the verify forward over a chain of n nodes (`infer.generate.verify_tree`: 4D ancestor mask, explicit positions,
logits of every node) and the batch-1 vanilla loops' one-token step (`infer.generate.vanilla_steps`), each call cut
back to the same cache. The cost curve (`eval.cost_curve`: sizing, the vanilla check) reads it on the served target;
the precision policy reads it through `ServedForward` on a model of the target's shape in each candidate dtype.

Why one function: the policy had timed its own forward (HF cache, no mask, a 1- and an 8-layer probe extrapolated to
30 layers) and the report's sizing the runtime's. Timed interleaved in one process on SmolLM2, the runtime's forward,
the probe's forward on the real weights and a full-depth random-weight probe agreed within the host's noise; the
extrapolation did not: it weighs the 1-layer time by -(L - 1) / 7 = -4.1, so a disturbed call of the small probe made
a larger forward look cheaper (docs/decisions.md, "The policy times the runtime's forward").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from infer.generate import VANILLA_LOOPS, DecodeState, prefill, vanilla_steps, verify_tree
from infer.kernels.cpu_decode_attention import serve_shared_heads
from infer.kernels.cpu_linear import install as install_cpu_linear
from infer.sampling import SamplingParams
from infer.tree import chain
from models.target import TargetModel
from models.timing import RETRIES, Timing, interleaved

Key = int | str
"""A node count (a verify forward over a chain of that many nodes) or a vanilla loop's name ("plain", "masked")."""


@torch.inference_mode()  # as decoding runs: with autograd on, the routed CPU layouts fall back to F.linear
def forward_timings(
    target: TargetModel,
    context: list[int],
    sizes: Sequence[int],
    reps: int,
    aux: bool = False,
    rows: int = 1,
    loops: Sequence[str] = (),
) -> dict[Key, Timing]:
    """Seconds of one target forward after ``context``, the runtime's way, timed in turn ``reps`` times after one
    untimed round (`models.timing.interleaved`; a key whose calls spread wider than ``MAX_SPREAD`` is timed again, up
    to ``RETRIES`` times): for each n of ``sizes``, ``verify_tree`` over a chain of n nodes on ``rows`` rows that
    each hold ``context`` (``aux``: with the aux-layer taps EAGLE-3 asks for); for each name of ``loops``, that batch-1
    vanilla loop's one-token step in its own cache. Every call cuts its cache back, so all see ``len(context) - 1``
    cached tokens; a cache that grew anyway raises."""
    calls: dict[Key, object] = {}
    if sizes:
        state = DecodeState([context] * rows, SamplingParams(max_new_tokens=1), (), target.device)
        prefill(target, state, capture_aux=aux)
        slots = state.kv_valid.shape[1]
        trees = {n: chain(torch.randint(0, target.vocab_size, (rows, n), device=target.device)) for n in sizes}

        def run(n: int) -> None:
            verify_tree(target, state, trees[n], capture_aux=aux)
            for layer in state.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, :slots], layer.values[:, :, :slots]

        calls.update({n: lambda n=n: run(n) for n in sizes})
    if loops:
        if rows != 1:
            raise ValueError("the vanilla loops' step is timed at batch 1; at a batch time verify of 1 node")
        steps = vanilla_steps(target, context)
        calls.update({name: steps[name] for name in loops})
    times = interleaved(calls, reps, target.device, retries=RETRIES)
    if sizes and any(layer.keys.shape[2] != slots for layer in state.cache.layers):
        raise RuntimeError("the cache grew during timing: later sizes saw a longer context")
    return times


SERVE_REPS = 7
"""Timed calls per size when the precision policy times a serving curve (each after one untimed round)."""


class ServedForward:
    """How the runtime serves a target on this device, as the precision policy needs it (`models.precision_curves.
    ServingPath`): calling it installs the CPU kernel routing (`infer.kernels.cpu_linear`, silently) and the served
    attention (`infer.kernels.cpu_decode_attention.serve_shared_heads`), and
    `forward_ms` times a forward of that model the way the runtime runs it (`forward_timings`)."""

    def __call__(self, model: nn.Module) -> None:
        if next(model.parameters()).device.type == "cpu":
            install_cpu_linear(model, lambda msg: None)
            serve_shared_heads(model)

    def forward_ms(self, model: nn.Module, rows: int, prefix: int, batch: int = 1) -> Timing:
        """Milliseconds of the forward the runtime runs for ``rows`` new tokens per sequence after a ``prefix``-token
        cache, on ``batch`` sequences: at one row and batch 1 the faster vanilla loop's step (the baseline runs in
        that loop, `eval.measure.choose_vanilla_loop`), otherwise the verify forward over a chain of ``rows`` nodes
        (speculation's; at one row and a batch, the batched step)."""
        target = TargetModel(model)
        ids = torch.randint(target.vocab_size, (prefix + 1,), generator=torch.Generator().manual_seed(0)).tolist()
        if rows == 1 and batch == 1:
            times = forward_timings(target, ids, (), SERVE_REPS, loops=VANILLA_LOOPS)
            timing = min(times.values(), key=lambda t: t.best)
        else:
            timing = forward_timings(target, ids, (rows,), SERVE_REPS, rows=batch)[rows]
        return Timing(tuple(1e3 * s for s in timing.samples))


quiet_routing = ServedForward()
"""The serving path every entry point hands the precision policy (as ``prepare``) and installs on its probes."""
