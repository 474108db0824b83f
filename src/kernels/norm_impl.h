/* The kernel bodies, written once and included by each ISA file once per dtype.
 *
 * The including file defines:
 *   T, C, SFX           storage type, compute type, symbol suffix (f32_avx2 ...)
 *   W, V                lanes and vector type of the compute type
 *   V_LD(p), V_LDP(p, n)       W (or n < W, the rest zero) storage elements widened to V
 *   V_ST(p, v), V_STP(p, v, n) v rounded (nearest even) to the storage type and stored
 *   V_STNT(p, v)        the same with a non-temporal store (p aligned to W * sizeof(T))
 *   V_PK2(a, b), V_ST2R(p, u, nt)   (optional) a and b rounded to 2 * W storage elements in
 *                       one register, and such a register stored (nt: non-temporally, p aligned
 *                       to it): where two vectors of the storage type fit a register
 *   V_RND(v)            v rounded through the storage type and back
 *   V_SQ2(acc, p)       (optional) acc + the squares of the 2 * W storage elements at p, added
 *                       pairwise into W lanes (see FN(sq2_chunk))
 *   VC_LD, VC_LDP, VC_ST, VC_STP   the same for compute-type arrays (w, dg)
 *   V_SET, V_ADD, V_SUB, V_MUL, V_FMA(a, b, c) = a * b + c
 *   A, A_ZERO, A_ACC(l, h, v), A_SUM(l, h)  float64 accumulators: l, h += v widened
 *   V_FENCE()           orders the non-temporal stores before later ones
 *   RMS_NT              1 where non-temporal stores exist, RMS_PF where prefetching pays
 *   S_LD(p), S_RND(v)   one element widened, one compute value rounded through T
 *
 * Row sums: four independent compute-type accumulators (hiding the FMA latency) flushed into
 * float64 every RMS_FLUSH iterations, so that the sum is far more accurate than the result. */

#ifndef RMS_IMPL_ONCE
#define RMS_IMPL_ONCE
#include <string.h>
#define RMS_CAT3_(a, b, c) a##_##b##_##c
#define RMS_CAT3(a, b, c) RMS_CAT3_(a, b, c)
#define RMS_INLINE static inline __attribute__((always_inline))
#if defined(__clang__)
#define RMS_NOCLONE __attribute__((noinline)) /* clang makes no constant-propagated clones */
#else
#define RMS_NOCLONE __attribute__((noinline, noclone))
#endif
#define RMS_FLUSH 16 /* iterations of 4 vectors between flushes into float64 */
#ifndef RMS_RELOAD
#define RMS_RELOAD 1
#endif
#define RMS_LINE 64
#define RMS_IF(c, a, b)                                                                    \
    do {                                                                                   \
        if (c)                                                                             \
            a;                                                                             \
        else                                                                               \
            b;                                                                             \
    } while (0)
/* How far ahead the passes prefetch: the row that starts RMS_AHEAD bytes on (at least the next
 * row), while rows are at most RMS_AHEAD_MAX bytes (longer rows are split or left to the
 * hardware's own prefetcher, which follows one long stream well). */
#define RMS_AHEAD 8192
#define RMS_AHEAD_MAX (256 * 1024)
/* Where the data outgrow the cache (streamed outputs), the first pass prefetches the rows
 * ahead too, so that memory is kept busy through both passes; RMS_PF1 0 builds without, for the
 * A/B in benchmarks/NOTES.md. */
#ifndef RMS_PF1
#define RMS_PF1 1
#endif
/* Vectors a line holds (at least one) */
#define RMS_LV(T, W) (RMS_LINE / ((W) * sizeof(T)) ? RMS_LINE / ((W) * sizeof(T)) : 1)
/* A second pass's ranges (FN(plan_pass), FN(next_range)): [lo, hi) is the middle, streamed when
 * nt; cur is how far the backwards pass got. */
typedef struct {
    size_t lo, hi, n, cur;
    int nt, back, stage;
} rms_plan;
#define RMS_ENTRY(sfx)                                                                     \
    {                                                                                      \
        rmsnorm_fwd_##sfx, rmsnorm_bwd_##sfx, rmsnorm_sumsq_##sfx, rmsnorm_scale_##sfx,    \
            rmsnorm_dot_##sfx, rmsnorm_bwdp_##sfx, rmsnorm_rescue_##sfx,                   \
            rmsnorm_widen_##sfx, rmsnorm_narrow_##sfx                                      \
    }
#endif

#define FN(op) RMS_CAT3(rmsnorm, op, SFX)
#if defined(V_PK2) && !defined(V_PK2_PLAIN)
#define V_PK2_PLAIN 0 /* 1 where V_PK2 is one instruction: plain stores take it too */
#endif
/* t elements at p: a full vector when t == W (a constant in the main loops), else partial. */
#define LDX(p, t) ((t) == W ? V_LD(p) : V_LDP((p), (t)))
#define LDCX(p, t) ((t) == W ? VC_LD(p) : VC_LDP((p), (t)))
#define STX(p, v, t, nt)                                                                   \
    do {                                                                                   \
        if ((t) == W && (nt))                                                              \
            V_STNT((p), (v));                                                              \
        else if ((t) == W)                                                                 \
            V_ST((p), (v));                                                                \
        else                                                                               \
            V_STP((p), (v), (t));                                                          \
    } while (0)
#define STCX(p, v, t)                                                                      \
    do {                                                                                   \
        if ((t) == W)                                                                      \
            VC_ST((p), (v));                                                               \
        else                                                                               \
            VC_STP((p), (v), (t));                                                         \
    } while (0)

/* t weights at offset i: the compute type (hw 1) or x's storage type (2), widened as it is
 * loaded with + 0 as widen adds its offset, so that a weight of -0 acts as +0 either way. */
#define LDW(w, i, t, hw)                                                                   \
    ((hw) == 2 ? V_ADD(LDX((const T *)(w) + (i), t), V_SET((C)0))                          \
               : LDCX((const C *)(w) + (i), t))
/* hw for a call: RMS_W_STORAGE matters only where the storage type is not the compute type */
#define RMS_HW(flags) (((flags) & RMS_W_STORAGE) && sizeof(T) < sizeof(C) ? 2 : 1)

/* Prefetches the lines of the 4 * W elements at p (into L2). */
RMS_INLINE void FN(pf4)(const T *p) {
#if RMS_PF
    for (size_t b = 0; b < 4 * W * sizeof(T); b += RMS_LINE)
        __builtin_prefetch((const char *)p + b, 0, 2);
#else
    (void)p;
#endif
}

