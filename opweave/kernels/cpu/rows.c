/* OpWeave CPU kernels: the row-wise operators of a layer in float32, one pass each.
 *
 * The math of opweave/kernels/reference.py (rms_norm, add_rms_norm, rope, gated_act with silu),
 * which these replace on CPU ranks: the torch reference spends five to twenty small tensor
 * operations on each, and on a decode round of a few rows those operations' fixed costs are the
 * time; on a prefill chunk their passes over memory are. Built with paged_attention.c by
 * opweave/kernels/cpu/__init__.py (-ffp-contract=off: a * b + c rounds twice, as torch's does),
 * called through ctypes; the caller checks shapes, dtypes and layouts. threads > 1: OpenMP over
 * rows where a call is large enough to pay for it.
 */
#include <math.h>
#include <stdint.h>

#include "opw_math.h"

#define PAR_MIN 65536  /* elements a call needs before its rows are split among threads */

/* Row r of x (rows `x_row` floats apart, h floats each): with res, s = x + res is written to
 * sum[r] (contiguous rows) and normalised; without, s = x. out[r] (contiguous rows) =
 * w * (s * rsqrt(mean(s^2) + eps)), or with offset (s * rsqrt(...)) * (1 + w). */
void opw_rms_norm_f32(const float *x, int64_t x_row, const float *res, int64_t res_row, float *sum,
                      const float *w, float *out, int64_t rows, int h, float eps, int offset, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * h >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_row;
        float *o = out + r * h;
        if (res) {
            const float *rr = res + r * res_row;
            float *sr = sum + r * h;
            for (int i = 0; i < h; i++)
                sr[i] = xr[i] + rr[i];
            xr = sr;
        }
        const float ms = dot(xr, xr, h) / (float)h;
        const float inv = 1.0f / sqrtf(ms + eps);
        if (offset)
            for (int i = 0; i < h; i++)
                o[i] = (xr[i] * inv) * (1.0f + w[i]);
        else
            for (int i = 0; i < h; i++)
                o[i] = w[i] * (xr[i] * inv);
    }
}

/* out[r, i] = silu(gate[r, i]) * up[r, i], i < n; gate and up rows `gate_row` and `up_row` floats
 * apart, out contiguous. silu(x) = x / (1 + exp(-x)), with exp(-|x|) only (x < 0: x e / (1 + e)). */
void opw_silu_mul_f32(const float *gate, int64_t gate_row, const float *up, int64_t up_row, float *out,
                      int64_t rows, int n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_row, *u = up + r * up_row;
        float *o = out + r * n;
        for (int i = 0; i < n; i++) {
            const float x = g[i];
            const float e = exp_neg(x >= 0.0f ? -x : x);
            const float num = x >= 0.0f ? x : x * e;
            o[i] = num / (1.0f + e) * u[i];
        }
    }
}

/* Rotary embedding (rotate-half) of the first `rot` dims of each head: token t's heads at
 * x + t * x_tok + head * x_head (d floats each); cos and sin [n, rot / 2] contiguous (the
 * frequencies' cos and sin, scaled as the reference scales them); out [n, heads, d] contiguous,
 * dims past `rot` copied. out_i = x_i cos_i - x_{i+half} sin_i (i < half),
 * x_i cos_{i-half} + x_{i-half} sin_{i-half} (half <= i < rot): the reference's products and sums. */
void opw_rope_f32(const float *x, int64_t x_tok, int64_t x_head, const float *cosv, const float *sinv,
                  float *out, int64_t n, int heads, int d, int rot, int threads) {
    const int half = rot / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n * heads * d >= PAR_MIN)
    for (int64_t t = 0; t < n; t++) {
        const float *c = cosv + t * half, *s = sinv + t * half;
        for (int hd = 0; hd < heads; hd++) {
            const float *xi = x + t * x_tok + hd * x_head;
            float *o = out + (t * heads + hd) * d;
            for (int i = 0; i < half; i++)
                o[i] = xi[i] * c[i] - xi[i + half] * s[i];
            for (int i = 0; i < half; i++)
                o[half + i] = xi[half + i] * c[i] + xi[i] * s[i];
            for (int i = rot; i < d; i++)
                o[i] = xi[i];
        }
    }
}
