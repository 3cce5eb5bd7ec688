/* The Adam loops compiled once per SIMD target, and run-time selection of the target.
 *
 * x86-64: portable (the x86-64 baseline, SSE2), AVX2 (+FMA, F16C) and AVX-512 (F, BW, VL,
 * DQ, 512-bit vectors), each the same so_adam_body.h under `#pragma GCC target`, chosen
 * per call with __builtin_cpu_supports. aarch64: NEON (architectural baseline; "portable"
 * resolves to it) and SVE, chosen with getauxval(AT_HWCAP) & HWCAP_SVE (Grace, DESIGN.md
 * §1). The build never uses -march=native, so one binary runs on any CPU of its arch.
 * -ffp-contract=off keeps FMA out, so every path gives the same bits.
 */
#include "so_internal.h"

#if defined(__x86_64__)

#define SO_SUFFIX portable
#include "so_adam_body.h"
#undef SO_SUFFIX

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define SO_SUFFIX avx2
#include "so_adam_body.h"
#undef SO_SUFFIX
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
#define SO_SUFFIX avx512
#include "so_adam_body.h"
#undef SO_SUFFIX
#pragma GCC pop_options

static int so_cpu_has(int path) {
    __builtin_cpu_init();
    switch (path) {
        case SO_SIMD_PORTABLE:
            return 1;
        case SO_SIMD_AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
        case SO_SIMD_AVX512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
        default:
            return 0;
    }
}

int so_simd_resolve(int requested) {
    if (requested == SO_SIMD_AUTO) {
        if (so_cpu_has(SO_SIMD_AVX512)) return SO_SIMD_AVX512;
        if (so_cpu_has(SO_SIMD_AVX2)) return SO_SIMD_AVX2;
        return SO_SIMD_PORTABLE;
    }
    return so_cpu_has(requested) ? requested : SO_ERR_SIMD;
}

const so_kernels *so_kernels_for(int path) {
    switch (path) {
        case SO_SIMD_PORTABLE: return &so_kernels_table_portable;
        case SO_SIMD_AVX2: return &so_kernels_table_avx2;
        case SO_SIMD_AVX512: return &so_kernels_table_avx512;
        default: return NULL;
    }
}

#elif defined(__aarch64__)

#define SO_SUFFIX neon
#include "so_adam_body.h"
#undef SO_SUFFIX

#pragma GCC push_options
#pragma GCC target("+sve")
#define SO_SUFFIX sve
#include "so_adam_body.h"
#undef SO_SUFFIX
#pragma GCC pop_options

/* Declared here rather than via <sys/auxv.h> so the sources build with only the compiler's
 * own headers (Debian's cross compiler ships without the arm64 libc headers). The values
 * are Linux's stable uapi constants. */
extern unsigned long getauxval(unsigned long type);
#define SO_AT_HWCAP 16ul
#define SO_HWCAP_SVE (1ul << 22)

int so_simd_resolve(int requested) {
    int has_sve = (getauxval(SO_AT_HWCAP) & SO_HWCAP_SVE) != 0;
    switch (requested) {
        case SO_SIMD_AUTO: return has_sve ? SO_SIMD_SVE : SO_SIMD_NEON;
        case SO_SIMD_PORTABLE:
        case SO_SIMD_NEON: return SO_SIMD_NEON;
        case SO_SIMD_SVE: return has_sve ? SO_SIMD_SVE : SO_ERR_SIMD;
        default: return SO_ERR_SIMD;
    }
}

const so_kernels *so_kernels_for(int path) {
    switch (path) {
        case SO_SIMD_NEON: return &so_kernels_table_neon;
        case SO_SIMD_SVE: return &so_kernels_table_sve;
        default: return NULL;
    }
}

#else /* any other architecture: the portable loop only */

#define SO_SUFFIX portable
#include "so_adam_body.h"
#undef SO_SUFFIX

int so_simd_resolve(int requested) {
    return (requested == SO_SIMD_AUTO || requested == SO_SIMD_PORTABLE) ? SO_SIMD_PORTABLE
                                                                         : SO_ERR_SIMD;
}

const so_kernels *so_kernels_for(int path) {
    return path == SO_SIMD_PORTABLE ? &so_kernels_table_portable : NULL;
}

#endif