/* The second pass prefetches the line at offset i of the rows ahead pf and pf2 (when two),
 * so that memory fetches the next rows while the core computes this one. */
RMS_INLINE void FN(pf_line)(const T *pf, const T *pf2, size_t i, const int two) {
#if RMS_PF
    if (pf) {
        __builtin_prefetch(pf + i, 0, 2);
        if (two)
            __builtin_prefetch(pf2 + i, 0, 2);
    }
#else
    (void)pf;
    (void)pf2;
    (void)i;
    (void)two;
#endif
}

/* ---------------------------------------------------------------- reductions
 * kind: 0 sum x^2; 1 sum round(x + r)^2 (h stored when h is not NULL); 2 sum a * (b * r); 3
 * (4: w in the storage type) sum (a * w) * (b * r): the backward's dy * w * xhat, with xhat
 * formed first so that rows of huge x do not overflow. pa, pb: the rows ahead to prefetch
 * (NULL: none). */
RMS_INLINE V FN(term)(V acc, const T *a, const T *b, const void *w, V vr, T *h, size_t i,
                      const size_t t, const int kind) {
    V u = LDX(a + i, t);
    if (kind == 0)
        return V_FMA(u, u, acc);
    V v = LDX(b + i, t);
    if (kind == 1) {
        V s;
        if (h && sizeof(T) < sizeof(C) && RMS_RELOAD) {
            /* 16-bit h: rounded once, by its store, and read back (from the store buffer),
             * which costs less than rounding in the lanes and again to store */
            STX(h + i, V_ADD(u, v), t, 0);
            s = LDX(h + i, t);
        } else {
            s = V_RND(V_ADD(u, v));
            if (h)
                STX(h + i, s, t, 0);
        }
        return V_FMA(s, s, acc);
    }
    if (kind >= 3)
        u = V_MUL(u, LDW(w, i, t, kind - 2));
    return V_FMA(u, V_MUL(v, vr), acc);
}

RMS_INLINE double FN(reduce_chunk)(const T *a, const T *b, const void *w, C r, T *h, size_t n,
                                   const T *pa, const T *pb, const int kind) {
    const V vr = V_SET(r);
    A l = A_ZERO, hi = A_ZERO;
    const V z = V_SET((C)0);
    size_t i = 0;
    while (i + 4 * W <= n) {
        V s0 = z, s1 = z, s2 = z, s3 = z;
        for (int it = 0; it < RMS_FLUSH && i + 4 * W <= n; it++, i += 4 * W) {
            if (RMS_PF1 && pa) {
                FN(pf4)(pa + i);
                if (kind != 0)
                    FN(pf4)(pb + i);
            }
            s0 = FN(term)(s0, a, b, w, vr, h, i, W, kind);
            s1 = FN(term)(s1, a, b, w, vr, h, i + W, W, kind);
            s2 = FN(term)(s2, a, b, w, vr, h, i + 2 * W, W, kind);
            s3 = FN(term)(s3, a, b, w, vr, h, i + 3 * W, W, kind);
        }
        A_ACC(l, hi, V_ADD(V_ADD(s0, s1), V_ADD(s2, s3)));
    }
    if (i < n) { /* the tail, into one accumulator (none: a row of whole steps adds no zeros) */
        V s = z;
        for (; i + W <= n; i += W)
            s = FN(term)(s, a, b, w, vr, h, i, W, kind);
        if (i < n)
            s = FN(term)(s, a, b, w, vr, h, i, n - i, kind);
        A_ACC(l, hi, s);
    }
    return A_SUM(l, hi);
}

#if defined(V_SQ2)
/* A chunk's sum of squares through V_SQ2 (two vectors' squares into one, pairwise): where that
 * instruction flushes subnormal results (VDPBF16PS), each flush loses less than float32's
 * smallest normal, 2^-126, a product, so a chunk whose sum is at least RMS_SQ2_EXACT (2^24 times
 * RMS_CHUNK such losses) is within float32's rounding; a smaller one is summed again exactly. */
#define RMS_SQ2_EXACT 0x1p-92
RMS_INLINE double FN(sq2_chunk)(const T *a, size_t n, const T *pa) {
    A l = A_ZERO, hi = A_ZERO;
    const V z = V_SET((C)0);
    size_t i = 0;
    while (i + 8 * W <= n) {
        V s0 = z, s1 = z, s2 = z, s3 = z;
        for (int it = 0; it < RMS_FLUSH / 2 && i + 8 * W <= n; it++, i += 8 * W) {
            if (RMS_PF1 && pa) {
                FN(pf4)(pa + i);
                FN(pf4)(pa + i + 4 * W);
            }
            s0 = V_SQ2(s0, a + i);
            s1 = V_SQ2(s1, a + i + 2 * W);
            s2 = V_SQ2(s2, a + i + 4 * W);
            s3 = V_SQ2(s3, a + i + 6 * W);
        }
        A_ACC(l, hi, V_ADD(V_ADD(s0, s1), V_ADD(s2, s3)));
    }
    if (i < n) {
        V s = z;
        for (; i + W <= n; i += W)
            s = FN(term)(s, a, NULL, NULL, z, NULL, i, W, 0);
        if (i < n)
            s = FN(term)(s, a, NULL, NULL, z, NULL, i, n - i, 0);
        A_ACC(l, hi, s);
    }
    return A_SUM(l, hi);
}
#endif

/* The sum of the chunk of a row of n elements that starts at c0 */
RMS_INLINE double FN(chunk_sum)(const T *a, const T *b, const void *w, C r, T *h, size_t n,
                                const T *pa, const T *pb, const int kind, size_t c0) {
    size_t len = n - c0 < RMS_CHUNK ? n - c0 : RMS_CHUNK;
    const void *wc = !w ? w : kind == 4 ? (const void *)((const T *)w + c0)
                                        : (const void *)((const C *)w + c0);
#if defined(V_SQ2)
    if (kind == 1) { /* h = round(x + r) first (here when not stored), then kind 0's sum of it,
                      * so that the add's rstd has the bits rms_norm gives h */
        T tmp[RMS_CHUNK];
        T *hc = h ? h + c0 : tmp;
#define RMS_H(i, t) STX(hc + (i), V_ADD(LDX(a + c0 + (i), t), LDX(b + c0 + (i), t)), t, 0)
        size_t i = 0;
        for (; i + W <= len; i += W) {
            if (RMS_PF1 && pa && i % (4 * W) == 0) {
                FN(pf4)(pa + c0 + i);
                FN(pf4)(pb + c0 + i);
            }
            RMS_H(i, W);
        }
        if (i < len)
            RMS_H(i, len - i);
#undef RMS_H
        return FN(chunk_sum)(hc, NULL, NULL, r, NULL, len, NULL, NULL, 0, 0);
    }
    double cs;
    if (kind == 0 && (cs = FN(sq2_chunk)(a + c0, len, pa ? pa + c0 : pa)) >= RMS_SQ2_EXACT)
        return cs;
#endif
    return FN(reduce_chunk)(a + c0, b ? b + c0 : b, wc, r, h ? h + c0 : h, len,
                            pa ? pa + c0 : pa, pa ? pb + c0 : pb, kind);
}

