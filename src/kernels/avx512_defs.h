/* Shared by the AVX-512 kernel files (compiled with their target on): conversions, float64
 * accumulators and the macros rows_impl.h needs for float compute (f32, f16, bf16). */
#ifndef RMSNORM_AVX512_DEFS_H
#define RMSNORM_AVX512_DEFS_H

#include <immintrin.h>

#include "kernels.h"
#include "convert.h"
#include "rstd_avx.h"

static inline __m512 bf16x16_widen(__m256i u) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(u), 16));
}

/* Round to nearest even on the integer bits; NaN becomes the canonical quiet NaN. */
static inline __m256i bf16x16_round(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __m512i hi = _mm512_srli_epi32(b, 16);
    __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                    _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, bias), 16);
    __m512i qnan = _mm512_or_si512(_mm512_and_si512(hi, _mm512_set1_epi32(0x8000)),
                                   _mm512_set1_epi32(0x7fc0));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), qnan);
    return _mm512_cvtepi32_epi16(r);
}

#define RMS_F16_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline __m512d lo_pd(__m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }

static inline __m512d hi_pd(__m512 v) {
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

static inline void widen_ps(__m512d *l, __m512d *h, __m512 v) {
    *l = _mm512_add_pd(*l, lo_pd(v));
    *h = _mm512_add_pd(*h, hi_pd(v));
}

/* masks for the first n < W lanes */
#define M16(n) ((__mmask16)((1u << (n)) - 1u))
#define M8(n) ((__mmask8)((1u << (n)) - 1u))

#define V_REGS 32
/* 16-bit backward rows of 8 KiB or more go in pairs (rows_add_bwd.h). 16-core Intel Xeon (AVX-512
 * BF16), from memory, one at a time -> in pairs, the two builds alternating in one process, at
 * 1 / 4 / 16 threads: bfloat16 32768x8192 0.92 / 0.92 / 0.93 of the time, float16 32768x8192
 * 0.94 / 0.94 / 0.91, bfloat16 4096x32768 0.97 / 0.99 / 0.98; at 1 / 16: 8192x16384 0.98 / 0.97,
 * 2048x65536 0.99 / 0.99; 64x4096 in cache 0.87. Rows of 4 KiB lost (65536x2048 bfloat16, one
 * thread: 1.15), so they stay one at a time. */
#define RMS_PAIRS_16 1
#define A __m512d
#define A_ZERO _mm512_setzero_pd()
#define A_ADD _mm512_add_pd
#define A_SUM rms_hsum_pd
#define V_HSUM8 rms_hsum8_pd

/* The sum of a's eight lanes: lane j + lane j + 4, then j + j + 2, then 0 + 1 (the pairs GCC's
 * _mm512_reduce_add_pd adds, written out so that no compiler picks others). */
static inline double rms_hsum_pd(__m512d a) {
    __m256d q = _mm256_add_pd(_mm512_extractf64x4_pd(a, 1), _mm512_castpd512_pd256(a));
    __m128d h = _mm_add_pd(_mm256_extractf128_pd(q, 1), _mm256_castpd256_pd128(q));
    return _mm_cvtsd_f64(_mm_add_sd(_mm_unpackhi_pd(h, h), h));
}

/* rms_hsum_pd of eight vectors at once, into s[0..7]: the same additions of the same pairs,
 * with the lanes of several rows moved side by side so that each vector addition serves two,
 * four, then eight rows (14 shuffles and 7 additions where one row at a time takes 48). */
static inline void rms_hsum8_pd(const __m512d *v, double *s) {
    __m512d t[4], u[2];
    for (int r = 0; r < 4; r++) /* [a0..a3 + a4..a7, b0..b3 + b4..b7] */
        t[r] = _mm512_add_pd(_mm512_shuffle_f64x2(v[2 * r], v[2 * r + 1], 0xEE),
                             _mm512_shuffle_f64x2(v[2 * r], v[2 * r + 1], 0x44));
    for (int r = 0; r < 2; r++) /* [a0,a1 + a2,a3, b.., c.., d..] */
        u[r] = _mm512_add_pd(_mm512_shuffle_f64x2(t[2 * r], t[2 * r + 1], 0xDD),
                             _mm512_shuffle_f64x2(t[2 * r], t[2 * r + 1], 0x88));
    const __m512i odd = _mm512_set_epi64(15, 13, 11, 9, 7, 5, 3, 1);
    const __m512i even = _mm512_set_epi64(14, 12, 10, 8, 6, 4, 2, 0);
    _mm512_storeu_pd(s, _mm512_add_pd(_mm512_permutex2var_pd(u[0], odd, u[1]),
                                      _mm512_permutex2var_pd(u[0], even, u[1])));
}
#define V_FENCE() _mm_sfence()

/* float compute: f32, f16, bf16 */
#define W 16
#define V __m512
#define V_LDC(p) _mm512_loadu_ps(p)
#define V_STC(p, v) _mm512_storeu_ps((p), (v))
#define V_SET _mm512_set1_ps
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MUL _mm512_mul_ps
#define V_FMA _mm512_fmadd_ps
#define A_WIDEN(l, h, v) widen_ps(&(l), &(h), (v))
#define A_CVT(l, h, v) ((l) = lo_pd(v), (h) = hi_pd(v))
#define V_LDCP(p, n) _mm512_maskz_loadu_ps(M16(n), (p))
#define V_STCP(p, v, n) _mm512_mask_storeu_ps((p), M16(n), (v))

/* a raw non-temporal copy of 32 bytes (V_STB of the 16-bit types) */
#define V_CPNT_32(p, q)                                                                            \
    _mm256_stream_si256((__m256i *)(p), _mm256_loadu_si256((const __m256i *)(q)))

/* bfloat16 storage macros shared by the integer-rounding and the native-conversion variants */
#define V_LD_BF16(p) bf16x16_widen(_mm256_loadu_si256((const __m256i *)(p)))
#define V_LDP_BF16(p, n) bf16x16_widen(_mm256_maskz_loadu_epi16(M16(n), (p)))

#endif
