"""A CPU step's decoder layers as direct native calls.

At a few rows (one request, or a handful) a step's kernels take microseconds each, while the
per-operation path around them (the model's modules, the backend, and each ``cpu_kernels``
wrapper checking dtypes, devices, shapes and strides again) adds thousands of Python
operations per step: a large share of one request's decode step, and a fixed cost in every
larger one (docs/performance.md). Here what does not change is checked once: a layer's
weights and KV cache when its :class:`LayerPlan` is built, the step's metadata once per step
(:class:`KernelStep`). A layer is then the kernels the per-operation path would pick
(csrc/fused_ops.c, gemv.c, paged_decode_attention.c, amx_linear.c on AMX-packed weights;
``linear.linear`` for other projections of more rows than the few-row kernel takes), called on
pointers, so it computes exactly what that path computes.

Where every projection of a step (decode, or with prefill chunks) is on a native kernel,
:class:`LayerStack` runs all the layers in one call (csrc/decode_layers.c, the same kernels in
the same order, the prefill chunks' attention on csrc/paged_prefill_attention.c), leaving no
Python between them.
"""

from __future__ import annotations

import ctypes

import torch

from . import activation, attention, cpu_kernels, linear
from .attention import AttentionMetadata


def _ok(dtype: torch.dtype, *tensors: torch.Tensor | None) -> bool:
    """All present tensors contiguous CPU tensors of ``dtype``."""
    return all(t is None or (t.dtype == dtype and t.is_cpu and t.is_contiguous()) for t in tensors)


class KernelStep:
    """A step's metadata as the kernels read it: its decode rows first, then (for
    :class:`LayerStack` alone) its prefill chunks; :meth:`build` gives None for a step the
    kernels do not read."""

    def __init__(self, meta: AttentionMetadata, cos: torch.Tensor, sin: torch.Tensor, rows: int):
        self.meta, self.cos, self.sin, self.rows = meta, cos, sin, rows
        self.decode_only = not meta.prefills

    @staticmethod
    def build(meta, rope: tuple[torch.Tensor, torch.Tensor], rows: int) -> KernelStep | None:
        cos, sin = rope
        if not (
            isinstance(meta, AttentionMetadata)
            and rows > 0
            and _ok(torch.int64, meta.slot_mapping)
            and meta.slot_mapping.shape == (rows,)
            and cos.dtype == sin.dtype == torch.float32
            and cos.is_cpu
            and sin.is_cpu
            and cos.dim() == sin.dim() == 2
            and cos.shape[0] >= rows
            and cos.stride(1) == sin.stride(1) == 1
            and cos.stride(0) == sin.stride(0)
        ):
            return None
        decodes = meta.num_decodes
        if decodes and not (
            _ok(torch.int64, meta.decode_block_tables, meta.decode_seq_lens)
            and meta.decode_block_tables.dim() == 2
            and meta.decode_max_seq_len <= meta.decode_block_tables.shape[1] * meta.block_size
        ):
            return None
        if meta.prefills and not (
            _ok(torch.int64, meta.prefill_segments, meta.prefill_block_tables)
            and meta.prefill_block_tables.dim() == 2
            and meta.prefill_segments.shape == (len(meta.prefills), 3)
            and meta.prefills[-1].q_end == rows
            and meta.prefills[0].q_start == decodes
        ):
            return None
        return KernelStep(meta, cos, sin, rows) if decodes == rows or meta.prefills else None


