/* Paged decode attention for the CPU: one query token per request, keys/values read
 * straight from the block-structured cache through the block table (no gather copy).
 *
 * Blocks that several requests' tables start with (a system prompt the prefix cache shares)
 * are attended first, for all of those requests together (Shared prefixes, below). Then each
 * thread takes an equal share of all the requests' own blocks; a request cut between two
 * shares is attended in pieces whose softmax states are merged (below, at the entry point).
 * Per KV block (block_size tokens) and KV head:
 *   scores  VF tokens at a time, each with its own vector accumulator (independent FMA
 *           chains), whose lanes are then summed for all VF tokens together (lane_sums);
 *   softmax online, fp32, per query head (VF lanes at a time with AVX-512);
 *   values  each token's V row is loaded once for several query heads of the group, whose
 *           output rows stay in registers across the block's tokens.
 * Both passes request the next block a line at a time as they go (see Prefetch). The GQA
 * query heads of a KV head reuse its K rows while they are in L1. The bf16 build
 * (-DELEM_BF16, elem.h) reads the stored bf16 K and V rows directly with AVX512-BF16's dot
 * product where the CPU has it (and D % 32 == 0), scoring on AMX tiles where it has those
 * (block_scores_amx); otherwise it widens the block's rows of a head to fp32 once, into a
 * small L1-resident buffer, and computes from there as the fp32 build does (widening in the
 * inner loops would repeat it for every query head of the group).
 * Vectors are GCC/Clang vector extensions (16 floats with AVX-512, else 8); head_dim 64 and
 * 128 get unrolled copies, other multiples of 8 a generic one. The kernel is bound by the
 * cache misses a core keeps in flight, which is what the scores layout and the prefetch
 * below are shaped by (measurements: docs/performance.md).
 *
 * Layouts (all contiguous; elements fp32, or bf16 in the bf16 build):
 *   q, out        [n, H, D]
 *   k_cache, v_c  [num_blocks * block_size, Hkv, D]
 *   block_tables  [n, max_blocks] int64;  seq_lens [n] int64
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "elem.h"
#ifdef __AVX512F__
#include "exp_avx512.h"
#endif

#define MAX_HEADS 64 /* the wrapper also keeps head_dim <= 256: the per-thread buffers stay small */
#define MAX_BLOCK 64

/* Vectors of VF floats: 16 where the CPU has AVX-512, else 8 (AVX2 registers on x86, NEON
 * pairs on Arm). A head dim that is a multiple of 8 but not of VF leaves an 8-float tail
 * (TAIL8 below). */
#ifdef __AVX512F__
#include <immintrin.h>
typedef float vf __attribute__((vector_size(64), aligned(4)));
#define VF 16
#define LANES_EVEN 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define LANES_ODD 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#else
typedef v8 vf;
#define VF 8
#define LANES_EVEN 0, 2, 4, 6, 8, 10, 12, 14
#define LANES_ODD 1, 3, 5, 7, 9, 11, 13, 15
#endif

/* Lanes of a and b (b's numbered from VF on): __builtin_shufflevector is Clang's and GCC
 * 12's; older GCC has __builtin_shuffle with a mask vector. */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t vf_mask __attribute__((vector_size(VF * 4)));
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vf_mask){__VA_ARGS__})
#endif

/* The pair sums of a's lanes, then b's, side by side in one vector. */
static inline vf fold(vf a, vf b) { return SHUFFLE(a, b, LANES_EVEN) + SHUFFLE(a, b, LANES_ODD); }

/* 8 floats in the low lanes of a vector, zeros above (D % VF == 8 with 16-float vectors). */
static inline vf tail8(v8 x) {
    vf r = {0};
    memcpy(&r, &x, sizeof x);
    return r;
}

/* Lane t: the sum of acc[t]'s lanes (acc is consumed). Folding the vectors in pairs, level by
 * level, sums VF tokens' dot products in VF - 1 folds, where a horizontal sum per token took
 * log2(VF) shuffles and adds each, and leaves the scores in one vector for the softmax. */
static inline vf lane_sums(vf acc[VF]) {
    for (int w = VF; w > 1; w /= 2)
        for (int i = 0; i < w / 2; i++) acc[i] = fold(acc[2 * i], acc[2 * i + 1]);
    return acc[0];
}

/* The next block (of this request, or the thread's next request) is requested while this
 * one is computed: blocks sit anywhere in the cache, so the hardware prefetcher loses the
 * stream at every block edge. The requests go out evenly over both passes, not in bursts: a
 * core keeps only so many misses in flight (its fill buffers), a burst stalls it until they
 * drain, and a pass that requests nothing leaves the memory idle; either way memory and
 * compute stop overlapping. The scores pass requests one line of K and one of V per row it
 * scores (prefetch_line: no branch, so its unrolled loop stays as it is), the values pass the
 * rest, `step` bytes per token (prefetch_some). The hint is 2 (to L2), the best measured
 * (docs/performance.md). A Prefetch walks one range, the next block's K or V. */
typedef struct {
    const char *start;
    int next, end, step; /* byte offsets: the next line to request, the range's end; bytes per call */
} Prefetch;

/* (past the end it requests the range's first line again: a hit, and no branch) */
static inline void prefetch_line(Prefetch *pf) {
    __builtin_prefetch(pf->start + (pf->next < pf->end ? pf->next : 0), 0, 2);
    pf->next += 64;
}

static inline void prefetch_some(Prefetch *pf) {
    for (int b = 0; b < pf->step && pf->next < pf->end; b += 64, pf->next += 64)
        __builtin_prefetch(pf->start + pf->next, 0, 2);
}

#ifdef ELEM_BF16
#if VF == 16
/* (load16: one widening move and a shift; GCC splits the generic vector conversion into
 * 256-bit halves) */
#include "bf16_avx512.h"
#define loadvf(p) ((vf)load16(p))
#else
#define loadvf load8
#endif

/* `len` rows of D elements, `row_stride` apart, into contiguous fp32 rows of `dst`. */
static inline void widen_rows(const elem_t *src, int len, int row_stride, int D, float *dst) {
    for (int t = 0; t < len; t++) {
        const elem_t *row = src + (int64_t)t * row_stride;
        float *out = dst + (int64_t)t * D;
        int j = 0;
        for (; j + VF <= D; j += VF) *(vf *)(out + j) = loadvf(row + j);
        if (j < D) *(v8 *)(out + j) = load8(row + j); /* D % VF == 8 */
    }
}
#endif

/* One row's dot product with a query head, left in VF lanes (lane_sums adds them up):
 * fp32 rows, NV whole vectors (a constant where inlined for the unrolled head dims) and,
 * with `tail`, the last 8 floats (D % VF == 8 with 16-float vectors). */
