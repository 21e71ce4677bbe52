/*
 * Quantised matrix products for CPU stages: int8 activations times int4 (group-wise,
 * asymmetric) or int8 (per output channel) weights, with AVX-512 VNNI dot products.
 * Built and loaded by mesh/runtime/native.py.
 *
 * Every row of the input is computed on its own, in one fixed order, so a row's
 * result never depends on the rows beside it or on the thread count
 * (mesh/runtime/invariant.py), and a weight tile is decoded once per call whatever
 * the number of rows: the cost of a call grows slowly with rows, where torch's
 * weight-only kernels decode the weight again for every four rows.
 *
 * Activations are quantised per row in blocks of 32 values, in two int8 parts:
 * d = max|a| / 127, hi = round(a / d), lo = round((a / d - hi) * 254) (half to
 * even), so a = d * (hi + lo / 254) to within d / 508: about 16 bits per value,
 * finer than the bfloat16 activations torch's kernels take. A block of a row
 * against 16 outputs is two exact int32 dot products per output; blocks are
 * combined in float32 in order of k.
 *
 * int4 layout (mesh_pack_int4): outputs in blocks of 16, k in steps of 8; each step
 * is 64 bytes, byte 4 j + t holding code q[16 b + j][8 s + t] in its low nibble and
 * q[16 b + j][8 s + 4 + t] in its high nibble. W[n, k] = q * scale[g, n] + min[g, n]
 * for group g = k / group, so sum_k a W = sum_g (scale * sum_k a q + min * sum_k a),
 * the second sum taken over the float activations.
 *
 * int8 layout (mesh_pack_int8): outputs in blocks of 16, k in steps of 4; each step
 * 64 bytes, byte 4 j + t = w[16 b + j][4 s + t] + 128. VNNI multiplies unsigned by
 * signed bytes, so weights are offset by 128 and 128 * sum_k a_q is taken off per
 * block of a row.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define QBLOCK 32
/* How far ahead of the block being multiplied the weight's cache lines are asked
   for (bytes; 0: not at all). A weight is read once per call, mostly from memory:
   without these hints a one-row call ran at about 2/3 of this machine's read
   bandwidth and the integer work of more rows did not overlap the reads. Set by the
   caller (mesh_set_fetch_ahead). */
static int64_t fetch_distance = 2048;

void mesh_set_fetch_ahead(int64_t bytes) { fetch_distance = bytes; }

/* Ask for the cache lines fetch_distance bytes past the `bytes` bytes at `p` (a
   hint: no fault past the end of the weight). */
static inline void fetch_ahead(const uint8_t *p, int64_t bytes) {
    if (fetch_distance <= 0) return;
    for (int64_t at = 0; at < bytes; at += 64)
        _mm_prefetch((const char *)p + fetch_distance + at, _MM_HINT_T0);
}
/* Calls with fewer multiply-adds than this run on the calling thread alone. */
#define THREADED_MACS (1LL << 24)

typedef struct {
    int int4;
    const uint8_t *packed;
    const int32_t *block_sums;
    const float *scales, *sums, *dscale;
    const uint16_t *half_scales, *half_mins;
    const int8_t *codes;
    void *y; /* float32, or bfloat16 with bf16 set */
    float *acc;
    int64_t rows, k, n, group, first, last;
    int bf16;
} Work;

/* 16 activations as float32, from float32 or bfloat16 (exact). */
static inline __m512 load16(const void *x, int bf16, int64_t index) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + index);
    __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

