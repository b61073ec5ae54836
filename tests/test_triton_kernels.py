"""Triton kernels (src/kernels/triton_attention.py, triton_ops.py) against the torch reference.

Runs on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set here before triton is
imported), on small shapes; skipped when triton is not installed. Cases: a mixed batch in one
launch (decodes, a prefill chunk behind a cached prefix, a fresh prefill, a padded dummy
request), GQA with 4, 3 and 1 query heads per KV head, head_dim 64 and 128, block_size 16,
fp32 (tight) and fp16 (loose) inputs, CUDA-graph-style padding (slot -1, seq_len 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest
import torch

pytest.importorskip("triton")

from kernels import attention as ref_attn  # noqa: E402
from kernels import norm as ref_norm  # noqa: E402
from kernels import rotary as ref_rotary  # noqa: E402
from kernels import triton_attention, triton_ops  # noqa: E402

BLOCK_SIZE = 16
_SRC = Path(__file__).resolve().parent.parent / "src"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _batch(query_lens, seq_lens, num_blocks, gen):
    """Random non-overlapping block tables (block 0 kept as the null block) and the flat
    varlen tensors the Triton kernel takes."""
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, i = [], 0
    for s in seq_lens:
        n = -(-s // BLOCK_SIZE)
        tables.append(perm[i : i + n])
        i += n
    max_blocks = max(1, max(len(t) for t in tables))
    bt = torch.zeros(len(tables), max_blocks + 1, dtype=torch.int32)  # +1: ragged width
    for r, t in enumerate(tables):
        bt[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return tables, bt, qsl, torch.tensor(seq_lens, dtype=torch.int32)


# Decodes (one near a block edge, one with a single key), a chunk behind a 29-token cached
# prefix that spans several query tiles and blocks, a fresh prefill, a q_len 0 / seq_len 0 pad.
MIXED_QLENS = [1, 1, 1, 19, 21, 0]
MIXED_SEQLENS = [17, 1, 40, 48, 21, 0]


def _run_step(num_heads, num_kv_heads, head_dim, dtype, block_m=None, tile_n=None, seed=0, **kw):
    """One model step on both paths: store this step's K/V, then attend. Returns
    (triton out, reference out, triton caches, reference caches, number of real rows)."""
    gen = torch.Generator().manual_seed(seed)
    qlens, slens = MIXED_QLENS, MIXED_SEQLENS
    num_blocks = 24
    tables, bt, qsl, seq = _batch(qlens, slens, num_blocks, gen)
    T = sum(qlens)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(T, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(dtype)
    real = [i for i, n in enumerate(qlens) if n]  # the reference has no notion of a q_len 0 pad
    meta = ref_attn.AttentionMetadata.build(
        [qlens[i] for i in real], [slens[i] for i in real], [tables[i] for i in real], BLOCK_SIZE
    )
    scale = head_dim**-0.5

    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref_attn.store_kv(k, v, kc_ref, vc_ref, meta.slot_mapping)
    ref = ref_attn.paged_attention(q.float(), kc_ref.float(), vc_ref.float(), meta, scale)

    kc, vc = k_cache.clone(), v_cache.clone()
    triton_ops.store_kv(k, v, kc, vc, meta.slot_mapping)
    out = triton_attention.unified_attention(q, kc, vc, bt, qsl, seq, scale, block_m=block_m, tile_n=tile_n, **kw)
    return out, ref, (kc, vc), (kc_ref, vc_ref), T


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(8, 2, 64), (4, 4, 128), (6, 2, 64), (4, 1, 128)],
    ids=["gqa4-d64", "mha-d128", "gqa3-d64", "gqa4-d128"],
)
def test_mixed_batch_fp32(num_heads, num_kv_heads, head_dim):
    out, ref, caches, ref_caches, T = _run_step(num_heads, num_kv_heads, head_dim, torch.float32)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    assert out.shape == (T, num_heads, head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("block_m,tile_n", [(64, 16), (16, 32), (32, 64)])
def test_mixed_batch_tilings(block_m, tile_n):
    """Bigger query tiles (several tokens x GQA heads per tile) and key tiles spanning blocks."""
    out, ref, _, _, _ = _run_step(8, 2, 64, torch.float32, block_m=block_m, tile_n=tile_n, seed=1)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("num_splits,tile_n", [(2, 16), (4, 16), (8, 32)])
def test_split_kv(num_splits, tile_n):
    """Flash-decoding: keys split over several programs, partial softmax states merged. Splits
    past a request's keys stay empty; the mixed batch covers prefills and a pad too."""
    out, ref, _, _, _ = _run_step(8, 2, 64, torch.float32, tile_n=tile_n, seed=4, num_splits=num_splits)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_mixed_batch_prefill_heuristic():
    """max_query_len switches to 64-row query tiles and 32-key tiles."""
    out, ref, _, _, _ = _run_step(4, 4, 64, torch.float32, seed=8, max_query_len=max(MIXED_QLENS))
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_mixed_batch_fp16():
    out, ref, caches, ref_caches, _ = _run_step(8, 2, 64, torch.float16, seed=2)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, **TOL[torch.float16])


