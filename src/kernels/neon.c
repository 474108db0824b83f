/* AArch64 Advanced SIMD (NEON) kernels: 4 floats or 2 doubles a vector. NEON is part of every
 * AArch64 CPU, so no target switch is needed; float16 uses the FCVT conversions (nearest even
 * under the default FPCR), bfloat16 the same exact integer rounding as the x86 files. Tails go
 * through a small zeroed buffer; there are no non-temporal stores. */
#include <arm_neon.h>
#include <string.h>

#include "kernels.h"
#include "convert.h"

static inline uint16x4_t bf16x4_round(float32x4_t v) {
    uint32x4_t b = vreinterpretq_u32_f32(v);
    uint32x4_t hi = vshrq_n_u32(b, 16);
    uint32x4_t bias = vaddq_u32(vandq_u32(hi, vdupq_n_u32(1)), vdupq_n_u32(0x7fff));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(b, bias), 16);
    uint32x4_t qnan = vorrq_u32(vandq_u32(hi, vdupq_n_u32(0x8000)), vdupq_n_u32(0x7fc0));
    r = vbslq_u32(vmvnq_u32(vceqq_f32(v, v)), qnan, r); /* NaN lanes: canonical quiet NaN */
    return vmovn_u32(r);
}

static inline float32x4_t bf16x4_widen(uint16x4_t u) {
    return vreinterpretq_f32_u32(vshll_n_u16(u, 16));
}

/* n < W elements of `size` bytes at p, the rest zero; and the first n of a vector stored */
#define PART_LD(type, ld, p, n)                                                            \
    ({                                                                                     \
        type b_[4] = {0};                                                                  \
        memcpy(b_, (p), (n) * sizeof(type));                                               \
        ld(b_);                                                                            \
    })
#define PART_ST(type, st, p, v, n)                                                         \
    do {                                                                                   \
        type b_[4];                                                                        \
        st(b_, (v));                                                                       \
        memcpy((p), b_, (n) * sizeof(type));                                               \
    } while (0)

#define RMS_NT 0
#define RMS_PF 1
#define V_FENCE() ((void)0)
#define A float64x2_t
#define A_ZERO vdupq_n_f64(0.0)

/* float compute: f32, f16, bf16 */
#define W 4
#define V float32x4_t
#define V_SET vdupq_n_f32
#define V_ADD vaddq_f32
#define V_SUB vsubq_f32
#define V_MUL vmulq_f32
#define V_FMA(a, b, c) vfmaq_f32((c), (a), (b))
#define VC_LD(p) vld1q_f32(p)
#define VC_LDP(p, n) PART_LD(float, vld1q_f32, (p), (n))
#define VC_ST(p, v) vst1q_f32((p), (v))
#define VC_STP(p, v, n) PART_ST(float, vst1q_f32, (p), (v), (n))
#define A_ACC(l, h, v)                                                                     \
    ((l) = vaddq_f64((l), vcvt_f64_f32(vget_low_f32(v))),                                  \
     (h) = vaddq_f64((h), vcvt_high_f64_f32(v)))
#define A_SUM(l, h) vaddvq_f64(vaddq_f64((l), (h)))

#define T float
#define C float
#define SFX f32_neon
#define V_LD(p) vld1q_f32(p)
#define V_LDP VC_LDP
#define V_ST(p, v) vst1q_f32((p), (v))
#define V_STP VC_STP
#define V_STNT V_ST
#define V_RND(v) (v)
#define S_LD(p) (*(p))
#define S_RND(v) (v)
#include "norm_impl.h"

#define LD_F16(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))
#define ST_F16(p, v) vst1_u16((p), vreinterpret_u16_f16(vcvt_f16_f32(v)))
#define T uint16_t
#define C float
#define SFX f16_neon
#define V_LD LD_F16
#define V_LDP(p, n) PART_LD(uint16_t, LD_F16, (p), (n))
#define V_ST ST_F16
#define V_STP(p, v, n) PART_ST(uint16_t, ST_F16, (p), (v), (n))
#define V_STNT V_ST
#define V_RND(v) vcvt_f32_f16(vcvt_f16_f32(v))
#define S_LD(p) rms_f16_to_f32(*(p))
#define S_RND(v) rms_f16_to_f32(rms_f32_to_f16(v))
#include "norm_impl.h"

#define LD_BF16(p) bf16x4_widen(vld1_u16(p))
#define ST_BF16(p, v) vst1_u16((p), bf16x4_round(v))
#define T uint16_t
#define C float
#define SFX bf16_neon
#define V_LD LD_BF16
#define V_LDP(p, n) PART_LD(uint16_t, LD_BF16, (p), (n))
#define V_ST ST_BF16
#define V_STP(p, v, n) PART_ST(uint16_t, ST_BF16, (p), (v), (n))
#define V_STNT V_ST
#define V_RND(v) bf16x4_widen(bf16x4_round(v))
#define S_LD(p) rms_bf16_to_f32(*(p))
#define S_RND(v) rms_bf16_to_f32(rms_f32_to_bf16(v))
#include "norm_impl.h"

/* double compute: f64 */
#include "compute_undef.h"
#define W 2
#define V float64x2_t
#define V_SET vdupq_n_f64
#define V_ADD vaddq_f64
#define V_SUB vsubq_f64
#define V_MUL vmulq_f64
#define V_FMA(a, b, c) vfmaq_f64((c), (a), (b))
#define VC_LD(p) vld1q_f64(p)
#define VC_LDP(p, n) PART_LD(double, vld1q_f64, (p), (n))
#define VC_ST(p, v) vst1q_f64((p), (v))
#define VC_STP(p, v, n) PART_ST(double, vst1q_f64, (p), (v), (n))
#define A_ACC(l, h, v) ((l) = vaddq_f64((l), (v)))
#define A_SUM(l, h) ((void)(h), vaddvq_f64(l))

#define T double
#define C double
#define SFX f64_neon
#define V_LD(p) vld1q_f64(p)
#define V_LDP VC_LDP
#define V_ST(p, v) vst1q_f64((p), (v))
#define V_STP VC_STP
#define V_STNT V_ST
#define V_RND(v) (v)
#define S_LD(p) (*(p))
#define S_RND(v) (v)
#include "norm_impl.h"

const rms_isa_table rms_isa_neon = {
    "neon", {RMS_ENTRY(f32_neon), RMS_ENTRY(f64_neon), RMS_ENTRY(f16_neon), RMS_ENTRY(bf16_neon)},
    NULL};