static inline __attribute__((always_inline)) vf dot_f32(const float *q, const float *k, int NV, int tail, int D) {
    vf a = {0};
    for (int j = 0; j < NV; j++) a += ((const vf *)q)[j] * ((const vf *)k)[j];
    if (tail) a += tail8(*(const v8 *)(q + D - 8) * *(const v8 *)(k + D - 8));
    return a;
}
#define DOT_D64(q, k, D) dot_f32(q, k, 64 / VF, 0, D)
#define DOT_D128(q, k, D) dot_f32(q, k, 128 / VF, 0, D)
#define DOT_ANY(q, k, D) dot_f32(q, k, (D) / VF, (D) % VF, D)

/* One request, one KV head, one block: the scores of the G query heads (rows of `q`, D
 * apart) for the block's `len` rows, VF rows at a time, each row's dot product (DOT) in its
 * own accumulator (independent FMA chains), then summed across lanes by lane_sums (rows of
 * a group past `len` are not read: zero). A line of the next block's K and V per row. */
#define DEFINE_BLOCK_SCORES(NAME, ELEM, DOT)                                                        \
    static inline void NAME(const ELEM *q, const ELEM *kb, int len, int row_stride, int G, int D,   \
                            float scale, float s[][MAX_BLOCK], Prefetch *pk, Prefetch *pv) {        \
        for (int g = 0; g < G; g++) {                                                               \
            const ELEM *qg = q + (int64_t)g * D;                                                    \
            for (int t0 = 0; t0 < len; t0 += VF) {                                                  \
                const int m = len - t0 < VF ? len - t0 : VF;                                        \
                vf acc[VF];                                                                         \
                /* unrolled: the accumulators stay in registers for lane_sums */                  \
                _Pragma("GCC unroll 16") for (int t = 0; t < VF; t++) {                             \
                    prefetch_line(pk);                                                              \
                    prefetch_line(pv);                                                              \
                    acc[t] = t < m ? DOT(qg, kb + (int64_t)(t0 + t) * row_stride, D) : (vf){0};     \
                }                                                                                   \
                *(vf *)(s[g] + t0) = lane_sums(acc) * scale;                                        \
            }                                                                                       \
        }                                                                                           \
    }

/* acc[g] = acc[g] * corr[g] + sum_t p[g][t] * v[t], one query head at a time: the generic head
 * dim (the unrolled ones load each V row once for several heads: DEFINE_VALUES_CHUNK). */
#define DEFINE_BLOCK_VALUES(NAME, NVC, TAIL8)                                                       \
    static inline void NAME(float *acc, const float *vb, int len, int row_stride, int G, int D,     \
                            const float *corr, float s[][MAX_BLOCK], Prefetch *pk, Prefetch *pv) {  \
        for (int g = 0; g < G; g++) {                                                               \
            vf r[(NVC) > 0 ? (NVC) : 1]; /* (D 8 with 16-float vectors: the tail alone) */          \
            v8 r8 = {0};                                                                            \
            float *a = acc + (int64_t)g * D;                                                        \
            for (int j = 0; j < NVC; j++) r[j] = *(vf *)(a + j * VF) * corr[g];                     \
            if (TAIL8) r8 = *(v8 *)(a + D - 8) * corr[g];                                           \
            for (int t = 0; t < len; t++) {                                                         \
                const float *v = vb + (int64_t)t * row_stride;                                      \
                const float p = s[g][t];                                                            \
                prefetch_some(pk);                                                                  \
                prefetch_some(pv);                                                                  \
                for (int j = 0; j < NVC; j++) r[j] += p * *(const vf *)(v + j * VF);                \
                if (TAIL8) r8 += p * *(const v8 *)(v + D - 8);                                      \
            }                                                                                       \
            for (int j = 0; j < NVC; j++) *(vf *)(a + j * VF) = r[j];                               \
            if (TAIL8) *(v8 *)(a + D - 8) = r8;                                                     \
        }                                                                                           \
    }

DEFINE_BLOCK_SCORES(block_scores_d64, float, DOT_D64)
DEFINE_BLOCK_SCORES(block_scores_d128, float, DOT_D128)
DEFINE_BLOCK_SCORES(block_scores_any, float, DOT_ANY)
DEFINE_BLOCK_VALUES(block_values_any, D / VF, D % VF)

/* The values pass for GC query heads together (head dim D = NVC * VF, their acc rows D
 * apart): each token's V row is loaded once for all GC, into GC * NVC independent
 * accumulators that stay in registers (GC is as many as the registers hold). */
#define DEFINE_VALUES_CHUNK(NAME, NVC, GC)                                                          \
    static inline void NAME(float *acc, const float *vb, int len, int row_stride, const float *corr, \
                            float s[][MAX_BLOCK], Prefetch *pk, Prefetch *pv) {                     \
        vf r[GC][NVC];                                                                              \
        for (int g = 0; g < GC; g++)                                                                \
            for (int j = 0; j < NVC; j++) r[g][j] = *(vf *)(acc + (g * NVC + j) * VF) * corr[g];    \
        for (int t = 0; t < len; t++) {                                                             \
            const float *v = vb + (int64_t)t * row_stride;                                          \
            prefetch_some(pk);                                                                      \
            prefetch_some(pv);                                                                      \
            vf x[NVC];                                                                              \
            for (int j = 0; j < NVC; j++) x[j] = *(const vf *)(v + j * VF);                         \
            for (int g = 0; g < GC; g++) {                                                          \
                const float p = s[g][t];                                                            \
                for (int j = 0; j < NVC; j++) r[g][j] += p * x[j];                                  \
            }                                                                                       \
        }                                                                                           \
        for (int g = 0; g < GC; g++)                                                                \
            for (int j = 0; j < NVC; j++) *(vf *)(acc + (g * NVC + j) * VF) = r[g][j];              \
    }

DEFINE_VALUES_CHUNK(values_d64_g1, 64 / VF, 1)
DEFINE_VALUES_CHUNK(values_d64_g2, 64 / VF, 2)
DEFINE_VALUES_CHUNK(values_d64_g3, 64 / VF, 3)
DEFINE_VALUES_CHUNK(values_d64_g4, 64 / VF, 4)
DEFINE_VALUES_CHUNK(values_d128_g1, 128 / VF, 1)
DEFINE_VALUES_CHUNK(values_d128_g2, 128 / VF, 2)

/* Query heads per values pass: as many as the registers hold with 16-float vectors (AVX-512's
 * 32 registers); with 8-float ones a row of 64 already takes half of AVX2's 16. */
#define HEADS_D64 (VF == 16 ? 4 : 1)
#define HEADS_D128 (VF == 16 ? 2 : 1)

/* How many values passes (chunks of query heads) a group of G takes. */
static inline int value_chunks(int G, int D) {
    const int heads = D == 64 ? HEADS_D64 : D == 128 ? HEADS_D128 : 1;
    return (G + heads - 1) / heads;
}

