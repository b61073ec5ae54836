/* Paged decode attention for the CPU: one query token per request, keys/values read
 * straight from the block-structured cache through the block table (no gather copy).
 *
 * One task per (request, KV head); the G query heads that share the KV head are done
 * together so every key/value row is loaded once. Softmax is online per block of
 * block_size tokens (fp32 accumulation).
 *
 * Layouts (all contiguous, fp32):
 *   q, out        [n, H, D]
 *   k_cache, v_c  [num_blocks * block_size, Hkv, D]
 *   block_tables  [n, max_blocks] int64;  seq_lens [n] int64
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 16
#define MAX_BLOCK 64

void paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                const int64_t *block_tables, const int64_t *seq_lens, float *out,
                                int n, int H, int Hkv, int D, int block_size, int max_blocks,
                                float scale) {
    const int G = H / Hkv;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int i = 0; i < n; i++) {
        for (int h = 0; h < Hkv; h++) {
            const int64_t seq = seq_lens[i];
            const int64_t *table = block_tables + (int64_t)i * max_blocks;
            const float *qh = q + ((int64_t)i * H + (int64_t)h * G) * D;
            float acc[MAX_GROUP][256];
            float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BLOCK];
            for (int g = 0; g < G; g++) {
                m[g] = -FLT_MAX;
                l[g] = 0.f;
                for (int d = 0; d < D; d++) acc[g][d] = 0.f;
            }
            for (int64_t start = 0; start < seq; start += block_size) {
                const int64_t base = table[start / block_size] * block_size;
                const int len = (int)(seq - start < block_size ? seq - start : block_size);
                for (int t = 0; t < len; t++) {
                    const float *k = k_cache + ((base + t) * Hkv + h) * D;
                    for (int g = 0; g < G; g++) {
                        const float *qg = qh + (int64_t)g * D;
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int d = 0; d < D; d++) dot += qg[d] * k[d];
                        s[g][t] = dot * scale;
                    }
                }
                for (int g = 0; g < G; g++) {
                    float mb = m[g];
                    for (int t = 0; t < len; t++) mb = s[g][t] > mb ? s[g][t] : mb;
                    const float corr = expf(m[g] - mb);
                    l[g] *= corr;
                    for (int d = 0; d < D; d++) acc[g][d] *= corr;
                    for (int t = 0; t < len; t++) {
                        s[g][t] = expf(s[g][t] - mb);
                        l[g] += s[g][t];
                    }
                    m[g] = mb;
                }
                for (int t = 0; t < len; t++) {
                    const float *v = v_cache + ((base + t) * Hkv + h) * D;
                    for (int g = 0; g < G; g++) {
                        const float p = s[g][t];
#pragma omp simd
                        for (int d = 0; d < D; d++) acc[g][d] += p * v[d];
                    }
                }
            }
            for (int g = 0; g < G; g++) {
                float *o = out + ((int64_t)i * H + (int64_t)h * G + g) * D;
                const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
                for (int d = 0; d < D; d++) o[d] = acc[g][d] * inv;
            }
        }
    }
}
