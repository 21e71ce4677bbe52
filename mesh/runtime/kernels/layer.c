/*
 * A stage's decoder layers in one call (mesh/runtime/native_layers.py): for bfloat16
 * stages whose linears all run on the quantised kernels (int4 or int8), every layer
 * of the stage over a frame's rows without going back to Python between the steps
 * of a layer. The Python path spends about a third of a one-row step between kernels
 * (torch's element-wise operations, their dispatch, the kernels' call set-up); here
 * those steps are loops over the rows.
 *
 * Per layer, each row on its own (row-invariant, as the kernels it calls):
 *   states = rms_norm(hidden, input_norm)                      (norm.c)
 *   qkv    = states W_qkv                                      (qmatmul.c)
 *   q, k   rotated: bf16(bf16(x cos) + bf16-free(swap(x) sin)) (the Python path's
 *          two rounding steps: the product, then the sum with the second product)
 *   att    = attention over each segment's cache, new keys and values written first
 *                                                              (attend.c)
 *   hidden = bf16(hidden + att W_o)
 *   states = rms_norm(hidden, post_norm)
 *   gate, up = states W_gate_up
 *   hidden = bf16(hidden + bf16(bf16(silu(gate)) up) W_down)
 * Every sum and product of the element-wise steps is rounded to float32 on its own
 * (no fused multiply-add), then to bfloat16, as torch's bfloat16 operations do.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

void mesh_rms_norm(const void *x, int bf16, int64_t rows, int64_t dim, const void *weight,
                   float eps, void *out);
void mesh_int4_matmul(const void *x, int bf16, int64_t rows, int64_t k, int64_t n, int64_t group,
                      const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                      void *y, int8_t *codes, float *dscale, float *sums, float *acc,
                      int threads);
void mesh_int8_matmul(const void *x, int bf16, int64_t rows, int64_t k, int64_t n,
                      const uint8_t *packed, const float *scales, void *y, int8_t *codes,
                      float *dscale, int32_t *block_sums, float *acc, int threads);
int mesh_attend(const void *qkv, int64_t stride, int dtype, int64_t heads, int64_t kv_heads,
                int64_t dim, float scaling, const int64_t *table, int64_t segments, void *out,
                int threads);

/* One quantised linear as the kernels hold it. */
typedef struct {
    int64_t int8; /* 0: int4 codes, group-wise scales and mins; 1: int8 rows */
    const uint8_t *packed;
    const void *scales; /* int4: float16 [N / 16, groups, 16]; int8: float32 [N] */
    const uint16_t *mins;
    int64_t n, k, group;
    const uint16_t *bias; /* bfloat16 [N], or NULL */
} Linear;

typedef struct {
    Linear qkv, o, gate_up, down;
    const uint16_t *input_norm, *post_norm; /* bfloat16 [hidden] */
    int64_t sliding;                        /* attends over the model's window */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scaling;
} Shape;

/* Per-call buffers of the quantised kernels (mesh/runtime/qkernels.py's _Workspace),
   sized for the widest linear of the stage. */
typedef struct {
    int8_t *codes;
    float *dscale, *sums, *acc;
} Work;

static inline __mmask16 tail(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

static void add_into(uint16_t *hidden, const uint16_t *add, int64_t count);

/* y = x W (+ bias, added in bfloat16 as torch adds it). */
static void linear(const Linear *l, const void *x, int64_t rows, void *y, const Work *w,
                   int threads) {
    if (l->int8)
        mesh_int8_matmul(x, 1, rows, l->k, l->n, l->packed, (const float *)l->scales, y, w->codes,
                         w->dscale, (int32_t *)w->sums, w->acc, threads);
    else
        mesh_int4_matmul(x, 1, rows, l->k, l->n, l->group, l->packed, (const uint16_t *)l->scales,
                         l->mins, y, w->codes, w->dscale, w->sums, w->acc, threads);
    if (l->bias != NULL)
        for (int64_t t = 0; t < rows; ++t) add_into((uint16_t *)y + t * l->n, l->bias, l->n);
}

/* 16 bfloat16 values as float32 (those under keep; the others 0). */
static inline __m512 bf(const uint16_t *p, __mmask16 keep) { return from_bf16(p, keep); }

/* A float32 result rounded to bfloat16 and widened back (what a bfloat16 tensor
   holds between two torch operations). */
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

/* a * b rounded to float32, kept apart from any later addition (no contraction into
   a fused multiply-add). */
static inline __m512 product(__m512 a, __m512 b) {
    __m512 p = _mm512_mul_ps(a, b);
    __asm__("" : "+v"(p));
    return p;
}

/* Rotary position embedding on the first `count` heads of each row, in place:
   x' = bf16(bf16(x cos) + swap(x) sin), swap exchanging the two halves of a head and
   sin carrying the sign of the half it lands in (mesh/runtime/rotary.py). */
static void rotate(uint16_t *qkv, int64_t rows, int64_t stride, int64_t count, int64_t dim,
                   const uint16_t *cos, const uint16_t *sin) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < rows; ++t) {
        const uint16_t *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < count; ++h) {
            uint16_t *x = qkv + t * stride + h * dim;
            for (int64_t i = 0; i < half; i += 16) {
                const __mmask16 keep = tail(half - i);
                const __m512 lo = bf(x + i, keep), hi = bf(x + half + i, keep);
                const __m512 new_lo = _mm512_add_ps(round_bf16(product(lo, bf(c + i, keep))),
                                                    product(hi, bf(s + i, keep)));
                const __m512 new_hi =
                    _mm512_add_ps(round_bf16(product(hi, bf(c + half + i, keep))),
                                  product(lo, bf(s + half + i, keep)));
                _mm256_mask_storeu_epi16(x + i, keep, to_bf16(new_lo));
                _mm256_mask_storeu_epi16(x + half + i, keep, to_bf16(new_hi));
            }
        }
    }
}

