"""Gated MLP activation: the torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused ``[..., 2 * I]`` gate|up projection: ``silu(gate) * up`` (any
    device, dtype and layout)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
