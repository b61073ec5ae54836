"""Dense projection ``x @ weight.T + bias`` with faster CPU forms (the CPU backend's
projections and every device's LM head; accelerators always use ``F.linear``).

Four shapes are slow with torch's CPU GEMMs as ``F.linear``, measured rather than explained
(the numbers are in docs/performance.md, "CPU kernels"):

* A few rows (decode of a few requests): torch streams the weights well below the memory's
  bandwidth; the native ``few_rows_linear`` (csrc/gemv.c) reads each block of weights once for
  four rows of ``x`` at a time, up to ``few_rows_max`` rows.
* Short batches: ``weight @ x.T`` beats ``F.linear`` on a few dozen rows (and may stay
  column-major for a consumer that reads any strides).
* Wide outputs (a large vocabulary's LM head) in fp32: one GEMM over the whole weight runs
  slower than the layer projections; column blocks of ``COLUMN_BLOCK`` weight rows, each
  written straight into its slice of the output, are faster and already row-major.
* Decode batches and prefill chunks: a copy of the weight packed once into the GEMM's own
  layout (``pack_weight``: MKL's packed sgemm in fp32; in bf16 the AMX tiles of
  csrc/amx_linear.c where the CPU has them, else oneDNN's blocked layout) beats the forms
  above past the few-row kernel: in fp32 and in AMX tiles at any row count (or matches them),
  in oneDNN's bf16 layout up to ``packed_max_rows`` (past it the plain GEMM is faster). It
  costs the weights' memory again, so ``resolve.py`` decides whether to keep it. On AMX a
  decode step's projections are small GEMMs whose time in oneDNN is mostly its fixed cost
  per call; the tile kernel has next to none.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from . import cpu_kernels

PACKED_MAX_ROWS = {torch.float32: sys.maxsize, torch.bfloat16: 256}  # rows up to which a packed weight is used
# (AMX tiles: at any row count, as fast as torch's GEMM on prefill chunks and faster below)
PACK_ROWS_HINT = 256  # the batch size the packing is tuned for (any batch may use it)
TRANSPOSED_MAX_ROWS = 64
COLUMN_BLOCK = 1024  # weight rows per block of a wide projection
WIDE_MIN_COLUMNS = 8 * COLUMN_BLOCK


def _few_rows_max() -> dict[tuple[torch.dtype, bool], int]:
    """(dtype, weight packed) -> up to how many rows ``few_rows_linear`` beats the GEMM it
    would otherwise meet in whole decode steps (A/B-measured: docs/performance.md). With
    16-float vectors (AVX-512) the fp32 kernel keeps its lead over more rows; a packed weight
    and torch's bf16 GEMM (AMX where there is one) take over sooner."""
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


def packed_max_rows(dtype: torch.dtype, packed: torch.Tensor | None = None) -> int:
    if packed is not None and is_amx_packed(packed):
        return sys.maxsize
    return PACKED_MAX_ROWS.get(dtype, 0)


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
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_ROWS_HINT)
    if cpu_kernels.has_amx():
        tiles = cpu_kernels.amx_pack(weight)
        if tiles is not None:
            return tiles
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)


def is_amx_packed(packed: torch.Tensor) -> bool:
    """Whether ``pack_weight`` made AMX tiles (5-D) rather than a GEMM library's layout (2-D)."""
    return packed.dim() == 5


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
    ``packed``: ``pack_weight(weight)``, used past the few-row kernel up to ``packed_max_rows``."""
    if not x.is_cpu or x.dim() != 2:
        return F.linear(x, weight, bias)
    if x.shape[0] <= few_rows_max(x.dtype, packed is not None):
        out = cpu_kernels.few_rows_linear(x, weight, bias)
        if out is not None:
            return out
    if packed is not None and x.shape[0] <= packed_max_rows(x.dtype, packed):
        if not is_amx_packed(packed):
            if x.dtype == torch.float32:
                # (the batch size argument only guards a fallback: the packed layout fits any)
                return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        out = cpu_kernels.amx_linear(x, packed, bias)
        if out is not None:
            return out
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