static inline float load1(const void *x, int bf16, int64_t index) {
    if (!bf16) return ((const float *)x)[index];
    uint32_t bits = (uint32_t)((const uint16_t *)x)[index] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Rows of the codes buffer per part: a multiple of the AMX tile's 16 rows. */
static inline int64_t padded_rows(int64_t rows) { return (rows + 15) / 16 * 16; }

/* Quantise rows*cols float32 activations (cols % 32 == 0) to two int8 codes each
   (hi in the first padded_rows(rows) * cols bytes, lo after them), one scale per block of 32; with
   non-null `sums`, the float32 sum of each group of `group` values in order of k
   (for the int4 min term); with non-null `block_sums`, 128 times the sum of each
   block's codes, 254 * hi + lo (for the int8 offset, [rows, blocks]). */
static void quantise_rows(const void *x, int bf16, int64_t rows, int64_t cols, int64_t group,
                          int8_t *codes, float *scales, float *sums, int32_t *block_sums) {
    const int64_t blocks = cols / QBLOCK;
    for (int64_t m = 0; m < rows; ++m) {
        const int64_t row = m * cols;
        for (int64_t b = 0; b < blocks; ++b) {
            __m512 lo = load16(x, bf16, row + b * QBLOCK), hi = load16(x, bf16, row + b * QBLOCK + 16);
            float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
            scales[m * blocks + b] = mx / 127.0f / 254.0f;
            __m512 vinv = _mm512_set1_ps(inv), fine = _mm512_set1_ps(254.0f);
            /* First and second 16 values of the block: coarse codes, then the rest. */
            __m512 s0 = _mm512_mul_ps(lo, vinv), s1 = _mm512_mul_ps(hi, vinv);
            __m512i c0 = _mm512_cvtps_epi32(s0), c1 = _mm512_cvtps_epi32(s1);
            __m512i f0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(s0, _mm512_cvtepi32_ps(c0)), fine));
            __m512i f1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(s1, _mm512_cvtepi32_ps(c1)), fine));
            int8_t *dst = codes + m * cols + b * QBLOCK;
            int8_t *rest = dst + padded_rows(rows) * cols;
            _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(c0));
            _mm_storeu_si128((__m128i *)(dst + 16), _mm512_cvtsepi32_epi8(c1));
            _mm_storeu_si128((__m128i *)rest, _mm512_cvtsepi32_epi8(f0));
            _mm_storeu_si128((__m128i *)(rest + 16), _mm512_cvtsepi32_epi8(f1));
            if (block_sums) {
                const int32_t coarse = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
                const int32_t rest_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(f0, f1));
                block_sums[m * blocks + b] = 128 * (254 * coarse + rest_sum);
            }
        }
        if (sums) {
            for (int64_t g = 0; g < cols / group; ++g) {
                float s = 0.0f;
                for (int64_t i = 0; i < group; ++i) s += load1(x, bf16, row + g * group + i);
                sums[m * (cols / group) + g] = s;
            }
        }
    }
}

/* A block of 32 k against 16 outputs, from its two exact sums: 254 * hi + lo
   (exact in int32), less the int8 weights' offset, times d / 254 (dscale), added to
   acc. Every path folds a block this way, so they agree bit for bit. */
static inline __m512 fold(__m512i hi, __m512i lo, int32_t offset, float scale, __m512 acc) {
    __m512i value = _mm512_add_epi32(_mm512_mullo_epi32(hi, _mm512_set1_epi32(254)), lo);
    value = _mm512_sub_epi32(value, _mm512_set1_epi32(offset));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(value), _mm512_set1_ps(scale), acc);
}

/* Group g of output block b into every row's outputs: scale * (the group's folded
   blocks, gacc) + min * (the group's activation sum). */
static void add_group(const Work *w, int64_t b, int64_t g, const float *gacc, float *yacc) {
    const int64_t groups = w->k / w->group, at = (b * groups + g) * 16;
    __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->half_scales + at)));
    __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->half_mins + at)));
    for (int64_t m = 0; m < w->rows; ++m) {
        __m512 ya = _mm512_loadu_ps(yacc + m * 16);
        ya = _mm512_fmadd_ps(sc, _mm512_loadu_ps(gacc + m * 16), ya);
        ya = _mm512_fmadd_ps(mn, _mm512_set1_ps(w->sums[m * groups + g]), ya);
        _mm512_storeu_ps(yacc + m * 16, ya);
    }
}

