/* Scalar conversions between float32 and the 16-bit formats, rounding to nearest even exactly
 * as ml_dtypes (bfloat16) and NumPy / F16C (float16) do. The vector kernels must agree with these
 * bit for bit; tests compare every ISA against the scalar one. */
#ifndef RMSNORM_CONVERT_H
#define RMSNORM_CONVERT_H

#include <stdint.h>
#include <string.h>

static inline uint32_t rms_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float rms_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float rms_bf16_to_f32(uint16_t h) { return rms_bits_f32((uint32_t)h << 16); }

static inline uint16_t rms_f32_to_bf16(float f) {
    uint32_t u = rms_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: the canonical quiet NaN, sign kept */
        return (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float rms_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f)
        return rms_bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in float */
        float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return rms_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

static inline uint16_t rms_f32_to_f16(float f) {
    uint32_t u = rms_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) /* NaN: quiet, top payload bits kept (as F16C does) */
        return (uint16_t)(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
    if (u >= 0x477ff000u) /* >= 65520 rounds to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (u < 0x38800000u) { /* below 2^-14: subnormal; adding 0.5 aligns to the 2^-24 grid */
        float a = rms_bits_f32(u) + 0.5f;
        return (uint16_t)(sign | (rms_f32_bits(a) - 0x3f000000u));
    }
    u += 0xc8000fffu + ((u >> 13) & 1u); /* rebias 127 -> 15 and round to nearest even */
    return (uint16_t)(sign | (u >> 13));
}

#endif
