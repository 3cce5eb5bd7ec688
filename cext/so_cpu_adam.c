/* Entry points of the CPU Adam kernel: argument checks, coefficients, and ONE OpenMP
 * parallel region per call over all tensors.
 *
 * Threads: the total element count of all tensors is split into T contiguous ranges
 * (aligned to 64 elements, one cache line of fp32 x 4), and each thread walks its range
 * across tensor boundaries. Peers (torch fused, DeepSpeed) start a parallel region per
 * tensor; with ~200 tensors that is ~200 fork/joins per step, here it is one. That static
 * split is the default; so_exec.schedule = SO_SCHED_DYNAMIC hands out chunks on demand
 * instead (measured, not faster with the data in DRAM: docs/kernel.md).
 * Every result is a pure function of the element and its global index, so neither the
 * thread count nor the split changes a bit. grad_stats reduces in fixed blocks (SO_STATS_BLOCK) summed in
 * block order, for the same reason.
 */
#include <omp.h>
#include <stdlib.h>

#include "so_internal.h"

/* Below this many elements per thread, extra threads cost more than they bring. */
#define SO_MIN_ELEMS_PER_THREAD 32768
#define SO_ALIGN_ELEMS 64
/* Up to this many tensors the per-call offsets live on the stack (no malloc). */
#define SO_STACK_TENSORS 512

int so_kernel_abi_version(void) { return SO_KERNEL_ABI_VERSION; }

static int so_coeffs_make(const so_adam_hparams *h, int rollback, so_coeffs *c) {
    if (h->step < 1) return SO_ERR_HPARAM;
    double bc1 = 1.0, bc2 = 1.0;
    if (h->bias_correction) {
        bc1 = 1.0 - __builtin_pow(h->beta1, (double)h->step);
        bc2 = 1.0 - __builtin_pow(h->beta2, (double)h->step);
    }
    c->b1 = (float)h->beta1;
    c->b2 = (float)h->beta2;
    c->omb1 = (float)(1.0 - h->beta1);
    c->omb2 = (float)(1.0 - h->beta2);
    c->eps = (float)h->eps;
    c->grad_scale = (float)h->grad_scale;
    c->wd_l2 = (float)h->weight_decay;
    c->decay = h->adamw_mode ? (float)(1.0 - h->lr * h->weight_decay) : 1.0f;
    c->step_size = (float)(h->lr / bc1);
    c->bc2_sqrt = (float)__builtin_sqrt(bc2);
    /* NaN fails every comparison below, so NaN hyper-parameters are refused too */
    if (!(c->bc2_sqrt > 0.0f && c->decay > 0.0f && c->eps >= 0.0f)) return SO_ERR_HPARAM;
    if (!(h->beta1 >= 0.0 && h->beta1 < 1.0 && h->beta2 >= 0.0 && h->beta2 < 1.0))
        return SO_ERR_HPARAM;
    /* a negative grad_scale steps with -grad (maximize); NaN and inf are refused */
    if (!(h->lr >= 0.0 && h->weight_decay >= 0.0)) return SO_ERR_HPARAM;
    if (!(c->step_size < __builtin_inff() && __builtin_fabsf(c->grad_scale) < __builtin_inff()))
        return SO_ERR_HPARAM;
    /* the inverse divides by b1, b2 and the decay factor */
    if (rollback && !(c->b1 > 0.0f && c->b2 > 0.0f)) return SO_ERR_HPARAM;
    return SO_OK;
}

static int so_tensors_check(const so_adam_tensors *t) {
    if (t == NULL || t->count < 0) return SO_ERR_NULL;
    if (t->count > 0 && (t->params == NULL || t->grads == NULL || t->exp_avgs == NULL ||
                         t->exp_avg_sqs == NULL || t->numels == NULL))
        return SO_ERR_NULL;
    if (t->grad_dtype != SO_DTYPE_F32 && t->grad_dtype != SO_DTYPE_BF16) return SO_ERR_DTYPE;
    if (t->moment_dtype != SO_DTYPE_F32 && t->moment_dtype != SO_DTYPE_BF16) return SO_ERR_DTYPE;
    if (t->lp_dtype != SO_DTYPE_NONE && t->lp_dtype != SO_DTYPE_BF16 && t->lp_dtype != SO_DTYPE_F16)
        return SO_ERR_DTYPE;
    for (int64_t i = 0; i < t->count; ++i) {
        if (t->numels[i] < 0) return SO_ERR_NULL;
        if (t->numels[i] == 0) continue;
        if (!t->params[i] || !t->grads[i] || !t->exp_avgs[i] || !t->exp_avg_sqs[i])
            return SO_ERR_NULL;
    }
    return SO_OK;
}

