/*
 * Causal attention of a batched frame's rows, each session over its own key/value
 * cache, in one call per layer (mesh/runtime/native_attention.py).
 *
 * Every (query row, head) is computed on its own by the same sequence of operations
 * whatever the other rows of the frame are, so a row's result is the same alone, in
 * a verify window, in a prefill chunk cut anywhere or beside other sessions' rows
 * (mesh/runtime/invariant.py), and the same with any thread count: a query at
 * position p sees the keys lo .. p (lo = 0, or p - window + 1 on sliding layers) and
 * nothing else; there is no padding and no mask.
 *
 * Arithmetic, in float32 for every storage dtype (float32, bfloat16, float16):
 * score_j = (q . k_j) * scaling, the dot product over the head dimension in lanes
 * of 16 reduced in a fixed tree; m = max score; e_j = exp(score_j - m) (polynomial
 * exp, relative error about 2e-7); out = (sum_j e_j v_j) / (sum_j e_j), both sums in
 * order of j (the second in 16 lanes by j mod 16, then a fixed tree).
 *
 * Segment table (int64 [segments, 6]): first row in the frame, first position, row
 * count, window (0: none), cache capacity C, address of the layer's cache
 * [2, kv_heads, C, D] (keys, then values) in the storage dtype. The segment's new
 * keys and values (already rotated) are read from the q/k/v rows and written to the
 * cache before any row attends.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* Calls with fewer multiply-adds than this run on the calling thread alone. */
#define THREADED_MACS (1LL << 22)
/* Head dimensions up to this many lanes of 16 (D <= 256). */
#define MAX_CHUNKS 16
/* Query heads per key/value head, at most. */
#define MAX_GROUPS 64

enum { F32 = 0, BF16 = 1, F16 = 2 };

typedef struct {
    const void *qkv;
    void *out;
    const int64_t *table;
    int64_t stride, heads, kv_heads, dim, segments;
    int64_t first, last; /* this worker's units: (row, kv head) pairs, in order */
    float scaling;
    int dtype;
    int64_t most_keys;
} Job;

static inline int64_t elem_size(int dtype) { return dtype == F32 ? 4 : 2; }

static inline __m512 load(const void *base, int dtype, int64_t at, __mmask16 keep) {
    if (dtype == F32) return _mm512_maskz_loadu_ps(keep, (const float *)base + at);
    if (dtype == BF16) return from_bf16((const uint16_t *)base + at, keep);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, (const uint16_t *)base + at));
}

static inline void store(void *base, int dtype, int64_t at, __m512 v, __mmask16 keep) {
    if (dtype == F32)
        _mm512_mask_storeu_ps((float *)base + at, keep, v);
    else if (dtype == BF16)
        _mm256_mask_storeu_epi16((uint16_t *)base + at, keep, to_bf16(v));
    else
        _mm256_mask_storeu_epi16((uint16_t *)base + at, keep,
                                 _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* exp(x) for x <= 0 (scores minus their maximum). */
static inline __m512 exp_nonpositive(__m512 x) {
    return exp_in_range(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)));
}

static inline __mmask16 lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* Find unit `index`'s segment and row. */
static void locate(const Job *job, int64_t unit, int64_t *segment, int64_t *offset) {
    int64_t before = 0;
    for (int64_t s = 0; s < job->segments; ++s) {
        const int64_t units = job->table[s * 6 + 2] * job->kv_heads;
        if (unit < before + units) {
            *segment = s;
            *offset = unit - before;
            return;
        }
        before += units;
    }
    *segment = job->segments;
    *offset = 0;
}

/* The lane sums of 16 vectors, one per lane of the result (v[j]'s sum in lane j).
   Every vector's lanes are added in the same tree: within 128-bit lanes (l, l + 2),
   then the pairs, then across 128-bit lanes. */
static inline __m512 sum_lanes16(__m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i)
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                         _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

/* Scratch of one worker: scores [groups, most_keys], a key block [16, chunks * 16]
   and the queries [groups, chunks * 16], in float32. */
typedef struct {
    float *scores, *keys, *queries;
} Scratch;

/* One query row against one key/value head: its `groups` query heads. `chunks` is
   a constant where this is inlined, so the loops over it unroll into registers. */
