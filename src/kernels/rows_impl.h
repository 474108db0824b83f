/* The kernel bodies, written once and instantiated for every dtype x ISA.
 *
 * The including ISA file defines, before each inclusion:
 *   RMS_DT, RMS_SFX      dtype (RMS_DT_*) and the symbol suffix, e.g. f32_avx2
 *   W, V                 lanes and vector type of the compute type
 *   V_LD(p), V_ST(p, v)  load W storage elements widened to V / round V (nearest even) and store
 *   V_STNT(p, v), V_STB  non-temporal store, and its alignment in bytes (W * sizeof(T))
 *   V_RND(v)             round V through the storage type and back (identity for f32 / f64)
 *   V_LDC, V_STC, V_SET, V_ADD, V_SUB, V_MUL, V_FMA(a, b, c) = a * b + c, V_FENCE()
 *   A, A_ZERO, A_ADD, A_SUM   float64 accumulators (two per compute vector when C is float)
 *   A_WIDEN(l, h, v)     l, h += v widened to float64 (l += v when C is double)
 *   A_CVT(l, h, v)       l, h = v widened to float64 (l = v when C is double)
 * and optionally masked partial accesses of n < W elements: V_LDP(p, n), V_STP(p, v, n) for the
 * storage type (undefined after each inclusion) and V_LDCP(p, n), V_STCP(p, v, n) for the
 * compute type. Without them partial vectors go through a zeroed stack buffer. Also optional:
 * V_ST2(p, a, b, nt), storing two vectors at once (the spans store pairs through it), V_REGS,
 * the number of vector registers (16 unless defined), and
 * V_DOT2(acc, p) / V_PACK2DOT(acc, lo, hi), pairwise sums of squares of 2W storage elements
 * (read, or packed from two rounded vectors) for the forward and the add alike, and
 * V_HSUM8(a, s), s[j] = A_SUM(a[j]) for eight accumulators at once (FN(sums)), and
 * V_PF_FUSED_16, the shortest 16-bit rows (in bytes) whose fused forward prefetches ahead, with
 * no longest (see FN(fused_ahead)).
 *
 * Row sums end in float64: short runs of compute-type FMAs in several independent accumulators
 * (hiding FMA latency) are flushed into float64 before they can lose accuracy, so the sum is
 * far more accurate than the float32 the result is stored in. */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifndef RMS_IMPL_ONCE
#define RMS_IMPL_ONCE
#define RMS_DT_F32 0
#define RMS_DT_F64 1
#define RMS_DT_F16 2
#define RMS_DT_BF16 3
#define RMS_CAT_(a, b) a##_##b
#define RMS_CAT(a, b) RMS_CAT_(a, b)
#define RMS_INLINE static inline __attribute__((always_inline))
/* The row loops prefetch rows ahead of the one they scale: into L2, or into L1 where FN(near)
 * says so; pm is a prefetch mode (FN(pf_mode)). */
#define RMS_PREFETCH(p, pm)                                                                        \
    do {                                                                                           \
        if ((pm) == RMS_PF_L1)                                                                     \
            __builtin_prefetch((p), 0, 3);                                                         \
        else                                                                                       \
            __builtin_prefetch((p), 0, 2);                                                         \
    } while (0)
/* the row reductions: sum x^2, sum round(x + r)^2, sum dy * x, sum dy * w * x (w in the
 * compute type, or in the storage type: RMS_DOTWS); with RMS_KPF or'ed in, the reduction also
 * prefetches its first row a into L2 as it reads it (FN(quad), FN(fwd_pf1)); with RMS_KDG, a dot
 * product also adds dy * xhat into the dgamma row dg (FN(factors), FN(bwd_dg1)) */
enum { RMS_SQ, RMS_ADDSQ, RMS_DOT, RMS_DOTW, RMS_DOTWS, RMS_KPF = 8, RMS_KDG = 16 };
#define RMS_KBITS (RMS_KPF | RMS_KDG)
#ifndef RMS_PF1_AHEAD
#define RMS_PF1_AHEAD 1024
#endif
#ifndef RMS_PF1_STEP
#define RMS_PF1_STEP 128
#endif
/* the three passes, for their prefetch (FN(near)) */
enum { RMS_P_FWD, RMS_P_ADD, RMS_P_BWD };
/* prefetch modes: every line into L2, every line into L1, every second line into L2 */
enum { RMS_PF_L2, RMS_PF_L1, RMS_PF_L2_HALF };
/* options of a row loop, switched once per call into constants: weight, round before the
 * weight, non-temporal stores, weight in the storage type */
enum { RMS_O_W = 1, RMS_O_BEFORE = 2, RMS_O_NT = 4, RMS_O_WS = 8 };
/* FN(put)'s nt for the partial lines at either end of a streamed span: plain stores, or
 * non-temporal pieces (RMS_EDGE_NT: see FN(span)) */
#define RMS_EDGE 2
#define RMS_EDGE_NT 3
#if RMS_NT_EDGES
#include <emmintrin.h>
/* nb bytes from s to d (both multiples of 4, d aligned to 4), non-temporally, in the aligned
 * pieces of 16, 8 and 4 bytes that d allows. */
static inline void rms_nt_bytes(char *d, const char *s, size_t nb) {
    while (nb) {
        uintptr_t a = (uintptr_t)d;
        size_t n = nb >= 16 && a % 16 == 0 ? 16 : nb >= 8 && a % 8 == 0 ? 8 : 4;
        if (n == 16) {
            _mm_stream_si128((__m128i *)(void *)d,
                             _mm_loadu_si128((const __m128i *)(const void *)s));
        } else if (n == 8) {
            long long q;
            memcpy(&q, s, 8);
            _mm_stream_si64((long long *)(void *)d, q);
        } else {
            int q;
            memcpy(&q, s, 4);
            _mm_stream_si32((int *)(void *)d, q);
        }
        d += n;
        s += n;
        nb -= n;
    }
}
#endif
/* The hasw constant of the loops: 0 no weight, 1 compute-type weight, RMS_HW_S storage-type
 * weight (the same loops as 1 where the two types are one). */
#define RMS_HW_S (sizeof(T) == sizeof(C) ? 1 : 2)
/* An ISA file whose streaming store is a plain one (V_STNT is V_ST: the scalar and NEON kernels)
 * defines RMS_NO_STREAM before including this, and its loops are compiled for plain stores only
 * (RMS_NT_ON 0): the option switches below then leave out their streamed cases. */
#ifdef RMS_NO_STREAM
#define RMS_NT_ON 0
#define RMS_IF_NT(...)
#else
#define RMS_NT_ON 1
#define RMS_IF_NT(...) __VA_ARGS__
#endif
/* The options of a forward or add loop (RMS_O_* bits) that its row loops take as constants:
 * C(X, o, hasw, before, nt) for each, and D(X, o, ...) for the default (15; 11 without streamed
 * loops). */
#define RMS_CASES3(C, D, X)                                                                        \
    C(X, 0, 0, 0, 0) C(X, 1, 1, 0, 0) C(X, 2, 0, 1, 0) C(X, 3, 1, 1, 0) C(X, 9, RMS_HW_S, 0, 0)    \
    RMS_IF_NT(C(X, 4, 0, 0, 1) C(X, 5, 1, 0, 1) C(X, 6, 0, 1, 1) C(X, 7, 1, 1, 1)                  \
              C(X, 11, RMS_HW_S, 1, 0) C(X, 13, RMS_HW_S, 0, 1))                                   \
    D(X, 15, RMS_HW_S, 1, RMS_NT_ON)
/* A switch over the options of LIST (RMS_CASES3, RMS_CASES_BWD), each case by CASE(X, o, ...)
 * and the default by DFLT, then the store fence when `flags` streamed. */
#define RMS_OPT_SWITCH(LIST, CASE, DFLT, o, flags, X)                                              \
    do {                                                                                           \
        switch (o) { LIST(CASE, DFLT, X) }                                                         \
        if ((flags) & RMS_STREAM)                                                                  \
            V_FENCE();                                                                             \
    } while (0)
#define RMS_CASE3(X, o, a, b, c)                                                                   \
    case o: X(a, b, c); break;
#define RMS_DFLT3(X, o, a, b, c)                                                                   \
    default: X(a, b, c); break;
/* X(hasw, before, nt) with constant arguments for the options in `opt`, then the fence. */
#define RMS_SWITCH3(opt, flags, X) RMS_OPT_SWITCH(RMS_CASES3, RMS_CASE3, RMS_DFLT3, opt, flags, X)
/* A row loop for each of those options in a function of its own, and the switch that calls
 * them: X(o, hasw, before, nt) defines the function for o, and CALL(o) calls it. Inlined into
 * one function, the loops of every option made functions of up to 500 KB of code, and the
 * compiler's time grows faster than their size. */
#define RMS_VDEF(X, o, a, b, c) X(o, a, b, c)
#define RMS_VCASE(X, o, a, b, c)                                                                   \
    case o: X(o); break;
#define RMS_VDFLT(X, o, a, b, c)                                                                   \
    default: X(o); break;
#define RMS_VARIANTS3(X) RMS_CASES3(RMS_VDEF, RMS_VDEF, X)
#define RMS_VSWITCH3(opt, flags, CALL)                                                             \
    RMS_OPT_SWITCH(RMS_CASES3, RMS_VCASE, RMS_VDFLT, opt, flags, CALL)
/* The function of option o for the loop `name` */
#define RMS_VFN(name, o) FN(RMS_CAT(name, o))
#define RMS_VARIANT static __attribute__((noinline)) void
/* CALL, a row loop that names its row length KK, compiled with KK a constant for the short rows
 * of 64 and 128 elements (per-head norms) when `on` (a constant), else with KK = k: its loops
 * then unroll and the fixed cost of each row shrinks. Used for the 16-bit add and backward with a
 * weight (and dgamma), where it measured faster from memory as well as in cache (AMD EPYC Zen 4,
 * AVX2, one thread, bfloat16 1M x 64, ratio to two copies: backward 1.18-1.25 -> 1.10-1.14, add
 * 1.34-1.40 -> 1.25-1.27), and for the 16- and 32-bit forward with a weight (AMD EPYC Zen 3,
 * two builds alternating in one process, new time over old at one / two threads: bfloat16
 * 1M x 64 0.77 / 0.77-0.87, 524288x128 0.89 / 0.87; float16 0.80-0.84 / 0.83-0.93 and 0.87 /
 * 0.92; float32 524288x128 0.73 / 0.97-0.99, 1M x 64 the same within 0.03, in cache 0.88), and
 * without one too (AMD EPYC Zen 4, the same, each order, page-aligned, one thread: bfloat16
 * 1M x 64 0.79 and 0.80, 524288x128 0.87 and 0.87; float16 1M x 64 0.77 and 0.77; float32
 * 524288x128 0.84 and 0.83, 1M x 64 0.94 and 0.97, 2048x64 in cache 0.73; two threads, bfloat16
 * 1M x 64 0.80, float32 524288x128 0.96). The 16-bit add and backward take them without a
 * weight as well (the same, one thread: add bfloat16 1M x 64 0.73 and 0.68, 524288x128 0.78 and
 * 0.77, float16 1M x 64 0.74 and 0.73; backward bfloat16 1M x 64 0.88 and 0.88, 524288x128 0.98
 * and 0.97, float16 1M x 64 0.85 and 0.86; two threads, bfloat16 1M x 64: add 0.77, backward
 * 0.94). On the 16-core Xeon (AVX-512), without a weight, new over old at one / 16 threads:
 * forward 1M x 64 float32 0.88 / 0.95, float16 0.87 / 0.79, bfloat16 0.87 / 0.85; add bfloat16
 * 1M x 64 0.70 / 0.77, float16 0.88 / 0.93; backward bfloat16 1M x 64 0.98 / 0.79, float16 0.94 /
 * 0.78; rows of 128 0.85 to 1.07 by type and run, each order (about the same). The float32 add
 * and backward measured no faster (0.93 to 1.06), so they keep the one loop. */
