/* The float64 statement of one Adam(W) step and the tolerances the kernel's fp32 result
 * must meet (DESIGN.md §4; torch.optim.AdamW's documented algorithm). The bounds are the
 * ones tests/test_kernel.py and tests/_kernel_support.py state for the x86 paths:
 *
 *   step:     4 fp32 roundings (u = 2^-24) of the magnitudes each result is built from,
 *             so a cancellation (b1*m close to -(1-b1)*g) is judged against its operands;
 *             bf16 moments (stochastic rounding) add one bf16 ulp (2^-7 relative);
 *   copy:     half an ulp of the copy's type (bf16 2^-8, fp16 2^-11 relative + 2^-25);
 *   rollback: 4 roundings (of fp32, or of bf16 for bf16 moments) of the magnitudes the
 *             inverse works with (v's subtraction cancels, so relative to v_post and
 *             (1-b2) g^2, not to the small result); plus 4 units of the moment type's
 *             smallest subnormal (the inputs hold subnormal gradients, and a rounding in
 *             the subnormal range is absolute, not relative).
 */
#include <math.h>
#include <stdio.h>

#include "so_harness.h"

#define U24 0x1p-24
#define F32_EPS 0x1p-23
#define BF16_EPS 0x1p-7

typedef struct ref_hp {
    double lr, b1, b2, eps, wd, gs, bc1, bc2;
    int l2, adamw;
} ref_hp;

static ref_hp ref_hparams(const so_adam_hparams *h) {
    ref_hp r = {h->lr, h->beta1, h->beta2, h->eps, h->weight_decay, h->grad_scale, 1.0, 1.0,
                !h->adamw_mode && h->weight_decay != 0.0, h->adamw_mode};
    if (h->bias_correction) {
        r.bc1 = 1.0 - pow(h->beta1, (double)h->step);
        r.bc2 = 1.0 - pow(h->beta2, (double)h->step);
    }
    return r;
}

/* Record |got - want| against tol (NaN in either fails). */
static void judge(so_ref_result *res, double got, double want, double tol, const char *what,
                  int64_t k, int64_t i) {
    double err = fabs(got - want);
    int ok = err <= tol; /* false for NaN */
    double ratio = err == 0.0 ? 0.0 : err / tol;
    if (ok && ratio > res->worst_ratio) res->worst_ratio = ratio;
    if (!ok) {
        if (res->bad == 0)
            snprintf(res->where, sizeof res->where, "%s[%lld][%lld]=%.9g want %.9g tol %.3g",
                     what, (long long)k, (long long)i, got, want, tol);
        res->bad += 1;
        res->worst_ratio = INFINITY;
    }
}

/* Half an ulp of the low-precision copy around p. */
static double copy_tol(int lpdt, double p) {
    return lpdt == SO_DTYPE_BF16 ? 0x1p-8 * fabs(p) : 0x1p-11 * fabs(p) + 0x1p-25;
}

