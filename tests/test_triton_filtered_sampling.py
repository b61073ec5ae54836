"""The sync-free top-k / top-p / min-p sampler (src/kernels/triton_filtered_sampling.py).

Runs on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is
imported). The interpreter costs ~30-100 ms per program (each nested ``tl.sum`` / ``tl.max``
re-patches the language), so the Triton path sees a few hundred rows in all: it must pick
the reference's token on the same uniforms, and the reference (fast) carries the many-draw
distribution test against the kept set computed by sort-and-cut. Its compile for sm_90 is
checked with the other kernels' (tests/test_triton_kernels.py).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest
import torch

pytest.importorskip("triton")

from kernels.triton_filtered_sampling import filtered_sample, filtered_sample_reference  # noqa: E402

ROUNDS = 32
U_MAX = 1.0 - 2.0**-24  # the largest float32 below 1


def _weights(logits: torch.Tensor) -> torch.Tensor:
    return (logits - logits.amax(dim=-1, keepdim=True)).exp()


def _params(rows: list[tuple], vocab: int):
    """(top_k or None, top_p, min_w) per row -> the kernel's tensors (off: k = vocab)."""
    k = torch.tensor([vocab if r[0] is None else r[0] for r in rows], dtype=torch.int64)
    p = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    m = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    return k, p, m


# off, each filter alone, and combinations
MIXED = [
    (None, 1.0, 0.0),
    (5, 1.0, 0.0),
    (1, 1.0, 0.0),
    (None, 0.5, 0.0),
    (None, 0.9, 0.0),
    (None, 1.0, 0.05),
    (40, 0.9, 0.0),
    (10, 0.5, 0.01),
    (None, 0.9, 0.2),
    (3, 0.95, 0.1),
    (200, 0.3, 0.0),
    (None, 1.0, 0.5),
]


@pytest.mark.parametrize(
    "vocab,block,scale,seed",
    [(300, 128, 4.0, 0), (1500, 512, 0.3, 1), (3000, 1024, 1.0, 3), (2500, 2048, 2.0, 2)],
    ids=["peaked-v300", "flat-v1500", "v3000", "v2500-default-block"],
)
def test_matches_reference(vocab, block, scale, seed):
    """Same uniforms, same tokens: chunked scans (V not a multiple of the block), masked zeros."""
    g = torch.Generator().manual_seed(seed)
    w = _weights(torch.randn(len(MIXED), vocab, generator=g) * scale)
    w[torch.rand(w.shape, generator=g) < 0.2] = 0.0  # masked tokens (grammar, banned)
    w[:, 0] = 1.0  # keep each row's maximum at 1 after the masking
    k, p, m = _params(MIXED, vocab)
    u = torch.rand(len(MIXED), ROUNDS, generator=g)
    got = filtered_sample(w, k, p, m, u, block=block)
    want = filtered_sample_reference(w, k, p, m, u)
    assert got.dtype == torch.int64 and got.shape == (len(MIXED),)
    # float32 (kernel) vs float64 (reference) sums only differ within rounding of a boundary:
    # with random weights that does not happen in these cases, so exact equality holds
    assert torch.equal(got, want), (got, want)
    assert bool((w.gather(1, got.unsqueeze(1)) > 0).all())


def _kept_distribution(w: torch.Tensor, k: int, p: float, min_w: float) -> torch.Tensor:
    """Sort-and-cut: the longest sorted prefix of tokens with fewer than k before them, less
    than p of the mass before them and a weight >= min_w; ties with its last token stay."""
    s = w.double().sort(descending=True).values
    before = torch.cat([torch.zeros(1, dtype=torch.float64), s.cumsum(0)[:-1]])
    ok = (torch.arange(len(s)) < k) & (before < p * s.sum()) & (s >= min_w)
    n = int(ok.long().cumprod(0).sum())
    kept = w.double() * (w.double() >= s[n - 1])
    return kept / kept.sum()


# a fixed row with ties (the 0.5s around a k cut) and a masked token
DIST_ROW = torch.tensor([0.3, 1.0, 0.5, 0.05, 0.5, 0.0, 0.8, 0.15, 0.5, 0.02])
DIST_PARAMS = [
    (3, 1.0, 0.0),
    (2, 1.0, 0.0),
    (10, 0.6, 0.0),
    (10, 0.75, 0.0),
    (10, 1.0, 0.2),
    (6, 0.9, 0.04),
    (10, 1.0, 0.0),
]


@pytest.mark.parametrize("k,p,min_w", DIST_PARAMS)
def test_distribution_matches_kept_set(k, p, min_w):
    """Many draws (fresh uniforms each) against the exact renormalised kept set; the first
    draws also through the kernel, which must pick the same tokens."""
    n = 6000
    g = torch.Generator().manual_seed(100 + DIST_PARAMS.index((k, p, min_w)))
    w = DIST_ROW.expand(n, -1).contiguous()
    kk, pp, mm = _params([(k, p, min_w)] * n, len(DIST_ROW))
    u = torch.rand(n, ROUNDS, generator=g)
    tokens = filtered_sample_reference(w, kk, pp, mm, u)
    want = _kept_distribution(DIST_ROW, k, p, min_w)
    counts = torch.bincount(tokens, minlength=len(DIST_ROW)).double()
    assert bool((counts[want == 0] == 0).all()), counts  # dropped tokens never drawn
    expected = want * n
    chi2 = float((((counts - expected) ** 2)[want > 0] / expected[want > 0]).sum())
    assert chi2 < 35.0, (chi2, counts / n, want)  # df <= 8: p-value below 1e-4; seeds fixed
    m = 16
    assert torch.equal(filtered_sample(w[:m], kk[:m], pp[:m], mm[:m], u[:m], block=16), tokens[:m])


