/* bf16 in 16 fp32 lanes (AVX-512), shared by the bf16 kernels: widening is a shift (bf16 is
 * the top half of an fp32); rounding to nearest even needs AVX512-BF16's conversion. */
#ifndef SERVICER_BF16_AVX512_H
#define SERVICER_BF16_AVX512_H

#include <immintrin.h>
#include <stdint.h>

/* 16 bf16 values (in a 256-bit vector) -> 16 floats. */
static inline __m512 widen16(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }

/* 16 bf16 values -> 16 floats. */
static inline __m512 load16(const uint16_t *p) { return widen16(_mm256_loadu_si256((const __m256i *)p)); }

#ifdef __AVX512BF16__
/* 16 floats rounded to bf16 and stored. */
static inline void store16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }

/* 16 floats rounded to bf16 and widened back: a value as a bf16 tensor would hold it. */
static inline __m512 round16(__m512 v) { return widen16((__m256i)_mm512_cvtneps_pbh(v)); }
#endif

#endif
