/* The kernel bodies, written once and instantiated for every dtype x ISA.
 *
 * The including ISA file defines, before each inclusion:
 *   RMS_DT, RMS_SFX      dtype (RMS_DT_*) and the symbol suffix, e.g. f32_avx2
 *   W, V                 lanes and vector type of the compute type
 *   V_LD(p), V_ST(p, v)  load W storage elements widened to V / round V (nearest even) and store
 *   V_STNT(p, v), V_STB  non-temporal store, and its required alignment in bytes
 *   V_RND(v)             round V through the storage type and back (identity for f32 / f64)
 *   V_LDC, V_STC, V_SET, V_ADD, V_SUB, V_MUL, V_FENCE()   compute-type vector helpers
 *   V_FMA(a, b, c)       a * b + c
 *   A, A_ZERO, A_ADD, A_SUM   float64 accumulators (two per compute vector when C is float)
 *   A_WIDEN(l, h, v)     l, h += v widened to float64 (l += v when C is double)
 * Row sums end in float64: short runs of compute-type FMAs in several independent accumulators
 * (hiding FMA latency) are flushed into float64 before they can lose accuracy, so the sum is
 * far more accurate than the float32 the result is stored in. Tails go through a zero-padded
 * stack vector, so any length works. */

#include <math.h>
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
#define RMS_PREFETCH(p) __builtin_prefetch((p), 0, 2)
enum { RMS_SQ, RMS_ADDSQ, RMS_DOT, RMS_DOTW };
/* The table row for one dtype of one ISA. */
#define RMS_ENTRY(sfx)                                                                         \
    {                                                                                          \
        fwd_rows_##sfx, add_rows_##sfx, bwd_rows_##sfx, sumsq_##sfx, scale_##sfx,              \
            add_sumsq_##sfx, add_scale_##sfx, rescue_##sfx, dot_##sfx, bwd_##sfx               \
    }
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

/* Copies the n < W leftover elements into a zeroed vector-sized buffer. */
#define RMS_PAD(buf, src, n)                                                                   \
    do {                                                                                       \
        memset((buf), 0, sizeof(buf));                                                         \
        memcpy((buf), (src), (n) * sizeof((buf)[0]));                                          \
    } while (0)

/* The row reductions (RMS_SQ, RMS_ADDSQ, RMS_DOT, RMS_DOTW): sum of squares of x, of
 * h = round(x + r), and sum(dy * w * x). The two factors of element i's term: */
RMS_INLINE void FN(factors)(const T *a, const T *b, const C *w, size_t i, const int kind, V *u,
                            V *v) {
    if (kind == RMS_SQ) {
        *u = *v = V_LD(a + i);
    } else if (kind == RMS_ADDSQ) {
        *u = *v = V_RND(V_ADD(V_LD(a + i), V_LD(b + i)));
    } else {
        *u = kind == RMS_DOTW ? V_MUL(V_LD(a + i), V_LDC(w + i)) : V_LD(a + i);
        *v = V_LD(b + i);
    }
}

/* Four compute-type accumulators, flushed into float64 every RMS_BLOCK vectors so that each
 * float32 lane adds at most a few terms before the wide sum. */
#define RMS_BLOCK 32

