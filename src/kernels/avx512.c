/* AVX-512 (F, BW, VL, DQ) + FMA + F16C kernels: 16 floats or 8 doubles a vector, masked tails.
 * Only this file is compiled for that target; the dispatcher calls it only on CPUs (and OSes)
 * that run it. bfloat16 is rounded with exact integer arithmetic. */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#endif

#include <immintrin.h>

#include "kernels.h"
#include "convert.h"

/* v's bits plus the round-to-nearest-even bias, so that their high 16 bits are v rounded to
 * bfloat16 (a NaN: the canonical quiet NaN of its sign). */
static inline __m512i bf16x16_biased(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
    __m512i qnan = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32((int)0x80000000u)),
                                   _mm512_set1_epi32(0x7fc00000));
    return _mm512_mask_mov_epi32(_mm512_add_epi32(b, bias), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                 qnan);
}

/* v rounded to bfloat16, narrowed to 16 bits */
static inline __m256i bf16x16_round(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16x16_biased(v), 16));
}

/* v rounded to bfloat16 and widened back, without leaving the 32-bit lanes */
static inline __m512 bf16x16_rnd(__m512 v) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(bf16x16_biased(v), _mm512_set1_epi32((int)0xffff0000u)));
}

/* a in the low half, b in the high */
static inline __m512i join256(__m256i a, __m256i b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

static inline __m512 bf16x16_widen(__m256i u) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(u), 16));
}

static inline __m512d lo_pd(__m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }
static inline __m512d hi_pd(__m512 v) {
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* The sum of the eight lanes, in a fixed order (the pairs GCC's _mm512_reduce_add_pd adds). */
static inline double hsum_pd(__m512d a) {
    __m256d q = _mm256_add_pd(_mm512_extractf64x4_pd(a, 1), _mm512_castpd512_pd256(a));
    __m128d h = _mm_add_pd(_mm256_extractf128_pd(q, 1), _mm256_castpd256_pd128(q));
    return _mm_cvtsd_f64(_mm_add_sd(_mm_unpackhi_pd(h, h), h));
}

#define M16(n) ((__mmask16)((1u << (n)) - 1u))
#define M8(n) ((__mmask8)((1u << (n)) - 1u))
#define F16_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

#define RMS_NT 1
#define RMS_PF 1
/* a register of 16-bit values (V_PK2's) stored plainly or non-temporally */
#define V_ST2R(p, u, nt) ((nt) ? _mm512_stream_si512((void *)(p), (u)) : _mm512_storeu_si512((p), (u)))
#define V_FENCE() _mm_sfence()
#define A __m512d
#define A_ZERO _mm512_setzero_pd()

/* float compute: f32, f16, bf16 */
#define W 16
#define V __m512
#define V_SET _mm512_set1_ps
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MUL _mm512_mul_ps
#define V_FMA _mm512_fmadd_ps
#define VC_LD(p) _mm512_loadu_ps(p)
#define VC_LDP(p, n) _mm512_maskz_loadu_ps(M16(n), (p))
#define VC_ST(p, v) _mm512_storeu_ps((p), (v))
#define VC_STP(p, v, n) _mm512_mask_storeu_ps((p), M16(n), (v))
#define A_ACC(l, h, v) ((l) = _mm512_add_pd((l), lo_pd(v)), (h) = _mm512_add_pd((h), hi_pd(v)))
#define A_SUM(l, h) hsum_pd(_mm512_add_pd((l), (h)))

#define T float
#define C float
#define SFX f32_avx512
#define V_LD(p) _mm512_loadu_ps(p)
#define V_LDP VC_LDP
#define V_ST(p, v) _mm512_storeu_ps((p), (v))
#define V_STP VC_STP
#define V_STNT(p, v) _mm512_stream_ps((p), (v))
#define V_RND(v) (v)
#define S_LD(p) (*(p))
#define S_RND(v) (v)
#include "norm_impl.h"

#define T uint16_t
#define C float
#define SFX f16_avx512
#define V_LD(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define V_LDP(p, n) _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(M16(n), (p)))
#define V_ST(p, v) _mm256_storeu_si256((__m256i *)(p), _mm512_cvtps_ph((v), F16_RNE))
#define V_STP(p, v, n) _mm256_mask_storeu_epi16((p), M16(n), _mm512_cvtps_ph((v), F16_RNE))
#define V_STNT(p, v) _mm256_stream_si256((__m256i *)(p), _mm512_cvtps_ph((v), F16_RNE))
#define V_PK2(a, b) join256(_mm512_cvtps_ph((a), F16_RNE), _mm512_cvtps_ph((b), F16_RNE))
#define V_RND(v) _mm512_cvtph_ps(_mm512_cvtps_ph((v), F16_RNE))
#define S_LD(p) rms_f16_to_f32(*(p))
#define S_RND(v) rms_f16_to_f32(rms_f32_to_f16(v))
#include "norm_impl.h"

#define T uint16_t
#define C float
#define SFX bf16_avx512
#define V_LD(p) bf16x16_widen(_mm256_loadu_si256((const __m256i *)(p)))
#define V_LDP(p, n) bf16x16_widen(_mm256_maskz_loadu_epi16(M16(n), (p)))
#define V_ST(p, v) _mm256_storeu_si256((__m256i *)(p), bf16x16_round(v))
#define V_STP(p, v, n) _mm256_mask_storeu_epi16((p), M16(n), bf16x16_round(v))
#define V_STNT(p, v) _mm256_stream_si256((__m256i *)(p), bf16x16_round(v))
#define V_PK2(a, b) join256(bf16x16_round(a), bf16x16_round(b))
#define V_RND(v) bf16x16_rnd(v)
#define S_LD(p) rms_bf16_to_f32(*(p))
#define S_RND(v) rms_bf16_to_f32(rms_f32_to_bf16(v))
#include "norm_impl.h"

#if defined(RMSNORM_HAVE_AVX512BF16)
/* bfloat16 with AVX512-BF16: VCVTNEPS2BF16 rounds 16 floats in one instruction (nearest even),
 * but flushes subnormal inputs to zero and keeps NaN payloads; a vector holding either takes the
 * integer rounding above, so that the results keep the same bits as every other family's. The
 * dispatcher lists this table first on CPUs that have the extension. */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")
#endif
/* The rare vectors out of line, so that each store keeps only the fast path's code */
__attribute__((noinline, cold)) static __m512i bf16x32_round_cold(__m512 a, __m512 b) {
    return join256(bf16x16_round(a), bf16x16_round(b));
}
static inline __m256i bf16x16_round_bf(__m512 v) {
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0xa1) != 0, 0)) /* NaN or subnormal */
        return _mm512_castsi512_si256(bf16x32_round_cold(v, v));
    return (__m256i)_mm512_cvtneps_pbh(v);
}
/* a and b (a first) rounded to bfloat16 in one instruction, as above */
static inline __m512i bf16x32_round_bf(__m512 a, __m512 b) {
    if (__builtin_expect((_mm512_fpclass_ps_mask(a, 0xa1) | _mm512_fpclass_ps_mask(b, 0xa1)) != 0,
                         0))
        return bf16x32_round_cold(a, b);
    return (__m512i)_mm512_cvtne2ps_pbh(b, a);
}
/* the squares of 32 bfloat16 values at p, added pairwise into acc's 16 lanes (one VDPBF16PS:
 * exact products, nearest-even sums, subnormals flushed: see RMS_SQ2_EXACT) */
