"""CPU decode attention: the native kernel (csrc/paged_decode_attention.c) against the torch
reference path (gather + SDPA) on the same paged cache, in one run.

One decode step's attention over all layers: ``--requests`` rows of ``--tokens`` keys each,
SmolLM2's heads by default (9 query heads, 3 KV heads, head dim 64), 16-token blocks
scattered through the cache as a busy engine leaves them (``--in-order`` keeps each
request's blocks together). Prints the median time per step, the KV read rate and the
ratio; the output of both paths is compared.

    python bench/bench_decode_attention.py [--dtypes float32,bfloat16] [--requests 64] [--tokens 450]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from kernels import cpu_kernels  # noqa: E402
from kernels.attention import AttentionMetadata, decode_attention  # noqa: E402


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=450, help="keys per request")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--in-order", action="store_true", help="each request's blocks side by side in the cache")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, bs = args.requests, args.block_size
    per_request = -(-args.tokens // bs)
    num_blocks = n * per_request
    order = list(range(num_blocks))
    if not args.in_order:
        random.Random(0).shuffle(order)
    tables = [order[i * per_request : (i + 1) * per_request] for i in range(n)]
    meta = AttentionMetadata.build([1] * n, [args.tokens] * n, tables, bs)
    scale = args.head_dim**-0.5
    print(
        f"{n} requests x {args.tokens} tokens x {args.layers} layers, heads {args.heads}/{args.kv_heads}, "
        f"head dim {args.head_dim}, {bs}-token blocks {'in order' if args.in_order else 'shuffled'}, "
        f"{args.threads} threads"
    )
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        shape = (num_blocks, bs, args.kv_heads, args.head_dim)
        caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)]
        q = torch.randn(n, args.heads, args.head_dim).to(dtype)
        out = torch.empty_like(q)

        def native():
            for k, v in caches:
                if (
                    cpu_kernels.paged_decode_attention(
                        q, k, v, meta.decode_block_tables, meta.decode_seq_lens, scale, max_seq_len=args.tokens, out=out
                    )
                    is None
                ):
                    raise SystemExit("the native kernel declined these shapes (or there is no C compiler)")

        def reference():
            for k, v in caches:
                decode_attention(q, k.view(-1, *shape[2:]), v.view(-1, *shape[2:]), meta, scale)

        native_ms, torch_ms = median_ms(native, args.repeat), median_ms(reference, args.repeat)
        k, v = caches[-1]
        expected = decode_attention(
            q.float(), k.float().view(-1, *shape[2:]), v.float().view(-1, *shape[2:]), meta, scale
        )
        error = (out.float() - expected).abs().max().item()
        gb = n * args.tokens * args.kv_heads * args.head_dim * 2 * dtype.itemsize * args.layers / 1e9
        print(
            f"{name:9s} native {native_ms:7.2f} ms ({gb / native_ms * 1e3:5.1f} GB/s)   "
            f"torch path {torch_ms:7.2f} ms ({gb / torch_ms * 1e3:5.1f} GB/s)   "
            f"native / torch {torch_ms / native_ms:5.2f}x   max |diff| {error:.1e}"
        )


if __name__ == "__main__":
    main()
