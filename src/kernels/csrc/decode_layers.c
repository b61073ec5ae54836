/* All decoder layers of a step in one call: the same kernels, in the same order and on the
 * same inputs, as the model's per-operation path calls one by one from Python (through the
 * wrappers of kernels/cpu_kernels.py, or a decode step's kernels/cpu_decode.py LayerPlan),
 * so it computes exactly what that path computes. A step's rows are its decodes (one token
 * each) and then its prefill chunks. The kernels live in their own
 * libraries; the caller passes their addresses (struct kernels). What one call saves is
 * the Python between the kernels, a fixed cost per layer that a small decode step feels.
 *
 * The step's buffers are slices of one caller-owned workspace (decode_layers_workspace
 * elements): the layer stream x and the residual first, each [rows, hidden], which the
 * caller reads back. x_in (the embeddings) is only read, and the KV cache writes repeat on
 * a second run, so after a failed call (a kernel out of memory) the caller can take the
 * per-layer path from the start. */
#include <stdint.h>
#include <string.h>

#include "elem.h"

typedef void (*norm_fn)(const elem_t *x, int64_t rs, int64_t cs, elem_t *residual, const elem_t *weight, elem_t *out,
                        int rows, int d, float eps);
typedef void (*silu_mul_fn)(const elem_t *a, int64_t stride, int64_t up, elem_t *out, int64_t out_stride, int outer,
                            int inner);
typedef void (*qkv_fn)(const elem_t *qkv, int64_t rs, int64_t cs, const elem_t *q_norm, const elem_t *k_norm,
                       float eps, const float *cos, const float *sin, int64_t rope_stride, const int64_t *slots,
                       elem_t *k_cache, elem_t *v_cache, elem_t *q_out, elem_t *k_out, elem_t *v_out, int rows,
                       int heads, int kv_heads, int head_dim);
typedef int (*gemv_fn)(const elem_t *x, const elem_t *w, const elem_t *bias, elem_t *out, int rows, int n, int k);
typedef int (*amx_fn)(const elem_t *x, int64_t x_stride, const elem_t *tiles, const elem_t *bias, elem_t *out,
                      int64_t out_stride, int rows, int n, int k, int gated);
typedef int (*attention_fn)(const elem_t *q, const elem_t *k_cache, const elem_t *v_cache, const int64_t *tables,
                            const int64_t *seq_lens, elem_t *out, int rows, int heads, int kv_heads, int head_dim,
                            int block_size, int max_blocks, float scale, int shares);

typedef int (*prefill_attention_fn)(const elem_t *q, const elem_t *k_cache, const elem_t *v_cache,
                                    const int64_t *tables, int max_blocks, const int64_t *segments, int chunks,
                                    elem_t *out, int heads, int kv_heads, int head_dim, int block_size, float scale);

typedef struct {
    norm_fn norm;
    silu_mul_fn silu_mul;
    qkv_fn qkv;
    gemv_fn gemv;
    amx_fn amx; /* NULL: no AMX tiles (fp32, or a CPU without AMX) */
    attention_fn attention;
    prefill_attention_fn prefill_attention; /* NULL: steps with prefill chunks are not run here */
} kernels;

/* out[rows, n] = x[rows, k] @ weight.T + bias: the few-row kernel on the plain weight up to
 * gemv_max_rows rows, past that the AMX kernel on the weight's tiles. */
typedef struct {
    const elem_t *weight, *bias, *tiles; /* bias, tiles: NULL when absent */
    int n, k, gemv_max_rows;
} projection;

typedef struct {
    const elem_t *norm1, *norm2, *q_norm, *k_norm; /* q_norm, k_norm: NULL without qk-norm */
    float norm1_eps, norm2_eps, qk_norm_eps, scale;
    projection qkv, o, gate_up, down;
    const elem_t *gated_tiles, *gated_bias; /* silu(gate) * up in one AMX call; tiles NULL: none */
    int gated_min_rows;                     /* the gated call is taken from this many rows */
    elem_t *k_cache, *v_cache;
} layer;

typedef struct {
    int rows, heads, kv_heads, head_dim, hidden, inter, block_size;
    const float *cos, *sin;
    int64_t rope_stride;
    const int64_t *slots;
    int decodes, decode_max_blocks; /* the first rows: one token of a request each */
    const int64_t *decode_tables, *decode_seq_lens;
    int prefills, prefill_max_blocks; /* then the chunks: [first row, rows, keys] each */
    const int64_t *prefill_segments, *prefill_tables;
} step;

