"""Keep glibc malloc from handing a CPU step's large activations back to the kernel.

By default glibc serves allocations over a (dynamic) threshold with mmap and returns freed
heap tops to the OS. A forward pass allocates the same multi-MB activations every step
(a 512-token gate/up output is 6 MB, 64 rows of logits 12 MB), so each one comes back as
fresh pages: thousands of page faults and zeroing per GEMM output. With allocation churn
around the model (a torch.profiler run) that made GEMMs markedly slower; in a plain run
glibc's dynamic threshold mostly adapts by itself, so this is insurance, not a speed-up
(docs/performance.md).
PyTorch's CPU tuning guides reach the same end with jemalloc/tcmalloc via LD_PRELOAD;
mallopt needs no extra library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling on 64-bit; bigger blocks (the KV cache) still mmap
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of freed heap for reuse


def keep_freed_memory() -> bool:
    """Apply the settings to this process; False where libc is not glibc or refuses them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        logger.debug("mallopt refused the CPU allocation settings")
    return ok
