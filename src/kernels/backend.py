"""Kernel backends: one object per kernel implementation, created once at start-up
(:func:`create_backend`) and handed to the model's forward, whose layers call it.

A backend turns a step's batch into its own attention metadata (:meth:`prepare_metadata`)
and provides what a decoder layer computes: the fused q/k/v step (q/k norm, rope, KV store)
with attention, RMSNorm (with the residual add), SiLU-mul and projections.

* ``torch``: the reference paths of ``attention.py``, ``norm.py``, ``activation.py`` on any
  device; what the other backends are tested against.
* ``cpu``: the reference plus the native C kernels (``cpu_kernels``) wherever they read the
  tensors, and the CPU projection forms of ``linear.py`` (few-row kernel, packed weights).
* ``triton``: the Triton kernels (GPUs; the CPU under ``TRITON_INTERPRET=1`` for tests), with
  optional fused small-batch projections and programmatic dependent launch.

Adding a backend: a subclass here and its entry in ``BACKENDS``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import activation, attention, cpu_decode, cpu_kernels, linear, norm, triton_attention, triton_ops
from .triton_gemv import SMALL_BATCH_ROWS, small_batch_linear

logger = logging.getLogger(__name__)

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, head_dim / 2]
KVCache = tuple[torch.Tensor, torch.Tensor]


class Projection(nn.Linear):
    """A layer's dense projection; ``packed_weight`` is a backend's copy of the weight in its
    GEMM's own layout (``CpuBackend.prepare_model``), None when it keeps none. A gated MLP's
    fused gate|up projection is ``gated`` (rows: gate, then up); a backend may instead keep
    ``packed_gated`` (and its bias), read only by ``silu_mul_projection``."""

    packed_weight: torch.Tensor | None = None
    gated: bool = False
    packed_gated: torch.Tensor | None = None
    packed_gated_bias: torch.Tensor | None = None


class TorchBackend:
    """The reference paths, on any device."""

    name = "torch"

    def __init__(self, device: torch.device, block_size: int, **_options: Any):
        self.device, self.block_size = device, block_size

    def prepare_model(self, model: nn.Module) -> None:
        """Per-backend weight preparation, once after loading (none here: packed copies another
        runner may have left on a shared model are not read)."""

    def prepare_metadata(
        self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]]
    ) -> attention.AttentionMetadata:
        """A step's metadata; the batch's decodes (query length 1) come first."""
        return attention.AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size, self.device)

    def attention(self, layer, qkv: torch.Tensor, rope: Rope, kv_cache: KVCache, meta) -> torch.Tensor:
        """From a layer's fused q|k|v projection to its attention output ``[T, heads * head_dim]``:
        q/k norm and rope, this step's K/V stored in the cache, paged attention. ``layer`` gives
        ``num_heads``, ``num_kv_heads``, ``q_size``, ``scale``, ``eps`` and the q/k norm weights."""
        q, k, v = attention.qkv_rope_store(qkv, *_qkv_args(layer, rope, kv_cache, meta))
        return attention.paged_attention(q, kv_cache[0], kv_cache[1], meta, layer.scale, k, v).view(-1, layer.q_size)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        """``rms_norm(x)``, or with ``residual`` ``(rms_norm(x + residual), x + residual)``."""
        return norm.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul(x)

    def project(self, x: torch.Tensor, proj: Projection, row_major: bool = True) -> torch.Tensor:
        """``proj(x)``; ``row_major=False`` lets a backend return a column-major result for a
        consumer that reads any strides (the next call of this backend)."""
        return F.linear(x, proj.weight, proj.bias)

    def silu_mul_projection(self, x: torch.Tensor, proj: Projection) -> torch.Tensor:
        """``silu(gate) * up`` of a ``gated`` projection of ``x``."""
        return self.silu_and_mul(self.project(x, proj, row_major=False))

    def decoder_layer(self, layer, rope: Rope, x, residual, kv_cache: KVCache, meta):
        """A whole decoder layer in a backend's own fused form, or None for the layer's own
        sequence of the operations above."""
        return None

    def decoder_stack(self, layers, rope: Rope, x, kv_caches: list[KVCache], meta):
        """All decoder layers in one fused call: ``(output, residual)`` of the last, as the
        layers one by one return them, or None to run them one by one."""
        return None


class CpuBackend(TorchBackend):
    """The reference with the native CPU kernels where they apply (each wrapper returns None
    where it does not, and the reference runs instead)."""

    name = "cpu"

    def __init__(self, device: torch.device, block_size: int, packed_weights: bool = False, **options: Any):
        super().__init__(device, block_size, **options)
        self.packed_weights = packed_weights
        # per decoder layer: (the K cache and dtype it was built for, its plan or None)
        self._plans: dict[nn.Module, tuple[torch.Tensor, torch.dtype, cpu_decode.LayerPlan | None]] = {}
        self._step: tuple[object, cpu_decode.KernelStep | None] = (None, None)
        # (the K caches it was built for, the layer stack or None)
        self._stack: tuple[list[torch.Tensor], cpu_decode.LayerStack | None] = ([], None)

    def prepare_model(self, model: nn.Module) -> None:
        """A packed copy of every projection and the LM head for decode batches
        (``linear.pack_weight``), or none; another runner sharing the model may have packed it."""
        packed = 0
        for module in model.modules():
            if isinstance(module, Projection):
                if not self.packed_weights:
                    module.packed_weight = module.packed_gated = module.packed_gated_bias = None
                elif module.packed_weight is None and module.packed_gated is None:
                    weight, gated = module.weight, None
                    if (
                        module.gated
                        and weight.dtype == torch.bfloat16
                        and weight.shape[0] % 32 == 0
                        and cpu_kernels.has_amx()
                    ):
                        gated = cpu_kernels.amx_pack(cpu_kernels.gated_pairs(weight))
                    if gated is not None:
                        # the AMX kernel's fused silu(gate) * up: this copy serves that alone
                        module.packed_gated = gated
                        module.packed_gated_bias = None if module.bias is None else cpu_kernels.gated_pairs(module.bias)
                    else:
                        module.packed_weight = linear.pack_weight(module.weight)
                    packed += module.weight.numel() * module.weight.element_size()
        if packed:
            logger.info("projections packed for CPU batches (+%.2f GiB)", packed / 2**30)

    def attention(self, layer, qkv: torch.Tensor, rope: Rope, kv_cache: KVCache, meta) -> torch.Tensor:
        args = (qkv, *_qkv_args(layer, rope, kv_cache, meta))
        fused = cpu_kernels.qkv_rope_store(*args)
        q, k, v = fused if fused is not None else attention.qkv_rope_store(*args)
        return self.paged_attention(q, kv_cache[0], kv_cache[1], meta, layer.scale, k, v).view(-1, layer.q_size)

    @staticmethod
    def paged_attention(q, k_cache, v_cache, meta, scale: float, k_new=None, v_new=None) -> torch.Tensor:
        """``attention.paged_attention`` with the decode rows on the native kernel."""
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            native = cpu_kernels.paged_decode_attention(
                q[:n],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
                max_seq_len=meta.decode_max_seq_len or None,
                out=out[:n],
            )
            if native is None:
                flat = attention.flat_cache
                out[:n] = attention.decode_attention(q[:n], flat(k_cache), flat(v_cache), meta, scale)
        if meta.prefills and not cpu_kernels.paged_prefill_attention(
            q, k_cache, v_cache, meta.prefill_segments, meta.prefill_block_tables, scale, out
        ):
            attention.prefill_attention(q, k_cache, v_cache, meta, scale, out, k_new, v_new)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        native = cpu_kernels.add_rms_norm(x, weight, eps, residual)  # (updates residual in place)
        return native if native is not None else norm.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        native = cpu_kernels.silu_mul(x)
        return native if native is not None else activation.silu_and_mul(x)

    def project(self, x: torch.Tensor, proj: Projection, row_major: bool = True) -> torch.Tensor:
        return linear.linear(x, proj.weight, proj.bias, row_major, proj.packed_weight)

    def silu_mul_projection(self, x: torch.Tensor, proj: Projection) -> torch.Tensor:
        if proj.packed_gated is not None and x.dim() == 2 and x.shape[0] > linear.few_rows_max(x.dtype, True):
            out = cpu_kernels.amx_linear(x, proj.packed_gated, proj.packed_gated_bias, gated=True)
            if out is not None:
                return out
        return super().silu_mul_projection(x, proj)

    def decoder_layer(self, layer, rope: Rope, x, residual, kv_cache: KVCache, meta):
        """A decode-only step's layer as its native kernels called directly (``cpu_decode``);
        None for any other step."""
        step = self._kernel_step(meta, rope, x)
        plan = None if step is None or not step.decode_only else self._plan(layer, kv_cache, x.dtype)
        return None if plan is None else plan(step, x, residual)

    def decoder_stack(self, layers, rope: Rope, x, kv_caches: list[KVCache], meta):
        """A step's layers in one native call (``cpu_decode.LayerStack``) where all their
        projections have native kernels at its rows; None otherwise."""
        step = self._kernel_step(meta, rope, x)
        if step is None:
            return None
        built_for, stack = self._stack
        if len(built_for) != len(kv_caches) or any(k is not c[0] for k, c in zip(built_for, kv_caches)):
            plans = [self._plan(layer, kv_cache, x.dtype) for layer, kv_cache in zip(layers, kv_caches)]
            stack = cpu_decode.LayerStack.build(plans)
            self._stack = [c[0] for c in kv_caches], stack
        return None if stack is None else stack(step, x)

    def _kernel_step(self, meta, rope: Rope, x) -> cpu_decode.KernelStep | None:
        """The step's metadata as the kernels read it, built once per step; None for a step
        they do not run."""
        step_meta, step = self._step
        if step_meta is not meta:
            step = cpu_decode.KernelStep.build(meta, rope, x.shape[0]) if x.dim() == 2 and x.is_cpu else None
            self._step = meta, step
        return step

    def _plan(self, layer, kv_cache: KVCache, dtype: torch.dtype) -> cpu_decode.LayerPlan | None:
        cached = self._plans.get(layer)
        if cached is None or cached[0] is not kv_cache[0] or cached[1] != dtype:
            cached = (kv_cache[0], dtype, cpu_decode.LayerPlan.build(layer, kv_cache, dtype))
            self._plans[layer] = cached
        return cached[2]


class TritonBackend(TorchBackend):
    """The Triton kernels over the varlen metadata (``triton_attention.build_varlen``).

    ``small_batch_gemv``: steps of at most ``SMALL_BATCH_ROWS`` tokens run each layer as the
    fused projections of ``triton_gemv`` (norms and SiLU-mul folded in); ``pdl``: those kernels
    launch as programmatic dependents (CUDA sm_90+)."""

    name = "triton"

    def __init__(
        self,
        device: torch.device,
        block_size: int,
        num_kv_heads: int = 1,
        num_sms: int = 1,
        small_batch_gemv: bool = False,
        pdl: bool = False,
        upload: Callable[[np.ndarray], torch.Tensor] | None = None,
        **options: Any,
    ):
        super().__init__(device, block_size, **options)
        self.num_kv_heads, self.num_sms, self.upload = num_kv_heads, num_sms, upload
        self.small_batch_gemv, self.pdl = small_batch_gemv, small_batch_gemv and pdl

    def prepare_metadata(
        self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]]
    ) -> triton_attention.VarlenMetadata:
        """Decode-only batches split the keys (flash-decoding) when they alone would leave SMs idle."""
        decode = len(query_lens) == sum(query_lens)
        splits = triton_attention.decode_splits(len(query_lens), self.num_kv_heads, self.num_sms) if decode else 1
        return triton_attention.build_varlen(
            query_lens, seq_lens, block_tables, self.block_size, self.device, splits, upload=self.upload
        )

    def attention(self, layer, qkv: torch.Tensor, rope: Rope, kv_cache: KVCache, meta, pdl: bool = False):
        q = triton_ops.qkv_rope_store(qkv, *_qkv_args(layer, rope, kv_cache, meta), pdl=pdl)
        o = triton_attention.unified_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            layer.scale,
            max_query_len=meta.max_query_len,
            num_splits=meta.num_splits,
            pdl=pdl,
        )
        return o.view(-1, layer.q_size)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        return triton_ops.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return triton_ops.silu_and_mul(x)

    def decoder_layer(self, layer, rope: Rope, x, residual, kv_cache: KVCache, meta):
        """Six kernels (seven with split-KV decode attention) for a step of a few rows."""
        if not self.small_batch_gemv or x.shape[0] > SMALL_BATCH_ROWS:
            return None
        attn, mlp, ln1, ln2, pdl = (
            layer.self_attn,
            layer.mlp,
            layer.input_layernorm,
            layer.post_attention_layernorm,
            self.pdl,
        )
        qkv_proj, o_proj, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        qkv, residual = small_batch_linear(x, qkv_proj.weight, qkv_proj.bias, ln1.weight, residual, ln1.eps, pdl=pdl)
        o = small_batch_linear(
            self.attention(attn, qkv, rope, kv_cache, meta, pdl), o_proj.weight, o_proj.bias, pdl=pdl
        )
        act, residual = small_batch_linear(
            o, gate_up.weight, gate_up.bias, ln2.weight, residual, ln2.eps, gate_up=True, pdl=pdl
        )
        return small_batch_linear(act, down.weight, down.bias, pdl=pdl), residual


def _qkv_args(layer, rope: Rope, kv_cache: KVCache, meta) -> tuple:
    """The arguments after ``qkv`` of every ``qkv_rope_store`` (reference, native, Triton)."""
    norms = (layer.q_norm.weight, layer.k_norm.weight) if layer.qk_norm else (None, None)
    return layer.num_heads, layer.num_kv_heads, *rope, kv_cache[0], kv_cache[1], meta.slot_mapping, *norms, layer.eps


BACKENDS: dict[str, type[TorchBackend]] = {"torch": TorchBackend, "cpu": CpuBackend, "triton": TritonBackend}


def create_backend(name: str, device: torch.device, block_size: int, **options: Any) -> TorchBackend:
    """The backend ``name`` (a resolved name: see ``scheduler/config.py``) for ``device``;
    ``options`` are its constructor's (the others ignore them)."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown kernel backend {name!r}; have {sorted(BACKENDS)}") from None
    return cls(device, block_size, **options)
