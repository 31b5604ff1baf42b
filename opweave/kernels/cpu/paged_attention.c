/* OpWeave CPU kernels: paged decode attention and paged cache writes in float32.
 *
 * The math of opweave/kernels/paged.py (paged_decode_attention, paged_cache_write), which these
 * replace on CPU ranks: the torch reference gathers each row's pages into a scratch copy and
 * then attends it; here every key and value row is read once, in place, through the block
 * table. Built by opweave/kernels/cpu/__init__.py with the system C compiler, called through
 * ctypes with the tensors' data pointers; the caller checks shapes, dtypes and layouts.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_PAGE 64  /* positions per page this kernel takes (the loader checks) */

#include "opw_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>

/* lane k of the result = the sum of the 16 lanes of v[k] (a transpose-and-add tree: 16 dot
 * products reduced in about 45 vector operations instead of 16 horizontal reductions) */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 s[8], r[4];
    for (int k = 0; k < 8; k++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        s[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int m = 0; m < 4; m++) {  /* per 128-bit lane: the lane's sums of v[4m..4m+3] */
        const __m512d a = _mm512_castps_pd(s[2 * m]), b = _mm512_castps_pd(s[2 * m + 1]);
        r[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], 0x44), _mm512_shuffle_f32x4(r[0], r[1], 0xEE));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(r[2], r[3], 0x44), _mm512_shuffle_f32x4(r[2], r[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

/* The scores of G query heads (qh: G rows of d) against n <= MAX_PAGE keys (kb: rows tok apart):
 * s[i * MAX_PAGE + t] = q_i . k_t * scale. 16 / G keys at a time, each key loaded once for the G
 * heads, the 16 dot products reduced together. d % 16 == 0. */
#define SCORES_G(G)                                                                                     \
    static void scores_g##G(const float *qh, const float *kb, int64_t tok, int n, int d, float scale,  \
                            float *s) {                                                                 \
        enum { T = 16 / G };                                                                            \
        for (int t0 = 0; t0 < n; t0 += T) {                                                             \
            const float *kt[T];                                                                         \
            for (int tt = 0; tt < T; tt++) /* past n: the last key again, its scores dropped */         \
                kt[tt] = kb + (int64_t)(t0 + tt < n ? t0 + tt : n - 1) * tok;                           \
            __m512 acc[16];                                                                             \
            for (int k = 0; k < 16; k++)                                                                \
                acc[k] = _mm512_setzero_ps();                                                           \
            for (int c = 0; c < d; c += 16) {                                                           \
                __m512 kv[T];                                                                           \
                for (int tt = 0; tt < T; tt++)                                                          \
                    kv[tt] = _mm512_loadu_ps(kt[tt] + c);                                               \
                for (int i = 0; i < G; i++) {                                                           \
                    const __m512 qv = _mm512_loadu_ps(qh + (int64_t)i * d + c);                         \
                    for (int tt = 0; tt < T; tt++)                                                      \
                        acc[tt * G + i] = _mm512_fmadd_ps(qv, kv[tt], acc[tt * G + i]);                 \
                }                                                                                       \
            }                                                                                           \
            float lanes[16];                                                                            \
            _mm512_storeu_ps(lanes, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));               \
            for (int tt = 0; tt < T && t0 + tt < n; tt++)                                               \
                for (int i = 0; i < G; i++)                                                             \
                    s[i * MAX_PAGE + t0 + tt] = lanes[tt * G + i];                                      \
        }                                                                                               \
    }
SCORES_G(1)
SCORES_G(2)
SCORES_G(4)
SCORES_G(8)
SCORES_G(16)

/* Whether `scores` takes this shape (else the portable loop scores) */
static inline int vector_scores(int g, int d) {
    return d % 16 == 0 && (g == 1 || g == 2 || g == 4 || g == 8 || g == 16);
}

static void scores(const float *qh, const float *kb, int64_t tok, int n, int g, int d, float scale, float *s) {
    switch (g) {
    case 1: scores_g1(qh, kb, tok, n, d, scale, s); break;
    case 2: scores_g2(qh, kb, tok, n, d, scale, s); break;
    case 4: scores_g4(qh, kb, tok, n, d, scale, s); break;
    case 8: scores_g8(qh, kb, tok, n, d, scale, s); break;
    default: scores_g16(qh, kb, tok, n, d, scale, s); break;
    }
}

/* o[j] += sum over t < n of p[t] * v_t[j], j < dv (dv % 16 == 0): 16 lanes of o kept in a register
 * over the page's values (read from L1 once per head). */
static inline void accumulate(float *o, const float *p, const float *vb, int64_t tok, int n, int dv) {
    for (int c = 0; c < dv; c += 16) {
        __m512 acc = _mm512_loadu_ps(o + c);
        for (int t = 0; t < n; t++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(vb + (int64_t)t * tok + c), acc);
        _mm512_storeu_ps(o + c, acc);
    }
}
#else
static inline int vector_scores(int g, int d) { (void)g; (void)d; return 0; }
static void scores(const float *qh, const float *kb, int64_t tok, int n, int g, int d, float scale, float *s) {
    (void)qh; (void)kb; (void)tok; (void)n; (void)g; (void)d; (void)scale; (void)s;
}
#endif