class LayerPlan:
    """One decoder layer's weights, KV cache and kernels, checked once (:meth:`build`)."""

    def __init__(self, layer, kv_cache, dtype: torch.dtype, kernels: dict):
        attn, mlp = layer.self_attn, layer.mlp
        self.dtype, self.k = dtype, kernels
        self.k_cache, self.v_cache = kv_cache
        self.block_size = self.k_cache.shape[1]
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale, self.eps = attn.scale, attn.eps
        self.norm1, self.norm1_eps = layer.input_layernorm.weight, layer.input_layernorm.eps
        self.norm2, self.norm2_eps = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        self.q_norm = attn.q_norm.weight if attn.qk_norm else None
        self.k_norm = attn.k_norm.weight if attn.qk_norm else None
        self.projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        self.inner = mlp.gate_up_proj.weight.shape[0] // 2
        # Which kernel each projection takes, as linear.linear would pick it: the few-row
        # kernel up to few_rows[i] rows, past that AMX tiles where there are some (tiles[i]);
        # gate|up with its silu in the AMX kernel (gated: tiles and bias) from gated_min_rows.
        amx = kernels["amx"] is not None
        self.few_rows = tuple(linear.few_rows_max(dtype, p.packed_weight is not None) for p in self.projections)
        self.tiles = tuple(
            p.packed_weight if amx and p.packed_weight is not None and linear.is_amx_packed(p.packed_weight) else None
            for p in self.projections
        )
        gate_up = mlp.gate_up_proj
        self.gated = (
            (gate_up.packed_gated, gate_up.packed_gated_bias) if amx and gate_up.packed_gated is not None else None
        )
        self.gated_min_rows = linear.few_rows_max(dtype, True) + 1

    @staticmethod
    def build(layer, kv_cache, dtype: torch.dtype) -> LayerPlan | None:
        """The plan, or None where a part of the layer is not for the native kernels (the
        per-operation path then runs it, with the reference where they decline)."""
        attn, mlp = layer.self_attn, layer.mlp
        k_cache, v_cache = kv_cache
        kernels = {
            "norm": cpu_kernels.native_kernel("fused_ops", "add_rms_norm", dtype),
            "silu_mul": cpu_kernels.native_kernel("fused_ops", "silu_mul", dtype),
            "qkv": cpu_kernels.native_kernel("fused_ops", "qkv_rope_store", dtype),
            "attention": cpu_kernels.native_kernel("paged_decode_attention", "paged_decode_attention", dtype),
            "gemv": cpu_kernels.native_kernel("gemv", "few_rows_linear", dtype),
        }
        projections = qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        hidden = layer.input_layernorm.weight.numel()
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if attn.qk_norm:
            norms += [attn.q_norm.weight, attn.k_norm.weight]
        if not (
            all(kernels.values())
            and _ok(dtype, k_cache, v_cache, *norms)
            and all(
                _ok(dtype, p.weight, p.bias) and p.weight.dim() == 2 and p.weight.shape[1] % 32 == 0
                for p in projections
            )
            and qkv.weight.shape == ((heads + 2 * kv_heads) * head_dim, hidden)
            and o.weight.shape == (hidden, heads * head_dim)
            and gate_up.weight.shape[1] == hidden
            and down.weight.shape == (hidden, gate_up.weight.shape[0] // 2)
            and k_cache.dim() == 4
            and v_cache.shape == k_cache.shape
            and k_cache.shape[2:] == (kv_heads, head_dim)
            and cpu_kernels.decode_attention_reads(heads, kv_heads, head_dim, k_cache.shape[1])
        ):
            return None
        amx = dtype == torch.bfloat16 and cpu_kernels.has_amx()  # (packed weights may be AMX tiles)
        kernels["amx"] = cpu_kernels.native_kernel("amx_linear", "amx_linear", dtype) if amx else None
        # (for LayerStack's steps with prefill chunks)
        kernels["prefill_attention"] = cpu_kernels.native_kernel(
            "paged_prefill_attention", "paged_prefill_attention", dtype
        )
        return LayerPlan(layer, kv_cache, dtype, kernels)

    def native_at(self, rows: int) -> bool:
        """Whether :meth:`project` and :meth:`gate_up_silu` take native kernels at ``rows`` rows."""
        gated = self.gated is not None and rows >= self.gated_min_rows
        return all(
            (index == 2 and gated) or rows <= self.few_rows[index] or self.tiles[index] is not None
            for index in range(4)
        )

    def project(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Projection ``index`` (q|k|v, o, gate|up, down) of ``x``, in the form ``linear.linear``
        picks: the few-row kernel or the AMX tile kernel called directly where they apply, else
        ``linear.linear`` itself (whose result may stay column-major: the fused kernels read any
        strides)."""
        proj = self.projections[index]
        weight, bias, tiles = proj.weight, proj.bias, self.tiles[index]
        rows, (n, k) = x.shape[0], weight.shape
        if rows <= self.few_rows[index] and x.is_contiguous():
            out = torch.empty(rows, n, dtype=self.dtype)
            if self.k["gemv"](x.data_ptr(), weight.data_ptr(), _ptr(bias), out.data_ptr(), rows, n, k) == 0:
                return out
        elif tiles is not None:
            out = self.amx(x, tiles, bias, n, k, gated=False)
            if out is not None:
                return out
        return linear.linear(x, weight, bias, False, proj.packed_weight)

    def gate_up_silu(self, h: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused gate|up projection: in one AMX tile kernel where
        the backend packed the weight for it (past the few-row kernel), else the projection,
        then silu_mul."""
        if self.gated is not None and h.shape[0] >= self.gated_min_rows:
            out = self.amx(h, *self.gated, *self.projections[2].weight.shape, gated=True)
            if out is not None:
                return out
        return self.silu_mul(self.project(h, 2))

    def amx(self, x: torch.Tensor, packed, bias, n: int, k: int, gated: bool) -> torch.Tensor | None:
        """amx_linear.c on ``x``'s rows (``[rows, n]``, or ``[rows, n / 2]`` ``gated``), or None
        where it declines (rows not unit-stride)."""
        if x.stride(1) != 1:
            return None
        rows, width = x.shape[0], n // 2 if gated else n
        out = torch.empty(rows, width, dtype=self.dtype)
        status = self.k["amx"](
            x.data_ptr(), x.stride(0), packed.data_ptr(), _ptr(bias), out.data_ptr(), width, rows, n, k, int(gated)
        )
        return out if status == 0 else None

    def norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``rms_norm(x)``, or ``rms_norm(x + residual)`` with ``residual`` updated in place."""
        rows, d = x.shape
        out = torch.empty(rows, d, dtype=self.dtype)
        self.k["norm"](
            x.data_ptr(), x.stride(0), x.stride(1), _ptr(residual), weight.data_ptr(), out.data_ptr(), rows, d, eps
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
        if gate_up.stride(1) != 1:  # column-major (a short batch's projection): the wrapper's layouts
            out = cpu_kernels.silu_mul(gate_up)
            return out if out is not None else activation.silu_and_mul(gate_up)
        out = torch.empty(rows, inner, dtype=self.dtype)
        self.k["silu_mul"](gate_up.data_ptr(), gate_up.stride(0), inner, out.data_ptr(), inner, rows, inner)
        return out

    def __call__(self, step: KernelStep, x: torch.Tensor, residual: torch.Tensor | None):
        """The layer on ``x [rows, hidden]`` of a decode-only ``step``: ``(output, residual)`` as
        ``DecoderLayer.forward`` returns them, or None (nothing done) for rope tables or an
        ``x`` it does not read."""
        rows, dt, hd, meta = step.rows, self.dtype, self.head_dim, step.meta
        if step.cos.shape[1] * 2 != hd or x.dtype != dt or (residual is None and not x.is_contiguous()):
            return None
        if residual is None:  # the first layer: the residual stream starts as x
            h, residual = self.norm(x, None, self.norm1, self.norm1_eps), x
        else:
            h = self.norm(x, residual, self.norm1, self.norm1_eps)
        qkv = self.project(h, 0)
        q = torch.empty(rows, self.heads, hd, dtype=dt)
        kv = torch.empty(2, rows, self.kv_heads, hd, dtype=dt)  # this step's k and v (the cache has them)
        self.k["qkv"](
            qkv.data_ptr(),
            qkv.stride(0),
            qkv.stride(1),
            _ptr(self.q_norm),
            _ptr(self.k_norm),
            self.eps,
            step.cos.data_ptr(),
            step.sin.data_ptr(),
            step.cos.stride(0),
            meta.slot_mapping.data_ptr(),
            self.k_cache.data_ptr(),
            self.v_cache.data_ptr(),
            q.data_ptr(),
            kv[0].data_ptr(),
            kv[1].data_ptr(),
            rows,
            self.heads,
            self.kv_heads,
            hd,
        )
        attn = torch.empty_like(q)
        status = self.k["attention"](
            q.data_ptr(),
            self.k_cache.data_ptr(),
            self.v_cache.data_ptr(),
            meta.decode_block_tables.data_ptr(),
            meta.decode_seq_lens.data_ptr(),
            attn.data_ptr(),
            rows,
            self.heads,
            self.kv_heads,
            hd,
            self.block_size,
            meta.decode_block_tables.shape[1],
            self.scale,
            0,
        )
        if status != 0:  # (out of memory for its partial states): the torch path
            flat_k, flat_v = attention.flat_cache(self.k_cache), attention.flat_cache(self.v_cache)
            attn = attention.decode_attention(q, flat_k, flat_v, meta, self.scale)
        o = self.project(attn.view(rows, -1), 1)
        h = self.norm(o, residual, self.norm2, self.norm2_eps)
        return self.project(self.gate_up_silu(h), 3), residual


class LayerStack:
    """All decoder layers of a step as one call of csrc/decode_layers.c, built from the
    layers' plans (:meth:`build`); it keeps the tensors it points to alive."""

    def __init__(self, plans: list[LayerPlan], kernels: _Kernels, run, workspace):
        first = plans[0]
        self.plans, self.kernels, self.run, self.workspace = plans, kernels, run, workspace
        self.dtype, self.hidden = first.dtype, first.norm1.numel()
        self.layers = (_Layer * len(plans))(*(_layer(plan) for plan in plans))
        self.shape = (first.heads, first.kv_heads, first.head_dim, self.hidden, first.inner, first.block_size)
        self._native_at: dict[int, bool] = {}

    @staticmethod
    def build(plans: list[LayerPlan | None]) -> LayerStack | None:
        """The stack, or None where a layer has no plan, the layers differ in shape or dtype,
        or the library is not available."""
        if not plans or any(plan is None for plan in plans):
            return None
        first = plans[0]
        shape = (first.dtype, first.heads, first.kv_heads, first.head_dim, first.inner, first.block_size)
        if any((p.dtype, p.heads, p.kv_heads, p.head_dim, p.inner, p.block_size) != shape for p in plans):
            return None
        run = cpu_kernels.native_kernel("decode_layers", "decode_layers", first.dtype)
        workspace = cpu_kernels.native_kernel("decode_layers", "decode_layers_workspace", first.dtype)
        if run is None or workspace is None:
            return None
        addresses = {name: _address(first.k.get(name)) for name in _KERNELS}
        if any(addresses[name] is None for name in ("norm", "silu_mul", "qkv", "gemv", "attention")):
            return None  # (amx and prefill_attention are optional: steps that need them decline)
        return LayerStack(plans, _Kernels(*(addresses[name] for name in _KERNELS)), run, workspace)

    def native_at(self, rows: int) -> bool:
        """Whether every projection of a ``rows``-row step has a native kernel (the few-row
        kernel, or AMX tiles), as the one call needs."""
        native = self._native_at.get(rows)
        if native is None:
            native = all(plan.native_at(rows) for plan in self.plans)
            self._native_at[rows] = native
        return native

    def __call__(self, step: KernelStep, x: torch.Tensor):
        """``(output, residual)`` of the last layer on the embeddings ``x [rows, hidden]``, as
        the layers one by one return them, or None (nothing written but KV cache rows a
        per-layer run writes again) where the step is not for the one call."""
        rows, heads, kv_heads, head_dim, hidden, inner, block_size = step.rows, *self.shape
        if (
            step.cos.shape[1] * 2 != head_dim
            or x.dtype != self.dtype
            or x.shape != (rows, hidden)
            or not x.is_contiguous()
            or not self.native_at(rows)
        ):
            return None
        meta = step.meta
        decodes, prefills = meta.num_decodes, meta.prefill_segments
        if prefills is not None and (self.kernels.prefill_attention is None or head_dim % 16):
            return None
        args = _Step(
            rows,
            heads,
            kv_heads,
            head_dim,
            hidden,
            inner,
            block_size,
            step.cos.data_ptr(),
            step.sin.data_ptr(),
            step.cos.stride(0),
            meta.slot_mapping.data_ptr(),
            decodes,
            meta.decode_block_tables.shape[1] if decodes else 0,
            _ptr(meta.decode_block_tables) if decodes else None,
            _ptr(meta.decode_seq_lens) if decodes else None,
            0 if prefills is None else prefills.shape[0],
            0 if prefills is None else meta.prefill_block_tables.shape[1],
            _ptr(prefills),
            _ptr(meta.prefill_block_tables),
        )
        workspace = torch.empty(self.workspace(ctypes.byref(args)), dtype=self.dtype)
        if self.run(
            ctypes.byref(self.kernels),
            self.layers,
            len(self.plans),
            ctypes.byref(args),
            x.data_ptr(),
            workspace.data_ptr(),
        ):
            return None
        size = rows * hidden
        return workspace[:size].view(rows, hidden), workspace[size : 2 * size].view(rows, hidden)


# csrc/decode_layers.c's structs
_P, _I32, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_KERNELS = ("norm", "silu_mul", "qkv", "gemv", "amx", "attention", "prefill_attention")


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _P) for name in _KERNELS]


