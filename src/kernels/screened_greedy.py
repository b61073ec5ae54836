"""Greedy tokens of an fp32 LM head read mostly from a bf16 copy of its weight.

An fp32 LM head is the largest single read of a CPU decode step (a vocabulary of rows) and,
for a batch, its largest GEMM. Greedy sampling only needs each row's argmax, and almost all
tokens are far from it: the bf16 logits (half the bytes, and the CPU's bf16 GEMM, AMX tiles
where there are some) are each within a bound of the fp32 logit, so only tokens whose upper
bound reaches the largest lower bound can win (a few per row), and those get their exact
fp32 logits (csrc/row_argmax.c). The result is the argmax of fp32 logits, as the full head
gives.

The bound on ``|z_j - a_j|`` (z: the fp32 logit of hidden row h and weight row w_j; a: the
bf16 logit of the rounded ĥ and ŵ_j, accumulated in fp32, then rounded to bf16):
``h.w_j - ĥ.ŵ_j = h.(w_j - ŵ_j) + (h - ĥ).ŵ_j``, bounded by Cauchy-Schwarz; each fp32 sum of
H products is within ``H u`` (u = 2^-24) of its exact value relative to the sum of the
products' magnitudes, itself within the norms' product; the bf16 result is within 2^-9 of
its value (2^-8 of itself is taken). Per row the kernel gets ``s1 = |h|`` and
``s2 = |h - ĥ| + H u (|ĥ| + |h|)`` and per token ``|w_j - ŵ_j|`` and ``|ŵ_j| + |w_j - ŵ_j|``,
all rounded up.
"""

from __future__ import annotations

import torch

from . import cpu_kernels, linear

MARGIN = 1.001  # norms and products computed in fp32 are rounded up by this factor


class ScreenedGreedyHead:
    """``hidden [N, H] fp32 -> tokens [N] int64``: the argmax of ``hidden @ weight.T``."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        low = weight.to(torch.bfloat16)
        wide = weight.double()
        diff = (wide - low.double()).norm(dim=1)
        self.bounds = torch.stack([diff, low.double().norm(dim=1) + diff]).mul(MARGIN).float().contiguous()
        # AMX tiles serve any number of rows; elsewhere the row-major copy (the few-row kernel
        # or torch's bf16 GEMM through linear.linear)
        self.tiles = cpu_kernels.amx_pack(low) if cpu_kernels.has_amx() else None
        self.low = low if self.tiles is None else None
        self.sum_error = weight.shape[1] * 2.0**-24 * MARGIN

    @staticmethod
    def build(weight: torch.Tensor, bias: torch.Tensor | None = None) -> ScreenedGreedyHead | None:
        """The head where it pays: a CPU fp32 weight without bias, on a CPU with bf16
        instructions (emulated bf16 would be slower than the fp32 head) and the kernels."""
        if (
            bias is not None
            or weight.dtype != torch.float32
            or not weight.is_cpu
            or weight.dim() != 2
            or not weight.is_contiguous()
            or not cpu_kernels.has_avx512_bf16()
            or cpu_kernels.native_kernel("row_argmax", "screened_argmax", torch.bfloat16) is None
        ):
            return None
        return ScreenedGreedyHead(weight)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Tokens, or None where ``hidden`` is not a CPU fp32 matrix the kernels read."""
        if hidden.dtype != torch.float32 or not hidden.is_cpu or hidden.dim() != 2:
            return None
        hidden = hidden.contiguous()
        rounded = hidden.to(torch.bfloat16)
        if self.tiles is not None:
            approx = cpu_kernels.amx_linear(rounded, self.tiles)
        else:
            approx = linear.linear(rounded, self.low)
        if approx is None:
            return None
        wide, near = hidden.double(), rounded.double()
        norm, near_norm = wide.norm(dim=1), near.norm(dim=1)
        s1 = norm.mul(MARGIN).float()
        s2 = ((wide - near).norm(dim=1) + self.sum_error * (norm + near_norm)).mul(MARGIN).float()
        return cpu_kernels.screened_argmax(approx, s1, s2, self.bounds, hidden, self.weight)