#define RMS_KSW(on, k, CALL)                                                                       \
    do {                                                                                           \
        if ((on) && (k) == RMS_KSW_K1) {                                                           \
            const size_t KK = RMS_KSW_K1;                                                          \
            CALL;                                                                                  \
        } else if ((on) && (k) == RMS_KSW_K2) {                                                    \
            const size_t KK = RMS_KSW_K2;                                                          \
            CALL;                                                                                  \
        } else {                                                                                   \
            const size_t KK = (k);                                                                 \
            CALL;                                                                                  \
        }                                                                                          \
    } while (0)
/* RMS_KSW's `on` for the forward (16- and 32-bit rows) and the add (16-bit rows), with a weight
 * cast at the end (!bf) or with none. Their switches ask it with constant options, and their
 * RMS_ANY_K tests with the call's. */
#define RMS_KSW_FWD(bf) (sizeof(T) <= 4 && !(bf))
#define RMS_KSW_ADD(bf) (sizeof(T) == 2 && !(bf))
/* The kinds of second pass over a row (FN(span)): the forward (y = (x * r) * w), the add
 * (h = round(x + r), y = (h * r) * w), the backward (dx, and the dgamma partial row per hasdg)
 * the backward of two rows at once (accumulating dgamma), h alone, and the add's y alone (h
 * computed again, not stored: FN(add_early)); the vectors each computes, and at most how many
 * vectors of them a span computes ahead (FN(span_block)). */
enum { RMS_S_FWD, RMS_S_ADD, RMS_S_BWD, RMS_S_PAIR, RMS_S_H, RMS_S_ADD_Y };
#define RMS_SPAN_OUTS(kind, hasdg)                                                                 \
    ((kind) == RMS_S_PAIR                                                             ? 3          \
     : (kind) == RMS_S_ADD || (kind) == RMS_S_ADD_Y || ((kind) == RMS_S_BWD && (hasdg)) ? 2        \
                                                                                        : 1)
#define RMS_SPAN_BMAX 8
#define RMS_LINE 64
/* Vector registers of the ISA (V_REGS, optional). */
#ifndef V_REGS
#define V_REGS 16
#endif
/* Flush the compute-type accumulators into float64 every RMS_BLOCK vectors. */
#define RMS_BLOCK 32
/* The table row for one dtype of one ISA. */
#define RMS_ENTRY(sfx)                                                                             \
    {                                                                                              \
        fwd_rows_##sfx, add_rows_##sfx, bwd_rows_##sfx, sumsq_##sfx, scale_##sfx,                  \
            add_sumsq_##sfx, add_scale_##sfx, add_stage_##sfx, rescue_##sfx, dot_##sfx,            \
            bwd_##sfx, widen_##sfx, narrow_##sfx                                                   \
    }
/* t elements at p: a full vector when t == W (a constant in the main loops), else partial. */
#define LDX(p, t) ((t) == W ? V_LD(p) : V_LDP((p), (t)))
#define LDCX(p, t) ((t) == W ? V_LDC(p) : V_LDCP((p), (t)))
#define STX(p, v, t)                                                                               \
    do {                                                                                           \
        if ((t) == W)                                                                              \
            V_ST((p), (v));                                                                        \
        else                                                                                       \
            V_STP((p), (v), (t));                                                                  \
    } while (0)
/* The weight at offset i, and t weights widened to the compute type, for a hasw constant.
 * Storage-type weights get + 0 as the widening to the compute type does (offset 0), so that
 * a weight of -0 acts as +0 either way. */
#define W_AT(w, i, hw)                                                                             \
    ((hw) == 2 ? (const void *)((const T *)(w) + (i)) : (const void *)((const C *)(w) + (i)))
#define LDW(w, t, hw)                                                                              \
    ((hw) == 2 ? V_ADD(LDX((const T *)(w), (t)), V_SET((C)0)) : LDCX((const C *)(w), (t)))
#define STCX(p, v, t)                                                                              \
    do {                                                                                           \
        if ((t) == W)                                                                              \
            V_STC((p), (v));                                                                       \
        else                                                                                       \
            V_STCP((p), (v), (t));                                                                 \
    } while (0)
#endif

#if RMS_DT == RMS_DT_F32
#define T float
#define C float
#define S_LD(p) (*(p))
#define S_RND(c) (c)
#elif RMS_DT == RMS_DT_F64
#define T double
#define C double
#define S_LD(p) (*(p))
#define S_RND(c) (c)
#elif RMS_DT == RMS_DT_F16
#define T uint16_t
#define C float
#define S_LD(p) rms_f16_to_f32(*(p))
#define S_RND(c) rms_f16_to_f32(rms_f32_to_f16(c))
#else
#define T uint16_t
#define C float
#define S_LD(p) rms_bf16_to_f32(*(p))
#define S_RND(c) rms_bf16_to_f32(rms_f32_to_bf16(c))
#endif

#define FN(name) RMS_CAT(name, RMS_SFX)

#ifndef V_LDP
#define RMS_OWN_LDP
RMS_INLINE V FN(ldp)(const T *p, size_t n) {
    T b[W];
    memset(b, 0, sizeof(b));
    memcpy(b, p, n * sizeof(T));
    return V_LD(b);
}
RMS_INLINE void FN(stp)(T *p, V v, size_t n) {
    T b[W];
    V_ST(b, v);
    memcpy(p, b, n * sizeof(T));
}
#define V_LDP(p, n) FN(ldp)((p), (n))
#define V_STP(p, v, n) FN(stp)((p), (v), (n))
#endif
#ifndef V_CPNT
#define RMS_OWN_CPNT
#define V_CPNT(p, q) memcpy((p), (q), V_STB)
#endif
#ifndef V_LDCP
#define RMS_OWN_LDCP
RMS_INLINE V FN(ldcp)(const C *p, size_t n) {
    C b[W];
    memset(b, 0, sizeof(b));
    memcpy(b, p, n * sizeof(C));
    return V_LDC(b);
}
RMS_INLINE void FN(stcp)(C *p, V v, size_t n) {
    C b[W];
    V_STC(b, v);
    memcpy(p, b, n * sizeof(C));
}
#define V_LDCP(p, n) FN(ldcp)((p), (n))
#define V_STCP(p, v, n) FN(stcp)((p), (v), (n))
#endif

/* ---------------------------------------------------------------- weights */

static void FN(widen)(const void *src, void *dst, double offset, size_t n) {
    const T *s = (const T *)src;
    C *d = (C *)dst;
    V vo = V_SET((C)offset);
    size_t i = 0;
    for (; i + W <= n; i += W)
        V_STC(d + i, V_ADD(V_LD(s + i), vo));
    if (i < n)
        STCX(d + i, V_ADD(LDX(s + i, n - i), vo), n - i);
}

static void FN(narrow)(const void *src, void *dst, size_t n) {
    const C *s = (const C *)src;
    T *d = (T *)dst;
    size_t i = 0;
    for (; i + W <= n; i += W)
        V_ST(d + i, V_LDC(s + i));
    if (i < n)
        STX(d + i, LDCX(s + i, n - i), n - i);
}

/* ---------------------------------------------------------------- row reductions */

/* The two factors of the terms of t elements at i (partial loads are zero-filled); the dot
 * products use x * r, which stays near 1 whatever the scale of x. */
RMS_INLINE void FN(factors)(const T *a, const T *b, const void *w, C *dg, V vr, size_t i,
                            size_t t, const int kpf, V *u, V *v) {
    const int kind = kpf & ~RMS_KBITS;
    if (kind == RMS_SQ) {
        *u = *v = LDX(a + i, t);
    } else if (kind == RMS_ADDSQ) {
        *u = *v = V_RND(V_ADD(LDX(a + i, t), LDX(b + i, t)));
    } else {
        const int hw = kind == RMS_DOTWS ? 2 : 1; /* the weight's type, for DOTW(S) */
        V d = LDX(a + i, t);
        *u = kind == RMS_DOT ? d : V_MUL(d, LDW(W_AT(w, i, hw), t, hw));
        *v = V_MUL(LDX(b + i, t), vr);
        if (kpf & RMS_KDG)
            STCX(dg + i, V_FMA(d, *v, LDCX(dg + i, t)), t);
    }
}

/* Four vectors of terms from i into accumulators p..s. With V_DOT2 (a pairwise dot product of
 * 2W storage elements, e.g. VDPBF16PS) the squares of x, and of h = round(x + r) packed back
 * by V_PACK2DOT, take two of them and leave r and s alone; the add and the plain forward pass both
 * go this way, so that their sums stay bit-identical. */
RMS_INLINE void FN(quad)(const T *a, const T *b, const void *w, C *dg, V vr, size_t i,
                         const int kind, V *p, V *q, V *r, V *s) {
    if (kind & RMS_KPF) {
        /* addresses as integers: the lines ahead may lie past the end of the array */
        for (size_t o = 0; o < 4 * W * sizeof(T); o += RMS_PF1_STEP)
            __builtin_prefetch((const void *)((uintptr_t)(a + i) + RMS_PF1_AHEAD + o), 0, 2);
        FN(quad)(a, b, w, dg, vr, i, kind & ~RMS_KPF, p, q, r, s);
        return;
    }
#ifdef V_DOT2
    if (kind == RMS_SQ) {
        *p = V_DOT2(*p, a + i);
        *q = V_DOT2(*q, a + i + 2 * W);
        return;
    }
    if (kind == RMS_ADDSQ) {
        V h0 = V_RND(V_ADD(V_LD(a + i), V_LD(b + i)));
        V h1 = V_RND(V_ADD(V_LD(a + i + W), V_LD(b + i + W)));
        V h2 = V_RND(V_ADD(V_LD(a + i + 2 * W), V_LD(b + i + 2 * W)));
        V h3 = V_RND(V_ADD(V_LD(a + i + 3 * W), V_LD(b + i + 3 * W)));
        *p = V_PACK2DOT(*p, h0, h1);
        *q = V_PACK2DOT(*q, h2, h3);
        return;
    }
#endif
    V u0, v0, u1, v1, u2, v2, u3, v3;
    FN(factors)(a, b, w, dg, vr, i, W, kind, &u0, &v0);
    FN(factors)(a, b, w, dg, vr, i + W, W, kind, &u1, &v1);
    FN(factors)(a, b, w, dg, vr, i + 2 * W, W, kind, &u2, &v2);
    FN(factors)(a, b, w, dg, vr, i + 3 * W, W, kind, &u3, &v3);
    *p = V_FMA(u0, v0, *p);
    *q = V_FMA(u1, v1, *q);
    *r = V_FMA(u2, v2, *r);
    *s = V_FMA(u3, v3, *s);
}

/* Whether quad() takes `kind` two accumulators at a time (V_DOT2). */
#ifdef V_DOT2
#define RMS_KIND_DOT2(kind) (((kind) & ~RMS_KBITS) == RMS_SQ || ((kind) & ~RMS_KBITS) == RMS_ADDSQ)
#else
#define RMS_KIND_DOT2(kind) 0
#endif

/* The most rows a group holds (see FN(group)). */
#define RMS_GROUP_MAX 8

/* Eight independent accumulators hide the FMA latency at two FMAs per cycle; a block (up to
 * RMS_BLOCK vectors) is summed in the compute type, then widened once. A row's sum is its blocks
 * in order (reduce_blk, while at least 4 W elements remain), then the rest (reduce_end), so a
 * loop may take a row's blocks between other work (FN(fwd_fused)) and get the same bits. */
