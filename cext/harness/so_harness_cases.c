/* The harness's remaining cases: non-finite inputs, grad_stats, the bandwidth probe, the
 * rollback guard's count and every return code of so_cpu_adam.h (a refused call must write
 * nothing). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "so_harness.h"

static int nonfinite(double x) { return x != x || x == INFINITY || x == -INFINITY; }

/* A step over inf/NaN inputs: it runs (validation is the caller's, kernels/checks.py),
 * every element with a non-finite input gets a non-finite p, the others stay finite.
 * Digests: NaN bits differ between ISAs (default NaN sign) and between compilers (which
 * operand of a two-NaN operation propagates), so tests compare the canonical digest. */
static void nonfinite_step(int simd) {
    static const int variants[4][3] = {{SO_DTYPE_F32, SO_DTYPE_F32, SO_DTYPE_BF16},
                                       {SO_DTYPE_BF16, SO_DTYPE_BF16, SO_DTYPE_F16},
                                       {SO_DTYPE_F32, SO_DTYPE_F32, SO_DTYPE_F16},
                                       {SO_DTYPE_F32, SO_DTYPE_BF16, SO_DTYPE_BF16}};
    int64_t sizes[2] = {40, 13};
    for (int vi = 0; vi < 4; ++vi) {
        const int *v = variants[vi];
        char name[64];
        so_variant_name(name, sizeof name, "nonfinite_step", v[0], v[1], v[2]);
        so_batch *b = so_batch_new(sizes, 2, v[0], v[1], v[2], 31 + (uint64_t)vi, 1);
        so_put(b, 'p', 0, 3, INFINITY);
        so_put(b, 'g', 0, 5, NAN);
        so_put(b, 'g', 0, 6, INFINITY);
        so_put(b, 'g', 0, 7, -INFINITY);
        so_put(b, 'm', 0, 8, -INFINITY);
        so_put(b, 'v', 0, 9, NAN);
        so_put(b, 'p', 1, 12, -NAN);
        int bad_in[40 + 13] = {0};
        for (int64_t k = 0, at = 0; k < 2; ++k)
            for (int64_t i = 0; i < sizes[k]; ++i, ++at)
                bad_in[at] = nonfinite(so_get(b, 'p', k, i)) || nonfinite(so_get(b, 'g', k, i)) ||
                             nonfinite(so_get(b, 'm', k, i)) || nonfinite(so_get(b, 'v', k, i));
        so_adam_hparams h = {1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 3, 1, 1, 8};
        so_exec x = {2, simd, SO_SCHED_STATIC, 0};
        int rc = so_adam_step_multi(&b->t, &h, &x);
        int classes_ok = 1;
        for (int64_t k = 0, at = 0; k < 2; ++k)
            for (int64_t i = 0; i < sizes[k]; ++i, ++at)
                classes_ok &= nonfinite(so_get(b, 'p', k, i)) == bad_in[at];
        so_check(name, rc == SO_OK && classes_ok && so_guards_broken(b) == 0, -1,
                 "a non-finite input did not give a non-finite p (or the reverse)");
        so_digest d;
        so_digest_init(&d);
        so_digest_batch(&d, b);
        so_print_digest(name, &d);
        so_batch_free(b);
    }
}

/* Rollback refuses a non-finite p, m, v or g with its own code (p first) and writes
 * nothing (DESIGN.md §4: never zero an overflow). */
