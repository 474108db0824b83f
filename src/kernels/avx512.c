/* AVX-512 (F, BW, VL, DQ) + FMA + F16C kernels. Only this file is compiled for that target; the
 * dispatcher calls it only on CPUs (and OSes) that run it. bfloat16 is rounded here with exact
 * integer arithmetic; CPUs with AVX512-BF16 get the bfloat16 entry of avx512bf16.c instead. */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#endif

#include "avx512_defs.h"

#define RMS_DT 0
#define RMS_SFX f32_avx512
#define V_LD(p) _mm512_loadu_ps(p)
#define V_ST(p, v) _mm512_storeu_ps((p), (v))
#define V_STNT(p, v) _mm512_stream_ps((p), (v))
#define V_STB 64
#define V_RND(v) (v)
#define V_LDP V_LDCP
#define V_STP V_STCP
#include "rows_impl.h"

#define RMS_DT 2
#define RMS_SFX f16_avx512
#define V_LD(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define V_ST(p, v) _mm256_storeu_si256((__m256i *)(p), _mm512_cvtps_ph((v), RMS_F16_RNE))
#define V_STNT(p, v) _mm256_stream_si256((__m256i *)(p), _mm512_cvtps_ph((v), RMS_F16_RNE))
#define V_STB 32
#define V_CPNT V_CPNT_32
#define V_RND(v) _mm512_cvtph_ps(_mm512_cvtps_ph((v), RMS_F16_RNE))
#define V_LDP(p, n) _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(M16(n), (p)))
#define V_STP(p, v, n) _mm256_mask_storeu_epi16((p), M16(n), _mm512_cvtps_ph((v), RMS_F16_RNE))
#include "rows_impl.h"

#define RMS_DT 3
#define RMS_SFX bf16_avx512
#define V_LD V_LD_BF16
#define V_ST(p, v) _mm256_storeu_si256((__m256i *)(p), bf16x16_round(v))
#define V_STNT(p, v) _mm256_stream_si256((__m256i *)(p), bf16x16_round(v))
#define V_STB 32
#define V_CPNT V_CPNT_32
#define V_RND(v)                                                                               \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_round(v)), 16))
#define V_LDP V_LDP_BF16
#define V_STP(p, v, n) _mm256_mask_storeu_epi16((p), M16(n), bf16x16_round(v))
#include "rows_impl.h"

/* double compute: f64 */
#include "compute_undef.h"
#define W 8
#define V __m512d
#define V_LDC(p) _mm512_loadu_pd(p)
#define V_STC(p, v) _mm512_storeu_pd((p), (v))
#define V_SET _mm512_set1_pd
#define V_ADD _mm512_add_pd
#define V_SUB _mm512_sub_pd
#define V_MUL _mm512_mul_pd
#define V_FMA _mm512_fmadd_pd
#define A_WIDEN(l, h, v) ((l) = _mm512_add_pd((l), (v)))
#define A_CVT(l, h, v) ((l) = (v))
#define V_LDCP(p, n) _mm512_maskz_loadu_pd(M8(n), (p))
#define V_STCP(p, v, n) _mm512_mask_storeu_pd((p), M8(n), (v))

#define RMS_DT 1
#define RMS_SFX f64_avx512
#define V_LD(p) _mm512_loadu_pd(p)
#define V_ST(p, v) _mm512_storeu_pd((p), (v))
#define V_STNT(p, v) _mm512_stream_pd((p), (v))
#define V_STB 64
#define V_RND(v) (v)
#define V_LDP V_LDCP
#define V_STP V_STCP
#include "rows_impl.h"

static void stream_lines_avx512(void *dst, const void *src, size_t lines) {
    for (size_t i = 0; i < lines; i++)
        _mm512_stream_si512((__m512i *)dst + i, _mm512_load_si512((const __m512i *)src + i));
}

const rms_isa_table rms_isa_avx512 = {"avx512",
                                      {RMS_ENTRY(f32_avx512), RMS_ENTRY(f64_avx512),
                                       RMS_ENTRY(f16_avx512), RMS_ENTRY(bf16_avx512)},
                                      8192, 0, 1024, 1, stream_lines_avx512};

#if defined(__clang__)
#pragma clang attribute pop
#endif