/* A row's sum as the sum, left to right, of its RMS_CHUNK-element chunks, each reduced from
 * fresh accumulators: a row split across threads at chunk bounds (the driver) adds the same
 * chunk sums in the same order, so its bits do not depend on the thread count. parts, when not
 * NULL, receives each chunk's sum. */
RMS_INLINE double FN(reduce)(const T *a, const T *b, const void *w, C r, T *h, size_t n,
                             const T *pa, const T *pb, const int kind, double *parts) {
    double total = 0.0;
    for (size_t c0 = 0; c0 < n; c0 += RMS_CHUNK) {
        double cs = FN(chunk_sum)(a, b, w, r, h, n, pa, pb, kind, c0);
        if (parts)
            parts[c0 / RMS_CHUNK] = cs;
        total += cs;
    }
    return total;
}

/* ---------------------------------------------------------------- the rescue */

/* Out of line and never cloned: a cold path (rows whose squares overflowed or underflowed, or
 * that hold Inf or NaN), whose constant-propagated copies were only code size. */
RMS_NOCLONE static double FN(rescue)(const void *xv, const void *rv, size_t n, double eps) {
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
    /* every value finite: the squares overflowed or underflowed, so rescale. A compensated
     * sum (Neumaier's): float64 rows take this path too, and a plain running sum of thousands
     * of terms is a few ulps short of what rstd promises in float64. */
    double s = 0.0, comp = 0.0;
    for (size_t i = 0; i < n; i++) {
        double v = r ? (double)S_RND((C)(S_LD(x + i) + S_LD(r + i))) : (double)S_LD(x + i);
        double q = (v / amax) * (v / amax), t = s + q;
        comp += fabs(s) >= fabs(q) ? (s - t) + q : (q - t) + s;
        s = t;
    }
    s += comp;
    double t = eps / amax / amax;
    if (!(t <= 1.79769313486231570e308)) /* eps / amax^2 overflows: the mean square (at most
                                           * amax^2) vanishes beside eps */
        return 1.0 / sqrt(eps);
    return 1.0 / (amax * sqrt(s / (double)n + t));
}

/* The row's rstd, rounded to the compute type: rd (rms_rstd of ss) where its sum of squares ss
 * is usable, else the rescue's. */
RMS_INLINE C FN(rstd)(double ss, double rd, const T *x, const T *r, size_t n, double eps) {
    return (C)(rms_sumsq_ok(ss, sizeof(C) == 8) ? rd : FN(rescue)(x, r, n, eps));
}

/* The rstd of a block's cnt rows from their sums of squares (rd[j] meaningful where
 * rms_sumsq_ok(ss[j])), in one loop the compiler vectorizes: division and square root round
 * correctly either way, so the bits are FN(rstd)'s, and a short row's own division and square
 * root were a large part of its time (benchmarks/NOTES.md). */
RMS_INLINE void FN(rstd_block)(const double *ss, double *rd, size_t cnt, size_t n, double eps) {
    for (size_t j = 0; j < cnt; j++)
        rd[j] = rms_rstd(ss[j], n, eps);
}

/* ---------------------------------------------------------------- second passes
 * Elements [i0, i1) of a row (the last three arguments, which RMS_PASS appends); nt:
 * non-temporal stores (the range then starts on a line). */
RMS_INLINE void FN(scale_range)(const T *x, const T *r, T *h, T *y, const void *w, V vr,
                                const T *pf, const T *pf2, const int hasr, const int hasw,
                                const int before, size_t i0, size_t i1, const int nt) {
#define RMS_VAL(i, t, hv, v) /* y's value v at i, and h's hv (the add) */                   \
    do {                                                                                   \
        hv = LDX(x + (i), t);                                                              \
        if (hasr == 1)                                                                     \
            hv = V_RND(V_ADD(hv, LDX(r + (i), t)));                                        \
        v = V_MUL(hv, vr);                                                                 \
        if (before)                                                                        \
            v = V_RND(v);                                                                  \
        if (hasw)                                                                          \
            v = V_MUL(v, LDW(w, i, t, hasw));                                              \
    } while (0)
#define RMS_STEP(i, t)                                                                     \
    do {                                                                                   \
        V h_, v_;                                                                          \
        RMS_VAL(i, t, h_, v_);                                                             \
        if (hasr) /* 2: x is the add's h, staged in a buffer */                            \
            STX(h + (i), h_, t, nt);                                                       \
        STX(y + (i), v_, t, nt);                                                           \
    } while (0)
    size_t i = i0;
    const size_t lv = RMS_LV(T, W);
    const int two = pf2 && pf2 != pf; /* the add's r rows ahead too */
    for (; i + lv * W <= i1; i += lv * W) {
        FN(pf_line)(pf, pf2, i, two);
#if defined(V_PK2)
        if (nt || V_PK2_PLAIN) {
            for (size_t j = 0; j < lv; j += 2) {
                V h0, v0, h1, v1;
                RMS_VAL(i + j * W, W, h0, v0);
                RMS_VAL(i + (j + 1) * W, W, h1, v1);
                if (hasr)
                    V_ST2R(h + i + j * W, V_PK2(h0, h1), nt);
                V_ST2R(y + i + j * W, V_PK2(v0, v1), nt);
            }
            continue;
        }
#endif
        for (size_t j = 0; j < lv; j++)
            RMS_STEP(i + j * W, W);
    }
    for (; i + W <= i1; i += W)
        RMS_STEP(i, W);
    if (i < i1)
        RMS_STEP(i, i1 - i);
#undef RMS_STEP
#undef RMS_VAL
}