/* NAME##_g<n>(...) for n = 1-4 heads (the copies of a values pass by head count). */
#define BY_HEADS(n, NAME, ...)                                                                      \
    ((n) == 4   ? NAME##_g4(__VA_ARGS__)                                                            \
     : (n) == 3 ? NAME##_g3(__VA_ARGS__)                                                            \
     : (n) == 2 ? NAME##_g2(__VA_ARGS__)                                                            \
                : NAME##_g1(__VA_ARGS__))

static inline void block_values_d64(float *acc, const float *vb, int len, int row_stride, int G, int D,
                                    const float *corr, float s[][MAX_BLOCK], Prefetch *pk, Prefetch *pv) {
    for (int g = 0; g < G; g += HEADS_D64) {
        const int n = G - g < HEADS_D64 ? G - g : HEADS_D64;
        BY_HEADS(n, values_d64, acc + (int64_t)g * D, vb, len, row_stride, corr + g, s + g, pk, pv);
    }
}

static inline void block_values_d128(float *acc, const float *vb, int len, int row_stride, int G, int D,
                                     const float *corr, float s[][MAX_BLOCK], Prefetch *pk, Prefetch *pv) {
    for (int g = 0; g < G; g += HEADS_D128) {
        float *a = acc + (int64_t)g * D;
        if (HEADS_D128 == 1 || G - g == 1)
            values_d128_g1(a, vb, len, row_stride, corr + g, s + g, pk, pv);
        else
            values_d128_g2(a, vb, len, row_stride, corr + g, s + g, pk, pv);
    }
}

static inline void block_scores(const float *q, const float *kb, int len, int row_stride, int G, int D,
                                float scale, float s[][MAX_BLOCK], Prefetch *pk, Prefetch *pv) {
    if (D == 64)
        block_scores_d64(q, kb, len, row_stride, G, D, scale, s, pk, pv);
    else if (D == 128)
        block_scores_d128(q, kb, len, row_stride, G, D, scale, s, pk, pv);
    else
        block_scores_any(q, kb, len, row_stride, G, D, scale, s, pk, pv);
}

static inline void block_values(float *acc, const float *vb, int len, int row_stride, int G, int D, const float *corr,
                                float s[][MAX_BLOCK], Prefetch *pk, Prefetch *pv) {
    if (D == 64)
        block_values_d64(acc, vb, len, row_stride, G, D, corr, s, pk, pv);
    else if (D == 128)
        block_values_d128(acc, vb, len, row_stride, G, D, corr, s, pk, pv);
    else
        block_values_any(acc, vb, len, row_stride, G, D, corr, s, pk, pv);
}

#if defined(ELEM_BF16) && defined(__AVX512BF16__)
#define DPBF16 1
/* The bf16 build where the CPU has AVX512-BF16 and D % 32 == 0: scores straight from the
 * stored bf16 K rows and query, the dot-product instruction multiplying 32 bf16 pairs
 * exactly and adding in fp32, so K is never widened. */
static inline __attribute__((always_inline)) vf dot_bf16(const elem_t *q, const elem_t *k, int D) {
    __m512 a = _mm512_setzero_ps();
    for (int j = 0; j < D; j += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + j), (__m512bh)_mm512_loadu_si512(k + j));
    return (vf)a;
}
DEFINE_BLOCK_SCORES(block_scores_bf16, elem_t, dot_bf16)

/* The values pass of the same build, straight from the stored bf16 V rows: the dot-product
 * instruction takes a pair of tokens per step, so the probabilities are rounded to bf16 (as
 * GPU flash attention rounds them for P.V) and each pair of V rows is interleaved into
 * (row t, row t + 1) element pairs. The interleave works within 128-bit lanes, so an
 * accumulator holds its 32 dims permuted: `lo` dims 0-3, 8-11, 16-19, 24-27, `hi` the
 * others; to_pairs_order and from_pairs_order move an fp32 row of 32 between the orders.
 * GC query heads at a time (NC = D / 32 chunks each), their accumulators in registers. */
