/* The bfloat16 kernels for CPUs with AVX512-BF16: VCVTNEPS2BF16 rounds 16 floats in one
 * instruction. It flushes subnormals and keeps NaN payloads, so any vector holding a value below
 * the smallest normal (zero included) or a NaN takes the exact integer rounding instead, and
 * the results stay bit-identical to ml_dtypes. The dispatcher swaps this entry into the AVX-512
 * table when the CPU has the extension (unless RMSNORM_NO_AVX512BF16=1). */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")
#endif

#include "avx512_defs.h"

static inline __m256i bf16x16_round_native(__m512 v) {
    __mmask16 odd = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(0x1p-126f), _CMP_NGE_UQ);
    if (__builtin_expect(odd != 0, 0))
        return bf16x16_round(v);
    return (__m256i)_mm512_cvtneps_pbh(v);
}

#define RMS_DT 3
#define RMS_SFX bf16_avx512bf16
#define V_LD V_LD_BF16
#define V_LDP V_LDP_BF16
#define V_ST(p, v) _mm256_storeu_si256((__m256i *)(p), bf16x16_round_native(v))
#define V_STNT(p, v) _mm256_stream_si256((__m256i *)(p), bf16x16_round_native(v))
#define V_STB 32
#define V_RND(v)                                                                               \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_round_native(v)), 16))
#define V_STP(p, v, n) _mm256_mask_storeu_epi16((p), M16(n), bf16x16_round_native(v))
#include "rows_impl.h"

const rms_kernels rms_bf16_avx512bf16 = RMS_ENTRY(bf16_avx512bf16);

#if defined(__clang__)
#pragma clang attribute pop
#endif