RMS_INLINE void FN(reduce_blk)(const T *a, const T *b, const void *w, C *dg, V vr, size_t n,
                               const int kind, size_t *pi, A *l0, A *h0, const int first) {
    V a0 = V_SET((C)0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    size_t i = *pi, stop = n - i >= RMS_BLOCK * W ? i + RMS_BLOCK * W : n, start = i;
    for (; i + 8 * W <= stop; i += 8 * W) {
        FN(quad)(a, b, w, dg, vr, i, kind, &a0, &a1, &a2, &a3);
        FN(quad)(a, b, w, dg, vr, i + 4 * W, kind, &a4, &a5, &a6, &a7);
    }
    if (i + 4 * W <= stop) {
        FN(quad)(a, b, w, dg, vr, i, kind, &a0, &a1, &a2, &a3);
        i += 4 * W;
    }
    /* The add tree leaves out accumulators that are still +0: a4..a7 when the block was a
     * single quad (a short row), and a2, a3, a6, a7 for pairwise sums of squares, which feed
     * the others only. Accumulators that start at +0 and only ever gain terms are never -0,
     * so adding a +0 changes no bit: a short row's chain is just shorter. */
    int two = RMS_KIND_DOT2(kind), one = i - start <= 4 * W;
    V sum = one && two ? V_ADD(a0, a1)
          : one        ? V_ADD(V_ADD(a0, a1), V_ADD(a2, a3))
          : two        ? V_ADD(V_ADD(a0, a4), V_ADD(a1, a5))
                       : V_ADD(V_ADD(V_ADD(a0, a4), V_ADD(a1, a5)),
                               V_ADD(V_ADD(a2, a6), V_ADD(a3, a7)));
    (void)h0; /* unused where C is double */
    if (first) /* the first block sets l0, h0: +0 plus the sum is the sum */
        A_CVT(*l0, *h0, sum);
    else
        A_WIDEN(*l0, *h0, sum);
    *pi = i;
}

RMS_INLINE A FN(reduce_end)(const T *a, const T *b, const void *w, C *dg, V vr, size_t n,
                            const int kind, size_t i, A l0, A h0) {
    A l1 = A_ZERO, h1 = A_ZERO;
    V u0, v0;
    for (; i + W <= n; i += W) {
        FN(factors)(a, b, w, dg, vr, i, W, kind, &u0, &v0);
        A_WIDEN(l0, h0, V_MUL(u0, v0));
    }
    if (i == n) /* no partial vector: l1, h1 would add +0 */
        return A_ADD(l0, h0);
    FN(factors)(a, b, w, dg, vr, i, n - i, kind, &u0, &v0);
    A_WIDEN(l1, h1, V_MUL(u0, v0));
    return A_ADD(A_ADD(l0, h0), A_ADD(l1, h1));
}

RMS_INLINE A FN(reduce_a)(const T *a, const T *b, const void *w, C *dg, C r, size_t n,
                          const int kind) {
    V vr = V_SET(r);
    A l0 = A_ZERO, h0 = A_ZERO;
    size_t i = 0;
    for (int first = 1; i + 4 * W <= n; first = 0)
        FN(reduce_blk)(a, b, w, dg, vr, n, kind, &i, &l0, &h0, first);
    return FN(reduce_end)(a, b, w, dg, vr, n, kind, i, l0, h0);
}

/* The sum (reduce_a leaves its float64 lanes to be added up, so that a group's rows can add
 * theirs up together: FN(sums)). */
RMS_INLINE double FN(reduce)(const T *a, const T *b, const void *w, C r, size_t n,
                             const int kind) {
    return A_SUM(FN(reduce_a)(a, b, w, NULL, r, n, kind));
}

/* ss[j] = A_SUM(sa[j]) for a group of n rows: eight at once through V_HSUM8 where an ISA defines
 * it, with the same additions (AMD EPYC Zen 4, one row at a time, the adding up of the lanes
 * took a quarter of the time of the bfloat16 forward of rows of 64 in cache). */
RMS_INLINE void FN(sums)(const A *sa, double *ss, size_t n) {
#ifdef V_HSUM8
    if (n == 8) {
        V_HSUM8(sa, ss);
        return;
    }
#endif
    for (size_t j = 0; j < n; j++)
        ss[j] = A_SUM(sa[j]);
}

static double FN(sumsq)(const void *x, size_t n) {
    return FN(reduce)((const T *)x, NULL, NULL, (C)1, n, RMS_SQ);
}

static double FN(add_sumsq)(const void *x, const void *r, size_t n) {
    return FN(reduce)((const T *)x, (const T *)r, NULL, (C)1, n, RMS_ADDSQ);
}

/* sum(dy * w * xhat) with xhat = x * r; w in the storage type with RMS_W_STORAGE in flags */
static double FN(dot)(const void *dy, const void *x, const void *w, double r, size_t n,
                      int flags) {
    if (!w)
        return FN(reduce)((const T *)dy, (const T *)x, NULL, (C)r, n, RMS_DOT);
    if ((flags & RMS_W_STORAGE) && sizeof(T) != sizeof(C))
        return FN(reduce)((const T *)dy, (const T *)x, w, (C)r, n, RMS_DOTWS);
    return FN(reduce)((const T *)dy, (const T *)x, w, (C)r, n, RMS_DOTW);
}

/* Slow path for a row whose sum of squares is not usable (rms_sumsq_ok): NaN for a row with
 * NaN or Inf, else the sum rescaled by the row's largest magnitude, in float64. */
static double FN(rescue)(const void *xv, const void *rv, size_t n, double eps) {
    const T *x = (const T *)xv, *r = (const T *)rv;
    double amax = 0.0;
    for (size_t i = 0; i < n; i++) {
        double v = r ? (double)S_RND((C)(S_LD(x + i) + S_LD(r + i))) : (double)S_LD(x + i);
        if (!(fabs(v) <= 1.79769313486231570e308)) /* Inf or NaN in the row */
            return NAN;
        amax = fabs(v) > amax ? fabs(v) : amax;
    }
    if (amax == 0.0) /* all zeros */
        return 1.0 / sqrt(eps);
    double s = 0.0; /* every value finite: the squares overflowed or underflowed, so rescale */
    for (size_t i = 0; i < n; i++) {
        double v = r ? (double)S_RND((C)(S_LD(x + i) + S_LD(r + i))) : (double)S_LD(x + i);
        s += (v / amax) * (v / amax);
    }
    return 1.0 / (amax * sqrt(s / (double)n + eps / amax / amax));
}

/* inv_n: rms_inv_pow2(n). */
RMS_INLINE double FN(rstd)(double ss, const T *x, const T *r, size_t n, double eps,
                           double inv_n) {
    return rms_sumsq_ok(ss, sizeof(C) == 8) ? 1.0 / sqrt(rms_mean(ss, n, inv_n) + eps)
                                            : FN(rescue)(x, r, n, eps);
}

/* rstd of n rows (a group) from their sums ss: rows x (stride xs) and, for the add, r (stride
 * rs, or NULL). A full group of float-compute rows goes through V_RSTD8 where an ISA defines it:
 * the same bits, with the square roots and divisions of eight rows in four vector operations
 * rather than sixteen scalar ones, whose throughput limits short 16-bit rows (AMD EPYC Zen 4,
 * one thread, two builds alternating in one process, ratio to a copy: bfloat16 1M x 64 forward
 * 2.85-2.89 -> 2.56-2.73 in three runs of four, 2.47 -> 2.53 in the fourth; add 2.05-2.22 ->
 * 1.96-2.14; float16 forward 2.55-2.64 -> 2.38-2.48). */
RMS_INLINE void FN(rstds)(const A *sa, C *rstd, size_t n, const T *x, ptrdiff_t xs,
                          const T *r, ptrdiff_t rs, size_t k, double eps, double inv_k) {
    double ss[RMS_GROUP_MAX];
    FN(sums)(sa, ss, n);
#ifdef V_RSTD8
    if (sizeof(C) == 4 && n == 8 &&
        V_RSTD8(ss, (float *)(void *)rstd, k, eps, inv_k))
        return;
#endif
    for (size_t j = 0; j < n; j++)
        rstd[j] = (C)FN(rstd)(ss[j], x + (ptrdiff_t)j * xs, r ? r + (ptrdiff_t)j * rs : NULL, k,
                              eps, inv_k);
}

/* ---------------------------------------------------------------- streaming */

/* Elements to store normally before `p` reaches a cache line (RMS_LINE), where streaming
 * starts; -1 when `p` can never get there (not even element-aligned). */
static inline size_t FN(stream_head)(const T *p, size_t n) {
    size_t mis = (size_t)((uintptr_t)p % RMS_LINE);
    if (mis % sizeof(T))
        return (size_t)-1;
    size_t head = mis ? (RMS_LINE - mis) / sizeof(T) : 0;
    return head < n ? head : n;
}

/* The end of the whole lines of a streamed span of n elements whose first `head` elements
 * precede its first whole line. */
static inline size_t FN(stream_end)(size_t head, size_t n) {
    const size_t line = RMS_LINE / sizeof(T);
    return head + (n - head) / line * line;
}

/* Whether to stream outputs y (and h, when not NULL: both must align at the same element), and
 * the partial vector to store first. */
static inline int FN(plan_stream)(const T *y, const T *h, size_t n, int flags, size_t *head) {
    *head = 0;
    if (!(flags & RMS_STREAM))
        return 0;
    size_t hy = FN(stream_head)(y, n);
    if (hy == (size_t)-1 || (h && FN(stream_head)(h, n) != hy))
        return 0;
    *head = hy;
    return 1;
}

/* The forward's rows that RMS_FWD_NEAR prefetches into L1, a row or 16 KiB ahead: its rows over 16
 * KiB, of every type (RMS_FWD_AHEAD_32: FN(fwd_ahead)), and its 32- and 64-bit rows of
 * RMS_NEAR_FWD_MIN bytes or more, those under 4 KiB in place of the CPU's own prefetcher
 * (RMS_HW_PREFETCH, which the add and the backward keep). On the 2-core Zen 5 VM, the same
 * kernels with and without, 64 MiB of x, page-aligned, each pair in both orders, new time over
 * old, one / two threads: float32 rows of 256 bytes 0.79 / 0.91, 384 bytes 0.90 / 0.93, 640 0.68 /
 * 0.88, 768 0.71 / 0.86, 1 KiB 0.84 / 0.86, 1.5 KiB 0.88 / 0.87, 2 KiB 0.88 / 0.90, 3 KiB 0.80 /
 * 0.88 (1.05-1.53 of a copy before, 0.94-1.03 after; 384 bytes 1.62 -> 1.45); float64 256 bytes
 * 0.91 / 0.92, 384 0.87 / 0.90, 768 0.74 / 0.73, 2 KiB 0.88 / 0.81, 3 KiB 0.84 / 0.86; outputs 16
 * bytes past a page, float32 640 bytes 0.74 / 0.88, 1 KiB 0.91 / 0.93, 2 KiB 0.84 / 0.88, 3 KiB
 * 0.79 / 0.86 (rows of 256 and 384 bytes there take the line buffer, RMS_LINED: 0.94 to 1.01).
 * 16-bit rows under 16 KiB measured either way (bfloat16 and float16 rows of 256 bytes to 16 KiB,
 * 0.86 to 1.06) and keep L2. */
#ifndef RMS_NEAR_FWD_MIN
#define RMS_NEAR_FWD_MIN 256
#endif
static inline int FN(fwd_near)(size_t k, const int pass, int flags) {
    size_t row = k * sizeof(T);
    return pass == RMS_P_FWD && (flags & RMS_FWD_NEAR) &&
           (row > 16384 || (sizeof(T) >= 4 && row >= RMS_NEAR_FWD_MIN));
}

/* Whether the rows of k elements of a pass are prefetched into L1, 16 KiB of input ahead, rather
 * than into L2, 64 KiB ahead: rows of 32- or 64-bit elements of 4 to 16 KiB for the forward and
 * the add, and of 4 to 8 KiB for the backward, whose first pass then reads from L1 while the row
 * before is scaled. Measured on one thread (two in brackets), ratio to a copy or a triad:
 *   forward float32 8192x4096: 1.14-1.18 -> 1.03-1.07; 8192x2048: 1.16 -> 1.13; float64
 *     8192x2048: 1.15-1.17 -> 1.05-1.07;
 *   add float32 8192x2048: 1.00-1.10 -> 0.92-0.95; 16384x1024: 1.05 -> 0.96-0.97; 16384x4096:
 *     1.12-1.13 -> 1.08-1.10 (1.10 -> 1.06-1.08); float64 8192x1024: 0.99-1.01 -> 0.89-0.90
 *     (0.91-0.94 -> 0.85-0.88); float64 8192x2048 the same within noise (1.09-1.12 either way);
 *   backward float32 16384x1024: 1.14-1.17 -> 1.04-1.08 (1.05-1.09 -> 0.98-1.00); 16384x1536:
 *     1.21 -> 1.06 (1.15 -> 1.06-1.08); 32768x1024: 1.17-1.22 -> 1.07-1.10; 8192x2048: 1.18-1.19
 *     -> 1.11-1.12; float64 16384x512: 0.83-0.85 -> 0.75-0.76.
 * Measured slower that way, so left in L2: short rows (forward 1M x 64 float32: 1.13 -> 1.27;
 * backward 32768x512 about 0.02 slower), forward rows of 32 KiB (8192x8192 float32: 1.10 -> 1.18;
 * L1 cannot hold two), backward rows of 16 KiB (8192x4096 float32, two threads: 1.07-1.08 ->
 * 1.11: with the partial dgamma row, five rows in flight overflow L1), and the 16-bit forward,
 * which the arithmetic of its second pass limits at one thread (bfloat16 8192x4096: 1.16 ->
 * 1.18-1.30).
 * With RMS_HW_PREFETCH (AMD EPYC Zen 4) forward and add rows of 16 KiB go to L2 too, in its
 * every-second-line mode: the row, the row ahead and the weight overflow the 32 KiB L1 there.
 * One thread, ratio to the prefetching copy, two builds alternating in one process: float32
 * add 16384x4096 1.46-1.51 -> 1.15-1.18, forward 16384x4096 1.31-1.32 -> 1.15-1.16; float64
 * forward 8192x2048 1.84-1.85 -> 1.49-1.50.
 * With RMS_NEAR_16 (the driver sets it on Intel CPUs, rms_cpu_near_16) the 16-bit backward, whose
 * second pass has the most arithmetic of any, prefetches its rows of up to 2 KiB into L1 too, 16
 * KiB ahead (the row after that when fused). The same build in one process with
 * RMSNORM_L1_PREFETCH_16 on and off for rows of every length, each pair in both orders (the
 * geometric mean), page-aligned, new time over old:
 *   2-core Xeon (AVX-512), one / two threads: bfloat16 1M x 64 0.96 / 0.95, 262144x256 0.91 /
 *     0.93, 131072x512 0.94 / 0.96, 65536x1024 0.94 / 0.97; float16 1M x 64 0.96 / 0.97,
 *     262144x256 0.91 / 0.91, 131072x512 0.94 / 1.01-1.06, 65536x1024 0.94 / 0.99;
 *   16-core Xeon, 1 / 4 / 16 threads: bfloat16 1048576x64 0.98 / 0.99 / 0.99, 262144x256 0.98 /
 *     1.00 / 0.99, 131072x512 0.99 / 1.00 / 0.995, 65536x1024 0.97 / 1.00 / 1.02; float16
 *     262144x256 0.95 / 0.96 / 0.97, 131072x512 0.95 / 1.00 / 1.02, 65536x1024 0.95 / 1.01 /
 *     1.02.
 * Longer rows gained on the 2-core Xeon (bfloat16 16384x4096 0.98 / 0.96, 8192x8192 0.97 / 0.99,
 * 1024x32768 0.98 / 1.01, 256x65536 1.00; float16 8192x8192 0.95 / 0.98) but lost on the
 * 16-core one (bfloat16 32768x2048 1.03 / 1.04 / 1.02, 8192x8192 1.03 / 1.01 / 0.98; float16
 * 8192x8192 1.02 / 1.01 / 1.01), and keep L2. Into L1 64 KiB ahead gained less on the 2-core
 * Xeon (bfloat16 16384x4096 0.98, 65536x1024 0.99), 32 KiB ahead too (0.97-0.98), and
 * PREFETCHNTA lost (2.1 to 2.3 of the time). The float32 backward, its rows of 16 KiB and more
 * prefetched the same way, measured the same within 0.02. The AVX2 kernels on the 2-core Xeon
 * (`set_isa("avx2")`) lost on long rows (one thread: bfloat16 16384x4096 1.06, 1024x32768 1.07,
 * float16 1.07-1.08; two: bfloat16 1.03-1.04) and gained little on short ones (0.96 to 1.00;
 * bfloat16 262144x256 1.07 at two threads), so they keep L2 (near_bwd_16 in the ISA table).
 * With RMS_FWD_NEAR (the driver sets it on Zen 5, rms_cpu_fwd_flags) the forward prefetches more
 * rows into L1 (FN(fwd_near)). */
static inline int FN(near)(size_t k, const int pass, int flags) {
    size_t row = k * sizeof(T);
    size_t max = pass == RMS_P_BWD || (flags & RMS_HW_PREFETCH) ? 8192 : 16384;
    if (FN(fwd_near)(k, pass, flags))
        return 1;
    if (sizeof(T) == 2)
        return pass == RMS_P_BWD && (flags & RMS_NEAR_16) && row <= 2048;
    return row >= 4096 && row <= max;
}

/* Row i + d of a (stride s), the row to prefetch, or NULL when there is none (d == 0: no
 * prefetch, or i + d >= m: past the last row, unless the rows go on past the call's m:
 * RMS_PF_PAST in flags). */
RMS_INLINE const T *FN(row_ahead)(const T *a, ptrdiff_t s, size_t i, size_t d, size_t m,
                                  int flags) {
    return d && (i + d < m || (flags & RMS_PF_PAST)) ? a + (ptrdiff_t)(i + d) * s : NULL;
}

/* The prefetch mode of a pass over rows of k elements (see FN(near)). With RMS_HW_PREFETCH, the
 * L2 prefetch of the forward and the add touches every second line of 32- and 64-bit rows, and
 * the CPU's own prefetcher fetches the lines between: on an AMD EPYC (Zen 4), a plain copy of
 * 256 MiB took 15.4 ms, 19.5 ms with a PREFETCHT1 64 KiB ahead on every line, and 13.2 ms with
 * one on every eighth line. Ratio to the roofline, every line -> every second line, one thread
 * (two), float32, the two alternating in one process: forward 8192x8192 1.25 -> 1.16 (1.16 ->
 * 1.11), 4096x12288 1.34 -> 1.15 (1.17 -> 1.09); add 8192x8192 1.25 -> 1.16 (1.21 -> 1.13),
 * 4096x12288 1.28 -> 1.19 (1.13 -> 1.10). Every fourth or eighth line gained less, the L1
 * prefetch needs every line (16384x4096 forward 1.23 -> 1.48 at every fourth), and so did the
 * backward at one thread (8192x8192 1.58 -> 1.67 at every second line), as did the 16-bit
 * forward (bfloat16, one thread, of the prefetching copy: 8192x8192 1.35 -> 1.91, 16384x4096
 * 1.36 -> 2.09; the add the same within 0.06), so 16-bit rows keep every line. The backward's
 * mode depends on no flag. */
static inline int FN(pf_mode)(size_t k, const int pass, int flags) {
    if (FN(near)(k, pass, flags))
        return RMS_PF_L1;
    return (flags & RMS_HW_PREFETCH) && sizeof(T) >= 4 && pass != RMS_P_BWD ? RMS_PF_L2_HALF
                                                                            : RMS_PF_L2;
}

/* Whether offset i of a row gets a prefetch in mode pm: in RMS_PF_L2_HALF, the offsets in the
 * first half of each 128-byte pair of lines. */
RMS_INLINE int FN(pf_line)(size_t i, int pm) {
    return pm != RMS_PF_L2_HALF || (i * sizeof(T)) % 128 < 64;
}

/* Prefetches offset i of two rows (the next inputs of the add or the backward), if any. */
RMS_INLINE void FN(pf2)(const T *a, const T *b, size_t i, const int pm) {
    if (a && FN(pf_line)(i, pm)) {
        RMS_PREFETCH(a + i, pm);
        RMS_PREFETCH(b + i, pm);
    }
}

/* ---------------------------------------------------------------- second passes */

/* A span is the second pass over a row, of a kind RMS_S_*. Its rows: inputs a and b (x; x, r;
 * dy, x), outputs o (y; y; dx) and h (the add), the dgamma row dg and the weight w; the second
 * row of a pair lies as, bs and os further along a, b and o. vr, vnc (and vr1, vnc1 for the
 * second row): the rstd and, for the backward, -c. */
typedef struct {
    const T *a, *b;
    T *o, *h;
    C *dg;
    const void *w;
    ptrdiff_t as, bs, os;
    V vr, vnc, vr1, vnc1;
} FN(span_rows);

/* (v * r) * w, cast through T first when `before`; the constant flags make specialised loops. */
RMS_INLINE V FN(scale_val)(V v, const void *w, V vr, size_t t, const int hasw, const int before) {
    v = V_MUL(v, vr);
    if (before)
        v = V_RND(v);
    return hasw ? V_MUL(v, LDW(w, t, hasw)) : v;
}

/* dx = r * (g - xhat * c), given vnc = -c: one explicit FMA, so that the compiler has no product
 * left to fuse in one place and not in another, and every path gives the same bits. */
RMS_INLINE V FN(dx_val)(V g, V xh, V vr, V vnc) { return V_MUL(vr, V_FMA(xh, vnc, g)); }

/* The outputs of t elements at offset i of a span, into v: y (forward); y, h (add); dx and the
 * new dgamma (backward); dx, the second row's dx and dgamma (pair). In the backward, with
 * xhat = x * r and g = dy * w: c = mean(g * xhat), dx = r * (g - xhat * c), and the dgamma
 * partial row gains dy * xhat (hasdg 1; 2 sets it; 3 sets it rounded to T: RMS_DG_NARROW).
 * Every intermediate stays near the scale of dy, so huge or tiny rows neither overflow nor
 * underflow. */
RMS_INLINE void FN(span_val)(const FN(span_rows) *s, size_t i, size_t t, const int kind,
                             const int hasw, const int before, const int hasdg, V *v) {
    const void *w = W_AT(s->w, i, hasw);
    if (kind == RMS_S_FWD) {
        v[0] = FN(scale_val)(LDX(s->a + i, t), w, s->vr, t, hasw, before);
    } else if (kind == RMS_S_ADD || kind == RMS_S_ADD_Y) {
        v[1] = V_RND(V_ADD(LDX(s->a + i, t), LDX(s->b + i, t)));
        v[0] = FN(scale_val)(v[1], w, s->vr, t, hasw, before);
    } else if (kind == RMS_S_H) {
        v[0] = V_RND(V_ADD(LDX(s->a + i, t), LDX(s->b + i, t)));
    } else if (kind == RMS_S_BWD) {
        V dyv = LDX(s->a + i, t), xh = V_MUL(LDX(s->b + i, t), s->vr);
        if (hasdg == 1)
            v[1] = V_FMA(dyv, xh, LDCX(s->dg + i, t));
        else if (hasdg >= 2)
            v[1] = V_MUL(dyv, xh);
        v[0] = FN(dx_val)(hasw ? V_MUL(dyv, LDW(w, t, hasw)) : dyv, xh, s->vr, s->vnc);
    } else {
        V dyv0 = LDX(s->a + i, t), xh0 = V_MUL(LDX(s->b + i, t), s->vr);
        V dyv1 = LDX(s->a + s->as + i, t), xh1 = V_MUL(LDX(s->b + s->bs + i, t), s->vr1);
        V wv = LDW(w, t, hasw);
        v[2] = V_FMA(dyv1, xh1, V_FMA(dyv0, xh0, LDCX(s->dg + i, t)));
        v[0] = FN(dx_val)(V_MUL(dyv0, wv), xh0, s->vr, s->vnc);
        v[1] = FN(dx_val)(V_MUL(dyv1, wv), xh1, s->vr1, s->vnc1);
    }
}

/* t < W elements of v at p through a buffer, in plain stores of 32, 16, 8, 4 and 2 bytes. */
RMS_INLINE void FN(st_plain)(T *p, V v, size_t t) {
    T b[W] __attribute__((aligned(64)));
    V_ST(b, v);
    const char *s = (const char *)b;
    char *d = (char *)p;
    size_t nb = t * sizeof(T);
#define RMS_PIECE(n)                                                                               \
    if ((n) < sizeof(b) && (nb & (n))) {                                                           \
        memcpy(d, s, (n));                                                                         \
        d += (n);                                                                                  \
        s += (n);                                                                                  \
    }
    RMS_PIECE(32) RMS_PIECE(16) RMS_PIECE(8) RMS_PIECE(4) RMS_PIECE(2)
#undef RMS_PIECE
}

/* t <= W elements of v at p through a buffer, non-temporally (rms_nt_bytes). */
RMS_INLINE void FN(st_edge)(T *p, V v, size_t t) {
#if RMS_NT_EDGES
    T b[W] __attribute__((aligned(64)));
    V_ST(b, v);
    rms_nt_bytes((char *)p, (const char *)b, t * sizeof(T));
#else
    (void)p, (void)v, (void)t;
#endif
}

/* Stores t elements of a span in mode nt: 0 plain; 1 streamed, a full vector non-temporally;
 * RMS_EDGE the partial lines at either end of a streamed span, plainly; RMS_EDGE_NT those lines
 * in non-temporal pieces (FN(st_edge)). Partial vectors of
 * modes 1 and RMS_EDGE go through plain stores rather than a masked one: on an AMD EPYC
 * (Zen 4), masked stores into the lines beside streaming stores cost about a read from memory
 * each (float32 forward, one thread, output rows starting 16 bytes past a cache line, ratio to
 * a copy: 65536x1024 1.56-2.09 -> 1.06-1.18, 1M x 64 6.1-6.8 -> 1.5-1.7). */
RMS_INLINE void FN(put)(T *y, V v, size_t t, const int nt) {
    if (nt == 1 && t == W)
        V_STNT(y, v);
    else if (nt == RMS_EDGE_NT)
        FN(st_edge)(y, v, t);
    else if (nt && t < W)
        FN(st_plain)(y, v, t);
    else
        STX(y, v, t);
}

/* Stores the outputs v of t elements at offset i of a span (see span_val). */
RMS_INLINE void FN(span_put)(const FN(span_rows) *s, size_t i, size_t t, const int kind,
                             const int hasdg, const int nt, const V *v) {
    if (kind == RMS_S_ADD)
        FN(put)(s->h + i, v[1], t, nt);
    if (kind == RMS_S_BWD && hasdg == 3)
        STX((T *)s->dg + i, v[1], t);
    else if ((kind == RMS_S_BWD && hasdg) || kind == RMS_S_PAIR)
        STCX(s->dg + i, v[kind == RMS_S_PAIR ? 2 : 1], t);
    FN(put)(s->o + i, v[0], t, nt);
    if (kind == RMS_S_PAIR)
        FN(put)(s->o + s->os + i, v[1], t, nt);
}

/* Stores the outputs of two full vectors, v at offset i and u after it: through V_ST2(p, a, b,
 * nt) where an ISA defines it (one check of both for the fast conversion). */
RMS_INLINE void FN(span_put2)(const FN(span_rows) *s, size_t i, const int kind, const int hasdg,
                              const int nt, const V *v, const V *u) {
#ifdef V_ST2
    if (kind == RMS_S_ADD)
        V_ST2(s->h + i, v[1], u[1], nt == 1);
    if (kind == RMS_S_BWD && hasdg == 3) {
        V_ST2((T *)s->dg + i, v[1], u[1], 0);
    } else if ((kind == RMS_S_BWD && hasdg) || kind == RMS_S_PAIR) {
        STCX(s->dg + i, v[kind == RMS_S_PAIR ? 2 : 1], W);
        STCX(s->dg + i + W, u[kind == RMS_S_PAIR ? 2 : 1], W);
    }
    V_ST2(s->o + i, v[0], u[0], nt == 1);
    if (kind == RMS_S_PAIR)
        V_ST2(s->o + s->os + i, v[1], u[1], nt == 1);
#else
    FN(span_put)(s, i, W, kind, hasdg, nt, v);
    FN(span_put)(s, i + W, W, kind, hasdg, nt, u);
#endif
}

/* Stores the outputs v of nb full vectors at offset i of a span, in pairs where it can. */
RMS_INLINE void FN(span_block_put)(const FN(span_rows) *s, size_t i, size_t nb, const int kind,
                                   const int hasdg, const int nt, V (*v)[3]) {
    size_t q = 0;
    for (; q + 2 <= nb; q += 2)
        FN(span_put2)(s, i + q * W, kind, hasdg, nt, v[q], v[q + 1]);
    if (q < nb)
        FN(span_put)(s, i + q * W, W, kind, hasdg, nt, v[q]);
}

/* Prefetches offset i of the rows pa and pb (if any) that will be a span's inputs, in mode pm;
 * for a pair, of the rows as and bs beyond as well. */
RMS_INLINE void FN(span_pf)(const FN(span_rows) *s, const T *pa, const T *pb, size_t i, int pm,
                            const int kind) {
    if (!pa || !FN(pf_line)(i, pm))
        return;
    RMS_PREFETCH(pa + i, pm);
    if (kind != RMS_S_FWD)
        RMS_PREFETCH(pb + i, pm);
    if (kind == RMS_S_PAIR) {
        RMS_PREFETCH(pa + s->as + i, pm);
        RMS_PREFETCH(pb + s->bs + i, pm);
    }
}

/* Vectors a span computes ahead of its stores: enough for 128 bytes of each input, within the
 * ISA's registers (V_REGS) for its outputs (RMS_SPAN_OUTS). See FN(span). */
RMS_INLINE size_t FN(span_block)(const int kind, const int hasdg) {
    size_t mem = 128 / (W * sizeof(T)), reg = V_REGS / (4 * RMS_SPAN_OUTS(kind, hasdg));
    size_t b = mem < reg ? mem : reg;
    return b < 1 ? 1 : b > RMS_SPAN_BMAX ? RMS_SPAN_BMAX : b;
}

/* The t elements at offset i of a span: prefetched, computed into v and stored in mode nt. */
RMS_INLINE void FN(span_vec)(const FN(span_rows) *s, size_t i, size_t t, const T *pa,
                             const T *pb, int pm, const int kind, const int hasw,
                             const int before, const int hasdg, const int nt, V *v) {
    FN(span_pf)(s, pa, pb, i, pm, kind);
    FN(span_val)(s, i, t, kind, hasw, before, hasdg, v);
    FN(span_put)(s, i, t, kind, hasdg, nt, v);
}

/* Elements [i, e) of a span, a vector at a time up to a partial last one (none when `full`),
 * stored in mode nt (see put), prefetching as FN(span) does. */
RMS_INLINE void FN(span_plain)(const FN(span_rows) *s, size_t i, size_t e, const T *pa,
                               const T *pb, int pm, const int kind, const int hasw,
                               const int before, const int hasdg, const int nt, const int full) {
    for (; i < e; i += W) {
        V v[3];
        FN(span_vec)(s, i, full || e - i >= W ? W : e - i, pa, pb, pm, kind, hasw, before, hasdg,
                     nt, v);
    }
}

/* Whether the partial lines of a streamed output row o of n elements (and of the row os after
 * it, for a pair; else os is 0) take non-temporal pieces (see FN(span)): 32- and 64-bit rows
 * always; 16-bit rows when their ends fall on 4 bytes, where every piece fits. */
static inline int FN(edge_nt)(const T *o, ptrdiff_t os, size_t n) {
    return sizeof(T) >= 4 || ((uintptr_t)o | (uintptr_t)os * sizeof(T) | n * sizeof(T)) % 4 == 0;
}

/* FN(span_plain) of a 16-bit row's partial line in non-temporal pieces, out of line: inlined
 * beside the plain stores' loop, it changed the code of the row loops around it, and page-aligned
 * rows, which store no partial line, ran slower (bfloat16 forward 262144x256, one thread, 1.03
 * to 1.08 of the time). */
__attribute__((noinline)) static void FN(span_edge_nt)(const FN(span_rows) *s, size_t i,
                                                       size_t e, const T *pa, const T *pb, int pm,
                                                       const int kind, const int hasw,
                                                       const int before, const int hasdg) {
    for (; i < e; i += W) { /* v zeroed: kind may not be a constant here */
        V v[3] = {V_SET((C)0), V_SET((C)0), V_SET((C)0)};
        FN(span_vec)(s, i, e - i >= W ? W : e - i, pa, pb, pm, kind, hasw, before, hasdg,
                     RMS_EDGE_NT, v);
    }
}

/* The partial line [i, e) of a streamed span of n elements: in non-temporal pieces where
 * `pieces` (a constant) and FN(edge_nt) allow, else plainly. */
RMS_INLINE void FN(span_edge)(const FN(span_rows) *s, size_t i, size_t e, size_t n, const T *pa,
                              const T *pb, int pm, const int kind, const int hasw,
                              const int before, const int hasdg, const int pieces) {
    if (sizeof(T) >= 4 || !pieces)
        FN(span_plain)(s, i, e, pa, pb, pm, kind, hasw, before, hasdg,
                       pieces ? RMS_EDGE_NT : RMS_EDGE, 0);
    else if (FN(edge_nt)(s->o, kind == RMS_S_PAIR ? s->os : 0, n))
        FN(span_edge_nt)(s, i, e, pa, pb, pm, kind, hasw, before, hasdg);
    else
        FN(span_plain)(s, i, e, pa, pb, pm, kind, hasw, before, hasdg, RMS_EDGE, 0);
}

/* A span of n elements, prefetching the rows pa and pb in mode pm. When streamed (nt), the first
 * `head` elements precede the first whole cache line, and only whole lines take vector streaming
 * stores: the partial lines at either end take non-temporal pieces where they start and end on
 * 4 bytes (RMS_EDGE_NT, FN(edge_nt): every 32- and 64-bit row, 16-bit rows on 4 bytes), so that
 * the line a row shares with the next takes only streaming stores, and plain stores otherwise
 * (16-bit rows that start or end on 2 bytes), and in the loops compiled for a constant row
 * length (see streamable in driver.c). A
 * line written by both kinds of store cost up to a hundred times a copy of it (bfloat16 forward
 * 1M x 64, one thread, output rows starting 48 bytes into a line: 68-73 -> 3.1-3.3 of a copy
 * with plain partial lines; 65536x1024 4.2-4.9 -> 1.3-1.4). The full
 * vectors go in blocks (span_block), each computed before the block behind it is stored: a
 * load that follows a store to an address 4 KiB apart in its low 12 bits waits for that store,
 * so when the output lies up to about 128 bytes past the input modulo 4 KiB, as it does for
 * np.empty_like(x), storing each vector before loading the next made every load wait on a
 * streaming store (AMD EPYC Zen 4, one thread, ratio to a copy, output 16 to 112 bytes past the
 * input: bfloat16 forward 16384x4096 2.0-3.1 -> 1.1-1.4, float32 65536x1024 1.3-1.6 -> 1.1).
 * Blocks of vectors of 16 bytes or less (AVX2's 16-bit rows, NEON, scalar) prefetch once per 64
 * bytes of each input rather than per vector (blocks hold a power of two of vectors of a power of
 * two of bytes, so the prefetches step 64 bytes), where AVX2 prefetched each line of a 16-bit row
 * four times: on an AMD EPYC Zen 3, one thread, the two builds alternating in one process, new
 * time over old, bfloat16 forward 8192x4096 0.94-0.96 (two threads 0.94), 64x4096 0.94-0.97,
 * backward 0.93-0.98, add 1.02; float16 forward 8192x4096 0.91. Vectors of 32 bytes or more keep
 * one per vector: once per 64 bytes, the AVX2 float32 forward of 8192x4096 took 1.11 of the time
 * there (64x4096 0.98), though its unchanged code measured 1.05 between the same two builds.
 * The block loop holds one copy of the block's arithmetic rather than a first block peeled off
 * before it: spans are inlined once per dtype x ISA x option set, and the peeled copy made the
 * AVX2 and AVX-512 kernels 8% larger (and their build as much slower). */
RMS_INLINE void FN(span)(const FN(span_rows) *s, size_t n, size_t head, const T *pa,
                         const T *pb, int pm, const int kind, const int hasw, const int before,
                         const int hasdg, const int nt) {
    const size_t nb = FN(span_block)(kind, hasdg);
    V v[RMS_SPAN_BMAX][3], u[RMS_SPAN_BMAX][3];
    size_t i = 0, end = n;
    /* the partial lines: in pieces (FN(edge_nt)), except in the loops compiled for a constant
     * row length (RMS_KSW), where their code slowed the rows that store none */
    const int pieces = RMS_NT_EDGES && !__builtin_constant_p(n);
    if (nt) { /* only whole lines are streamed */
        if (head)
            FN(span_edge)(s, 0, head, n, pa, pb, pm, kind, hasw, before, hasdg, pieces);
        i = head;
        end = FN(stream_end)(head, n);
    }
    const size_t first = i;
    /* v is stored only once computed; zeroed for the compiler */
    for (size_t q = 0; q < nb; q++)
        for (int o = 0; o < RMS_SPAN_OUTS(kind, hasdg); o++)
            v[q][o] = V_SET((C)0);
    for (; i + nb * W <= end; i += nb * W) {
        for (size_t q = 0; q < nb; q++) {
            if (W * sizeof(T) > 16 || (q * W * sizeof(T)) % RMS_LINE == 0)
                FN(span_pf)(s, pa, pb, i + q * W, pm, kind);
            FN(span_val)(s, i + q * W, W, kind, hasw, before, hasdg, u[q]);
        }
        if (i != first)
            FN(span_block_put)(s, i - nb * W, nb, kind, hasdg, nt, v);
        for (size_t q = 0; q < nb; q++)
            for (int o = 0; o < RMS_SPAN_OUTS(kind, hasdg); o++)
                v[q][o] = u[q][o];
    }
    if (i != first)
        FN(span_block_put)(s, i - nb * W, nb, kind, hasdg, nt, v);
    /* fewer than nb full vectors (whole lines when streamed), then the partial ones */
    FN(span_plain)(s, i, end, pa, pb, pm, kind, hasw, before, hasdg, nt, nt);
    if (nt && end < n)
        FN(span_edge)(s, end, n, n, pa, pb, pm, kind, hasw, before, hasdg, pieces);
}

/* ---------------------------------------------------------------- forward */

RMS_INLINE void FN(scale_span)(const T *x, T *y, const void *w, V vr, size_t n, size_t head,
                               const T *pf, int pm, const int hasw, const int before,
                               const int nt) {
    FN(span_rows) s = {x, NULL, y, NULL, NULL, w, 0, 0, 0, vr, vr, vr, vr};
    FN(span)(&s, n, head, pf, NULL, pm, RMS_S_FWD, hasw, before, 0, nt);
}

/* The RMS_O_* bits of a forward or add loop: weight (and its type), cast before it, and
 * streaming (nt). */
static inline int FN(opts)(const void *w, int flags, int nt) {
    int ws = w && (flags & RMS_W_STORAGE) ? RMS_O_WS : 0;
    return (w ? RMS_O_W : 0) | ws | ((flags & RMS_CAST_BEFORE) ? RMS_O_BEFORE : 0) |
           (nt && RMS_NT_ON ? RMS_O_NT : 0);
}

/* One row piece with a given rstd (a row split across threads), fenced when streamed. */
static void FN(scale)(const void *x, void *y, const void *w, double r, size_t n, int flags) {
    size_t head;
    int opt = FN(opts)(w, flags, FN(plan_stream)((T *)y, NULL, n, flags, &head));
#define RMS_X(hw, bf, nt)                                                                          \
    FN(scale_span)((const T *)x, (T *)y, w, V_SET((C)r), n, head, NULL, RMS_PF_L2, hw, bf, nt)
    RMS_SWITCH3(opt, flags, RMS_X);
#undef RMS_X
}

/* Rows per group: short 16-bit rows are summed a group at a time so that the latency of each
 * row's reduction, square root and division overlaps the others; the group stays in L1 for the
 * second read. 32- and 64-bit rows go one at a time (but see FN(fwd_group)): there the loop
 * specialised for a single row measured faster, in cache and from memory alike (1M x 64 float32,
 * one thread: 1.6x a copy in groups of 8, 1.1x one row at a time; 1M x 64 bfloat16: 1.7x in
 * groups, 2.0x one at a time). */
#define RMS_GROUP (sizeof(T) >= 4 ? 1 : RMS_GROUP_MAX)
static inline size_t FN(group)(size_t k) {
    size_t g = (16 * 1024) / (k * sizeof(T) + 1);
    return g < 1 ? 1 : g > RMS_GROUP ? RMS_GROUP : g;
}

/* The forward's group: FN(group), except that streamed float32 rows of up to 256 bytes go in
 * groups of RMS_GROUP_MAX too, pipelined and with their rstd through V_RSTD8. A row that short
 * is limited by the latency of its own reduction, square root and division, which a single row
 * leaves exposed (in cache, 1024 rows of 64: 12.7 ns a row). AMD EPYC (Zen 4), one thread, two
 * builds alternating in one process, ratio to a copy, into a page-aligned out=: 2M x 32
 * 2.04-2.09 -> 1.63-1.67; 1M x 64 AVX2 1.38-1.39 -> 1.25-1.28, AVX-512 the same within noise
 * (1.29-1.41 -> 1.31-1.38, new slower in 4 runs of 6, by up to 0.04). With
 * plain stores the groups measured slower from L3 and from memory (65536x64 0.95-1.02 ->
 * 1.36-1.46; 1M x 64 into np.empty_like, whose rows do not start on a line, 1.50-1.57 ->
 * 1.67-1.83), so those rows stay one at a time. */
static inline size_t FN(fwd_group)(size_t k, const int nt) {
    return nt && sizeof(T) == 4 && k * sizeof(T) <= 256 ? RMS_GROUP_MAX : FN(group)(k);
}

/* How many rows ahead the second pass prefetches (at least a group), so that memory stays busy
 * while the first pass of the rows between runs from cache; 0 for none. With RMS_HW_PREFETCH (the
 * driver sets it on CPUs where it measured faster, see rms_cpu_hw_prefetch), 32- and 64-bit rows
 * of up to 8 KiB (4 KiB in the backward and the add) get no software prefetch: the rows follow
 * each other, the hardware's stream prefetcher sees one stream and runs further ahead than the
 * software prefetch, which there only competes with it. AMD EPYC (Zen 4), one thread, ratio to a
 * copy (a triad), prefetched -> not: float32 forward 1M x 64 1.67-1.95 -> 0.90-0.93, 65536x1024
 * 1.17-1.34 -> 0.90-0.97, 32768x2048 1.29-1.35 -> 1.07-1.10; float32 backward (rows paired) 1M x
 * 64 1.46 -> 1.02, 262144x256 1.34 -> 1.09; float64 forward 524288x64 1.55 -> 0.99. Longer rows
 * measured slower without (float32 forward 16384x4096 1.36 -> 1.41-1.63, backward 32768x2048 1.69
 * -> 1.80), and so did most 16-bit rows, whose second pass does more arithmetic (bfloat16 forward
 * 16384x4096 1.07 -> 2.03). The add reads two rows, and its rows of 8 KiB measured faster with the
 * software prefetch (float32, one thread, ratio to the prefetching copies, two builds alternating:
 * 8192x2048 1.66-1.67 -> 1.53-1.60, 16384x2048 1.85 -> 1.71). The backward's 32- and 64-bit
 * rows reach 32 KiB ahead rather than 64 where the driver asks (RMS_BWD_AHEAD_32: see
 * rms_cpu_bwd_ahead_32 in dispatch.h), so that rows of 12 to 16 KiB in pairs prefetch the next
 * pair's first row and leave its second to the hardware, and single rows prefetch the next. */
/* Whether the backward's rows that FN(near) prefetches into L1 reach 8 KiB ahead rather than 16,
 * that is the next row: its 32- and 64-bit rows of over 4 KiB and up to 8 KiB with
 * RMS_HW_PREFETCH (AMD EPYC Zen 4), where the row, the weight, the dgamma row and the two rows
 * after the next overflowed the 32 KiB L1. The two alternating in one process, each order, inputs
 * 256 MiB + 16 KiB apart, new time over old, one thread: float32 43690x1536 0.88 and 0.90,
 * 52428x1280 0.91 and 0.90; inputs 256 MiB + 4 KiB apart: float32 43690x1536 0.92 and 0.93,
 * 52428x1280 0.89 and 0.91, 37449x1792 0.88 and 0.87, float64 43690x768 0.93; two threads, float32
 * 43690x1536 0.95. Rows of 8 KiB already reach only the next row. */
static inline int FN(bwd_near8)(const int pass, int flags) {
    return pass == RMS_P_BWD && sizeof(T) >= 4 && (flags & RMS_HW_PREFETCH);
}

static inline size_t FN(ahead)(size_t g, size_t k, const int pass, int flags) {
    if ((flags & RMS_HW_PREFETCH) && sizeof(T) >= 4 &&
        k * sizeof(T) <= (pass == RMS_P_FWD ? 8192u : 4096u) && !FN(fwd_near)(k, pass, flags))
        return 0;
    size_t bytes = k * sizeof(T) * (pass == RMS_P_FWD ? 1 : 2);
    const int near = FN(near)(k, pass, flags);
    size_t reach = near && FN(bwd_near8)(pass, flags)                                  ? 8 * 1024
                   : near                                                              ? 16 * 1024
                   : pass == RMS_P_BWD && sizeof(T) >= 4 && (flags & RMS_BWD_AHEAD_32) ? 32 * 1024
                                                                                   : 64 * 1024;
    size_t d = (reach + bytes - 1) / (bytes ? bytes : 1);
    return d < g ? g : d;
}

/* Whether the forward's first pass prefetches into L2 as it reads, RMS_PF1_AHEAD bytes ahead on
 * every second line (RMS_KPF): 32- and 64-bit rows of over 4 KiB and up to 8 KiB that prefetch
 * no row ahead (d == 0: RMS_HW_PREFETCH, FN(ahead)), whose second pass then leaves memory to the
 * CPU's own prefetcher. AMD EPYC (Zen 4), two builds alternating in one process, page-aligned,
 * the same bits, new time over old at one thread: float32 32768x2048 0.93-0.96 (0.95-1.00 at
 * two), 8192x2048 0.94-0.96, float64 16384x1024 0.95; rows of 6 KiB the same within 0.02
 * (float32 16384x1536, 43690x1536; float64 16384x768 0.95). 2 KiB ahead measured slower (1.03 to
 * 1.11), every line about the same (0.93 to 0.97). Left out: the float32 backward's first pass
 * prefetching both its rows, rows of 512 bytes to 4 KiB (0.93 to 1.03), and the add's first pass
 * (0.97 to 1.01). Vector kernels only: a quad of the scalar ones covers 16 or 32 bytes, and each
 * would prefetch the same line again. */
static inline int FN(fwd_pf1)(size_t k, size_t d, int flags) {
    return sizeof(T) >= 4 && 4 * W * sizeof(T) >= RMS_PF1_STEP && !d &&
           (flags & RMS_HW_PREFETCH) && k * sizeof(T) > 4096 && k * sizeof(T) <= 8192;
}

/* The forward's prefetch row for row i: FN(row_ahead), or with RMS_FWD_AHEAD_32, for contiguous
 * 32- and 64-bit rows over 32 KiB, the k elements 32 KiB ahead of row i: the rest of row i, which
 * its first pass read into L2, and the start of the next (none for the last row). 16-bit rows
 * keep a row: 32 KiB ahead lost where x fits in the L3 (bfloat16 256x65536 and 512x32768, float16
 * 256x65536, one thread, 1.05 to 1.22 of the time on Zen 5) and measured 0.89 to 1.04 where it
 * does not. */
RMS_INLINE const T *FN(fwd_ahead)(const T *x, ptrdiff_t xs, size_t i, size_t d, size_t m,
                                  size_t k, int flags) {
    const size_t e = 32768 / sizeof(T);
    if (!(flags & RMS_FWD_AHEAD_32) || sizeof(T) < 4 || k <= e || xs != (ptrdiff_t)k || !d)
        return FN(row_ahead)(x, xs, i, d, m, flags);
    return i * k + e <= (m - 1) * k || (flags & RMS_PF_PAST) ? x + i * k + e : NULL;
}

/* The row loops switch their options into constants once per call (RMS_SWITCH3), and inline
 * both passes of every row, so that the fixed cost of a short row stays small. A row of a
 * streamed loop that plan_stream cannot stream (an output not aligned to its elements) is
 * stored normally, out of line (FN(scale)). */
RMS_INLINE void FN(fwd_row)(const T *x, ptrdiff_t xs, T *y, ptrdiff_t ys, const void *w,
                            const C *rstd, size_t i, size_t m, size_t k, size_t d, int pm,
                            int flags, const int hasw, const int before, const int nt) {
    const T *xr = x + (ptrdiff_t)i * xs;
    const T *pf = FN(fwd_ahead)(x, xs, i, d, m, k, flags);
    T *yr = y + (ptrdiff_t)i * ys;
    size_t head = 0;
    if (!nt || FN(plan_stream)(yr, NULL, k, RMS_STREAM, &head))
        FN(scale_span)(xr, yr, w, V_SET(rstd[i]), k, head, pf, pm, hasw, before, nt);
    else
        FN(scale)(xr, yr, w, rstd[i], k, flags & ~RMS_STREAM);
}

/* Streamed rows of RMS_FUSE_BYTES or more (512; 1 KiB in the 32- and 64-bit backward and add),
 * whose sums take blocks of at most 1 KiB (AVX2; with AVX-512, whose 32- and 64-bit blocks are
 * 2 KiB, some row lengths only: see FN(fused)), are fused across rows, in the forward
 * (FN(fwd_fused)), the backward (FN(bwd_fused)) and the add (FN(add_fused)): each block of the
 * next row's sum (reduce_blk) is followed by as many elements of this row's second pass, so that
 * memory sees the streams of reads beside the stream of writes, as a copy or a triad does, rather
 * than a row of reads and then a row of writes. A fused loop prefetches the row after next
 * (FN(fused_ahead)). AMD EPYC (Zen 3), two builds alternating in one process, page-aligned
 * outputs, the same bits, new time over old at one / two threads. The forward
 * fused, against one row at a time:
 *   float32 8192x8192 0.87-0.92 / 0.90-0.96, 4096x12288 0.88-0.91 / 0.89-0.93, 1024x32768 0.88 /
 *     0.93, 256x65536 0.96 / 0.95, 16384x4096 0.93-0.97 / 0.93-1.01, 32768x2048 0.96-0.97 /
 *     0.98-0.99; float64 8192x4096 0.96 / 0.99, 16384x2048 0.94 / 0.96;
 *   bfloat16 8192x8192 0.95 / 0.94, 16384x4096 0.95 / 1.00, 65536x1024 0.91 / 0.92, 262144x256
 *     0.95 / 0.96; float16 8192x8192 0.79 / 0.92, 65536x1024 0.73 / 0.84, 262144x256 0.92 / 0.99.
 * Then the backward fused, the 32- and 64-bit rows of 1 to 8 KiB, and the prefetch, against the
 * forward alone fused from 8 KiB (2048 float32) with no prefetch:
 *   forward float32 65536x1024 0.91 / 0.92, 262144x256 0.74 / 0.76, 8192x8192 0.96-0.97 /
 *     0.94-0.97, 16384x4096 0.95 / 0.94; float64 262144x128 0.81 / 0.87; float16 8192x8192 0.91
 *     / 0.89, 16384x4096 0.93 / 0.92; bfloat16 0.96 to 1.02;
 *   backward float32 8192x8192 0.92 / 0.88-0.90, 16384x4096 0.96-0.97 / 0.85-0.91, 65536x1024
 *     0.93-0.95 / 0.80-0.93, 262144x256 0.86-0.89 / 0.83-0.96, 1024x32768 1.04-1.09 / 0.89-1.00;
 *     float64 16384x2048 0.90-0.91 / 0.84-0.90; bfloat16 8192x8192 0.96-0.97 / 0.92-0.94,
 *     65536x1024 0.91-0.92 / 0.81-0.83, 262144x256 0.76-0.78 / 0.70-0.73; float16 8192x8192
 *     0.93-0.94 / 0.88, 262144x256 0.78-0.79 / 0.65-0.73.
 * Without the prefetch, the fused backward measured slower than one row at a time (float32,
 * 4096x12288 1.10-1.12 / 1.05, 8192x8192 0.99-1.01 / 1.00-1.01): the CPU then fetches the next
 * row only as its sum reaches it. Shorter rows, fused, against one at a time: float32 rows of
 * 512 bytes, forward 0.87-0.92 / 0.90-0.99 (524288x128; float64 524288x64 0.89-0.95 /
 * 0.99-1.02), backward 1.10 / 1.06; of 256 bytes (1048576x64) forward 1.03 / 0.98, backward
 * 1.16 / 1.12; 16-bit rows of 256 bytes (bfloat16 524288x128) 1.00 both ways.
 * The fused backward, add and shorter rows with the prefetch, on a 16-core Intel Xeon running
 * these kernels, against the forward alone fused, float32 at 1 / 4 / 16 threads: forward
 * 16384x8192 0.93 / 0.91 / 0.92, 262144x512 0.81 / 0.94 / 0.97; backward 16384x8192 0.93 / 0.92 /
 * 0.97, 262144x512 0.90 / 1.02 / 1.00; add 16384x8192 0.97 / 0.98 / 1.01, 262144x512 0.99 / 0.99
 * / 1.03.
 * 16-bit rows are fused where the driver asks (RMS_FUSE_16, rms_cpu_fuse_16): on AMD CPUs, and
 * on other x86 CPUs in the backward only (fuse_bwd_16 in dispatch.c). A 16-core Intel
 * Xeon running these kernels measured the forward slower (1 / 4 / 16 threads, 32768x8192: bfloat16
 * 1.16-1.32 / 1.18-1.27 / 1.15-1.18, float16 1.11-1.26 / 1.06-1.14 / 1.07-1.27; steps of 1 KiB
 * rather than 512 bytes did not help), its float32 not (32768x8192 0.97 / 0.99 / 0.95,
 * 131072x2048 0.91 / 0.89 / 1.03).
 * The next row's loads follow the streaming stores of this one at any distance modulo 4 KiB:
 * chunks scaled ahead of their blocks to keep 1 to 3 KiB between the two measured slower
 * (float32 rows at 1, 2 and 3 KiB modulo 4 KiB, one thread: 1.02, 1.03, 1.07 of the time with
 * none). The 32- and 64-bit add is fused too (FN(add_fused); 16-bit rows take their stage),
 * from 1 KiB: with no prefetch it measured slower at one thread (float32 16384x4096 1.10,
 * 32768x2048 1.18, 4096x12288 1.03) and the same or slower at two (0.99 to 1.08); with it, against
 * one row at a time: float32 8192x8192 0.89 / 0.96, 16384x4096 0.85 / 0.95, 4096x12288 0.83-0.90 /
 * 0.93-0.96, 65536x1024 0.86-0.87 / 0.93-0.95, 262144x256 0.78-0.86 / 0.90-0.94; float64 8192x4096
 * 0.88-0.93 / 0.95-0.98, 65536x512 0.91-0.95 / 0.91-0.94 (bfloat16, staged, 1.00). */
#define RMS_FUSE_BYTES(pass) (sizeof(T) >= 4 && (pass) != RMS_P_FWD ? 1024 : 512)
/* Fused float32 backward rows of RMS_BWD_LONG bytes or more prefetch nothing (FN(fused_ahead)): a
 * row ahead of such rows, with the row being summed, the row in its second pass and the dgamma
 * row, overflows an L2 of 2 MiB, and the CPU's own prefetcher follows the sum's one stream. The
 * AVX-512 kernels fuse those rows up to 256 KiB (RMS_BWD_LONG_MAX). On the 2-core Xeon, two builds
 * alternating in one process, new time over old at one / two threads, the same bits: AVX-512 (one
 * row, or a pair, at a time before) 256x65536 0.65-0.71 / 0.88-1.01, 1024x32768 0.90-0.92 /
 * 0.93-0.97; AVX2 (fused, prefetching the row after next, before) 256x65536 0.77-0.82 / 0.76-0.82,
 * 1024x32768 0.91-0.95 / 0.91-1.01, 128x131072 0.87 / 0.88. AVX-512 rows of 32 to 64 KiB fused
 * this way measured the same (8192x8192 1.00 / 1.00, 2048x16384 0.96 / 1.00), rows of 512 KiB
 * slower (128x131072 1.07 / 1.08), and with the prefetch, rows of 128 KiB slower (1024x32768 1.28
 * / 1.30); float64 rows slower (AVX-512, 512x16384 0.97 / 1.12, 128x65536 1.06 / 1.09). */
#define RMS_BWD_LONG 131072u
#define RMS_BWD_LONG_MAX 262144u
#define RMS_BWD_LONG_ROW(pass, rb) ((pass) == RMS_P_BWD && sizeof(T) == 4 && (rb) >= RMS_BWD_LONG)
/* The AVX-512 32- and 64-bit sums take blocks of 2 KiB, and are fused in the forward of rows of 4
 * to 32 KiB, the add of rows of 4 to 8 KiB and the float32 backward of rows of 128 to 256 KiB
 * (RMS_BWD_LONG) only. On a 2-core Intel Xeon (AVX512-BF16 and -FP16, 2 MiB of L2 a core), against
 * one row at a time at one / two threads, float32 forward 65536x1024 0.86-0.88 / 0.85-0.87,
 * 32768x2048 0.84 / 0.84, 16384x4096 0.89 / 0.89, but 8192x8192 1.01 / 1.01, 4096x12288 1.02 /
 * 1.02, 131072x512 1.01-1.04 / 0.97-1.05; add 65536x1024 0.94 / 0.92, 32768x2048 1.00 / 0.96,
 * 16384x4096 1.02 / 1.01, 8192x8192 1.04-1.05 / 1.02-1.03; backward 65536x1024 1.11-1.16 /
 * 1.01-1.09, 16384x4096 1.04 / 1.04, 8192x8192 0.98 / 0.98. On the 16-core Xeon at 1 / 4 / 16
 * threads: forward 131072x1024 0.93 / 0.90 / 0.95, 65536x2048 0.98 / 1.00 / 0.96, 32768x4096 1.01
 * / 1.03 / 1.01; add 131072x1024 0.98 / 1.02 / 0.99, 65536x2048 1.00-1.06 / 1.05-1.06 / 0.99-1.02,
 * float64 65536x1024 1.09 / 1.04 / 0.99. */
static inline int FN(fused)(size_t m, size_t k, int flags, const int nt, const int pass) {
    const size_t rb = k * sizeof(T);
    return nt && (sizeof(T) >= 4 ? !(flags & RMS_NO_FUSE_32) : (flags & RMS_FUSE_16)) && m > 1 &&
           rb >= RMS_FUSE_BYTES(pass) &&
           (RMS_BLOCK * W * sizeof(T) <= 1024 ||
            (RMS_BWD_LONG_ROW(pass, rb) && rb <= RMS_BWD_LONG_MAX) ||
            (pass != RMS_P_BWD && rb >= 4096 && rb < (pass == RMS_P_FWD ? 32768u : 8192u)));
}

/* How many rows ahead of the row in its second pass a fused loop prefetches: FN(ahead)'s distance
 * counted from the next row (which is being summed), or 0 where that is 0. Long float32 backward
 * rows take none (RMS_BWD_LONG), nor do forward rows of 64 KiB or more (float32 1024x32768
 * 1.05-1.12 / 1.03-1.09 with it, float64 4096x8192 1.04 / 1.01), nor do 16-bit forward rows under
 * 4 KiB: bfloat16, bound by its arithmetic with AVX2, measured slower with it (262144x256
 * 1.06-1.07, 131072x512 1.03 at one and two threads). An ISA file may set the 16-bit rows that
 * prefetch otherwise (V_PF_FUSED_16: from that many bytes, however long). */
#ifdef V_PF_FUSED_16
#define RMS_PF16_LO ((size_t)V_PF_FUSED_16)
#define RMS_PF16_HI SIZE_MAX
#else
#define RMS_PF16_LO ((size_t)4096)
#define RMS_PF16_HI ((size_t)65536)
#endif
static inline size_t FN(fused_ahead)(size_t k, const int pass, int flags) {
    size_t d = FN(ahead)(1, k, pass, flags), rb = k * sizeof(T);
    const int none = sizeof(T) == 2 ? rb < RMS_PF16_LO || rb >= RMS_PF16_HI : rb >= 65536;
    if (pass == RMS_P_FWD && none)
        return 0;
    if (RMS_BWD_LONG_ROW(pass, rb))
        return 0;
    return d ? d + 1 : 0;
}

/* Elements [c, c + n) of row x's second pass into y, streamed: c is 0 with n its head (see
 * FN(span)), or c starts a cache line of y. */
RMS_INLINE void FN(fwd_chunk)(const T *x, T *y, const void *w, V vr, size_t c, size_t n,
                              size_t head, const T *pf, const int hasw, const int before) {
    FN(scale_span)(x + c, y + c, hasw ? W_AT(w, c, hasw) : NULL, vr, n, head, pf ? pf + c : NULL,
                   RMS_PF_L2, hasw, before, 1);
}

/* The body of a fused loop's row: CHUNK(0, head, head), then each block of the next row's sum
 * FN(reduce_blk)(a, b, wr, s, k, kind) followed by CHUNK(c, n, 0), the next RMS_BLOCK * W (or
 * fewer, at the end) elements of this row's second pass from c = head; the sum is left in sa. */
#define RMS_FUSE_PASS(sa, a, b, wr, s, k, kind, head, CHUNK)                                      \
    do {                                                                                           \
        const size_t B_ = RMS_BLOCK * W;                                                           \
        size_t c_ = (head), ir_ = 0;                                                               \
        A l_ = A_ZERO, h_ = A_ZERO;                                                                \
        CHUNK(0, c_, c_);                                                                          \
        for (int first_ = 1; ir_ + 4 * W <= (k) || c_ < (k); first_ = 0, c_ += B_) {               \
            if (ir_ + 4 * W <= (k))                                                                \
                FN(reduce_blk)(a, b, wr, NULL, s, k, kind, &ir_, &l_, &h_, first_);                \
            if (c_ < (k))                                                                          \
                CHUNK(c_, (k) - c_ < B_ ? (k) - c_ : B_, 0);                                       \
        }                                                                                          \
        sa = FN(reduce_end)(a, b, wr, NULL, s, k, kind, ir_, l_, h_);                              \
    } while (0)

/* The forward of FN(fused) rows: each block of row i + 1's sum, then as many elements of row i's
 * second pass. The last row, and a row whose y cannot stream, take their two passes in turn.
 * Every sum keeps its order, so the bits are those of FN(fwd_loop). */
RMS_INLINE void FN(fwd_fused)(const T *x, ptrdiff_t xs, T *y, ptrdiff_t ys, const void *w,
                              C *rstd, size_t m, size_t k, double eps, int flags, const int hasw,
                              const int before, const size_t d) {
    const double inv_k = rms_inv_pow2(k);
    const V one = V_SET((C)1);
    A sa = FN(reduce_a)(x, NULL, NULL, NULL, (C)1, k, RMS_SQ);
    FN(rstds)(&sa, rstd, 1, x, xs, NULL, 0, k, eps, inv_k);
    for (size_t i = 0; i < m; i++) {
        const T *xr = x + (ptrdiff_t)i * xs, *xn = i + 1 < m ? xr + xs : NULL;
        T *yr = y + (ptrdiff_t)i * ys;
        size_t head;
        if (!xn || !FN(plan_stream)(yr, NULL, k, RMS_STREAM, &head)) {
            if (xn)
                sa = FN(reduce_a)(xn, NULL, NULL, NULL, (C)1, k, RMS_SQ);
            FN(fwd_row)(x, xs, y, ys, w, rstd, i, m, k, 0, RMS_PF_L2, flags, hasw, before, 1);
        } else {
            const V vr = V_SET(rstd[i]);
            const T *pf = FN(row_ahead)(x, xs, i, d, m, flags);
#define RMS_CHUNK(c, n, hd) FN(fwd_chunk)(xr, yr, w, vr, c, n, hd, pf, hasw, before)
            RMS_FUSE_PASS(sa, xn, NULL, NULL, one, k, RMS_SQ, head, RMS_CHUNK);
#undef RMS_CHUNK
        }
        if (xn)
            FN(rstds)(&sa, rstd + i + 1, 1, xn, xs, NULL, 0, k, eps, inv_k);
    }
}

/* Short rows (under RMS_PIPE_BYTES) are pipelined by group: while a group is scaled, row by
 * row, the next group's sums of squares are taken between its rows, so that each row's chain of
 * reduction, square root and division runs beside independent work (1M x 64 bfloat16, one
 * thread: 1.70 -> 1.50 of a copy). Longer rows measured slightly slower that way and take each
 * group's sums first. The order of every sum is the same either way. */
#define RMS_PIPE_BYTES 1024
RMS_INLINE void FN(fwd_loop)(const T *x, ptrdiff_t xs, T *y, ptrdiff_t ys, const void *w, C *rstd,
                             size_t m, size_t k, double eps, int flags, const int hasw,
                             const int before, const int nt) {
    size_t g = FN(fwd_group)(k, nt), d = FN(ahead)(g, k, RMS_P_FWD, flags), n = 0;
    const double inv_k = rms_inv_pow2(k);
    const int pipe = k * sizeof(T) < RMS_PIPE_BYTES, pm = FN(pf_mode)(k, RMS_P_FWD, flags);
    const int pf1 = FN(fwd_pf1)(k, d, flags);
    A sa[RMS_GROUP_MAX];
    for (size_t i = 0; i < m; i += g) {
        if (!pipe || i == 0) {
            n = rms_group_rows(i, m, g);
            for (size_t j = 0; j < n; j++)
                sa[j] = pf1 ? FN(reduce_a)(x + (ptrdiff_t)(i + j) * xs, NULL, NULL, NULL, (C)1, k,
                                           RMS_SQ | RMS_KPF)
                            : FN(reduce_a)(x + (ptrdiff_t)(i + j) * xs, NULL, NULL, NULL, (C)1, k,
                                           RMS_SQ);
        }
        FN(rstds)(sa, rstd + i, n, x + (ptrdiff_t)i * xs, xs, NULL, 0, k, eps, inv_k);
        size_t next = i + g, n2 = pipe ? rms_group_rows(next, m, g) : 0;
        for (size_t j = 0; j < n; j++) {
            if (j < n2)
                sa[j] = FN(reduce_a)(x + (ptrdiff_t)(next + j) * xs, NULL, NULL, NULL, (C)1, k,
                                     RMS_SQ);
            FN(fwd_row)(x, xs, y, ys, w, rstd, i + j, m, k, d, pm, flags, hasw, before, nt);
        }
        n = n2;
    }
}

/* FN(fwd_fused) of each option (RMS_VARIANTS3), apart from the row loops (inlined into them, it
 * changed their code: the bfloat16 forward of rows of 64 took 42.5 rather than 40 TSC ticks a row
 * in cache on the Zen 3 VM). Rows that prefetch nothing (d == 0) take a copy with no prefetch
 * code at all: the test of a NULL prefetch row in every vector's loop made the bfloat16 and
 * float16 rows that prefetch nothing 5 to 16% slower (65536x1024, 262144x256). */
#define RMS_X(o, hw, bf, nt)                                                                       \
    RMS_VARIANT RMS_VFN(fwd_fused_v, o)(const void *x, ptrdiff_t xs, void *y, ptrdiff_t ys,       \
                                        const void *w, void *rstd, size_t m, size_t k, double eps, \
                                        int flags, size_t d) {                                     \
        if (!(nt)) /* never: fused rows stream */                                                  \
            return;                                                                                \
        if (d)                                                                                     \
            FN(fwd_fused)((const T *)x, xs, (T *)y, ys, w, (C *)rstd, m, k, eps, flags, hw, bf,    \
                          d);                                                                      \
        else                                                                                       \
            FN(fwd_fused)((const T *)x, xs, (T *)y, ys, w, (C *)rstd, m, k, eps, flags, hw, bf,    \
                          0);                                                                      \
    }
RMS_VARIANTS3(RMS_X)
#undef RMS_X

/* Out of line, as it was while it held the loops themselves: inlined into fwd_rows, the switch
 * changed the row loops' code there. */
static __attribute__((noinline)) void FN(fwd_fused_rows)(const void *x, ptrdiff_t xs, void *y,
                                                         ptrdiff_t ys, const void *w, void *rstd,
                                                         size_t m, size_t k, double eps,
                                                         int flags) {
    size_t d = FN(fused_ahead)(k, RMS_P_FWD, flags);
#define RMS_X(o) RMS_VFN(fwd_fused_v, o)(x, xs, y, ys, w, rstd, m, k, eps, flags, d)
    RMS_VSWITCH3(FN(opts)(w, flags, 1), flags, RMS_X);
#undef RMS_X
}

/* Rows of the constant lengths with no weight or one cast at the end, through the general loop
 * (RMS_ANY_K: see the driver), in a function of their own: a test of the flag among the
 * constant-length loops changed those loops' code, and rows on lines ran slower (float32
 * 1M x 64, 1.02-1.03 of the time). */
__attribute__((noinline)) static void FN(fwd_rows_any)(const void *x, ptrdiff_t xs, void *y,
                                                       ptrdiff_t ys, const void *w, void *rstd,
                                                       size_t m, size_t k, double eps,
                                                       int flags) {
    if (!w)
        FN(fwd_loop)((const T *)x, xs, (T *)y, ys, w, (C *)rstd, m, k, eps, flags, 0, 0,
                     RMS_NT_ON);
    else if (flags & RMS_W_STORAGE)
        FN(fwd_loop)((const T *)x, xs, (T *)y, ys, w, (C *)rstd, m, k, eps, flags, RMS_HW_S, 0,
                     RMS_NT_ON);
    else
        FN(fwd_loop)((const T *)x, xs, (T *)y, ys, w, (C *)rstd, m, k, eps, flags, 1, 0,
                     RMS_NT_ON);
    if (flags & RMS_STREAM)
        V_FENCE();
}

static void FN(fwd_rows)(const void *x, ptrdiff_t xs, void *y, ptrdiff_t ys, const void *w,
                         void *rstd, size_t m, size_t k, double eps, int flags) {
    if (FN(fused)(m, k, flags, (flags & RMS_STREAM) && RMS_NT_ON, RMS_P_FWD)) {
        FN(fwd_fused_rows)(x, xs, y, ys, w, rstd, m, k, eps, flags);
        return;
    }
    if ((flags & RMS_ANY_K) && (flags & RMS_STREAM) &&
        RMS_KSW_FWD(flags & RMS_CAST_BEFORE) && rms_ksw_k(k)) {
        FN(fwd_rows_any)(x, xs, y, ys, w, rstd, m, k, eps, flags);
        return;
    }
    int opt = FN(opts)(w, flags, flags & RMS_STREAM);
#define RMS_X(hw, bf, nt)                                                                          \
    RMS_KSW(RMS_KSW_FWD(bf), k,                                                                    \
            FN(fwd_loop)((const T *)x, xs, (T *)y, ys, w, (C *)rstd, m, KK, eps, flags, hw, bf,    \
                         nt))
    RMS_SWITCH3(opt, flags, RMS_X);
#undef RMS_X
}

#include "rows_add_bwd.h"

#undef T
#undef C
#undef S_LD
#undef S_RND
#undef FN
#undef RMS_DT
#undef RMS_SFX
#undef V_LD
#undef V_ST
#undef V_STNT
#undef V_STB
#undef V_RND
#undef V_LDP
#undef V_STP
#undef RMS_OWN_LDP
#undef V_DOT2
#undef V_ST2
#undef V_PACK2DOT
#undef V_PF_FUSED_16
#undef RMS_PF16_LO
#undef RMS_PF16_HI
#undef RMS_KIND_DOT2
#undef V_CPNT
#undef RMS_OWN_CPNT
#ifdef RMS_OWN_LDCP
#undef RMS_OWN_LDCP
#undef V_LDCP
#undef V_STCP
#endif