static void store_block(const Work *w, int64_t b, const float *yacc) {
    const int64_t cols = w->n - b * 16 < 16 ? w->n - b * 16 : 16;
    const __mmask16 keep = (__mmask16)((1u << cols) - 1u);
    for (int64_t m = 0; m < w->rows; ++m) {
        const int64_t at = m * w->n + b * 16;
        __m512 v = _mm512_loadu_ps(yacc + m * 16);
        if (w->bf16)
            _mm256_mask_storeu_epi16((uint16_t *)w->y + at, keep, to_bf16(v));
        else
            _mm512_mask_storeu_ps((float *)w->y + at, keep, v);
    }
}

static void int4_blocks(const Work *w) {
    const int64_t rows = w->rows, k = w->k, steps = k / 8, groups = k / w->group;
    const int64_t lo_rows = padded_rows(rows);
    const int64_t qblocks = k / QBLOCK, per_group = w->group / QBLOCK;
    const __m512i nib = _mm512_set1_epi8(0x0F);
    float *yacc = w->acc, *gacc = w->acc + rows * 16;
    for (int64_t b = w->first; b < w->last; ++b) {
        const uint8_t *wb = w->packed + b * steps * 64;
        for (int64_t m = 0; m < rows; ++m) _mm512_storeu_ps(yacc + m * 16, _mm512_setzero_ps());
        for (int64_t g = 0; g < groups; ++g) {
            for (int64_t m = 0; m < rows; ++m) _mm512_storeu_ps(gacc + m * 16, _mm512_setzero_ps());
            for (int64_t qb = 0; qb < per_group; ++qb) {
                const int64_t kb = g * per_group + qb; /* block of 32 along k */
                const uint8_t *wp = wb + kb * 4 * 64;
                fetch_ahead(wp, 256);
                __m512i w0 = _mm512_loadu_si512(wp), w1 = _mm512_loadu_si512(wp + 64);
                __m512i w2 = _mm512_loadu_si512(wp + 128), w3 = _mm512_loadu_si512(wp + 192);
                __m512i l0 = _mm512_and_si512(w0, nib), h0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), nib);
                __m512i l1 = _mm512_and_si512(w1, nib), h1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), nib);
                __m512i l2 = _mm512_and_si512(w2, nib), h2 = _mm512_and_si512(_mm512_srli_epi16(w2, 4), nib);
                __m512i l3 = _mm512_and_si512(w3, nib), h3 = _mm512_and_si512(_mm512_srli_epi16(w3, 4), nib);
                for (int64_t m = 0; m < rows; ++m) {
                    const int32_t *a = (const int32_t *)(w->codes + m * k + kb * QBLOCK);
                    const int32_t *f = (const int32_t *)(w->codes + (lo_rows + m) * k + kb * QBLOCK);
                    __m512i s = _mm512_setzero_si512(), t = _mm512_setzero_si512();
                    s = _mm512_dpbusd_epi32(s, l0, _mm512_set1_epi32(a[0]));
                    t = _mm512_dpbusd_epi32(t, l0, _mm512_set1_epi32(f[0]));
                    s = _mm512_dpbusd_epi32(s, h0, _mm512_set1_epi32(a[1]));
                    t = _mm512_dpbusd_epi32(t, h0, _mm512_set1_epi32(f[1]));
                    s = _mm512_dpbusd_epi32(s, l1, _mm512_set1_epi32(a[2]));
                    t = _mm512_dpbusd_epi32(t, l1, _mm512_set1_epi32(f[2]));
                    s = _mm512_dpbusd_epi32(s, h1, _mm512_set1_epi32(a[3]));
                    t = _mm512_dpbusd_epi32(t, h1, _mm512_set1_epi32(f[3]));
                    s = _mm512_dpbusd_epi32(s, l2, _mm512_set1_epi32(a[4]));
                    t = _mm512_dpbusd_epi32(t, l2, _mm512_set1_epi32(f[4]));
                    s = _mm512_dpbusd_epi32(s, h2, _mm512_set1_epi32(a[5]));
                    t = _mm512_dpbusd_epi32(t, h2, _mm512_set1_epi32(f[5]));
                    s = _mm512_dpbusd_epi32(s, l3, _mm512_set1_epi32(a[6]));
                    t = _mm512_dpbusd_epi32(t, l3, _mm512_set1_epi32(f[6]));
                    s = _mm512_dpbusd_epi32(s, h3, _mm512_set1_epi32(a[7]));
                    t = _mm512_dpbusd_epi32(t, h3, _mm512_set1_epi32(f[7]));
                    __m512 ga = _mm512_loadu_ps(gacc + m * 16);
                    ga = fold(s, t, 0, w->dscale[m * qblocks + kb], ga);
                    _mm512_storeu_ps(gacc + m * 16, ga);
                }
            }
            add_group(w, b, g, gacc, yacc);
        }
        store_block(w, b, yacc);
    }
}

