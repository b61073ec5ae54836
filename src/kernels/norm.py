"""RMSNorm, optionally fused with the residual add that precedes it: the torch reference."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)`` over the last dim (any device and dtype).

    With ``residual``: first ``x = x + residual`` and return ``(norm(x), x)``, the new
    residual stream. Fusing that add is what saves a pass over memory in the native and
    GPU kernels (``kernels/backend.py``).
    """
    if residual is not None:
        x = x + residual
        residual = x
    # The variance is taken in fp32 (bf16 squares overflow/lose precision); the scaled
    # value is rounded back before the weight, the same order HF uses.
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)