static void nonfinite_rollback(int simd) {
    static const struct {
        const char *arrays;
        int rc;
    } cases[] = {{"p", SO_ERR_NONFINITE_PARAM},
                 {"m", SO_ERR_NONFINITE_EXP_AVG},
                 {"v", SO_ERR_NONFINITE_EXP_AVG_SQ},
                 {"g", SO_ERR_NONFINITE_GRAD},
                 {"gp", SO_ERR_NONFINITE_PARAM},
                 {"vm", SO_ERR_NONFINITE_EXP_AVG}};
    int64_t sizes[3] = {100, 70000, 3};
    so_digest all;
    so_digest_init(&all);
    for (int mdt = SO_DTYPE_F32; mdt <= SO_DTYPE_BF16; ++mdt) {
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
            so_batch *b = so_batch_new(sizes, 3, SO_DTYPE_BF16, mdt, SO_DTYPE_BF16, 50 + c, 1);
            for (const char *a = cases[c].arrays; *a; ++a)
                so_put(b, *a, 1, 69999, *a == 'v' ? NAN : -INFINITY);
            so_digest before, after;
            so_digest_init(&before), so_digest_init(&after);
            so_digest_batch(&before, b);
            so_adam_hparams h = {1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 2, 1, 1, 0};
            so_exec x = {3, simd, SO_SCHED_DYNAMIC, 4096};
            int rc = so_adam_rollback_multi(&b->t, &h, &x);
            so_digest_batch(&after, b);
            char name[64], what[96];
            snprintf(name, sizeof name, "nonfinite_rollback/m%s-%s", so_dtype_name(mdt),
                     cases[c].arrays);
            snprintf(what, sizeof what, "rc=%d want %d, modified=%d", rc, cases[c].rc,
                     !so_digest_equal(&before, &after));
            so_check(name, rc == cases[c].rc && so_digest_equal(&before, &after), -1, what);
            so_digest_i64(&all, rc);
            so_batch_free(b);
        }
    }
    so_print_digest("nonfinite_rollback", &all);
}

static void stats(int simd) {
    static const int64_t sizes[] = {0, 1, 7, 8, 9, 4095, 4096, 4097, 100003};
    int count = (int)(sizeof sizes / sizeof sizes[0]);
    for (int dt = SO_DTYPE_F32; dt <= SO_DTYPE_BF16; ++dt) {
        char name[32];
        snprintf(name, sizeof name, "grad_stats/%s", so_dtype_name(dt));
        so_batch *b = so_batch_new(sizes, count, dt, SO_DTYPE_F32, SO_DTYPE_NONE, 70 + dt, 1);
        so_put(b, 'g', 2, 3, NAN);
        so_put(b, 'g', 8, 50000, INFINITY);
        so_put(b, 'g', 5, 4094, -INFINITY);
        int64_t blocks = so_grad_stats_blocks(b->numels, count), want_blocks = 0;
        for (int k = 0; k < count; ++k) want_blocks += (sizes[k] + SO_STATS_BLOCK - 1) / SO_STATS_BLOCK;
        double want = 0.0; /* float64 sum of the finite squares, in index order */
        for (int k = 0; k < count; ++k)
            for (int64_t i = 0; i < sizes[k]; ++i) {
                double g = so_get(b, 'g', k, i);
                if (!nonfinite(g)) want += g * g;
            }
        double *scratch = malloc(sizeof(double) * (size_t)blocks);
        double first = 0.0;
        int64_t first_bad = -1;
        int same = 1, rc_all = SO_OK;
        for (int threads = 1; threads <= 4; ++threads) {
            double sum = -1.0;
            int64_t bad = -1;
            int rc = so_grad_stats_multi(b->gp, b->numels, count, dt, threads, simd, scratch,
                                         blocks, &sum, &bad);
            if (rc != SO_OK) rc_all = rc;
            if (threads == 1) first = sum, first_bad = bad;
            else same &= memcmp(&sum, &first, sizeof sum) == 0 && bad == first_bad;
        }
        double err = fabs(first - want), tol = 1e-12 * want;
        char what[160];
        snprintf(what, sizeof what, "rc=%d blocks=%lld/%lld sum=%.17g want %.17g nonfinite=%lld same=%d",
                 rc_all, (long long)blocks, (long long)want_blocks, first, want,
                 (long long)first_bad, same);
        so_check(name, rc_all == SO_OK && blocks == want_blocks && err <= tol && first_bad == 3 && same,
                 err / tol, what);
        so_digest d;
        so_digest_init(&d);
        so_digest_f64(&d, first);
        so_digest_i64(&d, first_bad);
        so_print_digest(name, &d);
        free(scratch);
        so_batch_free(b);
    }
}

