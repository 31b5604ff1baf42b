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

/* One query token per row over its pages (GQA: the G = hq / hkv query heads of a kv head share
 * its keys, and are scored, exponentiated and accumulated together, a page at a time).
 * q[b, h, :] at q + b * q_row + h * d; pools [pages, page, hkv, d] contiguous; the value of a
 * position is its pool row's first dv entries (dv <= d: MLA's latent part); table[b, j] at
 * table + b * table_row + j, j < table_width; row b attends positions 0..pos[b * pos_stride]
 * (a negative position is padding: zeros; none past the table's last page). sinks: [hq] logits
 * or NULL (one more softmax term with a zero value). out [b, hq, dv] contiguous. threads > 1:
 * OpenMP over (row, kv head). */
void opw_paged_decode_f32(const float *q, int64_t q_row, const float *k_pool, const float *v_pool,
                          const int32_t *table, int64_t table_row, const int64_t *pos, int64_t pos_stride,
                          const float *sinks, float *out, int rows, int hq, int hkv, int d, int dv,
                          int page, int table_width, float scale, int threads) {
    const int g = hq / hkv;
    const int64_t tok = (int64_t)hkv * d;  /* floats between a head's rows of consecutive positions */
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