RMS_INLINE double FN(reduce)(const T *a, const T *b, const C *w, size_t n, const int kind) {
    A l0 = A_ZERO, h0 = A_ZERO, l1 = A_ZERO, h1 = A_ZERO;
    V u0, v0, u1, v1, u2, v2, u3, v3;
    size_t i = 0;
    while (i + 4 * W <= n) {
        V a0 = V_SET((C)0), a1 = a0, a2 = a0, a3 = a0;
        size_t stop = n - i >= RMS_BLOCK * W ? i + RMS_BLOCK * W : n;
        for (; i + 4 * W <= stop; i += 4 * W) {
            FN(factors)(a, b, w, i, kind, &u0, &v0);
            FN(factors)(a, b, w, i + W, kind, &u1, &v1);
            FN(factors)(a, b, w, i + 2 * W, kind, &u2, &v2);
            FN(factors)(a, b, w, i + 3 * W, kind, &u3, &v3);
            a0 = V_FMA(u0, v0, a0);
            a1 = V_FMA(u1, v1, a1);
            a2 = V_FMA(u2, v2, a2);
            a3 = V_FMA(u3, v3, a3);
        }
        A_WIDEN(l0, h0, V_ADD(a0, a1));
        A_WIDEN(l1, h1, V_ADD(a2, a3));
    }
    for (; i + W <= n; i += W) {
        FN(factors)(a, b, w, i, kind, &u0, &v0);
        A_WIDEN(l0, h0, V_MUL(u0, v0));
    }
    if (i < n) {
        T ab[W], bb[W];
        C wb[W];
        RMS_PAD(ab, a + i, n - i);
        if (kind != RMS_SQ)
            RMS_PAD(bb, b + i, n - i);
        if (kind == RMS_DOTW)
            RMS_PAD(wb, w + i, n - i);
        FN(factors)(ab, bb, wb, 0, kind, &u0, &v0);
        A_WIDEN(l1, h1, V_MUL(u0, v0));
    }
    return A_SUM(A_ADD(A_ADD(l0, h0), A_ADD(l1, h1)));
}

static double FN(sumsq)(const void *x, size_t n) {
    return FN(reduce)((const T *)x, NULL, NULL, n, RMS_SQ);
}

/* y = (x * r) * w over n elements; the constant flags make eight specialised loops. */
RMS_INLINE void FN(scale_span)(const T *x, T *y, const C *w, V vr, size_t n, const T *pf,
                               const int hasw, const int before, const int nt) {
    size_t i = 0;
    for (; i + W <= n; i += W) {
        if (pf)
            RMS_PREFETCH(pf + i);
        V t = V_MUL(V_LD(x + i), vr);
        if (before)
            t = V_RND(t);
        if (hasw)
            t = V_MUL(t, V_LDC(w + i));
        if (nt)
            V_STNT(y + i, t);
        else
            V_ST(y + i, t);
    }
    if (i < n) {
        T xb[W], yb[W];
        C wb[W];
        RMS_PAD(xb, x + i, n - i);
        V t = V_MUL(V_LD(xb), vr);
        if (before)
            t = V_RND(t);
        if (hasw) {
            RMS_PAD(wb, w + i, n - i);
            t = V_MUL(t, V_LDC(wb));
        }
        V_ST(yb, t);
        memcpy(y + i, yb, (n - i) * sizeof(T));
    }
}

/* Elements to store normally before `p` reaches the streaming alignment; (size_t)-1 when `p`
 * can never get there (not even element-aligned) and streaming is off. */
static inline size_t FN(stream_head)(const T *p, size_t n) {
    size_t mis = (size_t)((uintptr_t)p % V_STB);
    if (mis % sizeof(T))
        return (size_t)-1;
    size_t head = mis ? (V_STB - mis) / sizeof(T) : 0;
    return head < n ? head : n;
}

#define RMS_SCALE_CASE(hw, bf)                                                                 \
    do {                                                                                       \
        FN(scale_span)(x, y, w, vr, head, pf, hw, bf, 0);                                      \
        const T *pf1 = pf ? pf + head : NULL;                                                  \
        if (stream)                                                                            \
            FN(scale_span)(x + head, y + head, hw ? w + head : w, vr, n - head, pf1, hw, bf, 1); \
        else                                                                                   \
            FN(scale_span)(x + head, y + head, hw ? w + head : w, vr, n - head, pf1, hw, bf, 0); \
    } while (0)

/* One row's scaling without the store fence (row loops fence once at the end). While the row
 * is rescaled from cache, `pf` (the next row, or NULL) is prefetched so that memory stays busy. */
static void FN(scale_row)(const T *x, T *y, const C *w, C r, size_t n, const T *pf, int flags) {
    V vr = V_SET(r);
    size_t head = 0;
    int stream = 0;
    if (flags & RMS_STREAM) {
        head = FN(stream_head)(y, n);
        stream = head != (size_t)-1;
        if (!stream)
            head = 0;
    }
    int before = (flags & RMS_CAST_BEFORE) != 0;
    if (w) {
        if (before) RMS_SCALE_CASE(1, 1); else RMS_SCALE_CASE(1, 0);
    } else {
        if (before) RMS_SCALE_CASE(0, 1); else RMS_SCALE_CASE(0, 0);
    }
}

