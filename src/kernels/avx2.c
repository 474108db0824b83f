/* AVX2 + FMA + F16C kernels: 8 floats or 4 doubles a vector. Only this file is compiled for
 * that target; the dispatcher calls it only on CPUs (and OSes) that run it. 16-bit tails go
 * through a small zeroed buffer (AVX2 has no 16-bit masked loads). */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif

#include <immintrin.h>
#include <string.h>

#include "kernels.h"
#include "convert.h"

/* v's bits plus the round-to-nearest-even bias, so that their high 16 bits are v rounded to
 * bfloat16 (a NaN: the canonical quiet NaN of its sign). */
static inline __m256i bf16x8_biased(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff));
    __m256i qnan = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32((int)0x80000000u)),
                                   _mm256_set1_epi32(0x7fc00000));
    return _mm256_blendv_epi8(_mm256_add_epi32(b, bias), qnan,
                              _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* v rounded to bfloat16, packed to 16 bytes */
static inline __m128i bf16x8_round(__m256 v) {
    __m256i r = _mm256_srli_epi32(bf16x8_biased(v), 16);
    __m256i packed = _mm256_packus_epi32(r, r); /* per 128-bit lane: r0-3 r0-3 | r4-7 r4-7 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* a and b rounded to bfloat16, packed to 32 bytes (a first): one pack for the two */
static inline __m256i bf16x16_round2(__m256 a, __m256 b) {
    __m256i ra = _mm256_srli_epi32(bf16x8_biased(a), 16), rb = _mm256_srli_epi32(bf16x8_biased(b), 16);
    /* per 128-bit lane: a0-3 b0-3 | a4-7 b4-7 */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(ra, rb), 0xd8);
}

/* v rounded to bfloat16 and widened back, without leaving the 32-bit lanes */
static inline __m256 bf16x8_rnd(__m256 v) {
    return _mm256_castsi256_ps(
        _mm256_and_si256(bf16x8_biased(v), _mm256_set1_epi32((int)0xffff0000u)));
}

static inline __m256 bf16x8_widen(__m128i u) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(u), 16));
}

/* n < 8 16-bit values at p, the rest zero; and the first n of u stored at p */
static inline __m128i load16_part(const void *p, size_t n) {
    uint16_t b[8] = {0};
    memcpy(b, p, n * 2);
    return _mm_loadu_si128((const __m128i *)b);
}
static inline void store16_part(void *p, __m128i u, size_t n) {
    uint16_t b[8];
    _mm_storeu_si128((__m128i *)b, u);
    memcpy(p, b, n * 2);
}

static inline __m256i mask32(size_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline __m256i mask64(size_t n) {
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x((long long)n), _mm256_setr_epi64x(0, 1, 2, 3));
}

static inline double hsum_pd(__m256d a) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

#define F16_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

#define RMS_NT 1
#define RMS_PF 1
/* a register of 16-bit values (V_PK2's) stored plainly or non-temporally */
#define V_ST2R(p, u, nt)                                                                   \
    ((nt) ? _mm256_stream_si256((__m256i *)(p), (u)) : _mm256_storeu_si256((__m256i *)(p), (u)))
#define V_FENCE() _mm_sfence()
#define A __m256d
#define A_ZERO _mm256_setzero_pd()

/* float compute: f32, f16, bf16 */
#define W 8
#define V __m256
#define V_SET _mm256_set1_ps
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MUL _mm256_mul_ps
#define V_FMA _mm256_fmadd_ps
#define VC_LD(p) _mm256_loadu_ps(p)
#define VC_LDP(p, n) _mm256_maskload_ps((p), mask32(n))
#define VC_ST(p, v) _mm256_storeu_ps((p), (v))
#define VC_STP(p, v, n) _mm256_maskstore_ps((p), mask32(n), (v))
#define A_ACC(l, h, v)                                                                     \
    ((l) = _mm256_add_pd((l), _mm256_cvtps_pd(_mm256_castps256_ps128(v))),                 \
     (h) = _mm256_add_pd((h), _mm256_cvtps_pd(_mm256_extractf128_ps((v), 1))))
