/* The kernel's C test harness: every entry point of so_cpu_adam.h on one SIMD path
 * (output format in so_harness.h; docs/kernel.md, "Which paths are verified where").
 *
 *   so_harness [--simd auto|portable|avx2|avx512|neon|sve] [--quick]
 *
 * Cases: all 48 step/rollback variants (grad fp32/bf16 x moments fp32/bf16 x copy
 * none/bf16/fp16 x AdamW/L2, with bias correction on and off) over tails of every length
 * around a vector (0, 1, VL-1, VL, VL+1 for VL up to 2048 bits) at odd alignments; thread
 * counts and schedules; 10^6+3 elements (skipped by --quick); > 512 tensors; aliasing
 * gradients; non-finite inputs; grad_stats; the bandwidth probe; every return code.
 */
#include <omp.h>
#include <stdio.h>
#include <string.h>
#if defined(__aarch64__) && defined(__linux__)
#include <sys/prctl.h>
#endif

#include "so_harness.h"

static int g_simd = SO_SIMD_AUTO; /* the path every call asks for */

static const char *path_name(int code) {
    switch (code) {
        case SO_SIMD_AUTO: return "auto";
        case SO_SIMD_PORTABLE: return "portable";
        case SO_SIMD_AVX2: return "avx2";
        case SO_SIMD_AVX512: return "avx512";
        case SO_SIMD_NEON: return "neon";
        case SO_SIMD_SVE: return "sve";
        default: return "none";
    }
}

static so_exec exec_of(int threads, int schedule, int64_t chunk) {
    so_exec x = {threads, g_simd, schedule, chunk};
    return x;
}

static so_adam_hparams hparams(int l2, int bc, int64_t step, double grad_scale, uint64_t seed) {
    so_adam_hparams h = {1e-3, 0.9, 0.999, 1e-8, l2 ? 0.1 : 0.01, grad_scale, step, !l2, bc, seed};
    return h;
}

/* Step `pre` (into a clone), roll it back (into another clone), check rc, guards and the
 * float64 statement of both; fold both results into d. */
static void step_and_rollback(const char *name, const so_batch *pre, const so_adam_hparams *h,
                              const so_exec *x, so_digest *d, int check_ref) {
    char label[160], what[200];
    so_batch *post = so_batch_clone(pre);
    int rc = so_adam_step_multi(&post->t, h, x);
    int64_t broken = so_guards_broken(post);
    so_ref_result rs = {0.0, 0, ""};
    if (check_ref && rc == SO_OK) rs = so_ref_step(pre, post, h);
    snprintf(label, sizeof label, "%s/step", name);
    snprintf(what, sizeof what, "rc=%d guards_broken=%lld bad=%lld %s", rc, (long long)broken,
             (long long)rs.bad, rs.where);
    so_check(label, rc == SO_OK && broken == 0 && rs.bad == 0, rs.worst_ratio, what);
    so_digest_batch(d, post);

    so_batch *back = so_batch_clone(post);
    rc = so_adam_rollback_multi(&back->t, h, x);
    broken = so_guards_broken(back);
    so_ref_result rr = {0.0, 0, ""};
    if (check_ref && rc == SO_OK) rr = so_ref_rollback(pre, post, back, h);
    snprintf(label, sizeof label, "%s/rollback", name);
    snprintf(what, sizeof what, "rc=%d guards_broken=%lld bad=%lld %s", rc, (long long)broken,
             (long long)rr.bad, rr.where);
    so_check(label, rc == SO_OK && broken == 0 && rr.bad == 0, rr.worst_ratio, what);
    so_digest_batch(d, back);
    so_batch_free(back), so_batch_free(post);
}

/* One step/rollback case checked against float64, its digest printed; frees `pre`. */
static void run_case(const char *name, so_batch *pre, const so_adam_hparams *h, const so_exec *x) {
    so_digest d;
    so_digest_init(&d);
    step_and_rollback(name, pre, h, x, &d, 1);
    so_print_digest(name, &d);
    so_batch_free(pre);
}

/* Every variant over every tail length, in one multi call each (each tensor is its own
 * SIMD loop with its own remainder). */
