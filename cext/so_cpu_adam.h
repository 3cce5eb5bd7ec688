/* superoffload CPU Adam/AdamW kernel: the C declaration (DESIGN.md §4).
 *
 * Three layers (docs/conventions.md, "Kernel bindings in three layers"): this header is
 * the declaration; cext/build_cpu_adam.py compiles it into the private module superoffload.kernels._cpu_adam_cffi; the thin wrapper
 * superoffload/kernels/cpu_adam.py checks every argument and turns every return code into
 * an exception. The library holds no global state: every call gets all it needs.
 *
 * The block between CDEF-BEGIN and CDEF-END is fed verbatim to cffi's cdef, so it holds
 * only declarations cffi understands (no preprocessor conditionals).
 *
 * Legend: p = fp32 master param, g = gradient, m = exp_avg, v = exp_avg_sq,
 *         lp = low-precision copy of p (bf16 or fp16), sr = stochastic rounding.
 */
#ifndef SO_CPU_ADAM_H
#define SO_CPU_ADAM_H

#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */
/* Bumped whenever a declaration below changes; the wrapper refuses a stale build. */
#define SO_KERNEL_ABI_VERSION 7

/* element types */
#define SO_DTYPE_NONE -1
#define SO_DTYPE_F32 0
#define SO_DTYPE_BF16 1
#define SO_DTYPE_F16 2

/* SIMD paths; SO_SIMD_AUTO picks the best one the CPU supports */
#define SO_SIMD_AUTO 0
#define SO_SIMD_PORTABLE 1
#define SO_SIMD_AVX2 2
#define SO_SIMD_AVX512 3
#define SO_SIMD_NEON 4
#define SO_SIMD_SVE 5

/* how the element range is split among threads (so_exec.schedule) */
#define SO_SCHED_STATIC 0
#define SO_SCHED_DYNAMIC 1

/* return codes (0 = success); the wrapper maps each to an exception */
#define SO_OK 0
#define SO_ERR_NULL -1
#define SO_ERR_DTYPE -2
#define SO_ERR_HPARAM -3
#define SO_ERR_SIMD -4
#define SO_ERR_THREADS -5
#define SO_ERR_SCRATCH -6
#define SO_ERR_NONFINITE_PARAM -10
#define SO_ERR_NONFINITE_EXP_AVG -11
#define SO_ERR_NONFINITE_EXP_AVG_SQ -12
#define SO_ERR_NONFINITE_GRAD -13

/* Elements per grad_stats block: each block's sum of squares is accumulated in fp64 in 8
 * fixed lanes, and the blocks are summed in order, so any thread count and any SIMD path
 * give the same bits. */
#define SO_STATS_BLOCK 4096

typedef struct so_adam_hparams {
    double lr;
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    double grad_scale;       /* g = grad * grad_scale (unscale and clip fused in; < 0:
                                maximize, a step with -grad) */
    int64_t step;            /* t >= 1, the step being taken (or undone) */
    int adamw_mode;          /* 1: decoupled decay (AdamW); 0: L2 (g += wd * p first) */
    int bias_correction;     /* 1: divide by 1 - beta^t; 0: do not */
    uint64_t sr_seed;        /* stochastic rounding seed for bf16 moments */
} so_adam_hparams;

/* count tensors given as arrays of pointers; all grads share grad_dtype, all moments
 * share moment_dtype; params_lp may be NULL, and so may any entry of it. */
typedef struct so_adam_tensors {
    float **params;
    void **grads;
    void **exp_avgs;
    void **exp_avg_sqs;
    void **params_lp;
    const int64_t *numels;
    int64_t count;
    int grad_dtype;          /* SO_DTYPE_F32 or SO_DTYPE_BF16 */
    int moment_dtype;        /* SO_DTYPE_F32 or SO_DTYPE_BF16 (stochastic rounding) */
    int lp_dtype;            /* SO_DTYPE_NONE, SO_DTYPE_BF16 or SO_DTYPE_F16 */
} so_adam_tensors;

/* How one call runs: none of these changes a result bit (every result is a pure function
 * of the element and its global index). */
typedef struct so_exec {
    int threads;             /* >= 1 OpenMP threads */
    int simd;                /* SO_SIMD_* */
    int schedule;            /* SO_SCHED_*: one range per thread, or chunks on demand */
    int64_t chunk_elems;     /* elements per chunk of the dynamic schedule (>= 64) */
} so_exec;

int so_kernel_abi_version(void);

/* The path a request resolves to on this CPU (AUTO -> best), or SO_ERR_SIMD. */
int so_simd_resolve(int requested);

/* One Adam step over all tensors in ONE OpenMP parallel region. */
int so_adam_step_multi(const so_adam_tensors *t, const so_adam_hparams *h, const so_exec *x);

/* The inverse of so_adam_step_multi with the same arguments (DESIGN.md §4). Refuses
 * non-finite p, m, v or grad with SO_ERR_NONFINITE_* and then writes nothing. */
int so_adam_rollback_multi(const so_adam_tensors *t, const so_adam_hparams *h,
                           const so_exec *x);

/* Benchmark probe with Adam's memory traffic and (almost) no arithmetic: reads p, g, m, v
 * and writes p, m, v in place (p += g, m += g, v += g; 28 B/param), with the same threads
 * and partition as a step. Its throughput is the bandwidth floor of the fp32 step.
 * fp32 grads and moments only. */
int so_bandwidth_probe(const so_adam_tensors *t, int threads, int simd);

/* Number of SO_STATS_BLOCK blocks grad_stats needs as scratch for these lengths. */
int64_t so_grad_stats_blocks(const int64_t *numels, int64_t count);

/* Sum of squares of the finite values (fp64) and count of non-finite values.
 * scratch holds at least so_grad_stats_blocks(numels, count) doubles. */
int so_grad_stats_multi(void **grads, const int64_t *numels, int64_t count, int grad_dtype,
                        int threads, int simd, double *scratch, int64_t scratch_len,
                        double *sum_sq, int64_t *nonfinite);
/* Rollback guard (cext/so_guard.c): the number of elements with (grad*grad_scale)^2 >
 * c_v * exp_avg_sq, over count tensors, in one parallel region. fp32 or bf16 gradients,
 * fp32 moments. Used before a speculative step (runtime/auto_rollback.py). */
int so_rollback_risk_multi(void **grads, void **exp_avg_sqs, const int64_t *numels,
                           int64_t count, int grad_dtype, double grad_scale, double c_v,
                           int threads, int64_t *risky);
/* CDEF-END */

#endif /* SO_CPU_ADAM_H */
