/* The kernel's C test harness: declarations shared by its four files.
 *
 * The harness drives every entry point of cext/so_cpu_adam.h from C alone, so it runs where
 * no Python exists: natively (x86-64 portable / AVX2 / AVX-512, or aarch64 on real Grace
 * hardware) and under qemu-user (aarch64 NEON, SVE at 128/256/512-bit vectors). It prints
 * one line per check; tests/test_kernel_emulated.py builds it, runs it on every path and
 * compares the digests of all runs bit for bit.
 *
 * Files: so_harness_util.c (inputs, tensors with guard zones, digests, report),
 * so_harness_ref.c (the float64 statement of the step and its tolerances),
 * so_harness.c (main; the step/rollback cases), so_harness_cases.c (non-finite inputs,
 * grad_stats, the bandwidth probe, return codes). Built with the kernel's own compile flags
 * (cext/build_cpu_adam.py COMPILE_FLAGS: -ffp-contract=off, no FMA), so the inputs it makes
 * with float arithmetic are the same bits on every ISA.
 *
 * Output (one record per line, space separated):
 *   dispatch auto=<path> portable=<path|none> ... sve=<path|none>   what so_simd_resolve says
 *   vl_bytes <n>        SVE vector length in bytes (0 without SVE)
 *   omp_threads <n>     threads a 4-thread OpenMP region really got
 *   digest <case> <exact> <canonical>   FNV-1a 64 of every output byte; canonical maps
 *                                       every NaN to one pattern first
 *   check <case> ok <worst error/tolerance> | check <case> FAIL <what>
 *   done <checks> <failures>            exit status 0 only without failures
 */
#ifndef SO_HARNESS_H
#define SO_HARNESS_H

#include <stddef.h>
#include <stdint.h>

#include "so_cpu_adam.h"

/* ---- deterministic inputs (splitmix64: integer only, the same on every ISA) ---------- */
typedef struct so_rng {
    uint64_t state;
} so_rng;

uint64_t so_rng_next(so_rng *r);
/* Uniform in [-1, 1) with 24 bits: exact in fp32. */
float so_rng_unit(so_rng *r);

/* ---- one multi-tensor call's buffers --------------------------------------------------- */
/* Tensors lie back to back in one pool per array with SO_GUARD sentinel elements before,
 * between and after them, so every tensor starts at a different alignment and a loop that
 * writes past its end (a wrong SIMD tail) is caught. */
#define SO_GUARD 40  /* > one 2048-bit SVE vector of fp32 */
#define SO_MAX_TENSORS 640

typedef struct so_batch {
    int64_t count;
    int64_t numels[SO_MAX_TENSORS];
    int64_t offsets[SO_MAX_TENSORS]; /* element offset of each tensor in its pool */
    int64_t pool_elems;
    int gdt, mdt, lpdt;
    float *p;       /* fp32 pools */
    void *g, *m, *v, *lp;
    /* the pointer arrays so_adam_tensors points into */
    float *pp[SO_MAX_TENSORS];
    void *gp[SO_MAX_TENSORS], *mp[SO_MAX_TENSORS], *vp[SO_MAX_TENSORS], *lpp[SO_MAX_TENSORS];
    so_adam_tensors t;
} so_batch;

/* Element size in bytes of an SO_DTYPE_* (0 for SO_DTYPE_NONE). */
int so_dtype_size(int dtype);
/* "f32", "bf16", "f16" or "none": the names in the case labels. */
const char *so_dtype_name(int dtype);
/* "<prefix>/g<dtype>-m<dtype>-lp<dtype>" into out (a case label); returns its length. */
size_t so_variant_name(char *out, size_t size, const char *prefix, int gdt, int mdt, int lpdt);

/* Allocate and fill: p = 2u, g = u * 2^k (k in [-12, 3]; a few subnormal), m = u/10,
 * v = |u|/100 + 1e-4 (warm) or m = v = 0 (cold); lp zero; guards set. */
so_batch *so_batch_new(const int64_t *numels, int64_t count, int gdt, int mdt, int lpdt,
                       uint64_t seed, int warm);
so_batch *so_batch_clone(const so_batch *b);
void so_batch_free(so_batch *b);
/* Value of element i of tensor k of one array (widened to double). */
double so_get(const so_batch *b, char array, int64_t k, int64_t i);
/* Overwrite element i of tensor k of one array from a float (rounded to its dtype). */
void so_put(so_batch *b, char array, int64_t k, int64_t i, float x);
/* Number of guard elements that changed (0 unless something wrote out of bounds). */
int64_t so_guards_broken(const so_batch *b);

/* ---- digests ----------------------------------------------------------------------------- */
typedef struct so_digest {
    uint64_t exact, canonical;
} so_digest;

void so_digest_init(so_digest *d);
void so_digest_bytes(so_digest *d, const void *data, size_t n);
/* Every tensor's elements of the written arrays (p, m, v, lp), in order. */
void so_digest_batch(so_digest *d, const so_batch *b);
void so_digest_i64(so_digest *d, int64_t x);
void so_digest_f64(so_digest *d, double x);
int so_digest_equal(const so_digest *a, const so_digest *b);

/* ---- report ------------------------------------------------------------------------------ */
void so_print_digest(const char *name, const so_digest *d);
/* Record a check; ratio is the worst error / tolerance (< 1 passes) or -1 when n/a. */
void so_check(const char *name, int ok, double ratio, const char *what);
int so_failures(void);
int so_checks(void);

/* ---- the float64 statement of a step (so_harness_ref.c) ---------------------------------- */
typedef struct so_ref_result {
    double worst_ratio; /* max over elements and arrays of |err| / tolerance */
    int64_t bad;        /* elements past their tolerance */
    char where[96];     /* the first bad element */
} so_ref_result;

/* Compare `post` (after one step of `pre`) with DESIGN.md §4 in float64. */
so_ref_result so_ref_step(const so_batch *pre, const so_batch *post, const so_adam_hparams *h);
/* Compare `restored` (step then rollback of `pre`) with `pre`: the inverse is exact to a
 * few roundings of the magnitudes it works with (tests/_kernel_support.py's bound). */
so_ref_result so_ref_rollback(const so_batch *pre, const so_batch *post,
                              const so_batch *restored, const so_adam_hparams *h);

#endif /* SO_HARNESS_H */
