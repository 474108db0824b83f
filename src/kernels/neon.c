/* AArch64 Advanced SIMD (NEON) kernels: 4 floats or 2 doubles a vector. NEON is part of every
 * AArch64 CPU, so no target switch is needed; float16 uses the FCVT conversions (nearest even
 * under the default FPCR), bfloat16 the same exact integer rounding as the x86 files. */
#include <arm_neon.h>

#define RMS_NO_STREAM /* V_STNT is V_ST: no streamed loops */
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

static inline void widen_ps(float64x2_t *l, float64x2_t *h, float32x4_t v) {
    *l = vaddq_f64(*l, vcvt_f64_f32(vget_low_f32(v)));
    *h = vaddq_f64(*h, vcvt_high_f64_f32(v));
}

#define V_REGS 32
#define A float64x2_t
#define A_ZERO vdupq_n_f64(0.0)
#define A_ADD vaddq_f64
#define A_SUM vaddvq_f64
#define V_FENCE() ((void)0)

/* float compute: f32, f16, bf16 */
#define W 4
#define V float32x4_t
#define V_LDC(p) vld1q_f32(p)
#define V_STC(p, v) vst1q_f32((p), (v))
#define V_SET vdupq_n_f32
#define V_ADD vaddq_f32
#define V_SUB vsubq_f32
#define V_MUL vmulq_f32
#define V_FMA(a, b, c) vfmaq_f32((c), (a), (b))
#define A_WIDEN(l, h, v) widen_ps(&(l), &(h), (v))
#define A_CVT(l, h, v) ((l) = vcvt_f64_f32(vget_low_f32(v)), (h) = vcvt_high_f64_f32(v))

#define RMS_DT 0
#define RMS_SFX f32_neon
#define V_LD(p) vld1q_f32(p)
#define V_ST(p, v) vst1q_f32((p), (v))
#define V_STNT V_ST
#define V_STB 16
#define V_RND(v) (v)
#include "rows_impl.h"

#define RMS_DT 2
#define RMS_SFX f16_neon
#define V_LD(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))
#define V_ST(p, v) vst1_u16((p), vreinterpret_u16_f16(vcvt_f16_f32(v)))
#define V_STNT V_ST
#define V_STB 8
#define V_RND(v) vcvt_f32_f16(vcvt_f16_f32(v))
#include "rows_impl.h"

#define RMS_DT 3
#define RMS_SFX bf16_neon
#define V_LD(p) bf16x4_widen(vld1_u16(p))
#define V_ST(p, v) vst1_u16((p), bf16x4_round(v))
#define V_STNT V_ST
#define V_STB 8
#define V_RND(v) bf16x4_widen(bf16x4_round(v))
#include "rows_impl.h"

/* double compute: f64 */
#include "compute_undef.h"
#define W 2
#define V float64x2_t
#define V_LDC(p) vld1q_f64(p)
#define V_STC(p, v) vst1q_f64((p), (v))
#define V_SET vdupq_n_f64
#define V_ADD vaddq_f64
#define V_SUB vsubq_f64
#define V_MUL vmulq_f64
#define V_FMA(a, b, c) vfmaq_f64((c), (a), (b))
#define A_WIDEN(l, h, v) ((l) = vaddq_f64((l), (v)))
#define A_CVT(l, h, v) ((l) = (v))

#define RMS_DT 1
#define RMS_SFX f64_neon
#define V_LD(p) vld1q_f64(p)
#define V_ST(p, v) vst1q_f64((p), (v))
#define V_STNT V_ST
#define V_STB 16
#define V_RND(v) (v)
#include "rows_impl.h"

const rms_isa_table rms_isa_neon = {
    "neon",
    {RMS_ENTRY(f32_neon), RMS_ENTRY(f64_neon), RMS_ENTRY(f16_neon), RMS_ENTRY(bf16_neon)},
    8192, 0, SIZE_MAX, 0, NULL};
