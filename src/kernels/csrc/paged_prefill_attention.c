/* Paged prefill attention for the CPU: the prefill chunks of a step, each query row attending
 * to its request's keys 0 .. its own position (causal, bottom-right aligned: a chunk after a
 * cached prefix sees the whole prefix), keys and values read straight from the
 * block-structured cache through the block table (no gather copy, no mask tensor).
 *
 * Work is split into tiles: VF query rows of one request's chunk and one KV head (its G query
 * heads side by side: row r is position r / G, head r % G), VF being the floats a vector
 * holds. A tile's queries lie along the vector lanes, so attention is small matrix products
 * over KC keys at a time:
 *   scores   S[t] = sum_d K[t][d] * Qt[d]   (Qt: the tile's queries transposed once, K
 *            elements broadcast; several keys' accumulators as independent FMA chains);
 *   softmax  online and lane-wise: each lane is one query, so the max and the sum never
 *            cross lanes (no horizontal reductions);
 *   values   Ot[d] += sum_t V[t][d] * P[t], the output transposed as well, a slice of head
 *            dims at a time in registers.
 * Keys past a lane's position are masked only in the chunks that reach the diagonal; chunks
 * past the tile's last position are never read. The tiles of a step are shared among the
 * threads dynamically (later rows of a chunk see more keys). Arithmetic is fp32 (elem.h widens
 * bf16 on load); the bf16 build on a CPU with AMX runs the two products on tiles instead
 * (attend_tile_amx).
 *
 * Layouts (all contiguous; elements fp32, or bf16 in the bf16 build):
 *   q, out        [T, H, D] (only the segments' rows are written)
 *   k_cache, v_c  [num_blocks * block_size, Hkv, D]
 *   tables        [num_segments, table_width] int64
 *   segments      [num_segments, 3] int64: first query row, query rows, keys (seq_len)
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "elem.h"

#ifdef __AVX512F__
#include "exp_avx512.h"
typedef float vf __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64)));
#define VF 16
#else
typedef v8 vf;
typedef int32_t vi __attribute__((vector_size(32)));
#define VF 8
#endif

#define KC 16          /* keys per chunk */
#define KEYS_AT_ONCE 8 /* scores pass: keys whose accumulators are live together */
#define DIMS_AT_ONCE 16 /* values pass: head dims whose accumulators are live together */
#define MAX_D 256

typedef struct {
    const elem_t *q, *k_cache, *v_cache;
    elem_t *out;
    const int64_t *table;
    int64_t q_start, q_len, seq_len;
    int H, Hkv, D, block_size;
    float scale;
} Segment;

/* The K and V rows of KV head h at positions [k0, k0 + n): one division per chunk, not per key. */
static inline void chunk_rows(const Segment *s, int64_t k0, int n, int h, const elem_t **kr, const elem_t **vr) {
    const int64_t bs = s->block_size;
    int64_t b = k0 / bs, off = k0 % bs;
    for (int t = 0; t < n; t++) {
        const int64_t at = ((s->table[b] * bs + off) * s->Hkv + h) * s->D;
        kr[t] = s->k_cache + at;
        vr[t] = s->v_cache + at;
        if (++off == bs) {
            off = 0;
            b++;
        }
    }
}

/* The chunk's K and V rows as floats: the cache's own rows in the fp32 build; in the bf16
 * build widened once into kbuf and vbuf (n rows of D), so that the loops below broadcast
 * floats straight from memory rather than widen an element per multiply-add. */
static inline __attribute__((always_inline)) void chunk_floats(const elem_t **kc, const elem_t **vc, int n, int D,
                                                               float *kbuf, float *vbuf, const float **kr,
                                                               const float **vr) {
#ifdef ELEM_BF16
    for (int t = 0; t < n; t++) {
        for (int d = 0; d < D; d++) kbuf[t * D + d] = ld(kc[t][d]);
        for (int d = 0; d < D; d++) vbuf[t * D + d] = ld(vc[t][d]);
        kr[t] = kbuf + t * D;
        vr[t] = vbuf + t * D;
    }
#else
    (void)D, (void)kbuf, (void)vbuf;
    for (int t = 0; t < n; t++) {
        kr[t] = kc[t];
        vr[t] = vc[t];
    }
#endif
}

