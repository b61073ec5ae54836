/* Paged decode attention for the CPU: one query token per request, keys/values read
 * straight from the block-structured cache through the block table (no gather copy).
 *
 * Each thread takes an equal share of all the requests' blocks; a request cut between two
 * shares is attended in pieces whose softmax states are merged (below, at the entry point).
 * Per KV block (block_size tokens) and KV head:
 *   scores  VF tokens at a time, each with its own vector accumulator (independent FMA
 *           chains), whose lanes are then summed for all VF tokens together (lane_sums);
 *   softmax online, fp32, per query head;
 *   values  each token's V row is loaded once for several query heads of the group, whose
 *           output rows stay in registers across the block's tokens.
 * Both passes request the next block a line at a time as they go (see Prefetch). The GQA
 * query heads of a KV head reuse its K rows while they are in L1. The bf16 build
 * (-DELEM_BF16, elem.h) scores straight from the stored bf16 K rows with AVX512-BF16's dot
 * product where the CPU has it (and D % 32 == 0); otherwise it widens the block's K rows of
 * a head to fp32 once, into a small L1-resident buffer, and computes from there as the fp32
 * build does (widening in the inner loops would repeat it for every query head of the
 * group). V is always widened that way: its weights, the probabilities, are fp32.
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
/* 16 bf16 values -> 16 floats: one widening move and a shift (GCC splits the generic
 * vector conversion into 256-bit halves). */