static void int8_blocks(const Work *w) {
    const int64_t rows = w->rows, k = w->k, steps = k / 4, qblocks = k / QBLOCK;
    const int64_t lo_rows = padded_rows(rows);
    float *yacc = w->acc;
    for (int64_t b = w->first; b < w->last; ++b) {
        const uint8_t *wb = w->packed + b * steps * 64;
        for (int64_t m = 0; m < rows; ++m) _mm512_storeu_ps(yacc + m * 16, _mm512_setzero_ps());
        for (int64_t kb = 0; kb < qblocks; ++kb) {
            const uint8_t *wp = wb + kb * 8 * 64;
            fetch_ahead(wp, 512);
            __m512i w0 = _mm512_loadu_si512(wp), w1 = _mm512_loadu_si512(wp + 64);
            __m512i w2 = _mm512_loadu_si512(wp + 128), w3 = _mm512_loadu_si512(wp + 192);
            __m512i w4 = _mm512_loadu_si512(wp + 256), w5 = _mm512_loadu_si512(wp + 320);
            __m512i w6 = _mm512_loadu_si512(wp + 384), w7 = _mm512_loadu_si512(wp + 448);
            for (int64_t m = 0; m < rows; ++m) {
                const int32_t *a = (const int32_t *)(w->codes + m * k + kb * QBLOCK);
                const int32_t *f = (const int32_t *)(w->codes + (lo_rows + m) * k + kb * QBLOCK);
                __m512i s = _mm512_setzero_si512(), t = _mm512_setzero_si512();
                s = _mm512_dpbusd_epi32(s, w0, _mm512_set1_epi32(a[0]));
                t = _mm512_dpbusd_epi32(t, w0, _mm512_set1_epi32(f[0]));
                s = _mm512_dpbusd_epi32(s, w1, _mm512_set1_epi32(a[1]));
                t = _mm512_dpbusd_epi32(t, w1, _mm512_set1_epi32(f[1]));
                s = _mm512_dpbusd_epi32(s, w2, _mm512_set1_epi32(a[2]));
                t = _mm512_dpbusd_epi32(t, w2, _mm512_set1_epi32(f[2]));
                s = _mm512_dpbusd_epi32(s, w3, _mm512_set1_epi32(a[3]));
                t = _mm512_dpbusd_epi32(t, w3, _mm512_set1_epi32(f[3]));
                s = _mm512_dpbusd_epi32(s, w4, _mm512_set1_epi32(a[4]));
                t = _mm512_dpbusd_epi32(t, w4, _mm512_set1_epi32(f[4]));
                s = _mm512_dpbusd_epi32(s, w5, _mm512_set1_epi32(a[5]));
                t = _mm512_dpbusd_epi32(t, w5, _mm512_set1_epi32(f[5]));
                s = _mm512_dpbusd_epi32(s, w6, _mm512_set1_epi32(a[6]));
                t = _mm512_dpbusd_epi32(t, w6, _mm512_set1_epi32(f[6]));
                s = _mm512_dpbusd_epi32(s, w7, _mm512_set1_epi32(a[7]));
                t = _mm512_dpbusd_epi32(t, w7, _mm512_set1_epi32(f[7]));
                const int64_t at = m * qblocks + kb;
                __m512 ya = _mm512_loadu_ps(yacc + m * 16);
                ya = fold(s, t, w->block_sums[at], w->dscale[at], ya);
                _mm512_storeu_ps(yacc + m * 16, ya);
            }
        }
        __m512 sc = _mm512_loadu_ps(w->scales + b * 16);
        for (int64_t m = 0; m < rows; ++m)
            _mm512_storeu_ps(yacc + m * 16, _mm512_mul_ps(sc, _mm512_loadu_ps(yacc + m * 16)));
        store_block(w, b, yacc);
    }
}

