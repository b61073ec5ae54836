"""Fused temperature sampling in Triton: the Gumbel-max trick in one pass over the logits.

``argmax(logits / T + G)`` with ``G = -log(-log(U))`` i.i.d. Gumbel noise is an exact sample
of ``softmax(logits / T)``, and needs no softmax, no cumulative sum and no float32 copy of
the ``[rows, vocab]`` logits: each program reads one vocab slice of one row (any dtype),
draws its uniforms with Philox (four per call) from ``(seed, row, token)``, and keeps the slice's best
score; a tiny torch reduction picks each row's best slice. Rows with ``T == 0`` take the plain
argmax. For rows that only set a temperature (top-k, top-p, min-p, penalties and seeds go
through ``kernels.sampling``); the torch path is its reference in distribution.
"""

from __future__ import annotations

import functools

import torch

from .util import cdiv

VOCAB_SLICE = 4096


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["seed"])
    def _gumbel_argmax_kernel(
        logits_ptr,
        temp_ptr,
        best_val_ptr,
        best_idx_ptr,
        seed,
        vocab,
        stride_row,
        NUM_SLICES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One Philox call yields 4 uniforms: the slice is taken as 4 quarters, quarter j
        # using the j-th output (a quarter of the RNG work of one call per token).
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        QUARTER: tl.constexpr = BLOCK // 4
        lanes = tl.arange(0, QUARTER)
        t = tl.load(temp_ptr + row)
        inv_t = 1.0 / tl.where(t > 0.0, t, 1.0)  # one division per program, not per token
        r0, r1, r2, r3 = tl.randint4x(seed, (row * (NUM_SLICES * QUARTER) + part * QUARTER + lanes).to(tl.uint32))
        best_val = float("-inf")
        best_idx = 0
        for j in tl.static_range(4):
            r = r0 if j == 0 else (r1 if j == 1 else (r2 if j == 2 else r3))
            cols = part * BLOCK + j * QUARTER + lanes
            ok = cols < vocab
            x = tl.load(logits_ptr + row * stride_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            if t > 0.0:
                u = tl.maximum(tl.random.uint_to_uniform_float(r), 1e-20)
                x = tl.where(ok, x * inv_t - tl.log(-tl.log(u)), float("-inf"))
            val, idx = tl.max(x, 0, return_indices=True)
            if val > best_val:  # strict: the first maximum wins, as argmax
                best_val = val
                best_idx = idx + j * QUARTER
        tl.store(best_val_ptr + row * NUM_SLICES + part, best_val)
        tl.store(best_idx_ptr + row * NUM_SLICES + part, best_idx + part * BLOCK)

    return _gumbel_argmax_kernel


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """One token per row of ``logits [N, V]``; ``temperature [N]`` float32 (0: greedy)."""
    n, vocab = logits.shape
    logits = logits.reshape(n, vocab)  # a lone row's stride is arbitrary (1 on the CPU): a view with the usual one
    assert logits.stride(1) == 1 and temperature.shape == (n,)
    slices = cdiv(vocab, VOCAB_SLICE)
    best_val = torch.empty((n, slices), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((n, slices), dtype=torch.int64, device=logits.device)
    if n:
        _kernel()[(n, slices)](
            logits,
            temperature,
            best_val,
            best_idx,
            seed & 0x7FFF_FFFF,
            vocab,
            logits.stride(0),
            NUM_SLICES=slices,
            BLOCK=VOCAB_SLICE,
        )
    return best_idx.gather(1, best_val.argmax(dim=1, keepdim=True)).squeeze(1)
