/* Projections of a few rows (decode of one to a few dozen requests): out = x @ w.T (+ bias).
 *
 * At a handful of rows a projection is a pass over its weights: memory-bound, ~2 flops per
 * weight read, so the kernel is built to keep the memory busy:
 *   - each thread walks its own contiguous run of weight rows, four rows at a time, one
 *     accumulator per (row of x, weight row): four independent FMA chains per row of x, so
 *     the FMA latency never holds a load back;
 *   - it prefetches the block of rows PREFETCH_BLOCKS ahead. The projections are small
 *     (0.2-2 MB) and a thread's run shorter still, so the hardware prefetcher alone spends
 *     much of each run ramping up (measurements: docs/performance.md).
 * More rows of x (a decode batch of a few requests, or one with speculative drafts) go
 * GROUP at a time against each block of weight rows: the block comes from memory for the
 * first group and from L1 for the others, so the weights are still read once. From ~8 rows
 * the loop is compute-bound, hence 16-float vectors for fp32 where AVX-512 has them.
 * Where the CPU has AVX512-BF16, the bf16 build multiplies the stored bf16 values directly
 * (one dot-product instruction per 32 pairs) instead of widening each weight to fp32 first.
 *
 * Layouts (row-major, contiguous; elements fp32, or bf16 in the bf16 build: elem.h):
 *   x [M, K], w [N, K], bias [N] or NULL, out [M, N];  M <= MAX_ROWS, K % 32 == 0.
 */
#include <stdint.h>
#include <stdlib.h>

#include "elem.h"

#define MAX_ROWS 32       /* rows of x (cpu_kernels.GEMV_MAX_ROWS) */
#define GROUP 4           /* rows of x computed together (their accumulators fill the registers) */
#define BLOCK 4           /* weight rows read together */
#define PREFETCH_BLOCKS 1 /* how far ahead the prefetch runs, in blocks */
#define LINE_ELEMS (64 / (int)sizeof(elem_t))

static inline void prefetch_block(const elem_t *rows, int K, int k) {
    const elem_t *ahead = rows + (int64_t)PREFETCH_BLOCKS * BLOCK * K + k;
    for (int j = 0; j < BLOCK; j++)
        for (int e = 0; e < 32; e += LINE_ELEMS) __builtin_prefetch(ahead + (int64_t)j * K + e);
}

static inline void store_row(elem_t *out, const elem_t *bias, int M, int N, int n, const float *sums) {
    const float b = bias ? ld(bias[n]) : 0.f;
    for (int m = 0; m < M; m++) out[(int64_t)m * N + n] = st(sums[m] + b);
}

#if !defined(ELEM_BF16) && defined(__AVX512F__)
/* fp32 weights on AVX-512: 16-float vectors (at 8-16 rows of x the loop is compute-bound). */
typedef float vw __attribute__((vector_size(64), aligned(4)));
#define VW 16
static inline vw loadw(const elem_t *p) { return *(const vw *)p; }
static inline float hsumw(vw x) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
}
#else
typedef v8 vw;
#define VW 8
#define loadw load8
#define hsumw hsum
#endif

/* NR (BLOCK, or 1 for the tail) weight rows from row n, against MG rows of x from row m0;
 * x widened to fp32 in `xf` [M, K]. */
static inline __attribute__((always_inline)) void rows_fp32(const float *xf, const elem_t *w, const elem_t *bias,
                                                            elem_t *out, int N, int K, int n, const int NR, int m0,
                                                            int MG) {
    const elem_t *rows = w + (int64_t)n * K;
    vw acc[GROUP][BLOCK] = {{{0}}};
    for (int k = 0; k < K; k += 32) {
        if (NR == BLOCK && m0 == 0) prefetch_block(rows, K, k);
        for (int s = k; s < k + 32; s += VW) {
            vw wv[BLOCK];
            for (int j = 0; j < NR; j++) wv[j] = loadw(rows + (int64_t)j * K + s);
            for (int m = 0; m < MG; m++) {
                const vw xv = *(const vw *)(xf + (int64_t)(m0 + m) * K + s);
                for (int j = 0; j < NR; j++) acc[m][j] += wv[j] * xv;
            }
        }
    }
    for (int j = 0; j < NR; j++) {
        float sums[GROUP];
        for (int m = 0; m < MG; m++) sums[m] = hsumw(acc[m][j]);
        store_row(out + (int64_t)m0 * N, bias, MG, N, n + j, sums);
    }
}