RMS_INLINE void FN(bwd_range)(const T *dy, const T *x, const void *w, T *dx, C *dg, V vr, V vnc,
                              const T *pf, const T *pf2, const int hasw, const int dgm,
                              size_t i0, size_t i1, const int nt) {
#define RMS_VAL(i, t, v) /* dx's value v at i; dgamma updated */                            \
    do {                                                                                   \
        V d = LDX(dy + (i), t), xh = V_MUL(LDX(x + (i), t), vr);                           \
        V g = hasw ? V_MUL(d, LDW(w, i, t, hasw)) : d;                                     \
        v = V_MUL(vr, V_FMA(xh, vnc, g));                                                  \
        if (dgm == 1)                                                                      \
            STCX(dg + (i), V_FMA(d, xh, LDCX(dg + (i), t)), t);                            \
        else if (dgm == 2)                                                                 \
            STCX(dg + (i), V_MUL(d, xh), t);                                               \
        else if (dgm == 3) /* RMS_DG_NARROW */                                             \
            STX((T *)dg + (i), V_MUL(d, xh), t, 0);                                        \
    } while (0)
#define RMS_STEP(i, t)                                                                     \
    do {                                                                                   \
        V v_;                                                                              \
        RMS_VAL(i, t, v_);                                                                 \
        STX(dx + (i), v_, t, nt);                                                          \
    } while (0)
    size_t i = i0;
    const size_t lv = RMS_LV(T, W);
    for (; i + lv * W <= i1; i += lv * W) {
        FN(pf_line)(pf, pf2, i, 1);
#if defined(V_PK2)
        if (nt || V_PK2_PLAIN) {
            for (size_t j = 0; j < lv; j += 2) {
                V v0, v1;
                RMS_VAL(i + j * W, W, v0);
                RMS_VAL(i + (j + 1) * W, W, v1);
                V_ST2R(dx + i + j * W, V_PK2(v0, v1), nt);
            }
            continue;
        }
#endif
        for (size_t j = 0; j < lv; j++)
            RMS_STEP(i + j * W, W);
    }
    for (; i + W <= i1; i += W)
        RMS_STEP(i, W);
    if (i < i1)
        RMS_STEP(i, i1 - i);
#undef RMS_STEP
#undef RMS_VAL
}

/* Elements of out (n of them) before its first whole line, where streaming starts; n when
 * the row is too short to stream, or out is not aligned to its elements. */
RMS_INLINE size_t FN(head)(const T *out, size_t n) {
    size_t mis = (size_t)((uintptr_t)out % RMS_LINE);
    if (!RMS_NT || mis % sizeof(T) || n * sizeof(T) < RMS_LINE)
        return n;
    size_t head = mis ? (RMS_LINE - mis) / sizeof(T) : 0;
    return head < n ? head : n;
}

/* Second passes over more than RMS_BACK bytes go backwards, in chunks (see RMS_PASS). */
#define RMS_BACK (512 * 1024)
#define RMS_BACK_CHUNK 4096
/* The plan of a second pass over n elements with outputs out and out2. */
RMS_INLINE rms_plan FN(plan_pass)(const T *out, const T *out2, size_t n, int stream) {
    rms_plan p = {0, n, n, 0, 0, n * sizeof(T) > RMS_BACK, 0};
    size_t hd = stream ? FN(head)(out, n) : n;
    if (hd < n && FN(head)(out2, n) == hd) {
        const size_t ln = RMS_LINE / sizeof(T);
        p.lo = hd;
        p.hi = hd + (n - hd) / ln * ln;
        p.nt = 1;
    }
    p.cur = p.back ? p.hi : p.lo;
    return p;
}

/* The next range [*a, *b) of the pass, streamed or not (*nt); 0 when there is none. Forwards:
 * [0, lo), the middle, [hi, n). Backwards: [hi, n), the middle in chunks from its end, [0, lo). */
RMS_INLINE int FN(next_range)(rms_plan *p, size_t *a, size_t *b, int *nt) {
    for (;;) {
        if (p->stage == 0) { /* the edge before the middle */
            p->stage = 1;
            *a = p->back ? p->hi : 0;
            *b = p->back ? p->n : p->lo;
            *nt = 0;
        } else if (p->stage == 1) { /* the middle: whole, or a chunk of it from its end */
            if (!p->back) {
                p->stage = 2;
                *a = p->lo, *b = p->hi;
            } else if (p->cur > p->lo) {
                size_t c = p->lo + (p->cur - p->lo - 1) / RMS_BACK_CHUNK * RMS_BACK_CHUNK;
                *a = c, *b = p->cur;
                p->cur = c;
            } else {
                p->stage = 2;
                continue;
            }
            *nt = p->nt;
        } else if (p->stage == 2) { /* the edge after it */
            p->stage = 3;
            *a = p->back ? 0 : p->hi;
            *b = p->back ? p->lo : p->n;
            *nt = 0;
        } else {
            return 0;
        }
        if (*b > *a)
            return 1;
    }
}

/* A second pass over n elements (outputs out and out2, which may be the same): streamed (whole
 * lines non-temporally, the partial lines at either end plainly) when `stream` and the outputs
 * allow, else plainly. A row longer than RMS_BACK bytes takes its second pass from the end
 * backwards, RMS_BACK_CHUNK elements at a time: its first pass left the row's end in cache, and
 * its start went out of it first. */
#define RMS_PASS(RANGE, out, out2, n, stream, ...)                                         \
    do {                                                                                   \
        rms_plan p_ = FN(plan_pass)(out, out2, n, stream);                                 \
        size_t a_, b_;                                                                     \
        int nt_;                                                                           \
        while (FN(next_range)(&p_, &a_, &b_, &nt_)) {                                      \
            if (nt_)                                                                       \
                RANGE(__VA_ARGS__, a_, b_, 1);                                             \
            else                                                                           \
                RANGE(__VA_ARGS__, a_, b_, 0);                                             \
        }                                                                                  \
    } while (0)

/* The part [a, b) of a forwards pass planned as p: its pieces before lo and from hi plainly,
 * those in [lo, hi) as the plan streams. */
#define RMS_PASS_PART(RANGE, p, a, b, ...)                                                 \
    do {                                                                                   \
        const size_t cut_[4] = {0, (p).lo, (p).hi, (p).n};                                 \
        for (int q_ = 0; q_ < 3; q_++) {                                                   \
            size_t s_ = (a) > cut_[q_] ? (a) : cut_[q_];                                   \
            size_t e_ = (b) < cut_[q_ + 1] ? (b) : cut_[q_ + 1];                           \
            if (s_ >= e_)                                                                  \
                continue;                                                                  \
            if (q_ == 1 && (p).nt)                                                         \
                RANGE(__VA_ARGS__, s_, e_, 1);                                             \
            else                                                                           \
                RANGE(__VA_ARGS__, s_, e_, 0);                                             \
        }                                                                                  \
    } while (0)

