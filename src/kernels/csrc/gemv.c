/* Projections of a few rows (decode of one to a few requests): out = x @ w.T (+ bias).
 *
 * At a handful of rows a projection is a pass over its weights: memory-bound, ~2 flops per
 * weight read. Torch's CPU GEMM reads weights from DRAM at ~12 GB/s here (2-core EPYC,
 * SmolLM2 shapes, cold cache), half of what the machine streams; this kernel streams them
 * at 22-32 GB/s: each thread walks its own contiguous run of weight rows (the hardware
 * prefetcher follows it), and each row's dot products use four independent accumulators
 * so the FMA latency chain never waits on itself. Where the CPU has AVX512-BF16, the bf16
 * build multiplies the stored bf16 values directly (gemv_rows_dpbf16).
 *
 * Layouts (row-major, contiguous; elements fp32, or bf16 in the bf16 build: elem.h):
 *   x [M, K], w [N, K], bias [N] or NULL, out [M, N];  M <= MAX_ROWS, K % 32 == 0.
 */
#include <stdint.h>
#include <stdlib.h>

#include "elem.h"

#define MAX_ROWS 4

/* x, widened to fp32, is read by every thread: `xf` holds M rows of K floats. */
static void gemv_rows(const float *xf, const elem_t *w, const elem_t *bias, elem_t *out, int M, int N, int K) {
    const int NV = K / 8;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const elem_t *row = w + (int64_t)n * K;
        v8 acc[MAX_ROWS][4] = {{{0}}};
        for (int j = 0; j < NV; j += 4) {
            const v8 w0 = load8(row + 8 * j), w1 = load8(row + 8 * j + 8);
            const v8 w2 = load8(row + 8 * j + 16), w3 = load8(row + 8 * j + 24);
            for (int m = 0; m < M; m++) {
                const v8 *xv = (const v8 *)(xf + (int64_t)m * K) + j;
                acc[m][0] += w0 * xv[0];
                acc[m][1] += w1 * xv[1];
                acc[m][2] += w2 * xv[2];
                acc[m][3] += w3 * xv[3];
            }
        }
        const float b = bias ? ld(bias[n]) : 0.f;
        for (int m = 0; m < M; m++)
            out[(int64_t)m * N + n] = st(hsum((acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3])) + b);
    }
}

#if defined(ELEM_BF16) && defined(__AVX512BF16__)
#include <immintrin.h>
/* bf16 on CPUs with AVX512-BF16: the dot-product instruction multiplies 32 bf16 pairs
 * exactly and adds them in fp32, straight from the stored weights and x, where widening
 * each weight to fp32 first left the loop short of the memory's pace (Sapphire Rapids
 * class, 2 cores: a pass over SmolLM2's weights 13 -> 20 GB/s). Two accumulators per row
 * of x keep the instruction's latency off the critical path. */
static void gemv_rows_dpbf16(const elem_t *x, const elem_t *w, const elem_t *bias, elem_t *out, int M, int N,
                             int K) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const elem_t *row = w + (int64_t)n * K;
        __m512 acc[MAX_ROWS][2];
        for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        int k = 0;
        for (; k + 64 <= K; k += 64) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k), w1 = (__m512bh)_mm512_loadu_si512(row + k + 32);
            for (int m = 0; m < M; m++) {
                const elem_t *xm = x + (int64_t)m * K + k;
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(xm));
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, (__m512bh)_mm512_loadu_si512(xm + 32));
            }
        }
        if (k < K) { /* K % 32 == 0: one half step left */
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
            for (int m = 0; m < M; m++)
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + k));
        }
        const float b = bias ? ld(bias[n]) : 0.f;
        for (int m = 0; m < M; m++)
            out[(int64_t)m * N + n] = st(_mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) + b);
    }
}
#endif

int KERNEL(few_rows_linear)(const elem_t *x, const elem_t *w, const elem_t *bias, elem_t *out, int M, int N,
                               int K) {
    if (M > MAX_ROWS || K % 32) return -1;
#if defined(ELEM_BF16) && defined(__AVX512BF16__)
    gemv_rows_dpbf16(x, w, bias, out, M, N, K);
    return 0;
#endif
    float *xf = aligned_alloc(32, sizeof(float) * (size_t)M * K);
    if (!xf) return -1;
    for (int64_t i = 0; i < (int64_t)M * K; i++) xf[i] = ld(x[i]);
    gemv_rows(xf, w, bias, out, M, N, K);
    free(xf);
    return 0;
}