/* p += g, m += g, v += g exactly (single fp32 adds), in place. */
static void probe(int simd) {
    int64_t sizes[3] = {1, 33, 70001};
    so_batch *pre = so_batch_new(sizes, 3, SO_DTYPE_F32, SO_DTYPE_F32, SO_DTYPE_NONE, 90, 1);
    so_batch *b = so_batch_clone(pre);
    int rc = so_bandwidth_probe(&b->t, 3, simd);
    int64_t wrong = 0;
    for (int64_t k = 0; k < 3; ++k)
        for (int64_t i = 0; i < sizes[k]; ++i) {
            float g = (float)so_get(pre, 'g', k, i);
            wrong += (float)so_get(b, 'p', k, i) != (float)so_get(pre, 'p', k, i) + g;
            wrong += (float)so_get(b, 'm', k, i) != (float)so_get(pre, 'm', k, i) + g;
            wrong += (float)so_get(b, 'v', k, i) != (float)so_get(pre, 'v', k, i) + g;
        }
    char what[64];
    snprintf(what, sizeof what, "rc=%d wrong=%lld", rc, (long long)wrong);
    so_check("bandwidth_probe", rc == SO_OK && wrong == 0 && so_guards_broken(b) == 0, -1, what);
    so_digest d;
    so_digest_init(&d);
    so_digest_batch(&d, b);
    so_print_digest("bandwidth_probe", &d);
    so_batch_free(pre), so_batch_free(b);
}