/* Streamed rows of RMS_FUSE_MIN to RMS_AHEAD_MAX bytes are fused across rows: each chunk of the
 * next row's first pass is followed by as many elements of this row's second pass (from the
 * line its streaming starts on), so that memory serves the reads of one row beside the writes
 * of the other, as it serves a copy, rather than a row of reads and then a row of writes. Every
 * sum keeps its chunks and their order: the bits are those of one row at a time. The loop runs
 * j over the chunks: first-pass chunk [j C, j C + C) and second-pass elements [a, lo + j C + C). */
#ifndef RMS_FUSE_MIN
#define RMS_FUSE_MIN 4096
#endif
#define RMS_FUSED(rb, m) (RMS_NT && (rb) >= RMS_FUSE_MIN && (rb) <= RMS_AHEAD_MAX && (m) > 1)
#define RMS_FUSE_LOOP(p, k, SUM, PART)                                                     \
    for (size_t c0_ = 0, a_ = 0; a_ < (k) || c0_ < (k); c0_ += RMS_CHUNK) {                \
        const size_t b_ = (p).lo + c0_ + RMS_CHUNK < (k) ? (p).lo + c0_ + RMS_CHUNK : (k); \
        if (c0_ < (k))                                                                     \
            SUM(c0_);                                                                      \
        if (a_ < b_)                                                                       \
            PART(a_, b_);                                                                  \
        a_ = b_;                                                                           \
    }

/* Rows of fewer than RMS_BLOCK_BYTES go in blocks (at most RMS_BLOCK rows of at most that many
 * bytes together): the first passes of a block's rows, then their second passes, so that the
 * core overlaps one row's reduction, square root and division with the next rows' (a short row
 * is mostly that latency). */
#ifndef RMS_BLOCK_BYTES
#define RMS_BLOCK_BYTES RMS_FWD_BLOCK /* a block's staged h fills fwd's buf */
#endif
#if RMS_BLOCK_BYTES > RMS_FWD_BLOCK
#error "a block's staged h must fit fwd's buf"
#endif
#define RMS_BLOCK 16
#ifndef RMS_STAGE_MAX
#define RMS_STAGE_MAX RMS_AHEAD_MAX /* bytes of the longest row whose add stages h */
#endif
#define RMS_BLOCK_ROWS(rb)                                                                 \
    ((rb) >= RMS_BLOCK_BYTES || !(rb) ? (size_t)1                                          \
     : RMS_BLOCK_BYTES / (rb) > RMS_BLOCK ? (size_t)RMS_BLOCK                              \
                                          : RMS_BLOCK_BYTES / (rb))
/* Rows of fewer than RMS_PF_MIN bytes are not prefetched: one after another they are one
 * stream, which the hardware prefetcher follows. */
#ifndef RMS_PF_MIN
#define RMS_PF_MIN 2048
#endif

/* How many rows ahead of this one to prefetch (0: none) for rows of rb bytes: the row that starts
 * RMS_AHEAD bytes on, for rows of RMS_PF_MIN to RMS_AHEAD_MAX bytes. */
RMS_INLINE size_t FN(ahead)(size_t rb) {
    return rb > RMS_AHEAD_MAX || rb < RMS_PF_MIN ? 0 : (RMS_AHEAD + rb - 1) / rb;
}

/* Rows of fewer than RMS_STREAM_ROW bytes stream only where every row of the output starts on a
 * line: elsewhere each row's two partial lines are stored plainly (and a plain store of a partial
 * line reads it first), which streaming the rest of so short a row does not repay. */
#define RMS_STREAM_ROW 1024
RMS_INLINE int FN(stream_rows)(const void *o, ptrdiff_t os, size_t k) {
    return k * sizeof(T) >= RMS_STREAM_ROW ||
           ((uintptr_t)o % RMS_LINE == 0 && (size_t)os * sizeof(T) % RMS_LINE == 0);
}

/* Rows of 64 and 128 elements (per-head norms, the q and k norms of attention heads) take row
 * loops compiled with that length as a constant: unrolled, with no tails, and the second pass's
 * plan folded away. Only the cases models call: the forward and the add with a compute-type
 * weight or none, rounded once; the backward with a compute-type weight and dgamma. (RMS_KCONST 0
 * builds without them, for the A/B in benchmarks/NOTES.md.) */
#ifndef RMS_KCONST
#define RMS_KCONST 1
#endif

/* ---------------------------------------------------------------- forward and add */

/* The forward and the add of RMS_FUSED rows with streamed outputs (see RMS_FUSE_MIN). The
 * 16-bit add stages h as fwd_loop does, in two rows of buf: the row being summed stores its h
 * in one while the other's is streamed out and scaled. */
RMS_INLINE void FN(fwd_fused)(const T *x, ptrdiff_t xs, const T *r, ptrdiff_t rs, T *h,
                              ptrdiff_t hs, T *y, ptrdiff_t ys, const void *w, C *rstd, size_t m,
                              size_t k, double eps, T *buf, const int hasr, const int hasw,
                              const int before) {
    const size_t d = FN(ahead)(k * sizeof(T));
    const int staged = hasr && sizeof(T) < sizeof(C) && k * sizeof(T) <= RMS_STAGE_MAX;
    T *sb[2] = {buf, buf + k};
    double ss = FN(reduce)(x, r, NULL, (C)1, staged ? sb[0] : NULL, k, NULL, NULL, hasr, NULL);
    for (size_t i = 0; i < m; i++) {
        const T *xr = x + (ptrdiff_t)i * xs, *xn = i + 1 < m ? xr + xs : NULL;
        const T *rr = hasr ? r + (ptrdiff_t)i * rs : NULL, *rn = hasr && xn ? rr + rs : NULL;
        T *yr = y + (ptrdiff_t)i * ys, *hr = hasr ? h + (ptrdiff_t)i * hs : NULL;
        T *sr = sb[i & 1], *sn = sb[(i + 1) & 1];
        const double rd = rms_rstd(ss, k, eps);
        const C rc = staged ? FN(rstd)(ss, rd, sr, NULL, k, eps) : FN(rstd)(ss, rd, xr, rr, k, eps);
        const V vr = V_SET(rc);
        rstd[i] = rc;
        /* the rows d past the one being summed */
        const T *pf = xn && i + 1 + d < m ? xn + (ptrdiff_t)d * xs : NULL;
        const T *pr = hasr && pf ? rn + (ptrdiff_t)d * rs : pf;
        const rms_plan p = FN(plan_pass)(yr, hasr ? hr : yr, k, 1);
        double t = 0.0;
#define RMS_SUM(c0)                                                                        \
    do {                                                                                   \
        if (xn)                                                                            \
            t += FN(chunk_sum)(xn, rn, NULL, (C)1, staged ? sn : NULL, k, pf, pr, hasr, (c0)); \
    } while (0)
#define RMS_PART(a, b)                                                                     \
    RMS_IF(staged,                                                                         \
           RMS_PASS_PART(FN(scale_range), p, a, b, sr, NULL, hr, yr, w, vr, pf, pr, 2, hasw,   \
                         before),                                                          \
           RMS_PASS_PART(FN(scale_range), p, a, b, xr, rr, hr, yr, w, vr, pf, pr, hasr, hasw,  \
                         before))
        RMS_FUSE_LOOP(p, k, RMS_SUM, RMS_PART)
#undef RMS_SUM
#undef RMS_PART
        ss = t;
    }
}