static inline __attribute__((always_inline)) void attend_unit_with(
    const Job *job, const int64_t *seg, int64_t i, int64_t g, const Scratch *work,
    const int64_t chunks) {
    const int64_t dim = job->dim, groups = job->heads / job->kv_heads, width = chunks * 16;
    const int64_t row = seg[0] + i, position = seg[1] + i, window = seg[3], capacity = seg[4];
    const int64_t lo = (window > 0 && position >= window) ? position - window + 1 : 0;
    const int64_t keys = position - lo + 1;
    const int dtype = job->dtype;
    const char *cache = (const char *)(intptr_t)seg[5];
    const int64_t size = elem_size(dtype);
    const void *kbase = cache + (g * capacity + lo) * dim * size;
    const void *vbase = cache + ((job->kv_heads + g) * capacity + lo) * dim * size;
    const void *qrow = (const char *)job->qkv + row * job->stride * size;
    for (int64_t h = 0; h < groups; ++h)
        for (int64_t c = 0; c < chunks; ++c)
            _mm512_storeu_ps(work->queries + h * width + c * 16,
                             load(qrow, dtype, (g * groups + h) * dim + c * 16, lanes(dim - c * 16)));
    const __m512 scaling = _mm512_set1_ps(job->scaling);
    __m512 top[MAX_GROUPS];
    for (int64_t h = 0; h < groups; ++h) top[h] = _mm512_set1_ps(-INFINITY);
    for (int64_t first = 0; first < keys; first += 16) {
        const int64_t count = keys - first < 16 ? keys - first : 16;
        for (int64_t j = 0; j < 16; ++j)
            for (int64_t c = 0; c < chunks; ++c)
                _mm512_storeu_ps(work->keys + j * width + c * 16,
                                 j < count ? load(kbase, dtype, (first + j) * dim + c * 16, lanes(dim - c * 16))
                                           : _mm512_setzero_ps());
        for (int64_t h = 0; h < groups; ++h) {
            __m512 acc[16];
            for (int64_t j = 0; j < 16; ++j) {
                acc[j] = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks; ++c)
                    acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(work->queries + h * width + c * 16),
                                             _mm512_loadu_ps(work->keys + j * width + c * 16), acc[j]);
            }
            const __m512 score = _mm512_mul_ps(sum_lanes16(acc), scaling);
            const __mmask16 keep = lanes(count);
            _mm512_mask_storeu_ps(work->scores + h * job->most_keys + first, keep, score);
            top[h] = _mm512_mask_max_ps(top[h], keep, top[h], score);
        }
    }
    float denominators[MAX_GROUPS];
    for (int64_t h = 0; h < groups; ++h) {
        float *s = work->scores + h * job->most_keys;
        const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top[h]));
        __m512 total = _mm512_setzero_ps();
        for (int64_t j = 0; j < keys; j += 16) {
            const __mmask16 keep = lanes(keys - j);
            const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + j), peak));
            total = _mm512_mask_add_ps(total, keep, total, e);
            _mm512_mask_storeu_ps(s + j, keep, e);
        }
        denominators[h] = _mm512_reduce_add_ps(total);
    }
    /* Values: heads in batches whose accumulators fit in 16 registers. */
    const int64_t batch = chunks >= 16 ? 1 : 16 / chunks;
    for (int64_t h0 = 0; h0 < groups; h0 += batch) {
        const int64_t heads = groups - h0 < batch ? groups - h0 : batch;
        __m512 acc[16];
        for (int64_t a = 0; a < 16; ++a) acc[a] = _mm512_setzero_ps();
        for (int64_t j = 0; j < keys; ++j) {
            for (int64_t c = 0; c < chunks; ++c) {
                const __m512 v = load(vbase, dtype, j * dim + c * 16, lanes(dim - c * 16));
                for (int64_t h = 0; h < heads; ++h)
                    acc[h * chunks + c] = _mm512_fmadd_ps(
                        _mm512_set1_ps(work->scores[(h0 + h) * job->most_keys + j]), v, acc[h * chunks + c]);
            }
        }
        for (int64_t h = 0; h < heads; ++h) {
            const __m512 denominator = _mm512_set1_ps(denominators[h0 + h]);
            for (int64_t c = 0; c < chunks; ++c)
                store(job->out, dtype, row * job->heads * dim + (g * groups + h0 + h) * dim + c * 16,
                      _mm512_div_ps(acc[h * chunks + c], denominator), lanes(dim - c * 16));
        }
    }
}

