"""CPU memory settings: glibc malloc keeps a step's large activations, and the KV cache sits
on huge pages.

By default glibc serves allocations over a (dynamic) threshold with mmap and returns freed
heap tops to the OS. A forward pass allocates the same multi-MB activations every step
(a 512-token gate/up output is 6 MB, 64 rows of logits 12 MB), so each one comes back as
fresh pages: thousands of page faults and zeroing per GEMM output. With allocation churn
around the model (a torch.profiler run) that made GEMMs markedly slower; in a plain run
glibc's dynamic threshold mostly adapts by itself, so this is insurance, not a speed-up
(docs/performance.md).
PyTorch's CPU tuning guides reach the same end with jemalloc/tcmalloc via LD_PRELOAD;
mallopt needs no extra library.

The KV cache is read at scattered blocks every decode step (a request's blocks lie wherever
the pool had them): on 4 KiB pages nearly every block costs a TLB miss and a page walk.
Where transparent huge pages are on only for regions that ask (``madvise``, the common
default), :func:`zeros_on_huge_pages` asks before the first touch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling on 64-bit; bigger blocks (the KV cache) still mmap
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of freed heap for reuse
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 * 2**20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """This process's C library on Linux (errno kept for madvise), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Apply the settings to this process; False where libc is not glibc or refuses them."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        logger.debug("mallopt refused the CPU allocation settings")
    return ok


def huge_page_range(t: torch.Tensor) -> tuple[int, int]:
    """The whole 2 MiB pages inside ``t``'s memory, ``(start, end)`` addresses (empty when
    ``end <= start``): advice past them would reach memory ``t`` does not own."""
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    return start, end


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose whole 2 MiB pages are marked for transparent huge pages
    before they are first touched (so the kernel faults them in huge where it can); a
    plain one where the system does not take the advice."""
    t = torch.empty(shape, dtype=dtype)
    start, end = huge_page_range(t)
    libc = _libc()
    if end > start and libc is not None and libc.madvise(start, end - start, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    return t.zero_()