static int project(const kernels *kn, const projection *p, const elem_t *x, elem_t *out, int rows) {
    if (rows <= p->gemv_max_rows) return kn->gemv(x, p->weight, p->bias, out, rows, p->n, p->k);
    if (kn->amx && p->tiles) return kn->amx(x, p->k, p->tiles, p->bias, out, p->n, rows, p->n, p->k, 0);
    return -1;
}

/* The workspace each step needs, in elements: x, residual, h [rows, hidden]; qkv; q, the
 * new k and v, the attention output; gate|up and silu(gate) * up. */
int64_t KERNEL(decode_layers_workspace)(const step *s) {
    const int64_t r = s->rows, q = (int64_t)s->heads * s->head_dim, kv = (int64_t)s->kv_heads * s->head_dim;
    return r * (3 * (int64_t)s->hidden + (q + 2 * kv) + q + 2 * kv + q + 3 * (int64_t)s->inter);
}

/* Returns 0, or the failing kernel's status (the caller then runs the layers its own way). */
int KERNEL(decode_layers)(const kernels *kn, const layer *layers, int n_layers, const step *s, const elem_t *x_in,
                          elem_t *workspace) {
    const int rows = s->rows, hidden = s->hidden, inter = s->inter;
    const int q_width = s->heads * s->head_dim, kv_width = s->kv_heads * s->head_dim;
    const int qkv_width = q_width + 2 * kv_width;
    elem_t *x = workspace, *residual = x + (int64_t)rows * hidden, *h = residual + (int64_t)rows * hidden;
    elem_t *qkv = h + (int64_t)rows * hidden, *q = qkv + (int64_t)rows * qkv_width;
    elem_t *k_new = q + (int64_t)rows * q_width, *v_new = k_new + (int64_t)rows * kv_width;
    elem_t *attn = v_new + (int64_t)rows * kv_width, *gate_up = attn + (int64_t)rows * q_width;
    elem_t *act = gate_up + (int64_t)rows * 2 * inter;
    int status;

    memcpy(residual, x_in, sizeof(elem_t) * (size_t)rows * hidden);
    for (int i = 0; i < n_layers; i++) {
        const layer *L = &layers[i];
        if (i == 0) /* the residual stream starts as the embeddings */
            kn->norm(x_in, hidden, 1, NULL, L->norm1, h, rows, hidden, L->norm1_eps);
        else
            kn->norm(x, hidden, 1, residual, L->norm1, h, rows, hidden, L->norm1_eps);
        if ((status = project(kn, &L->qkv, h, qkv, rows))) return status;
        kn->qkv(qkv, qkv_width, 1, L->q_norm, L->k_norm, L->qk_norm_eps, s->cos, s->sin, s->rope_stride, s->slots,
                L->k_cache, L->v_cache, q, k_new, v_new, rows, s->heads, s->kv_heads, s->head_dim);
        if (s->decodes &&
            (status = kn->attention(q, L->k_cache, L->v_cache, s->decode_tables, s->decode_seq_lens, attn,
                                    s->decodes, s->heads, s->kv_heads, s->head_dim, s->block_size,
                                    s->decode_max_blocks, L->scale, 0)))
            return status;
        if (s->prefills &&
            (status = kn->prefill_attention(q, L->k_cache, L->v_cache, s->prefill_tables, s->prefill_max_blocks,
                                            s->prefill_segments, s->prefills, attn, s->heads, s->kv_heads,
                                            s->head_dim, s->block_size, L->scale)))
            return status;
        if ((status = project(kn, &L->o, attn, x, rows))) return status;
        kn->norm(x, hidden, 1, residual, L->norm2, h, rows, hidden, L->norm2_eps);
        if (kn->amx && L->gated_tiles && rows >= L->gated_min_rows) {
            status = kn->amx(h, hidden, L->gated_tiles, L->gated_bias, act, inter, rows, 2 * inter, hidden, 1);
            if (status) return status;
        } else {
            if ((status = project(kn, &L->gate_up, h, gate_up, rows))) return status;
            kn->silu_mul(gate_up, 2 * inter, inter, act, inter, rows, inter);
        }
        if ((status = project(kn, &L->down, act, x, rows))) return status;
    }
    return 0;
}