RMS_INLINE void FN(fwd_loop)(const T *x, ptrdiff_t xs, const T *r, ptrdiff_t rs, T *h,
                             ptrdiff_t hs, T *y, ptrdiff_t ys, const void *w, C *rstd, size_t m,
                             size_t k, double eps, int stream, T *buf, const int hasr,
                             const int hasw, const int before) {
    const size_t rb = k * sizeof(T), d = FN(ahead)(rb), nb = RMS_BLOCK_ROWS(rb);
    /* The add with cached outputs: the first pass stores h = round(x + r) as it sums (h may be
     * x or r, each element written after it was read), and the second pass scales h, so that
     * neither the add nor its rounding is done twice. Streamed outputs keep the recomputation:
     * a plain store of h would fetch its lines first. */
    const int narrow = sizeof(T) < sizeof(C); /* 16-bit: h costs a rounding */
    const int staged = hasr && (!stream || (narrow && rb <= RMS_STAGE_MAX));
    /* With streamed outputs, 16-bit rows of up to RMS_STAGE_MAX bytes stage h in buf instead
     * (the first pass stores it, the second streams it to h and scales it); a block's rows
     * (RMS_BLOCK_BYTES in all) one after another. Wider types recompute h: without a rounding
     * to spare, the buffer's traffic costs more than the add. */
    if (stream && RMS_FUSED(rb, m)) {
        FN(fwd_fused)(x, xs, r, rs, h, hs, y, ys, w, rstd, m, k, eps, buf, hasr, hasw, before);
        return;
    }
    double ss[RMS_BLOCK], rd[RMS_BLOCK];
    for (size_t i0 = 0; i0 < m; i0 += nb) {
        const size_t cnt = m - i0 < nb ? m - i0 : nb;
        for (size_t j = 0; j < cnt; j++) { /* the block's first passes */
            const size_t i = i0 + j, ahead = i + d < m ? d : 0;
            const T *xr = x + (ptrdiff_t)i * xs, *rr = hasr ? r + (ptrdiff_t)i * rs : NULL;
            const T *px = ahead && stream ? xr + (ptrdiff_t)ahead * xs : NULL;
            const T *pr = hasr && px ? rr + (ptrdiff_t)ahead * rs : px;
            T *hr = !staged ? NULL : stream ? buf + j * k : h + (ptrdiff_t)i * hs;
            ss[j] = FN(reduce)(xr, rr, NULL, (C)1, hr, k, px, pr, hasr, NULL);
        }
        FN(rstd_block)(ss, rd, cnt, k, eps);
        for (size_t j = 0; j < cnt; j++) { /* and their second passes */
            const size_t i = i0 + j, ahead = i + d < m ? d : 0;
            const T *xr = x + (ptrdiff_t)i * xs, *rr = hasr ? r + (ptrdiff_t)i * rs : NULL;
            T *hr = hasr ? h + (ptrdiff_t)i * hs : NULL, *yr = y + (ptrdiff_t)i * ys;
            const T *pfx = ahead ? xr + (ptrdiff_t)ahead * xs : NULL;
            const T *pr = hasr ? rr + (ptrdiff_t)ahead * rs : pfx;
            const T *sr = stream ? buf + j * k : hr; /* the staged h */
            const C rc = staged ? FN(rstd)(ss[j], rd[j], sr, NULL, k, eps)
                                : FN(rstd)(ss[j], rd[j], xr, rr, k, eps);
            const V vr = V_SET(rc);
            rstd[i] = rc;
            if (staged && stream)
                RMS_PASS(FN(scale_range), yr, hr, k, 1, sr, NULL, hr, yr, w, vr, pfx, pr, 2,
                         hasw, before);
            else if (staged)
                RMS_PASS(FN(scale_range), yr, yr, k, 0, hr, NULL, NULL, yr, w, vr, pfx, pr, 0,
                         hasw, before);
            else
                RMS_PASS(FN(scale_range), yr, hasr ? hr : yr, k, stream, xr, rr, hr, yr, w, vr,
                         pfx, pr, hasr, hasw, before);
        }
    }
}

static void FN(fwd)(const void *x, ptrdiff_t xs, const void *r, ptrdiff_t rs, void *h,
                    ptrdiff_t hs, void *y, ptrdiff_t ys, const void *w, void *rstd, size_t m,
                    size_t k, double eps, int flags, void *buf) {
    const int before = (flags & RMS_CAST_BEFORE) && sizeof(T) < sizeof(C);
    const int stream = (flags & RMS_STREAM) && FN(stream_rows)(y, ys, k) &&
                       (!r || FN(stream_rows)(h, hs, k));
#define RMS_CALL(hr, hw, bf)                                                               \
    do {                                                                                   \
        if (RMS_KCONST && (hw) != 2 && !(bf) && k == 64)                                   \
            RMS_CALLK(hr, hw, bf, 64);                                                     \
        else if (RMS_KCONST && (hw) != 2 && !(bf) && k == 128)                             \
            RMS_CALLK(hr, hw, bf, 128);                                                    \
        else                                                                               \
            RMS_CALLK(hr, hw, bf, k);                                                      \
    } while (0)
#define RMS_CALLK(hr, hw, bf, kk)                                                          \
    FN(fwd_loop)((const T *)x, xs, (const T *)r, rs, (T *)h, hs, (T *)y, ys, w, (C *)rstd, m, \
                 kk, eps, stream, (T *)buf, hr, hw, bf)
#define RMS_CALL_W(hr)                                                                     \
    do {                                                                                   \
        if (!w)                                                                            \
            RMS_CALL(hr, 0, 0);                                                            \
        else if (RMS_HW(flags) == 2)                                                       \
            RMS_IF(before, RMS_CALL(hr, 2, 1), RMS_CALL(hr, 2, 0));                        \
        else                                                                               \
            RMS_IF(before, RMS_CALL(hr, 1, 1), RMS_CALL(hr, 1, 0));                        \
    } while (0)
    if (r)
        RMS_CALL_W(1);
    else
        RMS_CALL_W(0);
#undef RMS_CALL_W
#undef RMS_CALL
#undef RMS_CALLK
    if (stream)
        V_FENCE();
}

