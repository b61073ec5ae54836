/* bf16 projections on AMX tiles: out = x @ w.T (+ bias), accumulated in fp32.
 *
 * torch's bf16 GEMM (oneDNN) is fast on large batches but pays a fixed cost per call that
 * dominates a decode step's small ones. Here the weights are packed once into the layout
 * the tile multiply reads (``cpu_kernels.amx_pack``), so a call only walks the tiles:
 *   - each thread owns a contiguous run of 16-column blocks of the output (the weight's
 *     rows), taken two at a time;
 *   - for each pair it runs over x in groups of 32 rows: two 16-row A tiles against the
 *     pair's two B tiles, four 16x16 fp32 accumulator tiles, down the whole K; the pair's
 *     weights come from memory for the first group and from L2 for the others;
 *   - the accumulators go through a small fp32 buffer, get the bias and are rounded to
 *     bf16 (nearest even) straight into ``out``; or, for a gated MLP's fused gate|up
 *     projection packed with each gate block beside its up block (``gated``), become
 *     silu(gate) * up there: the [M, N] projection is never written or read back.
 *
 * Packed weight layout (``w [N, K]`` bf16, N % 16 == 0, K % 32 == 0): tile (nb, kb) of 1 KiB
 * at ((nb * K/32 + kb) * 16) rows of 32 elements, row kp holding, for n = 0..15, the pair
 *   w[16 nb + n][32 kb + 2 kp], w[16 nb + n][32 kb + 2 kp + 1]
 * (the "VNNI" pairing TDPBF16PS multiplies).
 *
 * Other layouts (row-major): x [M, K] with row stride x_stride, bias [N] or NULL,
 * out [M, N] with row stride out_stride. Built for bf16 only; without AMX it exports
 * ``amx_available`` = 0 and the caller keeps torch's GEMM.
 */
#include <stdint.h>
#include <string.h>

#include "elem.h"

#if defined(ELEM_BF16) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <omp.h>

#include "amx_tiles.h"
#include "bf16_avx512.h"
#include "exp_avx512.h"

#define TILE_ROWS 16
#define TILE_K 32 /* bf16 elements of K per tile step (64 bytes a row) */
#define RUNS_PER_THREAD 4

int amx_available(void) { return amx_request_tiles(); }

/* Tiles 0-3: accumulators (A row group a, B column block b at 2a + b); 4-5: A; 6-7: B. */
static void configure(int rows0, int rows1) {
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, TILE_ROWS, TILE_ROWS};
    amx_configure(rows);
}

/* Rows of one accumulator tile (+ bias) rounded into out[:, n0:n0+16]. */
static void store_tile(const float *acc, int rows, const uint16_t *bias, uint16_t *out, int64_t out_stride) {
    const __m512 b = bias ? load16(bias) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) store16(out + r * out_stride, _mm512_add_ps(_mm512_loadu_ps(acc + r * 16), b));
}

/* Gated pairs: out[:, 16 j : 16 j + 16] = silu(gate) * up from the accumulators of a gate
 * block and its up block, each rounded to bf16 first and silu rounded before the product,
 * exactly as the projection's bf16 output and then silu_mul (fused_ops.c) compute it. */
static void store_gated_tile(const float *gate, const float *up, int rows, const uint16_t *bias, uint16_t *out,
                             int64_t out_stride) {
    const __m512 bg = bias ? load16(bias) : _mm512_setzero_ps(), bu = bias ? load16(bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 g = round16(_mm512_add_ps(_mm512_loadu_ps(gate + r * 16), bg));
        const __m512 u = round16(_mm512_add_ps(_mm512_loadu_ps(up + r * 16), bu));
        store16(out + r * out_stride, _mm512_mul_ps(round16(silu512(g)), u));
    }
}

