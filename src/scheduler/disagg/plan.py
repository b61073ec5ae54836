"""Which bytes a request's KV transfer moves: the byte ranges of its blocks in the prefill
pool and where they go in the decode pool, one range per run of blocks that are consecutive
on both sides, per layer and per K/V."""

from __future__ import annotations

from .wire import KvLayout


def block_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, length) of each run in which both
    sides' block ids go up by one."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def transfer_ranges(
    src: KvLayout, src_blocks: list[int], dst: KvLayout, dst_blocks: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) that copy ``src_blocks`` of every
    layer's K and V into ``dst_blocks`` (the layouts must match but for the block counts)."""
    problem = src.mismatch(dst)
    if problem is not None:
        raise ValueError(problem)
    bb = src.block_bytes
    runs = block_runs(src_blocks, dst_blocks)
    src_addrs: list[int] = []
    dst_addrs: list[int] = []
    lens: list[int] = []
    for plane in range(2 * src.num_layers):  # (layer, K or V) in memory order
        src_plane = src.base_ptr + plane * src.num_blocks * bb
        dst_plane = dst.base_ptr + plane * dst.num_blocks * bb
        for s, d, n in runs:
            src_addrs.append(src_plane + s * bb)
            dst_addrs.append(dst_plane + d * bb)
            lens.append(n * bb)
    return src_addrs, dst_addrs, lens
