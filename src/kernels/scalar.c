/* Portable scalar kernels: the reference every SIMD family is tested against, and the fallback
 * on any CPU. One "vector" is one element. */
#define RMS_NO_STREAM /* V_STNT is V_ST: no streamed loops */
#include "kernels.h"
#include "convert.h"

#define W 1
#define V float
#define V_LDC(p) (*(p))
#define V_STC(p, v) (*(p) = (v))
#define V_SET(s) (s)
#define V_ADD(a, b) ((a) + (b))
#define V_SUB(a, b) ((a) - (b))
#define V_MUL(a, b) ((a) * (b))
#define V_FENCE() ((void)0)
/* one lane: a partial vector never occurs */
#define V_LDCP(p, n) V_LDC(p)
#define V_STCP(p, v, n) V_STC((p), (v))
#define A double
#define A_ZERO 0.0
#define V_FMA(a, b, c) ((a) * (b) + (c))
#define A_WIDEN(l, h, v) ((l) += (double)(v))
#define A_CVT(l, h, v) ((l) = (double)(v))
#define A_ADD(a, b) ((a) + (b))
#define A_SUM(a) (a)

#define RMS_DT 0
#define RMS_SFX f32_scalar
#define V_LD(p) (*(p))
#define V_ST(p, v) (*(p) = (v))
#define V_STNT V_ST
#define V_STB 4
#define V_RND(v) (v)
#define V_LDP(p, n) V_LD(p)
#define V_STP(p, v, n) V_ST((p), (v))
#include "rows_impl.h"

#define RMS_DT 2
#define RMS_SFX f16_scalar
#define V_LD(p) rms_f16_to_f32(*(p))
#define V_ST(p, v) (*(p) = rms_f32_to_f16(v))
#define V_STNT V_ST
#define V_STB 2
#define V_RND(v) rms_f16_to_f32(rms_f32_to_f16(v))
#define V_LDP(p, n) V_LD(p)
#define V_STP(p, v, n) V_ST((p), (v))
#include "rows_impl.h"

#define RMS_DT 3
#define RMS_SFX bf16_scalar
#define V_LD(p) rms_bf16_to_f32(*(p))
#define V_ST(p, v) (*(p) = rms_f32_to_bf16(v))
#define V_STNT V_ST
#define V_STB 2
#define V_RND(v) rms_bf16_to_f32(rms_f32_to_bf16(v))
#define V_LDP(p, n) V_LD(p)
#define V_STP(p, v, n) V_ST((p), (v))
#include "rows_impl.h"

#undef V
#define V double
#define RMS_DT 1
#define RMS_SFX f64_scalar
#define V_LD(p) (*(p))
#define V_ST(p, v) (*(p) = (v))
#define V_STNT V_ST
#define V_STB 8
#define V_RND(v) (v)
#define V_LDP(p, n) V_LD(p)
#define V_STP(p, v, n) V_ST((p), (v))
#include "rows_impl.h"

const rms_isa_table rms_isa_scalar = {
    "scalar",
    {RMS_ENTRY(f32_scalar), RMS_ENTRY(f64_scalar), RMS_ENTRY(f16_scalar), RMS_ENTRY(bf16_scalar)},
    8192, 0, SIZE_MAX, 0, NULL};
