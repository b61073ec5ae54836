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
  74.7 -> 69.6, a wash at 32 (``cpu_kernels.FEW_ROWS_MAX``). In bf16, torch's GEMM (AMX)
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

Accelerators always use ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels

TRANSPOSED_MAX_ROWS = 64
COLUMN_BLOCK = 1024  # weight rows per block of a wide projection
WIDE_MIN_COLUMNS = 8 * COLUMN_BLOCK


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, row_major: bool = True
) -> torch.Tensor:
    """``[T, N]``; with ``row_major=False`` a short CPU batch's result may stay column-major
    (the transposed view of ``weight @ x.T``, strides ``(1, T)``) for consumers that read
    any strides (the fused kernels in ``cpu_kernels``), saving the transpose copy."""
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    if x.shape[0] <= cpu_kernels.FEW_ROWS_MAX.get(x.dtype, 0):
        out = cpu_kernels.few_rows_linear(x, weight, bias)
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