#ifdef __AVX512F__
/* The online softmax of one chunk's scores S [n][VF] (lane-wise): S becomes the
 * probabilities, m and l are updated, corr gets each lane's rescale of its earlier output. */
static inline void chunk_softmax(float S[KC][VF], int n, float *m, float *l, float *corr) {
    __m512 mx = _mm512_loadu_ps(m), sum = _mm512_setzero_ps();
    for (int t = 0; t < n; t++) mx = _mm512_max_ps(mx, _mm512_load_ps(S[t]));
    for (int t = 0; t < n; t++) {
        const vf p = (vf)exp512(_mm512_sub_ps(_mm512_load_ps(S[t]), mx));
        *(vf *)S[t] = p;
        sum = _mm512_add_ps(sum, (__m512)p);
    }
    const __m512 c = exp512(_mm512_sub_ps(_mm512_loadu_ps(m), mx));
    _mm512_storeu_ps(corr, c);
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), c, sum));
    _mm512_storeu_ps(m, mx);
}
#else
/* (as above, 8 lanes; GCC vectorizes the exponentials through libm's vector expf) */
static void chunk_softmax(float S[KC][VF], int n, float *m, float *l, float *corr) {
    float mx[VF], sum[VF];
    for (int j = 0; j < VF; j++) {
        mx[j] = m[j];
        sum[j] = 0.f;
    }
    for (int t = 0; t < n; t++)
        for (int j = 0; j < VF; j++) mx[j] = S[t][j] > mx[j] ? S[t][j] : mx[j];
    for (int t = 0; t < n; t++)
        for (int j = 0; j < VF; j++) {
            S[t][j] = expf(S[t][j] - mx[j]);
            sum[j] += S[t][j];
        }
    for (int j = 0; j < VF; j++) {
        corr[j] = expf(m[j] - mx[j]);
        l[j] = l[j] * corr[j] + sum[j];
        m[j] = mx[j];
    }
}
#endif


#if defined(ELEM_BF16) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
/* The bf16 build on AMX tiles (head dim 64, blocks of a multiple of 16 keys): the products
 * run on the tile unit, the online softmax stays as above. A tile attends 32 keys at a time:
 *   S^T [16 keys][16 queries] = K [16 keys][64] . Q^T, twice: K straight from its cache
 *            block (16 consecutive keys, rows Hkv * D apart), Q^T packed once per tile in
 *            the pairs TDPBF16PS reads; S^T is exactly the S[t][lane] the softmax takes;
 *   O [16 queries][64] += P^T [16 queries][32 keys] . V [32 keys][64]: P^T transposed and
 *            rounded to bf16, V's rows interleaved in pairs; the product lands in fp32 and
 *            joins O (in memory: the softmax rescales it every chunk).
 * Tiles: 0, 1 scores (or 0, 1, 6, 7: the chunk's P.V); 2, 3 K (or P^T, V); 4, 5 Q^T. */
#include "amx_tiles.h"

#define AMX_D 64
#define AMX_KEYS 32