so_ref_result so_ref_step(const so_batch *pre, const so_batch *post, const so_adam_hparams *h) {
    so_ref_result res = {0.0, 0, ""};
    ref_hp r = ref_hparams(h);
    int sr = pre->mdt == SO_DTYPE_BF16;
    for (int64_t k = 0; k < pre->count; ++k) {
        for (int64_t i = 0; i < pre->numels[k]; ++i) {
            double p0 = so_get(pre, 'p', k, i), g0 = so_get(pre, 'g', k, i);
            double m0 = so_get(pre, 'm', k, i), v0 = so_get(pre, 'v', k, i);
            double g = g0 * r.gs + (r.l2 ? r.wd * p0 : 0.0);
            double m = r.b1 * m0 + (1 - r.b1) * g;
            double v = r.b2 * v0 + (1 - r.b2) * g * g;
            double denom = sqrt(v) / sqrt(r.bc2) + r.eps;
            double p = (r.adamw ? p0 * (1 - r.lr * r.wd) : p0) - r.lr / r.bc1 * m / denom;
            double ga = fabs(g0) * r.gs + (r.l2 ? r.wd * fabs(p0) : 0.0);
            double tol_m = 4 * U24 * (fabs(m0) + ga) + 1e-30;
            double tol_v = 4 * U24 * (v0 + ga * ga) + 1e-30;
            double upd = r.lr / r.bc1 * fabs(m) / denom;
            /* denom's own error (sqrt of an inexact v, eps) is relative: 8 roundings of upd */
            double tol_p = 4 * U24 * (fabs(p0) + fabs(p)) + r.lr / r.bc1 * tol_m / denom +
                           8 * U24 * upd * (1 + tol_v / (v + 1e-300));
            /* p is computed from the fp32 moments; the stored ones are then rounded to bf16 */
            double tol_ms = sr ? tol_m + BF16_EPS * (fabs(m) + tol_m) : tol_m;
            double tol_vs = sr ? tol_v + BF16_EPS * (v + tol_v) : tol_v;
            double p1 = so_get(post, 'p', k, i);
            judge(&res, p1, p, tol_p, "p", k, i);
            judge(&res, so_get(post, 'm', k, i), m, tol_ms, "m", k, i);
            judge(&res, so_get(post, 'v', k, i), v, tol_vs, "v", k, i);
            if (post->lp) judge(&res, so_get(post, 'l', k, i), p1, copy_tol(post->lpdt, p1), "lp", k, i);
        }
    }
    return res;
}

so_ref_result so_ref_rollback(const so_batch *pre, const so_batch *post,
                              const so_batch *restored, const so_adam_hparams *h) {
    so_ref_result res = {0.0, 0, ""};
    ref_hp r = ref_hparams(h);
    /* the fp32 coefficients the kernel computes with */
    double step_size = (float)(r.lr / r.bc1), bc2_sqrt = (float)sqrt(r.bc2);
    double eps = (float)r.eps, b1 = (float)r.b1, b2 = (float)r.b2;
    double omb1 = (float)(1 - r.b1), omb2 = (float)(1 - r.b2);
    double eps_rel = pre->mdt == SO_DTYPE_BF16 ? BF16_EPS : F32_EPS;
    double tiny = 4 * (pre->mdt == SO_DTYPE_BF16 ? 0x1p-133 : 0x1p-149) / b1;
    double wd = r.l2 ? r.wd : 0.0;
    for (int64_t k = 0; k < pre->count; ++k) {
        for (int64_t i = 0; i < pre->numels[k]; ++i) {
            double g = fabs(so_get(pre, 'g', k, i) * r.gs);
            double m = so_get(post, 'm', k, i), v = so_get(post, 'v', k, i);
            double p_pre = so_get(pre, 'p', k, i), p_post = so_get(post, 'p', k, i);
            double upd = step_size * fabs(m) / (sqrt(v) / bc2_sqrt + eps);
            double p_scale = fabs(p_pre) + fabs(p_post) + upd;
            double ga = g + wd * p_scale;
            double m_scale = (fabs(m) + omb1 * ga) / b1;
            double v_scale = (v + omb2 * ga * ga * 1.01) / b2;
            double p1 = so_get(restored, 'p', k, i);
            judge(&res, p1, p_pre, 4 * F32_EPS * p_scale + 4 * eps_rel * upd, "p", k, i);
            judge(&res, so_get(restored, 'm', k, i), so_get(pre, 'm', k, i), 4 * eps_rel * m_scale + tiny,
                  "m", k, i);
            judge(&res, so_get(restored, 'v', k, i), so_get(pre, 'v', k, i), 4 * eps_rel * v_scale + tiny,
                  "v", k, i);
            if (restored->lp)
                judge(&res, so_get(restored, 'l', k, i), p1, copy_tol(restored->lpdt, p1), "lp", k, i);
        }
    }
    return res;
}