/* Every refusal: the expected code, and not one byte written. */
static void errors(int simd) {
    int64_t sizes[2] = {300, 70000};
    so_batch *b = so_batch_new(sizes, 2, SO_DTYPE_F32, SO_DTYPE_F32, SO_DTYPE_BF16, 60, 1);
    so_digest before, rcs;
    so_digest_init(&before), so_digest_init(&rcs);
    so_digest_batch(&before, b);
    const so_adam_hparams ok_h = {1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 3, 1, 1, 0};
    const so_exec ok_x = {2, simd, SO_SCHED_STATIC, 0};
    so_adam_tensors t;
    so_adam_hparams h;
    so_exec x;
    int64_t bad_numels[2] = {300, -1};
    double sum;
    int64_t nonfin;
    double scratch[64];
    int failures = 0;
#define SO_EXPECT(label, call, want)                                                     \
    do {                                                                                 \
        t = b->t, h = ok_h, x = ok_x;                                                    \
        int rc_ = (call);                                                                \
        so_digest_i64(&rcs, rc_);                                                        \
        if (rc_ != (want)) {                                                             \
            printf("# %s: rc=%d want %d\n", label, rc_, want);                           \
            ++failures;                                                                  \
        }                                                                                \
    } while (0)
    SO_EXPECT("tensors NULL", so_adam_step_multi(NULL, &h, &x), SO_ERR_NULL);
    SO_EXPECT("hparams NULL", so_adam_step_multi(&t, NULL, &x), SO_ERR_NULL);
    SO_EXPECT("exec NULL", so_adam_rollback_multi(&t, &h, NULL), SO_ERR_NULL);
    SO_EXPECT("params NULL", (t.params = NULL, so_adam_step_multi(&t, &h, &x)), SO_ERR_NULL);
    SO_EXPECT("numel < 0", (t.numels = bad_numels, so_adam_step_multi(&t, &h, &x)), SO_ERR_NULL);
    SO_EXPECT("fp16 grads", (t.grad_dtype = SO_DTYPE_F16, so_adam_step_multi(&t, &h, &x)), SO_ERR_DTYPE);
    SO_EXPECT("fp16 moments", (t.moment_dtype = SO_DTYPE_F16, so_adam_step_multi(&t, &h, &x)), SO_ERR_DTYPE);
    SO_EXPECT("fp32 copy", (t.lp_dtype = SO_DTYPE_F32, so_adam_step_multi(&t, &h, &x)), SO_ERR_DTYPE);
    SO_EXPECT("step 0", (h.step = 0, so_adam_step_multi(&t, &h, &x)), SO_ERR_HPARAM);
    SO_EXPECT("beta1 1", (h.beta1 = 1.0, so_adam_step_multi(&t, &h, &x)), SO_ERR_HPARAM);
    SO_EXPECT("beta2 < 0", (h.beta2 = -0.1, so_adam_step_multi(&t, &h, &x)), SO_ERR_HPARAM);
    SO_EXPECT("lr < 0", (h.lr = -1.0, so_adam_step_multi(&t, &h, &x)), SO_ERR_HPARAM);
    SO_EXPECT("lr NaN", (h.lr = NAN, so_adam_step_multi(&t, &h, &x)), SO_ERR_HPARAM);
    SO_EXPECT("eps < 0", (h.eps = -1e-8, so_adam_step_multi(&t, &h, &x)), SO_ERR_HPARAM);
    SO_EXPECT("lr*wd 1", (h.lr = 1.0, h.weight_decay = 1.0, so_adam_step_multi(&t, &h, &x)), SO_ERR_HPARAM);
    SO_EXPECT("grad_scale inf", (h.grad_scale = INFINITY, so_adam_step_multi(&t, &h, &x)), SO_ERR_HPARAM);
    SO_EXPECT("rollback beta1 0", (h.beta1 = 0.0, so_adam_rollback_multi(&t, &h, &x)), SO_ERR_HPARAM);
    SO_EXPECT("threads 0", (x.threads = 0, so_adam_step_multi(&t, &h, &x)), SO_ERR_THREADS);
    SO_EXPECT("schedule 7", (x.schedule = 7, so_adam_step_multi(&t, &h, &x)), SO_ERR_THREADS);
    SO_EXPECT("chunk 10", (x.schedule = SO_SCHED_DYNAMIC, x.chunk_elems = 10,
                           so_adam_step_multi(&t, &h, &x)), SO_ERR_THREADS);
    SO_EXPECT("simd 99", (x.simd = 99, so_adam_step_multi(&t, &h, &x)), SO_ERR_SIMD);
    SO_EXPECT("probe threads 0", so_bandwidth_probe(&t, 0, simd), SO_ERR_THREADS);
    SO_EXPECT("probe bf16 grads", (t.grad_dtype = SO_DTYPE_BF16, so_bandwidth_probe(&t, 1, simd)),
              SO_ERR_DTYPE);
    int64_t blocks = so_grad_stats_blocks(b->numels, 2);
    SO_EXPECT("stats scratch short", so_grad_stats_multi(b->gp, b->numels, 2, SO_DTYPE_F32, 1, simd,
                                                         scratch, blocks - 1, &sum, &nonfin),
              SO_ERR_SCRATCH);
    SO_EXPECT("stats sum NULL", so_grad_stats_multi(b->gp, b->numels, 2, SO_DTYPE_F32, 1, simd,
                                                    scratch, blocks, NULL, &nonfin), SO_ERR_NULL);
    SO_EXPECT("stats threads 0", so_grad_stats_multi(b->gp, b->numels, 2, SO_DTYPE_F32, 0, simd,
                                                     scratch, blocks, &sum, &nonfin), SO_ERR_THREADS);
    SO_EXPECT("stats fp16", so_grad_stats_multi(b->gp, b->numels, 2, SO_DTYPE_F16, 1, simd,
                                                scratch, blocks, &sum, &nonfin), SO_ERR_DTYPE);
    SO_EXPECT("stats numel < 0", so_grad_stats_multi(b->gp, bad_numels, 2, SO_DTYPE_F32, 1, simd,
                                                     scratch, blocks, &sum, &nonfin), SO_ERR_NULL);
    SO_EXPECT("stats empty", so_grad_stats_multi(NULL, NULL, 0, SO_DTYPE_F32, 1, simd, NULL, 0,
                                                 &sum, &nonfin), SO_OK);
    SO_EXPECT("stats empty sum", (int)(sum == 0.0 && nonfin == 0) - 1, 0);
    /* a path this CPU lacks is refused too (not in the digest: it differs per CPU) */
    int refused_ok = 1;
    for (int c = SO_SIMD_PORTABLE; c <= SO_SIMD_SVE; ++c)
        if (so_simd_resolve(c) < 0) {
            so_exec y = {1, c, SO_SCHED_STATIC, 0};
            refused_ok &= so_adam_step_multi(&b->t, &ok_h, &y) == SO_ERR_SIMD;
        }
#undef SO_EXPECT
    so_digest after;
    so_digest_init(&after);
    so_digest_batch(&after, b);
    char what[64];
    snprintf(what, sizeof what, "%d wrong codes, modified=%d, refused=%d", failures,
             !so_digest_equal(&before, &after), refused_ok);
    so_check("errors", failures == 0 && refused_ok && so_digest_equal(&before, &after), -1, what);
    so_print_digest("errors", &rcs);
    /* beta1 = 0 is a valid step (only its inverse divides by it) */
    so_batch *c = so_batch_clone(b);
    h = ok_h, h.beta1 = 0.0;
    so_check("beta1_0_step", so_adam_step_multi(&c->t, &h, &ok_x) == SO_OK, -1, "refused");
    so_batch_free(c), so_batch_free(b);
}

