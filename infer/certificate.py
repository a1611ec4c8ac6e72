"""Greedy-identity certificate: where a speculative greedy output parts from vanilla, is it rounding or a bug?

At T = 0 the lossless rules emit the target's argmax at every position, so speculative output equals vanilla's
*up to rounding*: vanilla computes a row alone (M = 1), verification computes it among k + 1 rows (M = k + 1), and
the kernels round those two shapes differently. In fp32 that moves a logit by ~1e-7 relative and almost never
flips an argmax; in bf16 logits of magnitude 16–32 are spaced 0.125 apart and 10–13 of 16 answers flipped on a
near-tie (DESIGN.md §7). A certificate must therefore know the served dtype.

The test for one divergence (first position where the outputs differ, vanilla's token ``a``, the candidate's
``b``), after the common prefix:

1. **Replay** the prefix in a higher precision than the served one (fp32 for bf16 / fp16, fp64 for fp32) and in
   the served dtype with vanilla's own shape (the prefix but its last token prefilled into a cache, then that
   token alone, M = 1). ``g = l_hi[a] − l_hi[b]`` is the gap a perfect
   computation would see; ``e = |(l_dt[a] − l_dt[b]) − g|`` is how far the served dtype itself moved that gap here.
2. **Band.** Each of the two runs (vanilla, verify) computed this gap with its own served-dtype error (measured
   ``e`` for vanilla's shape; the verify shape's error is of the same size, hence ``2e``) and rounded each of the
   two logits to the served dtype (half an ulp each, so at most ``2 · ulp/2`` per run, ``2 ulp`` for both):
   ``band = 2e + 2 · ulp_dt(max(|l_hi[a]|, |l_hi[b]|))``, with ``ulp_dt(m) = eps_dt · 2^⌊log2 m⌋`` (bf16 at
   m ∈ [16, 32): 0.125).
3. **Verdict.** Explained by rounding iff ``|g| ≤ band``, or the candidate's token ``b`` is the replay's own
   argmax: then the method emitted the exact greedy token and it was vanilla's served-dtype run that parted from it
   (the band measures vanilla's error on a replay, whose cache is built in one prefill, not token by token as
   vanilla's loop built it, so vanilla's own error there can exceed it). A wrong accept rule emits tokens the target
   does not rank near the top: ``|g|`` is then far outside the band and ``b`` is not the argmax (a test runs one and
   sees it caught).

A prefix relation without a differing token (one output stops where the other goes on) is never explained. Every
report also re-runs T = 0 in fp32 (``greedy_identical_fp32``): the band says a divergence *can* be rounding; the
fp32 pass shows the same method, prompts and rule are token-identical where rounding is ~1e-7.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from infer.kernels.cpu_linear import uninstall as uninstall_cpu_linear


def replay_dtype(served: torch.dtype) -> torch.dtype:
    """The precision a served dtype's divergences are replayed in: one step up (fp32 for 16-bit, fp64 for fp32)."""
    return torch.float64 if served in (torch.float32, torch.float64) else torch.float32


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """Spacing of ``dtype``'s representable numbers at ``|magnitude|``: eps · 2^⌊log2 |m|⌋ (bf16 at 20: 0.125)."""
    m = abs(magnitude)
    if m == 0 or not math.isfinite(m):
        return torch.finfo(dtype).tiny
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(m))


def rounding_band(dtype: torch.dtype, magnitude: float, served_error: float) -> float:
    """Largest exact top-2 gap that two runs of ``dtype`` in different shapes can order differently by rounding:
    each run's own error on the gap (``served_error``, measured, counted twice) plus each logit's rounding to
    ``dtype`` in both runs (2 ulps at ``magnitude``). See the module docstring."""
    return 2.0 * served_error + 2.0 * ulp(dtype, magnitude)


