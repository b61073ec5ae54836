"""Unified paged attention in Triton: varlen prefill, chunked prefill, prefix hits and decode
in ONE launch over the block tables (the GPU counterpart of ``attention.paged_attention``).

Layout (same as the torch path):

- ``q``: ``[T, H, D]``, this step's query tokens of ``B`` requests, flattened in request order.
- ``k_cache``/``v_cache``: ``[num_blocks, block_size, KVH, D]`` per layer; position ``p`` of
  request ``r`` lives in block ``block_tables[r, p // block_size]`` at row ``p % block_size``.
- ``block_tables``: ``[B, max_blocks]``; ``query_start_loc``: ``[B+1]`` (cumsum of query
  lengths, ``query_start_loc[0] == 0``); ``seq_lens``: ``[B]``, KV length after this step
  (cached prefix + this chunk). Integers (the runner's are int64; int32 works too), all on
  the device; no other metadata is needed.
- Output ``[T, H, D]`` in ``q``'s dtype.

Causal mask, bottom-right aligned: query ``j`` of a request with ``q_len`` query tokens and
``seq_len`` keys sees keys ``0 .. seq_len - q_len + j``. This covers decode (``q_len == 1``),
fresh prefill (``q_len == seq_len``) and chunks behind a cached prefix in the same code.

Grid: ``(T // BLOCK_Q + B, KVH, num_splits)``. A *query tile* is ``BLOCK_Q`` consecutive query tokens of one
request; request ``r`` owns the tile indices starting at ``query_start_loc[r] // BLOCK_Q + r``
(``ceil(q_len / BLOCK_Q)`` of them; the ``+ r`` leaves room for each request's ragged last
tile). So the grid size comes from tensor *shapes* only, never from a host sync, and a
CUDA-graph replay with a padded batch launches the same grid. Each program:

1. finds its request by a binary search of its tile index over
   ``query_start_loc[r] // BLOCK_Q + r`` (monotone in ``r``), and exits if the tile lies past
   the request's query tokens (the grid's slack) ;
2. packs the ``G = H / KVH`` query heads that share its KV head into the tile's rows: row
   ``m`` is token ``m // G_PAD`` of the tile, head ``kv_head * G + m % G_PAD``
   (``BLOCK_M = BLOCK_Q * G_PAD`` rows), so each K/V tile loaded serves all ``G`` heads (GQA
   reads K/V once per KV head instead of once per query head);
3. walks the keys in tiles of ``TILE_N`` positions, translating each position through the
   block table (``TILE_N`` need not equal ``block_size``), only up to the last key that the
   tile's last query can see (causal skipping);
4. keeps an fp32 online softmax (running max ``m``, sum ``l``, accumulator ``acc``) and
   writes ``acc / l``; with ``num_splits > 1`` each program walks its share of the keys and
   writes its partial state, which a second kernel merges (flash-decoding).

Padding: a request with ``q_len == 0`` owns no tiles; one with ``seq_len == 0`` (CUDA-graph
pad with a dummy query token) loops over no keys and writes zeros, never NaN. Query rows past
``T`` are never read.

Import-safe without triton or a GPU: triton is imported lazily and the kernel compiled on first
call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .attention import varlen_arrays
from .util import cdiv, next_pow2


@dataclass
class VarlenMetadata:
    """What the unified kernel reads of a step: requests in any order, no host sync."""

    slot_mapping: torch.Tensor  # [T] flat slot per query token (-1 = padding, not stored)
    positions: torch.Tensor  # [T] position of every query token (for rope)
    block_tables: torch.Tensor  # [B, max_blocks] int64
    query_start_loc: torch.Tensor  # [B + 1] int64
    seq_lens: torch.Tensor  # [B] int64, KV length after this step
    max_query_len: int
    num_splits: int = 1  # split-KV factor (small decode batches: flash-decoding)


def build_varlen(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str,
    num_splits: int = 1,
    upload: Callable[[np.ndarray], torch.Tensor] | None = None,
) -> VarlenMetadata:
    """Metadata for the unified (Triton) kernel: everything packed into one host array and
    moved to the device in a single copy; the fields are views of it. ``upload`` makes that
    copy (the runner passes one through pinned memory that does not wait for the GPU).

    Every field starts on a 16-byte boundary: Triton specialises a kernel on the alignment
    of its pointers, so a field whose alignment followed the batch's parity would make the
    attention kernel compile again in the middle of serving."""
    fields = varlen_arrays(query_lens, seq_lens, block_tables, block_size)
    starts = np.zeros(len(fields) + 1, dtype=np.int64)
    np.cumsum([cdiv(f.size, 2) * 2 for f in fields], out=starts[1:])  # int64 pairs: 16 bytes
    host = np.zeros(int(starts[-1]), dtype=np.int64)
    for arr, start in zip(fields, starts):
        host[start : start + arr.size] = arr.ravel()
    packed = upload(host) if upload is not None else torch.from_numpy(host).to(device, non_blocking=True)
    slots, pos, qsl, seq, table = (packed[a : a + f.size] for f, a in zip(fields, starts))
    return VarlenMetadata(
        slot_mapping=slots,
        positions=pos,
        query_start_loc=qsl,
        seq_lens=seq,
        block_tables=table.view(fields[4].shape),
        max_query_len=max(query_lens, default=0),
        num_splits=num_splits,
    )


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def _kernels():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    # The batch size and the block-table width change every step: specialising on them
    # (== 1, % 16) would compile new variants mid-run (tests/test_triton_specialization.py).
    @triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
    def _unified_attention_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        block_tables_ptr,
        query_start_loc_ptr,
        seq_lens_ptr,
        part_acc_ptr,
        part_ml_ptr,  # split-KV partials: [T, H, NUM_SPLITS, HEAD_PAD] and [T, H, NUM_SPLITS, 2] fp32
        qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
        num_seqs,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_bt,
        BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block)
        G: tl.constexpr,  # query heads per KV head
        G_PAD: tl.constexpr,  # next power of two >= G
        BLOCK_Q: tl.constexpr,  # query tokens per tile
        BLOCK_M: tl.constexpr,  # BLOCK_Q * G_PAD rows
        TILE_N: tl.constexpr,  # key positions per inner iteration
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else "tf32"
        NUM_SPLITS: tl.constexpr,  # > 1: this program covers one slice of the keys (flash-decoding)
        PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/triton_gemv.py): wait first
    ):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        # Binary search: the largest r with query_start_loc[r] // BLOCK_Q + r <= tile.
        # (Inlined: a lazily built kernel cannot call a sibling @jit closure.)
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
                lo = mid + 1
            else:
                hi = mid
        req = lo - 1
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        q_tile = tile - (q_start // BLOCK_Q + req)
        if q_tile * BLOCK_Q >= q_len:  # grid slack (or a q_len == 0 pad): nothing to do
            return
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len  # keys cached before this chunk

        rows = tl.arange(0, BLOCK_M)
        tok = q_tile * BLOCK_Q + rows // G_PAD  # query index within the request
        head_in_group = rows % G_PAD
        head = kv_head * G + head_in_group
        row_ok = (tok < q_len) & (head_in_group < G)
        dims = tl.arange(0, HEAD_PAD)
        dim_ok = dims < HEAD_DIM

        q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

        # Keys visible to the tile's last valid query: 0 .. context_len + last_tok.
        last_tok = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_end = tl.minimum(context_len + last_tok + 1, seq_len)
        num_tiles = tl.cdiv(tl.maximum(kv_end, 0), TILE_N)
        q_pos = context_len + tok  # absolute position of each row's query
        table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
        cols = tl.arange(0, TILE_N)

        tile_lo = 0
        tile_hi = num_tiles
        if NUM_SPLITS > 1:
            per_split = tl.cdiv(num_tiles, NUM_SPLITS)
            tile_lo = split * per_split
            tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
        for j in range(tile_lo, tile_hi):
            kpos = j * TILE_N + cols
            k_ok = kpos < kv_end
            block = tl.load(table_row + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            in_block = (kpos % BLOCK_SIZE).to(tl.int64)
            k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
            v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
            # K loaded transposed, [HEAD_PAD, TILE_N], for Q @ K^T.
            k = tl.load(k_cache_ptr + k_off[None, :] + dims[:, None], mask=dim_ok[:, None] & k_ok[None, :], other=0.0)
            v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :], mask=k_ok[:, None] & dim_ok[None, :], other=0.0)

            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
            visible = row_ok[:, None] & k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay at 0
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if NUM_SPLITS > 1:  # unnormalised partials; _combine_splits_kernel merges them
            part = ((q_start + tok).to(tl.int64) * (G * tl.num_programs(1)) + head) * NUM_SPLITS + split
            tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        else:
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # no visible key (seq_len 0 pad): write zeros
            out = acc / l_safe[:, None]
            o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
            tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])

    @triton.jit(do_not_specialize=["num_seqs"])
    def _combine_splits_kernel(
        part_acc_ptr,
        part_ml_ptr,
        out_ptr,
        query_start_loc_ptr,
        num_seqs,
        stride_ot,
        stride_oh,
        H: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        # Rows past the last request's queries have no partials (never written): leave them.
        num_rows = tl.load(query_start_loc_ptr + num_seqs)
        splits = tl.arange(0, NUM_SPLITS)
        dims = tl.arange(0, HEAD_PAD)
        split_ok = t + splits * 0 < num_rows  # (masks as tensors: the interpreter refuses a scalar one)
        base = (t * H + h) * NUM_SPLITS
        m = tl.load(part_ml_ptr + (base + splits) * 2, mask=split_ok, other=float("-inf"))
        denom = tl.load(part_ml_ptr + (base + splits) * 2 + 1, mask=split_ok, other=0.0)
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.where(denom > 0.0, tl.exp2(m - m_max), 0.0)  # empty splits (no keys) weigh nothing
        acc = tl.load(
            part_acc_ptr + (base + splits)[:, None] * HEAD_PAD + dims[None, :], mask=split_ok[:, None], other=0.0
        )
        total = tl.sum(denom * w, 0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
        tl.store(
            out_ptr + t * stride_ot + h * stride_oh + dims,
            out.to(out_ptr.dtype.element_ty),
            mask=(dims < HEAD_DIM) & (t + dims * 0 < num_rows),
        )

    return _unified_attention_kernel, _combine_splits_kernel


def tile_shape(num_heads: int, num_kv_heads: int, block_m: int | None = None) -> tuple[int, int, int]:
    """``(G_PAD, BLOCK_Q, BLOCK_M)`` for a model; static per model, so graph-capturable."""
    g_pad = next_pow2(num_heads // num_kv_heads)
    block_m = max(16, g_pad, next_pow2(block_m or 16))  # tl.dot needs >= 16 rows
    return g_pad, block_m // g_pad, block_m


def decode_splits(batch: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Split-KV factor for a decode batch: enough programs for ~4 per SM, a power of two."""
    want = cdiv(4 * num_sms, max(1, batch * num_kv_heads))
    return min(max_splits, next_pow2(want)) if want > 1 else 1


