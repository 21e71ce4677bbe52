/*
 * Conversions shared by the stage's CPU kernels (qmatmul.c, attend.c).
 */
#ifndef MESH_SIMD_H
#define MESH_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* float32 to bfloat16, rounding to nearest even as torch does (NaN stays NaN). */
static inline __m256i to_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* 16 bfloat16 values (those under `keep`; the others 0) as float32, exactly. */
static inline __m512 from_bf16(const uint16_t *p, __mmask16 keep) {
    __m256i half = _mm256_maskz_loadu_epi16(keep, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

#endif
