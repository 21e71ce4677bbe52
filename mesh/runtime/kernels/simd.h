/*
 * Conversions shared by the stage's CPU kernels (qmatmul.c, attend.c).
 */
#ifndef MESH_SIMD_H
#define MESH_SIMD_H

#include <immintrin.h>
#include <pthread.h>
#include <stddef.h>
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

/* exp(x) for x in [-87, 88] (callers clamp): 2^n * p(r), x = n ln2 + r, relative
   error about 2e-7. */
static inline __m512 exp_in_range(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Threads a kernel call splits over, at most. */
#define MAX_THREADS 64

/* Run `work` on `count` items laid out `size` bytes apart from `items`: item 0 on
   the calling thread, each other one on a thread of its own (or on the calling
   thread where no thread can be had). Returns 1 where any call returned non-NULL. */
static inline int run_on_threads(void *(*work)(void *), void *items, size_t size, int count) {
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (count > MAX_THREADS) count = MAX_THREADS;
    char *base = (char *)items;
    for (int t = 1; t < count; ++t)
        started[t] = pthread_create(&ids[t], NULL, work, base + t * size) == 0;
    int failed = work(base) != NULL;
    for (int t = 1; t < count; ++t) {
        void *result = NULL;
        if (started[t])
            pthread_join(ids[t], &result);
        else
            result = work(base + t * size);
        failed |= result != NULL;
    }
    return failed;
}

#endif
