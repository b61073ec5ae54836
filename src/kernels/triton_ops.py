"""Small Triton kernels around attention: KV store, fused RMSNorm(+residual), rotary.

Each mirrors a torch reference and returns the same thing:

- :func:`store_kv` (``attention.store_kv``): ``k``/``v`` ``[T, KVH, D]`` written into
  ``k_cache``/``v_cache`` ``[num_blocks, block_size, KVH, D]`` at ``slot_mapping [T]``
  (int64 flat slot ``block * block_size + row``). Grid ``(T,)``: one program per token copies
  its ``KVH x D`` tile of K and of V; a slot ``< 0`` (padding, CUDA-graph pad) returns
  immediately, so the grid can be the padded batch with no host sync.
- :func:`rms_norm` (``norm.rms_norm``): grid ``(rows,)``, one program per row holding the
  whole hidden dim in registers (``BLOCK = next_pow2(N)``). With ``residual`` it first
  adds ``x + residual`` (rounded to the input dtype, like torch), writes the sum as the new
  residual and normalizes it, returning ``(out, new_residual)``: one read of each input and
  one write of each output instead of three passes. Variance in fp32; the normalized value
  is rounded to the input dtype before the weight multiply (HF order, as the reference).
- :func:`apply_rotary` (``rotary.apply_rotary``): rotate-half ("neox") RoPE; ``cos``/``sin``
  are ``[T, D/2]`` fp32 rows already gathered by position. Grid ``(T,)`` per tensor: a program
  rotates all heads of one token, loading its cos/sin row once. Math in fp32.
- :func:`qkv_rope_store` (``attention.qkv_rope_store``): everything between the fused qkv
  GEMM and attention in one launch: split, Qwen3's per-head q/k RMSNorm (optional), rope on
  q and k, and the KV store; returns q contiguous. Grid ``(T,)``. At batch 1 a layer is
  launch-bound, so one kernel instead of 5-7 matters.
- :func:`silu_and_mul` (``activation.silu_and_mul``): ``silu(gate) * up`` in one pass.

Import-safe without triton or a GPU: triton is imported lazily on first call (kernels are
built once, so ``TRITON_INTERPRET`` must be set before the first call to take effect).
"""

from __future__ import annotations

import functools

import torch

from .util import cdiv, next_pow2


