"""Batched token sampling (torch path, any device).

Every row carries its own parameters, so requests with different settings share a
step. Greedy rows take the argmax; the others are temperature-scaled, top-k/top-p
filtered, and drawn with the exponential race (argmax of p / Exp(1)), which needs no
host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [N] float, <= 0 means greedy
    top_p: torch.Tensor  # [N] float in (0, 1]
    top_k: torch.Tensor  # [N] int, <= 0 means off
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool

    @staticmethod
    def build(temperature: list[float], top_p: list[float], top_k: list[int], device) -> "SamplingTensors":
        return SamplingTensors(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            all_greedy=all(t <= 0 for t in temperature),
            any_top_p=any(p < 1.0 for p in top_p),
            any_top_k=any(k > 0 for k in top_k),
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token if the mass strictly before it is below p (the top token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, params: SamplingTensors, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of ``logits [N, vocab]``; returns int64 ``[N]``."""
    greedy_tokens = logits.argmax(dim=-1)
    if params.all_greedy:
        return greedy_tokens
    is_greedy = params.temperature <= 0
    temperature = torch.where(is_greedy, 1.0, params.temperature)
    scaled = logits.float() / temperature.unsqueeze(1)
    if params.any_top_k or params.any_top_p:
        scaled = apply_top_k_top_p(
            scaled, params.top_k if params.any_top_k else None, params.top_p if params.any_top_p else None
        )
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(is_greedy, greedy_tokens, sampled)
