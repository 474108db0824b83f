/* rstd of eight rows at once, for the groups of short 16-bit rows (rows_impl.h, V_RSTD8): two
 * vectors of four doubles through the same correctly rounded operations as the scalar path
 * (mean, + eps, square root, division, rounding to float), so the bits are the same. Included by
 * the x86 kernel files after their target pragma: it needs AVX only. */
#ifndef RMSNORM_RSTD_AVX_H
#define RMSNORM_RSTD_AVX_H

#include <immintrin.h>

#include "kernels.h"

static inline void rms_rstd4_avx(__m256d ss, float *rstd, size_t k, double eps, double inv_k) {
    __m256d mean = inv_k != 0.0 ? _mm256_mul_pd(ss, _mm256_set1_pd(inv_k))
                                : _mm256_div_pd(ss, _mm256_set1_pd((double)k));
    __m256d root = _mm256_sqrt_pd(_mm256_add_pd(mean, _mm256_set1_pd(eps)));
    _mm_storeu_ps(rstd, _mm256_cvtpd_ps(_mm256_div_pd(_mm256_set1_pd(1.0), root)));
}

/* 1 when all eight sums pass rms_sumsq_ok (float compute) and the rstds are stored, else 0 and
 * nothing is stored. */
static inline int rms_rstd8_avx(const double *ss, float *rstd, size_t k, double eps,
                                double inv_k) {
    /* element by element, so that each sum can be forwarded from its own store: a vector load
     * over eight scalar stores cannot be, and waits for them to reach the cache */
    __m256d a = _mm256_set_pd(ss[3], ss[2], ss[1], ss[0]);
    __m256d b = _mm256_set_pd(ss[7], ss[6], ss[5], ss[4]);
    __m256d hi = _mm256_set1_pd(RMS_SUMSQ_MAX), lo = _mm256_set1_pd(RMS_SUMSQ_MIN_F32);
    __m256d ok = _mm256_and_pd(
        _mm256_and_pd(_mm256_cmp_pd(a, hi, _CMP_LE_OQ), _mm256_cmp_pd(a, lo, _CMP_GE_OQ)),
        _mm256_and_pd(_mm256_cmp_pd(b, hi, _CMP_LE_OQ), _mm256_cmp_pd(b, lo, _CMP_GE_OQ)));
    if (_mm256_movemask_pd(ok) != 0xf)
        return 0;
    rms_rstd4_avx(a, rstd, k, eps, inv_k);
    rms_rstd4_avx(b, rstd + 4, k, eps, inv_k);
    return 1;
}
#define V_RSTD8 rms_rstd8_avx

#endif
