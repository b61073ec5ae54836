/* Fused element-wise CPU kernels for the decoder layer (fp32, or bf16 in the -DELEM_BF16
 * build: elem.h): each is one pass over its data where the torch path takes several (and a
 * transpose copy before them).
 *
 * Inputs are strided 2-D views: element (t, j) of x is x[t * rs + j * cs]. On the CPU the
 * projections of short batches come out column-major ([T, N] with rs = 1, cs = T: see
 * kernels/linear.py), large ones row-major (cs = 1); both are read as they are.
 *
 *   add_rms_norm   residual += x (optional), out = rms_norm(residual) * weight   [T, D]
 *   silu_mul       out = silu(gate) * up, the two halves of a fused projection
 *   qkv_rope_store split q|k|v, optional per-head RMSNorm (Qwen3), rotary
 *                  (rotate-half) on q and k, k and v written to their cache slots
 *                  (slot < 0: not stored) and returned contiguous with q.
 *
 * The arithmetic follows the torch reference path (kernels/norm.py, rotary.py,
 * activation.py) in the same order, rounding to the element type where torch does (R), so
 * results agree to rounding.
 */
#include <math.h>
#include <stdint.h>

#include "elem.h"

#define R(x) ld(st(x)) /* a value rounded to the element type, as torch stores it between ops */

#define PARALLEL_MIN_ELEMENTS 32768 /* below this a parallel region costs more than it saves */

/* The bf16 build works 16 lanes at a time where the CPU converts to bf16 itself (AVX512-BF16):
 * GCC vectorises neither the bf16 rounding of st() nor expf well on its own. (The fp32 build
 * is as fast as it is, and keeps libm's expf.) */
#if defined(ELEM_BF16) && defined(__AVX512BF16__)
#include "bf16_avx512.h" /* load16, store16, round16: R() of 16 lanes */
#include "exp_avx512.h"
#define VEC16 1
#endif

