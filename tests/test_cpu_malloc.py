"""The CPU memory settings (scheduler/cpu_malloc.py)."""

import os

import pytest
import torch

from scheduler.cpu_malloc import HUGE_PAGE, huge_page_range, zeros_on_huge_pages


def test_zeros_on_huge_pages_is_a_zeroed_tensor_of_the_shape_and_dtype():
    for shape, dtype in [
        ((3, 2, 5), torch.float32),
        ((2, 2 * HUGE_PAGE // 2 + 7), torch.bfloat16),
        ((0, 4), torch.float32),
    ]:
        t = zeros_on_huge_pages(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()


def _advised_ranges() -> list[tuple[int, int]]:
    """This process's mappings whose flags carry MADV_HUGEPAGE's advice ("hg")."""
    ranges, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = head.split("-")
                current = (int(lo, 16), int(hi, 16))
            elif head == "VmFlags:" and "hg" in line.split()[1:]:
                ranges.append(current)
    return ranges


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"), reason="no transparent huge pages here"
)
def test_the_advice_covers_the_whole_huge_pages_inside_the_tensor():
    t = zeros_on_huge_pages((3 * HUGE_PAGE + 12345,), torch.uint8)
    start, end = huge_page_range(t)
    assert t.data_ptr() <= start and end <= t.data_ptr() + t.numel()
    assert end - start >= 2 * HUGE_PAGE
    # Every byte of the range lies in an advised mapping. (Memory advised earlier in this
    # process, e.g. freed heap beside it, may share those mappings, so they may reach past
    # the range: the arithmetic above is what keeps the advice inside the tensor.)
    reached = start
    for lo, hi in sorted(_advised_ranges()):
        if lo <= reached < hi:
            reached = hi
    assert reached >= end