/* offsets[i] = global index of tensor i's first element, offsets[count] = total. */
static int64_t so_offsets(const int64_t *numels, int64_t count, int64_t *offsets) {
    int64_t total = 0;
    for (int64_t i = 0; i < count; ++i) {
        offsets[i] = total;
        total += numels[i];
    }
    offsets[count] = total;
    return total;
}

/* Start of part k out of T of [0, total) (overflow-free, aligned). */
static int64_t so_split(int64_t total, int64_t T, int64_t k) {
    if (k >= T) return total;
    int64_t q = total / T, r = total % T;
    int64_t at = q * k + (r * k) / T;
    at -= at % SO_ALIGN_ELEMS;
    return at;
}

static int so_team_size(int threads, int64_t work) {
    int64_t cap = (work + SO_MIN_ELEMS_PER_THREAD - 1) / SO_MIN_ELEMS_PER_THREAD;
    if (cap < 1) cap = 1;
    return threads < cap ? threads : (int)cap;
}

/* Elements per chunk of a dynamic schedule: the requested size, but at least 4 chunks per
 * thread so a small call still spreads over the team (aligned, >= 64). */
static int64_t so_chunk(int64_t requested, int64_t total, int team) {
    int64_t fair = (total + 4 * (int64_t)team - 1) / (4 * (int64_t)team);
    int64_t chunk = requested < fair ? requested : fair;
    chunk += (SO_ALIGN_ELEMS - chunk % SO_ALIGN_ELEMS) % SO_ALIGN_ELEMS;
    return chunk < SO_ALIGN_ELEMS ? SO_ALIGN_ELEMS : chunk;
}

/* The tensor holding global element lo: the last i with offsets[i] <= lo (binary search,
 * so a chunk of a call over thousands of tensors finds its start in O(log n)). */
static int64_t so_tensor_at(const int64_t *offsets, int64_t count, int64_t lo) {
    int64_t a = 0, b = count;
    while (b - a > 1) {
        int64_t mid = a + (b - a) / 2;
        if (offsets[mid] <= lo) a = mid;
        else b = mid;
    }
    return a;
}

/* Visit the pieces of global range [lo, hi): one so_seg per (tensor, 2^32-index window).
 * mode 0: Adam loop; 1: finiteness check (returns the OR of the masks); 2: probe. */
static uint32_t so_walk(const so_adam_tensors *t, const int64_t *offsets, const so_kernels *k,
                        const so_coeffs *c, uint64_t seed, int variant, int mode, int64_t lo,
                        int64_t hi) {
    uint32_t mask = 0;
    for (int64_t i = so_tensor_at(offsets, t->count, lo); i < t->count && offsets[i] < hi; ++i) {
        int64_t off = offsets[i], n = t->numels[i];
        if (off + n <= lo || n == 0) continue;
        int64_t a = (lo > off ? lo : off) - off;
        int64_t b = (hi < off + n ? hi : off + n) - off;
        while (a < b) {
            uint64_t global = (uint64_t)(off + a);
            /* split where the top 32 bits of the global index change (tensors > 4 G) */
            int64_t window_end = (int64_t)((global | 0xffffffffull) + 1) - off;
            int64_t e = b < window_end ? b : window_end;
            so_seg s = {t->params[i], t->grads[i], t->exp_avgs[i], t->exp_avg_sqs[i],
                        t->params_lp ? t->params_lp[i] : NULL, a, e,
                        so_sr_key(seed, (uint32_t)(global >> 32)), (uint32_t)global};
            if (mode == 0)  /* a tensor without a copy target (NULL lp) gets no copy */
                k->adam(c, &s, s.lp == NULL ? variant & ~(3 << 2) : variant);
            else if (mode == 1)
                mask |= k->check(&s, t->grad_dtype, t->moment_dtype);
            else
                k->probe(&s);
            a = e;
        }
    }
    return mask;
}

