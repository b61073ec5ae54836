/* Paged decode attention for the CPU: one query token per request, keys/values read
 * straight from the block-structured cache through the block table (no gather copy).
 *
 * One task per request with all its heads, so each token row [Hkv, D] is read once,
 * contiguously. Per block of block_size tokens: the scores of every query head first,
 * then their exponentials in one vectorisable loop (online softmax, fp32), then the
 * value accumulation.
 *
 * Layouts (all contiguous, fp32):
 *   q, out        [n, H, D]
 *   k_cache, v_c  [num_blocks * block_size, Hkv, D]
 *   block_tables  [n, max_blocks] int64;  seq_lens [n] int64
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#define MAX_HEADS 64
#define MAX_BLOCK 64
#define MAX_DIM 256

void paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                const int64_t *block_tables, const int64_t *seq_lens, float *out,
                                int n, int H, int Hkv, int D, int block_size, int max_blocks,
                                float scale) {
    const int G = H / Hkv;
#pragma omp parallel for schedule(dynamic, 1)
    for (int i = 0; i < n; i++) {
        const int64_t seq = seq_lens[i];
        const int64_t *table = block_tables + (int64_t)i * max_blocks;
        const float *qi = q + (int64_t)i * H * D;
        float acc[MAX_HEADS * MAX_DIM];
        float m[MAX_HEADS], l[MAX_HEADS], s[MAX_HEADS][MAX_BLOCK];
        for (int hq = 0; hq < H; hq++) {
            m[hq] = -FLT_MAX;
            l[hq] = 0.f;
        }
        for (int x = 0; x < H * D; x++) acc[x] = 0.f;
        for (int64_t start = 0; start < seq; start += block_size) {
            const int64_t base = table[start / block_size] * block_size;
            const int len = (int)(seq - start < block_size ? seq - start : block_size);
            const float *kb = k_cache + base * Hkv * D;
            const float *vb = v_cache + base * Hkv * D;
            for (int t = 0; t < len; t++) {
                for (int h = 0; h < Hkv; h++) {
                    const float *k = kb + ((int64_t)t * Hkv + h) * D;
                    for (int g = 0; g < G; g++) {
                        const float *qg = qi + (int64_t)(h * G + g) * D;
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int d = 0; d < D; d++) dot += qg[d] * k[d];
                        s[h * G + g][t] = dot * scale;
                    }
                }
            }
            for (int hq = 0; hq < H; hq++) {
                float mb = m[hq];
                for (int t = 0; t < len; t++) mb = s[hq][t] > mb ? s[hq][t] : mb;
                const float corr = expf(m[hq] - mb);
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int t = 0; t < len; t++) {
                    s[hq][t] = expf(s[hq][t] - mb);
                    sum += s[hq][t];
                }
                l[hq] = l[hq] * corr + sum;
                m[hq] = mb;
                float *a = acc + (int64_t)hq * D;
#pragma omp simd
                for (int d = 0; d < D; d++) a[d] *= corr;
            }
            for (int t = 0; t < len; t++) {
                for (int h = 0; h < Hkv; h++) {
                    const float *v = vb + ((int64_t)t * Hkv + h) * D;
                    for (int g = 0; g < G; g++) {
                        const int hq = h * G + g;
                        const float p = s[hq][t];
                        float *a = acc + (int64_t)hq * D;
#pragma omp simd
                        for (int d = 0; d < D; d++) a[d] += p * v[d];
                    }
                }
            }
        }
        for (int hq = 0; hq < H; hq++) {
            float *o = out + ((int64_t)i * H + hq) * D;
            const float inv = l[hq] > 0.f ? 1.f / l[hq] : 0.f;
            for (int d = 0; d < D; d++) o[d] = acc[(int64_t)hq * D + d] * inv;
        }
    }
}
