"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from . import cpu_kernels


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)`` over the last dim.

    With ``residual``: first ``x = x + residual`` and return ``(norm(x), x)``, the new
    residual stream (the native CPU kernel updates ``residual`` in place and returns it).
    """
    native = cpu_kernels.add_rms_norm(x, weight, eps, residual)
    return native if native is not None else rms_norm_torch(x, weight, eps, residual)


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The reference path (any device and dtype); fusing the add is what saves a pass over
    memory in the native and GPU kernels."""
    if residual is not None:
        x = x + residual
        residual = x
    # The variance is taken in fp32 (bf16 squares overflow/lose precision); the scaled
    # value is rounded back before the weight, the same order HF uses.
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)