/* Run so_walk over [0, total) with `team` threads in ONE parallel region and
 * return the OR of the masks. SO_SCHED_STATIC: one contiguous range per thread;
 * SO_SCHED_DYNAMIC: chunks handed out on demand, so a thread the OS preempts does not
 * stretch the call by its whole share (docs/kernel.md, "Threads, the work split and the
 * OpenMP wait policy"). */
static uint32_t so_parallel_walk(const so_adam_tensors *t, const int64_t *offsets,
                                 const so_kernels *k, const so_coeffs *c, uint64_t seed,
                                 int variant, int mode, int64_t total, int team, int sched,
                                 int64_t chunk) {
    uint32_t mask = 0;
    if (sched == SO_SCHED_STATIC || team == 1) {
#pragma omp parallel num_threads(team) reduction(| : mask)
        {
            int T = omp_get_num_threads(), me = omp_get_thread_num();
            mask |= so_walk(t, offsets, k, c, seed, variant, mode, so_split(total, T, me),
                            so_split(total, T, me + 1));
        }
    } else {
        int64_t chunks = (total + chunk - 1) / chunk;
#pragma omp parallel for num_threads(team) schedule(dynamic, 1) reduction(| : mask)
        for (int64_t j = 0; j < chunks; ++j) {
            int64_t lo = j * chunk, hi = lo + chunk < total ? lo + chunk : total;
            mask |= so_walk(t, offsets, k, c, seed, variant, mode, lo, hi);
        }
    }
    return mask;
}

static int so_exec_check(const so_exec *x) {
    if (x == NULL) return SO_ERR_NULL;
    if (x->threads < 1) return SO_ERR_THREADS;
    if (x->schedule != SO_SCHED_STATIC && x->schedule != SO_SCHED_DYNAMIC) return SO_ERR_THREADS;
    if (x->schedule == SO_SCHED_DYNAMIC && x->chunk_elems < SO_ALIGN_ELEMS) return SO_ERR_THREADS;
    return SO_OK;
}

static int so_adam_common(const so_adam_tensors *t, const so_adam_hparams *h,
                          const so_exec *x, int rollback) {
    if (h == NULL) return SO_ERR_NULL;
    int rc = so_exec_check(x);
    if (rc != SO_OK) return rc;
    rc = so_tensors_check(t);
    if (rc != SO_OK) return rc;
    so_coeffs c;
    rc = so_coeffs_make(h, rollback, &c);
    if (rc != SO_OK) return rc;
    int path = so_simd_resolve(x->simd);
    const so_kernels *k = path < 0 ? NULL : so_kernels_for(path);
    if (k == NULL) return SO_ERR_SIMD;

    int lp_code = t->lp_dtype == SO_DTYPE_NONE ? 0 : t->lp_dtype;
    int l2 = !h->adamw_mode && h->weight_decay != 0.0;
    int variant = rollback << 5 | l2 << 4 | lp_code << 2 | t->moment_dtype << 1 | t->grad_dtype;
    int64_t stack_offsets[SO_STACK_TENSORS + 1];
    int64_t *offsets = t->count <= SO_STACK_TENSORS
                           ? stack_offsets
                           : (int64_t *)malloc(sizeof(int64_t) * (size_t)(t->count + 1));
    if (offsets == NULL) return SO_ERR_SCRATCH;
    int64_t total = so_offsets(t->numels, t->count, offsets);
    int team = so_team_size(x->threads, total);
    int64_t chunk = so_chunk(x->chunk_elems, total, team);
    rc = SO_OK;
    if (total > 0 && rollback) {
        /* refuse non-finite input before writing anything (DESIGN.md §4: never zero it) */
        uint32_t mask = so_parallel_walk(t, offsets, k, &c, h->sr_seed, variant, 1, total, team,
                                         x->schedule, chunk);
        if (mask & 1u) rc = SO_ERR_NONFINITE_PARAM;
        else if (mask & 2u) rc = SO_ERR_NONFINITE_EXP_AVG;
        else if (mask & 4u) rc = SO_ERR_NONFINITE_EXP_AVG_SQ;
        else if (mask & 8u) rc = SO_ERR_NONFINITE_GRAD;
    }
    if (total > 0 && rc == SO_OK)
        so_parallel_walk(t, offsets, k, &c, h->sr_seed, variant, 0, total, team, x->schedule,
                         chunk);
    if (offsets != stack_offsets) free(offsets);
    return rc;
}

