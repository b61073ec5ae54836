"""Gated MLP activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused ``[..., 2 * I]`` gate|up projection: ``silu(gate) * up``."""
    native = cpu_kernels.silu_mul(x)
    return native if native is not None else silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The reference path (any device, dtype and layout)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
