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
    /* NaN (0x01, 0x80) or subnormal (0x20) */
    __mmask16 odd = _mm512_fpclass_ps_mask(v, 0xa1);
    if (__builtin_expect(odd != 0, 0))
        return bf16x16_round(v);
    return (__m256i)_mm512_cvtneps_pbh(v);
}

static inline __m512 dot2_bf16(__m512 acc, const void *p) {
    __m512bh u = (__m512bh)_mm512_loadu_si512(p);
    return _mm512_dpbf16_ps(acc, u, u);
}

/* lo and hi hold bfloat16 values (rounded already), so packing them is exact */
static inline __m512 pack2dot_bf16(__m512 acc, __m512 lo, __m512 hi) {
    __m512bh u = _mm512_cvtne2ps_pbh(hi, lo);
    return _mm512_dpbf16_ps(acc, u, u);
}

/* Two vectors with one check of both */
static inline void store2_bf16(void *p, __m512 a, __m512 b, int nt) {
    __mmask16 oa = _mm512_fpclass_ps_mask(a, 0xa1), ob = _mm512_fpclass_ps_mask(b, 0xa1);
    __m256i *q = (__m256i *)p;
    if (__builtin_expect(!_kortestz_mask16_u8(oa, ob), 0)) { /* one KORTESTW for both */
        _mm256_storeu_si256(q, bf16x16_round(a));
        _mm256_storeu_si256(q + 1, bf16x16_round(b));
    } else if (nt) {
        _mm256_stream_si256(q, (__m256i)_mm512_cvtneps_pbh(a));
        _mm256_stream_si256(q + 1, (__m256i)_mm512_cvtneps_pbh(b));
    } else {
        _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

#define RMS_DT 3
#define RMS_SFX bf16_avx512bf16
#define V_ST2(p, a, b, nt) store2_bf16((p), (a), (b), (nt))
#define V_LD V_LD_BF16
#define V_LDP V_LDP_BF16
#define V_ST(p, v) _mm256_storeu_si256((__m256i *)(p), bf16x16_round_native(v))
#define V_STNT(p, v) _mm256_stream_si256((__m256i *)(p), bf16x16_round_native(v))
#define V_STB 32
#define V_CPNT V_CPNT_32
#define V_RND(v)                                                                               \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_round_native(v)), 16))
#define V_STP(p, v, n) _mm256_mask_storeu_epi16((p), M16(n), bf16x16_round_native(v))
/* Squares of 32 bfloat16 values summed pairwise into 16 floats: one VDPBF16PS. Its inputs are
 * exact products of bfloat16 values; subnormal inputs, whose squares underflow to zero in
 * float32 anyway, are flushed. */
#define V_DOT2(acc, p) dot2_bf16((acc), (const void *)(p))
#define V_PACK2DOT(acc, lo, hi) pack2dot_bf16((acc), (lo), (hi))
#include "rows_impl.h"

const rms_kernels rms_bf16_avx512bf16 = RMS_ENTRY(bf16_avx512bf16);

#if defined(__clang__)
#pragma clang attribute pop
#endif