/* One query token per row over its pages (GQA: the G = hq / hkv query heads of a kv head share
 * its keys, and are scored, exponentiated and accumulated together, a page at a time).
 * q[b, h, :] at q + b * q_row + h * d; pools [pages, page, hkv, d] contiguous; the value of a
 * position is its pool row's first dv entries (dv <= d: MLA's latent part); table[b, j] at
 * table + b * table_row + j, j < table_width; row b attends positions 0..pos[b * pos_stride]
 * (a negative position is padding: zeros; none past the table's last page). sinks: [hq] logits
 * or NULL (one more softmax term with a zero value). out [b, hq, dv] contiguous. threads > 1:
 * OpenMP over (row, kv head). With AVX-512, head dims of whole 16-lane vectors and G of 1, 2, 4,
 * 8 or 16, the scores are 16 dot products at a time and the values accumulate in registers. */
void opw_paged_decode_f32(const float *q, int64_t q_row, const float *k_pool, const float *v_pool,
                          const int32_t *table, int64_t table_row, const int64_t *pos, int64_t pos_stride,
                          const float *sinks, float *out, int rows, int hq, int hkv, int d, int dv,
                          int page, int table_width, float scale, int threads) {
    const int g = hq / hkv;
    const int64_t tok = (int64_t)hkv * d;  /* floats between a head's rows of consecutive positions */
    const int fast = vector_scores(g, d);
#if defined(__AVX512F__)
    const int fast_values = dv % 16 == 0;
#endif
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int task = 0; task < rows * hkv; task++) {
        const int b = task / hkv, h = task % hkv;
        float *o = out + ((int64_t)b * hq + (int64_t)h * g) * dv;
        int64_t last = pos[b * pos_stride];
        if (last >= (int64_t)table_width * page)
            last = (int64_t)table_width * page - 1;
        memset(o, 0, sizeof(float) * (size_t)g * dv);
        if (last < 0)
            continue;
        const float *qh = q + b * q_row + (int64_t)h * g * d;
        float m[g], l[g], s[g][MAX_PAGE];
        for (int i = 0; i < g; i++) {
            m[i] = sinks ? sinks[h * g + i] : -INFINITY;
            l[i] = sinks ? 1.0f : 0.0f;
        }
        for (int64_t start = 0; start <= last; start += page) {
            const int n = (int)(last - start + 1 < page ? last - start + 1 : page);
            const int64_t base = ((int64_t)table[b * table_row + start / page] * page) * tok + (int64_t)h * d;
            const float *kb = k_pool + base, *vb = v_pool + base;
            if (fast)
                scores(qh, kb, tok, n, g, d, scale, &s[0][0]);
            else
                for (int t = 0; t < n; t++)
                    for (int i = 0; i < g; i++)
                        s[i][t] = dot(qh + (int64_t)i * d, kb + t * tok, d) * scale;
            for (int i = 0; i < g; i++) {
                float mx = m[i];
                for (int t = 0; t < n; t++)
                    mx = s[i][t] > mx ? s[i][t] : mx;
                const float corr = m[i] == -INFINITY ? 0.0f : exp_neg(m[i] - mx);
                float sum = 0.0f;
                for (int t = 0; t < n; t++) {
                    s[i][t] = exp_neg(s[i][t] - mx);
                    sum += s[i][t];
                }
                if (corr != 1.0f) {
                    float *oi = o + (int64_t)i * dv;
                    for (int j = 0; j < dv; j++)
                        oi[j] *= corr;
                }
                m[i] = mx;
                l[i] = l[i] * corr + sum;
            }
#if defined(__AVX512F__)
            if (fast_values) {
                for (int i = 0; i < g; i++)
                    accumulate(o + (int64_t)i * dv, s[i], vb, tok, n, dv);
                continue;
            }
#endif
            for (int t = 0; t < n; t++) {
                const float *vt = vb + t * tok;
                for (int i = 0; i < g; i++) {
                    const float p = s[i][t];
                    float *oi = o + (int64_t)i * dv;
                    for (int j = 0; j < dv; j++)
                        oi[j] += p * vt[j];
                }
            }
        }
        for (int i = 0; i < g; i++) {
            const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            for (int j = 0; j < dv; j++)
                o[(int64_t)i * dv + j] *= inv;
        }
    }
}

/* Writes n tokens' keys and values (rows of `width` floats: hkv * d) into their pages: token i of
 * row b (positions [rows, t], row-major, i = b * t + c) at position p goes to page
 * table[b, p / page] (the table's last entry past its end), slot p % page; padding (p < 0) to
 * slot 0 of the null page `null`, which nothing reads, as the reference does. k, v:
 * [rows * t, width] rows `src_row` floats apart. */
void opw_paged_write_f32(float *k_pool, float *v_pool, const int32_t *table, int64_t table_row,
                         const float *k, const float *v, int64_t src_row, const int64_t *pos,
                         int rows, int t, int64_t width, int page, int table_width, int64_t null) {
    for (int b = 0; b < rows; b++) {
        for (int c = 0; c < t; c++) {
            const int64_t p = pos[(int64_t)b * t + c];
            int64_t dst = null * page * width;
            if (p >= 0) {
                int64_t entry = p / page;
                if (entry >= table_width)
                    entry = table_width - 1;
                dst = ((int64_t)table[b * table_row + entry] * page + p % page) * width;
            }
            const int64_t src = ((int64_t)b * t + c) * src_row;
            memcpy(k_pool + dst, k + src, sizeof(float) * (size_t)width);
            if (v_pool != k_pool || v != k)
                memcpy(v_pool + dst, v + src, sizeof(float) * (size_t)width);
        }
    }
}
