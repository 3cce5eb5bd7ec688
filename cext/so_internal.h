/* Internal types shared by so_cpu_adam.c (threads, validation) and so_simd.c (the loops
 * compiled per SIMD target). Not part of the cffi declaration. */
#ifndef SO_INTERNAL_H
#define SO_INTERNAL_H

#include "so_cpu_adam.h"
#include "so_numerics.h"

/* Per-call fp32 coefficients, each rounded once from the fp64 hyper-parameters
 * (torch_ref.py's _coefficients() computes the same values). */
typedef struct so_coeffs {
    float b1, b2, omb1, omb2, eps;
    float grad_scale;
    float wd_l2;     /* weight decay added to g in L2 mode */
    float decay;     /* 1 - lr*wd in AdamW mode, else 1 */
    float step_size; /* lr / (1 - b1^t), or lr without bias correction */
    float bc2_sqrt;  /* sqrt(1 - b2^t), or 1 */
} so_coeffs;

/* A contiguous range [lo, hi) of one tensor, as one thread sees it. */
typedef struct so_seg {
    float *p;
    const void *g;
    void *m;
    void *v;
    void *lp;
    int64_t lo, hi;
    uint32_t sr_key;    /* so_sr_key(seed, top 32 bits of the global index) */
    uint32_t index0_lo; /* low 32 bits of the global index of element lo */
} so_seg;

typedef void (*so_adam_run_fn)(const so_coeffs *c, const so_seg *s, int variant);
typedef uint32_t (*so_check_run_fn)(const so_seg *s, int gdt, int mdt);
typedef void (*so_probe_run_fn)(const so_seg *s);
typedef void (*so_stats_run_fn)(const void *grad, int gdt, int64_t lo, int64_t hi,
                                double *sum_sq, int64_t *nonfinite);

/* The loops of one SIMD path (constant tables: the library has no mutable global state). */
typedef struct so_kernels {
    so_adam_run_fn adam;
    so_check_run_fn check;
    so_stats_run_fn stats;
    so_probe_run_fn probe;
} so_kernels;

/* The loops of a resolved path (so_simd_resolve), or NULL when not compiled in. */
const so_kernels *so_kernels_for(int path);

#endif /* SO_INTERNAL_H */
