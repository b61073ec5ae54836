"""Integer helpers the kernels' launch code shares."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())
