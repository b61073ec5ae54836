"""Native CPU kernels: small C files in ``csrc/`` compiled on first use with the system C
compiler (cached per source, flags and CPU), called through ctypes on tensor pointers.
Each source is built once per element type, fp32 and bf16 (``csrc/elem.h``): bf16 halves
the bytes every kernel moves, and the decode attention is bound by exactly that. (The AMX
projections, ``amx_linear``, exist in bf16 only.)

Each wrapper returns None when its kernel does not apply (not fp32/bf16 on the CPU, a
layout it does not read, no compiler); the caller then takes the torch reference path.

``SERVICER_DISABLE_NATIVE_KERNELS=1`` turns them all off.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import torch

from . import envs, owned_cache

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


# The element types the kernels are built for: the -D flag selecting each in elem.h.
ELEMENT_FLAGS = {torch.float32: [], torch.bfloat16: ["-DELEM_BF16"]}
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@functools.cache
def load_library(name: str, dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    """Compile (once) and load ``csrc/<name>.c`` for ``dtype``; None if that cannot be done here."""
    if envs.native_kernels_disabled() or dtype not in ELEMENT_FLAGS:
        return None
    compiler = envs.c_compiler() or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: using the torch path for %s", name)
        return None
    src = os.path.join(CSRC, f"{name}.c")
    flags = CFLAGS + ELEMENT_FLAGS[dtype]
    tmp = None
    try:
        digest = hashlib.sha256(" ".join(flags).encode() + _cpu_signature().encode())
        for path in [src, *sorted(glob.glob(os.path.join(CSRC, "*.h")))]:
            with open(path, "rb") as f:
                digest.update(f.read())
        lib_path = os.path.join(
            owned_cache.cache_dir("kernels"), f"{name}-{SUFFIX[dtype]}-{digest.hexdigest()[:16]}.so"
        )
        if not owned_cache.is_owned_file(lib_path):  # missing, or others may have written it: build
            if os.path.lexists(lib_path):
                logger.warning("%s is not owned and writable by this user alone: building it again", lib_path)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(lib_path))
            os.close(fd)
            subprocess.run([compiler, *flags, src, "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
            os.replace(tmp, lib_path)  # atomic: concurrent builders never see half a file
        if not owned_cache.is_owned_file(lib_path):  # loading runs its code in this process
            raise owned_cache.UntrustedPath(f"{lib_path} is not a file owned and writable by this user alone")
        return ctypes.CDLL(lib_path)
    except (subprocess.CalledProcessError, OSError) as e:
        logger.warning("cannot build %s (%s): using the torch path", name, getattr(e, "stderr", None) or e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        return None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _cpu_elements(dtype: torch.dtype, *tensors: torch.Tensor | None) -> bool:
    """All on the CPU in ``dtype``, a type the kernels are built for."""
    if dtype not in ELEMENT_FLAGS:
        return False
    for t in tensors:  # (a loop, not all(...): this runs a few hundred times per decode step)
        if t is not None and (t.dtype != dtype or not t.is_cpu):  # (is_cpu: device.type builds a device)
            return False
    return True


# Each kernel's C signature, so calls pass plain ints, floats and data_ptr()s (None: NULL)
# and ctypes converts them without a Python object per argument. (restype None: void.)
_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "paged_decode_attention": (ctypes.c_int, [_P] * 6 + [_I32] * 6 + [_F32, _I32]),
    "paged_prefill_attention": (ctypes.c_int, [_P] * 4 + [_I32, _P, _I32, _P] + [_I32] * 4 + [_F32]),
    "add_rms_norm": (None, [_P, _I64, _I64, _P, _P, _P, _I32, _I32, _F32]),
    "silu_mul": (None, [_P, _I64, _I64, _P, _I64, _I32, _I32]),
    "qkv_rope_store": (None, [_P, _I64, _I64, _P, _P, _F32, _P, _P, _I64] + [_P] * 6 + [_I32] * 4),
    "few_rows_linear": (ctypes.c_int, [_P] * 4 + [_I32] * 3),
    "amx_linear": (ctypes.c_int, [_P, _I64, _P, _P, _P, _I64] + [_I32] * 4),
    "decode_layers": (ctypes.c_int, [_P] * 2 + [_I32] + [_P] * 3),
    "decode_layers_workspace": (_I64, [_P]),
    "row_argmax": (None, [_P, _I64, _I32, _I32, _P]),
    "screened_argmax": (None, [_P, _I64, _P, _P, _P, _P, _I64, _P, _I32, _I32, _I32, _P]),
}


@functools.cache
def native_kernel(library: str, name: str, dtype: torch.dtype):
    """``name`` of ``library``'s ``dtype`` build (e.g. ``silu_mul_bf16``), typed by
    ``_SIGNATURES``; None if unavailable."""
    lib = load_library(library, dtype)
    if lib is None:
        return None
    fn = getattr(lib, f"{name}_{SUFFIX[dtype]}")
    fn.restype, fn.argtypes = _SIGNATURES[name]
    return fn


def decode_attention_reads(heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether paged_decode_attention.c reads these shapes: whole query groups, per-thread
    buffers kept small, 8-float vectors."""
    return heads % kv_heads == 0 and heads <= 64 and head_dim <= 256 and head_dim % 8 == 0 and block_size <= 64


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    shares: int = 0,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Decode attention straight from the paged cache; None when the native kernel does
    not apply (device, dtype, shapes, no compiler), so the caller uses the torch path.
    ``shares``: the requests' blocks, end to end, are cut into this many equal shares,
    handed to the OpenMP threads as they free up (a request cut between two is attended in
    pieces, then merged); 0: a few per thread (the kernel's SHARES_PER_THREAD), 1: no cut.
    ``max_seq_len``: ``max(seq_lens)`` where the caller knows it on the host (no reduction
    per call); ``out``: a contiguous ``q``-shaped tensor to write."""
    n, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if (
        not _cpu_elements(q.dtype, q, k_cache, v_cache)
        or k_cache.shape[-1] != head_dim
        or v_cache.shape != k_cache.shape
        or block_tables.dim() != 2
        or block_tables.shape[0] != n
        or seq_lens.shape != (n,)
        or not decode_attention_reads(heads, kv_heads, head_dim, block_size)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return None
    kernel = native_kernel("paged_decode_attention", "paged_decode_attention", q.dtype)
    if kernel is None:
        return None
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    if max_seq_len is None:
        max_seq_len = int(lens.max()) if n else 0
    if max_seq_len > tables.shape[1] * block_size:  # the kernel would read past a table row
        return None
    if out is None:
        out = torch.empty_like(q)
    elif not (out.shape == q.shape and _cpu_elements(q.dtype, out) and out.is_contiguous()):
        return None
    status = kernel(
        _ptr(q),
        _ptr(k_cache),
        _ptr(v_cache),
        _ptr(tables),
        _ptr(lens),
        _ptr(out),
        n,
        heads,
        kv_heads,
        head_dim,
        block_size,
        tables.shape[1],
        scale,
        shares,
    )
    return out if status == 0 else None


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    segments: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> bool:
    """The prefill chunks' attention straight from the paged cache (their keys and values
    already stored), written into their rows of ``out``; False when the native kernel does
    not apply (device, dtype, shapes, no compiler), so the caller uses the torch path.
    ``segments [P, 3]``: each chunk's first row in ``q``, its rows, its keys (seq_len);
    ``block_tables [P, max_blocks]``: their tables (``AttentionMetadata.prefill_segments``)."""
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if (
        not _cpu_elements(q.dtype, q, k_cache, v_cache, out)
        or k_cache.shape[-1] != head_dim
        or v_cache.shape != k_cache.shape
        or out.shape != q.shape
        or heads % kv_heads
        or head_dim > 256
        or head_dim % 16
        or not (q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())
        or segments.dtype != torch.int64
        or block_tables.dtype != torch.int64
        or not (segments.is_contiguous() and block_tables.is_contiguous())
    ):
        return False
    kernel = native_kernel("paged_prefill_attention", "paged_prefill_attention", q.dtype)
    if kernel is None:
        return False
    status = kernel(
        _ptr(q),
        _ptr(k_cache),
        _ptr(v_cache),
        _ptr(block_tables),
        block_tables.shape[1],
        _ptr(segments),
        segments.shape[0],
        _ptr(out),
        heads,
        kv_heads,
        head_dim,
        block_size,
        scale,
    )
    return status == 0


# -- fused element-wise kernels of the decoder layer (csrc/fused_ops.c) ------------------------
def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm of ``x [T, D]`` (any strides), or of ``x + residual`` with ``residual``
    updated in place and returned as the new residual stream: ``(out, residual)``."""
    if (
        x.dim() != 2
        or not _cpu_elements(x.dtype, x, weight, residual)
        or not weight.is_contiguous()
        or weight.numel() != x.shape[1]
        or (residual is not None and not (residual.is_contiguous() and residual.shape == x.shape))
    ):
        return None
    kernel = native_kernel("fused_ops", "add_rms_norm", x.dtype)
    if kernel is None:
        return None
    t, d = x.shape
    out = torch.empty(t, d, dtype=x.dtype)
    kernel(_ptr(x), x.stride(0), x.stride(1), _ptr(residual), _ptr(weight), _ptr(out), t, d, eps)
    return out if residual is None else (out, residual)