static double FN(sumsq)(const void *x, const void *r, void *h, size_t n, double *parts) {
    const T *a = (const T *)x;
    if (r)
        return FN(reduce)(a, (const T *)r, NULL, (C)1, (T *)h, n, NULL, NULL, 1, parts);
    return FN(reduce)(a, NULL, NULL, (C)1, NULL, n, NULL, NULL, 0, parts);
}

static void FN(scale)(const void *x, void *y, const void *w, double rstd, size_t n, int flags) {
    const T *xp = (const T *)x;
    T *yp = (T *)y;
    const V vr = V_SET((C)rstd);
    const int before = (flags & RMS_CAST_BEFORE) && sizeof(T) < sizeof(C);
    const int stream = (flags & RMS_STREAM) != 0;
#define RMS_CALL(hw, bf)                                                                   \
    RMS_PASS(FN(scale_range), yp, yp, n, stream, xp, NULL, NULL, yp, w, vr, NULL, NULL, 0, hw, \
             bf)
    if (!w)
        RMS_CALL(0, 0);
    else if (RMS_HW(flags) == 2)
        RMS_IF(before, RMS_CALL(2, 1), RMS_CALL(2, 0));
    else
        RMS_IF(before, RMS_CALL(1, 1), RMS_CALL(1, 0));
#undef RMS_CALL
    if (stream)
        V_FENCE();
}

/* ---------------------------------------------------------------- backward */

/* The backward of RMS_FUSED rows with streamed outputs (see RMS_FUSE_MIN). */
RMS_INLINE void FN(bwd_fused)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, T *dx,
                              ptrdiff_t dxs, const void *w, const C *rstd, C *dg, size_t m,
                              size_t k, int store, const int hasw, const int hasdg) {
    const size_t d = FN(ahead)(k * sizeof(T));
    const int kind = hasw ? 2 + hasw : 2;
    double s = FN(reduce)(dy, x, w, rstd[0], NULL, k, NULL, NULL, kind, NULL);
    for (size_t i = 0; i < m; i++) {
        const T *dyr = dy + (ptrdiff_t)i * dys, *xr = x + (ptrdiff_t)i * xs;
        const T *dyn = i + 1 < m ? dyr + dys : NULL, *xn = dyn ? xr + xs : NULL;
        T *dxr = dx + (ptrdiff_t)i * dxs;
        const V vr = V_SET(rstd[i]), vnc = V_SET(-(C)rms_bwd_c(s, k));
        const C rn = i + 1 < m ? rstd[i + 1] : (C)0;
        /* the rows d past the one being summed */
        const T *pdy = dyn && i + 1 + d < m ? dyn + (ptrdiff_t)d * dys : NULL;
        const T *px = pdy ? xn + (ptrdiff_t)d * xs : NULL;
        const rms_plan p = FN(plan_pass)(dxr, dxr, k, 1);
        double t = 0.0;
#define RMS_SUM(c0)                                                                        \
    do {                                                                                   \
        if (dyn)                                                                           \
            t += FN(chunk_sum)(dyn, xn, w, rn, NULL, k, pdy, px, kind, (c0));              \
    } while (0)
#define RMS_PART(a, b)                                                                     \
    RMS_IF(hasdg && i == 0 && store,                                                       \
           RMS_PASS_PART(FN(bwd_range), p, a, b, dyr, xr, w, dxr, dg, vr, vnc, pdy, px, hasw, 2), \
           RMS_PASS_PART(FN(bwd_range), p, a, b, dyr, xr, w, dxr, dg, vr, vnc, pdy, px, hasw,  \
                         hasdg))
        RMS_FUSE_LOOP(p, k, RMS_SUM, RMS_PART)
#undef RMS_SUM
#undef RMS_PART
        s = t;
    }
}

RMS_INLINE void FN(bwd_loop)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, T *dx,
                             ptrdiff_t dxs, const void *w, const C *rstd, C *dg, size_t m,
                             size_t k, int stream, int store, const int hasw, const int hasdg) {
    const size_t rb = k * sizeof(T), d = FN(ahead)(rb), nb = RMS_BLOCK_ROWS(rb);
    if (stream && RMS_FUSED(rb, m)) {
        FN(bwd_fused)(dy, dys, x, xs, dx, dxs, w, rstd, dg, m, k, store, hasw, hasdg);
        return;
    }
    double s[RMS_BLOCK];
    for (size_t i0 = 0; i0 < m; i0 += nb) {
        const size_t cnt = m - i0 < nb ? m - i0 : nb;
        for (size_t j = 0; j < cnt; j++) { /* the block's dot products */
            const size_t i = i0 + j, ahead = i + d < m ? d : 0;
            const T *dyr = dy + (ptrdiff_t)i * dys, *xr = x + (ptrdiff_t)i * xs;
            const T *pdy = ahead && stream ? dyr + (ptrdiff_t)ahead * dys : NULL;
            const T *px = pdy ? xr + (ptrdiff_t)ahead * xs : NULL;
            s[j] = hasw ? FN(reduce)(dyr, xr, w, rstd[i], NULL, k, pdy, px, 2 + hasw, NULL)
                        : FN(reduce)(dyr, xr, NULL, rstd[i], NULL, k, pdy, px, 2, NULL);
        }
        for (size_t j = 0; j < cnt; j++) { /* and their second passes */
            const size_t i = i0 + j, ahead = i + d < m ? d : 0;
            const T *dyr = dy + (ptrdiff_t)i * dys, *xr = x + (ptrdiff_t)i * xs;
            T *dxr = dx + (ptrdiff_t)i * dxs;
            const V vr = V_SET(rstd[i]), vnc = V_SET(-(C)rms_bwd_c(s[j], k));
            const T *pdy = ahead ? dyr + (ptrdiff_t)ahead * dys : NULL;
            const T *px = xr + (ptrdiff_t)ahead * xs;
            if (hasdg && i == 0 && store)
                RMS_PASS(FN(bwd_range), dxr, dxr, k, stream, dyr, xr, w, dxr, dg, vr, vnc, pdy,
                         px, hasw, 2);
            else
                RMS_PASS(FN(bwd_range), dxr, dxr, k, stream, dyr, xr, w, dxr, dg, vr, vnc, pdy,
                         px, hasw, hasdg);
        }
    }
}