/* hidden = bf16(hidden + add), both [rows, dim] bfloat16. */
static void add_into(uint16_t *hidden, const uint16_t *add, int64_t count) {
    for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 keep = tail(count - i);
        const __m512 sum = _mm512_add_ps(bf(hidden + i, keep), bf(add + i, keep));
        _mm256_mask_storeu_epi16(hidden + i, keep, to_bf16(sum));
    }
}

/* exp(x), x clamped to [-87, 88] (beyond, the silu below is already exact in
   bfloat16). */
static inline __m512 exp_clamped(__m512 x) {
    return exp_in_range(
        _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f)));
}

/* act[t] = bf16(bf16(silu(gate)) * up) for gate_up rows [gate | up] of width 2 I. */
static void silu_times(const uint16_t *gate_up, int64_t rows, int64_t inner, uint16_t *act) {
    for (int64_t t = 0; t < rows; ++t) {
        const uint16_t *gate = gate_up + t * 2 * inner, *up = gate + inner;
        for (int64_t i = 0; i < inner; i += 16) {
            const __mmask16 keep = tail(inner - i);
            const __m512 g = bf(gate + i, keep);
            const __m512 e = exp_clamped(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            _mm256_mask_storeu_epi16(act + t * inner + i, keep,
                                     to_bf16(_mm512_mul_ps(silu, bf(up + i, keep))));
        }
    }
}

/*
 * Every layer of `layers` over the frame's rows: `hidden` bfloat16 [rows, H], updated
 * in place; cos and sin bfloat16 [rows, D]; `segments` int64 [count, 7]: first row,
 * first position, rows, the model's sliding window (0: none), cache capacity C,
 * address of the first layer's cache [2, kv_heads, C, D], bytes from one layer's
 * cache to the next. `scratch`: bfloat16 room for mesh_layers_scratch(shape, rows)
 * values. Returns 0, or the attention kernel's status.
 */
int mesh_layers(const Layer *layers, int64_t layer_count, const Shape *shape, void *hidden,
                int64_t rows, const void *cos, const void *sin, const int64_t *segments,
                int64_t segment_count, void *scratch, int8_t *codes, float *dscale, float *sums,
                float *acc, int threads) {
    const int64_t H = shape->hidden, D = shape->head_dim, I = shape->intermediate;
    const int64_t qkv_width = (shape->heads + 2 * shape->kv_heads) * D;
    const int64_t q_width = shape->heads * D;
    uint16_t *states = (uint16_t *)scratch;
    uint16_t *qkv = states + rows * H;
    uint16_t *attended = qkv + rows * qkv_width;
    uint16_t *gate_up = attended + rows * q_width;
    uint16_t *act = gate_up + rows * 2 * I;
    uint16_t *out = act + rows * I;
    int64_t *table = (int64_t *)malloc((size_t)(segment_count > 0 ? segment_count : 1) * 6 * 8);
    if (table == NULL) return -1;
    const Work work = {codes, dscale, sums, acc};
    int status = 0;
    for (int64_t l = 0; l < layer_count && status == 0; ++l) {
        const Layer *layer = &layers[l];
        mesh_rms_norm(hidden, 1, rows, H, layer->input_norm, shape->eps, states);
        linear(&layer->qkv, states, rows, qkv, &work, threads);
        rotate(qkv, rows, qkv_width, shape->heads + shape->kv_heads, D, (const uint16_t *)cos,
               (const uint16_t *)sin);
        for (int64_t s = 0; s < segment_count; ++s) {
            const int64_t *seg = segments + s * 7;
            int64_t *to = table + s * 6;
            to[0] = seg[0];
            to[1] = seg[1];
            to[2] = seg[2];
            to[3] = layer->sliding ? seg[3] : 0;
            to[4] = seg[4];
            to[5] = seg[5] + l * seg[6];
        }
        status = mesh_attend(qkv, qkv_width, 1, shape->heads, shape->kv_heads, D, shape->scaling,
                             table, segment_count, attended, threads);
        if (status != 0) break;
        linear(&layer->o, attended, rows, out, &work, threads);
        add_into((uint16_t *)hidden, out, rows * H);
        mesh_rms_norm(hidden, 1, rows, H, layer->post_norm, shape->eps, states);
        linear(&layer->gate_up, states, rows, gate_up, &work, threads);
        silu_times(gate_up, rows, I, act);
        linear(&layer->down, act, rows, out, &work, threads);
        add_into((uint16_t *)hidden, out, rows * H);
    }
    free(table);
    return status;
}

/* bfloat16 values of scratch mesh_layers needs for `rows` rows. */
int64_t mesh_layers_scratch(const Shape *shape, int64_t rows) {
    const int64_t D = shape->head_dim;
    const int64_t qkv_width = (shape->heads + 2 * shape->kv_heads) * D;
    return rows * (2 * shape->hidden + qkv_width + shape->heads * D + 3 * shape->intermediate);
}