static void attend_tile_amx(const Segment *s, int h, int64_t r0, int nr) {
    const int G = s->H / s->Hkv, D = AMX_D;
    const int64_t prefix = s->seq_len - s->q_len, bs = s->block_size, key_stride = (int64_t)s->Hkv * D;
    uint32_t qt[2][16][16] __attribute__((aligned(64)));   /* Q^T pairs: [dim half][dim pair][query] */
    uint32_t pt[16][16] __attribute__((aligned(64)));      /* P in bf16 pairs: [key pair][query] */
    uint32_t vv[4][16][16] __attribute__((aligned(64)));   /* V pairs: [16 dims][key pair][dim] */
    float S[AMX_KEYS][16] __attribute__((aligned(64)));
    float O[16][AMX_D] __attribute__((aligned(64)));
    float pv[16][AMX_D] __attribute__((aligned(64)));
    float m[16], l[16], corr[16], qpos[16];
    int64_t last = 0;
    for (int j = 0; j < 16; j++) {
        m[j] = -FLT_MAX;
        l[j] = 0.f;
        const uint32_t *qr = NULL;
        if (j < nr) {
            const int64_t r = r0 + j, i = r / G;
            qr = (const uint32_t *)(s->q + ((s->q_start + i) * s->H + h * G + r % G) * D);
            qpos[j] = (float)(prefix + i);
            last = prefix + i;
        } else {
            qpos[j] = (float)s->seq_len;
        }
        for (int half = 0; half < 2; half++)
            for (int kp = 0; kp < 16; kp++) qt[half][kp][j] = qr ? qr[half * 16 + kp] : 0;
    }
    memset(O, 0, sizeof O);
    const float first = qpos[0];
    const vf qposv = *(const vf *)qpos;
    const __m512 scale = _mm512_set1_ps(s->scale);
    static const int all_rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_configure(all_rows);
    _tile_loadd(4, qt[0], 64);
    _tile_loadd(5, qt[1], 64);
    for (int64_t k0 = 0; k0 <= last; k0 += AMX_KEYS) {
        const int n = last + 1 - k0 < AMX_KEYS ? (int)(last + 1 - k0) : AMX_KEYS;
        const elem_t *krow[2], *vrow[2];
        for (int half = 0; half * 16 < n; half++) {
            const int64_t key = k0 + half * 16, at = ((s->table[key / bs] * bs + key % bs) * s->Hkv + h) * D;
            krow[half] = s->k_cache + at;
            vrow[half] = s->v_cache + at;
        }
        /* scores of the (up to) two 16-key halves: both dim halves of K against Q^T's */
#define HALF_SCORES(acc, half)                                \
    do {                                                      \
        _tile_zero(acc);                                      \
        _tile_loadd(2, krow[half], key_stride * 2);           \
        _tile_loadd(3, krow[half] + 32, key_stride * 2);      \
        _tile_dpbf16ps(acc, 2, 4);                            \
        _tile_dpbf16ps(acc, 3, 5);                            \
        _tile_stored(acc, S[16 * (half)], 64);                \
    } while (0)
        HALF_SCORES(0, 0);
        if (n > 16) HALF_SCORES(1, 1);
#undef HALF_SCORES
        for (int t = 0; t < n; t++) _mm512_store_ps(S[t], _mm512_mul_ps(_mm512_load_ps(S[t]), scale));
        if (k0 + n - 1 > first) {
            for (int t = 0; t < n; t++) {
                const vi past = ((vf){0} + (float)(k0 + t)) > qposv;
                *(vi *)S[t] = (*(vi *)S[t] & ~past) | ((vi)((vf){0} - FLT_MAX) & past);
            }
        }
        chunk_softmax(S, n, m, l, corr);
        /* P^T in bf16 pairs (keys past n: zero), V's rows in pairs (past n: zero) */
        for (int t = n; t < AMX_KEYS; t++) _mm512_store_ps(S[t], _mm512_setzero_ps());
        for (int kp = 0; kp < 16; kp++) {
            const __m512i even = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(S[2 * kp])));
            const __m512i odd = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(S[2 * kp + 1])));
            _mm512_store_si512(pt[kp], _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
        }
        /* P^T, the A operand: [query][key pair] */
        uint32_t ptt[16][16] __attribute__((aligned(64)));
        for (int q = 0; q < 16; q++)
            for (int kp = 0; kp < 16; kp++) ptt[q][kp] = pt[kp][q];
        for (int kp = 0; kp < 16; kp++) {
            const int t = 2 * kp;
            const uint16_t *a = t < n ? vrow[t / 16] + (int64_t)(t % 16) * key_stride : NULL;
            const uint16_t *b = t + 1 < n ? vrow[(t + 1) / 16] + (int64_t)((t + 1) % 16) * key_stride : NULL;
            for (int d16 = 0; d16 < 4; d16++) {
                const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + d16 * 16))) : _mm512_setzero_si512();
                const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + d16 * 16))) : _mm512_setzero_si512();
                _mm512_store_si512(vv[d16][kp], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
        _tile_loadd(2, ptt, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(6);
        _tile_zero(7);
        _tile_loadd(3, vv[0], 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(3, vv[1], 64);
        _tile_dpbf16ps(1, 2, 3);
        _tile_loadd(3, vv[2], 64);
        _tile_dpbf16ps(6, 2, 3);
        _tile_loadd(3, vv[3], 64);
        _tile_dpbf16ps(7, 2, 3);
        _tile_stored(0, &pv[0][0], AMX_D * 4);
        _tile_stored(1, &pv[0][16], AMX_D * 4);
        _tile_stored(6, &pv[0][32], AMX_D * 4);
        _tile_stored(7, &pv[0][48], AMX_D * 4);
        for (int q = 0; q < 16; q++) {
            const __m512 c = _mm512_set1_ps(corr[q]);
            for (int d = 0; d < AMX_D; d += 16)
                _mm512_store_ps(&O[q][d], _mm512_fmadd_ps(_mm512_load_ps(&O[q][d]), c, _mm512_load_ps(&pv[q][d])));
        }
    }
    _tile_release();
    for (int j = 0; j < nr; j++) {
        const int64_t r = r0 + j, i = r / G;
        elem_t *o = s->out + ((s->q_start + i) * s->H + h * G + r % G) * D;
        const float inv = 1.f / l[j];
        for (int d = 0; d < D; d++) o[d] = st(O[j][d] * inv);
    }
}
#define HAVE_AMX_TILE 1
#endif

/* One tile: rows [r0, r0 + nr) of KV head h of segment s (D a constant where inlined). */
static inline __attribute__((always_inline)) void attend_tile(const Segment *s, int h, int64_t r0, int nr, int D) {
    const int G = s->H / s->Hkv;
    const int64_t prefix = s->seq_len - s->q_len;
    float Qt[MAX_D][VF] __attribute__((aligned(64)));
    float Ot[MAX_D][VF] __attribute__((aligned(64)));
    float S[KC][VF] __attribute__((aligned(64)));
#ifdef ELEM_BF16
    float kbuf[KC * MAX_D] __attribute__((aligned(64))), vbuf[KC * MAX_D] __attribute__((aligned(64)));
#else
    float *kbuf = NULL, *vbuf = NULL;
#endif
    float m[VF], l[VF], corr[VF], qpos[VF];
    int64_t last = 0; /* the tile's last query position: keys past it are not read */
    for (int j = 0; j < VF; j++) {
        m[j] = -FLT_MAX;
        l[j] = 0.f;
        if (j < nr) {
            const int64_t r = r0 + j, i = r / G;
            const elem_t *qr = s->q + ((s->q_start + i) * s->H + h * G + r % G) * D;
            for (int d = 0; d < D; d++) Qt[d][j] = ld(qr[d]) * s->scale;
            qpos[j] = (float)(prefix + i);
            last = prefix + i;
        } else { /* a padding lane: zero scores, never masked, never written */
            for (int d = 0; d < D; d++) Qt[d][j] = 0.f;
            qpos[j] = (float)s->seq_len;
        }
    }
    for (int d = 0; d < D; d++) *(vf *)Ot[d] = (vf){0};
    const float first = qpos[0]; /* lanes are in position order: the first is the smallest */
    const vf qposv = *(const vf *)qpos;

    for (int64_t k0 = 0; k0 <= last; k0 += KC) {
        const int n = last + 1 - k0 < KC ? (int)(last + 1 - k0) : KC;
        const elem_t *kc[KC], *vc[KC];
        chunk_rows(s, k0, n, h, kc, vc);
        const float *kr[KC], *vr[KC];
        chunk_floats(kc, vc, n, D, kbuf, vbuf, kr, vr);
        for (int t = n; t < KC; t++) kr[t] = kr[0];
        /* scores, KEYS_AT_ONCE keys at a time */
        for (int t0 = 0; t0 < n; t0 += KEYS_AT_ONCE) {
            vf acc[KEYS_AT_ONCE];
            for (int u = 0; u < KEYS_AT_ONCE; u++) acc[u] = (vf){0};
            for (int d = 0; d < D; d++) {
                const vf qd = *(const vf *)Qt[d];
                for (int u = 0; u < KEYS_AT_ONCE; u++) acc[u] += kr[t0 + u][d] * qd;
            }
            for (int u = 0; u < KEYS_AT_ONCE && t0 + u < n; u++) *(vf *)S[t0 + u] = acc[u];
        }
        if (k0 + n - 1 > first) { /* the chunk reaches the diagonal: mask keys past each lane */
            for (int t = 0; t < n; t++) {
                const vi past = ((vf){0} + (float)(k0 + t)) > qposv;
                *(vi *)S[t] = (*(vi *)S[t] & ~past) | ((vi)((vf){0} - FLT_MAX) & past);
            }
        }
        chunk_softmax(S, n, m, l, corr);
        const vf c = *(const vf *)corr;
        /* values, DIMS_AT_ONCE head dims at a time */
        for (int d0 = 0; d0 < D; d0 += DIMS_AT_ONCE) {
            vf acc[DIMS_AT_ONCE];
            for (int j = 0; j < DIMS_AT_ONCE; j++) acc[j] = *(const vf *)Ot[d0 + j] * c;
            for (int t = 0; t < n; t++) {
                const vf p = *(const vf *)S[t];
                const float *v = vr[t] + d0;
                __asm__("" : "+r"(v)); /* (GCC would otherwise keep an offset register per dim) */
                for (int j = 0; j < DIMS_AT_ONCE; j++) acc[j] += v[j] * p;
            }
            for (int j = 0; j < DIMS_AT_ONCE; j++) *(vf *)Ot[d0 + j] = acc[j];
        }
    }
    for (int j = 0; j < nr; j++) {
        const int64_t r = r0 + j, i = r / G;
        elem_t *o = s->out + ((s->q_start + i) * s->H + h * G + r % G) * D;
        const float inv = 1.f / l[j];
        for (int d = 0; d < D; d++) o[d] = st(Ot[d][j] * inv);
    }
}

static void tile(const Segment *s, int h, int64_t r0, int nr) {
#ifdef HAVE_AMX_TILE
    if (s->D == AMX_D && s->block_size % 16 == 0 && amx_granted()) {
        attend_tile_amx(s, h, r0, nr);
        return;
    }
#endif
    if (s->D == 64)
        attend_tile(s, h, r0, nr, 64);
    else if (s->D == 128)
        attend_tile(s, h, r0, nr, 128);
    else
        attend_tile(s, h, r0, nr, s->D);
}

/* 0 on success; -1 for shapes it does not take (the wrapper checks them first) or no memory. */
int KERNEL(paged_prefill_attention)(const elem_t *q, const elem_t *k_cache, const elem_t *v_cache,
                                    const int64_t *tables, int table_width, const int64_t *segments,
                                    int num_segments, elem_t *out, int H, int Hkv, int D, int block_size,
                                    float scale) {
    if (D > MAX_D || D % DIMS_AT_ONCE != 0 || Hkv <= 0 || H % Hkv != 0 || num_segments <= 0) return -1;
    const int G = H / Hkv;
    /* tile index -> (segment, KV head, first row): the first tile of each segment */
    int64_t *first_tile = malloc(sizeof(int64_t) * (num_segments + 1));
    if (!first_tile) return -1;
    first_tile[0] = 0;
    for (int i = 0; i < num_segments; i++) {
        const int64_t rows = segments[3 * i + 1] * G;
        first_tile[i + 1] = first_tile[i] + Hkv * ((rows + VF - 1) / VF);
    }
    const int64_t total = first_tile[num_segments];
#pragma omp parallel
    {
        int seg = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < total; w++) {
            while (w >= first_tile[seg + 1]) seg++; /* (a thread's w only grows) */
            const int64_t *sg = segments + 3 * seg;
            const Segment s = {q, k_cache, v_cache, out, tables + (int64_t)seg * table_width,
                               sg[0], sg[1], sg[2], H, Hkv, D, block_size, scale};
            const int64_t per_head = (sg[1] * G + VF - 1) / VF, local = w - first_tile[seg];
            const int h = (int)(local / per_head);
            const int64_t r0 = (local % per_head) * VF, rows = sg[1] * G;
            tile(&s, h, r0, rows - r0 < VF ? (int)(rows - r0) : VF);
        }
    }
    free(first_tile);
    return 0;
}