/* A table may take dot and widen from another instantiation of the same dtype (they store
 * nothing, so a family that differs only in its stores shares them); here dot serves FN(bwd)'s
 * one-row RMS_DG_NARROW case too, and widen may go unused. */
__attribute__((unused)) static double FN(dot)(const void *dy, const void *x, const void *w,
                                              double rstd, size_t n, int flags, double *parts) {
    const T *a = (const T *)dy, *b = (const T *)x;
    if (w && RMS_HW(flags) == 2)
        return FN(reduce)(a, b, w, (C)rstd, NULL, n, NULL, NULL, 4, parts);
    if (w)
        return FN(reduce)(a, b, w, (C)rstd, NULL, n, NULL, NULL, 3, parts);
    return FN(reduce)(a, b, NULL, (C)rstd, NULL, n, NULL, NULL, 2, parts);
}

/* CALL(hw, hg) for the backward's weight (none, compute type, storage type: hw) and dgamma
 * (accumulated: hg 1, or none), from the locals w, dg and hw */
#define RMS_BWD_OPTS(CALL)                                                                 \
    do {                                                                                   \
        if (w && dg)                                                                       \
            RMS_IF(hw == 2, CALL(2, 1), CALL(1, 1));                                       \
        else if (w)                                                                        \
            RMS_IF(hw == 2, CALL(2, 0), CALL(1, 0));                                       \
        else                                                                               \
            CALL(0, 0);                                                                    \
    } while (0)

static void FN(bwdp)(const void *dy, const void *x, const void *w, void *dx, double rstd,
                     double c, void *dg, size_t n, int flags) {
    const T *dyp = (const T *)dy, *xp = (const T *)x;
    T *dxp = (T *)dx;
    C *dgp = (C *)dg;
    const V vr = V_SET((C)rstd), vnc = V_SET(-(C)c);
    const int stream = (flags & RMS_STREAM) != 0, hw = RMS_HW(flags);
#define RMS_CALL(hw, hg)                                                                   \
    RMS_PASS(FN(bwd_range), dxp, dxp, n, stream, dyp, xp, w, dxp, dgp, vr, vnc, NULL, NULL, hw, \
             hg)
    if (sizeof(T) < sizeof(C) && w && dg && (flags & RMS_DG_NARROW))
        RMS_IF(hw == 2, RMS_CALL(2, 3), RMS_CALL(1, 3));
    else if (w && dg && (flags & RMS_DG_STORE))
        RMS_IF(hw == 2, RMS_CALL(2, 2), RMS_CALL(1, 2));
    else
        RMS_BWD_OPTS(RMS_CALL);
#undef RMS_CALL
    if (stream)
        V_FENCE();
}

static void FN(bwd)(const void *dy, ptrdiff_t dys, const void *x, ptrdiff_t xs, void *dx,
                    ptrdiff_t dxs, const void *w, const void *rstd, void *dg, size_t m,
                    size_t k, int flags) {
    if (sizeof(T) < sizeof(C) && w && dg && (flags & RMS_DG_NARROW)) { /* one row */
        const C r = ((const C *)rstd)[0];
        FN(bwdp)(dy, x, w, dx, r, (C)rms_bwd_c(FN(dot)(dy, x, w, r, k, flags, NULL), k), dg, k,
                 flags);
        return;
    }
    const int stream = (flags & RMS_STREAM) && FN(stream_rows)(dx, dxs, k);
    const int store = (flags & RMS_DG_STORE) != 0;
#define RMS_CALL(hw, hg)                                                                   \
    do {                                                                                   \
        if (RMS_KCONST && (hw) == 1 && (hg) && k == 64)                                    \
            RMS_CALLK(hw, hg, 64);                                                         \
        else if (RMS_KCONST && (hw) == 1 && (hg) && k == 128)                              \
            RMS_CALLK(hw, hg, 128);                                                        \
        else                                                                               \
            RMS_CALLK(hw, hg, k);                                                          \
    } while (0)
#define RMS_CALLK(hw, hg, kk)                                                              \
    FN(bwd_loop)((const T *)dy, dys, (const T *)x, xs, (T *)dx, dxs, w, (const C *)rstd,   \
                 (C *)dg, m, kk, stream, store, hw, hg)
    const int hw = RMS_HW(flags);
    RMS_BWD_OPTS(RMS_CALL);
#undef RMS_CALL
#undef RMS_CALLK
    if (stream)
        V_FENCE();
}

/* ---------------------------------------------------------------- weights */

__attribute__((unused)) static void FN(widen)(const void *src, void *dst, double offset,
                                              size_t n) {
    const T *s = (const T *)src;
    C *d = (C *)dst;
    const V off = V_SET((C)offset);
    size_t i = 0;
    for (; i + W <= n; i += W)
        VC_ST(d + i, V_ADD(off, V_LD(s + i)));
    if (i < n)
        VC_STP(d + i, V_ADD(off, V_LDP(s + i, n - i)), n - i);
}

static void FN(narrow)(const void *src, void *dst, size_t n) {
    const C *s = (const C *)src;
    T *d = (T *)dst;
    size_t i = 0;
    for (; i + W <= n; i += W)
        V_ST(d + i, VC_LD(s + i));
    if (i < n)
        V_STP(d + i, VC_LDP(s + i, n - i), n - i);
}

#undef FN
#undef LDX
#undef LDCX
#undef STX
#undef STCX
#undef RMS_PASS
#undef RMS_BWD_OPTS
#undef T
#undef C
#undef SFX
#undef V_LD
#undef V_LDP
#undef V_ST
#undef V_STP
#undef V_STNT
#undef V_PK2
#undef V_PK2_PLAIN
#undef V_SQ2
#undef V_RND
#undef S_LD
#undef S_RND
