"""Model registry: HF architecture name -> our implementation."""

from __future__ import annotations

import torch

from ..model_config import ModelConfig
from .llama import LlamaForCausalLM

# One decoder class covers these; the differences are ModelConfig flags (ModelConfig.head:
# the LM head, a classifier's score head, or none for a base model's hidden states).
MODEL_REGISTRY: dict[str, type[torch.nn.Module]] = {
    f"{family}{kind}": LlamaForCausalLM
    for family in ("Llama", "Mistral", "Qwen2", "Qwen3")
    for kind in ("ForCausalLM", "Model", "ForSequenceClassification")
} | {"GraniteForCausalLM": LlamaForCausalLM}


def build_model(config: ModelConfig, dtype: torch.dtype | None = None, tp=None) -> torch.nn.Module:
    """An unloaded model for ``config`` (call ``load_weights`` next); ``dtype`` sets the
    parameter dtype up front, which avoids a transient fp32 copy of a bf16 checkpoint.
    ``tp``: this rank's share under tensor parallelism (tensor_parallel.py)."""
    try:
        cls = MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise NotImplementedError(
            f"architecture {config.architecture!r} is not supported (have {sorted(MODEL_REGISTRY)})"
        ) from None
    return cls(config, dtype=dtype, tp=tp)
