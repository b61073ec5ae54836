/* Greedy sampling's argmax: the index of each row's maximum (the first on ties), for
 * logits [rows, n] with row stride rs (fp32, or bf16 in the -DELEM_BF16 build: elem.h).
 *
 * torch's CPU max over a vocabulary-wide row walks it several times slower than memory
 * allows (bf16 most of all); here eight lanes each keep their running maximum and its first
 * index in one pass, and the lanes are merged at the end. NaN compares false and is never
 * picked (torch would return it: such logits are garbage either way).
 */
#include <float.h>
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
