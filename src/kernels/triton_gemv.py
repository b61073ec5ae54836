"""Projections of a few rows (decode at small batch) in Triton, with the ops around them fused.

At batch 1 a decoder layer is launch-bound: ten short kernels (two norms, four GEMMs, the
SiLU-mul, rope/store, attention) each pay a launch and a tail for a few µs of memory
traffic. :func:`small_batch_linear` folds the RMSNorm (+ residual add) that precedes a
projection into its prologue and the SiLU-mul that follows the gate|up projection into its
epilogue, so a layer runs six kernels (seven when decode attention splits its keys and
merges the splits):

    norm+qkv -> rope/store -> attention (-> combine) -> o_proj -> norm+gate_up+silu -> down

Each program owns ``BLOCK_N`` output columns and streams their weight rows once; the rows
of ``x`` (at most ``BLOCK_M = 16``, padded for ``tl.dot``) are re-read from cache by every
program. With a norm, a first pass over ``x`` takes each row's sum of squares and program 0
writes the new residual ``x + residual``; the main loop normalises each chunk on the fly.

Rounding follows the torch path (``norm.rms_norm``, ``activation.silu_and_mul``):
``x + residual`` and the normalised value are rounded to the input dtype before the weight
multiply, the GEMM output is rounded before the SiLU, the SiLU before the multiply by up.
Accumulation is fp32.

``pdl`` (sm_90+, experimental): programmatic dependent launch. The kernel is launched while
the previous one (attention, or the previous projection) is still running; since the weights
do not depend on it, each program first pulls its weight rows into L2, then waits for the
previous kernel's outputs (``griddepcontrol.wait``) and lets the next kernel launch. So at
batch 1 the weight stream of one projection overlaps the tail of the kernel before it instead
of starting after a launch gap. Every read of data another kernel writes comes after the wait.

Import-safe without triton or a GPU: triton is imported lazily on first call.
"""

from __future__ import annotations

import functools

import torch

from .util import cdiv, next_pow2