class _Projection(ctypes.Structure):
    _fields_ = [("weight", _P), ("bias", _P), ("tiles", _P), ("n", _I32), ("k", _I32), ("gemv_max_rows", _I32)]


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, _P) for name in ("norm1", "norm2", "q_norm", "k_norm")),
        *((name, _F32) for name in ("norm1_eps", "norm2_eps", "qk_norm_eps", "scale")),
        *((name, _Projection) for name in ("qkv", "o", "gate_up", "down")),
        ("gated_tiles", _P),
        ("gated_bias", _P),
        ("gated_min_rows", _I32),
        ("k_cache", _P),
        ("v_cache", _P),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, _I32) for name in ("rows", "heads", "kv_heads", "head_dim", "hidden", "inter", "block_size")),
        ("cos", _P),
        ("sin", _P),
        ("rope_stride", ctypes.c_int64),
        ("slots", _P),
        ("decodes", _I32),
        ("decode_max_blocks", _I32),
        ("decode_tables", _P),
        ("decode_seq_lens", _P),
        ("prefills", _I32),
        ("prefill_max_blocks", _I32),
        ("prefill_segments", _P),
        ("prefill_tables", _P),
    ]


def _layer(plan: LayerPlan) -> _Layer:
    qkv, o, gate_up, down = (
        _Projection(p.weight.data_ptr(), _ptr(p.bias), _ptr(tiles), *p.weight.shape, few_rows)
        for p, tiles, few_rows in zip(plan.projections, plan.tiles, plan.few_rows)
    )
    gated_tiles, gated_bias = plan.gated or (None, None)
    return _Layer(
        _ptr(plan.norm1),
        _ptr(plan.norm2),
        _ptr(plan.q_norm),
        _ptr(plan.k_norm),
        plan.norm1_eps,
        plan.norm2_eps,
        plan.eps,
        plan.scale,
        qkv,
        o,
        gate_up,
        down,
        _ptr(gated_tiles),
        _ptr(gated_bias),
        plan.gated_min_rows,
        plan.k_cache.data_ptr(),
        plan.v_cache.data_ptr(),
    )


def _address(fn) -> int | None:
    """A native kernel's address; None for none, or for anything else standing in for one."""
    return ctypes.cast(fn, ctypes.c_void_p).value if isinstance(fn, ctypes._CFuncPtr) else None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
