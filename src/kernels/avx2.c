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
#include "rstd_avx.h"

/* 8 bfloat16 values widened: the 16 bytes are broadcast to both halves (a load, no shuffle) and
 * one in-lane byte shuffle moves each value into the high half of its lane, where a widening
 * move and a shift would take two of the ports that shifts and shuffles share on some cores. */
static inline __m256 bf16x8_load(const uint16_t *p) {
    const __m256i ctl = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
                                         -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14,
                                         15);
    __m256i u = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(u, ctl));
}

/* 8 floats rounded to nearest even on the integer bits: the bfloat16 bits are the high half of
 * each lane (the low half is left over). NaN is left to the caller. The rounding bit is found by
 * a mask and a compare rather than a shift: shifts and shuffles share two of the vector ports on
 * some cores, and the conversions need both. */
static inline __m256i bf16x8_rne_hi(__m256 v) {
    __m256i b = _mm256_castps_si256(v), lsb = _mm256_set1_epi32(0x10000);
    __m256i odd = _mm256_cmpeq_epi32(_mm256_and_si256(b, lsb), lsb); /* -1 where the lsb is 1 */
    return _mm256_sub_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), odd);
}

/* v rounded to bfloat16 (nearest even; NaN becomes the canonical quiet NaN) and widened back,
 * with no shuffle: the rounded bits are masked in place. */
static inline __m256 bf16x8_rnd(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i r = _mm256_and_si256(bf16x8_rne_hi(v), _mm256_set1_epi32((int)0xffff0000u));
    __m256i qnan = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32((int)0x80000000u)),
                                   _mm256_set1_epi32(0x7fc00000));
    return _mm256_castsi256_ps(
        _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))));
}

/* 8 floats rounded to bfloat16, as bf16x8_rnd rounds them, and packed into 16 bytes */
static inline __m128i bf16x8_round(__m256 v) {
    __m256i r = _mm256_srli_epi32(_mm256_castps_si256(bf16x8_rnd(v)), 16);
    __m256i packed = _mm256_packus_epi32(r, r); /* per 128-bit lane: r0-3 r0-3 | r4-7 r4-7 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* 32 bytes stored at p, or streamed (nt): in one 32-byte stream where p is 32-byte aligned, else
 * in two of 16 bytes. */
static inline void put32(void *p, __m256i u, int nt) {
    if (nt && !((uintptr_t)p % 32)) {
        _mm256_stream_si256((__m256i *)p, u);
    } else if (nt) {
        _mm_stream_si128((__m128i *)p, _mm256_castsi256_si128(u));
        _mm_stream_si128((__m128i *)p + 1, _mm256_extracti128_si256(u, 1));
    } else {
        _mm256_storeu_si256((__m256i *)p, u);
    }
}

/* 16 floats rounded to bfloat16 and stored at p: one NaN check of both vectors, a byte shuffle of
 * each, one permute and one 32-byte store. Streamed (nt), the spans store pairs from the start of
 * a line, so p is 32-byte aligned and takes one 32-byte stream rather than two of 16 bytes (AMD
 * EPYC Zen 3, one / two threads, two builds alternating, new time over old, 8192x4096 into a
 * page-aligned out=: backward 0.95 / 0.95, add 0.97 / 0.98, forward 0.99). A vector pair
 * holding a NaN takes bf16x8_round, so the bits are the same either way. */
static inline void store2_bf16(void *p, __m256 a, __m256 b, int nt) {
    __m128i *q = (__m128i *)p;
    __m256 nan = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
    if (__builtin_expect(!_mm256_testz_ps(nan, nan), 0)) {
        _mm_storeu_si128(q, bf16x8_round(a));
        _mm_storeu_si128(q + 1, bf16x8_round(b));
        return;
    }
    /* the high halves of a into the low 8 bytes of each 128-bit lane, those of b into the high */
    const __m256i lo = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                        2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i hi = _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15,
                                        -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15);
    __m256i u = _mm256_or_si256(_mm256_shuffle_epi8(bf16x8_rne_hi(a), lo),
                                _mm256_shuffle_epi8(bf16x8_rne_hi(b), hi));
    u = _mm256_permute4x64_epi64(u, 0xd8); /* a0-3 b0-3 | a4-7 b4-7 -> a0-7 | b0-7 */
    put32(p, u, nt);
}

#define RMS_F16_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* Pairwise sums of squares of 16 bfloat16 values at p: lane j gains the squares of elements 2j
 * and 2j + 1, which one 32-byte load gives by a shift (the even elements) and a mask (the odd),
 * rather than two widening loads and two shifts. */
static inline __m256 dot2_bf16(__m256 acc, const void *p) {
    __m256i u = _mm256_loadu_si256((const __m256i *)p);
    __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    __m256 o = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
    return _mm256_fmadd_ps(o, o, _mm256_fmadd_ps(e, e, acc));
}

/* dot2_bf16 of the 16 values lo (elements 0-7) and hi (8-15), bfloat16 values already, with the
 * same pairs in the same lanes, so the two give the same bits. */
static inline __m256 pack2dot_bf16(__m256 acc, __m256 lo, __m256 hi) {
    /* lo0 lo2 hi0 hi2 | lo4 lo6 hi4 hi6 -> lo0 lo2 lo4 lo6 hi0 hi2 hi4 hi6, and the odd ones */
    __m256 e = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xd8));
    __m256 o = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xdd)), 0xd8));
    return _mm256_fmadd_ps(o, o, _mm256_fmadd_ps(e, e, acc));
}

