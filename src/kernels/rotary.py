"""Rotary position embedding: the cos/sin table and its application (torch reference path).

Rotate-half ("neox") layout as in HF Llama: dimension ``i`` pairs with ``i + head_dim/2``.
The table holds only the ``head_dim/2`` distinct frequencies; it is built once, in
fp32, and indexed by position, so a step costs one gather.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """``[head_dim/2]`` fp32 inverse frequencies, with the supported scalings applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":  # position interpolation: every frequency slowed by `factor`
        return inv_freq / scaling["factor"]
    if kind == "freq_factors":  # llama.cpp's per-frequency divisors (GGUF `rope_freqs`)
        return inv_freq / torch.as_tensor(scaling["freq_factors"], dtype=torch.float32)
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
        # between original_max/low_freq_factor and original_max/high_freq_factor blended.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(
            wavelen > old_len / low, inv_freq / factor, torch.where(wavelen < old_len / high, inv_freq, blended)
        )
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (Qwen's long-context setting): frequencies that turn many times within the
    original context are kept, slow ones are divided by ``factor``, and a linear ramp over
    the dimensions between (set by beta_fast / beta_slow rotations) blends the two."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_turning(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    slowed = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * slowed + inv_freq * (1 - slowed)


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention temperature (its paper's
    0.1 ln(factor) + 1, or the config's own), 1 for every other rope."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """``[max_positions, head_dim]`` fp32 table: cos in the first half, sin in the second."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling))
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    attention_factor = rope_attention_factor(scaling)
    return table if attention_factor == 1.0 else table * attention_factor


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, heads, D]`` and ``k [T, kv_heads, D]`` by ``cos``/``sin [T, D/2]`` (fp32)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
