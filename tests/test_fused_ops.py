"""The native fused CPU kernels (csrc/fused_ops.c) against their torch reference paths, on
both layouts a projection can come out in (row-major, and column-major from
``linear(row_major=False)`` on short batches), in both element types they are built for
(bf16 rounds where the torch path rounds, so the two agree to bf16's tolerance)."""

import pytest
import torch

from kernels import cpu_kernels
from kernels.activation import silu_and_mul
from kernels.attention import qkv_rope_store
from kernels.norm import rms_norm
from kernels.rotary import rope_cos_sin

H, HKV, D, BLOCK = 6, 2, 16, 4


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    if cpu_kernels.load_library("fused_ops", request.param) is None:
        pytest.skip("no C compiler: native kernels unavailable")
    return request.param


def strided(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values, row-major or as the transposed view of a column-major buffer."""
    return x.clone() if layout == "row" else x.t().contiguous().t()


@pytest.mark.parametrize("layout", ["row", "column"])
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("width", [96, 100])  # whole 16-lane vectors; a tail
def test_add_rms_norm(layout, rows, width, dtype):
    g = torch.Generator().manual_seed(rows)
    x, res, w = (torch.randn(*shape, generator=g).to(dtype) for shape in ((rows, width), (rows, width), (width,)))
    x_in = strided(x, layout)
    assert x_in.is_contiguous() == (layout == "row" or rows == 1)

    torch.testing.assert_close(cpu_kernels.add_rms_norm(x_in, w, 1e-5), rms_norm(x, w, 1e-5))

    ref_out, ref_res = rms_norm(x, w, 1e-5, res)
    res_in = res.clone()
    out, new_res = cpu_kernels.add_rms_norm(x_in, w, 1e-5, res_in)
    assert new_res is res_in  # updated in place
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(new_res, ref_res)


@pytest.mark.parametrize("layout", ["row", "column"])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_silu_mul(layout, rows, dtype):
    x = (torch.randn(rows, 2 * 80, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, -90.0, 90.0])  # where e^-x leaves fp32's range
    out = cpu_kernels.silu_mul(strided(x, layout))
    torch.testing.assert_close(out, silu_and_mul(x))
    if layout == "column" and rows > 1:
        assert out.stride() == (1, rows)  # keeps the input's layout for the next projection


def test_native_kernels_decline_what_they_do_not_read():
    x = torch.randn(4, 32)
    assert cpu_kernels.add_rms_norm(x.double(), torch.ones(32, dtype=torch.float64), 1e-6) is None
    assert cpu_kernels.add_rms_norm(x.view(2, 2, 32), torch.ones(32), 1e-6) is None  # 3-D: the torch path
    assert cpu_kernels.silu_mul(x[:, ::2]) is None  # neither dimension unit-stride
    assert cpu_kernels.silu_mul(x.half()) is None  # no fp16 build
    assert cpu_kernels.add_rms_norm(x.bfloat16(), torch.ones(32), 1e-6) is None  # mixed element types


@pytest.mark.parametrize("layout", ["row", "column"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_store(layout, qk_norm, dtype):
    g = torch.Generator().manual_seed(int(qk_norm))
    t = 9
    qkv = torch.randn(t, (H + 2 * HKV) * D, generator=g).to(dtype)
    table = rope_cos_sin(D, 64, 10000.0)  # fp32 in both cases, as the model keeps it
    positions = torch.tensor([3, 0, 1, 2, 3, 4, 5, 6, 7])
    cos, sin = table[positions].chunk(2, dim=-1)
    slots = torch.tensor([13, 0, 1, 2, 3, -1, 5, 6, 7])  # one padded slot, not stored
    norms = tuple(torch.randn(D, generator=g).to(dtype) for _ in range(2)) if qk_norm else (None, None)

    caches = [torch.zeros(4, BLOCK, HKV, D, dtype=dtype) for _ in range(4)]
    native = cpu_kernels.qkv_rope_store(strided(qkv, layout), H, HKV, cos, sin, *caches[:2], slots, *norms, 1e-6)
    reference = qkv_rope_store(qkv, H, HKV, cos, sin, *caches[2:], slots, *norms, 1e-6)
    for got, want in zip((*native, *caches[:2]), (*reference, *caches[2:])):
        torch.testing.assert_close(got, want)
    assert caches[0].view(-1, HKV, D)[4].abs().sum() == 0  # slot 4 belongs to the padded token: untouched