#if defined(ELEM_BF16) && defined(__AVX512BF16__)
#include <immintrin.h>
/* bf16 on CPUs with AVX512-BF16: the dot-product instruction multiplies 32 bf16 pairs
 * exactly and adds them in fp32, straight from the stored weights and x; widening each
 * weight to fp32 first left the loop short of the memory's pace. */
static inline __attribute__((always_inline)) void rows_dpbf16(const elem_t *x, const elem_t *w, const elem_t *bias,
                                                              elem_t *out, int N, int K, int n, const int NR, int m0,
                                                              int MG) {
    const elem_t *rows = w + (int64_t)n * K;
    __m512 acc[GROUP][BLOCK];
    for (int m = 0; m < MG; m++)
        for (int j = 0; j < NR; j++) acc[m][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        if (NR == BLOCK && m0 == 0) prefetch_block(rows, K, k);
        __m512bh wv[BLOCK];
        for (int j = 0; j < NR; j++) wv[j] = (__m512bh)_mm512_loadu_si512(rows + (int64_t)j * K + k);
        for (int m = 0; m < MG; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (int64_t)(m0 + m) * K + k);
            for (int j = 0; j < NR; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xv);
        }
    }
    for (int j = 0; j < NR; j++) {
        float sums[GROUP];
        for (int m = 0; m < MG; m++) sums[m] = _mm512_reduce_add_ps(acc[m][j]);
        store_row(out + (int64_t)m0 * N, bias, MG, N, n + j, sums);
    }
}
#define DPBF16 1
#endif

/* x as the build's dot products read it: the stored bf16 values (DPBF16), else fp32. The
 * rows of x go GROUP at a time (the accumulators a group keeps in registers); the weight
 * block, read from memory for the first group, is in L1 for the others. */
static inline __attribute__((always_inline)) void rows(const void *xs, const elem_t *w, const elem_t *bias,
                                                       elem_t *out, int M, int N, int K, int n, const int NR) {
    for (int m0 = 0; m0 < M; m0 += GROUP) {
        const int MG = M - m0 < GROUP ? M - m0 : GROUP;
#ifdef DPBF16
        rows_dpbf16((const elem_t *)xs, w, bias, out, N, K, n, NR, m0, MG);
#else
        rows_fp32((const float *)xs, w, bias, out, N, K, n, NR, m0, MG);
#endif
    }
}

/* Whole blocks of rows in parallel (contiguous runs per thread), then the N % BLOCK tail. */
static void gemv(const void *xs, const elem_t *w, const elem_t *bias, elem_t *out, int M, int N, int K) {
    const int blocks = N / BLOCK;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; b++) rows(xs, w, bias, out, M, N, K, b * BLOCK, BLOCK);
    for (int n = blocks * BLOCK; n < N; n++) rows(xs, w, bias, out, M, N, K, n, 1);
}

int KERNEL(few_rows_linear)(const elem_t *x, const elem_t *w, const elem_t *bias, elem_t *out, int M, int N,
                               int K) {
    if (M > MAX_ROWS || K % 32) return -1;
#ifdef DPBF16
    gemv(x, w, bias, out, M, N, K);
    return 0;
#else
    float *xf = aligned_alloc(32, sizeof(float) * (size_t)M * K);
    if (!xf) return -1;
    for (int64_t i = 0; i < (int64_t)M * K; i++) xf[i] = ld(x[i]);
    gemv(xf, w, bias, out, M, N, K);
    free(xf);
    return 0;
#endif
}