int amx_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                    int64_t out_stride, int M, int N, int K, int gated) {
    if (N % 16 || K % TILE_K || M <= 0 || (gated && N % 32)) return -1;
    const int blocks = N / 16, ksteps = K / TILE_K;
    const int64_t block_elems = (int64_t)ksteps * TILE_ROWS * TILE_K; /* one column block's tiles */
    const int pairs = (blocks + 1) / 2;
    /* Runs of pairs handed out as threads free up, several per thread: a thread the OS
     * preempts (the servicer beside the scheduler on a small machine) leaves its runs to
     * the others instead of holding them all at the end of the call. */
    const int runs = pairs < RUNS_PER_THREAD * omp_get_max_threads() ? pairs : RUNS_PER_THREAD * omp_get_max_threads();
    const char *packed_end = (const char *)(packed + (int64_t)blocks * block_elems);
#pragma omp parallel
    {
        float acc[4][TILE_ROWS * 16];
        int configured0 = -1, configured1 = -1;
        const int groups = (M + 2 * TILE_ROWS - 1) / (2 * TILE_ROWS);
        const int pair_lines = 2 * ksteps * TILE_ROWS; /* 64-byte lines of a pair's tiles */
        const int lines_per_step = (pair_lines + groups * ksteps - 1) / (groups * ksteps);
#pragma omp for schedule(dynamic, 1) nowait
        for (int run = 0; run < runs; run++) {
            const int first = (int)((int64_t)pairs * run / runs) * 2, last = (int)((int64_t)pairs * (run + 1) / runs) * 2;
            for (int nb = first; nb < last && nb < blocks; nb += 2) {
                const int two = nb + 1 < blocks;
                const uint16_t *b0 = packed + nb * block_elems, *b1 = b0 + block_elems;
                /* The next pair's tiles, fetched into L2 while this pair's are multiplied, spread
                 * over all its groups: memory stays busy while a group works from cache. */
                const char *ahead = (const char *)(b0 + 2 * block_elems);
                const char *ahead_end = ahead + (int64_t)pair_lines * 64 < packed_end ? ahead + (int64_t)pair_lines * 64 : packed_end;
                for (int m0 = 0; m0 < M; m0 += 2 * TILE_ROWS) {
                    const int rows0 = M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS;
                    const int rest = M - m0 - TILE_ROWS, rows1 = rest <= 0 ? 0 : rest < TILE_ROWS ? rest : TILE_ROWS;
                    if (rows0 != configured0 || rows1 != configured1) {
                        configure(rows0, rows1);
                        configured0 = rows0, configured1 = rows1;
                    }
                    const uint16_t *a0 = x + m0 * x_stride, *a1 = a0 + TILE_ROWS * x_stride;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int kb = 0; kb < ksteps; kb++) {
                        const int64_t k = (int64_t)kb * TILE_K, tile = (int64_t)kb * TILE_ROWS * TILE_K;
                        _tile_loadd(4, a0 + k, x_stride * 2);
                        for (int l = 0; l < lines_per_step && ahead < ahead_end; l++, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
                        _tile_loadd(6, b0 + tile, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (two) {
                            _tile_loadd(7, b1 + tile, 64);
                            _tile_dpbf16ps(1, 4, 7);
                        }
                        if (rows1) {
                            _tile_loadd(5, a1 + k, x_stride * 2);
                            _tile_dpbf16ps(2, 5, 6);
                            if (two) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, acc[0], 64);
                    if (two) _tile_stored(1, acc[1], 64);
                    if (rows1) {
                        _tile_stored(2, acc[2], 64);
                        if (two) _tile_stored(3, acc[3], 64);
                    }
                    const uint16_t *bb = bias ? bias + nb * 16 : NULL;
                    if (gated) { /* (blocks nb, nb + 1: a gate block and its up block) */
                        uint16_t *o = out + m0 * out_stride + nb / 2 * 16;
                        store_gated_tile(acc[0], acc[1], rows0, bb, o, out_stride);
                        if (rows1) store_gated_tile(acc[2], acc[3], rows1, bb, o + TILE_ROWS * out_stride, out_stride);
                        continue;
                    }
                    uint16_t *o = out + m0 * out_stride + nb * 16;
                    store_tile(acc[0], rows0, bb, o, out_stride);
                    if (two) store_tile(acc[1], rows0, bb ? bb + 16 : NULL, o + 16, out_stride);
                    if (rows1) {
                        store_tile(acc[2], rows1, bb, o + TILE_ROWS * out_stride, out_stride);
                        if (two) store_tile(acc[3], rows1, bb ? bb + 16 : NULL, o + TILE_ROWS * out_stride + 16, out_stride);
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
}

#else
int amx_available(void) { return 0; }

int amx_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                    int64_t out_stride, int M, int N, int K, int gated) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)out_stride, (void)M, (void)N, (void)K, (void)gated;
    return -1;
}
#endif
