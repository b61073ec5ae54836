"""The model hyper-parameters the engine needs, read from an HF config.json or GGUF metadata.

One flat dataclass covers the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3): the
differences are a few flags (qkv bias, q/k norm, rope scaling, tied embeddings).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

# model_type -> HF architecture, for configs that do not name one (and for GGUF).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
}
# GGUF general.architecture -> HF architecture: not granite (its llama.cpp q/k layout and
# scale keys are unverified here: serve its HF checkpoint).
GGUF_ARCHITECTURES = {k: v for k, v in ARCHITECTURES.items() if k != "granite"}
# What each supported rope scaling reads (kernels/rotary.py): checked at start-up, so an
# incomplete config is refused by name rather than with a bare KeyError.
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear" | "yarn" | "freq_factors", ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2; Llama/Qwen3 when attention_bias)
    attention_out_bias: bool = False  # bias on o_proj (Llama/Qwen3 when attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    sliding_window: int | None = None  # attention here is full: the runner caps the context at it
    # Granite's scalars: embeddings x embedding_multiplier, each block's output x
    # residual_multiplier before it joins the residual, attention scores x attention_multiplier
    # (None: 1/sqrt(head_dim)), logits / logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # What sits on the last hidden state: "lm" (the LM head, a *ForCausalLM), "score" (a
    # *ForSequenceClassification's head, one logit per label) or "none" (a bare *Model,
    # or an embedding model that pools hidden states)
    head: str = "lm"
    labels: tuple[str, ...] = ()  # a classifier's, in logit order (its config's id2label)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)

    # -- HF ----------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        if cfg.get("architectures"):
            architecture = cfg["architectures"][0]
        elif model_type in ARCHITECTURES:
            architecture = ARCHITECTURES[model_type]
        else:
            raise NotImplementedError(f"model_type {model_type!r} is not supported (have {sorted(ARCHITECTURES)})")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise NotImplementedError(f"hidden_act {act!r} is not supported (the MLP here is SiLU-gated)")
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes `rope_parameters` (theta inside); older configs use
        # `rope_theta` + `rope_scaling` (whose type key was once "type").
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        if rope.get("rope_type") == "yarn":  # as HF reads it: the pretraining context and its ratio
            max_positions = cfg.get("max_position_embeddings", 4096)
            # (a top-level original_max_position_embeddings wins, as Phi-3 writes it)
            original = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
            rope["original_max_position_embeddings"] = original = original or max_positions
            if rope.get("factor") is None:
                rope["factor"] = max_positions / original
            # what yarn is for: the context grows to factor x the original (as vLLM derives it)
            cfg = {**cfg, "max_position_embeddings": max(max_positions, int(original * rope["factor"]))}
        missing = [k for k in _ROPE_SCALING_KEYS.get(rope.get("rope_type"), ()) if k not in rope]
        if missing:
            raise ValueError(f"rope scaling {rope['rope_type']!r} needs {', '.join(missing)} in the config")
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise NotImplementedError(
                f"quantised checkpoints ({method}) are not supported: serve the unquantised "
                "weights, or a GGUF file (dequantised at load)"
            )
        bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3"):  # sliding only on layers >= max_window_layers, if enabled
            layer_types = cfg.get("layer_types") or []
            layers = cfg["num_hidden_layers"]
            if not cfg.get("use_sliding_window", False) or (
                "sliding_attention" not in layer_types and cfg.get("max_window_layers", layers) >= layers
            ):
                window = None
        head, labels = "lm", ()
        if architecture.endswith("ForSequenceClassification"):
            head, labels = "score", _labels(cfg)
        elif architecture.endswith("Model"):  # (a base model's checkpoint: no head at all)
            head = "none"
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has a qkv bias and never an o_proj bias; Llama/Qwen3 put one on all four.
            attention_bias=model_type == "qwen2" or bias,
            attention_out_bias=model_type != "qwen2" and bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            **(_granite_scalars(cfg) if model_type == "granite" else {}),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            head=head,
            labels=labels,
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> ModelConfig:
        """config.json, with the eos list widened by generation_config.json (chat models
        such as Llama 3 Instruct stop on <|eot_id|>, which only the latter names)."""
        with open(os.path.join(path, "config.json")) as f:
            config = cls.from_hf_dict(json.load(f))
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen_eos = json.load(f).get("eos_token_id")
            if gen_eos is not None:
                extra = gen_eos if isinstance(gen_eos, list) else [gen_eos]
                merged = list(dict.fromkeys([*config.eos_token_ids, *extra]))
                config.eos_token_id = merged[0] if len(merged) == 1 else merged
        return config

    # -- GGUF --------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader) -> ModelConfig:
        """From a ``gguf.GGUFReader``'s metadata (``<arch>.*`` keys) and tensor list."""

        def field(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        arch = field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            have = sorted(GGUF_ARCHITECTURES)
            raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (have {have})")
        tensors = {t.name: t for t in reader.tensors}
        hidden = field(f"{arch}.embedding_length")
        heads = field(f"{arch}.attention.head_count")
        head_dim = field(f"{arch}.attention.key_length") or hidden // heads
        rope_dim = field(f"{arch}.rope.dimension_count", head_dim)
        if rope_dim != head_dim:
            raise NotImplementedError(f"partial rotary ({rope_dim} of {head_dim} dims) is not supported")
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else field(f"{arch}.vocab_size")
        vocab = vocab or int(tensors["token_embd.weight"].shape[-1])
        rope_scaling = None
        scaling, factor = field(f"{arch}.rope.scaling.type"), field(f"{arch}.rope.scaling.factor")
        if scaling == "linear" and factor:
            rope_scaling = {"rope_type": "linear", "factor": factor}
        elif scaling not in (None, "none"):
            raise NotImplementedError(f"GGUF rope scaling {scaling!r} is not supported (only linear, with a factor)")
        if "rope_freqs.weight" in tensors:  # Llama 3.1 GGUFs carry the llama3 scaling as divisors
            rope_scaling = {"rope_type": "freq_factors", "freq_factors": tensors["rope_freqs.weight"].data.tolist()}
        # Chat GGUFs name the end-of-turn token separately from eos; stop on both.
        eos = [field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        eos = list(dict.fromkeys(e for e in eos if e is not None))
        bias = "blk.0.attn_q.bias" in tensors
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
            model_type=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=field(f"{arch}.feed_forward_length"),
            num_layers=field(f"{arch}.block_count"),
            num_heads=heads,
            num_kv_heads=field(f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=field(f"{arch}.context_length", 4096),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias=bias,
            attention_out_bias="blk.0.attn_output.bias" in tensors,
            mlp_bias="blk.0.ffn_up.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            bos_token_id=field("tokenizer.ggml.bos_token_id"),
            eos_token_id=(eos[0] if len(eos) == 1 else eos) if eos else None,
            pad_token_id=field("tokenizer.ggml.padding_token_id"),
        )


def _labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's label names by logit index: its id2label (keys are strings in
    config.json), ``LABEL_i`` where it names none (HF's default, two labels when unsaid)."""
    id2label = {str(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
    count = cfg.get("num_labels") or len(id2label) or 2
    return tuple(id2label.get(str(i), f"LABEL_{i}") for i in range(count))


def _granite_scalars(cfg: dict[str, Any]) -> dict[str, float]:
    """Granite's four multipliers, with HF's defaults (its attention multiplier replaces
    1/sqrt(head_dim) outright, 1.0 when unset)."""
    return {
        "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "attention_multiplier": float(cfg.get("attention_multiplier", 1.0)),
        "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
    }