static void case_tails(void) {
    static const int64_t lengths[] = {0,  1,  2,  3,  4,   5,   6,   7,   8,    9,    10,
                                      11, 12, 13, 14, 15,  16,  17,  31,  32,   33,   63,
                                      64, 65, 127, 128, 129, 255, 256, 257, 1000, 4095, 4096, 4097};
    static const int dts[2] = {SO_DTYPE_F32, SO_DTYPE_BF16};
    static const int lps[3] = {SO_DTYPE_NONE, SO_DTYPE_BF16, SO_DTYPE_F16};
    int count = (int)(sizeof lengths / sizeof lengths[0]), idx = 0;
    for (int gi = 0; gi < 2; ++gi)
        for (int mi = 0; mi < 2; ++mi)
            for (int li = 0; li < 3; ++li)
                for (int l2 = 0; l2 < 2; ++l2)
                    for (int bc = 0; bc < 2; ++bc, ++idx) {
                        char name[96];
                        size_t at = so_variant_name(name, sizeof name, "tails", dts[gi], dts[mi],
                                                    lps[li]);
                        snprintf(name + at, sizeof name - at, "-%s-bc%d", l2 ? "l2" : "adamw", bc);
                        so_batch *pre = so_batch_new(lengths, count, dts[gi], dts[mi], lps[li],
                                                     (uint64_t)idx, idx % 3 != 0);
                        so_adam_hparams h = hparams(l2, bc, 1 + idx % 5, bc ? 1.0 : 0.37,
                                                    0x5eed0000ull + (uint64_t)idx);
                        so_exec x = exec_of(2, SO_SCHED_STATIC, 0);
                        run_case(name, pre, &h, &x);
                    }
}

/* Thread counts and schedules change no bit; the first run is checked against float64. */
static void case_threads(int quick) {
    static const int64_t sizes[] = {70001, 3, 129999, 64, 1, 65537};
    static const int variants[3][5] = {/* gdt, mdt, lpdt, l2, bc */
                                       {SO_DTYPE_F32, SO_DTYPE_F32, SO_DTYPE_NONE, 0, 1},
                                       {SO_DTYPE_BF16, SO_DTYPE_BF16, SO_DTYPE_BF16, 1, 1},
                                       {SO_DTYPE_F32, SO_DTYPE_BF16, SO_DTYPE_F16, 0, 0}};
    static const int runs[5][3] = {/* threads, schedule, chunk */
                                   {1, SO_SCHED_STATIC, 0},    {2, SO_SCHED_STATIC, 0},
                                   {4, SO_SCHED_STATIC, 0},    {3, SO_SCHED_DYNAMIC, 64},
                                   {4, SO_SCHED_DYNAMIC, 4096}};
    int n_runs = quick ? 2 : 5;
    for (int vi = 0; vi < 3; ++vi) {
        const int *v = variants[vi];
        char name[64];
        so_variant_name(name, sizeof name, "threads", v[0], v[1], v[2]);
        so_batch *pre = so_batch_new(sizes, 6, v[0], v[1], v[2], 100 + (uint64_t)vi, 1);
        so_adam_hparams h = hparams(v[3], v[4], 7, v[4] ? 1.0 : 0.3, 42 + (uint64_t)vi);
        so_digest first = {0, 0};
        int same = 1;
        for (int r = 0; r < n_runs; ++r) {
            so_exec x = exec_of(runs[r][0], runs[r][1], runs[r][2]);
            so_digest d;
            so_digest_init(&d);
            step_and_rollback(name, pre, &h, &x, &d, r == 0);
            if (r == 0) first = d;
            else same &= so_digest_equal(&first, &d);
        }
        so_check(name, same, -1, "a thread count or schedule changed a bit");
        so_print_digest(name, &first);
        so_batch_free(pre);
    }
}

/* 10^6 + 3 elements, 4 threads. */
static void case_big(void) {
    static const int variants[2][5] = {{SO_DTYPE_F32, SO_DTYPE_F32, SO_DTYPE_NONE, 0, 1},
                                       {SO_DTYPE_BF16, SO_DTYPE_BF16, SO_DTYPE_BF16, 1, 1}};
    int64_t n = 1000003;
    for (int vi = 0; vi < 2; ++vi) {
        const int *v = variants[vi];
        char name[64];
        so_variant_name(name, sizeof name, "big", v[0], v[1], v[2]);
        so_batch *pre = so_batch_new(&n, 1, v[0], v[1], v[2], 7 + (uint64_t)vi, 1);
        so_adam_hparams h = hparams(v[3], v[4], 10, 1.0, 99);
        so_exec x = exec_of(4, SO_SCHED_STATIC, 0);
        run_case(name, pre, &h, &x);
    }
}

