"""Llama-family decoder over the paged KV cache: Llama 2/3, Mistral, Qwen2, Qwen3 (their
causal LMs, and as embedding models or classifiers: ``ModelConfig.head``).

The batch is flattened to ``T`` tokens (no padding, no batch dim); attention finds each
request's keys through the kernel backend's metadata. q/k/v and gate/up are fused into one
projection each (concatenated at load time) so a layer runs 4 GEMMs instead of 7. Every
operation goes through the backend passed to :meth:`LlamaForCausalLM.forward`
(``kernels/backend.py``); the modules hold only weights and shapes.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.backend import KVCache, Projection, TorchBackend
from kernels.rotary import rope_cos_sin
from kernels.util import cdiv

from ..model_config import ModelConfig


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None) -> Projection:
    # Weights always come from load_weights: skip the random init (minutes for 8B on CPU).
    return nn.utils.skip_init(Projection, in_features, out_features, bias=bias, dtype=dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, ops: TorchBackend, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """Holds the fp32 cos|sin table ``[max_positions, head_dim]``, gathered by position."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        table = rope_cos_sin(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
        self.register_buffer("cos_sin", table, persistent=False)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) would round the table to bf16 and shift every angle; let it
        # follow the device only. Probing fn with an empty tensor tells us the device.
        table = self._buffers.pop("cos_sin")
        super()._apply(fn, recurse)
        self.register_buffer("cos_sin", table.to(fn(torch.empty(0)).device), persistent=False)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[T, head_dim/2]``; gathered once per step for all layers."""
        return self.cos_sin[positions].chunk(2, dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.scale = c.attention_multiplier if c.attention_multiplier is not None else c.head_dim**-0.5
        self.qkv_proj = _linear(c.hidden_size, self.q_size + 2 * self.kv_size, c.attention_bias, dtype)
        self.o_proj = _linear(self.q_size, c.hidden_size, c.attention_out_bias, dtype)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
        self.qk_norm = c.qk_norm
        self.eps = c.rms_norm_eps

    def forward(self, ops: TorchBackend, rope, x, kv_cache: KVCache, meta) -> torch.Tensor:
        # (the fused q|k|v may stay column-major: every backend's attention reads any strides)
        qkv = ops.project(x, self.qkv_proj, row_major=False)
        return ops.project(ops.attention(self, qkv, rope, kv_cache, meta), self.o_proj, row_major=False)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None):
        super().__init__()
        self.gate_up_proj = _linear(config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, dtype)
        self.gate_up_proj.gated = True  # (rows: gate, then up)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, config.mlp_bias, dtype)

    def forward(self, ops: TorchBackend, x: torch.Tensor) -> torch.Tensor:
        return ops.project(ops.silu_mul_projection(x, self.gate_up_proj), self.down_proj, row_major=False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None, tp=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)
        self.tp = tp  # tensor_parallel.TpGroup: o and down are row-parallel, their outputs summed

    def forward(self, ops: TorchBackend, rope, x, residual, kv_cache: KVCache, meta):
        fused = ops.decoder_layer(self, rope, x, residual, kv_cache, meta) if self.tp is None else None
        if fused is not None:
            return fused
        # The residual add is deferred into the next norm (x + residual, then normalise),
        # which is one fused kernel in the native and GPU backends.
        if residual is None:
            x, residual = self.input_layernorm(ops, x), x
        else:
            x, residual = self.input_layernorm(ops, x, residual)
        x = self.self_attn(ops, rope, x, kv_cache, meta)
        if self.tp is not None:
            x = self.tp.all_reduce(x)
        x, residual = self.post_attention_layernorm(ops, x, residual)
        x = self.mlp(ops, x)
        if self.tp is not None:
            x = self.tp.all_reduce(x)
        return x, residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None, vocab_rows: int, tp=None):
        super().__init__()
        self.embed_tokens = nn.utils.skip_init(nn.Embedding, vocab_rows, config.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(config)  # one table for all layers
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    # HF names of the checkpoint tensors that we concatenate into one parameter.
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, tp=None):
        """``tp`` (a tensor_parallel.TpGroup): ``config`` is then this rank's share of the
        model (tensor_parallel.shard_config), and the embedding and LM head hold this rank's
        rows of the vocabulary."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.vocab_rows = config.vocab_size if tp is None else cdiv(config.vocab_size, tp.size)
        self.model = LlamaModel(config, dtype, self.vocab_rows, tp)
        self.lm_head = self.score = None
        if config.head == "lm":
            self.lm_head = _linear(config.hidden_size, self.vocab_rows, False, dtype)
            if config.tie_word_embeddings:  # one parameter, loaded as the embedding
                self.lm_head.weight = self.model.embed_tokens.weight
        elif config.head == "score":  # a classifier's (whole on every rank: it is small)
            self.score = _linear(config.hidden_size, len(config.labels), False, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.model.embed_tokens(input_ids)
        # vocab-parallel: the rows this rank holds, zeros elsewhere, summed over the ranks
        local = input_ids - self.tp.rank * self.vocab_rows
        inside = (local >= 0) & (local < self.vocab_rows)
        x = self.model.embed_tokens(local.clamp(0, self.vocab_rows - 1))
        return self.tp.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))

    def forward(self, ops: TorchBackend, input_ids: torch.Tensor, kv_caches: list[KVCache], meta) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the flattened batch (final norm applied), computed
        by the kernel backend ``ops`` over its metadata ``meta`` (``ops.prepare_metadata``)."""
        rope = self.model.rotary(meta.positions)
        x, residual = self.embed(input_ids), None
        if self.config.embedding_multiplier != 1.0:  # (Granite)
            x = x * self.config.embedding_multiplier
        fused = ops.decoder_stack(self.model.layers, rope, x, kv_caches, meta) if self.tp is None else None
        if fused is not None:
            x, residual = fused
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                x, residual = layer(ops, rope, x, residual, kv_cache, meta)
        x, _ = self.model.norm(ops, x, residual)
        return x

    def compute_logits(self, ops: TorchBackend, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over only the rows that sample: ``[N, hidden] -> [N, vocab]`` (with ``tp``,
        this rank's columns of the vocabulary)."""
        return ops.project(hidden, self.lm_head)

    def compute_scores(self, ops: TorchBackend, hidden: torch.Tensor) -> torch.Tensor:
        """A classifier's head over pooled rows: ``[N, hidden] -> [N, labels]``."""
        return ops.project(hidden, self.score)

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Take an HF-named state dict, fusing q/k/v and gate/up; strict on names and shapes.
        The dict is consumed: the model adopts its tensors (copies only to fuse or cast),
        and each entry leaves it once used, so no second copy of the weights outlives its
        own step."""
        sd = state_dict
        for name in [k for k in sd if k.endswith("rotary_emb.inv_freq")]:
            del sd[name]
        if self.lm_head is None:  # (an embedding model served from a causal LM's checkpoint)
            sd.pop("lm_head.weight", None)
        head = sd.pop("lm_head.weight", None) if self.config.tie_word_embeddings else None
        if head is not None and not torch.equal(head, sd.get("model.embed_tokens.weight", head)):
            # (some tied checkpoints store the copy anyway; a different one is ambiguous)
            raise ValueError("the config ties lm_head to embed_tokens, but the checkpoint's lm_head.weight differs")
        for i in range(self.config.num_layers):
            for fused, parts in self.FUSED.items():
                sub = "self_attn" if fused == "qkv_proj" else "mlp"
                for kind in ("weight", "bias"):
                    names = [f"model.layers.{i}.{sub}.{p}.{kind}" for p in parts]
                    if all(n in sd for n in names):
                        sd[f"model.layers.{i}.{sub}.{fused}.{kind}"] = torch.cat([sd.pop(n) for n in names])
        params = dict(self.named_parameters())
        missing, unexpected = sorted(params.keys() - sd.keys()), sorted(sd.keys() - params.keys())
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not fit {self.config.architecture}: "
                f"{len(missing)} missing {missing[:6]}, {len(unexpected)} unexpected {unexpected[:6]}"
            )
        for name, param in params.items():
            if param.shape != sd[name].shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(sd[name].shape)} != model {tuple(param.shape)}")
            # Adopt the tensor rather than copy into it: no second copy of the weights
            # (a copy is made only when the dtype differs).
            param.data = sd.pop(name).to(param.dtype).contiguous()
            param.requires_grad_(False)
        self._fold_scalars()

    def _fold_scalars(self) -> None:
        """Granite's residual multiplier and logits scaling, folded into the weights once
        (out of place: a loaded tensor may be a read-only mapping of the checkpoint): each
        block's last projection, and the final norm that feeds the LM head."""
        c = self.config
        if c.residual_multiplier != 1.0:
            for layer in self.model.layers:
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    for p in (proj.weight, proj.bias):
                        if p is not None:
                            p.data = p.data * c.residual_multiplier
        if c.logits_scaling != 1.0 and self.lm_head is not None:  # (pooled hidden states stay unscaled)
            self.model.norm.weight.data = self.model.norm.weight.data / c.logits_scaling