void KERNEL(add_rms_norm)(const elem_t *x, int64_t rs, int64_t cs, elem_t *residual, const elem_t *weight,
                          elem_t *out, int T, int D, float eps) {
#pragma omp parallel for if ((int64_t)T * D >= PARALLEL_MIN_ELEMENTS)
    for (int t = 0; t < T; t++) {
        const elem_t *xt = x + (int64_t)t * rs;
        elem_t *o = out + (int64_t)t * D;
        const elem_t *src = o;
        int d = 0;
        if (residual) {
            elem_t *r = residual + (int64_t)t * D;
#ifdef VEC16
            if (cs == 1)
                for (; d + 16 <= D; d += 16) store16(r + d, _mm512_add_ps(load16(r + d), load16(xt + d)));
#endif
            for (; d < D; d++) r[d] = st(ld(r[d]) + ld(xt[d * cs]));
            src = r;
        } else {
            for (; d < D; d++) o[d] = xt[d * cs];
        }
        float ss = 0.f;
        d = 0;
#ifdef VEC16
        __m512 squares = _mm512_setzero_ps();
        for (; d + 16 <= D; d += 16) {
            const __m512 v = load16(src + d);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        ss = _mm512_reduce_add_ps(squares);
#endif
        for (; d < D; d++) ss += ld(src[d]) * ld(src[d]);
        const float inv = 1.f / sqrtf(ss / D + eps);
        d = 0;
#ifdef VEC16
        const __m512 invv = _mm512_set1_ps(inv);
        for (; d + 16 <= D; d += 16)
            store16(o + d, _mm512_mul_ps(round16(_mm512_mul_ps(load16(src + d), invv)), load16(weight + d)));
#endif
        for (; d < D; d++) o[d] = st(R(ld(src[d]) * inv) * ld(weight[d]));
    }
}

/* out[i * out_stride + k] = silu(a[i * stride + k]) * a[i * stride + up + k], k < inner:
 * the inner dimension is unit-stride in input and output (row-major: i = token; column-
 * major: i = feature), so the loop vectorises (expf through the vector math library). */
void KERNEL(silu_mul)(const elem_t *a, int64_t stride, int64_t up, elem_t *out, int64_t out_stride, int outer,
                      int inner) {
#pragma omp parallel for if ((int64_t)outer * inner >= PARALLEL_MIN_ELEMENTS)
    for (int i = 0; i < outer; i++) {
        const elem_t *g = a + (int64_t)i * stride;
        const elem_t *u = g + up;
        elem_t *o = out + (int64_t)i * out_stride;
        int k = 0;
#ifdef VEC16
        for (; k + 16 <= inner; k += 16) {
            const __m512 x = load16(g + k);
            store16(o + k, _mm512_mul_ps(round16(silu512(x)), load16(u + k)));
        }
#endif
        for (; k < inner; k++) {
            const float x = ld(g[k]);
            o[k] = st(R(x / (1.f + expf(fminf(-x, 88.f)))) * ld(u[k])); /* (e^88 stays finite under -ffast-math) */
        }
    }
}

/* One head of D values (strided source) into `dst`: optional RMSNorm, then rotary (cos and
 * sin are fp32 in both builds). */
static inline void head_rope(const elem_t *src, int64_t cs, const elem_t *norm_w, float eps, const float *cos,
                             const float *sin, int D, elem_t *dst) {
    float v[512];
    for (int d = 0; d < D; d++) v[d] = ld(src[d * cs]);
    if (norm_w) {
        float ss = 0.f;
        for (int d = 0; d < D; d++) ss += v[d] * v[d];
        const float inv = 1.f / sqrtf(ss / D + eps);
        for (int d = 0; d < D; d++) v[d] = R(R(v[d] * inv) * ld(norm_w[d]));
    }
    const int half = D / 2;
    for (int d = 0; d < half; d++) {
        dst[d] = st(v[d] * cos[d] - v[d + half] * sin[d]);
        dst[d + half] = st(v[d + half] * cos[d] + v[d] * sin[d]);
    }
}

void KERNEL(qkv_rope_store)(const elem_t *qkv, int64_t rs, int64_t cs, const elem_t *q_norm,
                            const elem_t *k_norm, float eps, const float *cos, const float *sin, int64_t rope_stride,
                            const int64_t *slots, elem_t *k_cache, elem_t *v_cache, elem_t *q_out, elem_t *k_out,
                            elem_t *v_out, int T, int H, int Hkv, int D) {
    const int kv_width = Hkv * D;
#pragma omp parallel for if ((int64_t)T * (H + 2 * Hkv) * D >= PARALLEL_MIN_ELEMENTS)
    for (int t = 0; t < T; t++) {
        const elem_t *row = qkv + (int64_t)t * rs;
        const float *c = cos + (int64_t)t * rope_stride, *s = sin + (int64_t)t * rope_stride;
        for (int h = 0; h < H; h++) {
            const int64_t col = (int64_t)h * D;
            head_rope(row + col * cs, cs, q_norm, eps, c, s, D, q_out + ((int64_t)t * H + h) * D);
        }
        elem_t *k = k_out + (int64_t)t * kv_width, *v = v_out + (int64_t)t * kv_width;
        for (int h = 0; h < Hkv; h++) {
            const int64_t kcol = (int64_t)(H + h) * D, vcol = (int64_t)(H + Hkv + h) * D;
            head_rope(row + kcol * cs, cs, k_norm, eps, c, s, D, k + h * D);
            for (int d = 0; d < D; d++) v[h * D + d] = row[(vcol + d) * cs];
        }
        const int64_t slot = slots[t];
        if (slot >= 0) {
            elem_t *kc = k_cache + slot * kv_width, *vc = v_cache + slot * kv_width;
            for (int j = 0; j < kv_width; j++) {
                kc[j] = k[j];
                vc[j] = v[j];
            }
        }
    }
}
