/* Rollback guard: how many elements of a speculative step the inverse could not restore
 * within its error bound (runtime/auto_rollback.py, docs/engine.md "The default rollback").
 *
 * Legend: g = grad * grad_scale, v = exp_avg_sq before the step. An element counts when
 * g*g > c_v * v (c_v = rho_limit * b2 / (1 - b2)): rho = (1-b2) g^2 / (b2 v) exceeds the
 * limit. v == 0 counts too (the caller exempts m == v == 0, exact for the inverse). One read
 * of g and v (8 B/param for fp32, 6 for bf16 gradients), auto-vectorised by -O3 at the
 * baseline ISA: a memory-bound pass beside the 28 B/param step, taken only when speculating.
 * The common answer, 0, needs nothing else; the caller finds the indices only then.
 */
#include <omp.h>

#include "so_internal.h"

#define SO_GUARD_BLOCK ((int64_t)1 << 20)

/* x86: gcc builds AVX-512, AVX2 and baseline clones and picks one at load time (ifunc), as
 * the step's own run-time dispatch does; elsewhere the baseline (NEON is baseline on Arm). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SO_GUARD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SO_GUARD_CLONES
#endif

/* One straight loop per gradient dtype, so gcc vectorises each (no per-element branch). */
SO_GUARD_CLONES static int64_t so_guard_f32(const float *restrict g, const float *restrict v, int64_t lo,
                            int64_t hi, float gs, float cv) {
    int64_t total = 0;
    for (int64_t b = lo; b < hi; b += SO_GUARD_BLOCK) { /* int32 lanes: no overflow in a block */
        int64_t e = hi - b < SO_GUARD_BLOCK ? hi : b + SO_GUARD_BLOCK;
        int32_t n = 0;
        for (int64_t i = b; i < e; ++i) {
            float x = g[i] * gs;
            n += (x * x > cv * v[i]);
        }
        total += n;
    }
    return total;
}

SO_GUARD_CLONES static int64_t so_guard_bf16(const uint16_t *restrict g, const float *restrict v, int64_t lo,
                             int64_t hi, float gs, float cv) {
    int64_t total = 0;
    for (int64_t b = lo; b < hi; b += SO_GUARD_BLOCK) {
        int64_t e = hi - b < SO_GUARD_BLOCK ? hi : b + SO_GUARD_BLOCK;
        int32_t n = 0;
        for (int64_t i = b; i < e; ++i) {
            float x = so_bf16_to_f32(g[i]) * gs;
            n += (x * x > cv * v[i]);
        }
        total += n;
    }
    return total;
}

int so_rollback_risk_multi(void **grads, void **exp_avg_sqs, const int64_t *numels,
                           int64_t count, int grad_dtype, double grad_scale, double c_v,
                           int threads, int64_t *risky) {
    if (risky == NULL || count < 0) return SO_ERR_NULL;
    if (count > 0 && (grads == NULL || exp_avg_sqs == NULL || numels == NULL)) return SO_ERR_NULL;
    if (threads < 1) return SO_ERR_THREADS;
    if (grad_dtype != SO_DTYPE_F32 && grad_dtype != SO_DTYPE_BF16) return SO_ERR_DTYPE;
    if (!(c_v >= 0.0) || !(grad_scale == grad_scale)) return SO_ERR_HPARAM;
    int64_t total = 0;
    for (int64_t i = 0; i < count; ++i) {
        if (numels[i] < 0 || (numels[i] > 0 && (grads[i] == NULL || exp_avg_sqs[i] == NULL)))
            return SO_ERR_NULL;
        total += numels[i];
    }
    const float gs = (float)grad_scale, cv = (float)c_v;
    int64_t count_risky = 0;
    /* one team for all tensors; tiny calls stay on one thread (the fork costs more) */
    int team = total < 65536 ? 1 : threads;
#pragma omp parallel num_threads(team) reduction(+ : count_risky)
    {
        int T = omp_get_num_threads(), me = omp_get_thread_num();
        for (int64_t t = 0; t < count; ++t) {
            const float *v = (const float *)exp_avg_sqs[t];
            int64_t n = numels[t], lo = n * me / T, hi = n * (me + 1) / T;
            count_risky += grad_dtype == SO_DTYPE_BF16
                               ? so_guard_bf16((const uint16_t *)grads[t], v, lo, hi, gs, cv)
                               : so_guard_f32((const float *)grads[t], v, lo, hi, gs, cv);
        }
    }
    *risky = count_risky;
    return SO_OK;
}