static void FN(scale)(const void *x, void *y, const void *w, double r, size_t n, int flags) {
    FN(scale_row)((const T *)x, (T *)y, (const C *)w, (C)r, n, NULL, flags);
    if (flags & RMS_STREAM)
        V_FENCE();
}

static double FN(rescue)(const void *xv, const void *rv, size_t n, double eps) {
    const T *x = (const T *)xv, *r = (const T *)rv;
    double amax = 0.0;
    for (size_t i = 0; i < n; i++) {
        double v = r ? (double)S_RND((C)(S_LD(x + i) + S_LD(r + i))) : (double)S_LD(x + i);
        if (!(fabs(v) <= 1.79769313486231570e308)) /* Inf or NaN in the row */
            return NAN;
        amax = fabs(v) > amax ? fabs(v) : amax;
    }
    double s = 0.0; /* every value finite: only the squares overflowed, so rescale */
    for (size_t i = 0; i < n; i++) {
        double v = r ? (double)S_RND((C)(S_LD(x + i) + S_LD(r + i))) : (double)S_LD(x + i);
        s += (v / amax) * (v / amax);
    }
    return 1.0 / (amax * sqrt(s / (double)n + eps / amax / amax));
}

RMS_INLINE double FN(rstd)(double ss, const T *x, const T *r, size_t n, double eps) {
    return isfinite(ss) ? 1.0 / sqrt(ss / (double)n + eps) : FN(rescue)(x, r, n, eps);
}

static void FN(fwd_rows)(const void *xv, ptrdiff_t xs, void *yv, ptrdiff_t ys, const void *w,
                         void *rstdv, size_t m, size_t k, double eps, int flags) {
    const T *x = (const T *)xv;
    T *y = (T *)yv;
    C *rstd = (C *)rstdv;
    for (size_t i = 0; i < m; i++) {
        const T *xr = x + (ptrdiff_t)i * xs;
        C r = (C)FN(rstd)(FN(sumsq)(xr, k), xr, NULL, k, eps);
        rstd[i] = r;
        FN(scale_row)(xr, y + (ptrdiff_t)i * ys, (const C *)w, r, k, i + 1 < m ? xr + xs : NULL,
                      flags);
    }
    if (flags & RMS_STREAM)
        V_FENCE();
}

/* Residual add: h = round(x + r). The first pass only reads; the second recomputes h from the
 * cached row, so h and y can both be streamed and h may alias x or r. */
static double FN(add_sumsq)(const void *x, const void *r, size_t n) {
    return FN(reduce)((const T *)x, (const T *)r, NULL, n, RMS_ADDSQ);
}

RMS_INLINE void FN(add_span)(const T *x, const T *r, T *h, T *y, const C *w, V vr, size_t n,
                             const int hasw, const int before, const int nt) {
    size_t i = 0;
    for (; i + W <= n; i += W) {
        V hv = V_RND(V_ADD(V_LD(x + i), V_LD(r + i)));
        V t = V_MUL(hv, vr);
        if (before)
            t = V_RND(t);
        if (hasw)
            t = V_MUL(t, V_LDC(w + i));
        if (nt) {
            V_STNT(h + i, hv);
            V_STNT(y + i, t);
        } else {
            V_ST(h + i, hv);
            V_ST(y + i, t);
        }
    }
    if (i < n) {
        T xb[W], rb[W], hb[W], yb[W];
        C wb[W];
        RMS_PAD(xb, x + i, n - i);
        RMS_PAD(rb, r + i, n - i);
        V hv = V_RND(V_ADD(V_LD(xb), V_LD(rb)));
        V t = V_MUL(hv, vr);
        if (before)
            t = V_RND(t);
        if (hasw) {
            RMS_PAD(wb, w + i, n - i);
            t = V_MUL(t, V_LDC(wb));
        }
        V_ST(hb, hv);
        V_ST(yb, t);
        memcpy(h + i, hb, (n - i) * sizeof(T));
        memcpy(y + i, yb, (n - i) * sizeof(T));
    }
}