static inline __m512 bf16x32_sq(__m512 acc, const uint16_t *p) {
    __m512bh u = (__m512bh)_mm512_loadu_si512((const void *)p);
    return _mm512_dpbf16_ps(acc, u, u);
}
#define T uint16_t
#define C float
#define SFX bf16_avx512bf16
#define V_SQ2(acc, p) bf16x32_sq((acc), (p))
#define V_LD(p) bf16x16_widen(_mm256_loadu_si256((const __m256i *)(p)))
#define V_LDP(p, n) bf16x16_widen(_mm256_maskz_loadu_epi16(M16(n), (p)))
#define V_ST(p, v) _mm256_storeu_si256((__m256i *)(p), bf16x16_round_bf(v))
#define V_STP(p, v, n) _mm256_mask_storeu_epi16((p), M16(n), bf16x16_round_bf(v))
#define V_STNT(p, v) _mm256_stream_si256((__m256i *)(p), bf16x16_round_bf(v))
#define V_PK2(a, b) bf16x32_round_bf((a), (b))
#define V_PK2_PLAIN 1
#define V_RND(v) bf16x16_rnd(v)
#define S_LD(p) rms_bf16_to_f32(*(p))
#define S_RND(v) rms_bf16_to_f32(rms_f32_to_bf16(v))
#include "norm_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

/* double compute: f64 */
#include "compute_undef.h"
#define W 8
#define V __m512d
#define V_SET _mm512_set1_pd
#define V_ADD _mm512_add_pd
#define V_SUB _mm512_sub_pd
#define V_MUL _mm512_mul_pd
#define V_FMA _mm512_fmadd_pd
#define VC_LD(p) _mm512_loadu_pd(p)
#define VC_LDP(p, n) _mm512_maskz_loadu_pd(M8(n), (p))
#define VC_ST(p, v) _mm512_storeu_pd((p), (v))
#define VC_STP(p, v, n) _mm512_mask_storeu_pd((p), M8(n), (v))
#define A_ACC(l, h, v) ((l) = _mm512_add_pd((l), (v)))
#define A_SUM(l, h) ((void)(h), hsum_pd(l))

#define T double
#define C double
#define SFX f64_avx512
#define V_LD(p) _mm512_loadu_pd(p)
#define V_LDP VC_LDP
#define V_ST(p, v) _mm512_storeu_pd((p), (v))
#define V_STP VC_STP
#define V_STNT(p, v) _mm512_stream_pd((p), (v))
#define V_RND(v) (v)
#define S_LD(p) (*(p))
#define S_RND(v) (v)
#include "norm_impl.h"

const rms_isa_table rms_isa_avx512 = {
    "avx512",
    {RMS_ENTRY(f32_avx512), RMS_ENTRY(f64_avx512), RMS_ENTRY(f16_avx512), RMS_ENTRY(bf16_avx512)},
    NULL};

#if defined(RMSNORM_HAVE_AVX512BF16)
/* A variant of the avx512 family (its public name): the same kernels but bfloat16's that store
 * (rounding with VCVTNEPS2BF16); dot and widen store nothing and are avx512's. */
const rms_isa_table rms_isa_avx512bf16 = {
    "avx512bf16",
    {RMS_ENTRY(f32_avx512),
     RMS_ENTRY(f64_avx512),
     RMS_ENTRY(f16_avx512),
     {rmsnorm_fwd_bf16_avx512bf16, rmsnorm_bwd_bf16_avx512bf16, rmsnorm_sumsq_bf16_avx512bf16,
      rmsnorm_scale_bf16_avx512bf16, rmsnorm_dot_bf16_avx512, rmsnorm_bwdp_bf16_avx512bf16,
      rmsnorm_rescue_bf16_avx512bf16, rmsnorm_widen_bf16_avx512,
      rmsnorm_narrow_bf16_avx512bf16}},
    "avx512"};
#endif

#if defined(__clang__)
#pragma clang attribute pop
#endif
