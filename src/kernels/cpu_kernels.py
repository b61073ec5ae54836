"""Native CPU kernels: small C files in ``csrc/`` compiled on first use with the system C
compiler (cached per source, flags and CPU), called through ctypes on tensor pointers.

If no compiler is available the callers fall back to the torch reference path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import torch

logger = logging.getLogger(__name__)
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffast-math"]


def _cpu_signature() -> str:
    """-march=native code must not travel to another CPU: key the cache on it."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


@functools.lru_cache(maxsize=None)
def load_library(name: str) -> ctypes.CDLL | None:
    """Compile (once) and load ``csrc/<name>.c``; None if that cannot be done here."""
    if os.environ.get("SERVICER_DISABLE_NATIVE_KERNELS") == "1":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: using the torch path for %s", name)
        return None
    src = os.path.join(CSRC, f"{name}.c")
    with open(src, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(CFLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "servicer", "kernels")
    lib_path = os.path.join(cache, f"{name}-{key}.so")
    if not os.path.exists(lib_path):
        os.makedirs(cache, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run([compiler, *CFLAGS, src, "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
            os.replace(tmp, lib_path)  # atomic: concurrent builders never see half a file
        except (subprocess.CalledProcessError, OSError) as e:
            logger.warning("cannot build %s (%s): using the torch path", name, getattr(e, "stderr", e))
            if os.path.exists(tmp):
                os.unlink(tmp)
            return None
    return ctypes.CDLL(lib_path)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """Decode attention straight from the paged cache; None when the native kernel does
    not apply (device, dtype, shapes, no compiler), so the caller uses the torch path."""
    n, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    if (
        q.device.type != "cpu"
        or not (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32)
        or heads % kv_heads
        or heads > 64
        or head_dim > 256
        or head_dim % 8  # the kernel works in 8-float vectors
        or block_size > 64
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return None
    lib = load_library("paged_decode_attention")
    if lib is None:
        return None
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    lib.paged_decode_attention_f32(
        _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(tables), _ptr(lens), _ptr(out),
        ctypes.c_int(n), ctypes.c_int(heads), ctypes.c_int(kv_heads), ctypes.c_int(head_dim),
        ctypes.c_int(block_size), ctypes.c_int(tables.shape[1]), ctypes.c_float(scale),
    )
    return out