/* so_rollback_risk_multi (cext/so_guard.c): how many elements have (g*gs)^2 > c_v * v.
 * Checked against the same count in float64, which may differ only on elements within a
 * few fp32 roundings of the boundary; any thread count gives the same count. */
static void rollback_risk(void) {
    int64_t sizes[6] = {0, 1, 15, 17, 70001, 5};
    so_digest d;
    so_digest_init(&d);
    for (int dt = SO_DTYPE_F32; dt <= SO_DTYPE_BF16; ++dt) {
        so_batch *b = so_batch_new(sizes, 6, dt, SO_DTYPE_F32, SO_DTYPE_NONE, 80 + dt, 1);
        so_put(b, 'v', 4, 10, 0.0f); /* v == 0 counts whenever g != 0 */
        so_put(b, 'v', 2, 3, 0.0f);
        const double gs = 0.37, cv = 4.0;
        int64_t want = 0, near = 0;
        for (int64_t k = 0; k < 6; ++k)
            for (int64_t i = 0; i < sizes[k]; ++i) {
                double x = so_get(b, 'g', k, i) * gs, lhs = x * x, rhs = cv * so_get(b, 'v', k, i);
                want += lhs > rhs;
                near += fabs(lhs - rhs) <= 8 * 0x1p-24 * (lhs + rhs);
            }
        int64_t first = -1, risky = -1;
        int same = 1, rc_all = SO_OK;
        for (int threads = 1; threads <= 4; ++threads) {
            int rc = so_rollback_risk_multi(b->gp, b->vp, b->numels, 6, dt, gs, cv, threads, &risky);
            if (rc != SO_OK) rc_all = rc;
            if (threads == 1) first = risky;
            else same &= risky == first;
        }
        char name[40], what[128];
        snprintf(name, sizeof name, "rollback_risk/%s", so_dtype_name(dt));
        snprintf(what, sizeof what, "rc=%d risky=%lld float64 %lld (+-%lld near the boundary) same=%d",
                 rc_all, (long long)first, (long long)want, (long long)near, same);
        so_check(name, rc_all == SO_OK && same && llabs(first - want) <= near && first >= 2, -1, what);
        so_digest_i64(&d, first);
        /* refusals */
        int64_t bad_numels[2] = {5, -1};
        int refused = so_rollback_risk_multi(b->gp, b->vp, b->numels, 6, dt, gs, cv, 1, NULL) == SO_ERR_NULL &&
                      so_rollback_risk_multi(b->gp, b->vp, b->numels, 6, dt, gs, cv, 0, &risky) == SO_ERR_THREADS &&
                      so_rollback_risk_multi(b->gp, b->vp, b->numels, 6, SO_DTYPE_F16, gs, cv, 1, &risky) == SO_ERR_DTYPE &&
                      so_rollback_risk_multi(b->gp, b->vp, b->numels, 6, dt, gs, -1.0, 1, &risky) == SO_ERR_HPARAM &&
                      so_rollback_risk_multi(b->gp, b->vp, b->numels, 6, dt, NAN, cv, 1, &risky) == SO_ERR_HPARAM &&
                      so_rollback_risk_multi(b->gp, b->vp, bad_numels, 2, dt, gs, cv, 1, &risky) == SO_ERR_NULL;
        snprintf(name, sizeof name, "rollback_risk/%s/errors", so_dtype_name(dt));
        so_check(name, refused, -1, "a wrong return code");
        so_batch_free(b);
    }
    so_print_digest("rollback_risk", &d);
}

void so_cases_nonfinite(int simd) {
    nonfinite_step(simd);
    nonfinite_rollback(simd);
}

void so_cases_stats_probe_errors(int simd) {
    stats(simd);
    probe(simd);
    rollback_risk();
    errors(simd);
}
