"""Keep freed memory in the process: glibc's allocator told to serve every block from its heap and to give the heap's
free top back to the kernel only past 2 GB.

By default glibc maps every block over its mmap threshold (at most 32 MB) with its own ``mmap`` and unmaps it when
freed, and trims the heap's free top. A training step allocates its large tensors anew each time (logits over the
vocabulary, score and activation tensors whose shapes change with every batch), so each step first-touches fresh
pages: ~3 µs a page on the 2-core Firecracker VM this project is measured on, whose kernel also hands freed pages
back to the host. Measured there (bf16, `drafters bench-train`, EAGLE-3 batches of 4, two alternating pairs of
processes): 547 / 553 tokens/s by default, 670 / 692 with this (docs/decisions.md, "EAGLE-3 training throughput").
The cost is memory: the heap keeps its peak, and batches of ever new shapes fragment it (an EAGLE-3 run at batches
of 8 grew to 10-16 GB resident where it uses ~4 GB at a time). `release_freed_memory` hands the free pages back once
the process holds more than half the machine's memory; the training loops call it after each resumable save.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Apply the setting above to this process (glibc only); True when it took effect. Later allocations obey it;
    blocks already mapped stay as they are."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def release_freed_memory(fraction: float = 0.5) -> bool:
    """``malloc_trim``: give the heap's free pages back to the kernel when this process holds more than ``fraction``
    of the machine's memory (glibc only); True when it trimmed. Costs the next allocations their first touch again,
    so it is for occasional calls (a checkpoint), not every step."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * page
    if resident <= fraction * os.sysconf("SC_PHYS_PAGES") * page:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc_trim(0)
    return True
