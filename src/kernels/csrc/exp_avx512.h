/* e^x in 16 fp32 lanes (AVX-512): 2^(x log2 e) as 2^n * 2^f, |f| <= 1/2, 2^f by its Taylor
 * polynomial to degree 7 (relative error under 1e-8, below fp32's rounding), 2^n applied by
 * vscalefps: a few FMAs inline instead of a call into libm's vector expf per vector. x is
 * clamped to [-104, 88], where the result is still 0 at the bottom and finite at the top. */
#ifndef SERVICER_EXP_AVX512_H
#define SERVICER_EXP_AVX512_H

#include <immintrin.h>

static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f)); /* f ln 2 */
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* silu(x) = x / (1 + e^-x) in 16 lanes. */
static inline __m512 silu512(__m512 x) {
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

#endif