def num_query_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Grid size along axis 0: an upper bound on query tiles from shapes alone (no host sync)."""
    return num_tokens // block_q + num_seqs


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
    max_query_len: int | None = None,
    num_splits: int = 1,
    num_warps: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Paged attention of ``q [T, H, D]`` over the cache; see the module docstring.

    ``block_m``: rows per tile (query tokens x packed GQA heads), default 16 (good for decode;
    64 suits long prefills). ``tile_n``: key positions per inner step, default ``block_size``
    rounded up to a power of two (at least 16).
    The number of requests ``B`` is ``seq_lens.shape[0]``; ``query_start_loc`` must have
    ``B + 1`` entries whose last is at most ``T``.
    ``max_query_len`` (a host int the runner already knows; never read from the device): when
    given and ``block_m`` is not, prefill-heavy steps get 64-row tiles and 32-key tiles,
    decode-only steps (max_query_len 1) keep 16 rows and take 128-key tiles.
    ``num_splits`` (a power of two): each (query tile, KV head) is split along the keys into
    this many programs whose partial softmax states are merged by a second kernel
    (flash-decoding); use it when the batch alone does not fill the GPU (small decode batches).
    Static per call site, so CUDA graphs capture it.
    ``pdl``: launch both kernels as programmatic dependents (sm_90+; kernels/triton_gemv.py).
    """
    T, H, D = q.shape
    _, block_size, KVH, Dk = k_cache.shape
    assert Dk == D and v_cache.shape == k_cache.shape and H % KVH == 0
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    B = seq_lens.shape[0]
    assert query_start_loc.shape[0] == B + 1 and block_tables.shape[0] >= B
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if T == 0 or B == 0:
        return out
    g = H // KVH
    if block_m is None and max_query_len is not None and max_query_len * next_pow2(g) >= 64:
        block_m, tile_n = 64, tile_n or max(32, block_size)
    elif max_query_len == 1:  # decode: 128-key tiles, 4 warps (the H100's pick: docs/performance.md)
        tile_n, num_warps = tile_n or 128, num_warps or 4
    g_pad, block_q, bm = tile_shape(H, KVH, block_m)
    tile_n = max(16, next_pow2(tile_n or block_size))
    kernel, combine = _kernels()
    grid = (num_query_tiles(T, B, block_q), KVH, num_splits)
    head_pad = next_pow2(D)
    if num_splits > 1:
        assert num_splits == next_pow2(num_splits), "num_splits must be a power of two"
        part_acc = torch.empty((T, H, num_splits, head_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((T, H, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    extra = {"num_warps": num_warps} if num_warps else {}
    pdl_launch = {"launch_pdl": True} if pdl else {}  # only when set: HIP has no such option
    extra.update(pdl_launch)
    kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        part_acc,
        part_ml,
        float(scale) * 1.4426950408889634,
        B,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        G=g,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        BLOCK_M=bm,
        TILE_N=tile_n,
        HEAD_DIM=D,
        HEAD_PAD=head_pad,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_SPLITS=num_splits,
        PDL=pdl,
        **extra,
    )
    if num_splits > 1:
        combine[(T, H)](
            part_acc,
            part_ml,
            out,
            query_start_loc,
            B,
            out.stride(0),
            out.stride(1),
            H=H,
            NUM_SPLITS=num_splits,
            HEAD_DIM=D,
            HEAD_PAD=head_pad,
            PDL=pdl,
            **pdl_launch,
        )
    return out
