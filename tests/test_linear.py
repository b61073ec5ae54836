"""kernels.linear: the CPU forms (native for a few rows, transposed for short batches,
column-blocked for wide outputs, packed weights for decode batches) equal F.linear."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_kernels
from kernels.linear import (
    COLUMN_BLOCK,
    TRANSPOSED_MAX_ROWS,
    WIDE_MIN_COLUMNS,
    can_pack,
    few_rows_max,
    linear,
    pack_weight,
    packed_max_rows,
)


@pytest.mark.parametrize("rows", [1, 7, TRANSPOSED_MAX_ROWS, TRANSPOSED_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("columns", [160, WIDE_MIN_COLUMNS + COLUMN_BLOCK // 2])  # narrow; wide with a partial block
def test_linear_matches_f_linear(rows, with_bias, columns):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(columns, 96, generator=g)
    b = torch.randn(columns, generator=g) if with_bias else None
    out = linear(x, w, b)
    assert out.shape == (rows, columns) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 13, cpu_kernels.GEMV_MAX_ROWS])  # groups of 4 rows, whole and not
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("outputs", [1000, 1003, 3])  # whole blocks of 4 weight rows; a tail; only a tail
@pytest.mark.parametrize("inputs", [576, 96])  # 96: a multiple of 32, not of 64
def test_few_rows_linear_matches_f_linear(dtype, rows, with_bias, outputs, inputs):
    """The native few-row kernel (csrc/gemv.c), which ``linear`` takes up to ``few_rows_max`` rows."""
    if cpu_kernels.load_library("gemv", dtype) is None:
        pytest.skip("no C compiler: native kernel unavailable")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inputs, generator=g).to(dtype)
    w = torch.randn(outputs, inputs, generator=g).to(dtype)
    b = torch.randn(outputs, generator=g).to(dtype) if with_bias else None
    out = cpu_kernels.few_rows_linear(x, w, b)
    assert out is not None and out.dtype == dtype and out.shape == (rows, outputs)
    # The reference in fp32 on the same values: both accumulate in fp32 and round once.
    expected = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else {}
    torch.testing.assert_close(out, expected, **tol)
    if rows <= few_rows_max(dtype, packed=False):
        torch.testing.assert_close(linear(x, w, b), out, rtol=0, atol=0)


def test_few_rows_linear_declines_what_it_does_not_read():
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    assert cpu_kernels.few_rows_linear(torch.randn(cpu_kernels.GEMV_MAX_ROWS + 1, 64), w) is None  # too many rows
    assert cpu_kernels.few_rows_linear(torch.randn(2, 40), torch.randn(8, 40)) is None  # K % 32
    assert cpu_kernels.few_rows_linear(x.t().contiguous().t(), w) is None  # column-major x
    assert cpu_kernels.few_rows_linear(x.half(), w.half()) is None  # no fp16 build
    assert cpu_kernels.few_rows_linear(x, w, torch.randn(7)) is None  # a bias that is not one per output
    assert cpu_kernels.few_rows_linear(x, w.view(2, 4, 64)) is None
    assert linear(torch.randn(2, 40), torch.randn(8, 40)).shape == (2, 8)  # linear falls back to torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 40, 256, 257, 512])  # few-row kernel, packed, past bf16's packed rows
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("column_major_x", [False, True])  # what linear(row_major=False) hands on
def test_packed_weight_matches_f_linear(dtype, rows, with_bias, column_major_x):
    if not can_pack(dtype):
        pytest.skip(f"no packed GEMM for {dtype} in this torch build")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    if column_major_x:
        x = x.t().contiguous().t()
    w = torch.randn(960, 576, generator=g).to(dtype)
    b = torch.randn(960, generator=g).to(dtype) if with_bias else None
    out = linear(x, w, b, packed=pack_weight(w))
    assert out.shape == (rows, 960) and out.dtype == dtype
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = dict(rtol=1e-5, atol=1e-3) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.3)  # bf16: one rounding
    torch.testing.assert_close(out.float(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_takes_the_packed_weight_past_few_rows_up_to_its_dtype_limit(dtype):
    if not can_pack(dtype):
        pytest.skip(f"no packed GEMM for {dtype} in this torch build")
    w = torch.randn(160, 96).to(dtype)
    marked = pack_weight(2 * w)  # a packed weight that gives itself away
    few, most = few_rows_max(dtype, packed=True), packed_max_rows(dtype, marked)
    for rows in (1, few, few + 1, 256, 257, 512):
        x = torch.randn(rows, 96).to(dtype)
        ratio = (linear(x, w, packed=marked).float().norm() / F.linear(x, w).float().norm()).item()
        used = few < rows <= most
        assert ratio == pytest.approx(2.0 if used else 1.0, rel=0.02), rows


amx = pytest.mark.skipif(not cpu_kernels.has_amx(), reason="no AMX tiles on this CPU")


@amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, 100, 256])  # whole and partial 16-row tiles, 32-row groups
@pytest.mark.parametrize("shape", [(48, 32), (960, 576), (576, 1536)])  # an odd count of 16-column blocks; K of 1 tile
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_matches_the_fp32_reference(rows, shape, with_bias):
    """The AMX tile kernel (csrc/amx_linear.c), which ``linear`` takes for bf16 packed weights."""
    n, k = shape
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    out = cpu_kernels.amx_linear(x, cpu_kernels.amx_pack(w), b)
    assert out is not None and out.shape == (rows, n) and out.is_contiguous()
    # Both accumulate the same bf16 products in fp32 and round once (the order may differ).
    expected = F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)
    torch.testing.assert_close(out, expected)


@amx
def test_amx_linear_reads_rows_with_a_stride_and_declines_other_layouts():
    w = torch.randn(64, 96).to(torch.bfloat16)
    packed = cpu_kernels.amx_pack(w)
    wide = torch.randn(20, 160).to(torch.bfloat16)
    x = wide[:, 32:128]  # rows 160 elements apart
    expected = F.linear(x.float(), w.float()).to(torch.bfloat16)
    torch.testing.assert_close(cpu_kernels.amx_linear(x, packed), expected)
    assert cpu_kernels.amx_linear(x.t().contiguous().t(), packed) is None  # column-major x
    assert cpu_kernels.amx_linear(x.float(), packed) is None
    assert cpu_kernels.amx_linear(x[:, :64], packed) is None  # K is not the weight's
    assert cpu_kernels.amx_pack(torch.randn(40, 96).to(torch.bfloat16)) is None  # N % 16
    assert cpu_kernels.amx_pack(torch.randn(64, 80).to(torch.bfloat16)) is None  # K % 32
    assert cpu_kernels.amx_pack(w.float()) is None


@amx
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64, 100])
@pytest.mark.parametrize("inner,k", [(1536, 576), (32, 64), (48, 96)])  # I / 16 odd: pairs split unevenly
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_gated_linear_is_the_projection_then_silu_mul(rows, inner, k, with_bias):
    """``amx_linear(gated=True)`` on the gate|up weight packed in block pairs: the same bits
    as the plain projection followed by silu_mul (fused_ops.c), which round where torch does."""
    g = torch.Generator().manual_seed(rows + inner)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = torch.randn(2 * inner, k, generator=g).to(torch.bfloat16)
    b = torch.randn(2 * inner, generator=g).to(torch.bfloat16) if with_bias else None
    gated_b = None if b is None else cpu_kernels.gated_pairs(b)
    fused = cpu_kernels.amx_linear(x, cpu_kernels.amx_pack(cpu_kernels.gated_pairs(w)), gated_b, gated=True)
    assert fused is not None and fused.shape == (rows, inner)
    plain = cpu_kernels.amx_linear(x, cpu_kernels.amx_pack(w), b)
    assert torch.equal(fused, cpu_kernels.silu_mul(plain))
    reference = F.silu(plain[:, :inner]) * plain[:, inner:]  # torch's bf16 ops
    torch.testing.assert_close(fused, reference)


@amx
def test_gated_projections_are_packed_for_the_fused_kernel_and_served_by_the_backend():
    from kernels.backend import CpuBackend, Projection

    g = torch.Generator().manual_seed(4)
    proj = torch.nn.utils.skip_init(Projection, 64, 2 * 96, bias=False, dtype=torch.bfloat16)
    proj.weight.data = torch.randn(192, 64, generator=g).to(torch.bfloat16)
    proj.gated = True
    backend = CpuBackend(torch.device("cpu"), 16, packed_weights=True)
    backend.prepare_model(torch.nn.Sequential(proj))
    assert proj.packed_gated is not None and proj.packed_weight is None
    x = torch.randn(20, 64, generator=g).to(torch.bfloat16)
    plain = F.linear(x.float(), proj.weight.float()).to(torch.bfloat16)
    expected = F.silu(plain[:, :96]) * plain[:, 96:]
    torch.testing.assert_close(backend.silu_mul_projection(x, proj), expected)
    torch.testing.assert_close(backend.silu_mul_projection(x[:2], proj), expected[:2])  # few rows: unfused
    torch.testing.assert_close(backend.project(x, proj), plain)  # the plain projection still works


@amx
def test_bf16_weights_are_packed_into_amx_tiles_where_they_tile():
    assert pack_weight(torch.randn(64, 96).to(torch.bfloat16)).dim() == 5
    assert pack_weight(torch.randn(40, 96).to(torch.bfloat16)).dim() == 2  # oneDNN's layout instead