/* More tensors than the kernel keeps offsets for on its stack (512): the malloc path. */
static void case_many_tensors(void) {
    int64_t sizes[600];
    for (int i = 0; i < 600; ++i) sizes[i] = (i * 37) % 50;
    so_batch *pre = so_batch_new(sizes, 600, SO_DTYPE_BF16, SO_DTYPE_F32, SO_DTYPE_BF16, 5, 1);
    so_adam_hparams h = hparams(0, 1, 2, 1.0, 3);
    so_exec x = exec_of(3, SO_SCHED_DYNAMIC, 64);
    run_case("many_tensors", pre, &h, &x);
}

/* Gradients may alias each other (the kernel only reads them: kernels/checks.py): a call
 * whose grads share memory computes what copies compute. */
static void case_aliasing_grads(void) {
    int64_t sizes[3] = {5000, 5000, 3000};
    so_batch *copies = so_batch_new(sizes, 3, SO_DTYPE_F32, SO_DTYPE_F32, SO_DTYPE_BF16, 11, 1);
    /* copies: tensor 1's grad = tensor 0's; tensor 2's = tensor 0's elements 1000.. */
    memcpy(copies->gp[1], copies->gp[0], 5000 * sizeof(float));
    memcpy(copies->gp[2], (float *)copies->gp[0] + 1000, 3000 * sizeof(float));
    so_batch *shared = so_batch_clone(copies);
    shared->gp[1] = shared->gp[0];
    shared->gp[2] = (float *)shared->gp[0] + 1000;
    so_adam_hparams h = hparams(0, 1, 4, 0.5, 1);
    so_exec x = exec_of(2, SO_SCHED_STATIC, 0);
    int rc1 = so_adam_step_multi(&copies->t, &h, &x), rc2 = so_adam_step_multi(&shared->t, &h, &x);
    so_digest a, b;
    so_digest_init(&a), so_digest_init(&b);
    so_digest_batch(&a, copies), so_digest_batch(&b, shared);
    so_check("aliasing_grads", rc1 == SO_OK && rc2 == SO_OK && so_digest_equal(&a, &b), -1,
             "aliasing gradients gave other bits than copies");
    so_print_digest("aliasing_grads", &a);
    so_batch_free(copies), so_batch_free(shared);
}

void so_cases_nonfinite(int simd);
void so_cases_stats_probe_errors(int simd);

int main(int argc, char **argv) {
    int quick = 0;
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "--quick") == 0) {
            quick = 1;
        } else if (strcmp(argv[i], "--simd") == 0 && i + 1 < argc) {
            const char *want = argv[++i];
            int code = -1;
            for (int c = SO_SIMD_AUTO; c <= SO_SIMD_SVE; ++c)
                if (strcmp(want, path_name(c)) == 0) code = c;
            if (code < 0) {
                fprintf(stderr, "unknown --simd %s\n", want);
                return 2;
            }
            g_simd = code;
        } else {
            fprintf(stderr, "usage: %s [--simd auto|portable|avx2|avx512|neon|sve] [--quick]\n",
                    argv[0]);
            return 2;
        }
    }
    printf("abi %d\n", so_kernel_abi_version());
    printf("dispatch auto=%s", path_name(so_simd_resolve(SO_SIMD_AUTO)));
    for (int c = SO_SIMD_PORTABLE; c <= SO_SIMD_SVE; ++c)
        printf(" %s=%s", path_name(c), path_name(so_simd_resolve(c)));
    printf("\n");
    int path = so_simd_resolve(g_simd);
    printf("path %s\n", path_name(path));
    if (path < 0) {
        printf("done 0 1\n");
        return 1;
    }
    long vl = 0;
#if defined(__aarch64__) && defined(__linux__) && defined(PR_SVE_GET_VL)
    vl = prctl(PR_SVE_GET_VL, 0, 0, 0, 0);
    vl = vl < 0 ? 0 : (vl & PR_SVE_VL_LEN_MASK);
#endif
    printf("vl_bytes %ld\n", vl);
    int team = 0;
#pragma omp parallel num_threads(4)
    {
#pragma omp single
        team = omp_get_num_threads();
    }
    printf("omp_threads %d\n", team);
    fflush(stdout);

    case_tails();
    case_threads(quick);
    if (!quick) case_big();
    case_many_tensors();
    case_aliasing_grads();
    so_cases_nonfinite(g_simd);
    so_cases_stats_probe_errors(g_simd);
    printf("done %d %d\n", so_checks(), so_failures());
    return so_failures() == 0 ? 0 : 1;
}