#define RMS_ADD_CASE(hw, bf)                                                                   \
    do {                                                                                       \
        FN(add_span)(x, r, h, y, w, vr, head, hw, bf, 0);                                      \
        if (stream)                                                                            \
            FN(add_span)(x + head, r + head, h + head, y + head, hw ? w + head : w, vr,        \
                         n - head, hw, bf, 1);                                                 \
        else                                                                                   \
            FN(add_span)(x + head, r + head, h + head, y + head, hw ? w + head : w, vr,        \
                         n - head, hw, bf, 0);                                                 \
    } while (0)

static void FN(add_scale_row)(const T *x, const T *r, T *h, T *y, const C *w, C rs, size_t n,
                              int flags) {
    V vr = V_SET(rs);
    size_t head = 0;
    int stream = 0;
    if (flags & RMS_STREAM) {
        head = FN(stream_head)(y, n);
        /* both outputs must reach the alignment at the same element */
        stream = head != (size_t)-1 && head == FN(stream_head)(h, n);
        if (!stream)
            head = 0;
    }
    int before = (flags & RMS_CAST_BEFORE) != 0;
    if (w) {
        if (before) RMS_ADD_CASE(1, 1); else RMS_ADD_CASE(1, 0);
    } else {
        if (before) RMS_ADD_CASE(0, 1); else RMS_ADD_CASE(0, 0);
    }
}

static void FN(add_scale)(const void *x, const void *r, void *h, void *y, const void *w,
                          double rs, size_t n, int flags) {
    FN(add_scale_row)((const T *)x, (const T *)r, (T *)h, (T *)y, (const C *)w, (C)rs, n, flags);
    if (flags & RMS_STREAM)
        V_FENCE();
}

static void FN(add_rows)(const void *xv, ptrdiff_t xs, const void *rv, ptrdiff_t rs, void *hv,
                         ptrdiff_t hs, void *yv, ptrdiff_t ys, const void *w, void *rstdv,
                         size_t m, size_t k, double eps, int flags) {
    const T *x = (const T *)xv, *r = (const T *)rv;
    T *h = (T *)hv, *y = (T *)yv;
    C *rstd = (C *)rstdv;
    for (size_t i = 0; i < m; i++) {
        const T *xr = x + (ptrdiff_t)i * xs, *rr = r + (ptrdiff_t)i * rs;
        C q = (C)FN(rstd)(FN(add_sumsq)(xr, rr, k), xr, rr, k, eps);
        rstd[i] = q;
        FN(add_scale_row)(xr, rr, h + (ptrdiff_t)i * hs, y + (ptrdiff_t)i * ys, (const C *)w, q,
                          k, flags);
    }
    if (flags & RMS_STREAM)
        V_FENCE();
}

/* Backward. Per row, s = sum(dy * w * x); then dx = r * dy * w - (r^3 s / k) * x, and the
 * dgamma partial row gains dy * x * r in the same pass. */
static double FN(dot)(const void *dy, const void *x, const void *w, size_t n) {
    if (w)
        return FN(reduce)((const T *)dy, (const T *)x, (const C *)w, n, RMS_DOTW);
    return FN(reduce)((const T *)dy, (const T *)x, NULL, n, RMS_DOT);
}

RMS_INLINE V FN(bwd_elem)(V dyv, V xv, V wv, V vr, V vc, C *dg, const int hasw, const int hasdg) {
    V g = hasw ? V_MUL(dyv, wv) : dyv;
    if (hasdg)
        V_STC(dg, V_ADD(V_LDC(dg), V_MUL(V_MUL(dyv, xv), vr)));
    return V_SUB(V_MUL(vr, g), V_MUL(vc, xv));
}

