"""Batch preparation for attention (slot mapping, gather indices, masks) and the torch
paged-attention path, against dense causal attention on the same keys."""

import math

import pytest
import torch
import torch.nn.functional as F

from kernels import attention, cpu_kernels
from kernels.attention import AttentionMetadata, store_kv
from kernels.backend import CpuBackend

BS, H, HKV, D = 4, 6, 2, 16


def dense_reference(q, k, v):
    """Causal attention over a whole sequence; q/k/v [S, heads, D]."""
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(rep, 1).transpose(0, 1),
        v.repeat_interleave(rep, 1).transpose(0, 1),
        is_causal=True,
    )
    return out.transpose(0, 1)


@pytest.fixture(params=["native", "torch"])
def paged_attention(request):
    """Each test runs with the CPU backend's paged attention (the native decode kernel) and
    with the torch reference."""
    if request.param == "torch":
        return attention.paged_attention
    if cpu_kernels.load_library("paged_decode_attention") is None:
        pytest.skip("no C compiler: native kernel unavailable")
    return CpuBackend.paged_attention


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_matches_dense_attention(seed, paged_attention):
    g = torch.Generator().manual_seed(seed)
    # (already computed tokens, tokens this step, block table): a decode, a decode at a
    # block boundary, a prefill with a cached prefix (bottom-right mask), a fresh prefill.
    reqs = [(6, 1, [5, 9]), (8, 1, [3, 4, 7]), (3, 5, [1, 2]), (0, 7, [10, 11])]
    num_blocks = 16
    k_cache = torch.zeros(num_blocks, BS, HKV, D)
    v_cache = torch.zeros(num_blocks, BS, HKV, D)
    seqs = []
    for done, n, table in reqs:
        total = done + n
        q, k, v = (torch.randn(total, h, D, generator=g) for h in (H, HKV, HKV))
        seqs.append((q, k, v))
        for p in range(done):  # earlier steps' KV already in the cache
            slot = table[p // BS] * BS + p % BS
            k_cache.view(-1, HKV, D)[slot] = k[p]
            v_cache.view(-1, HKV, D)[slot] = v[p]
    meta = AttentionMetadata.build([n for _, n, _ in reqs], [d + n for d, n, _ in reqs], [t for *_, t in reqs], BS)
    assert meta.num_decodes == 2 and len(meta.prefills) == 2
    assert meta.prefills[0].mask is not None and meta.prefills[1].mask is None
    q = torch.cat([s[0][d:] for s, (d, _, _) in zip(seqs, reqs)])
    k = torch.cat([s[1][d:] for s, (d, _, _) in zip(seqs, reqs)])
    v = torch.cat([s[2][d:] for s, (d, _, _) in zip(seqs, reqs)])
    expected_slots = [t[p // BS] * BS + p % BS for d, n, t in reqs for p in range(d, d + n)]
    assert meta.slot_mapping.tolist() == expected_slots
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(q, k_cache, v_cache, meta, 1 / math.sqrt(D), k, v)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta, 1 / math.sqrt(D)), out)
    expected = torch.cat([dense_reference(*s)[d:] for s, (d, _, _) in zip(seqs, reqs)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_store_kv_skips_padding_slots():
    k_cache = torch.zeros(4, BS, HKV, D)
    v_cache = torch.zeros(4, BS, HKV, D)
    k = torch.ones(3, HKV, D)
    store_kv(k, k, k_cache, v_cache, torch.tensor([5, -1, 6]))
    flat = k_cache.view(-1, HKV, D)
    assert flat[5].eq(1).all() and flat[6].eq(1).all()
    assert flat.sum() == 2 * HKV * D


def random_paged_cache(dtype, num_blocks, head_dim, seed, block_size=BS, kv_heads=HKV):
    """A generator and random K/V caches for the native kernel (skips without a C compiler)."""
    if cpu_kernels.load_library("paged_decode_attention", dtype) is None:
        pytest.skip("no C compiler: native kernel unavailable")
    g = torch.Generator().manual_seed(seed)
    return g, *(torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))


def assert_native_decode_matches_torch_path(q, k_cache, v_cache, seq_lens, tables, shares=0):
    """The native kernel against the torch path in fp32 on the same (rounded) values: the
    kernel accumulates in fp32 too."""
    from kernels.attention import decode_attention

    _, block_size, kv_heads, head_dim = k_cache.shape
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, block_size)
    k_flat, v_flat = k_cache.float().view(-1, kv_heads, head_dim), v_cache.float().view(-1, kv_heads, head_dim)
    expected = decode_attention(q.float(), k_flat, v_flat, meta, 0.125).to(q.dtype)
    native = cpu_kernels.paged_decode_attention(
        q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, 0.125, shares
    )
    assert native.dtype == q.dtype
    if q.dtype == torch.bfloat16 and head_dim % 32 == 0 and cpu_kernels.has_avx512_bf16():
        # AVX512-BF16's dot product takes the probabilities rounded to bf16 for P.V, as GPU
        # flash attention does: within twice the error of torch's own bf16 path from fp32.
        reference = decode_attention(q.float(), k_flat, v_flat, meta, 0.125)
        torch_bf16 = decode_attention(q, k_flat.to(q.dtype), v_flat.to(q.dtype), meta, 0.125)
        error = (native.float() - reference).abs().max()
        assert error <= 2 * (torch_bf16.float() - reference).abs().max(), f"seq_lens {seq_lens}: {error}"
    else:
        tol = dict(atol=1e-5, rtol=1e-5) if q.dtype == torch.float32 else {}
        torch.testing.assert_close(native, expected, **tol, msg=lambda m: f"seq_lens {seq_lens}: {m}")
    # As the model calls it: the host's max length from the metadata, into a given tensor.
    out = torch.full_like(q, float("nan"))
    into = cpu_kernels.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        meta.decode_block_tables,
        meta.decode_seq_lens,
        0.125,
        shares,
        max_seq_len=meta.decode_max_seq_len,
        out=out,
    )
    assert into is out and torch.equal(out, native)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [D, 64, 128, 40, 8])  # generic, the two unrolled sizes, 8-float tails