#ifdef MESH_AMX
/* AMX: the same exact integer block sums, 16 rows x 16 outputs x 32 k per
   instruction, then the same float32 combination in the same order, so a row's
   result is bit for bit the one the VNNI loops give (calls switch by row count). */
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

static int amx_state = 0; /* 0 unknown, 1 usable, -1 not */

/* Whether the kernel grants this process AMX tile data (asked once). */
int mesh_amx_available(void) {
    if (amx_state == 0)
        amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_state == 1;
}

/* Tiles: 0, 1 int32 results (hi, lo); 2 weights (8 rows of 4 k x 16 outputs);
   3, 4 activation codes (hi, lo: up to 16 rows x 32 k). A call of fewer than 16
   rows gets tiles of just its rows: the multiplies, loads and stores of a tile
   scale with its rows. */
static void amx_configure(int64_t rows) {
    const uint8_t tile_rows = (uint8_t)(rows < 16 ? rows : 16);
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 2; ++t) {
        config.rows[t] = tile_rows;
        config.colsb[t] = 64;
    }
    config.rows[2] = 8;
    config.colsb[2] = 64;
    for (int t = 3; t < 5; ++t) {
        config.rows[t] = tile_rows;
        config.colsb[t] = 32;
    }
    _tile_loadconfig(&config);
}

/* For block kb of one output block, with the weight tile loaded in tile 2: every
   row tile's two int32 sums, offset (int8) and folded into gacc in order. */
static void amx_rows(const Work *w, int64_t kb, float *gacc, int offset) {
    const int64_t rows = w->rows, k = w->k, qblocks = k / QBLOCK, lo_rows = padded_rows(rows);
    int32_t hi[16][16] __attribute__((aligned(64)));
    int32_t lo[16][16] __attribute__((aligned(64)));
    for (int64_t first = 0; first < rows; first += 16) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(3, w->codes + first * k + kb * QBLOCK, k);
        _tile_loadd(4, w->codes + (lo_rows + first) * k + kb * QBLOCK, k);
        _tile_dpbsud(0, 3, 2);
        _tile_dpbsud(1, 4, 2);
        _tile_stored(0, hi, 64);
        _tile_stored(1, lo, 64);
        const int64_t count = rows - first < 16 ? rows - first : 16;
        for (int64_t r = 0; r < count; ++r) {
            const int64_t m = first + r;
            const int64_t at = m * qblocks + kb;
            __m512 ga = _mm512_loadu_ps(gacc + m * 16);
            ga = fold(_mm512_load_si512(hi[r]), _mm512_load_si512(lo[r]),
                      offset ? w->block_sums[at] : 0, w->dscale[at], ga);
            _mm512_storeu_ps(gacc + m * 16, ga);
        }
    }
}