RMS_INLINE void FN(bwd_span)(const T *dy, const T *x, const C *w, T *dx, V vr, V vc, C *dg,
                             size_t n, const T *pdy, const T *px, const int hasw, const int hasdg,
                             const int nt) {
    size_t i = 0;
    V one = V_SET((C)1);
    for (; i + W <= n; i += W) {
        if (pdy) {
            RMS_PREFETCH(pdy + i);
            RMS_PREFETCH(px + i);
        }
        V o = FN(bwd_elem)(V_LD(dy + i), V_LD(x + i), hasw ? V_LDC(w + i) : one, vr, vc,
                           hasdg ? dg + i : dg, hasw, hasdg);
        if (nt)
            V_STNT(dx + i, o);
        else
            V_ST(dx + i, o);
    }
    if (i < n) {
        T db[W], xb[W], ob[W];
        C wb[W], gb[W];
        RMS_PAD(db, dy + i, n - i);
        RMS_PAD(xb, x + i, n - i);
        if (hasw)
            RMS_PAD(wb, w + i, n - i);
        if (hasdg)
            RMS_PAD(gb, dg + i, n - i);
        V_ST(ob, FN(bwd_elem)(V_LD(db), V_LD(xb), hasw ? V_LDC(wb) : one, vr, vc, gb, hasw,
                              hasdg));
        memcpy(dx + i, ob, (n - i) * sizeof(T));
        if (hasdg)
            memcpy(dg + i, gb, (n - i) * sizeof(C));
    }
}

#define RMS_BWD_CASE(hw, hg)                                                                   \
    do {                                                                                       \
        FN(bwd_span)(dy, x, w, dx, vr, vc, dg, head, pdy, px, hw, hg, 0);                      \
        const C *w1 = hw ? w + head : w;                                                       \
        C *g1 = hg ? dg + head : dg;                                                           \
        const T *pdy1 = pdy ? pdy + head : NULL, *px1 = pdy ? px + head : NULL;                \
        if (stream)                                                                            \
            FN(bwd_span)(dy + head, x + head, w1, dx + head, vr, vc, g1, n - head, pdy1, px1,  \
                         hw, hg, 1);                                                           \
        else                                                                                   \
            FN(bwd_span)(dy + head, x + head, w1, dx + head, vr, vc, g1, n - head, pdy1, px1,  \
                         hw, hg, 0);                                                           \
    } while (0)

/* dx for one row (and its dgamma terms when dg is set); prefetches the next row's dy and x
 * (pdy, px) while this one is read from cache. */
static void FN(bwd_row)(const T *dy, const T *x, const C *w, T *dx, C r, C c, C *dg, size_t n,
                        const T *pdy, const T *px, int flags) {
    V vr = V_SET(r), vc = V_SET(c);
    size_t head = 0;
    int stream = 0;
    if (flags & RMS_STREAM) {
        head = FN(stream_head)(dx, n);
        stream = head != (size_t)-1;
        if (!stream)
            head = 0;
    }
    if (w && dg)
        RMS_BWD_CASE(1, 1);
    else if (w)
        RMS_BWD_CASE(1, 0);
    else
        RMS_BWD_CASE(0, 0);
}

static void FN(bwd)(const void *dy, const void *x, const void *w, void *dx, double r, double c,
                    void *dg, size_t n, int flags) {
    FN(bwd_row)((const T *)dy, (const T *)x, (const C *)w, (T *)dx, (C)r, (C)c, (C *)dg, n, NULL,
                NULL, flags);
    if (flags & RMS_STREAM)
        V_FENCE();
}

static void FN(bwd_rows)(const void *dyv, ptrdiff_t dys, const void *xv, ptrdiff_t xs,
                         void *dxv, ptrdiff_t dxs, const void *w, const void *rstdv, void *dg,
                         size_t m, size_t k, int flags) {
    const T *dy = (const T *)dyv, *x = (const T *)xv;
    T *dx = (T *)dxv;
    const C *rstd = (const C *)rstdv;
    for (size_t i = 0; i < m; i++) {
        const T *dyr = dy + (ptrdiff_t)i * dys, *xr = x + (ptrdiff_t)i * xs;
        int last = i + 1 == m;
        double r = (double)rstd[i];
        double c = r * r * r * FN(dot)(dyr, xr, w, k) / (double)k;
        FN(bwd_row)(dyr, xr, (const C *)w, dx + (ptrdiff_t)i * dxs, (C)r, (C)c, (C *)dg, k,
                    last ? NULL : dyr + dys, last ? NULL : xr + xs, flags);
    }
    if (flags & RMS_STREAM)
        V_FENCE();
}

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
