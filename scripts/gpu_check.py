"""GPU check of the verify kernels (``infer/kernels``): every kernel-vs-reference comparison on large random
inputs, and timings of kernel vs torch reference, written as a markdown table.

    python scripts/gpu_check.py [--out docs/gpu_check.md] [--repeats 20]

Needs CUDA (exits 2 without it). Sizes: B in {1, 16, 64}, n in {16, 60}, V in {8192, 128256} for greedy
(fp32 logits, bf16 logits, argmax input) and rejection sampling (stochastic and one-hot q); KV compaction of
a [B, 8, 2048, 128] bf16 cache for B in {1, 16, 64}; plus edge cases (tied logits, zeros in p and q, all-zero
residuals, strided caches). Times are the median of ``--repeats`` calls, each bracketed by
``torch.cuda.synchronize()``, after two warm-up calls (Triton compiles on the first). About a minute on
an H200, most of it Triton compiling each specialisation once.

Greedy and compaction must be bit-identical. Rejection rows may differ from the reference only at
rounding-level ties (the reference's CUDA cumsum is a float32 scan, the kernel's CDF float64; row sums over
V are reduced in different orders): every differing row must be within 1e-5 of a float64 replay
(``infer.kernels.rejection_disagreement``), and at most 5% of rows (at least 1) may differ: with a flat
target over V = 128256 about 0.4% of rows are expected to differ in the bonus token, while a systematic
error small enough to pass the float64 tolerance (an off-by-one in the CDF) would move most rows.

``--smoke-cpu`` runs tiny sizes through Triton's interpreter on the CPU, to test this script itself; its report goes
to the temporary folder unless ``--out`` is given (its timings mean nothing, and it must not replace the GPU's).
Exit status: 0 all checks passed, 1 a check failed, 2 no CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from infer.accept import AcceptResult, accept_greedy, accept_rejection  # noqa: E402
from infer.kernels import (  # noqa: E402
    compact_kv,
    compact_kv_reference,
    rejection_disagreement,
    verify_greedy,
    verify_rejection,
)
from infer.tree import DraftTree  # noqa: E402
from models.timing import synchronize, timed  # noqa: E402

TIE_TOL = 1e-5
MAX_TIE_FRACTION = 0.05


class Checker:
    """Collects table rows and failures."""

    def __init__(self, device: str, repeats: int) -> None:
        self.device = device
        self.repeats = repeats
        self.rows: list[tuple[str, str, str, str, str, str]] = []
        self.failures: list[str] = []

    def sync(self) -> None:
        synchronize(self.device)

    def median_ms(self, fn: Callable[[], object]) -> float:
        fn()
        fn()  # warm-up: Triton compiles on the first call, the allocator settles on the second
        self.sync()
        return statistics.median(timed(fn, self.device) for _ in range(self.repeats)) * 1e3

    def add(
        self,
        op: str,
        shape: str,
        ref_fn: Callable[[], object] | None,
        kernel_fn: Callable[[], object] | None,
        ok: bool,
        result: str,
    ) -> None:
        t_ref = self.median_ms(ref_fn) if ref_fn else float("nan")
        t_ker = self.median_ms(kernel_fn) if kernel_fn else float("nan")
        speed = f"{t_ref / t_ker:.1f}x" if ref_fn and kernel_fn else ""
        fmt = lambda t: "" if t != t else f"{t:.3f}"  # noqa: E731  (nan -> empty cell)
        self.rows.append((op, shape, fmt(t_ref), fmt(t_ker), speed, ("ok: " if ok else "FAIL: ") + result))
        if not ok:
            self.failures.append(f"{op} {shape}: {result}")
        print(" | ".join(self.rows[-1]), flush=True)

    def table(self) -> str:
        head = ["check", "shape", "torch ms", "triton ms", "speedup", "result"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ inputs


def random_tree_shape(B: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """parents, valid [B, n] on the CPU: random trees biased to depth, ragged valid counts (>= 3/4 of n)."""
    parents = torch.empty(B, n, dtype=torch.int64)
    parents[:, 0] = -1
    for j in range(1, n):
        parents[:, j] = torch.maximum(
            torch.randint(0, j, (B,), generator=gen), torch.randint(0, j, (B,), generator=gen)
        )
    real = torch.randint((3 * n) // 4, n + 1, (B,), generator=gen)
    valid = torch.arange(n)[None, :] < real[:, None]
    return parents, valid


def greedy_inputs(B: int, n: int, V: int, seed: int, device: str, ties: bool = False) -> tuple[DraftTree, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    parents, valid = random_tree_shape(B, n, gen)
    g = torch.Generator(device=device).manual_seed(seed)
    if ties:
        logits = torch.randint(0, 3, (B, n, V), generator=g, device=device).float()
    else:
        logits = torch.randn(B, n, V, generator=g, device=device)
    tstar = logits.argmax(-1)
    parents, valid = parents.to(device), valid.to(device)
    tokens = torch.randint(0, V, (B, n), generator=g, device=device)
    copy = torch.rand(B, n, generator=g, device=device) < 0.7
    rows = torch.arange(B, device=device)
    for j in range(1, n):
        tokens[:, j] = torch.where(copy[:, j], tstar[rows, parents[:, j]], tokens[:, j])
    return DraftTree(tokens, parents, valid), logits


def rejection_inputs(
    B: int, n: int, V: int, seed: int, device: str, draft: str
) -> tuple[DraftTree, torch.Tensor, torch.Tensor, torch.Tensor]:
    """draft: 'stochastic' (siblings drawn from q at their parent without replacement, as the accept rule reads
    them: `DraftTree.siblings_sampled`), 'onehot' (q = None, tokens = the draft's top choices among siblings) or
    'degenerate' (top-k zeros in p and q, a row with p = q / 2)."""
    gen = torch.Generator().manual_seed(seed)
    parents, valid = random_tree_shape(B, n, gen)
    parents, valid = parents.to(device), valid.to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    base = 3.0 * torch.randn(B, n, V, generator=g, device=device)
    p = torch.softmax(base + 0.5 * torch.randn(B, n, V, generator=g, device=device), -1)
    q = torch.softmax(base, -1)
    del base
    if draft == "degenerate":
        q = q * (q >= q.topk(8, -1).values[..., -1:])
        q = q / q.sum(-1, keepdim=True)
        p = p * (p >= p.topk(20, -1).values[..., -1:])
        p = p / p.sum(-1, keepdim=True)
        p[-1] = q[-1] / 2
    rows = torch.arange(B, device=device)
    tokens = torch.zeros(B, n, dtype=torch.int64, device=device)
    for j in range(1, n):
        qp = q[rows, parents[:, j]]  # [B, V] the distribution node j was drawn from
        if draft == "onehot":  # deterministic drafts: the k-th child of a node gets the draft's k-th choice
            rank = (parents[:, :j] == parents[:, j : j + 1]).sum(1)  # earlier siblings
            top = qp.topk(int(rank.max()) + 1, -1).indices
            tokens[:, j] = top.gather(1, rank[:, None]).squeeze(1)
        else:  # without replacement: the earlier siblings' tokens leave q (all of q gone: any token)
            earlier = (parents[:, 1:j] == parents[:, j : j + 1]).to(qp.dtype)
            taken = torch.zeros_like(qp).scatter_add_(1, tokens[:, 1:j], earlier)
            left = torch.where(taken > 0, 0.0, qp)
            left[left.sum(1) == 0] = 1.0
            tokens[:, j] = torch.multinomial(left, 1, generator=g).squeeze(1)
    tree = DraftTree(tokens, parents, valid, None if draft == "onehot" else q, siblings_sampled=draft != "onehot")
    return (tree, p, torch.rand(B, n, generator=g, device=device), torch.rand(B, n, generator=g, device=device))


# ------------------------------------------------------------------------------------------- comparisons


def same_rows(a: AcceptResult, b: AcceptResult) -> torch.Tensor:
    return (a.path == b.path).all(1) & (a.length == b.length) & (a.bonus == b.bonus)


def select_rows(tree: DraftTree, idx: list[int], *tensors: torch.Tensor) -> tuple:
    """The rows ``idx`` of a tree and [B, ...] tensors, on the CPU (the float64 replay runs there)."""
    i = torch.tensor(idx, device=tree.tokens.device)
    dp = None if tree.draft_probs is None else tree.draft_probs[i].cpu()
    sub = DraftTree(tree.tokens[i].cpu(), tree.parents[i].cpu(), tree.valid[i].cpu(), dp, tree.siblings_sampled)
    return (sub, *(t[i].cpu() for t in tensors))


def compare_rejection(
    tree: DraftTree, p: torch.Tensor, au: torch.Tensor, su: torch.Tensor, got: AcceptResult, ref: AcceptResult
) -> tuple[bool, str]:
    same = same_rows(got, ref)
    diff = (~same).nonzero().flatten().tolist()
    B = tree.batch_size
    if not diff:
        return True, f"identical {B}/{B} rows"
    sub_tree, sub_p, sub_au, sub_su, gp, gl, gb, rp, rl, rb = select_rows(
        tree, diff, p, au, su, got.path, got.length, got.bonus, ref.path, ref.length, ref.bonus
    )
    d_got = rejection_disagreement(sub_tree, sub_p, sub_au, sub_su, AcceptResult(gp, gl, gb))
    d_ref = rejection_disagreement(sub_tree, sub_p, sub_au, sub_su, AcceptResult(rp, rl, rb))
    worst = float(torch.maximum(d_got, d_ref).max())
    ok = worst <= TIE_TOL and len(diff) <= max(1, int(MAX_TIE_FRACTION * B))
    return ok, f"identical {B - len(diff)}/{B} rows, {len(diff)} at ties (float64 distance <= {worst:.1e})"


def check_greedy(c: Checker, B: int, n: int, V: int, seed: int) -> None:
    tree, logits = greedy_inputs(B, n, V, seed, c.device)
    shape = f"B={B} n={n} V={V}"
    ref = accept_greedy(tree, logits)
    mean_len = f"mean accepted {float(ref.length.float().mean()) - 1:.2f}"
    ok = bool(same_rows(verify_greedy(tree, logits, force_triton=True), ref).all())
    c.add(
        "greedy, fp32 logits",
        shape,
        lambda: accept_greedy(tree, logits),
        lambda: verify_greedy(tree, logits, force_triton=True),
        ok,
        f"bit-identical, {mean_len}",
    )
    bf = logits.bfloat16()
    ref_bf = accept_greedy(tree, bf)
    ok = bool(same_rows(verify_greedy(tree, bf, force_triton=True), ref_bf).all())
    c.add(
        "greedy, bf16 logits",
        shape,
        lambda: accept_greedy(tree, bf),
        lambda: verify_greedy(tree, bf, force_triton=True),
        ok,
        "bit-identical",
    )
    tstar = bf.argmax(-1)
    ok = bool(same_rows(verify_greedy(tree, tstar, force_triton=True), ref_bf).all())
    c.add(
        "greedy, argmax input", shape, None, lambda: verify_greedy(tree, tstar, force_triton=True), ok, "bit-identical"
    )


def check_rejection(c: Checker, B: int, n: int, V: int, seed: int, draft: str) -> None:
    tree, p, au, su = rejection_inputs(B, n, V, seed, c.device, draft)
    ref = accept_rejection(tree, p, au, su)
    got = verify_rejection(tree, p, au, su, force_triton=True)
    ok, result = compare_rejection(tree, p, au, su, got, ref)
    result += f", mean accepted {float(ref.length.float().mean()) - 1:.2f}"
    timed = draft != "degenerate"
    c.add(
        f"rejection, {draft} q",
        f"B={B} n={n} V={V}",
        (lambda: accept_rejection(tree, p, au, su)) if timed else None,
        (lambda: verify_rejection(tree, p, au, su, force_triton=True)) if timed else None,
        ok,
        result,
    )


def kv_case(
    B: int, H: int, S: int, D: int, n_tree: int, seed: int, device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache whose last ``n_tree`` positions hold a verified tree: keep the prefix plus a random accepted
    subset of the tree positions (ragged over rows: short rows are padded with the root position)."""
    g = torch.Generator(device=device).manual_seed(seed)
    kv = torch.randn(B, H, S, D, generator=g, device=device).to(dtype)
    prefix = S - n_tree
    accepted = torch.rand(B, n_tree, generator=g, device=device) < 0.1
    accepted[:, 0] = True  # the root is always kept
    pos = torch.where(accepted, torch.arange(prefix, S, device=device), S).sort(1).values
    k = int(accepted.sum(1).max())
    tail = pos[:, :k]
    tail = torch.where(tail < S, tail, tail[:, :1].clamp_max(S - 1))
    keep = torch.cat([torch.arange(prefix, device=device).expand(B, prefix), tail], 1)
    return kv, keep


def check_kv(
    c: Checker,
    B: int,
    H: int,
    S: int,
    D: int,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
    timed: bool = True,
    strided: bool = False,
) -> None:
    kv, keep = kv_case(B, H, S, D, min(60, S // 2), seed, c.device, dtype)
    if strided:  # cache stored [B, S, H, D], seen as [B, H, S, D]
        kv = kv.transpose(1, 2).contiguous().transpose(1, 2)
    ok = torch.equal(compact_kv(kv, keep, force_triton=True), compact_kv_reference(kv, keep))
    name = f"compact_kv, {str(dtype).removeprefix('torch.')}" + (", strided" if strided else "")
    c.add(
        name,
        f"[{B}, {H}, {S}, {D}] keep {keep.shape[1]}",
        (lambda: compact_kv_reference(kv, keep)) if timed else None,
        (lambda: compact_kv(kv, keep, force_triton=True)) if timed else None,
        ok,
        "bit-identical",
    )


@dataclass(frozen=True)
class Sizes:
    """What one run checks, and where."""

    device: str
    batch_sizes: tuple[int, ...]
    """B of every check."""
    tree_sizes: tuple[int, ...]
    """n, nodes per tree (root included), of the verify checks."""
    vocab_sizes: tuple[int, ...]
    """V of the verify checks."""
    kv_shape: tuple[int, int, int]
    """(H, S, D) of the compacted cache."""
    repeats: int
    """Timed calls per measurement."""


SMOKE_CPU = Sizes("cpu", (1, 3), (6,), (64,), (2, 64, 16), 1)
"""Tiny sizes for the Triton interpreter."""


def gpu_sizes(repeats: int) -> Sizes:
    """The sizes the docstring names, on CUDA."""
    return Sizes("cuda", (1, 16, 64), (16, 60), (8192, 128256), (8, 2048, 128), repeats)


def check_verify_rules(c: Checker, sizes: Sizes) -> None:
    """Greedy (three input kinds) and rejection sampling (stochastic and one-hot q) at every B × n × V."""
    seed = 0
    for V in sizes.vocab_sizes:
        for n in sizes.tree_sizes:
            for B in sizes.batch_sizes:
                seed += 1
                check_greedy(c, B, n, V, seed)
                for draft in ("stochastic", "onehot"):
                    check_rejection(c, B, n, V, seed, draft)
                if sizes.device == "cuda":
                    torch.cuda.empty_cache()


def check_edge_cases(c: Checker, sizes: Sizes) -> None:
    """Many exact argmax ties; zeros in p and q with all-zero residuals."""
    B, n, V = max(sizes.batch_sizes), max(sizes.tree_sizes), min(sizes.vocab_sizes)
    tree, logits = greedy_inputs(B, n, V, 99, sizes.device, ties=True)
    ok = bool(same_rows(verify_greedy(tree, logits, force_triton=True), accept_greedy(tree, logits)).all())
    c.add("greedy, tied integer logits", f"B={B} n={n} V={V}", None, None, ok, "bit-identical")
    for V in sizes.vocab_sizes:
        check_rejection(c, B, n, V, 100 + V % 7, "degenerate")


def check_compaction(c: Checker, sizes: Sizes) -> None:
    """KV compaction of a bf16 cache at every B (timed), then float32 and a strided float16 cache (untimed)."""
    H, S, D = sizes.kv_shape
    for B in sizes.batch_sizes:
        check_kv(c, B, H, S, D, 200 + B)
    check_kv(c, max(sizes.batch_sizes), H, S, D, 300, torch.float32, timed=False)
    check_kv(c, max(sizes.batch_sizes), H, S, D, 301, torch.float16, timed=False, strided=True)


def environment(device: str) -> str:
    """The machine and versions the report names."""
    if device != "cuda":
        return "CPU smoke run (Triton interpreter): timings are meaningless"
    import triton

    return (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"CUDA {torch.version.cuda}"
    )


def report_markdown(c: Checker, sizes: Sizes, wall: float) -> str:
    """The markdown report: how it was made, what is checked and the table."""
    status = "all checks passed" if not c.failures else f"{len(c.failures)} checks FAILED"
    env = environment(sizes.device)
    return "\n".join(
        [
            "# GPU check of the verify kernels",
            "",
            f"Generated by `python scripts/gpu_check.py` on {env}; {status}; {wall:.0f} s in all.",
            "",
            f"Times: median of {sizes.repeats} calls after two warm-up calls, each call bracketed by "
            "`torch.cuda.synchronize()`. torch = the reference (`infer.accept`, `torch.gather`), triton = "
            "`infer/kernels` with `force_triton=True`. Greedy and compaction must be bit-identical; rejection "
            f"rows may differ only at rounding-level ties (float64 replay distance <= {TIE_TOL:g}, at most "
            f"{MAX_TIE_FRACTION:.0%} of rows). Trees: random parents biased to depth, 3/4 to all nodes valid; "
            "greedy drafts copy the target argmax with prob 0.7; rejection drafts are sampled from q, siblings "
            "without replacement (stochastic), or are q's top choices (one-hot); KV keeps the prefix plus ~10% of the last 60 positions.",
            "",
            c.table(),
            "",
        ]
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="markdown report path (default docs/gpu_check.md; smoke: temp folder)")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (median reported)")
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny sizes through the Triton interpreter on the CPU")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    if args.smoke_cpu:
        sizes, default_out = SMOKE_CPU, Path(tempfile.gettempdir()) / "gpu_check_smoke.md"
    elif not torch.cuda.is_available():
        print("gpu_check.py needs CUDA (no CUDA device is visible); use --smoke-cpu to test the script on a CPU.")
        return 2
    else:
        sizes, default_out = gpu_sizes(args.repeats), Path("docs/gpu_check.md")

    c = Checker(sizes.device, sizes.repeats)
    t_start = time.perf_counter()
    check_verify_rules(c, sizes)
    check_edge_cases(c, sizes)
    check_compaction(c, sizes)
    report = report_markdown(c, sizes, time.perf_counter() - t_start)

    print()
    print(report)
    out = Path(args.out) if args.out else default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"written to {out}")
    for f in c.failures:
        print("FAILED:", f)
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
