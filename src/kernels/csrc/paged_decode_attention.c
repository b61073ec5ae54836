/* Paged decode attention for the CPU: one query token per request, keys/values read
 * straight from the block-structured cache through the block table (no gather copy).
 *
 * Each thread takes an equal share of all the requests' blocks; a request cut between two
 * shares is attended in pieces whose softmax states are merged (below, at the entry point).
 * Per KV block (block_size tokens) and KV head:
 *   scores  four tokens at a time, each with its own vector accumulator: four independent
 *           FMA chains instead of one dependent chain per token (a single chain leaves the
 *           FMA units waiting on their own latency);
 *   softmax online, fp32, per query head;
 *   values  the output row of a query head stays in registers across the block's tokens
 *           (no load/store of the accumulator per token).
 * The GQA query heads of a KV head reuse its K/V rows while they are in L1; the next
 * block is prefetched, slice by slice, while the current one is computed. The bf16 build
 * (-DELEM_BF16, elem.h) widens each block's K rows of a head, then its V rows, to fp32 once,
 * into a small L1-resident buffer, and computes from there as the fp32 build does: widening in
 * the inner loops would repeat it for every query head of the group (measured at 64
 * requests x 600 tokens: 2.5 ms a layer that way, the same as fp32, against half as many
 * bytes read).
 * Vectors are GCC/Clang vector extensions (8 floats): AVX2 registers on x86, pairs of NEON
 * registers on Arm; head_dim 64 and 128 get unrolled copies, other multiples of 8 a generic one.
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

/* Ask for a slice of the next block while this one is computed. Blocks sit anywhere in the
 * cache, so the hardware prefetcher loses the stream at every block edge. The next block's
 * K and V are requested in 2 * Hkv slices, one before each scores / values pass of the
 * current block, not in one burst: a burst of hundreds of lines fills the miss queue and
 * stalls the core until it drains, so memory and compute never overlap (W64-like decode,
 * 64 x 400 tokens x 30 layers: no prefetch 110 ms, one burst per block ~75-80 ms, sliced
 * ~54 ms, ~22 GB/s of the machine's ~25 GB/s). Hint 2 (to L2) measured best. */
static inline void prefetch_slice(const elem_t *start, int elements) {
    const char *p = (const char *)start;
    for (int64_t b = 0; b < (int64_t)elements * (int64_t)sizeof(elem_t); b += 64) __builtin_prefetch(p + b, 0, 2);
}

#ifdef ELEM_BF16
/* `len` rows of D elements, `row_stride` apart, into contiguous fp32 rows of `dst`. */
static inline void widen_rows(const elem_t *src, int len, int row_stride, int NV, float *dst) {
    for (int t = 0; t < len; t++)
        for (int j = 0; j < NV; j++) ((v8 *)dst)[t * NV + j] = load8(src + (int64_t)t * row_stride + 8 * j);
}
#endif

/* One request, one KV head, one block: scores of the G query heads for `len` tokens. */
static inline void block_scores(const float *q, const float *kb, int len, int row_stride, int G, int NV,
                                float scale, float s[][MAX_BLOCK]) {
    for (int g = 0; g < G; g++) {
        const v8 *qv = (const v8 *)(q + (int64_t)g * NV * 8);
        int t = 0;
        for (; t + 4 <= len; t += 4) {
            const v8 *k0 = (const v8 *)(kb + (int64_t)t * row_stride);
            const v8 *k1 = (const v8 *)(kb + (int64_t)(t + 1) * row_stride);
            const v8 *k2 = (const v8 *)(kb + (int64_t)(t + 2) * row_stride);
            const v8 *k3 = (const v8 *)(kb + (int64_t)(t + 3) * row_stride);
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int j = 0; j < NV; j++) {
                const v8 x = qv[j];
                a0 += x * k0[j];
                a1 += x * k1[j];
                a2 += x * k2[j];
                a3 += x * k3[j];
            }
            s[g][t] = hsum(a0) * scale;
            s[g][t + 1] = hsum(a1) * scale;
            s[g][t + 2] = hsum(a2) * scale;
            s[g][t + 3] = hsum(a3) * scale;
        }
        for (; t < len; t++) {
            const v8 *k0 = (const v8 *)(kb + (int64_t)t * row_stride);
            v8 a0 = {0};
            for (int j = 0; j < NV; j++) a0 += qv[j] * k0[j];
            s[g][t] = hsum(a0) * scale;
        }
    }
}

/* acc[g] = acc[g] * corr[g] + sum_t p[g][t] * v[t], the row kept in registers (NV constant). */
#define DEFINE_BLOCK_VALUES(NAME, NVC)                                                             \
    static inline void NAME(float *acc, const float *vb, int len, int row_stride, int G, int NV,  \
                            const float *corr, float s[][MAX_BLOCK]) {                              \
        (void)NV;                                                                                  \
        for (int g = 0; g < G; g++) {                                                              \
            v8 r[NVC];                                                                             \
            v8 *a = (v8 *)(acc + (int64_t)g * NVC * 8);                                            \
            for (int j = 0; j < NVC; j++) r[j] = a[j] * corr[g];                                   \
            for (int t = 0; t < len; t++) {                                                        \
                const v8 *v = (const v8 *)(vb + (int64_t)t * row_stride);                          \
                const float p = s[g][t];                                                           \
                for (int j = 0; j < NVC; j++) r[j] += p * v[j];                                    \
            }                                                                                      \
            for (int j = 0; j < NVC; j++) a[j] = r[j];                                             \
        }                                                                                          \
    }