SMALL_BATCH_ROWS = 16  # the most rows one program holds (tl.dot's minimum M)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit(do_not_specialize=["M"])
    def _small_batch_linear_kernel(
        x_ptr,
        res_ptr,
        norm_w_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        res_out_ptr,
        M,
        K,
        N,  # N: output columns (GATE_UP: the weight has 2N rows, gate then up)
        stride_xm,
        stride_rm,
        stride_wn,
        stride_om,
        stride_rom,
        eps,
        HAS_NORM: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GATE_UP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        PDL: tl.constexpr,
        LINE: tl.constexpr,
        K_LINES: tl.constexpr,  # LINE: elements per 128-byte line
    ):
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        ks = tl.arange(0, BLOCK_K)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        if PDL:  # weights first (they do not depend on the previous kernel), then wait for it
            lines = tl.minimum(tl.arange(0, K_LINES) * LINE, K - 1)
            pf = w_ptr + tl.minimum(cols, N - 1)[:, None].to(tl.int64) * stride_wn + lines[None, :]
            for half in tl.static_range(2 if GATE_UP else 1):  # gate|up: the up rows too, N rows on
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
                    "=r,l",
                    [pf + half * N.to(tl.int64) * stride_wn],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
            gdc_wait()
            gdc_launch_dependents()
        ty = x_ptr.dtype.element_ty
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        r_rows = res_ptr + rows[:, None].to(tl.int64) * stride_rm

        rstd = tl.zeros([BLOCK_M], tl.float32)
        if HAS_NORM:  # pass 1: each row's sum of squares (and the new residual, by program 0)
            sq = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + ks
                m = row_ok[:, None] & (kk < K)[None, :]
                h = tl.load(x_rows + kk[None, :], mask=m, other=0.0)
                if HAS_RESIDUAL:
                    h = (h.to(tl.float32) + tl.load(r_rows + kk[None, :], mask=m, other=0.0).to(tl.float32)).to(ty)
                    if pid == 0:
                        tl.store(res_out_ptr + rows[:, None].to(tl.int64) * stride_rom + kk[None, :], h, mask=m)
                hf = h.to(tl.float32)
                sq += tl.sum(hf * hf, 1)
            rstd = 1.0 / tl.sqrt(sq / K + eps)

        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if HAS_NORM:
                if HAS_RESIDUAL:
                    r = tl.load(r_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    a = (a.to(tl.float32) + r.to(tl.float32)).to(ty)
                nw = tl.load(norm_w_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
                a = ((a.to(tl.float32) * rstd[:, None]).to(ty).to(tl.float32) * nw[None, :]).to(ty)
            w_ok = col_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + kk[None, :], mask=w_ok, other=0.0)
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
            if GATE_UP:
                w_up = tl.load(w_rows + N.to(tl.int64) * stride_wn + kk[None, :], mask=w_ok, other=0.0)
                acc_up += tl.dot(a, tl.trans(w_up), input_precision=DOT_PRECISION)

        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if GATE_UP:
                acc_up += tl.load(bias_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = acc.to(ty)
        if GATE_UP:  # silu(gate) rounded, times up: activation.silu_and_mul's order
            gate = out.to(tl.float32)
            out = (gate / (1.0 + tl.exp(-gate))).to(ty) * acc_up.to(ty)
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(o_ptrs, out, mask=row_ok[:, None] & col_ok[None, :])

    return _small_batch_linear_kernel


def _prefetch_lines(k: int, elem_bytes: int, pdl: bool) -> dict:
    """Constexprs (and the launch option) of the L2 prefetch; constant without PDL, so the
    projections of different widths share one compiled variant."""
    if not pdl:  # launch_pdl only when set: backends without the option (HIP) reject it
        return dict(LINE=1, K_LINES=1)
    return dict(LINE=128 // elem_bytes, K_LINES=next_pow2(cdiv(k * elem_bytes, 128)), launch_pdl=True)


def small_batch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    gate_up: bool = False,
    block_n: int = 16,
    block_k: int = 256,
    pdl: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K] @ weight.T (+ bias)`` for ``M <= SMALL_BATCH_ROWS``.

    ``norm_weight``: the input is first ``rms_norm(x + residual) * norm_weight`` (no
    ``residual``: of ``x``), and the new residual stream is returned too: ``(out, x + residual)``
    (``(out, x)`` without one), like ``RMSNorm(x, residual)`` followed by the projection.
    ``gate_up``: ``weight`` is ``[2N, K]`` (gate rows, then up rows) and the result is
    ``silu(gate) * up``, ``[M, N]``. ``pdl``: launch as a programmatic dependent of the
    previous kernel (CUDA sm_90+ only; see the module docstring)."""
    M, K = x.shape
    assert residual is None or norm_weight is not None, "the residual is added before the norm"
    assert residual is None or residual.shape == x.shape
    # A lone row's stride is arbitrary (1 on the CPU): views with the usual one.
    x = x.reshape(M, K)
    residual = residual.reshape(M, K) if residual is not None else None
    assert M <= SMALL_BATCH_ROWS and x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == K
    assert residual is None or residual.stride(1) == 1
    n = weight.shape[0] // 2 if gate_up else weight.shape[0]
    out = torch.empty((M, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else out
    if M:
        _kernel()[(cdiv(n, block_n),)](
            x,
            residual if residual is not None else x,
            norm_weight if norm_weight is not None else x,
            weight,
            bias if bias is not None else weight,
            out,
            res_out,
            M,
            K,
            n,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            weight.stride(0),
            out.stride(0),
            res_out.stride(0),
            float(eps),
            HAS_NORM=norm_weight is not None,
            HAS_RESIDUAL=residual is not None,
            HAS_BIAS=bias is not None,
            GATE_UP=gate_up,
            BLOCK_M=SMALL_BATCH_ROWS,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            PDL=pdl,
            **_prefetch_lines(K, weight.element_size(), pdl),
        )
    if norm_weight is None:
        return out
    return out, (res_out if residual is not None else x)