#define A_SUM(l, h) hsum_pd(_mm256_add_pd((l), (h)))

#define T float
#define C float
#define SFX f32_avx2
#define V_LD(p) _mm256_loadu_ps(p)
#define V_LDP VC_LDP
#define V_ST(p, v) _mm256_storeu_ps((p), (v))
#define V_STP VC_STP
#define V_STNT(p, v) _mm256_stream_ps((p), (v))
#define V_RND(v) (v)
#define S_LD(p) (*(p))
#define S_RND(v) (v)
#include "norm_impl.h"

#define T uint16_t
#define C float
#define SFX f16_avx2
#define V_LD(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define V_LDP(p, n) _mm256_cvtph_ps(load16_part((p), (n)))
#define V_ST(p, v) _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph((v), F16_RNE))
#define V_STP(p, v, n) store16_part((p), _mm256_cvtps_ph((v), F16_RNE), (n))
#define V_STNT(p, v) _mm_stream_si128((__m128i *)(p), _mm256_cvtps_ph((v), F16_RNE))
#define V_PK2(a, b) _mm256_set_m128i(_mm256_cvtps_ph((b), F16_RNE), _mm256_cvtps_ph((a), F16_RNE))
#define V_RND(v) _mm256_cvtph_ps(_mm256_cvtps_ph((v), F16_RNE))
#define S_LD(p) rms_f16_to_f32(*(p))
#define S_RND(v) rms_f16_to_f32(rms_f32_to_f16(v))
#include "norm_impl.h"

#define T uint16_t
#define C float
#define SFX bf16_avx2
#define V_LD(p) bf16x8_widen(_mm_loadu_si128((const __m128i *)(p)))
#define V_LDP(p, n) bf16x8_widen(load16_part((p), (n)))
#define V_ST(p, v) _mm_storeu_si128((__m128i *)(p), bf16x8_round(v))
#define V_STP(p, v, n) store16_part((p), bf16x8_round(v), (n))
#define V_STNT(p, v) _mm_stream_si128((__m128i *)(p), bf16x8_round(v))
#define V_PK2(a, b) bf16x16_round2((a), (b))
#define V_RND(v) bf16x8_rnd(v)
#define S_LD(p) rms_bf16_to_f32(*(p))
#define S_RND(v) rms_bf16_to_f32(rms_f32_to_bf16(v))
#include "norm_impl.h"

/* double compute: f64 */
#include "compute_undef.h"
#define W 4
#define V __m256d
#define V_SET _mm256_set1_pd
#define V_ADD _mm256_add_pd
#define V_SUB _mm256_sub_pd
#define V_MUL _mm256_mul_pd
#define V_FMA _mm256_fmadd_pd
#define VC_LD(p) _mm256_loadu_pd(p)
#define VC_LDP(p, n) _mm256_maskload_pd((p), mask64(n))
#define VC_ST(p, v) _mm256_storeu_pd((p), (v))
#define VC_STP(p, v, n) _mm256_maskstore_pd((p), mask64(n), (v))
#define A_ACC(l, h, v) ((l) = _mm256_add_pd((l), (v)))
#define A_SUM(l, h) ((void)(h), hsum_pd(l))

#define T double
#define C double
#define SFX f64_avx2
#define V_LD(p) _mm256_loadu_pd(p)
#define V_LDP VC_LDP
#define V_ST(p, v) _mm256_storeu_pd((p), (v))
#define V_STP VC_STP
#define V_STNT(p, v) _mm256_stream_pd((p), (v))
#define V_RND(v) (v)
#define S_LD(p) (*(p))
#define S_RND(v) (v)
#include "norm_impl.h"

const rms_isa_table rms_isa_avx2 = {
    "avx2", {RMS_ENTRY(f32_avx2), RMS_ENTRY(f64_avx2), RMS_ENTRY(f16_avx2), RMS_ENTRY(bf16_avx2)},
    NULL};

#if defined(__clang__)
#pragma clang attribute pop
#endif
