/* The harness's plumbing: deterministic inputs, tensors with guard zones, digests and the
 * report (so_harness.h). Everything that makes an input is integer arithmetic or single
 * IEEE operations compiled without FMA, so x86-64 and aarch64 make the same bits. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "so_harness.h"
#include "so_numerics.h"

/* ---- inputs ------------------------------------------------------------------------------ */

uint64_t so_rng_next(so_rng *r) { /* splitmix64 (Steele, Lea, Flood 2014) */
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float so_rng_unit(so_rng *r) {
    int32_t k = (int32_t)(so_rng_next(r) >> 40) - (1 << 23); /* [-2^23, 2^23) */
    return (float)k * 0x1p-23f;                            /* exact */
}

int so_dtype_size(int dtype) {
    return dtype == SO_DTYPE_F32 ? 4 : (dtype == SO_DTYPE_NONE ? 0 : 2);
}

const char *so_dtype_name(int dtype) {
    return dtype == SO_DTYPE_F32 ? "f32" : dtype == SO_DTYPE_BF16 ? "bf16"
         : dtype == SO_DTYPE_F16 ? "f16" : "none";
}

size_t so_variant_name(char *out, size_t size, const char *prefix, int gdt, int mdt, int lpdt) {
    int n = snprintf(out, size, "%s/g%s-m%s-lp%s", prefix, so_dtype_name(gdt),
                     so_dtype_name(mdt), so_dtype_name(lpdt));
    return n < 0 ? 0 : ((size_t)n < size ? (size_t)n : size - 1);
}

#define SO_GUARD_BITS32 0xdeadbeefu
#define SO_GUARD_BITS16 0xbeefu

static void *pool_new(int64_t elems, int dtype) {
    size_t size = (size_t)so_dtype_size(dtype);
    void *pool = size ? malloc((size_t)elems * size) : NULL;
    if (size && pool == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    for (int64_t i = 0; size && i < elems; ++i) {
        if (size == 4) ((uint32_t *)pool)[i] = SO_GUARD_BITS32;
        else ((uint16_t *)pool)[i] = SO_GUARD_BITS16;
    }
    return pool;
}

static void *elem_ptr(void *pool, int dtype, int64_t index) {
    return (char *)pool + (size_t)index * (size_t)so_dtype_size(dtype);
}

static void batch_pointers(so_batch *b) {
    for (int64_t k = 0; k < b->count; ++k) {
        int64_t at = b->offsets[k];
        b->pp[k] = b->p + at;
        b->gp[k] = elem_ptr(b->g, b->gdt, at);
        b->mp[k] = elem_ptr(b->m, b->mdt, at);
        b->vp[k] = elem_ptr(b->v, b->mdt, at);
        b->lpp[k] = b->lp ? elem_ptr(b->lp, b->lpdt, at) : NULL;
    }
    so_adam_tensors t = {b->pp, b->gp, b->mp, b->vp, b->lp ? b->lpp : NULL, b->numels,
                         b->count, b->gdt, b->mdt, b->lpdt};
    b->t = t;
}

static double f16_to_f64(uint16_t h) {
    int e = (h >> 10) & 31, f = h & 1023;
    double mag = e == 0 ? ldexp(f, -24) : (e == 31 ? (f ? NAN : INFINITY) : ldexp(1024 + f, e - 25));
    return (h & 0x8000) ? -mag : mag;
}

/* The pool of one array ('p', 'g', 'm', 'v', 'l' for the low-precision copy) and its dtype. */
static void *pool_of(const so_batch *b, char array, int *dtype) {
    switch (array) {
        case 'p': *dtype = SO_DTYPE_F32; return b->p;
        case 'g': *dtype = b->gdt; return b->g;
        case 'm': *dtype = b->mdt; return b->m;
        case 'v': *dtype = b->mdt; return b->v;
        default: *dtype = b->lpdt; return b->lp;
    }
}

double so_get(const so_batch *b, char array, int64_t k, int64_t i) {
    int64_t at = b->offsets[k] + i;
    int dtype;
    const void *pool = pool_of(b, array, &dtype);
    if (dtype == SO_DTYPE_F32) return ((const float *)pool)[at];
    uint16_t bits = ((const uint16_t *)pool)[at];
    return dtype == SO_DTYPE_BF16 ? so_bf16_to_f32(bits) : f16_to_f64(bits);
}

void so_put(so_batch *b, char array, int64_t k, int64_t i, float x) {
    int64_t at = b->offsets[k] + i;
    int dtype;
    void *pool = pool_of(b, array, &dtype); /* p, g, m, v: fp32 or bf16 */
    if (dtype == SO_DTYPE_F32) ((float *)pool)[at] = x;
    else ((uint16_t *)pool)[at] = so_f32_to_bf16_rne(x);
}

so_batch *so_batch_new(const int64_t *numels, int64_t count, int gdt, int mdt, int lpdt,
                       uint64_t seed, int warm) {
    if (count > SO_MAX_TENSORS) {
        fprintf(stderr, "too many tensors\n");
        exit(2);
    }
    so_batch *b = calloc(1, sizeof *b);
    if (b == NULL) exit(2);
    b->count = count;
    b->gdt = gdt, b->mdt = mdt, b->lpdt = lpdt;
    int64_t at = SO_GUARD;
    for (int64_t k = 0; k < count; ++k) {
        b->numels[k] = numels[k];
        b->offsets[k] = at;
        at += numels[k] + SO_GUARD;
    }
    b->pool_elems = at;
    b->p = pool_new(at, SO_DTYPE_F32);
    b->g = pool_new(at, gdt);
    b->m = pool_new(at, mdt);
    b->v = pool_new(at, mdt);
    b->lp = lpdt == SO_DTYPE_NONE ? NULL : pool_new(at, lpdt);
    batch_pointers(b);
    /* powers of two 2^-12 .. 2^3 for the gradient's magnitude (exact scalings) */
    static const float scale[16] = {0x1p-12f, 0x1p-11f, 0x1p-10f, 0x1p-9f, 0x1p-8f, 0x1p-7f,
                                    0x1p-6f, 0x1p-5f, 0x1p-4f, 0x1p-3f, 0x1p-2f, 0x1p-1f,
                                    1.0f, 2.0f, 4.0f, 8.0f};
    so_rng r = {seed * 0x2545f4914f6cdd1dull + 1};
    for (int64_t k = 0; k < count; ++k) {
        for (int64_t i = 0; i < numels[k]; ++i) {
            uint64_t bits = so_rng_next(&r);
            float g = so_rng_unit(&r) * scale[bits & 15];
            if ((bits >> 8) % 251 == 0) g = g * 0x1p-120f; /* subnormal fp32 (and bf16) */
            float m = warm ? so_rng_unit(&r) * 0.1f : 0.0f;
            float v = warm ? __builtin_fabsf(so_rng_unit(&r)) * 0.01f + 1e-4f : 0.0f;
            so_put(b, 'p', k, i, so_rng_unit(&r) * 2.0f);
            so_put(b, 'g', k, i, g);
            so_put(b, 'm', k, i, m);
            so_put(b, 'v', k, i, v);
            if (b->lp) ((uint16_t *)b->lp)[b->offsets[k] + i] = 0;
        }
    }
    return b;
}

so_batch *so_batch_clone(const so_batch *src) {
    so_batch *b = malloc(sizeof *b);
    if (b == NULL) exit(2);
    *b = *src;
    const void *from[5] = {src->p, src->g, src->m, src->v, src->lp};
    int dtypes[5] = {SO_DTYPE_F32, src->gdt, src->mdt, src->mdt, src->lpdt};
    void **to[5] = {(void **)&b->p, &b->g, &b->m, &b->v, &b->lp};
    for (int a = 0; a < 5; ++a) {
        if (from[a] == NULL) continue;
        *to[a] = pool_new(src->pool_elems, dtypes[a]);
        memcpy(*to[a], from[a], (size_t)src->pool_elems * (size_t)so_dtype_size(dtypes[a]));
    }
    batch_pointers(b);
    return b;
}

void so_batch_free(so_batch *b) {
    free(b->p), free(b->g), free(b->m), free(b->v), free(b->lp);
    free(b);
}

int64_t so_guards_broken(const so_batch *b) {
    int64_t broken = 0;
    for (const char *a = "pgmvl"; *a; ++a) {
        int dtype;
        const void *pool = pool_of(b, *a, &dtype);
        if (pool == NULL) continue;
        for (int64_t k = 0; k <= b->count; ++k) { /* the zone before tensor k, then the last */
            int64_t end = k < b->count ? b->offsets[k] : b->pool_elems;
            for (int64_t i = (k == 0 ? 0 : end - SO_GUARD); i < end; ++i) {
                if (so_dtype_size(dtype) == 4)
                    broken += ((const uint32_t *)pool)[i] != SO_GUARD_BITS32;
                else
                    broken += ((const uint16_t *)pool)[i] != SO_GUARD_BITS16;
            }
        }
    }
    return broken;
}

/* ---- digests: FNV-1a 64 ------------------------------------------------------------------ */

void so_digest_init(so_digest *d) { d->exact = d->canonical = 0xcbf29ce484222325ull; }

static uint64_t fnv(uint64_t h, const unsigned char *data, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ data[i]) * 0x100000001b3ull;
    return h;
}

void so_digest_bytes(so_digest *d, const void *data, size_t n) {
    d->exact = fnv(d->exact, data, n);
    d->canonical = fnv(d->canonical, data, n);
}

/* One array of one tensor: exact bits, and with every NaN replaced by one pattern
 * (x86-64 makes negative default NaNs, AArch64 positive ones: docs/kernel.md). */
static void digest_array(so_digest *d, const void *data, int64_t n, int dtype) {
    d->exact = fnv(d->exact, data, (size_t)n * (size_t)so_dtype_size(dtype));
    for (int64_t i = 0; i < n; ++i) {
        if (dtype == SO_DTYPE_F32) {
            uint32_t u = ((const uint32_t *)data)[i];
            if ((u & 0x7fffffffu) > 0x7f800000u) u = 0x7fc00000u;
            d->canonical = fnv(d->canonical, (const unsigned char *)&u, 4);
        } else {
            uint16_t u = ((const uint16_t *)data)[i];
            int nan = dtype == SO_DTYPE_BF16 ? (u & 0x7fffu) > 0x7f80u : (u & 0x7fffu) > 0x7c00u;
            if (nan) u = dtype == SO_DTYPE_BF16 ? 0x7fc0u : 0x7e00u;
            d->canonical = fnv(d->canonical, (const unsigned char *)&u, 2);
        }
    }
}

void so_digest_batch(so_digest *d, const so_batch *b) {
    for (int64_t k = 0; k < b->count; ++k) {
        digest_array(d, b->pp[k], b->numels[k], SO_DTYPE_F32);
        digest_array(d, b->mp[k], b->numels[k], b->mdt);
        digest_array(d, b->vp[k], b->numels[k], b->mdt);
        if (b->lp) digest_array(d, b->lpp[k], b->numels[k], b->lpdt);
    }
}

void so_digest_i64(so_digest *d, int64_t x) { so_digest_bytes(d, &x, sizeof x); }

void so_digest_f64(so_digest *d, double x) { so_digest_bytes(d, &x, sizeof x); }

int so_digest_equal(const so_digest *a, const so_digest *b) {
    return a->exact == b->exact && a->canonical == b->canonical;
}

/* ---- report ------------------------------------------------------------------------------ */

static int n_checks, n_failures;

void so_print_digest(const char *name, const so_digest *d) {
    printf("digest %s %016llx %016llx\n", name, (unsigned long long)d->exact,
           (unsigned long long)d->canonical);
}

void so_check(const char *name, int ok, double ratio, const char *what) {
    ++n_checks;
    if (ok) {
        printf("check %s ok %.3g\n", name, ratio);
    } else {
        ++n_failures;
        printf("check %s FAIL %s\n", name, what);
    }
}

int so_failures(void) { return n_failures; }

int so_checks(void) { return n_checks; }