int so_adam_step_multi(const so_adam_tensors *t, const so_adam_hparams *h, const so_exec *x) {
    return so_adam_common(t, h, x, 0);
}

int so_adam_rollback_multi(const so_adam_tensors *t, const so_adam_hparams *h,
                           const so_exec *x) {
    return so_adam_common(t, h, x, 1);
}

int so_bandwidth_probe(const so_adam_tensors *t, int threads, int simd) {
    if (threads < 1) return SO_ERR_THREADS;
    int rc = so_tensors_check(t);
    if (rc != SO_OK) return rc;
    if (t->grad_dtype != SO_DTYPE_F32 || t->moment_dtype != SO_DTYPE_F32) return SO_ERR_DTYPE;
    int path = so_simd_resolve(simd);
    const so_kernels *k = path < 0 ? NULL : so_kernels_for(path);
    if (k == NULL) return SO_ERR_SIMD;
    int64_t stack_offsets[SO_STACK_TENSORS + 1];
    int64_t *offsets = t->count <= SO_STACK_TENSORS
                           ? stack_offsets
                           : (int64_t *)malloc(sizeof(int64_t) * (size_t)(t->count + 1));
    if (offsets == NULL) return SO_ERR_SCRATCH;
    int64_t total = so_offsets(t->numels, t->count, offsets);
    if (total > 0)
        so_parallel_walk(t, offsets, k, NULL, 0, 0, 2, total, so_team_size(threads, total),
                         SO_SCHED_STATIC, 0);
    if (offsets != stack_offsets) free(offsets);
    return SO_OK;
}

int64_t so_grad_stats_blocks(const int64_t *numels, int64_t count) {
    int64_t blocks = 0;
    for (int64_t i = 0; i < count; ++i)
        blocks += (numels[i] + SO_STATS_BLOCK - 1) / SO_STATS_BLOCK;
    return blocks;
}

int so_grad_stats_multi(void **grads, const int64_t *numels, int64_t count, int grad_dtype,
                        int threads, int simd, double *scratch, int64_t scratch_len,
                        double *sum_sq, int64_t *nonfinite) {
    if (sum_sq == NULL || nonfinite == NULL || count < 0) return SO_ERR_NULL;
    if (count > 0 && (grads == NULL || numels == NULL)) return SO_ERR_NULL;
    if (threads < 1) return SO_ERR_THREADS;
    if (grad_dtype != SO_DTYPE_F32 && grad_dtype != SO_DTYPE_BF16) return SO_ERR_DTYPE;
    for (int64_t i = 0; i < count; ++i)
        if (numels[i] < 0 || (numels[i] > 0 && grads[i] == NULL)) return SO_ERR_NULL;
    int path = so_simd_resolve(simd);
    const so_kernels *k = path < 0 ? NULL : so_kernels_for(path);
    if (k == NULL) return SO_ERR_SIMD;
    int64_t blocks = so_grad_stats_blocks(numels, count);
    if (blocks > 0 && (scratch == NULL || scratch_len < blocks)) return SO_ERR_SCRATCH;

    int64_t bad = 0;
    int team = so_team_size(threads, blocks * (int64_t)SO_STATS_BLOCK);
#pragma omp parallel num_threads(team) reduction(+ : bad)
    {
        int T = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t b_lo = blocks * me / T, b_hi = blocks * (me + 1) / T;
        int64_t first = 0; /* global index of tensor i's first block */
        for (int64_t i = 0; i < count && first < b_hi; ++i) {
            int64_t nb = (numels[i] + SO_STATS_BLOCK - 1) / SO_STATS_BLOCK;
            for (int64_t b = (b_lo > first ? b_lo : first); b < first + nb && b < b_hi; ++b) {
                int64_t lo = (b - first) * SO_STATS_BLOCK;
                int64_t hi = lo + SO_STATS_BLOCK < numels[i] ? lo + SO_STATS_BLOCK : numels[i];
                int64_t block_bad = 0;
                k->stats(grads[i], grad_dtype, lo, hi, &scratch[b], &block_bad);
                bad += block_bad;
            }
            first += nb;
        }
    }
    double total = 0.0;
    for (int64_t b = 0; b < blocks; ++b) total += scratch[b];
    *sum_sq = total;
    *nonfinite = bad;
    return SO_OK;
}