static void int4_blocks_amx(const Work *w) {
    const int64_t rows = w->rows, k = w->k, steps = k / 8, groups = k / w->group;
    const int64_t per_group = w->group / QBLOCK;
    const __m512i nib = _mm512_set1_epi8(0x0F);
    uint8_t tile[8][64] __attribute__((aligned(64)));
    float *yacc = w->acc, *gacc = w->acc + rows * 16;
    amx_configure(w->rows);
    for (int64_t b = w->first; b < w->last; ++b) {
        const uint8_t *wb = w->packed + b * steps * 64;
        for (int64_t m = 0; m < rows; ++m) _mm512_storeu_ps(yacc + m * 16, _mm512_setzero_ps());
        for (int64_t g = 0; g < groups; ++g) {
            for (int64_t m = 0; m < rows; ++m) _mm512_storeu_ps(gacc + m * 16, _mm512_setzero_ps());
            for (int64_t qb = 0; qb < per_group; ++qb) {
                const int64_t kb = g * per_group + qb;
                const uint8_t *wp = wb + kb * 4 * 64;
                fetch_ahead(wp, 256);
                for (int i = 0; i < 4; ++i) {
                    __m512i v = _mm512_loadu_si512(wp + 64 * i);
                    _mm512_store_si512(tile[2 * i], _mm512_and_si512(v, nib));
                    _mm512_store_si512(tile[2 * i + 1], _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
                }
                _tile_loadd(2, tile, 64);
                amx_rows(w, kb, gacc, 0);
            }
            add_group(w, b, g, gacc, yacc);
        }
        store_block(w, b, yacc);
    }
    _tile_release();
}

static void int8_blocks_amx(const Work *w) {
    const int64_t rows = w->rows, k = w->k, steps = k / 4, qblocks = k / QBLOCK;
    float *yacc = w->acc;
    amx_configure(w->rows);
    for (int64_t b = w->first; b < w->last; ++b) {
        const uint8_t *wb = w->packed + b * steps * 64;
        for (int64_t m = 0; m < rows; ++m) _mm512_storeu_ps(yacc + m * 16, _mm512_setzero_ps());
        for (int64_t kb = 0; kb < qblocks; ++kb) {
            fetch_ahead(wb + kb * 8 * 64, 512);
            _tile_loadd(2, wb + kb * 8 * 64, 64);
            amx_rows(w, kb, yacc, 1);
        }
        __m512 sc = _mm512_loadu_ps(w->scales + b * 16);
        for (int64_t m = 0; m < rows; ++m)
            _mm512_storeu_ps(yacc + m * 16, _mm512_mul_ps(sc, _mm512_loadu_ps(yacc + m * 16)));
        store_block(w, b, yacc);
    }
    _tile_release();
}
#else
int mesh_amx_available(void) { return 0; }
#endif

/* Calls of at least this many rows use AMX where it is available, one threshold
   for int4 weights and one for int8 (set by the caller, mesh_set_amx_rows; 0 turns
   AMX off for that kind). */
static int64_t amx_int4_from = 0, amx_int8_from = 0;

void mesh_set_amx_rows(int64_t int4_rows, int64_t int8_rows) {
    amx_int4_from = int4_rows;
    amx_int8_from = int8_rows;
}

static void *run_work(void *arg) {
    const Work *w = (const Work *)arg;
#ifdef MESH_AMX
    const int64_t from = w->int4 ? amx_int4_from : amx_int8_from;
    if (from > 0 && w->rows >= from && amx_state == 1) {
        if (w->int4)
            int4_blocks_amx(w);
        else
            int8_blocks_amx(w);
        return NULL;
    }
#endif
    if (w->int4)
        int4_blocks(w);
    else
        int8_blocks(w);
    return NULL;
}

/* Output blocks split over up to `threads` threads (each with its own accumulators
   in `acc`, 2 * rows * 16 floats per thread); small calls stay on this thread. */
static void run_split(Work base, int threads) {
    const int64_t nblocks = (base.n + 15) / 16;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > nblocks) threads = (int)nblocks;
    if (threads < 2 || base.rows * base.n * base.k < THREADED_MACS) {
        base.first = 0;
        base.last = nblocks;
        run_work(&base);
        return;
    }
    Work parts[MAX_THREADS];
    for (int t = 0; t < threads; ++t) {
        parts[t] = base;
        parts[t].first = nblocks * t / threads;
        parts[t].last = nblocks * (t + 1) / threads;
        parts[t].acc = base.acc + (int64_t)t * 2 * base.rows * 16;
    }
    run_on_threads(run_work, parts, sizeof parts[0], threads);
}