@functools.cache
def _kernels():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _store_kv_kernel(
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_kcb,
        stride_kcs,
        stride_kch,
        stride_vcb,
        stride_vcs,
        stride_vch,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        block = slot // BLOCK_SIZE
        row = slot % BLOCK_SIZE
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HEAD_PAD)
        mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64 * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(v_ptr + t64 * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        kc = k_cache_ptr + block * stride_kcb + row * stride_kcs + heads[:, None] * stride_kch + dims[None, :]
        vc = v_cache_ptr + block * stride_vcb + row * stride_vcs + heads[:, None] * stride_vch + dims[None, :]
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        stride_x,
        stride_r,
        stride_o,
        stride_ro,
        N,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
        y = (xf * rstd).to(x_ptr.dtype.element_ty)  # rounded before the weight, as the reference
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(
            out_ptr + row * stride_o + cols,
            (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty),
            mask=mask,
        )

    @triton.jit
    def _rotary_kernel(
        x_ptr,
        out_ptr,
        cos_ptr,
        sin_ptr,
        stride_xt,
        stride_xh,
        stride_ot,
        stride_oh,
        stride_ct,
        stride_st,
        NUM_HEADS: tl.constexpr,
        HALF: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HALF_PAD)
        dim_ok = dims < HALF
        mask = (heads < NUM_HEADS)[:, None] & dim_ok[None, :]
        cos = tl.load(cos_ptr + t * stride_ct + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + t * stride_st + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
        src = x_ptr + t * stride_xt + heads[:, None] * stride_xh + dims[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        ty = out_ptr.dtype.element_ty
        tl.store(dst, (x1 * cos - x2 * sin).to(ty), mask=mask)
        tl.store(dst + HALF, (x2 * cos + x1 * sin).to(ty), mask=mask)

    @triton.jit
    def _qkv_rope_store_kernel(
        qkv_ptr,
        q_out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        cos_ptr,
        sin_ptr,
        qw_ptr,
        kw_ptr,
        stride_t,
        stride_qo,
        stride_ct,
        stride_st,
        stride_kcb,
        stride_kcs,
        stride_kch,
        stride_vcb,
        stride_vcs,
        stride_vch,
        eps,
        H: tl.constexpr,
        KVH: tl.constexpr,
        H_PAD: tl.constexpr,
        KVH_PAD: tl.constexpr,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HAS_NORM: tl.constexpr,
        PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/triton_gemv.py): wait first
    ):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        dims = tl.arange(0, HALF_PAD)  # (head_dim 80 or 96: half a head padded to a power of two)
        dim_ok = dims < HALF
        ty = q_out_ptr.dtype.element_ty
        cos = tl.load(cos_ptr + t * stride_ct + dims, mask=dim_ok, other=0.0)[None, :]
        sin = tl.load(sin_ptr + t * stride_st + dims, mask=dim_ok, other=0.0)[None, :]
        row = qkv_ptr + t * stride_t
        D: tl.constexpr = 2 * HALF

        # q: [H, D] = heads 0..H-1 of the row
        qh = tl.arange(0, H_PAD)
        qm = (qh < H)[:, None] & dim_ok[None, :]
        q1 = tl.load(row + qh[:, None] * D + dims[None, :], mask=qm, other=0.0)
        q2 = tl.load(row + qh[:, None] * D + HALF + dims[None, :], mask=qm, other=0.0)
        if HAS_NORM:
            q1f, q2f = q1.to(tl.float32), q2.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(q1f * q1f, 1) + tl.sum(q2f * q2f, 1)) / D + eps)[:, None]
            w1 = tl.load(qw_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(qw_ptr + HALF + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
            q1 = ((q1f * rstd).to(ty).to(tl.float32) * w1).to(ty)
            q2 = ((q2f * rstd).to(ty).to(tl.float32) * w2).to(ty)
        q1f, q2f = q1.to(tl.float32), q2.to(tl.float32)
        dst = q_out_ptr + t * stride_qo + qh[:, None] * D + dims[None, :]
        tl.store(dst, (q1f * cos - q2f * sin).to(ty), mask=qm)
        tl.store(dst + HALF, (q2f * cos + q1f * sin).to(ty), mask=qm)

        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            block = slot // BLOCK_SIZE
            pos = slot % BLOCK_SIZE
            kh = tl.arange(0, KVH_PAD)
            km = (kh < KVH)[:, None] & dim_ok[None, :]
            kbase = row + (H + kh[:, None]) * D + dims[None, :]
            k1 = tl.load(kbase, mask=km, other=0.0)
            k2 = tl.load(kbase + HALF, mask=km, other=0.0)
            if HAS_NORM:
                k1n, k2n = k1.to(tl.float32), k2.to(tl.float32)
                k_rstd = 1.0 / tl.sqrt((tl.sum(k1n * k1n, 1) + tl.sum(k2n * k2n, 1)) / D + eps)[:, None]
                kw1 = tl.load(kw_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
                kw2 = tl.load(kw_ptr + HALF + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
                k1 = ((k1n * k_rstd).to(ty).to(tl.float32) * kw1).to(ty)
                k2 = ((k2n * k_rstd).to(ty).to(tl.float32) * kw2).to(ty)
            k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
            kc = k_cache_ptr + block * stride_kcb + pos * stride_kcs + kh[:, None] * stride_kch + dims[None, :]
            cty = k_cache_ptr.dtype.element_ty
            tl.store(kc, (k1f * cos - k2f * sin).to(ty).to(cty), mask=km)
            tl.store(kc + HALF, (k2f * cos + k1f * sin).to(ty).to(cty), mask=km)
            vbase = row + (H + KVH + kh[:, None]) * D + dims[None, :]
            vc = v_cache_ptr + block * stride_vcb + pos * stride_vcs + kh[:, None] * stride_vch + dims[None, :]
            tl.store(vc, tl.load(vbase, mask=km).to(cty), mask=km)
            tl.store(vc + HALF, tl.load(vbase + HALF, mask=km).to(cty), mask=km)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
        # silu rounded to the input dtype before the multiply, as F.silu(gate) * up does
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        tl.store(out_ptr + row * stride_o + cols, act * up, mask=mask)

    return _store_kv_kernel, _rms_norm_kernel, _rotary_kernel, _qkv_rope_store_kernel, _silu_and_mul_kernel


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k``/``v [T, KVH, D]`` into their cache slots; slot -1 is skipped. No host sync."""
    T, kvh, d = k.shape
    assert v.shape == k.shape and k_cache.shape[2:] == (kvh, d) and v_cache.shape == k_cache.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert slot_mapping.shape[0] >= T
    if T == 0:
        return
    kernel = _kernels()[0]
    kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=kvh,
        HEAD_DIM=d,
        HEADS_PAD=next_pow2(kvh),
        HEAD_PAD=next_pow2(d),
        BLOCK_SIZE=k_cache.shape[1],
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)`` over the last dim; with ``residual``, returns ``(norm(x + residual), x + residual)``."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    # Same dtype as the reference's ``norm.to(x.dtype) * weight`` (promotes with the weight).
    out = torch.empty((rows, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    else:
        r2, res_out = x2, out  # unused placeholders
    if rows:
        kernel = _kernels()[1]
        kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            res_out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            res_out.stride(0),
            n,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=next_pow2(n),
        )
    out = out.view(shape)
    return out if residual is None else (out, res_out.view(shape))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    T, h, d = x.shape
    assert d % 2 == 0 and x.stride(2) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    out = torch.empty((T, h, d), dtype=x.dtype, device=x.device)
    if T:
        kernel = _kernels()[2]
        kernel[(T,)](
            x,
            out,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            sin.stride(0),
            NUM_HEADS=h,
            HALF=d // 2,
            HEADS_PAD=next_pow2(h),
            HALF_PAD=next_pow2(d // 2),
        )
    return out


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, heads, D]`` and ``k [T, kv_heads, D]`` by ``cos``/``sin [T, D/2]`` (fp32)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qkv_rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    pdl: bool = False,
) -> torch.Tensor:
    """From the fused projection ``qkv [T, (H + 2 KVH) * D]``: store rope'd (and, with norm
    weights, per-head RMS-normalised) keys and the values at ``slot_mapping`` (-1 skipped);
    return the rope'd queries ``[T, H, D]``. ``pdl``: programmatic dependent launch (sm_90+)."""
    T = qkv.shape[0]
    qkv = qkv.reshape(T, -1)  # a lone row's stride is arbitrary (1 on the CPU): a view with the usual one
    d = k_cache.shape[-1]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * d and qkv.stride(1) == 1
    assert d % 2 == 0, "rotary embedding pairs the halves of a head: head_dim must be even"
    q = torch.empty((T, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    has_norm = q_norm_weight is not None
    kernel = _kernels()[3]
    kernel[(T,)](
        qkv,
        q,
        k_cache,
        v_cache,
        slot_mapping,
        cos,
        sin,
        q_norm_weight if has_norm else qkv,
        k_norm_weight if has_norm else qkv,
        qkv.stride(0),
        q.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        float(eps),
        H=num_heads,
        KVH=num_kv_heads,
        H_PAD=next_pow2(num_heads),
        KVH_PAD=next_pow2(num_kv_heads),
        HALF=d // 2,
        HALF_PAD=next_pow2(d // 2),
        BLOCK_SIZE=k_cache.shape[1],
        HAS_NORM=has_norm,
        PDL=pdl,
        **({"launch_pdl": True} if pdl else {}),  # only when set: HIP has no such option
    )
    return q


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``[rows, 2 * I]`` gate|up projection."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, next_pow2(n))
        _kernels()[4][(x2.shape[0], cdiv(n, block))](x2, out, x2.stride(0), out.stride(0), n, BLOCK=block)
    return out.view(*x.shape[:-1], n)
