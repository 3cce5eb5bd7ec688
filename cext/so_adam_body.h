/* The Adam loop body, included once per SIMD target by so_simd.c with SO_SUFFIX set
 * (portable, avx2, avx512, neon, sve) inside a `#pragma GCC target` region, so the same C
 * source is vectorised for each ISA and picked at run time. No include guard on purpose.
 *
 * Maths (DESIGN.md §4; PyTorch's AdamW/Adam docs, torch.optim.AdamW):
 *   g  = grad * grad_scale                       (+ wd * p first in L2 mode)
 *   m  = b1*m + (1-b1)*g
 *   v  = b2*v + ((1-b2)*g)*g
 *   p  = p*(1 - lr*wd) - step_size * (m / (sqrt(v)/sqrt(bc2) + eps)),  step_size = lr/bc1
 * and the inverse for rollback, in fp32, one rounding per operation (no FMA), in exactly
 * the order torch_ref.py uses, so the two agree bit for bit. A negative grad_scale steps
 * with -grad (torch.optim.AdamW's maximize=True; the sign flip is exact).
 *
 * The second moment multiplies (1-b2)*g first and then by g, left to right as PyTorch's
 * `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)` and its fused CPU kernel
 * do: g*g alone overflows fp32 for |g| > 1.8e19, where (1-b2)*g*g is still finite (a
 * gradient of 2.2e19 at lr 1e3 gives 4.8e35, not inf; docs/kernel.md).
 */
#ifndef SO_SUFFIX
#error "define SO_SUFFIX before including so_adam_body.h"
#endif

#define SO_CAT2(a, b) a##_##b
#define SO_CAT(a, b) SO_CAT2(a, b)
#define SO_FN(name) SO_CAT(name, SO_SUFFIX)

/* One specialised loop: gdt/mdt/lpdt/l2/rollback are compile-time constants at every call
 * site below, so each of the 48 variants is a straight vectorisable loop. */
SO_INLINE void SO_FN(so_adam_loop)(const so_coeffs *restrict c, const so_seg *restrict s,
                                   const int gdt, const int mdt, const int lpdt, const int l2,
                                   const int rollback) {
    float *restrict p = s->p;
    const float *restrict g32 = (const float *)s->g;
    const uint16_t *restrict g16 = (const uint16_t *)s->g;
    float *restrict m32 = (float *)s->m;
    float *restrict v32 = (float *)s->v;
    uint16_t *restrict m16 = (uint16_t *)s->m;
    uint16_t *restrict v16 = (uint16_t *)s->v;
    uint16_t *restrict lp16 = (uint16_t *)s->lp;
    const float b1 = c->b1, b2 = c->b2, omb1 = c->omb1, omb2 = c->omb2, eps = c->eps;
    const float gs = c->grad_scale, wd = c->wd_l2, decay = c->decay;
    const float step_size = c->step_size, bc2_sqrt = c->bc2_sqrt;
    const uint32_t key = s->sr_key, idx0 = s->index0_lo;
    const int64_t lo = s->lo, hi = s->hi;

    for (int64_t i = lo; i < hi; ++i) {
        float g = (gdt == SO_DTYPE_BF16 ? so_bf16_to_f32(g16[i]) : g32[i]) * gs;
        float m = mdt == SO_DTYPE_BF16 ? so_bf16_to_f32(m16[i]) : m32[i];
        float v = mdt == SO_DTYPE_BF16 ? so_bf16_to_f32(v16[i]) : v32[i];
        float w = p[i];
        if (!rollback) {
            if (l2) g = g + wd * w;
            m = b1 * m + omb1 * g;
            v = b2 * v + (omb2 * g) * g; /* not omb2 * (g * g): see the header */
            float denom = __builtin_sqrtf(v) / bc2_sqrt + eps;
            w = w * decay;
            w = w - step_size * (m / denom);
        } else {
            /* read post-step m, v, p; p first, then the moments (L2 needs p_prev) */
            float denom = __builtin_sqrtf(v) / bc2_sqrt + eps;
            w = w + step_size * (m / denom);
            w = w / decay;
            if (l2) g = g + wd * w;
            m = (m - omb1 * g) / b1;
            v = (v - (omb2 * g) * g) / b2; /* the very product the step added */
            v = v > 0.0f ? v : 0.0f; /* fp32 cancellation can leave v slightly negative */
        }
        p[i] = w;
        if (mdt == SO_DTYPE_BF16) {
            uint32_t r = so_mix32((idx0 + (uint32_t)(i - lo)) ^ key);
            m16[i] = so_f32_to_bf16_sr(m, r & 0xffffu);
            v16[i] = so_f32_to_bf16_sr(v, r >> 16);
        } else {
            m32[i] = m;
            v32[i] = v;
        }
        if (lpdt == SO_DTYPE_BF16) lp16[i] = so_f32_to_bf16_rne(w);
        if (lpdt == SO_DTYPE_F16) lp16[i] = so_f32_to_f16_rne(w);
    }
}

/* variant = rollback<<5 | l2<<4 | lp<<2 | mdt<<1 | gdt, lp: 0 none, 1 bf16, 2 fp16 */
#define SO_V1(R, W, L, M, G)                                                    \
    case ((R) << 5 | (W) << 4 | (L) << 2 | (M) << 1 | (G)):                     \
        SO_FN(so_adam_loop)(c, s, (G), (M), (L) == 0 ? SO_DTYPE_NONE : (L), (W), (R)); \
        return;