/* Codes [n, k] (uint8 0..15, row-major) into the int4 layout above; outputs past
   `n` up to a multiple of 16 are zero codes. */
void mesh_pack_int4(const uint8_t *codes, int64_t n, int64_t k, uint8_t *out) {
    const int64_t nblocks = (n + 15) / 16, steps = k / 8;
    for (int64_t b = 0; b < nblocks; ++b)
        for (int64_t s = 0; s < steps; ++s) {
            uint8_t *dst = out + (b * steps + s) * 64;
            for (int j = 0; j < 16; ++j)
                for (int t = 0; t < 4; ++t) {
                    const int64_t row = b * 16 + j;
                    uint8_t lo = 0, hi = 0;
                    if (row < n) {
                        lo = codes[row * k + 8 * s + t] & 15;
                        hi = codes[row * k + 8 * s + 4 + t] & 15;
                    }
                    dst[4 * j + t] = (uint8_t)(lo | (hi << 4));
                }
        }
}

/* y [rows, n] = x [rows, k] times the int4 weight; scales and mins float16 (as
   packages store them) [n rounded up to 16 / 16, k / group, 16]: an output block's
   scales together, read in order (a [groups, n] layout strided them by n). x and y
   are float32, or bfloat16 with bf16 set (y rounded to nearest even). Work buffers:
   codes int8 [2, rows rounded up to 16, k], dscale [rows, k / 32], sums [rows, k /
   group], acc [threads, 2, rows, 16] float32. */
void mesh_int4_matmul(const void *x, int bf16, int64_t rows, int64_t k, int64_t n, int64_t group,
                      const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                      void *y, int8_t *codes, float *dscale, float *sums, float *acc,
                      int threads) {
    quantise_rows(x, bf16, rows, k, group, codes, dscale, sums, NULL);
    Work w = {1, packed, NULL, NULL, sums, dscale, scales, mins, codes, y, acc,
              rows, k, n, group, 0, 0, bf16};
    run_split(w, threads);
}

/* Weights [n, k] int8 into the int8 layout above (offset to unsigned); outputs past
   `n` up to a multiple of 16 are zero weights. */
void mesh_pack_int8(const int8_t *weight, int64_t n, int64_t k, uint8_t *out) {
    const int64_t nblocks = (n + 15) / 16, steps = k / 4;
    for (int64_t b = 0; b < nblocks; ++b)
        for (int64_t s = 0; s < steps; ++s) {
            uint8_t *dst = out + (b * steps + s) * 64;
            for (int j = 0; j < 16; ++j)
                for (int t = 0; t < 4; ++t) {
                    const int64_t row = b * 16 + j;
                    const int value = row < n ? weight[row * k + 4 * s + t] : 0;
                    dst[4 * j + t] = (uint8_t)(value + 128);
                }
        }
}

/* y [rows, n] = x [rows, k] times the int8 weight with float32 scales [n rounded up
   to 16]. Work buffers as mesh_int4_matmul, with block_sums int32 [rows, k / 32] in
   place of sums. */
void mesh_int8_matmul(const void *x, int bf16, int64_t rows, int64_t k, int64_t n,
                      const uint8_t *packed, const float *scales, void *y, int8_t *codes,
                      float *dscale, int32_t *block_sums, float *acc, int threads) {
    quantise_rows(x, bf16, rows, k, k, codes, dscale, NULL, block_sums);
    Work w = {0, packed, block_sums, scales, NULL, dscale, NULL, NULL, codes, y, acc,
              rows, k, n, k, 0, 0, bf16};
    run_split(w, threads);
}
