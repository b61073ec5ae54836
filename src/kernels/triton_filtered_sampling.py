"""Top-k / top-p / min-p sampling by rejection, the whole loop on the device (Triton).

The sync-free GPU form of ``kernels.sampling.sample_filtered``: one program per row runs
every rejection round itself, so the host never waits (no ``.any()`` / ``.tolist()``
between rounds) and a step is one launch.

Per row, on unnormalised ``weights`` (>= 0, the row maximum 1): ``total = sum(w)`` and the
pivot starts below every weight. Each round draws among the candidates (``w > pivot``) by
inverse CDF in token order: the first candidate whose cumulative weight exceeds
``u * (candidate mass)``, clamped to the last candidate (never a zero weight). The draw
``t`` is accepted when fewer than ``top_k`` tokens are more likely than it, their mass is
below ``top_p * total`` and ``w[t] >= min_w``; otherwise ``w[t]`` becomes the pivot. The
kept set is an upper set of the distribution and a rejected token lies below all of it, so
the candidates always hold the kept set and an accepted draw follows the renormalised kept
distribution exactly (ties with the k-th token stay: threshold semantics). The mass of the
tokens above a draw, computed for the test, is the next round's candidate mass. A row
rejected in every round takes its first maximum, which always passes.

Cost per row: one pass for total / argmax, then per round a scan that stops at the drawn
chunk (about half a pass; the cumulative sum only runs in that chunk) and one full pass for
the count and mass above the draw. Uniforms come from the caller (``[R, ROUNDS]``), so
seeded rows and the torch reference ``filtered_sample_reference`` draw the same tokens.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 2048  # vocab chunk per loop step
NUM_WARPS = 8


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # vocab, strides and rounds are plain runtime ints: a new batch size or vocab never recompiles
    @triton.jit(do_not_specialize=["vocab", "stride_w", "rounds", "stride_u"])
    def _filtered_sample_kernel(
        w_ptr,
        top_k_ptr,
        top_p_ptr,
        min_w_ptr,
        u_ptr,
        out_ptr,
        vocab,
        stride_w,
        rounds,
        stride_u,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        w_row = w_ptr + row * stride_w
        lanes = tl.arange(0, BLOCK)
        none = 2**31 - 1

        # total mass, first argmax (the fallback), last nonzero token (round 0's clamp); per-lane
        # accumulators, reduced once after the loop (no cross-warp reduction per chunk)
        total_v = tl.zeros((BLOCK,), tl.float32)
        best_v = tl.full((BLOCK,), -1.0, tl.float32)
        best_i = tl.zeros((BLOCK,), tl.int32)
        last_v = tl.full((BLOCK,), -1, tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            w = tl.load(w_row + cols, mask=cols < vocab, other=0.0)
            total_v += w
            better = (w > best_v) & (cols < vocab)  # strict: each lane keeps its first maximum
            best_v = tl.where(better, w, best_v)
            best_i = tl.where(better, cols, best_i)
            last_v = tl.where(w > 0.0, cols, last_v)
        total = tl.sum(total_v, 0)
        best_idx = tl.min(tl.where(best_v == tl.max(best_v, 0), best_i, none), 0)
        last = tl.max(last_v, 0)

        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        # off means off: a token lighter than the rounding of the float32 total would
        # otherwise see `mass above == total` and be cut
        p_mass = tl.where(top_p < 1.0, top_p * total, float("inf"))
        min_w = tl.load(min_w_ptr + row)
        pivot = tl.full((), -1.0, tl.float32)
        cand_mass = total
        result = tl.full((), -1, tl.int32)
        r = 0
        while (result < 0) & (r < rounds):
            target = tl.load(u_ptr + row * stride_u + r) * cand_mass
            # inverse CDF over the candidates, chunk by chunk; stops at the chunk holding the draw
            token = tl.full((), -1, tl.int32)
            run = tl.zeros((), tl.float32)
            start = 0
            while (token < 0) & (start < vocab):
                cols = start + lanes
                w = tl.load(w_row + cols, mask=cols < vocab, other=0.0)
                c = tl.where(w > pivot, w, 0.0)
                s = tl.sum(c, 0)
                if run + s > target:  # only this chunk needs the (dearer) cumulative sum
                    cdf = tl.cumsum(c, 0) + run
                    hit = tl.min(tl.where((cdf > target) & (c > 0.0), cols, none), 0)
                    token = tl.where(hit < none, hit, -1)  # none: rounding, go on
                run += s
                start += BLOCK
            token = tl.where(token < 0, last, token)  # u * mass rounded past the candidates' sum
            token = tl.where(token < 0, best_idx, token)  # an all-zero row
            w_t = tl.load(w_row + token)
            # count and mass above the draw: the test, and the next round's candidates
            count_v = tl.zeros((BLOCK,), tl.int32)
            mass_v = tl.zeros((BLOCK,), tl.float32)
            above_v = tl.full((BLOCK,), -1, tl.int32)
            for start2 in range(0, vocab, BLOCK):
                cols = start2 + lanes
                w = tl.load(w_row + cols, mask=cols < vocab, other=0.0)
                gt = w > w_t
                count_v += gt.to(tl.int32)
                mass_v += tl.where(gt, w, 0.0)
                above_v = tl.where(gt, cols, above_v)
            count = tl.sum(count_v, 0)
            mass = tl.sum(mass_v, 0)
            if (count < top_k) & (mass < p_mass) & (w_t >= min_w):
                result = token
            else:
                pivot = w_t
                cand_mass = mass
                last = tl.max(above_v, 0)  # only needed on a rejection
            r += 1
        result = tl.where(result < 0, best_idx, result)  # every round rejected: the maximum passes
        result = tl.minimum(tl.maximum(result, 0), vocab - 1)  # a real id even for a NaN row
        tl.store(out_ptr + row, result.to(tl.int64))

    return _filtered_sample_kernel


def filtered_sample(
    weights: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_w: torch.Tensor,
    uniforms: torch.Tensor,
    block: int = BLOCK,
) -> torch.Tensor:
    """One token per row of ``weights [R, V]`` float32 (>= 0, row max 1) kept by ``top_k [R]``
    int64 (>= V: off), ``top_p [R]`` float32 (1: off), ``min_w [R]`` float32 (0: off), drawn
    with ``uniforms [R, ROUNDS]`` float32 in [0, 1). Returns int64 ``[R]``. No host sync."""
    n, vocab = weights.shape
    assert weights.dtype == uniforms.dtype == top_p.dtype == min_w.dtype == torch.float32
    assert top_k.dtype == torch.int64 and weights.stride(1) == 1 and uniforms.stride(1) == 1
    assert top_k.shape == top_p.shape == min_w.shape == (n,) and uniforms.shape[0] == n
    out = torch.empty(n, dtype=torch.int64, device=weights.device)
    if n:
        _kernel()[(n,)](
            weights,
            top_k,
            top_p,
            min_w,
            uniforms,
            out,
            vocab,
            weights.stride(0),
            uniforms.shape[1],
            uniforms.stride(0),
            BLOCK=block,
            num_warps=NUM_WARPS,
        )
    return out


def filtered_sample_reference(
    weights: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_w: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """The same rounds in torch, one row at a time, sums in float64 (the kernel's float32
    sums differ only where a draw or a test lands within rounding of a boundary)."""
    out = torch.empty(weights.shape[0], dtype=torch.int64)
    for row, (w, k, p, mw, us) in enumerate(
        zip(weights.double().cpu(), top_k.tolist(), top_p.tolist(), min_w.tolist(), uniforms.cpu().tolist())
    ):
        total = w.sum()
        pivot = -1.0
        out[row] = int(w.argmax())  # the first maximum, if every round rejects
        for u in us:
            cand = torch.where(w > pivot, w, 0.0)
            cdf = cand.cumsum(0)
            hits = ((cdf > u * cdf[-1]) & (cand > 0)).nonzero()
            token = int(hits[0]) if len(hits) else int((cand > 0).nonzero()[-1])
            w_t = w[token]
            above = w > w_t
            if int(above.sum()) < k and float(w[above].sum()) < p * float(total) and float(w_t) >= mw:
                out[row] = token
                break
            pivot = float(w_t)
    return out.to(weights.device)
