/* Element-level numerics shared by every SIMD path: bit casts, bf16/fp16 conversions and
 * the counter-based hash for stochastic rounding. Internal to cext/.
 *
 * Everything here is integer or single IEEE operations, so gcc vectorises it on every
 * target and each path gives the same bits (the build uses -ffp-contract=off: no FMA).
 * superoffload/kernels/torch_ref.py implements the same functions with torch ops.
 */
#ifndef SO_NUMERICS_H
#define SO_NUMERICS_H

#include <stddef.h>
#include <stdint.h>

#define SO_INLINE static inline __attribute__((always_inline))

SO_INLINE uint32_t so_f32_bits(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, sizeof u);
    return u;
}

SO_INLINE float so_bits_f32(uint32_t u) {
    float x;
    __builtin_memcpy(&x, &u, sizeof x);
    return x;
}

SO_INLINE float so_bf16_to_f32(uint16_t b) { return so_bits_f32((uint32_t)b << 16); }

/* True when the fp32 bit pattern is inf or NaN (exponent all ones). */
SO_INLINE uint32_t so_nonfinite_bits(uint32_t u) { return (u & 0x7f800000u) == 0x7f800000u; }

/* fp32 -> bf16, round to nearest even, as `p.to(torch.bfloat16)` on this CPU: any NaN
 * becomes 0xffff (ATen's vectorised conversion), inf stays inf, overflow rounds to inf. */
SO_INLINE uint16_t so_f32_to_bf16_rne(float x) {
    uint32_t u = so_f32_bits(x);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t is_nan = (u & 0x7fffffffu) > 0x7f800000u;
    return (uint16_t)(is_nan ? 0xffffu : rounded);
}

/* fp32 -> bf16 with stochastic rounding: add 16 random bits below the cut and truncate, so
 * E[result] = x (unbiased). inf/NaN keep their class (NaN stays quiet). */
SO_INLINE uint16_t so_f32_to_bf16_sr(float x, uint32_t random16) {
    uint32_t u = so_f32_bits(x);
    uint32_t rounded = (u + random16) >> 16;
    uint32_t special = (u >> 16) | (((u & 0x7fffffffu) > 0x7f800000u) ? 0x40u : 0u);
    return (uint16_t)(so_nonfinite_bits(u) ? special : rounded);
}

/* fp32 -> fp16 round to nearest even, as `p.to(torch.float16)` (F16C semantics for NaN:
 * sign kept, quiet bit set, top payload bits kept). After F. Giesen's branch-free
 * float_to_half_fast3_rtne; written with selects so it vectorises. */
SO_INLINE uint16_t so_f32_to_f16_rne(float x) {
    uint32_t u = so_f32_bits(x);
    uint32_t sign = u & 0x80000000u;
    uint32_t a = u ^ sign;
    /* NaN / inf / values >= 65536 (which round to inf) */
    uint32_t special = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x3ffu)) : 0x7c00u;
    /* subnormal or zero half: let the fp32 adder round, with 0.5f as the magic constant */
    float denorm = so_bits_f32(a) + so_bits_f32(0x3f000000u);
    uint32_t sub = so_f32_bits(denorm) - 0x3f000000u;
    /* normal half: rebias the exponent, round to nearest even on the 13 dropped bits */
    uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
    uint32_t out = a >= 0x47800000u ? special : (a < 0x38800000u ? sub : normal);
    return (uint16_t)(out | (sign >> 16));
}

/* lowbias32 (C. Wellons' hash prospector): a cheap 32-bit bijective mixer. */
SO_INLINE uint32_t so_mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    return h;
}

/* Key of the stochastic-rounding stream for global element indices whose top 32 bits are
 * index_hi. The random bits of element i are so_mix32((uint32)i ^ key): a pure function of
 * (seed, i), so results do not depend on the thread count or the SIMD path. */
SO_INLINE uint32_t so_sr_key(uint64_t seed, uint32_t index_hi) {
    uint32_t h = so_mix32(index_hi ^ 0x9e3779b9u);
    h = so_mix32(h ^ (uint32_t)(seed >> 32));
    return so_mix32(h ^ (uint32_t)seed);
}

#endif /* SO_NUMERICS_H */
