"""Llama-family decoder over the paged KV cache: Llama 2/3, Mistral, Qwen2, Qwen3.

The batch is flattened to ``T`` tokens (no padding, no batch dim); attention finds each
request's keys through ``AttentionMetadata``. q/k/v and gate/up are fused into one
Linear each (concatenated at load time) so a layer runs 4 GEMMs instead of 7.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import triton_attention, triton_ops
from kernels.activation import silu_and_mul
from kernels.attention import AttentionMetadata, paged_attention, qkv_rope_store
from kernels.linear import linear, pack_weight
from kernels.norm import rms_norm
from kernels.rotary import rope_cos_sin
from kernels.triton_gemv import SMALL_BATCH_ROWS, small_batch_linear

from ..model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


def _project(layer: nn.Linear, x: torch.Tensor, row_major: bool = False) -> torch.Tensor:
    """The output may be column-major on the CPU (``linear(row_major=False)``): the native
    fused kernels and the torch paths read any strides; the Triton kernels ask for rows."""
    return linear(x, layer.weight, layer.bias, row_major, getattr(layer, "packed_weight", None))


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None) -> nn.Linear:
    # Weights always come from load_weights: skip the random init (minutes for 8B on CPU).
    return nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.triton = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        norm = triton_ops.rms_norm if self.triton else rms_norm
        return norm(x, self.weight, self.eps, residual)


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
        self.triton = False

    def forward(self, rope, x, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = _project(self.qkv_proj, x, row_major=self.triton)
        if self.triton:
            return _project(self.o_proj, self.attend(rope, qkv, kv_cache, meta), row_major=True)
        q, k, v = qkv_rope_store(qkv, *self._qkv_args(rope, kv_cache, meta))
        o = paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, k, v)
        return _project(self.o_proj, o.reshape(-1, self.q_size))

    def _qkv_args(self, rope, kv_cache: KVCache, meta: AttentionMetadata) -> tuple:
        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        return self.num_heads, self.num_kv_heads, *rope, kv_cache[0], kv_cache[1], meta.slot_mapping, *norms, self.eps

    def attend(
        self, rope, qkv: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, pdl: bool = False
    ) -> torch.Tensor:
        """Triton path from the fused projection to the attention output ``[T, H * D]``:
        q/k norm + rope + KV store in one launch, then paged attention. ``pdl``: both launch
        as programmatic dependents (kernels/triton_gemv.py)."""
        q = triton_ops.qkv_rope_store(qkv, *self._qkv_args(rope, kv_cache, meta), pdl=pdl)
        o = triton_attention.unified_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            max_query_len=meta.max_query_len,
            num_splits=meta.num_splits,
            pdl=pdl,
        )
        return o.view(-1, self.q_size)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None):
        super().__init__()
        self.gate_up_proj = _linear(config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, dtype)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, config.mlp_bias, dtype)
        self.triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = triton_ops.silu_and_mul if self.triton else silu_and_mul
        return _project(self.down_proj, act(_project(self.gate_up_proj, x, self.triton)), self.triton)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)
        self.small_batch_gemv = False
        self.pdl = False  # the small-batch kernels launch as programmatic dependents (sm_90+)

    def forward(self, rope, x, residual, kv_cache, meta):
        if self.small_batch_gemv and x.shape[0] <= SMALL_BATCH_ROWS:
            return self._forward_few_rows(rope, x, residual, kv_cache, meta)
        # The residual add is deferred into the next norm (x + residual, then normalise),
        # which is one fused kernel on GPUs.
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _forward_few_rows(self, rope, x, residual, kv_cache, meta):
        """A few rows (small decode batches, Triton): six kernels (seven with split-KV decode
        attention), the norms and the SiLU-mul fused into the projections (kernels/triton_gemv.py)."""
        attn, mlp, ln1, ln2, pdl = (
            self.self_attn,
            self.mlp,
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pdl,
        )
        qkv, residual = small_batch_linear(
            x, attn.qkv_proj.weight, attn.qkv_proj.bias, ln1.weight, residual, ln1.eps, pdl=pdl
        )
        o = small_batch_linear(
            attn.attend(rope, qkv, kv_cache, meta, pdl), attn.o_proj.weight, attn.o_proj.bias, pdl=pdl
        )
        act, residual = small_batch_linear(
            o, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, ln2.weight, residual, ln2.eps, gate_up=True, pdl=pdl
        )
        return small_batch_linear(act, mlp.down_proj.weight, mlp.down_proj.bias, pdl=pdl), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None):
        super().__init__()
        self.embed_tokens = nn.utils.skip_init(nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(config)  # one table for all layers
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    # HF names of the checkpoint tensors that we concatenate into one parameter.
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.triton = False
        self.model = LlamaModel(config, dtype)
        self.packed_lm_head = None  # set by pack_cpu_weights
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the flattened batch (final norm applied)."""
        rope = self.model.rotary(positions)
        x, residual = self.model.embed_tokens(input_ids), None
        if self.config.embedding_multiplier != 1.0:  # (Granite)
            x = x * self.config.embedding_multiplier
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(rope, x, residual, kv_cache, attn_meta)
        x, _ = self.model.norm(x, residual)
        return x

    def use_triton_kernels(self, enabled: bool = True, small_batch_gemv: bool = False, pdl: bool = False) -> None:
        """Switch every layer to the Triton kernels (GPUs; the CPU under TRITON_INTERPRET=1).
        They read the varlen metadata (``attention.build_varlen``). ``small_batch_gemv``:
        steps of at most ``SMALL_BATCH_ROWS`` tokens take the fused projections; ``pdl``: whose
        kernels launch as programmatic dependents (CUDA sm_90+ only)."""
        for module in self.modules():
            if hasattr(module, "triton"):
                module.triton = enabled
            if isinstance(module, DecoderLayer):
                module.small_batch_gemv = enabled and small_batch_gemv
                module.pdl = module.small_batch_gemv and pdl
        self.triton = enabled

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over only the rows that sample: ``[N, hidden] -> [N, vocab]``."""
        return linear(hidden, self.lm_head_weight, packed=self.packed_lm_head)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_cpu_weights(self, enabled: bool = True) -> None:
        """Keep (or drop) a packed copy of every projection for CPU batches
        (kernels/linear.py); the originals stay for the few-row kernel, prefill chunks and
        the embedding."""
        for module in self.modules():
            if isinstance(module, nn.Linear) and module is not self.lm_head:
                module.packed_weight = pack_weight(module.weight) if enabled else None
        self.packed_lm_head = pack_weight(self.lm_head_weight) if enabled else None

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Take an HF-named state dict, fusing q/k/v and gate/up; strict on names and shapes.
        The dict is consumed: the model adopts its tensors (copies only to fuse or cast),
        and each entry leaves it once used, so no second copy of the weights outlives its
        own step."""
        sd = state_dict
        for name in [k for k in sd if k.endswith("rotary_emb.inv_freq")]:
            del sd[name]
        head = sd.pop("lm_head.weight", None) if self.lm_head is None else None
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
        if c.logits_scaling != 1.0:
            self.model.norm.weight.data = self.model.norm.weight.data / c.logits_scaling
