"""Dense projection ``x @ weight.T + bias`` with faster CPU forms.

Three shapes are slow with torch 2.13's CPU GEMMs as ``F.linear``, measured rather than
explained (2-core EPYC, SmolLM2 shapes, in-process A/B):

* A few rows (decode of a few requests): a pass over the weights that torch reads
  from DRAM at ~12 GB/s; the native ``few_rows_linear`` (csrc/gemv.c) streams them at
  22-32 GB/s: the 30 layers' projections at one row take 35 -> 13 ms in fp32 and
  16 -> 7 ms in bf16, at four rows 47 -> 19 and 18 -> 13 ms. On a 2-core Xeon with AMX
  (another machine of this kind) a pass over all of SmolLM2's weights at one row takes
  9.8 ms in bf16 (AVX512-BF16 dot products; torch 23.6) and 20.0 in fp32 (torch 20.9), at
  four rows 14.5 (torch 22.3) and 22.9 (torch 34.9). Past four rows the kernel takes the
  rows of x four at a time against each block of weights (read from memory once, then from
  L1), so in fp32 it stays ahead of torch up to ~24 rows with AVX-512: whole decode steps
  (2-core Xeon) at 5 rows 55.8 -> 33.0 ms, 8 rows 58.7 -> 37.0, 16 rows 65.2 -> 53.6, 24
  74.7 -> 69.6, a wash at 32 (``FEW_ROWS_MAX``). In bf16, torch's GEMM (AMX)
  wins from 6 rows.

* Short batches: ``weight @ x.T`` (made contiguous afterwards) beats ``F.linear`` on a few
  dozen rows: the layer projections at 16 rows 10-25% faster, a whole decode step at 64
  requests ~298 -> ~270 ms. At 128 rows it is a wash and at 512 slower.
* Wide outputs (the 49152-column LM head): one GEMM over the whole weight runs at 90-130
  GFLOP/s where the layer projections reach 150-190. Computing it in column blocks of
  ``COLUMN_BLOCK`` weight rows, each block's product written straight into its slice of
  the output, takes at 64 rows 38 -> 29 ms, at 128 rows 64 -> 48 ms, at 512 rows
  239 -> 178 ms, and the output is already row-major (no transpose copy). This is fp32's
  sgemm only: bf16's one GEMM is the fastest form (at 64 rows 11.6 ms, blocked 13.3).

* Decode batches: a copy of the weight packed once into the GEMM's own layout
  (``pack_weight``: MKL's packed sgemm in fp32, oneDNN's blocked layout in bf16) beats
  the forms above, which start from the plain layout on every call. Whole decode steps
  (2-core Xeon with AMX, SmolLM2, in-process A/B): fp32 at 64 rows 112 -> 76 ms, at 32
  rows 82.3 -> 63.3, at 16 rows 55.7 -> 47.8 (where the few-row kernel now stops,
  ``few_rows_max``); bf16 at 64 rows 45.7 -> 42.2, at 8 rows 23.3 -> 20.3. W64 (engine
  offline, two runs each): fp32 239.0 -> 280.0 tok/s (1.17x), bf16 534.2 -> 561.5
  (1.05x). Above ``PACKED_MAX_ROWS`` (prefill chunks) packing gains nothing in fp32 and
  loses in bf16. The packed copy costs the weights' memory again, so the runner packs
  only when that is small against the memory available (``ModelRunner._pack_cpu_weights``).

Accelerators always use ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels

PACKED_MAX_ROWS = 256  # rows up to which a packed weight is used (see the docstring)
TRANSPOSED_MAX_ROWS = 64
COLUMN_BLOCK = 1024  # weight rows per block of a wide projection
WIDE_MIN_COLUMNS = 8 * COLUMN_BLOCK


def _few_rows_max() -> dict[tuple[torch.dtype, bool], int]:
    """(dtype, weight packed) -> up to how many rows ``few_rows_linear`` beats the GEMM it
    would otherwise meet, in whole decode steps (2-core Xeon, SmolLM2; see the docstring).
    fp32: to 24 rows with AVX-512 (16-float vectors), 12 without; against a packed weight
    only to 8 (at 10 rows 43.7 -> 42.5 ms, at 16 rows 55.7 -> 47.8). bf16: to 4 either way
    (from 6 rows on, torch's bf16 GEMM, AMX where there is one, is faster)."""
    fp32 = 24 if cpu_kernels.has_avx512() else 12
    return {
        (torch.float32, False): fp32,
        (torch.float32, True): min(fp32, 8),
        (torch.bfloat16, False): 4,
        (torch.bfloat16, True): 4,
    }


FEW_ROWS_MAX = _few_rows_max()


def few_rows_max(dtype: torch.dtype, packed: bool) -> int:
    return FEW_ROWS_MAX.get((dtype, packed), 0)


def can_pack(dtype: torch.dtype) -> bool:
    """Whether ``pack_weight`` has a packed GEMM for CPU weights of ``dtype``."""
    if dtype == torch.float32:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    if dtype == torch.bfloat16:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A CPU weight ``[N, K]`` in the packed layout ``linear(..., packed=)`` takes."""
    if weight.dtype == torch.float32:
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, PACKED_MAX_ROWS)
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_MAX_ROWS)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    row_major: bool = True,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T, N]``; with ``row_major=False`` a short CPU batch's result may stay column-major
    (the transposed view of ``weight @ x.T``, strides ``(1, T)``) for consumers that read
    any strides (the fused kernels in ``cpu_kernels``), saving the transpose copy.
    ``packed``: ``pack_weight(weight)``, used for batches of a few dozen to ``PACKED_MAX_ROWS``."""
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    if x.shape[0] <= few_rows_max(x.dtype, packed is not None):
        out = cpu_kernels.few_rows_linear(x, weight, bias)
        if out is not None:
            return out
    if packed is not None and x.shape[0] <= PACKED_MAX_ROWS:
        if x.dtype == torch.float32:
            # (the batch size argument only guards a fallback: the packed layout fits any)
            return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if weight.shape[0] >= WIDE_MIN_COLUMNS:
        return _column_blocked(x, weight, bias) if x.dtype == torch.float32 else F.linear(x, weight, bias)
    if x.shape[0] <= TRANSPOSED_MAX_ROWS:
        out = torch.mm(weight, x.t()).t()
        out = out.contiguous() if row_major else out
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


def _column_blocked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    for start in range(0, weight.shape[0], COLUMN_BLOCK):
        block = slice(start, start + COLUMN_BLOCK)
        torch.mm(x, weight[block].t(), out=out[:, block])
    return out if bias is None else out.add_(bias)
