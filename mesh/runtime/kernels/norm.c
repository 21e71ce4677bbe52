/*
 * RMSNorm of rows, as transformers' LlamaRMSNorm computes it: the statistics in
 * float32, the normalised value rounded to the input's dtype, then multiplied by
 * the weight in that dtype.
 *
 *   out[r] = weight * dtype(x[r] * 1 / sqrt(mean(x[r]^2) + eps))
 *
 * x, weight and out are float32 (bf16 = 0) or bfloat16 (bf16 = 1), rows of `dim`
 * contiguous values. Each row goes through the same operations in the same order
 * whatever the other rows are (16 lanes of squares summed along the row, then one
 * fixed reduction), so the result of a row does not depend on its neighbours.
 */
#include "simd.h"

static inline __m512 load_row(const void *base, int bf16, int64_t at, __mmask16 keep) {
    if (bf16)
        return from_bf16((const uint16_t *)base + at, keep);
    return _mm512_maskz_loadu_ps(keep, (const float *)base + at);
}

/* The lanes of a 16-lane step that lie within `left` values. */
static inline __mmask16 tail(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

void mesh_rms_norm(const void *x, int bf16, int64_t rows, int64_t dim, const void *weight,
                   float eps, void *out) {
    for (int64_t r = 0; r < rows; ++r) {
        int64_t row = r * dim;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += 16) {
            __mmask16 keep = tail(dim - i);
            __m512 v = load_row(x, bf16, row + i, keep);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        float mean = _mm512_reduce_add_ps(squares) / (float)dim;
        float root = _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(mean + eps)));
        __m512 scale = _mm512_set1_ps(1.0f / root);
        for (int64_t i = 0; i < dim; i += 16) {
            __mmask16 keep = tail(dim - i);
            __m512 normed = _mm512_mul_ps(load_row(x, bf16, row + i, keep), scale);
            __m512 w = load_row(weight, bf16, i, keep);
            if (bf16) {
                /* the normalised value in bfloat16, then the product rounded again */
                __m512 rounded = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(normed)), 16));
                _mm256_mask_storeu_epi16((uint16_t *)out + row + i, keep,
                                         to_bf16(_mm512_mul_ps(w, rounded)));
            } else {
                _mm512_mask_storeu_ps((float *)out + row + i, keep, _mm512_mul_ps(w, normed));
            }
        }
    }
}