static inline vf loadvf(const elem_t *p) {
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
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

static inline void block_values_d64(float *acc, const float *vb, int len, int row_stride, int G, int D,
                                    const float *corr, float s[][MAX_BLOCK], Prefetch *pk, Prefetch *pv) {
    for (int g = 0; g < G; g += HEADS_D64) {
        const int n = G - g < HEADS_D64 ? G - g : HEADS_D64;
        float *a = acc + (int64_t)g * D;
        if (n == 4)
            values_d64_g4(a, vb, len, row_stride, corr + g, s + g, pk, pv);
        else if (n == 3)
            values_d64_g3(a, vb, len, row_stride, corr + g, s + g, pk, pv);
        else if (n == 2)
            values_d64_g2(a, vb, len, row_stride, corr + g, s + g, pk, pv);
        else
            values_d64_g1(a, vb, len, row_stride, corr + g, s + g, pk, pv);
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
 * exactly and adding in fp32, so K is never widened. (V still is: its weights, the
 * probabilities, are fp32.) */
static inline __attribute__((always_inline)) vf dot_bf16(const elem_t *q, const elem_t *k, int D) {
    __m512 a = _mm512_setzero_ps();
    for (int j = 0; j < D; j += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + j), (__m512bh)_mm512_loadu_si512(k + j));
    return (vf)a;
}
DEFINE_BLOCK_SCORES(block_scores_bf16, elem_t, dot_bf16)
#endif

/* Request i's attention over its KV blocks [b0, b1): the unnormalised output rows `acc`
 * [H * D] and each query head's online-softmax state (running max `m`, sum `l`). */
static void attend_blocks(const elem_t *q_i, const elem_t *k_cache, const elem_t *v_cache, const int64_t *table,
                          int64_t seq, int b0, int b1, int H, int Hkv, int D, int block_size, float scale,
                          float *acc, float *m, float *l, int64_t after) {
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
#else
    const float *qi = q_i;
#endif
    float corr[MAX_HEADS], s[MAX_HEADS][MAX_BLOCK] __attribute__((aligned(64)));
    for (int hq = 0; hq < H; hq++) {
        m[hq] = -FLT_MAX;
        l[hq] = 0.f;
    }
    memset(acc, 0, sizeof(float) * H * D);
    for (int b = b0; b < b1; b++) {
        const int64_t start = (int64_t)b * block_size;
        const int64_t base = table[b] * block_size;
        const int len = (int)(seq - start < block_size ? seq - start : block_size);
        /* The next block (`after` past the range's last; negative: none) as Prefetch says: the
         * scores pass requests a line of its K and V per row scored (VF rows per group), the
         * values pass the rest over its calls (one per token and chunk of query heads). */
        const int64_t next = (b + 1 < b1 ? table[b + 1] : after) * block_size * row_stride;
        const int bytes = next >= 0 ? block_size * row_stride * (int)sizeof(elem_t) : 0;
        const int score_lines = Hkv * G * ((len + VF - 1) / VF) * VF;
        const int rest = bytes / 64 - score_lines, value_calls = Hkv * value_chunks(G, D) * len;
        const int step = 64 * (rest > 0 ? (rest + value_calls - 1) / value_calls : 0);
        Prefetch pk = {(const char *)(k_cache + (next >= 0 ? next : 0)), 0, bytes, step};
        Prefetch pv = {(const char *)(v_cache + (next >= 0 ? next : 0)), 0, bytes, step};
        for (int h = 0; h < Hkv; h++) {
            const elem_t *k_rows = k_cache + base * row_stride + (int64_t)h * D;
            const elem_t *v_rows = v_cache + base * row_stride + (int64_t)h * D;
            float(*sh)[MAX_BLOCK] = s + h * G;
#ifdef ELEM_BF16
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
            for (int g = 0; g < G; g++) {
                const int hq = h * G + g;
                float mb = m[hq];
                for (int t = 0; t < len; t++) mb = sh[g][t] > mb ? sh[g][t] : mb;
                float sum = 0.f;
                for (int t = 0; t < len; t++) {
                    sh[g][t] = expf(sh[g][t] - mb);
                    sum += sh[g][t];
                }
                corr[g] = expf(m[hq] - mb);
                l[hq] = l[hq] * corr[g] + sum;
                m[hq] = mb;
            }
            float *ah = acc + (int64_t)h * G * D;
#ifdef ELEM_BF16
            widen_rows(v_rows, len, row_stride, D, kv); /* (K is done with the buffer) */
            block_values(ah, kv, len, D, G, D, corr, sh, &pk, &pv);
#else
            block_values(ah, v_rows, len, row_stride, G, D, corr, sh, &pk, &pv);
#endif
        }
    }
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
 * one share per thread: one core alone reads only a fraction of what all cores read from
 * DRAM, so one request, or a few of unequal lengths, would leave threads idle. A request
 * that straddles a cut is attended in pieces (split-KV, as flash-decoding does on GPUs)
 * whose softmax states are merged at the end: at most chunks - 1 requests. */
static inline int64_t blocks_of(int64_t seq, int block_size) {
    return seq > 0 ? (seq + block_size - 1) / block_size : 0;
}

typedef struct {
    int req, b0, b1; /* request, its blocks [b0, b1) */
    int slot;        /* of a split request: its partial state's index; else -1 */
} Piece;

/* Returns 0, or -1 when out of memory (the caller then takes the torch path). `chunks` <= 0:
 * one per thread. */
int KERNEL(paged_decode_attention)(const elem_t *q, const elem_t *k_cache, const elem_t *v_cache,
                                   const int64_t *block_tables, const int64_t *seq_lens, elem_t *out,
                                   int n, int H, int Hkv, int D, int block_size, int max_blocks,
                                   float scale, int chunks) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += blocks_of(seq_lens[i], block_size);
    if (chunks <= 0) chunks = omp_get_max_threads();
    if (chunks > total) chunks = total > 0 ? (int)total : 1; /* no empty chunks: every piece has a block */
    /* Pieces in order (by chunk, then by request: both ascend together); chunk c owns pieces
     * [first[c], first[c + 1]). A request's pieces are consecutive. */
    Piece *pieces = malloc(sizeof(Piece) * (size_t)(n + chunks));
    int *first = malloc(sizeof(int) * (size_t)(chunks + 1 + n)), *num_pieces = first + chunks + 1;
    if (!pieces || !first) {
        free(pieces);
        free(first);
        return -1;
    }
    int count = 0, i = 0;
    int64_t start_of_i = 0; /* block offset of request i in the end-to-end order */
    for (int r = 0; r < n; r++) num_pieces[r] = 0;
    for (int c = 0; c < chunks; c++) {
        const int64_t lo = total * c / chunks, hi = total * (c + 1) / chunks;
        first[c] = count;
        for (; i < n; i++) {
            const int64_t blocks = blocks_of(seq_lens[i], block_size), end_of_i = start_of_i + blocks;
            if (blocks > 0 && start_of_i < hi) {
                const int64_t b0 = (lo > start_of_i ? lo : start_of_i) - start_of_i;
                const int64_t b1 = (hi < end_of_i ? hi : end_of_i) - start_of_i;
                pieces[count++] = (Piece){i, (int)b0, (int)b1, -1};
                num_pieces[i]++;
            }
            if (end_of_i > hi) break; /* request i goes on in the next chunk */
            start_of_i = end_of_i;
        }
    }
    first[chunks] = count;
    for (int r = 0; r < n; r++) /* no keys: zeros, as the torch path gives */
        if (seq_lens[r] <= 0) memset(out + (int64_t)r * H * D, 0, sizeof(elem_t) * (size_t)H * D);
    /* Partial states of the pieces of split requests: acc [H * D], then m [H], then l [H]. */
    int num_partials = 0;
    for (int k = 0; k < count; k++)
        if (num_pieces[pieces[k].req] > 1) pieces[k].slot = num_partials++;
    const int64_t part_floats = (int64_t)H * D + 2 * H;
    float *partials = num_partials ? malloc(sizeof(float) * (size_t)(num_partials * part_floats)) : NULL;
    if (num_partials && !partials) {
        free(pieces);
        free(first);
        return -1;
    }
#pragma omp parallel for schedule(static, 1)
    for (int c = 0; c < chunks; c++) {
        for (int k = first[c]; k < first[c + 1]; k++) {
            const Piece pc = pieces[k];
            float whole[part_floats] __attribute__((aligned(32))); /* a request in one piece */
            float *state = pc.slot >= 0 ? partials + pc.slot * part_floats : whole;
            /* the block after this piece's last: the next piece's first */
            const int64_t after = k + 1 < first[c + 1]
                                      ? block_tables[(int64_t)pieces[k + 1].req * max_blocks + pieces[k + 1].b0]
                                      : -1;
            attend_blocks(q + (int64_t)pc.req * H * D, k_cache, v_cache, block_tables + (int64_t)pc.req * max_blocks,
                          seq_lens[pc.req], pc.b0, pc.b1, H, Hkv, D, block_size, scale, state, state + H * D,
                          state + H * D + H, after);
            if (pc.slot < 0) write_merged(out + (int64_t)pc.req * H * D, whole, 1, part_floats, H, D);
        }
    }
    /* The split requests, their pieces' states side by side from their first piece's slot. */
    for (int k = 0; k < count; k += num_pieces[pieces[k].req])
        if (pieces[k].slot >= 0)
            write_merged(out + (int64_t)pieces[k].req * H * D, partials + pieces[k].slot * part_floats,
                         num_pieces[pieces[k].req], part_floats, H, D);
    free(partials);
    free(pieces);
    free(first);
    return 0;
}
