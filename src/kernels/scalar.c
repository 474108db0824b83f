/* Portable scalar kernels: the fallback on any CPU, and the reference the SIMD families are
 * checked against (tests/c/kernel_check.c). One "vector" is one element. */
#include "kernels.h"
#include "convert.h"

#define RMS_NT 0
#define RMS_PF 0
/* no constant-length row loops: one element a "vector" gains nothing from them */
#define RMS_KCONST 0
#define W 1
#define V_FENCE() ((void)0)
#define V_SET(s) (s)
#define V_ADD(a, b) ((a) + (b))
#define V_SUB(a, b) ((a) - (b))
#define V_MUL(a, b) ((a) * (b))
#define V_FMA(a, b, c) ((a) * (b) + (c))
/* one lane: a partial vector never occurs */
#define VC_LD(p) (*(p))
#define VC_LDP(p, n) (*(p))
#define VC_ST(p, v) (*(p) = (v))
#define VC_STP(p, v, n) (*(p) = (v))
#define A double
#define A_ZERO 0.0
#define A_ACC(l, h, v) ((l) += (double)(v))
#define A_SUM(l, h) ((void)(h), (l))

#define V float
#define T float
#define C float
#define SFX f32_scalar
#define V_LD(p) (*(p))
#define V_ST(p, v) (*(p) = (v))
#define V_RND(v) (v)
#define S_LD(p) (*(p))
#define S_RND(v) (v)
#define V_LDP(p, n) V_LD(p)
#define V_STP(p, v, n) V_ST((p), (v))
#define V_STNT V_ST
#include "norm_impl.h"

#define T uint16_t
#define C float
#define SFX f16_scalar
#define V_LD(p) rms_f16_to_f32(*(p))
#define V_ST(p, v) (*(p) = rms_f32_to_f16(v))
#define V_RND(v) rms_f16_to_f32(rms_f32_to_f16(v))
#define S_LD V_LD
#define S_RND V_RND
#define V_LDP(p, n) V_LD(p)
#define V_STP(p, v, n) V_ST((p), (v))
#define V_STNT V_ST
#include "norm_impl.h"

#define T uint16_t
#define C float
#define SFX bf16_scalar
#define V_LD(p) rms_bf16_to_f32(*(p))
#define V_ST(p, v) (*(p) = rms_f32_to_bf16(v))
#define V_RND(v) rms_bf16_to_f32(rms_f32_to_bf16(v))
#define S_LD V_LD
#define S_RND V_RND
#define V_LDP(p, n) V_LD(p)
#define V_STP(p, v, n) V_ST((p), (v))
#define V_STNT V_ST
#include "norm_impl.h"

#undef V
#define V double
#define T double
#define C double
#define SFX f64_scalar
#define V_LD(p) (*(p))
#define V_ST(p, v) (*(p) = (v))
#define V_RND(v) (v)
#define S_LD(p) (*(p))
#define S_RND(v) (v)
#define V_LDP(p, n) V_LD(p)
#define V_STP(p, v, n) V_ST((p), (v))
#define V_STNT V_ST
#include "norm_impl.h"

const rms_isa_table rms_isa_scalar = {
    "scalar",
    {RMS_ENTRY(f32_scalar), RMS_ENTRY(f64_scalar), RMS_ENTRY(f16_scalar), RMS_ENTRY(bf16_scalar)},
    NULL};
