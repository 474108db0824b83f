/* AVX2 + FMA + F16C kernels. Only this file is compiled for that target; the dispatcher calls
 * it only on CPUs (and OSes) that run it. */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif

#include <immintrin.h>

#include "kernels.h"
#include "convert.h"

static inline __m256 bf16x8_load(const uint16_t *p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

/* Round to nearest even on the integer bits; NaN becomes the canonical quiet NaN. */
static inline __m128i bf16x8_round(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i hi = _mm256_srli_epi32(b, 16);
    __m256i bias = _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)),
                                    _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, bias), 16);
    __m256i qnan = _mm256_or_si256(_mm256_and_si256(hi, _mm256_set1_epi32(0x8000)),
                                   _mm256_set1_epi32(0x7fc0));
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    __m256i packed = _mm256_packus_epi32(r, r); /* per 128-bit lane: r0-3 r0-3 | r4-7 r4-7 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

#define RMS_F16_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline void widen_ps(__m256d *l, __m256d *h, __m256 v) {
    *l = _mm256_add_pd(*l, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    *h = _mm256_add_pd(*h, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

static inline double hsum_pd(__m256d a) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* masks for the first n < W lanes */
static inline __m256i mask32(size_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline __m256i mask64(size_t n) {
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x((long long)n), _mm256_setr_epi64x(0, 1, 2, 3));
}

#define A __m256d
#define A_ZERO _mm256_setzero_pd()
#define A_ADD _mm256_add_pd
#define A_SUM hsum_pd
#define V_FENCE() _mm_sfence()

/* float compute: f32, f16, bf16 */
#define W 8
#define V __m256
#define V_LDC(p) _mm256_loadu_ps(p)
#define V_STC(p, v) _mm256_storeu_ps((p), (v))
#define V_SET _mm256_set1_ps
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MUL _mm256_mul_ps
#define V_FMA _mm256_fmadd_ps
#define A_WIDEN(l, h, v) widen_ps(&(l), &(h), (v))
#define A_CVT(l, h, v)                                                                             \
    ((l) = _mm256_cvtps_pd(_mm256_castps256_ps128(v)),                                             \
     (h) = _mm256_cvtps_pd(_mm256_extractf128_ps((v), 1)))
/* a raw non-temporal copy of 16 bytes (V_STB of the 16-bit types) */
#define V_CPNT_16(p, q) _mm_stream_si128((__m128i *)(p), _mm_loadu_si128((const __m128i *)(q)))
#define V_LDCP(p, n) _mm256_maskload_ps((p), mask32(n))
#define V_STCP(p, v, n) _mm256_maskstore_ps((p), mask32(n), (v))

#define RMS_DT 0
#define RMS_SFX f32_avx2
#define V_LD(p) _mm256_loadu_ps(p)
#define V_ST(p, v) _mm256_storeu_ps((p), (v))
#define V_STNT(p, v) _mm256_stream_ps((p), (v))
#define V_STB 32
#define V_RND(v) (v)
#define V_LDP V_LDCP
#define V_STP V_STCP
#include "rows_impl.h"

#define RMS_DT 2
#define RMS_SFX f16_avx2
#define V_LD(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define V_ST(p, v) _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph((v), RMS_F16_RNE))
#define V_STNT(p, v) _mm_stream_si128((__m128i *)(p), _mm256_cvtps_ph((v), RMS_F16_RNE))
#define V_STB 16
#define V_CPNT V_CPNT_16
#define V_RND(v) _mm256_cvtph_ps(_mm256_cvtps_ph((v), RMS_F16_RNE))
#include "rows_impl.h"

#define RMS_DT 3
#define RMS_SFX bf16_avx2
#define V_LD(p) bf16x8_load(p)
#define V_ST(p, v) _mm_storeu_si128((__m128i *)(p), bf16x8_round(v))
#define V_STNT(p, v) _mm_stream_si128((__m128i *)(p), bf16x8_round(v))
#define V_STB 16
#define V_CPNT V_CPNT_16
#define V_RND(v) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16x8_round(v)), 16))
#include "rows_impl.h"

/* double compute: f64 */
#include "compute_undef.h"
#define W 4
#define V __m256d
#define V_LDC(p) _mm256_loadu_pd(p)
#define V_STC(p, v) _mm256_storeu_pd((p), (v))
#define V_SET _mm256_set1_pd
#define V_ADD _mm256_add_pd
#define V_SUB _mm256_sub_pd
#define V_MUL _mm256_mul_pd
#define V_FMA _mm256_fmadd_pd
#define A_WIDEN(l, h, v) ((l) = _mm256_add_pd((l), (v)))
#define A_CVT(l, h, v) ((l) = (v))
#define V_LDCP(p, n) _mm256_maskload_pd((p), mask64(n))
#define V_STCP(p, v, n) _mm256_maskstore_pd((p), mask64(n), (v))

#define RMS_DT 1
#define RMS_SFX f64_avx2
#define V_LD(p) _mm256_loadu_pd(p)
#define V_ST(p, v) _mm256_storeu_pd((p), (v))
#define V_STNT(p, v) _mm256_stream_pd((p), (v))
#define V_STB 32
#define V_RND(v) (v)
#define V_LDP V_LDCP
#define V_STP V_STCP
#include "rows_impl.h"

const rms_isa_table rms_isa_avx2 = {
    "avx2", {RMS_ENTRY(f32_avx2), RMS_ENTRY(f64_avx2), RMS_ENTRY(f16_avx2), RMS_ENTRY(bf16_avx2)}};

#if defined(__clang__)
#pragma clang attribute pop
#endif
