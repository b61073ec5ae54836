"""kernels.linear: the CPU forms (transposed for short batches, column-blocked for wide
outputs) equal F.linear."""

import pytest
import torch
import torch.nn.functional as F

from kernels.linear import COLUMN_BLOCK, TRANSPOSED_MAX_ROWS, WIDE_MIN_COLUMNS, linear


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