static void attend_unit(const Job *job, const int64_t *seg, int64_t i, int64_t g, const Scratch *work) {
    switch ((job->dim + 15) / 16) {
    case 1: attend_unit_with(job, seg, i, g, work, 1); break;
    case 2: attend_unit_with(job, seg, i, g, work, 2); break;
    case 4: attend_unit_with(job, seg, i, g, work, 4); break;
    case 8: attend_unit_with(job, seg, i, g, work, 8); break;
    default: attend_unit_with(job, seg, i, g, work, (job->dim + 15) / 16); break;
    }
}

static void *run_job(void *arg) {
    const Job *job = (const Job *)arg;
    if (job->first >= job->last) return NULL;
    const int64_t groups = job->heads / job->kv_heads, width = (job->dim + 15) / 16 * 16;
    const int64_t floats = groups * job->most_keys + 16 * width + groups * width;
    float *buffer = (float *)aligned_alloc(64, (size_t)((floats + 15) / 16 * 16) * 4);
    if (buffer == NULL) return (void *)1;
    const Scratch work = {buffer, buffer + groups * job->most_keys, buffer + groups * job->most_keys + 16 * width};
    int64_t segment, offset;
    locate(job, job->first, &segment, &offset);
    for (int64_t unit = job->first; unit < job->last; ++unit) {
        const int64_t *seg = job->table + segment * 6;
        attend_unit(job, seg, offset / job->kv_heads, offset % job->kv_heads, &work);
        if (++offset == seg[2] * job->kv_heads) {
            ++segment;
            offset = 0;
        }
    }
    free(buffer);
    return NULL;
}

/* New keys and values of every segment's rows into its cache. */
static void write_cache(const Job *job) {
    const int64_t dim = job->dim, size = elem_size(job->dtype), width = dim * size;
    const int64_t q_width = job->heads * dim;
    for (int64_t s = 0; s < job->segments; ++s) {
        const int64_t *seg = job->table + s * 6;
        char *cache = (char *)(intptr_t)seg[5];
        for (int64_t i = 0; i < seg[2]; ++i) {
            const char *row = (const char *)job->qkv + ((seg[0] + i) * job->stride + q_width) * size;
            for (int64_t part = 0; part < 2 * job->kv_heads; ++part)
                memcpy(cache + ((part * seg[4]) + seg[1] + i) * width, row + part * width, width);
        }
    }
}

/*
 * qkv: the frame's rows [T, stride] (queries [heads, D], keys and values
 * [kv_heads, D] each, from column 0); out: [T, heads * D]. Returns 0, or -1 where a
 * worker could not get its score buffer.
 */
int mesh_attend(const void *qkv, int64_t stride, int dtype, int64_t heads, int64_t kv_heads,
                int64_t dim, float scaling, const int64_t *table, int64_t segments, void *out,
                int threads) {
    Job base = {qkv, out, table, stride, heads, kv_heads, dim, segments, 0, 0, scaling, dtype, 1};
    if (dim > MAX_CHUNKS * 16 || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUPS) return -2;
    int64_t units = 0, macs = 0;
    for (int64_t s = 0; s < segments; ++s) {
        const int64_t *seg = table + s * 6;
        const int64_t last = seg[1] + seg[2];
        const int64_t seen = seg[3] > 0 && seg[3] < last ? seg[3] : last;
        if (seen > base.most_keys) base.most_keys = seen;
        units += seg[2] * kv_heads;
        macs += seg[2] * seen * heads * dim * 2;
    }
    write_cache(&base);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > units) threads = (int)units;
    if (threads < 2 || macs < THREADED_MACS) {
        base.last = units;
        return run_job(&base) == NULL ? 0 : -1;
    }
    Job parts[MAX_THREADS];
    for (int t = 0; t < threads; ++t) {
        parts[t] = base;
        parts[t].first = units * t / threads;
        parts[t].last = units * (t + 1) / threads;
    }
    return run_on_threads(run_job, parts, sizeof parts[0], threads) ? -1 : 0;
}
