/* Greedy sampling's argmax: the index of each row's maximum (the first on ties), for
 * logits [rows, n] with row stride rs (fp32, or bf16 in the -DELEM_BF16 build: elem.h).
 *
 * torch's CPU max over a vocabulary-wide row walks it several times slower than memory
 * allows (bf16 most of all); here eight lanes each keep their running maximum and its first
 * index in one pass, and the lanes are merged at the end. NaN compares false and is never
 * picked (torch would return it: such logits are garbage either way).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "elem.h"

typedef int32_t i8v __attribute__((vector_size(32)));

#define PARALLEL_MIN_ELEMENTS 65536 /* below this a parallel region costs more than it saves */

void KERNEL(row_argmax)(const elem_t *x, int64_t rs, int rows, int n, int64_t *out) {
#pragma omp parallel for if ((int64_t)rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const elem_t *row = x + (int64_t)r * rs;
        const int whole = n / 8 * 8;
        float best = -FLT_MAX; /* (no infinities under -ffast-math; a row of -inf picks index 0, as torch) */
        int64_t at = 0;
        if (whole) {
            v8 top = load8(row);
            i8v idx = {0, 1, 2, 3, 4, 5, 6, 7}, top_idx = idx;
            const i8v step = {8, 8, 8, 8, 8, 8, 8, 8};
            for (int i = 8; i < whole; i += 8) {
                idx += step;
                const v8 v = load8(row + i);
                const i8v greater = v > top; /* all ones where v wins (ties keep the earlier index) */
                top = (v8)(((i8v)v & greater) | ((i8v)top & ~greater));
                top_idx = (idx & greater) | (top_idx & ~greater);
            }
            for (int l = 0; l < 8; l++)
                if (top[l] > best || (top[l] == best && top_idx[l] < at)) best = top[l], at = top_idx[l];
        }
        for (int i = whole; i < n; i++)
            if (ld(row[i]) > best) best = ld(row[i]), at = i;
        out[r] = at;
    }
}

#ifdef ELEM_BF16
/* Greedy tokens of an fp32 LM head, screened by a bf16 copy of it (kernels/screened_greedy.py):
 * `approx` [rows, n] (row stride as) holds the bf16 logits of the bf16-rounded hidden rows
 * against the bf16-rounded weight. The fp32 logit of token j in row r lies within
 *   e_j = s1[r] * bound[j] + s2[r] * bound[n + j] + |approx_j| / 256
 * of approx_j (the caller's bounds: the weight's rounding, the hidden row's, fp32 sums, and
 * the logit's own rounding to bf16). So only tokens whose upper end reaches the largest
 * lower end can be the argmax; each of those few gets its exact fp32 logit (h [rows, H],
 * row stride hs, against w [n, H]), and the largest wins, the first on ties. */
static inline float dot_f32(const float *a, const float *b, int H) {
    v8 acc = {0};
    int i = 0;
    for (; i + 8 <= H; i += 8) acc += *(const v8 *)(a + i) * *(const v8 *)(b + i);
    float s = hsum(acc);
    for (; i < H; i++) s += a[i] * b[i];
    return s;
}

/* Token j's bound e_j (as above), 16 at a time with AVX-512. */
#ifdef __AVX512F__
#include "bf16_avx512.h"
static inline __m512 bound16(__m512 v, __m512 c1, __m512 c2, const float *d, const float *m) {
    const __m512 rel = _mm512_mul_ps(_mm512_abs_ps(v), _mm512_set1_ps(1.f / 256));
    return _mm512_fmadd_ps(c1, _mm512_loadu_ps(d), _mm512_fmadd_ps(c2, _mm512_loadu_ps(m), rel));
}
#endif

void KERNEL(screened_argmax)(const elem_t *approx, int64_t as, const float *s1, const float *s2, const float *bound,
                             const float *h, int64_t hs, const float *w, int H, int rows, int n, int64_t *out) {
#pragma omp parallel for if ((int64_t)rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const elem_t *a = approx + (int64_t)r * as;
        const float c1 = s1[r], c2 = s2[r], *d = bound, *m = bound + n;
        float lowest = -FLT_MAX; /* the largest lower end */
        int j = 0;
#ifdef __AVX512F__
        const __m512 v1 = _mm512_set1_ps(c1), v2 = _mm512_set1_ps(c2);
        __m512 low = _mm512_set1_ps(-FLT_MAX);
        for (; j + 16 <= n; j += 16) {
            const __m512 v = load16(a + j);
            low = _mm512_max_ps(low, _mm512_sub_ps(v, bound16(v, v1, v2, d + j, m + j)));
        }
        lowest = _mm512_reduce_max_ps(low);
#endif
        for (; j < n; j++) {
            const float v = ld(a[j]), e = c1 * d[j] + c2 * m[j] + fabsf(v) * (1.f / 256);
            lowest = v - e > lowest ? v - e : lowest;
        }
        float best = -FLT_MAX;
        int64_t at = -1;
        const float *hr = h + (int64_t)r * hs;
        j = 0;
#ifdef __AVX512F__
        const __m512 cut = _mm512_set1_ps(lowest);
        for (; j + 16 <= n; j += 16) {
            const __m512 v = load16(a + j);
            __mmask16 reach = _mm512_cmp_ps_mask(_mm512_add_ps(v, bound16(v, v1, v2, d + j, m + j)), cut, _CMP_GE_OQ);
            for (; reach; reach &= reach - 1) { /* (ascending: the first on ties stays) */
                const int k = j + __builtin_ctz(reach);
                const float z = dot_f32(hr, w + (int64_t)k * H, H);
                if (at < 0 || z > best) best = z, at = k;
            }
        }
#endif
        for (; j < n; j++) {
            const float v = ld(a[j]), e = c1 * d[j] + c2 * m[j] + fabsf(v) * (1.f / 256);
            if (v + e >= lowest) {
                const float z = dot_f32(hr, w + (int64_t)j * H, H);
                if (at < 0 || z > best) best = z, at = j;
            }
        }
        out[r] = at < 0 ? 0 : at;
    }
}
#endif