@dataclass
class GreedyComparison:
    identical: bool
    first_divergence: int | None
    """Index into the generated tokens where the outputs first differ (None if identical or one is a prefix)."""
    reference_token: int | None = None
    """Vanilla's token at the divergence."""
    candidate_token: int | None = None
    """The compared method's token there."""
    served_dtype: str = "float32"
    replay_dtype: str = "float64"
    gap: float | None = None
    """l[vanilla's token] − l[candidate's token] in the higher-precision replay (≥ 0 when vanilla was right)."""
    served_gap: float | None = None
    """The same gap in the served dtype, replayed in vanilla's shape."""
    top2_gap: float | None = None
    """Top-1 minus top-2 logit of the replay at the divergence (how close the race was at all)."""
    band: float | None = None
    """`rounding_band` at this position: |gap| within it is explained by the served dtype's rounding."""
    candidate_exact: bool = False
    """The candidate's token is the replay's argmax: the method was right there and vanilla's rounding parted."""

    @property
    def explained(self) -> bool:
        """True when identical, or the divergence is within the served dtype's rounding band, or the candidate's
        token is the exact greedy one (vanilla's served dtype parted from it)."""
        if self.identical:
            return True
        if self.gap is None or self.band is None:
            return False  # one output is a strict prefix of the other: no rounding can do that
        return abs(self.gap) <= self.band or self.candidate_exact

    def as_dict(self) -> dict:
        return {
            "position": self.first_divergence,
            "vanilla_token": self.reference_token,
            "candidate_token": self.candidate_token,
            "served_dtype": self.served_dtype,
            "replay_dtype": self.replay_dtype,
            "gap": self.gap,
            "served_gap": self.served_gap,
            "top2_gap": self.top2_gap,
            "band": self.band,
            "candidate_exact": self.candidate_exact,
            "explained": self.explained,
        }


class Certifier:
    """Replays divergences of one served model; its higher-precision copy is made on the first divergence only
    (fp64 SmolLM2 is 1 GB: a report without divergences never pays for it)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.served = next(model.parameters()).dtype
        self.high = replay_dtype(self.served)
        self._replica: nn.Module | None = None

    def replica(self) -> nn.Module:
        if self._replica is None:
            replica = copy.deepcopy(self.model)
            uninstall_cpu_linear(replica)  # routed layers cache fp32 transposed weights; the replica is another dtype
            self._replica = replica.to(self.high).eval()
        return self._replica

    @torch.no_grad()
    def last_logits(self, model: nn.Module, ids: list[int], one_row: bool = False) -> torch.Tensor:
        """Logits after ``ids`` (float64): one forward over all of them, or (``one_row``) vanilla's shape, the last
        token alone after a cache of the rest."""
        device = next(model.parameters()).device
        if not one_row or len(ids) < 2:
            return model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].double()
        cache = DynamicCache()
        model(input_ids=torch.tensor([ids[:-1]], device=device), cache=cache, use_cache=True)
        last = torch.tensor([ids[-1:]], device=device)
        return model(input_ids=last, cache=cache, use_cache=True).logits[0, -1].double()

    def compare(self, prompt: list[int], reference: list[int], candidate: list[int]) -> GreedyComparison:
        """Compare ``candidate`` with vanilla's ``reference`` (both continuations of ``prompt``)."""
        n = min(len(reference), len(candidate))
        first = next((i for i in range(n) if reference[i] != candidate[i]), None)
        names = {"served_dtype": str(self.served).removeprefix("torch."), "replay_dtype": str(self.high)[6:]}
        if first is None:
            return GreedyComparison(len(reference) == len(candidate), None, **names)
        a, b = reference[first], candidate[first]
        prefix = prompt + reference[:first]
        high = self.last_logits(self.replica(), prefix)
        low = self.last_logits(self.model, prefix, one_row=True)
        gap, served_gap = float(high[a] - high[b]), float(low[a] - low[b])
        magnitude = max(abs(float(high[a])), abs(float(high[b])))
        top = high.topk(2).values
        return GreedyComparison(
            identical=False,
            first_divergence=first,
            reference_token=a,
            candidate_token=b,
            gap=gap,
            served_gap=served_gap,
            top2_gap=float(top[0] - top[1]),
            band=rounding_band(self.served, magnitude, abs(served_gap - gap)),
            candidate_exact=int(high.argmax()) == b,
            **names,
        )


def compare_greedy(model: nn.Module, prompt: list[int], reference: list[int], candidate: list[int]) -> GreedyComparison:
    """One comparison with a fresh `Certifier` (reports keep one per model, so the replica is made once)."""
    return Certifier(model).compare(prompt, reference, candidate)