#define SO_V2(R, W, L, M) SO_V1(R, W, L, M, 0) SO_V1(R, W, L, M, 1)
#define SO_V3(R, W, L) SO_V2(R, W, L, 0) SO_V2(R, W, L, 1)
#define SO_V4(R, W) SO_V3(R, W, 0) SO_V3(R, W, 1) SO_V3(R, W, 2)

static void SO_FN(so_adam_run)(const so_coeffs *c, const so_seg *s, int variant) {
    switch (variant) {
        SO_V4(0, 0) SO_V4(0, 1) SO_V4(1, 0) SO_V4(1, 1)
        default: return;
    }
}

#undef SO_V1
#undef SO_V2
#undef SO_V3
#undef SO_V4

/* Bitmask of which arrays hold a non-finite value: 1 p, 2 m, 4 v, 8 g. */
SO_INLINE uint32_t SO_FN(so_check_loop)(const so_seg *restrict s, const int gdt,
                                        const int mdt) {
    const uint32_t *restrict p = (const uint32_t *)s->p;
    const uint32_t *restrict g32 = (const uint32_t *)s->g;
    const uint16_t *restrict g16 = (const uint16_t *)s->g;
    const uint32_t *restrict m32 = (const uint32_t *)s->m;
    const uint32_t *restrict v32 = (const uint32_t *)s->v;
    const uint16_t *restrict m16 = (const uint16_t *)s->m;
    const uint16_t *restrict v16 = (const uint16_t *)s->v;
    uint32_t bad_p = 0, bad_m = 0, bad_v = 0, bad_g = 0;
    for (int64_t i = s->lo; i < s->hi; ++i) {
        bad_p |= so_nonfinite_bits(p[i]);
        bad_g |= so_nonfinite_bits(gdt == SO_DTYPE_BF16 ? (uint32_t)g16[i] << 16 : g32[i]);
        bad_m |= so_nonfinite_bits(mdt == SO_DTYPE_BF16 ? (uint32_t)m16[i] << 16 : m32[i]);
        bad_v |= so_nonfinite_bits(mdt == SO_DTYPE_BF16 ? (uint32_t)v16[i] << 16 : v32[i]);
    }
    return (bad_p ? 1u : 0u) | (bad_m ? 2u : 0u) | (bad_v ? 4u : 0u) | (bad_g ? 8u : 0u);
}

static uint32_t SO_FN(so_check_run)(const so_seg *s, int gdt, int mdt) {
    if (gdt == SO_DTYPE_BF16)
        return mdt == SO_DTYPE_BF16 ? SO_FN(so_check_loop)(s, 1, 1) : SO_FN(so_check_loop)(s, 1, 0);
    return mdt == SO_DTYPE_BF16 ? SO_FN(so_check_loop)(s, 0, 1) : SO_FN(so_check_loop)(s, 0, 0);
}

/* Sum of squares of one grad_stats block in 8 fp64 lanes (element i goes to lane i % 8),
 * the lanes added in a fixed tree; non-finite values count and contribute 0. */
SO_INLINE void SO_FN(so_stats_loop)(const void *grad, const int gdt, int64_t lo, int64_t hi,
                                    double *sum_sq, int64_t *nonfinite) {
    const float *restrict g32 = (const float *)grad;
    const uint16_t *restrict g16 = (const uint16_t *)grad;
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t bad = 0;
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        for (int j = 0; j < 8; ++j) {
            float x = gdt == SO_DTYPE_BF16 ? so_bf16_to_f32(g16[i + j]) : g32[i + j];
            uint32_t nf = so_nonfinite_bits(so_f32_bits(x));
            double d = nf ? 0.0 : (double)x;
            lane[j] = lane[j] + d * d;
            bad += nf;
        }
    }
    for (int j = 0; i + j < hi; ++j) {
        float x = gdt == SO_DTYPE_BF16 ? so_bf16_to_f32(g16[i + j]) : g32[i + j];
        uint32_t nf = so_nonfinite_bits(so_f32_bits(x));
        double d = nf ? 0.0 : (double)x;
        lane[j] = lane[j] + d * d;
        bad += nf;
    }
    *sum_sq = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    *nonfinite = bad;
}

static void SO_FN(so_stats_run)(const void *grad, int gdt, int64_t lo, int64_t hi,
                                double *sum_sq, int64_t *nonfinite) {
    if (gdt == SO_DTYPE_BF16)
        SO_FN(so_stats_loop)(grad, SO_DTYPE_BF16, lo, hi, sum_sq, nonfinite);
    else
        SO_FN(so_stats_loop)(grad, SO_DTYPE_F32, lo, hi, sum_sq, nonfinite);
}

/* Bandwidth probe: the step's 28 B/param of traffic with one add per array. */
static void SO_FN(so_probe_run)(const so_seg *s) {
    float *restrict p = s->p;
    const float *restrict g = (const float *)s->g;
    float *restrict m = (float *)s->m;
    float *restrict v = (float *)s->v;
    for (int64_t i = s->lo; i < s->hi; ++i) {
        float gi = g[i];
        p[i] = p[i] + gi;
        m[i] = m[i] + gi;
        v[i] = v[i] + gi;
    }
}

static const so_kernels SO_FN(so_kernels_table) = {
    SO_FN(so_adam_run), SO_FN(so_check_run), SO_FN(so_stats_run), SO_FN(so_probe_run)};

#undef SO_FN
#undef SO_CAT
#undef SO_CAT2