static inline void to_pairs_order(const float *a, __m512 *lo, __m512 *hi, float scale) {
    const __m512 n0 = _mm512_loadu_ps(a), n1 = _mm512_loadu_ps(a + 16);
    *lo = _mm512_mul_ps(_mm512_shuffle_f32x4(n0, n1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_set1_ps(scale));
    *hi = _mm512_mul_ps(_mm512_shuffle_f32x4(n0, n1, _MM_SHUFFLE(3, 1, 3, 1)), _mm512_set1_ps(scale));
}

static inline void from_pairs_order(__m512 lo, __m512 hi, float *a) {
    const __m512 t0 = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 t1 = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
    _mm512_storeu_ps(a, _mm512_shuffle_f32x4(t0, t0, _MM_SHUFFLE(3, 1, 2, 0)));
    _mm512_storeu_ps(a + 16, _mm512_shuffle_f32x4(t1, t1, _MM_SHUFFLE(3, 1, 2, 0)));
}

/* Probability pairs (p[t], p[t + 1]) as bf16 pairs, one 32-bit word per pair of tokens. */
static inline void probability_pairs(const float *p, int len, uint32_t *pairs) {
    for (int t = 0; t < len; t += 32) {
        const __m512 a = _mm512_load_ps(p + t), b = t + 16 < len ? _mm512_load_ps(p + t + 16) : _mm512_setzero_ps();
        _mm512_storeu_si512(pairs + t / 2, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

#define DEFINE_VALUES_BF16(NAME, NC, GC)                                                            \
    static inline void NAME(float *acc, const elem_t *vb, int len, int row_stride, const float *corr, \
                            const uint32_t (*pairs)[MAX_BLOCK / 2], Prefetch *pk, Prefetch *pv) {    \
        static const elem_t zeros[32 * (NC)] __attribute__((aligned(64)));                         \
        __m512 r[GC][2 * (NC)];                                                                     \
        for (int g = 0; g < GC; g++)                                                                \
            for (int c = 0; c < NC; c++)                                                            \
                to_pairs_order(acc + (g * (NC) + c) * 32, &r[g][2 * c], &r[g][2 * c + 1], corr[g]); \
        for (int t = 0; t < len; t += 2) {                                                          \
            const elem_t *v0 = vb + (int64_t)t * row_stride, *v1 = t + 1 < len ? v0 + row_stride : zeros; \
            prefetch_some(pk);                                                                      \
            prefetch_some(pv);                                                                      \
            __m512i w[GC];                                                                          \
            for (int g = 0; g < GC; g++) w[g] = _mm512_set1_epi32((int)pairs[g][t / 2]);            \
            for (int c = 0; c < NC; c++) {                                                          \
                const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c); \
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);                          \
                const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);                          \
                for (int g = 0; g < GC; g++) {                                                      \
                    r[g][2 * c] = _mm512_dpbf16_ps(r[g][2 * c], lo, (__m512bh)w[g]);                \
                    r[g][2 * c + 1] = _mm512_dpbf16_ps(r[g][2 * c + 1], hi, (__m512bh)w[g]);        \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int g = 0; g < GC; g++)                                                                \
            for (int c = 0; c < NC; c++) from_pairs_order(r[g][2 * c], r[g][2 * c + 1], acc + (g * (NC) + c) * 32); \
    }

DEFINE_VALUES_BF16(values_bf16_d64_g1, 2, 1)
DEFINE_VALUES_BF16(values_bf16_d64_g2, 2, 2)
DEFINE_VALUES_BF16(values_bf16_d64_g3, 2, 3)
DEFINE_VALUES_BF16(values_bf16_d64_g4, 2, 4)
DEFINE_VALUES_BF16(values_bf16_d128_g1, 4, 1)
DEFINE_VALUES_BF16(values_bf16_d128_g2, 4, 2)
DEFINE_VALUES_BF16(values_bf16_d32_g1, 1, 1)

/* Calls of a block's bf16 values pass per pair of tokens (for the prefetch's share): head dims
 * 64 and 128 take as many heads a call as the fp32 passes, the others a head's 32 dims. */
static inline int bf16_value_calls(int G, int D) { return D == 64 || D == 128 ? value_chunks(G, D) : G * D / 32; }

static void block_values_bf16(float *acc, const elem_t *vb, int len, int row_stride, int G, int D,
                              const float *corr, float s[][MAX_BLOCK], Prefetch *pk, Prefetch *pv) {
    uint32_t pairs[MAX_HEADS][MAX_BLOCK / 2] __attribute__((aligned(64)));
    for (int g = 0; g < G; g++) probability_pairs(s[g], len, pairs[g]);
    const int heads = D == 64 ? HEADS_D64 : D == 128 ? HEADS_D128 : 1; /* (4 and 2: VF is 16 here) */
    for (int g = 0; g < G; g += heads) {
        const int n = G - g < heads ? G - g : heads;
        float *a = acc + (int64_t)g * D;
        if (D == 64) {
            BY_HEADS(n, values_bf16_d64, a, vb, len, row_stride, corr + g, pairs + g, pk, pv);
        } else if (D == 128) {
            if (n == 2)
                values_bf16_d128_g2(a, vb, len, row_stride, corr + g, pairs + g, pk, pv);
            else
                values_bf16_d128_g1(a, vb, len, row_stride, corr + g, pairs + g, pk, pv);
        } else {
            for (int j = 0; j < n; j++) /* other multiples of 32: one chunk of 32 dims at a time */
                for (int c = 0; c < D / 32; c++)
                    values_bf16_d32_g1(a + (int64_t)j * D + 32 * c, vb + 32 * c, len, row_stride, corr + g + j,
                                       pairs + g + j, pk, pv);
        }
    }
}
#endif

#if defined(DPBF16) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
/* On AMX (bf16, blocks of a multiple of 16 rows, D % 32 == 0, G <= 16) the scores pass runs
 * on the tile unit, where AVX512-BF16's dot product, a vector of 32 pairs at a time, and
 * the lane sums after it took most of a block's compute. Per 16 rows of a block:
 *   S^T [16 rows][16 heads] = K [16 rows][D] . Q^T, D / 32 products: K straight from the
 *   cache (rows row_stride apart), Q^T packed once per request in the pairs TDPBF16PS reads
 *   as its B operand (heads past G zero); then each head's column is gathered into its row
 *   of s. Only G of the 16 columns carry a head: the tile unit has so much more throughput
 *   than the vectors that the waste costs less than the vector products did.
 * Tiles: 0 scores, 2 K, 3 Q^T. */
#define AMX_SCORES 1
#include "amx_tiles.h"

/* The G query heads of one KV head (rows of q, D apart) as Q^T pairs: [D / 32][dim pair][head]. */
static void pack_query_pairs(const elem_t *q, int G, int D, uint32_t (*qt)[16][16]) {
    for (int c = 0; c < D / 32; c++)
        for (int kp = 0; kp < 16; kp++)
            for (int j = 0; j < 16; j++)
                qt[c][kp][j] = j < G ? ((const uint32_t *)(q + (int64_t)j * D))[c * 16 + kp] : 0;
}

static inline void block_scores_amx(const uint32_t (*qt)[16][16], const elem_t *kb, int len, int row_stride, int G,
                                    int D, float scale, float s[][MAX_BLOCK], Prefetch *pk, Prefetch *pv) {
    float st[16][16] __attribute__((aligned(64)));
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int t0 = 0; t0 < len; t0 += 16) {
        _tile_zero(0);
        for (int c = 0; c < D / 32; c++) {
            _tile_loadd(2, kb + (int64_t)t0 * row_stride + 32 * c, row_stride * (int)sizeof(elem_t));
            _tile_loadd(3, qt[c], 64);
            _tile_dpbf16ps(0, 2, 3);
        }
        _tile_stored(0, st, 64);
        for (int t = 0; t < 16; t++) {
            prefetch_line(pk);
            prefetch_line(pv);
        }
        for (int g = 0; g < G; g++)
            _mm512_store_ps(s[g] + t0, _mm512_mul_ps(_mm512_i32gather_ps(column, &st[0][g], 4), _mm512_set1_ps(scale)));
    }
}
#endif

/* One query head's online softmax over a block's scores s[0, len): s becomes exp(s - the new
 * max) (with AVX-512, zeros past len up to the next multiple of 16: the bf16 values pass reads
 * whole vectors); the running max m and sum l are updated; returns the rescale of the earlier
 * output. */
static inline float block_softmax(float *s, int len, float *m, float *l) {
#ifdef __AVX512F__
    __m512 mx = _mm512_set1_ps(*m), sum = _mm512_setzero_ps();
    for (int t = 0; t < len; t += 16) {
        const __mmask16 in = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
        mx = _mm512_mask_max_ps(mx, in, mx, _mm512_load_ps(s + t));
    }
    const float mb = _mm512_reduce_max_ps(mx);
    for (int t = 0; t < len; t += 16) {
        const __mmask16 in = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
        const __m512 p = _mm512_maskz_mov_ps(in, exp512(_mm512_sub_ps(_mm512_load_ps(s + t), _mm512_set1_ps(mb))));
        _mm512_store_ps(s + t, p);
        sum = _mm512_add_ps(sum, p);
    }
    const float total = _mm512_reduce_add_ps(sum);
#else
    float mb = *m, total = 0.f;
    for (int t = 0; t < len; t++) mb = s[t] > mb ? s[t] : mb;
    for (int t = 0; t < len; t++) {
        s[t] = expf(s[t] - mb);
        total += s[t];
    }
#endif
    const float corr = expf(*m - mb);
    *l = *l * corr + total;
    *m = mb;
    return corr;
}

/* Request i's attention over its KV blocks [b0, b1): the unnormalised output rows `acc`
 * [H * D] and each query head's online-softmax state (running max `m`, sum `l`). */
static void attend_blocks(const elem_t *q_i, const elem_t *k_cache, const elem_t *v_cache, const int64_t *table,
                          int64_t seq, int b0, int b1, int H, int Hkv, int D, int block_size, float scale,
                          float *acc, float *m, float *l, int64_t after, const float *init) {
    const int G = H / Hkv;
    const int row_stride = Hkv * D;
    /* Per-thread buffers sized by the real shapes (a few KB for common models): a worker
     * thread's stack may be small (OMP_STACKSIZE, musl's 128 KB). */
#ifdef ELEM_BF16
    float qi[H * D] __attribute__((aligned(64)));
    for (int j = 0; j < H * D; j++) qi[j] = ld(q_i[j]);
    float kv[block_size * D] __attribute__((aligned(64))); /* one block of K, then of V */
#ifdef DPBF16
    const int dot_bf16 = D % 32 == 0;
#endif
#ifdef AMX_SCORES
    const int on_tiles = dot_bf16 && block_size % 16 == 0 && G <= 16 && amx_granted();
    uint32_t qt[on_tiles ? Hkv * D / 32 : 1][16][16] __attribute__((aligned(64)));
    if (on_tiles) {
        for (int h = 0; h < Hkv; h++) pack_query_pairs(q_i + (int64_t)h * G * D, G, D, qt + h * D / 32);
        static const int rows[8] = {16, 0, 16, 16};
        amx_configure(rows);
    }
#endif
#else
    const float *qi = q_i;
#endif
    float corr[MAX_HEADS], s[MAX_HEADS][MAX_BLOCK] __attribute__((aligned(64)));
    if (init) { /* the state the request's shared prefix left (attend_prefix) */
        memcpy(acc, init, sizeof(float) * H * D);
        memcpy(m, init + H * D, sizeof(float) * H);
        memcpy(l, init + H * D + H, sizeof(float) * H);
    } else {
        for (int hq = 0; hq < H; hq++) {
            m[hq] = -FLT_MAX;
            l[hq] = 0.f;
        }
        memset(acc, 0, sizeof(float) * H * D);
    }
    for (int b = b0; b < b1; b++) {
        const int64_t start = (int64_t)b * block_size;
        const int64_t base = table[b] * block_size;
        const int len = (int)(seq - start < block_size ? seq - start : block_size);
        /* The next block (`after` past the range's last; negative: none) as Prefetch says: the
         * scores pass requests a line of its K and V per row scored (VF rows per group), the
         * values pass the rest over its calls (one per token and chunk of query heads). */
        const int64_t next = (b + 1 < b1 ? table[b + 1] : after) * block_size * row_stride;
        const int bytes = next >= 0 ? block_size * row_stride * (int)sizeof(elem_t) : 0;
        int score_lines = Hkv * G * ((len + VF - 1) / VF) * VF;
#ifdef AMX_SCORES
        if (on_tiles) score_lines = Hkv * (len + 15) / 16 * 16;
#endif
        int value_calls = Hkv * value_chunks(G, D) * len;
#ifdef DPBF16
        if (dot_bf16) value_calls = Hkv * bf16_value_calls(G, D) * ((len + 1) / 2);
#endif
        const int rest = bytes / 64 - score_lines;
        const int step = 64 * (rest > 0 ? (rest + value_calls - 1) / value_calls : 0);
        Prefetch pk = {(const char *)(k_cache + (next >= 0 ? next : 0)), 0, bytes, step};
        Prefetch pv = {(const char *)(v_cache + (next >= 0 ? next : 0)), 0, bytes, step};
        for (int h = 0; h < Hkv; h++) {
            const elem_t *k_rows = k_cache + base * row_stride + (int64_t)h * D;
            const elem_t *v_rows = v_cache + base * row_stride + (int64_t)h * D;
            float(*sh)[MAX_BLOCK] = s + h * G;
#ifdef ELEM_BF16
#ifdef AMX_SCORES
            if (on_tiles)
                block_scores_amx(qt + h * D / 32, k_rows, len, row_stride, G, D, scale, sh, &pk, &pv);
            else
#endif
#ifdef DPBF16
            if (dot_bf16)
                block_scores_bf16(q_i + (int64_t)h * G * D, k_rows, len, row_stride, G, D, scale, sh, &pk, &pv);
            else
#endif
            {
                widen_rows(k_rows, len, row_stride, D, kv);
                block_scores(qi + (int64_t)h * G * D, kv, len, D, G, D, scale, sh, &pk, &pv);
            }
#else
            block_scores(qi + (int64_t)h * G * D, k_rows, len, row_stride, G, D, scale, sh, &pk, &pv);
#endif
            for (int g = 0; g < G; g++) corr[g] = block_softmax(sh[g], len, &m[h * G + g], &l[h * G + g]);
            float *ah = acc + (int64_t)h * G * D;
#ifdef ELEM_BF16
#ifdef DPBF16
            if (dot_bf16)
                block_values_bf16(ah, v_rows, len, row_stride, G, D, corr, sh, &pk, &pv);
            else
#endif
            {
                widen_rows(v_rows, len, row_stride, D, kv); /* (K is done with the buffer) */
                block_values(ah, kv, len, D, G, D, corr, sh, &pk, &pv);
            }
#else
            block_values(ah, v_rows, len, row_stride, G, D, corr, sh, &pk, &pv);
#endif
        }
    }
#ifdef AMX_SCORES
    if (on_tiles) _tile_release();
#endif
}

/* ---- Shared prefixes (cascade attention) ----------------------------------------------------
 * Requests whose block tables start with the same blocks (a system prompt the prefix cache
 * shares) attend those blocks together, as small matrix products: read once per step for all
 * of them, and each K or V element loaded serves a tile of queries. A tile's queries lie
 * along the vector lanes (transposed once per tile), so the scores of a token for the whole
 * tile are D FMAs of a broadcast K element, for PREFIX_TOKENS tokens at a time; the softmax
 * then runs lane-wise, with no sums across lanes; and the values pass keeps a few queries'
 * output rows in registers across the segment's tokens, each V row loaded once for them. Each
 * query ends with an online-softmax state (acc, m, l) from which attend_blocks goes on over
 * the request's own blocks. */

#define PREFIX_TILE (2 * VF) /* queries per work item */
#define PREFIX_TOKENS 8      /* tokens scored together: 2 * 8 accumulators */
#define PREFIX_SEGMENT 128   /* tokens per softmax update */

typedef struct {
    const int64_t *table;
    int64_t own; /* blocks before its last: the most it may share */
    int row;
} RowKey;

static int by_table(const void *a, const void *b) {
    const RowKey *x = a, *y = b;
    const int64_t len = x->own < y->own ? x->own : y->own;
    for (int64_t i = 0; i < len; i++)
        if (x->table[i] != y->table[i]) return x->table[i] < y->table[i] ? -1 : 1;
    return x->own != y->own ? (x->own < y->own ? -1 : 1) : x->row - y->row;
}

typedef struct {
    int start, count; /* the group's rows: order[start, start + count) */
    int blocks;       /* the leading blocks they all share */
} Group;

/* Groups of two or more requests that share leading blocks, their rows listed in `order`,
 * and `shared[r]` (zeros on entry) set to the blocks row r attends in its group. A request shares only
 * blocks it has a block past (its last, with this step's token, stays its own, so each keeps
 * at least one block for attend_blocks). Sorted by table, requests sharing blocks are
 * neighbours; the runs are cut where that saves the most reads (count - 1 times the shared
 * blocks, summed), so a request sharing little with a group does not shorten its prefix.
 * `work`: 3 * n + 2 ints. */
static int find_groups(const int64_t *tables, const int64_t *seq_lens, int n, int max_blocks, int block_size,
                       RowKey *keys, int *work, int *order, Group *groups, int *shared) {
    int m = 0;
    for (int r = 0; r < n; r++) {
        const int64_t own = seq_lens[r] > 0 ? (seq_lens[r] - 1) / block_size : 0;
        if (own > 0) keys[m++] = (RowKey){tables + (int64_t)r * max_blocks, own, r};
    }
    qsort(keys, (size_t)m, sizeof *keys, by_table);
    int *lcp = work, *best = work + n, *from = work + 2 * n + 1; /* lcp[k]: keys k - 1 and k share */
    for (int k = 1; k < m; k++) {
        const int64_t len = keys[k - 1].own < keys[k].own ? keys[k - 1].own : keys[k].own;
        int64_t b = 0;
        while (b < len && keys[k - 1].table[b] == keys[k].table[b]) b++;
        lcp[k] = (int)b;
    }
    /* best[e]: the most reads saved by groups of keys [0, e); from[e]: where its last group starts */
    best[0] = 0;
    for (int e = 1; e <= m; e++) {
        best[e] = best[e - 1];
        from[e] = e - 1;
        int common = INT32_MAX;
        for (int s = e - 2; s >= 0; s--) {
            common = lcp[s + 1] < common ? lcp[s + 1] : common;
            if (common == 0) break;
            const int saved = best[s] + (e - 1 - s) * common;
            if (saved > best[e]) best[e] = saved, from[e] = s;
        }
    }
    int num_groups = 0;
    for (int e = m; e > 0; e = from[e]) {
        const int s = from[e];
        if (e - s < 2) continue;
        int common = INT32_MAX;
        for (int k = s + 1; k < e; k++) common = lcp[k] < common ? lcp[k] : common;
        for (int k = s; k < e; k++) {
            order[k] = keys[k].row;
            shared[keys[k].row] = common;
        }
        groups[num_groups++] = (Group){s, e - s, common};
    }
    return num_groups;
}

/* acc[j] = acc[j] * corr[j] + sum_t p[t][j] * v[t] for JC queries (head dim NVC * VF): each V
 * row loaded once for all JC, whose output rows stay in registers across the `len` tokens. */
#define DEFINE_PREFIX_VALUES(NAME, NVC, JC)                                                         \
    static inline void NAME(float *const *acc, const float *corr, const float *p,                  \
                            const float *const *v_rows, int len) {                                  \
        vf r[JC][NVC];                                                                              \
        for (int j = 0; j < JC; j++)                                                                \
            for (int c = 0; c < NVC; c++) r[j][c] = ((const vf *)acc[j])[c] * corr[j];              \
        for (int t = 0; t < len; t++) {                                                             \
            vf x[NVC];                                                                              \
            for (int c = 0; c < NVC; c++) x[c] = ((const vf *)v_rows[t])[c];                        \
            for (int j = 0; j < JC; j++) {                                                          \
                const float pj = p[t * PREFIX_TILE + j];                                            \
                for (int c = 0; c < NVC; c++) r[j][c] += pj * x[c];                                 \
            }                                                                                       \
        }                                                                                           \
        for (int j = 0; j < JC; j++)                                                                \
            for (int c = 0; c < NVC; c++) ((vf *)acc[j])[c] = r[j][c];                              \
    }

DEFINE_PREFIX_VALUES(prefix_values_d64_4, 64 / VF, 4)
DEFINE_PREFIX_VALUES(prefix_values_d64_1, 64 / VF, 1)
DEFINE_PREFIX_VALUES(prefix_values_d128_2, 128 / VF, 2)
DEFINE_PREFIX_VALUES(prefix_values_d128_1, 128 / VF, 1)

/* The generic head dim (a multiple of VF), one query at a time. */
static inline void prefix_values_any(float *acc, float corr, const float *p, const float *const *v_rows, int len,
                                     int D) {
    for (int d = 0; d < D; d += VF) {
        vf r = *(const vf *)(acc + d) * corr;
        for (int t = 0; t < len; t++) r += p[t * PREFIX_TILE] * *(const vf *)(v_rows[t] + d);
        *(vf *)(acc + d) = r;
    }
}

/* The values pass of a tile's `nq` queries (p: [len][PREFIX_TILE]). */
static void prefix_values(float *const *acc, const float *corr, const float *p, const float *const *v_rows, int len,
                          int nq, int D) {
    int j = 0;
    if (D == 64)
        for (; j + 4 <= nq; j += 4) prefix_values_d64_4(acc + j, corr + j, p + j, v_rows, len);
    if (D == 128)
        for (; j + 2 <= nq; j += 2) prefix_values_d128_2(acc + j, corr + j, p + j, v_rows, len);
    for (; j < nq; j++) {
        if (D == 64)
            prefix_values_d64_1(acc + j, corr + j, p + j, v_rows, len);
        else if (D == 128)
            prefix_values_d128_1(acc + j, corr + j, p + j, v_rows, len);
        else
            prefix_values_any(acc[j], corr[j], p + j, v_rows, len, D);
    }
}

/* The scores of PREFIX_TOKENS tokens (rows k_rows[0..]) for a tile's queries (qt: [D][PREFIX_TILE],
 * scaled), into p [PREFIX_TOKENS][PREFIX_TILE]. */
static inline void prefix_scores(const float *qt, const float *const *k_rows, int D, float *p) {
    vf s[PREFIX_TOKENS][2] = {{{0}}};
    for (int d = 0; d < D; d++) {
        const vf q0 = *(const vf *)(qt + d * PREFIX_TILE), q1 = *(const vf *)(qt + d * PREFIX_TILE + VF);
        for (int i = 0; i < PREFIX_TOKENS; i++) {
            const float k = k_rows[i][d];
            s[i][0] += k * q0;
            s[i][1] += k * q1;
        }
    }
    for (int i = 0; i < PREFIX_TOKENS; i++) {
        *(vf *)(p + i * PREFIX_TILE) = s[i][0];
        *(vf *)(p + i * PREFIX_TILE + VF) = s[i][1];
    }
}

/* The online softmax of a segment's scores p [T][PREFIX_TILE], lane-wise (the tile's queries
 * side by side): p becomes the probabilities, m and l are updated, corr gets each query's
 * rescale of its earlier output. With AVX-512 the exponentials are 16 lanes a call (GCC
 * otherwise vectorizes them 8 wide). */
#ifdef __AVX512F__
__attribute__((target("prefer-vector-width=512"), noinline))
#endif
static void prefix_softmax(float *p, int T, float *m, float *l, float *corr) {
    float mx[PREFIX_TILE], sum[PREFIX_TILE];
    for (int j = 0; j < PREFIX_TILE; j++) {
        mx[j] = m[j];
        sum[j] = 0.f;
    }
    for (int t = 0; t < T; t++)
        for (int j = 0; j < PREFIX_TILE; j++) mx[j] = p[t * PREFIX_TILE + j] > mx[j] ? p[t * PREFIX_TILE + j] : mx[j];
    for (int t = 0; t < T; t++)
        for (int j = 0; j < PREFIX_TILE; j++) {
            p[t * PREFIX_TILE + j] = expf(p[t * PREFIX_TILE + j] - mx[j]);
            sum[j] += p[t * PREFIX_TILE + j];
        }
    for (int j = 0; j < PREFIX_TILE; j++) {
        corr[j] = expf(m[j] - mx[j]);
        l[j] = l[j] * corr[j] + sum[j];
        m[j] = mx[j];
    }
}

/* Queries [first, first + nq) of a group (nq <= PREFIX_TILE), KV head h, over its shared prefix
 * (`tokens` long, in blocks `table`): query j is query head h * G + j % G of row rows[j / G],
 * so a tile may start or end mid-row. Their states are
 * written into `states` (acc [H * D], m [H], l [H] per row, `part_floats` apart). `buf`: the
 * thread's prefix_buffer_floats(D). */
static void attend_prefix(const elem_t *q, const elem_t *k_cache, const elem_t *v_cache, const int64_t *table,
                          int tokens, const int *rows, int first, int nq, int h, int H, int Hkv, int D,
                          int block_size, float scale, float *states, int64_t part_floats, float *buf) {
    const int G = H / Hkv;
    const int64_t row_stride = (int64_t)Hkv * D;
    float *qt = buf, *p = qt + D * PREFIX_TILE; /* [D][PREFIX_TILE], [PREFIX_SEGMENT][PREFIX_TILE] */
    static const float zeros[256] __attribute__((aligned(64)));
    const float *k_rows[PREFIX_SEGMENT + PREFIX_TOKENS], *v_rows[PREFIX_SEGMENT];
    float *acc[PREFIX_TILE], m[PREFIX_TILE], l[PREFIX_TILE], corr[PREFIX_TILE];
    for (int j = 0; j < PREFIX_TILE; j++) {
        m[j] = -FLT_MAX;
        l[j] = 0.f;
        if (j < nq) {
            const int row = rows[(first + j) / G], hq = h * G + (first + j) % G;
            const elem_t *qj = q + ((int64_t)row * H + hq) * D;
            for (int d = 0; d < D; d++) qt[d * PREFIX_TILE + j] = ld(qj[d]) * scale;
            acc[j] = states + row * part_floats + (int64_t)hq * D;
            memset(acc[j], 0, sizeof(float) * (size_t)D);
        } else {
            for (int d = 0; d < D; d++) qt[d * PREFIX_TILE + j] = 0.f;
        }
    }
    for (int seg = 0; seg < tokens; seg += PREFIX_SEGMENT) {
        const int T = tokens - seg < PREFIX_SEGMENT ? tokens - seg : PREFIX_SEGMENT;
        int64_t b = seg / block_size, o = seg % block_size; /* the token's block and row in it */
        for (int t = 0; t < T; t++, o = o + 1 < block_size ? o + 1 : (b++, 0)) {
            const int64_t at = (table[b] * block_size + o) * row_stride + (int64_t)h * D;
#ifdef ELEM_BF16
            float *kw = p + PREFIX_SEGMENT * PREFIX_TILE + (int64_t)t * D, *vw = kw + PREFIX_SEGMENT * D;
            for (int d = 0; d < D; d++) kw[d] = ld(k_cache[at + d]);
            for (int d = 0; d < D; d++) vw[d] = ld(v_cache[at + d]);
            k_rows[t] = kw;
            v_rows[t] = vw;
#else
            k_rows[t] = k_cache + at;
            v_rows[t] = v_cache + at;
#endif
        }
        for (int t = T; t < T + PREFIX_TOKENS; t++) k_rows[t] = zeros; /* a last partial group scores zeros */
        for (int t0 = 0; t0 < T; t0 += PREFIX_TOKENS) prefix_scores(qt, k_rows + t0, D, p + t0 * PREFIX_TILE);
        prefix_softmax(p, T, m, l, corr);
        prefix_values(acc, corr, p, v_rows, T, nq, D);
    }
    for (int j = 0; j < nq; j++) {
        const int row = rows[(first + j) / G], hq = h * G + (first + j) % G;
        states[row * part_floats + H * D + hq] = m[j];
        states[row * part_floats + H * D + H + hq] = l[j];
    }
}

/* Floats of a thread's buffer for attend_prefix: the tile's queries and scores (and in the
 * bf16 build the segment's K and V rows widened). */
static inline size_t prefix_buffer_floats(int D) {
    return (size_t)(D + PREFIX_SEGMENT) * PREFIX_TILE + (sizeof(elem_t) < sizeof(float) ? 2 * PREFIX_SEGMENT * D : 0);
}

/* A request's output rows from the states of its `parts` pieces (each acc [H * D], m [H],
 * l [H], `part_floats` apart): every piece rescaled to the largest max, then normalised. */
static void write_merged(elem_t *out, const float *states, int parts, int64_t part_floats, int H, int D) {
    for (int hq = 0; hq < H; hq++) {
        float mx = -FLT_MAX, w[parts], sum = 0.f;
        for (int p = 0; p < parts; p++) {
            const float mp = states[p * part_floats + H * D + hq];
            mx = mp > mx ? mp : mx;
        }
        for (int p = 0; p < parts; p++) {
            const float *part = states + p * part_floats;
            w[p] = expf(part[H * D + hq] - mx);
            sum += w[p] * part[H * D + H + hq];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int d = 0; d < D; d++) {
            float x = 0.f;
            for (int p = 0; p < parts; p++) x += w[p] * states[p * part_floats + (int64_t)hq * D + d];
            out[(int64_t)hq * D + d] = st(x * inv);
        }
    }
}

/* The work is cut into `chunks` equal shares of all the requests' blocks taken end to end,
 * SHARES_PER_THREAD per thread by default: one core alone reads only a fraction of what all
 * cores read from DRAM, so one request, or a few of unequal lengths, would leave threads
 * idle. The shares are handed out as threads free up: a thread the OS preempts (the
 * servicer beside the scheduler on a small machine) leaves its later shares to the others
 * instead of holding its whole part of the call. A request that straddles a cut is
 * attended in pieces (split-KV, as flash-decoding does on GPUs) whose softmax states are
 * merged at the end: at most chunks - 1 requests. */
#define SHARES_PER_THREAD 2
static inline int64_t blocks_of(int64_t seq, int block_size) {
    return seq > 0 ? (seq + block_size - 1) / block_size : 0;
}

typedef struct {
    int req, b0, b1; /* request, its blocks [b0, b1) */
    int slot;        /* of a split request: its partial state's index; else -1 */
} Piece;

/* The prefix pass: every group's prefix, per KV head and tile of its queries, into `states`
 * (per row, as attend_blocks keeps them). Returns -1 when out of memory. */
static int attend_prefixes(const elem_t *q, const elem_t *k_cache, const elem_t *v_cache, const int64_t *block_tables,
                           int max_blocks, const Group *groups, int num_groups, const int *order, int H, int Hkv,
                           int D, int block_size, float scale, float *states, int64_t part_floats) {
    const int G = H / Hkv;
    int items = 0;
    for (int g = 0; g < num_groups; g++) items += Hkv * ((groups[g].count * G + PREFIX_TILE - 1) / PREFIX_TILE);
    const size_t buf_floats = prefix_buffer_floats(D);
    float *bufs = aligned_alloc(64, sizeof(float) * buf_floats * (size_t)omp_get_max_threads());
    if (!bufs) return -1;
#pragma omp parallel for schedule(dynamic, 1)
    for (int it = 0; it < items; it++) {
        int g = 0, k = it, per;
        while (k >= (per = Hkv * ((groups[g].count * G + PREFIX_TILE - 1) / PREFIX_TILE))) k -= per, g++;
        const Group gr = groups[g];
        const int h = k % Hkv, j0 = k / Hkv * PREFIX_TILE; /* the tile's first query in the group */
        const int nq = gr.count * G - j0 < PREFIX_TILE ? gr.count * G - j0 : PREFIX_TILE;
        attend_prefix(q, k_cache, v_cache, block_tables + (int64_t)order[gr.start] * max_blocks, gr.blocks * block_size,
                      order + gr.start, j0, nq, h, H, Hkv, D, block_size, scale, states, part_floats,
                      bufs + buf_floats * (size_t)omp_get_thread_num());
    }
    free(bufs);
    return 0;
}

/* Returns 0, or -1 when out of memory (the caller then takes the torch path). `chunks` <= 0:
 * SHARES_PER_THREAD per thread. */
int KERNEL(paged_decode_attention)(const elem_t *q, const elem_t *k_cache, const elem_t *v_cache,
                                   const int64_t *block_tables, const int64_t *seq_lens, elem_t *out,
                                   int n, int H, int Hkv, int D, int block_size, int max_blocks,
                                   float scale, int chunks) {
    const int64_t part_floats = (int64_t)H * D + 2 * H; /* a state: acc [H * D], then m [H], then l [H] */
    if (chunks <= 0) chunks = SHARES_PER_THREAD * omp_get_max_threads();
    int status = -1;
    float *prefix_states = NULL, *partials = NULL;
    RowKey *keys = malloc(sizeof(RowKey) * (size_t)n);
    Group *groups = malloc(sizeof(Group) * (size_t)(n / 2 + 1));
    Piece *pieces = malloc(sizeof(Piece) * (size_t)(n + chunks));
    int *ints = malloc(sizeof(int) * (size_t)(7 * n + 3 + chunks));
    if (!keys || !groups || !pieces || !ints) goto done;
    int *order = ints, *shared = ints + n, *work = ints + 2 * n, *num_pieces = ints + 5 * n + 2;
    int *first = ints + 6 * n + 2; /* chunks + 1 */

    /* The shared prefixes first: their states are where the requests' own blocks start. */
    for (int r = 0; r < n; r++) shared[r] = 0;
    const int num_groups = n >= 2 && D % VF == 0 ? find_groups(block_tables, seq_lens, n, max_blocks, block_size,
                                                               keys, work, order, groups, shared)
                                                 : 0;
    if (num_groups) {
        prefix_states = malloc(sizeof(float) * (size_t)(n * part_floats));
        if (!prefix_states || attend_prefixes(q, k_cache, v_cache, block_tables, max_blocks, groups, num_groups, order,
                                              H, Hkv, D, block_size, scale, prefix_states, part_floats))
            goto done;
    }

    /* Then each request's own blocks, cut into `chunks` equal shares. */
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += blocks_of(seq_lens[i], block_size) - shared[i];
    if (chunks > total) chunks = total > 0 ? (int)total : 1; /* no empty chunks: every piece has a block */
    /* Pieces in order (by chunk, then by request: both ascend together); chunk c owns pieces
     * [first[c], first[c + 1]). A request's pieces are consecutive. */
    int count = 0, i = 0;
    int64_t start_of_i = 0; /* where request i's own blocks start in the end-to-end order */
    for (int r = 0; r < n; r++) num_pieces[r] = 0;
    for (int c = 0; c < chunks; c++) {
        const int64_t lo = total * c / chunks, hi = total * (c + 1) / chunks;
        first[c] = count;
        for (; i < n; i++) {
            const int64_t blocks = blocks_of(seq_lens[i], block_size) - shared[i], end_of_i = start_of_i + blocks;
            if (blocks > 0 && start_of_i < hi) {
                const int64_t b0 = (lo > start_of_i ? lo : start_of_i) - start_of_i;
                const int64_t b1 = (hi < end_of_i ? hi : end_of_i) - start_of_i;
                pieces[count++] = (Piece){i, shared[i] + (int)b0, shared[i] + (int)b1, -1};
                num_pieces[i]++;
            }
            if (end_of_i > hi) break; /* request i goes on in the next chunk */
            start_of_i = end_of_i;
        }
    }
    first[chunks] = count;
    for (int r = 0; r < n; r++) /* no keys: zeros, as the torch path gives */
        if (seq_lens[r] <= 0) memset(out + (int64_t)r * H * D, 0, sizeof(elem_t) * (size_t)H * D);
    /* Partial states of the pieces of split requests. */
    int num_partials = 0;
    for (int k = 0; k < count; k++)
        if (num_pieces[pieces[k].req] > 1) pieces[k].slot = num_partials++;
    partials = num_partials ? malloc(sizeof(float) * (size_t)(num_partials * part_floats)) : NULL;
    if (num_partials && !partials) goto done;
#pragma omp parallel for schedule(dynamic, 1)
    for (int c = 0; c < chunks; c++) {
        for (int k = first[c]; k < first[c + 1]; k++) {
            const Piece pc = pieces[k];
            float whole[part_floats] __attribute__((aligned(32))); /* a request in one piece */
            float *state = pc.slot >= 0 ? partials + pc.slot * part_floats : whole;
            /* the block after this piece's last: the next piece's first */
            const int64_t after = k + 1 < first[c + 1]
                                      ? block_tables[(int64_t)pieces[k + 1].req * max_blocks + pieces[k + 1].b0]
                                      : -1;
            const float *init = shared[pc.req] && pc.b0 == shared[pc.req] ? prefix_states + pc.req * part_floats : NULL;
            attend_blocks(q + (int64_t)pc.req * H * D, k_cache, v_cache, block_tables + (int64_t)pc.req * max_blocks,
                          seq_lens[pc.req], pc.b0, pc.b1, H, Hkv, D, block_size, scale, state, state + H * D,
                          state + H * D + H, after, init);
            if (pc.slot < 0) write_merged(out + (int64_t)pc.req * H * D, whole, 1, part_floats, H, D);
        }
    }
    /* The split requests, their pieces' states side by side from their first piece's slot. */
    for (int k = 0; k < count; k += num_pieces[pieces[k].req])
        if (pieces[k].slot >= 0)
            write_merged(out + (int64_t)pieces[k].req * H * D, partials + pieces[k].slot * part_floats,
                         num_pieces[pieces[k].req], part_floats, H, D);
    status = 0;
done:
    free(partials);
    free(prefix_states);
    free(ints);
    free(pieces);
    free(groups);
    free(keys);
    return status;
}