DEFINE_BLOCK_VALUES(block_values_d64, 8)
DEFINE_BLOCK_VALUES(block_values_d128, 16)

static inline void block_values_any(float *acc, const float *vb, int len, int row_stride, int G, int NV,
                                    const float *corr, float s[][MAX_BLOCK]) {
    for (int g = 0; g < G; g++) {
        v8 *a = (v8 *)(acc + (int64_t)g * NV * 8);
        for (int j = 0; j < NV; j++) a[j] *= corr[g];
        for (int t = 0; t < len; t++) {
            const v8 *v = (const v8 *)(vb + (int64_t)t * row_stride);
            const float p = s[g][t];
            for (int j = 0; j < NV; j++) a[j] += p * v[j];
        }
    }
}

/* Request i's attention over its KV blocks [b0, b1): the unnormalised output rows `acc`
 * [H * D] and each query head's online-softmax state (running max `m`, sum `l`). */
static void attend_blocks(const elem_t *q_i, const elem_t *k_cache, const elem_t *v_cache, const int64_t *table,
                          int64_t seq, int b0, int b1, int H, int Hkv, int D, int block_size, float scale,
                          float *acc, float *m, float *l) {
    const int G = H / Hkv;
    const int NV = D / 8;
    const int row_stride = Hkv * D;
    /* Per-thread buffers sized by the real shapes (a few KB for common models): a worker
     * thread's stack may be small (OMP_STACKSIZE, musl's 128 KB). */
#ifdef ELEM_BF16
    float qi[H * D] __attribute__((aligned(32)));
    for (int j = 0; j < H * D; j++) qi[j] = ld(q_i[j]);
    float kv[block_size * D] __attribute__((aligned(32))); /* one block of K, then of V */
#else
    const float *qi = q_i;
#endif
    float corr[MAX_HEADS], s[MAX_HEADS][MAX_BLOCK];
    for (int hq = 0; hq < H; hq++) {
        m[hq] = -FLT_MAX;
        l[hq] = 0.f;
    }
    memset(acc, 0, sizeof(float) * H * D);
    for (int b = b0; b < b1; b++) {
        const int64_t start = (int64_t)b * block_size;
        const int64_t base = table[b] * block_size;
        /* next block's offset (-1: none in this range) and the slice of it requested per pass */
        const int64_t next = b + 1 < b1 ? table[b + 1] * block_size * row_stride : -1;
        const int slice = block_size * D; /* = block_size * row_stride / Hkv */
        const int len = (int)(seq - start < block_size ? seq - start : block_size);
        for (int h = 0; h < Hkv; h++) {
#ifdef ELEM_BF16
            const float *kb = kv, *vb = kv;
            const int kv_stride = D;
            widen_rows(k_cache + base * row_stride + (int64_t)h * D, len, row_stride, NV, kv);
#else
            const float *kb = k_cache + base * row_stride + (int64_t)h * D;
            const float *vb = v_cache + base * row_stride + (int64_t)h * D;
            const int kv_stride = row_stride;
#endif
            float(*sh)[MAX_BLOCK] = s + h * G;
            if (next >= 0) prefetch_slice(k_cache + next + (int64_t)h * slice, slice);
            block_scores(qi + (int64_t)h * G * D, kb, len, kv_stride, G, NV, scale, sh);
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
            if (next >= 0) prefetch_slice(v_cache + next + (int64_t)h * slice, slice);
#ifdef ELEM_BF16
            widen_rows(v_cache + base * row_stride + (int64_t)h * D, len, row_stride, NV, kv); /* K is done */
#endif
            if (D == 64)
                block_values_d64(ah, vb, len, kv_stride, G, NV, corr, sh);
            else if (D == 128)
                block_values_d128(ah, vb, len, kv_stride, G, NV, corr, sh);
            else
                block_values_any(ah, vb, len, kv_stride, G, NV, corr, sh);
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
 * one share per thread: a request is one core's read bandwidth (~7 GB/s of the ~13 that two
 * cores get from DRAM here), so one request, or a few of unequal lengths, would leave threads
 * idle. A request that straddles a cut is attended in pieces (split-KV, as flash-decoding
 * does on GPUs) whose softmax states are merged at the end: at most chunks - 1 requests. */
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
            attend_blocks(q + (int64_t)pc.req * H * D, k_cache, v_cache, block_tables + (int64_t)pc.req * max_blocks,
                          seq_lens[pc.req], pc.b0, pc.b1, H, Hkv, D, block_size, scale, state, state + H * D,
                          state + H * D + H);
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
