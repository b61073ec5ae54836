"""kernels.linear: the transposed CPU form for short batches equals F.linear."""

import pytest
import torch
import torch.nn.functional as F

from kernels.linear import TRANSPOSED_MAX_ROWS, linear


@pytest.mark.parametrize("rows", [1, 7, TRANSPOSED_MAX_ROWS, TRANSPOSED_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if with_bias else None
    out = linear(x, w, b)
    assert out.shape == (rows, 160) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