/* 16 floats rounded to float16 and stored at p, as store2_bf16 does */
static inline void store2_f16(void *p, __m256 a, __m256 b, int nt) {
    put32(p, _mm256_set_m128i(_mm256_cvtps_ph(b, RMS_F16_RNE), _mm256_cvtps_ph(a, RMS_F16_RNE)),
          nt);
}

static inline void widen_ps(__m256d *l, __m256d *h, __m256 v) {
    *l = _mm256_add_pd(*l, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    *h = _mm256_add_pd(*h, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

static inline double hsum_pd(__m256d a) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* hsum_pd of eight vectors at once, into s[0..7]: the same additions of the same operands, four
 * rows to a vector (22 operations where one row at a time takes 32, in shorter chains). */
static inline void hsum8_pd(const __m256d *v, double *s) {
    for (int q = 0; q < 2; q++) {
        const __m256d *w = v + 4 * q;
        __m256d t0 = _mm256_add_pd(_mm256_permute2f128_pd(w[0], w[1], 0x20), /* [a0+a2, a1+a3, */
                                   _mm256_permute2f128_pd(w[0], w[1], 0x31)); /* b0+b2, b1+b3] */
        __m256d t1 = _mm256_add_pd(_mm256_permute2f128_pd(w[2], w[3], 0x20),
                                   _mm256_permute2f128_pd(w[2], w[3], 0x31));
        __m256d acbd = _mm256_add_pd(_mm256_unpacklo_pd(t0, t1), _mm256_unpackhi_pd(t0, t1));
        _mm256_storeu_pd(s + 4 * q, _mm256_permute4x64_pd(acbd, 0xD8));
    }
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
#define V_HSUM8 hsum8_pd
#define V_FENCE() _mm_sfence()
/* Rounding to 16 bits is integer code here, so the 16-bit add of long rows rounds h once, into
 * h itself (see RMS_STAGE in rows_add_bwd.h). */
#define RMS_STAGE_IN_H 1

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
#define V_ST2(p, a, b, nt) store2_f16((p), (a), (b), (nt))
#define V_RND(v) _mm256_cvtph_ps(_mm256_cvtps_ph((v), RMS_F16_RNE))
/* The fused forward of float16 rows prefetches ahead at every length that fuses (512 bytes and
 * more), where the kernels of other ISAs leave 16-bit rows under 4 KiB and of 64 KiB or more to
 * the hardware (see FN(fused_ahead)): the conversions are single instructions, and the rows are
 * bound by memory rather than by their arithmetic. AMD EPYC (Zen 3), two builds alternating in
 * one process, each pair in both orders, the same bits, new time over old at one / two threads:
 * rows under 4 KiB, 65536x1024 0.76-0.83 / 0.76-0.80, 43690x1536 0.73-0.81 / 0.71-0.84,
 * 131072x512 0.75-0.93 / 0.78-0.92, 262144x256 0.96-0.99 / 0.84, 174762x384 0.92-1.12 /
 * 0.92-1.06; rows of 64 KiB or more, 1024x32768 0.74-0.76 / 0.78-0.80, 256x65536 0.78-0.86 /
 * 0.78-1.01, 512x65536 0.70-0.79 (two copies of one build: 0.98-1.02 / 1.00-1.04). */
#define V_PF_FUSED_16 512
#include "rows_impl.h"

#define RMS_DT 3
#define RMS_SFX bf16_avx2
#define V_LD(p) bf16x8_load(p)
#define V_ST(p, v) _mm_storeu_si128((__m128i *)(p), bf16x8_round(v))
#define V_STNT(p, v) _mm_stream_si128((__m128i *)(p), bf16x8_round(v))
#define V_STB 16
#define V_CPNT V_CPNT_16
#define V_ST2(p, a, b, nt) store2_bf16((p), (a), (b), (nt))
#define V_DOT2(acc, p) dot2_bf16((acc), (const void *)(p))
#define V_PACK2DOT(acc, lo, hi) pack2dot_bf16((acc), (lo), (hi))
#define V_RND(v) bf16x8_rnd(v)
/* Bfloat16 rows of 64 KiB or more prefetch too (1024x32768 0.78-0.86 / 0.87-0.92, 256x65536
 * 0.80-0.84 / 0.86-0.96, 512x65536 0.87 at one thread, measured as float16's above); rows under
 * 4 KiB, bound by their arithmetic, measured either way (131072x512 1.05, 65536x1024 0.97-0.98,
 * 262144x256 0.95-1.10 at one thread) and keep none. */
#define V_PF_FUSED_16 4096
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

static void stream_lines_avx2(void *dst, const void *src, size_t lines) {
    for (size_t i = 0; i < 2 * lines; i += 2) {
        __m256i a = _mm256_load_si256((const __m256i *)src + i);
        __m256i b = _mm256_load_si256((const __m256i *)src + i + 1);
        _mm256_stream_si256((__m256i *)dst + i, a);
        _mm256_stream_si256((__m256i *)dst + i + 1, b);
    }
}

const rms_isa_table rms_isa_avx2 = {
    "avx2",
    {RMS_ENTRY(f32_avx2), RMS_ENTRY(f64_avx2), RMS_ENTRY(f16_avx2), RMS_ENTRY(bf16_avx2)},
    0, /* widening each 16-bit weight costs a shuffle beside x's own (see make_weights) */
    512, /* shorter 16-bit rows, bound by their arithmetic, measured faster stored plainly */
    512,
    0, /* prefetched into L1, the 16-bit backward's long rows measured slower (see FN(near)) */
    stream_lines_avx2};

#if defined(__clang__)
#pragma clang attribute pop
#endif
