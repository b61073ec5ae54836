/* The element type of a kernel library: each .c file here is compiled once per dtype,
 * fp32 by default and bf16 with -DELEM_BF16, so one source serves both. Arithmetic is
 * always fp32: bf16 values are widened on load and rounded (to nearest even) on store.
 *
 *   elem_t      the stored element
 *   ld(x)       elem_t -> float;  st(f): float -> elem_t
 *   load8(p)    8 consecutive elements -> v8 (8 floats);  hsum(v): the sum of a v8
 *   KERNEL(f)   the exported name: f_f32 or f_bf16
 */
#ifndef SERVICER_ELEM_H
#define SERVICER_ELEM_H

#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32), aligned(4))); /* aligned(4): unaligned loads OK */

#ifdef ELEM_BF16
typedef uint16_t elem_t;
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
#define KERNEL(name) name##_bf16

static inline float ld(elem_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline elem_t st(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (elem_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                        /* round to nearest even */
    return (elem_t)(u >> 16);
}

static inline v8 load8(const elem_t *p) {
    const u32x8 wide = __builtin_convertvector(*(const u16x8 *)p, u32x8) << 16;
    return (v8)wide; /* the same 32 bytes, read as floats */
}
#else
typedef float elem_t;
#define KERNEL(name) name##_f32

static inline float ld(elem_t x) { return x; }
static inline elem_t st(float f) { return f; }
static inline v8 load8(const elem_t *p) { return *(const v8 *)p; }
#endif

static inline float hsum(v8 x) {
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += x[i];
    return s;
}

#endif
