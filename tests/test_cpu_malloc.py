"""The CPU memory settings (scheduler/cpu_malloc.py)."""

import torch

from scheduler.cpu_malloc import HUGE_PAGE, zeros_on_huge_pages


def test_zeros_on_huge_pages_is_a_zeroed_tensor_of_the_shape_and_dtype():
    for shape, dtype in [
        ((3, 2, 5), torch.float32),
        ((2, 2 * HUGE_PAGE // 2 + 7), torch.bfloat16),
        ((0, 4), torch.float32),
    ]:
        t = zeros_on_huge_pages(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()