def silu_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of a fused ``[T, 2I]`` gate|up projection, row- or column-major;
    the output ``[T, I]`` has the input's layout."""
    if x.dim() != 2 or x.shape[1] % 2 or not _cpu_elements(x.dtype, x):
        return None
    t, i = x.shape[0], x.shape[1] // 2
    if x.stride(1) == 1:  # row-major: a token's features are contiguous
        out = torch.empty(t, i, dtype=x.dtype)
        outer, inner, stride, up, out_stride = t, i, x.stride(0), i, i
    elif x.stride(0) == 1:  # column-major: a feature's tokens are contiguous
        out = torch.empty_strided((t, i), (1, t), dtype=x.dtype)
        outer, inner, stride, up, out_stride = i, t, x.stride(1), i * x.stride(1), t
    else:
        return None
    kernel = native_kernel("fused_ops", "silu_mul", x.dtype)
    if kernel is None:
        return None
    kernel(_ptr(x), stride, up, _ptr(out), out_stride, outer, inner)
    return out


def qkv_rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Split a fused ``[T, (H + 2 Hkv) D]`` projection (any strides) into ``q [T, H, D]``,
    ``k, v [T, Hkv, D]`` with the optional per-head RMSNorm and rotary applied to q and k,
    and store k and v in their cache slots (slot -1: not stored)."""
    t = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    if (
        qkv.dim() != 2
        or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim
        or k_cache.shape[-2] != num_kv_heads
        or v_cache.shape != k_cache.shape
        or head_dim % 2
        or head_dim > 512
        or not _cpu_elements(qkv.dtype, qkv, k_cache, v_cache, q_norm, k_norm)
        or not _cpu_elements(torch.float32, cos, sin)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.is_contiguous())
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_cpu
        or slot_mapping.shape != (t,)
        or cos.dim() != 2
        or sin.dim() != 2
        or cos.shape[0] < t
        or cos.shape[1] != head_dim // 2
        or cos.stride(1) != 1
        or sin.stride(1) != 1
        or cos.stride(0) != sin.stride(0)
        or any(w is not None and not (w.is_contiguous() and w.numel() == head_dim) for w in (q_norm, k_norm))
    ):
        return None
    kernel = native_kernel("fused_ops", "qkv_rope_store", qkv.dtype)
    if kernel is None:
        return None
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype)
    k = torch.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype)
    v = torch.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype)
    kernel(
        _ptr(qkv),
        qkv.stride(0),
        qkv.stride(1),
        _ptr(q_norm),
        _ptr(k_norm),
        eps,
        _ptr(cos),
        _ptr(sin),
        cos.stride(0),
        _ptr(slot_mapping),
        _ptr(k_cache),
        _ptr(v_cache),
        _ptr(q),
        _ptr(k),
        _ptr(v),
        t,
        num_heads,
        num_kv_heads,
        head_dim,
    )
    return q, k, v


# -- projections of a few rows (csrc/gemv.c) ---------------------------------------------------
GEMV_MAX_ROWS = 32  # MAX_ROWS in gemv.c


def has_avx512() -> bool:
    """Whether the CPU has AVX-512 (gemv.c's fp32 path then works in 16-float vectors)."""
    return "avx512f" in _cpu_signature().split()


def has_avx512_bf16() -> bool:
    """Whether the CPU has AVX512-BF16 (its dot product and conversions): the bf16 decode
    attention kernel then multiplies bf16 pairs directly, its probabilities rounded to bf16
    for P.V, and an fp32 LM head can be screened by a bf16 one (screened_greedy.py)."""
    return "avx512_bf16" in _cpu_signature().split()


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ weight.T + bias`` for ``x [M <= 32, K]`` in one pass over the weights, which
    gemv.c streams faster than torch's GEMM does (docs/performance.md has numbers)."""
    if (
        x.dim() != 2
        or x.shape[0] > GEMV_MAX_ROWS
        or x.shape[1] % 32
        or weight.dim() != 2
        or weight.shape[1] != x.shape[1]
        or (bias is not None and bias.shape != (weight.shape[0],))
        or not _cpu_elements(x.dtype, x, weight, bias)
        or not (x.is_contiguous() and weight.is_contiguous() and (bias is None or bias.is_contiguous()))
    ):
        return None
    kernel = native_kernel("gemv", "few_rows_linear", x.dtype)
    if kernel is None:
        return None
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    if kernel(_ptr(x), _ptr(weight), _ptr(bias), _ptr(out), x.shape[0], weight.shape[0], x.shape[1]) != 0:
        return None
    return out


# -- bf16 projections on AMX tiles (csrc/amx_linear.c) -----------------------------------------
AMX_TILE_ROWS, AMX_TILE_K = 16, 32  # a packed tile: 16 output columns x 32 elements of K


@functools.cache
def has_amx() -> bool:
    """Whether bf16 projections can run on AMX tiles here: the CPU has them, the kernel
    builds, and the kernel (Linux) grants this process the tile state."""
    flags = _cpu_signature().split()
    if not {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags):
        return False
    lib = load_library("amx_linear", torch.bfloat16)
    return lib is not None and lib.amx_available() == 1


def amx_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 weight ``[N, K]`` in the tile layout ``amx_linear`` reads,
    ``[N/16, K/32, 16, 16, 2]`` (amx_linear.c), or None where the shapes do not tile."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % AMX_TILE_ROWS or k % AMX_TILE_K:
        return None
    tiles = weight.reshape(n // AMX_TILE_ROWS, AMX_TILE_ROWS, k // AMX_TILE_K, AMX_TILE_K // 2, 2)
    return tiles.permute(0, 2, 3, 1, 4).contiguous()


def gated_pairs(t: torch.Tensor) -> torch.Tensor:
    """A gated MLP's fused gate|up rows (``[2I, ...]``: gate, then up) reordered so that each
    block of 16 gate rows sits before its 16 up rows, the pairs ``amx_linear(gated=True)``
    reads (I % 16 == 0)."""
    inner = t.shape[0] // 2
    return t.reshape(2, inner // AMX_TILE_ROWS, AMX_TILE_ROWS, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def amx_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False
) -> torch.Tensor | None:
    """``x @ weight.T + bias`` in bf16 from ``packed = amx_pack(weight)``; with ``gated``,
    ``silu(gate) * up`` ``[M, N/2]`` of a fused gate|up weight packed as
    ``amx_pack(gated_pairs(weight))`` (bias ``gated_pairs(bias)``), rounded as the projection
    and silu_mul would round them. None where the kernel does not apply (no AMX, other
    dtypes or strides)."""
    n = packed.shape[0] * AMX_TILE_ROWS
    k = packed.shape[1] * AMX_TILE_K
    if (
        x.dim() != 2
        or x.shape[1] != k
        or x.stride(1) != 1
        or (bias is not None and (bias.shape != (n,) or not bias.is_contiguous()))
        or (gated and n % (2 * AMX_TILE_ROWS))
        or not _cpu_elements(torch.bfloat16, x, packed, bias)
        or not has_amx()
    ):
        return None
    kernel = native_kernel("amx_linear", "amx_linear", torch.bfloat16)
    width = n // 2 if gated else n
    out = torch.empty(x.shape[0], width, dtype=torch.bfloat16)
    if kernel(_ptr(x), x.stride(0), _ptr(packed), _ptr(bias), _ptr(out), width, x.shape[0], n, k, int(gated)) != 0:
        return None
    return out


# -- greedy sampling's argmax (csrc/row_argmax.c) ---------------------------------------------
def row_argmax(x: torch.Tensor) -> torch.Tensor | None:
    """The index of each row's maximum of ``x [rows, n]`` (the first on ties) as int64, or
    None where the kernel does not apply."""
    if x.dim() != 2 or x.stride(1) != 1 or not _cpu_elements(x.dtype, x):
        return None
    kernel = native_kernel("row_argmax", "row_argmax", x.dtype)
    if kernel is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kernel(_ptr(x), x.stride(0), x.shape[0], x.shape[1], _ptr(out))
    return out


def screened_argmax(
    approx: torch.Tensor,
    s1: torch.Tensor,
    s2: torch.Tensor,
    bounds: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor | None:
    """Each row's argmax of the fp32 logits ``hidden @ weight.T`` (the first on ties) from
    their bf16 approximation ``approx [rows, n]`` and its error bounds (row_argmax.c:
    ``screened_greedy.py`` derives them); None where the kernel does not apply."""
    rows, n = approx.shape
    if (
        approx.dtype != torch.bfloat16
        or approx.stride(1) != 1
        or not _cpu_elements(torch.float32, s1, s2, bounds, hidden, weight)
        or hidden.dim() != 2
        or hidden.stride(1) != 1
        or hidden.shape[0] != rows
        or weight.shape != (n, hidden.shape[1])
        or not weight.is_contiguous()
        or s1.shape != (rows,)
        or s2.shape != (rows,)
        or bounds.shape != (2, n)
        or not (s1.is_contiguous() and s2.is_contiguous() and bounds.is_contiguous())
    ):
        return None
    kernel = native_kernel("row_argmax", "screened_argmax", torch.bfloat16)
    if kernel is None:
        return None
    out = torch.empty(rows, dtype=torch.int64)
    kernel(
        _ptr(approx),
        approx.stride(0),
        _ptr(s1),
        _ptr(s2),
        _ptr(bounds),
        _ptr(hidden),
        hidden.stride(0),
        _ptr(weight),
        hidden.shape[1],
        rows,
        n,
        _ptr(out),
    )
    return out
