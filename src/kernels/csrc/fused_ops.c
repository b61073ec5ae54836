/* Fused element-wise CPU kernels for the decoder layer (fp32): each is one pass over its
 * data where the torch path takes several (and a transpose copy before them).
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
 * activation.py) in the same order, so results agree to rounding.
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN_ELEMENTS 32768 /* below this a parallel region costs more than it saves */

void add_rms_norm_f32(const float *x, int64_t rs, int64_t cs, float *residual, const float *weight, float *out,
                      int T, int D, float eps) {
#pragma omp parallel for if ((int64_t)T * D >= PARALLEL_MIN_ELEMENTS)
    for (int t = 0; t < T; t++) {
        const float *xt = x + (int64_t)t * rs;
        float *o = out + (int64_t)t * D;
        const float *src = o;
        if (residual) {
            float *r = residual + (int64_t)t * D;
            for (int d = 0; d < D; d++) r[d] += xt[d * cs];
            src = r;
        } else {
            for (int d = 0; d < D; d++) o[d] = xt[d * cs];
        }
        float ss = 0.f;
        for (int d = 0; d < D; d++) ss += src[d] * src[d];
        const float inv = 1.f / sqrtf(ss / D + eps);
        for (int d = 0; d < D; d++) o[d] = (src[d] * inv) * weight[d];
    }
}

/* out[i * out_stride + k] = silu(a[i * stride + k]) * a[i * stride + up + k], k < inner:
 * the inner dimension is unit-stride in input and output (row-major: i = token; column-
 * major: i = feature), so the loop vectorises (expf through the vector math library). */
void silu_mul_f32(const float *a, int64_t stride, int64_t up, float *out, int64_t out_stride, int outer,
                  int inner) {
#pragma omp parallel for if ((int64_t)outer * inner >= PARALLEL_MIN_ELEMENTS)
    for (int i = 0; i < outer; i++) {
        const float *g = a + (int64_t)i * stride;
        const float *u = g + up;
        float *o = out + (int64_t)i * out_stride;
        for (int k = 0; k < inner; k++) o[k] = g[k] / (1.f + expf(-g[k])) * u[k];
    }
}

/* One head of D values (strided source) into `dst`: optional RMSNorm, then rotary. */
static inline void head_rope(const float *src, int64_t cs, const float *norm_w, float eps, const float *cos,
                             const float *sin, int D, float *dst) {
    float v[512];
    for (int d = 0; d < D; d++) v[d] = src[d * cs];
    if (norm_w) {
        float ss = 0.f;
        for (int d = 0; d < D; d++) ss += v[d] * v[d];
        const float inv = 1.f / sqrtf(ss / D + eps);
        for (int d = 0; d < D; d++) v[d] = (v[d] * inv) * norm_w[d];
    }
    const int half = D / 2;
    for (int d = 0; d < half; d++) {
        dst[d] = v[d] * cos[d] - v[d + half] * sin[d];
        dst[d + half] = v[d + half] * cos[d] + v[d] * sin[d];
    }
}

void qkv_rope_store_f32(const float *qkv, int64_t rs, int64_t cs, const float *q_norm,
                        const float *k_norm, float eps, const float *cos, const float *sin, int64_t rope_stride,
                        const int64_t *slots, float *k_cache, float *v_cache, float *q_out, float *k_out,
                        float *v_out, int T, int H, int Hkv, int D) {
    const int kv_width = Hkv * D;
#pragma omp parallel for if ((int64_t)T * (H + 2 * Hkv) * D >= PARALLEL_MIN_ELEMENTS)
    for (int t = 0; t < T; t++) {
        const float *row = qkv + (int64_t)t * rs;
        const float *c = cos + (int64_t)t * rope_stride, *s = sin + (int64_t)t * rope_stride;
        for (int h = 0; h < H; h++) {
            const int64_t col = (int64_t)h * D;
            head_rope(row + col * cs, cs, q_norm, eps, c, s, D, q_out + ((int64_t)t * H + h) * D);
        }
        float *k = k_out + (int64_t)t * kv_width, *v = v_out + (int64_t)t * kv_width;
        for (int h = 0; h < Hkv; h++) {
            const int64_t kcol = (int64_t)(H + h) * D, vcol = (int64_t)(H + Hkv + h) * D;
            head_rope(row + kcol * cs, cs, k_norm, eps, c, s, D, k + h * D);
            for (int d = 0; d < D; d++) v[h * D + d] = row[(vcol + d) * cs];
        }
        const int64_t slot = slots[t];
        if (slot >= 0) {
            float *kc = k_cache + slot * kv_width, *vc = v_cache + slot * kv_width;
            for (int j = 0; j < kv_width; j++) {
                kc[j] = k[j];
                vc[j] = v[j];
            }
        }
    }
}
