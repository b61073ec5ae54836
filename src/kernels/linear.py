"""Dense projection ``x @ weight.T + bias`` with a faster CPU form for short batches.

On x86 CPUs (MKL/oneDNN sgemm under torch 2.13) ``F.linear`` on a few dozen rows runs well
below the GEMM's speed at a few hundred: it streams the ``[out, in]`` weight in an order
that suits a tall ``x``. Computing the transposed product ``weight @ x.T`` instead walks the
weight row by row; measured on a 2-core EPYC with the SmolLM2 shapes at 64 rows: the 49152-row
LM head 41 -> 34 ms, the layer projections 5-25% faster; at 512 rows it is slower, so only
short batches take it. Accelerators always use ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TRANSPOSED_MAX_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= TRANSPOSED_MAX_ROWS:
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)