def _run(w, k, p, m, u, block=256):
    got = filtered_sample(w, k, p, m, u, block=block)
    assert torch.equal(got, filtered_sample_reference(w, k, p, m, u))
    return got


def test_top_p_one_cuts_nothing():
    """top_p 1 is off: a token lighter than the float32 total's rounding (its "mass above"
    equals the total) is still drawn when the uniform lands on it, as the torch path does."""
    vocab = 3000
    w = torch.ones(2, vocab)
    w[:, 0] = 1e-5  # first in token order: u = 1e-9 lands on it
    assert w[0, 1:].sum() == w[0].sum()  # (float32)
    got = _run(w, *_params([(None, 1.0, 0.0), (None, 1.0, 0.0)], vocab), torch.full((2, ROUNDS), 1e-9), block=1024)
    assert got.tolist() == [0, 0]


def test_ties_at_the_kth_weight_stay():
    w = torch.tensor([0.5, 1.0, 0.5, 0.5, 0.2, 0.5, 0.1])  # k = 2: 1.0 and every 0.5 stay
    n = 24
    u = ((torch.arange(n) + 0.5) / n).unsqueeze(1).expand(n, ROUNDS).contiguous()  # a grid: hits every interval
    got = _run(w.expand(n, -1).contiguous(), *_params([(2, 1.0, 0.0)] * n, 7), u)
    assert set(got.tolist()) == {0, 1, 2, 3, 5}


def test_top_k_one_is_the_argmax():
    g = torch.Generator().manual_seed(5)
    w = _weights(torch.randn(6, 700, generator=g))
    got = _run(w, *_params([(1, 1.0, 0.0), (1, 0.9, 0.0), (1, 1.0, 0.3)] * 2, 700), torch.rand(6, ROUNDS, generator=g))
    assert torch.equal(got, w.argmax(dim=1))


def test_zero_weights_never_drawn():
    """u just below 1 lands past the last nonzero weight: clamped to the last candidate."""
    g = torch.Generator().manual_seed(6)
    w = _weights(torch.randn(4, 600, generator=g))
    w[w < 0.5] = 0.0
    w[:, -50:] = 0.0
    w[3] = 0.0
    w[3, 17] = 1.0  # a lone nonzero
    u = torch.full((4, ROUNDS), U_MAX)
    got = _run(w, *_params([(None, 1.0, 0.0), (5, 1.0, 0.0), (None, 0.5, 0.0), (None, 1.0, 0.0)], 600), u)
    assert bool((w.gather(1, got.unsqueeze(1)) > 0).all()) and got[3] == 17


def test_every_round_rejected_takes_the_argmax():
    """u = 0.999 draws the last candidate, here the least likely: each round peels one token
    off and rejects it (top_p tiny); after 32 rounds the row takes its first maximum."""
    w = (0.9 - 0.001 * torch.arange(400.0)).expand(2, -1).contiguous()  # the last candidate is the least likely
    w[0, 3] = 1.0
    w[1, 10] = w[1, 200] = 1.0  # tied maxima: the first
    got = _run(w, *_params([(None, 1e-6, 0.0), (300, 1e-6, 0.0)], 400), torch.full((2, ROUNDS), 0.999))
    assert got.tolist() == [3, 10]


def test_a_nan_row_still_gives_a_real_token_id():
    """A broken row (all NaN, e.g. uninitialised logits) must not index past the vocabulary:
    the next step would embed that id."""
    w = torch.full((2, 320), float("nan"))
    w[1] = float("inf")
    got = filtered_sample(w, *_params([(None, 1.0, 0.0), (None, 0.9, 0.0)], 320), torch.rand(2, ROUNDS))
    assert all(0 <= t < 320 for t in got.tolist()), got


def test_zero_and_one_rows():
    empty = filtered_sample(torch.empty(0, 50), *_params([], 50), torch.empty(0, ROUNDS))
    assert empty.shape == (0,) and empty.dtype == torch.int64
    g = torch.Generator().manual_seed(8)
    big = _weights(torch.randn(5, 333, generator=g) * 3)
    _run(big[2:3], *_params([(7, 0.8, 0.01)], 333), torch.rand(1, ROUNDS, generator=g))
    _run(big[:1], *_params([(7, 0.8, 0.01)], 333), torch.rand(1, 1, generator=g))  # a single round


def test_specialisation_key_ignores_batch_and_vocab():
    """One compile serves every batch size: the launcher's key (as tests/test_triton_specialization.py
    computes it) is the same whatever R, V or ROUNDS."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    from triton.backends.compiler import BaseBackend

    from kernels import triton_filtered_sampling as tf

    kernel = tf._kernel()
    unspecialised = set(kernel.kwargs.get("do_not_specialize") or ())

    def key(rows, vocab, rounds):
        w, u = torch.rand(rows, vocab), torch.rand(rows, rounds)
        k, p, m = _params([(None, 1.0, 0.0)] * rows, vocab)
        args = (w, k, p, m, u, torch.empty(rows, dtype=torch.int64), vocab, w.stride(0), rounds, u.stride(0))
        return tuple(
            libtriton.native_specialize_impl(BaseBackend, a, False, n not in unspecialised, True)
            for n, a in zip(kernel.arg_names, args)
        )

    assert key(1, 151936, 32) == key(17, 151936, 32) == key(256, 32000, 1) == key(3, 1000, 7)