def test_padded_decode_batch():
    """CUDA-graph replay shape: real decodes then pads with a dummy token, slot -1 and
    seq_len 0. Pads must not touch the cache and must come out as zeros (never NaN)."""
    gen = torch.Generator().manual_seed(3)
    H, KVH, D = 8, 2, 64
    slens = [5, 30, 0, 0]
    qlens = [1, 1, 1, 1]
    tables, bt, qsl, seq = _batch(qlens, slens, 8, gen)
    k_cache = torch.randn(8, BLOCK_SIZE, KVH, D, generator=gen)
    v_cache = torch.randn(8, BLOCK_SIZE, KVH, D, generator=gen)
    q = torch.randn(4, H, D, generator=gen)
    k = torch.randn(4, KVH, D, generator=gen)
    v = torch.randn(4, KVH, D, generator=gen)
    meta = ref_attn.AttentionMetadata.build(qlens[:2], slens[:2], tables[:2], BLOCK_SIZE)
    slots = torch.cat([meta.slot_mapping, torch.full((2,), -1, dtype=torch.int64)])

    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref_attn.store_kv(k[:2], v[:2], kc_ref, vc_ref, meta.slot_mapping)
    ref = ref_attn.paged_attention(q[:2], kc_ref, vc_ref, meta, D**-0.5)

    kc, vc = k_cache.clone(), v_cache.clone()
    triton_ops.store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    out = torch.full_like(q, float("nan"))
    triton_attention.unified_attention(q, kc, vc, bt, qsl, seq, D**-0.5, out=out)
    torch.testing.assert_close(out[:2], ref, **TOL[torch.float32])
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_trailing_unused_query_rows(num_splits):
    """T larger than query_start_loc[-1] (a padded token buffer): extra rows are left alone,
    also by the split-KV combine (its partials for them are never written)."""
    gen = torch.Generator().manual_seed(4)
    tables, bt, qsl, seq = _batch([3], [3], 4, gen)
    kc = torch.randn(4, BLOCK_SIZE, 1, 64, generator=gen)
    vc = torch.randn(4, BLOCK_SIZE, 1, 64, generator=gen)
    q = torch.randn(8, 2, 64, generator=gen)
    meta = ref_attn.AttentionMetadata.build([3], [3], tables, BLOCK_SIZE)
    ref = ref_attn.paged_attention(q[:3], kc, vc, meta, 0.125)
    out = torch.full_like(q, 7.0)
    triton_attention.unified_attention(q, kc, vc, bt, qsl, seq, 0.125, out=out, num_splits=num_splits)
    torch.testing.assert_close(out[:3], ref, **TOL[torch.float32])
    assert torch.all(out[3:] == 7.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv(dtype):
    gen = torch.Generator().manual_seed(5)
    kvh, d, T = 2, 128, 9
    k_cache = torch.randn(6, BLOCK_SIZE, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(6, BLOCK_SIZE, kvh, d, generator=gen).to(dtype)
    k = torch.randn(T, kvh, d, generator=gen).to(dtype)
    v = torch.randn(T, kvh, d, generator=gen).to(dtype)
    slots = torch.randperm(6 * BLOCK_SIZE, generator=gen)[:T]
    slots[[2, 7]] = -1
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref_attn.store_kv(k, v, kc_ref, vc_ref, slots)
    triton_ops.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    res = torch.randn(5, hidden, generator=gen).to(dtype) if with_residual else None
    ref = ref_norm.rms_norm(x, w, 1e-6, res)
    got = triton_ops.rms_norm(x, w, 1e-6, res)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    if with_residual:
        torch.testing.assert_close(got[1], ref[1], atol=0, rtol=0)  # the sum is exact
        ref, got = ref[0], got[0]
    assert got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary(dtype, head_dim):
    gen = torch.Generator().manual_seed(7)
    T = 6
    table = ref_rotary.rope_cos_sin(head_dim, 64, 10000.0)
    pos = torch.tensor([0, 1, 17, 5, 63, 40])
    cs = table[pos]
    cos, sin = cs[:, : head_dim // 2], cs[:, head_dim // 2 :]  # strided row views, as the runner does
    q = torch.randn(T, 8, head_dim, generator=gen).to(dtype)
    k = torch.randn(T, 2, head_dim, generator=gen).to(dtype)
    rq, rk = ref_rotary.apply_rotary(q, k, cos, sin)
    gq, gk = triton_ops.apply_rotary(q, k, cos, sin)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(gq, rq, **tol)
    torch.testing.assert_close(gk, rk, **tol)


def _run_python(code: str, env_drop=("TRITON_INTERPRET",)) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env["PYTHONPATH"] = os.pathsep.join([str(_SRC), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize(
    "norm,residual,bias,gate_up",
    [
        (False, False, False, False),
        (True, False, True, False),
        (True, True, False, False),
        (True, True, False, True),
        (False, False, True, True),
    ],
)
def test_small_batch_linear(rows, norm, residual, bias, gate_up, dtype):
    """Against the torch path of the ops it fuses: (x + residual) -> RMSNorm -> linear -> SiLU-mul.
    K = 300 and N = 40 are not multiples of the 256 / 16 tiles (two K steps, masked edges).
    fp16 checks the rounding order (a rounding step apart at most: accumulation order differs)."""
    from kernels.activation import silu_and_mul
    from kernels.triton_gemv import small_batch_linear

    g = torch.Generator().manual_seed(rows)
    K, N = 300, 40

    def randn(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g)).to(dtype)

    x = randn(rows, K)
    r = randn(rows, K) if residual else None
    w = randn(2 * N if gate_up else N, K, scale=K**-0.5)
    b = randn(w.shape[0]) if bias else None
    nw = randn(K, scale=0.3, shift=1.0) if norm else None

    got = small_batch_linear(x, w, b, nw, r, eps=1e-6, gate_up=gate_up)
    h, new_res = (
        (ref_norm.rms_norm(x, nw, 1e-6, r) if r is not None else (ref_norm.rms_norm(x, nw, 1e-6), x))
        if norm
        else (x, None)
    )
    want = torch.nn.functional.linear(h, w, b)
    if gate_up:
        want = silu_and_mul(want)
    if norm:
        got, got_res = got
        torch.testing.assert_close(got_res, new_res, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, want, **TOL[dtype])
    if dtype == torch.float16:  # same rounding order: nearly all equal to the last bit (a rounding elsewhere: ~half)
        assert (got == want).float().mean() > 0.95


def test_import_without_triton_is_safe():
    """With triton unimportable the modules still import (kernels are built on first call)."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from kernels import triton_attention, triton_ops\n"
        "assert not triton_attention.triton_available()\n"
        "print('ok')\n"
    )
    r = _run_python(code)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# Compiles the real (not interpreted) kernels down to sm_90 cubin with the ptxas bundled in the
# triton wheel: catches what the interpreter accepts but the compiler rejects (control flow,
# dtypes, dot shapes), with no GPU. bf16 is covered here only: the interpreter's bf16 tl.dot
# is wrong, so bf16 numerics need a GPU.
_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_attention as ta, triton_ops as to

target = GPUTarget("cuda", 90, 32)


def compile(fn, types, consts, pdl=False):
    sig = {n: types.get(n, "i32") for n in fn.arg_names}
    if "PDL" in fn.arg_names:
        consts = dict(consts, PDL=pdl)
    sig.update({c: "constexpr" for c in consts})
    k = triton.compile(ASTSource(fn, sig, consts), target=target, options={"launch_pdl": pdl})
    assert k.asm["cubin"]
    if pdl:  # waits for the kernel before it, then lets the next one launch (kernels/triton_gemv.py)
        ptx = k.asm["ptx"]
        assert k.metadata.launch_pdl
        assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
    return k


attn, combine = ta._kernels()
kv, rms, rot, qkv, silu = to._kernels()
for dt, g, bm, tn in (("bf16", 4, 16, 16), ("bf16", 4, 64, 32), ("fp16", 1, 64, 32), ("fp32", 3, 16, 16)):
    g_pad, bq, bm = ta.tile_shape(g * 2, 2, bm)
    types = dict(q_ptr="*" + dt, k_cache_ptr="*" + dt, v_cache_ptr="*" + dt, out_ptr="*" + dt,
                 block_tables_ptr="*i64", query_start_loc_ptr="*i64", seq_lens_ptr="*i64", qk_scale="fp32",
                 part_acc_ptr="*fp32", part_ml_ptr="*fp32")
    for splits, pdl in ((1, False), (8, False), (8, True)):
        k = compile(attn, types, dict(BLOCK_SIZE=16, G=g, G_PAD=g_pad, BLOCK_Q=bq, BLOCK_M=bm, TILE_N=tn,
                                      HEAD_DIM=128, HEAD_PAD=128, DOT_PRECISION="ieee" if dt == "fp32" else "tf32",
                                      NUM_SPLITS=splits), pdl)
    for pdl in (False, True):
        compile(combine, dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32", out_ptr="*" + dt, query_start_loc_ptr="*i64"),
                dict(H=16, NUM_SPLITS=8, HEAD_DIM=128, HEAD_PAD=128), pdl)
    if dt != "fp32":
        assert "wgmma" in k.asm["ptx"] or "mma.sync" in k.asm["ptx"], "attention dots must use tensor cores"
bf = {n: "*bf16" for n in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "x_ptr", "res_ptr", "w_ptr",
                           "out_ptr", "res_out_ptr")}
compile(kv, dict(bf, slot_ptr="*i64"), dict(NUM_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, HEAD_PAD=128, BLOCK_SIZE=16))
for res in (False, True):
    compile(rms, dict(bf, eps="fp32"), dict(HAS_RESIDUAL=res, BLOCK=4096))
compile(rot, dict(bf, cos_ptr="*fp32", sin_ptr="*fp32"), dict(NUM_HEADS=32, HALF=64, HEADS_PAD=32, HALF_PAD=64))
for norm, pdl in ((False, False), (True, False), (True, True)):
    compile(qkv, dict(qkv_ptr="*bf16", q_out_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", slot_ptr="*i64",
                      cos_ptr="*fp32", sin_ptr="*fp32", qw_ptr="*bf16", kw_ptr="*bf16", eps="fp32"),
            dict(H=16, KVH=8, H_PAD=16, KVH_PAD=8, HALF=64, HALF_PAD=64, BLOCK_SIZE=16, HAS_NORM=norm), pdl)
compile(silu, dict(x_ptr="*bf16", out_ptr="*bf16"), dict(BLOCK=1024))
from kernels import triton_gemv as tg
for dt in ("bf16", "fp16"):
    for norm, res, gate_up in ((False, False, False), (True, True, False), (True, True, True), (True, False, False)):
        for pdl in (False, True):
            k = compile(tg._kernel(), {**{n: "*" + dt for n in ("x_ptr", "res_ptr", "norm_w_ptr", "w_ptr", "bias_ptr",
                                                                 "out_ptr", "res_out_ptr")}, "eps": "fp32"},
                        dict(HAS_NORM=norm, HAS_RESIDUAL=res, HAS_BIAS=False, GATE_UP=gate_up, BLOCK_M=16, BLOCK_N=16,
                             BLOCK_K=256, DOT_PRECISION="tf32", LINE=64, K_LINES=16), pdl)
            ptx = k.asm["ptx"]
            assert "mma" in ptx, "small-batch linear dots must use tensor cores"
            # with PDL: this program's 16 weight rows x 16 lines (x2 for gate|up), prefetched before the wait
            lines = ptx.count("prefetch.global.L2")
            assert lines == (0 if not pdl else 4 if gate_up else 2), lines
            assert not pdl or ptx.rindex("prefetch.global.L2") < ptx.index("griddepcontrol.wait")
from kernels import triton_sampling as ts
compile(ts._kernel(), dict(logits_ptr="*bf16", temp_ptr="*fp32", best_val_ptr="*fp32", best_idx_ptr="*i64",
                           seed="i32", vocab="i32", stride_row="i32"), dict(NUM_SLICES=38, BLOCK=4096))
from kernels import triton_filtered_sampling as tf  # (nested while loops, loop-carried scalars)
compile(tf._kernel(), dict(w_ptr="*fp32", top_k_ptr="*i64", top_p_ptr="*fp32", min_w_ptr="*fp32", u_ptr="*fp32",
                           out_ptr="*i64"), dict(BLOCK=tf.BLOCK))
print("ok")
"""


def test_kernels_compile_for_sm90():
    probe = _run_python(
        "from triton.backends.nvidia.compiler import get_ptxas\n"
        "try:\n    get_ptxas(90)\nexcept TypeError:\n    get_ptxas()\n"
    )
    if probe.returncode != 0:
        pytest.skip(f"triton's CUDA backend / ptxas not available: {probe.stderr[-300:]}")
    r = _run_python(_AOT)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