def test_native_decode_kernel_matches_torch_path_on_long_sequences(dtype, head_dim):
    n, num_blocks = 5, 64
    g, k_cache, v_cache = random_paged_cache(dtype, num_blocks, head_dim, seed=0)
    seq_lens = [1, 4, 5, 37, 100]
    tables = [torch.randperm(num_blocks - 1, generator=g)[: -(-s // BS)].add(1).tolist() for s in seq_lens]
    q = torch.randn(n, H, head_dim, generator=g).to(dtype)
    assert_native_decode_matches_torch_path(q, k_cache, v_cache, seq_lens, tables)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (16, 128), (16, 96), (16, 40), (8, 64)])
def test_native_decode_kernel_at_the_engine_block_size(dtype, block_size, head_dim):
    """16-token blocks (the default) and 8-token ones. Head dims a multiple of 32 take the
    bf16 build's dot-product path where the CPU has AVX512-BF16, 40 the widening one and,
    with 16-float vectors, an 8-float tail. Partial blocks (rows past the length are never
    read), one token, and three query heads per KV head (SmolLM2's grouping)."""
    num_blocks, heads, kv_heads = 48, 9, 3
    g, k_cache, v_cache = random_paged_cache(dtype, num_blocks, head_dim, 3, block_size, kv_heads)
    seq_lens = [1, 15, 16, 17, 100, 203]
    perm = torch.randperm(num_blocks - 1, generator=g).add(1)
    starts = [sum(-(-s // block_size) for s in seq_lens[:i]) for i in range(len(seq_lens))]
    tables = [perm[a : a + -(-s // block_size)].tolist() for a, s in zip(starts, seq_lens)]
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype)
    for shares in (0, 1):
        assert_native_decode_matches_torch_path(q, k_cache, v_cache, seq_lens, tables, shares)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 5, 7, 8])
def test_native_decode_kernel_query_head_groupings(dtype, head_dim, group):
    """MHA to 8 query heads per KV head: the unrolled head dims' values pass takes several
    query heads of a group at once (as many as the registers hold), the rest in a smaller
    chunk."""
    num_blocks, kv_heads, block_size = 40, 2, 16
    g, k_cache, v_cache = random_paged_cache(dtype, num_blocks, head_dim, 4, block_size, kv_heads)
    seq_lens = [1, 17, 70, 200]
    perm = torch.randperm(num_blocks - 1, generator=g).add(1)
    starts = [sum(-(-s // block_size) for s in seq_lens[:i]) for i in range(len(seq_lens))]
    tables = [perm[a : a + -(-s // block_size)].tolist() for a, s in zip(starts, seq_lens)]
    q = torch.randn(len(seq_lens), group * kv_heads, head_dim, generator=g).to(dtype)
    for shares in (0, 3):
        assert_native_decode_matches_torch_path(q, k_cache, v_cache, seq_lens, tables, shares)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shares", [0, 1, 2, 3, 16, 200])  # 0: one per thread; 200: more than blocks
def test_native_decode_kernel_split_kv_matches_torch_path(dtype, shares):
    """The requests' blocks, end to end, are cut into equal shares run in parallel: a request
    cut between shares (in up to 76 pieces here) is attended in pieces, then merged."""
    num_blocks = 160
    g, k_cache, v_cache = random_paged_cache(dtype, num_blocks, head_dim=64, seed=2)
    for seq_lens in ([301], [3, 33, 250], [64, 65], [0, 5]):  # 76 blocks; 1, 9, 63; 16, 17; none, 2
        perm = torch.randperm(num_blocks - 1, generator=g).add(1)
        starts = [sum(-(-s // BS) for s in seq_lens[:i]) for i in range(len(seq_lens))]
        tables = [perm[a : a + -(-s // BS)].tolist() for a, s in zip(starts, seq_lens)]
        q = torch.randn(len(seq_lens), H, 64, generator=g).to(dtype)
        assert_native_decode_matches_torch_path(q, k_cache, v_cache, seq_lens, tables, shares)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (16, 128), (8, 64), (16, 96), (16, 40)])
def test_native_decode_kernel_shared_prefixes(dtype, block_size, head_dim):
    """Requests whose tables start with the same blocks attend them together, then their own
    blocks from that state. Here a group whose prefix is longer than a softmax segment, a
    request that shares only its first block with it (whether the kernel groups it is a speed
    choice: the result is the same either way), a group whose shortest member bounds its
    prefix, a request whose only block is a group's first (it has no block of its own past it:
    attended alone), a lone request and an empty one; three query heads to a KV head (SmolLM2's).
    96 takes the generic prefix path, 40 (not whole vectors) none."""
    num_blocks, heads, kv_heads = 160, 9, 3
    g, k_cache, v_cache = random_paged_cache(dtype, num_blocks, head_dim, 5, block_size, kv_heads)
    free = iter(torch.randperm(num_blocks - 1, generator=g).add(1).tolist())

    def blocks(count):
        return [next(free) for _ in range(count)]

    def need(tokens):
        return -(-tokens // block_size)

    long_prefix, short_prefix = blocks(need(300) - 1), blocks(3)
    rows = []  # (seq_len, table)
    for seq in (300, 301, 333, 360, 420):
        rows.append((seq, long_prefix + blocks(need(seq) - len(long_prefix))))
    rows.append((2 * block_size + 1, long_prefix[:1] + blocks(2)))
    rows.append((3 * block_size, short_prefix))  # shares two blocks: its last is its own
    for seq in (4 * block_size + 3, 6 * block_size):
        rows.append((seq, short_prefix + blocks(need(seq) - 3)))
    rows.append((block_size, short_prefix[:1]))
    rows += [(57, blocks(need(57))), (0, [])]
    seq_lens, tables = [s for s, _ in rows], [t for _, t in rows]
    q = torch.randn(len(rows), heads, head_dim, generator=g).to(dtype)
    for shares in (0, 1, 5):
        assert_native_decode_matches_torch_path(q, k_cache, v_cache, seq_lens, tables, shares)


def test_native_decode_kernel_declines_what_it_does_not_read():
    q = torch.randn(2, H, D)
    k_cache = torch.zeros(8, BS, HKV, D)
    tables, lens = torch.tensor([[1, 2], [3, 4]]), torch.tensor([5, 8])
    args = (k_cache, k_cache.clone(), tables, lens, 0.125)
    assert cpu_kernels.paged_decode_attention(q.bfloat16(), *args) is None  # bf16 query, fp32 cache
    assert cpu_kernels.paged_decode_attention(q, k_cache, torch.zeros(8, BS, HKV, 2 * D), tables, lens, 0.125) is None
    assert cpu_kernels.paged_decode_attention(q, k_cache, k_cache, tables[:1], lens, 0.125) is None  # a table short
    assert (
        cpu_kernels.paged_decode_attention(q, k_cache, k_cache, tables, torch.tensor([5, 9]), 0.125) is None
    )  # 9 > 2 blocks
    assert cpu_kernels.paged_decode_attention(q, *args, max_seq_len=9) is None  # the caller's max, 9 > 2 blocks
    assert (
        cpu_kernels.paged_decode_attention(q, *args, out=torch.empty(H, 2, D).transpose(0, 1)) is None
    )  # not contiguous
    assert cpu_kernels.paged_decode_attention(q, *args, out=torch.empty(2, H, D).bfloat16()) is None


def assert_native_prefill_matches_torch_path(reqs, heads, kv_heads, head_dim, block_size, dtype, seed):
    """``reqs``: (cached tokens, tokens this step) per request, decodes first. The native
    prefill kernel against the torch path in fp32 on the same (rounded) values."""
    total_blocks = sum(-(-(d + n) // block_size) for d, n in reqs) + 1
    g, k_cache, v_cache = random_paged_cache(dtype, total_blocks, head_dim, seed, block_size, kv_heads)
    free = iter(torch.randperm(total_blocks - 1, generator=g).add(1).tolist())
    tables = [[next(free) for _ in range(-(-(d + n) // block_size))] for d, n in reqs]
    meta = AttentionMetadata.build([n for _, n in reqs], [d + n for d, n in reqs], tables, block_size)
    q = torch.randn(meta.slot_mapping.shape[0], heads, head_dim, generator=g).to(dtype)
    expected = torch.zeros(q.shape)
    attention.prefill_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.125, expected)
    out = torch.full_like(q, float("nan"))
    assert cpu_kernels.paged_prefill_attention(
        q, k_cache, v_cache, meta.prefill_segments, meta.prefill_block_tables, 0.125, out
    )
    rows = slice(meta.num_decodes, None)
    assert out[: meta.num_decodes].isnan().all()  # the decode rows are not the kernel's
    if dtype == torch.bfloat16 and head_dim == 64 and block_size % 16 == 0 and cpu_kernels.has_amx():
        # On AMX tiles the probabilities are rounded to bf16 for P.V, as GPU flash attention
        # rounds them: within twice the error of torch's own bf16 path from the fp32 reference.
        torch_bf16 = torch.zeros_like(q)
        attention.prefill_attention(q, k_cache, v_cache, meta, 0.125, torch_bf16)
        error = (out[rows].float() - expected[rows]).abs().max()
        assert error <= 2 * (torch_bf16[rows].float() - expected[rows]).abs().max(), error
        return
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out[rows], expected[rows].to(dtype), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (16, 128), (16, 32), (8, 64), (32, 48), (32, 64)])
def test_native_prefill_kernel_matches_torch_path(dtype, block_size, head_dim):
    """Fresh prompts and chunks after a cached prefix (bottom-right causal), lengths around
    the kernel's 16-key chunks and block edges, one-token chunks, beside decode rows;
    SmolLM2's three query heads per KV head (a tile of 16 rows then ends mid-position)."""
    reqs = [(40, 1), (7, 1), (0, 1), (0, 2), (0, 16), (0, 17), (0, 300), (5, 1), (16, 16), (100, 33), (250, 7)]
    assert_native_prefill_matches_torch_path(reqs, 9, 3, head_dim, block_size, dtype, seed=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 2, 4, 7, 8])
def test_native_prefill_kernel_query_head_groupings(group, dtype):
    reqs = [(0, 45), (33, 20), (0, 3)]
    assert_native_prefill_matches_torch_path(reqs, group * 2, 2, 64, 16, dtype, seed=7)


def test_native_prefill_kernel_declines_what_it_does_not_read():
    q = torch.randn(3, H, D)
    k_cache = torch.zeros(8, BS, HKV, D)
    meta = AttentionMetadata.build([3], [3], [[1]], BS)
    args = (meta.prefill_segments, meta.prefill_block_tables, 0.125)
    assert not cpu_kernels.paged_prefill_attention(q.bfloat16(), k_cache, k_cache, *args, torch.empty_like(q))
    assert not cpu_kernels.paged_prefill_attention(q, k_cache, k_cache, *args, torch.empty(3, H, D).bfloat16())
    wide = torch.zeros(8, BS, HKV, 2 * D)
    assert not cpu_kernels.paged_prefill_attention(q, k_cache, wide, *args, torch.empty_like(q))
    odd = torch.zeros(8, BS, HKV, 24)  # head dims in whole 16-float slices only
    assert not cpu_kernels.paged_prefill_attention(torch.randn(3, H, 24), odd, odd, *args, torch.empty(3, H, 24))
    strided = torch.empty(H, 3, D).transpose(0, 1)
    assert not cpu_kernels.paged_prefill_attention(q, k_cache, k_cache, *args, strided)
