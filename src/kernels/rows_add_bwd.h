/* The residual add and the backward row loops: the second half of rows_impl.h, included by it
 * once per dtype x ISA with the same macros in force (see there). */

/* ---------------------------------------------------------------- residual add */

/* Residual add: h = round(x + r). The first pass only reads; the second recomputes h from the
 * cached row, so h and y can both be streamed and h may alias x or r. */
RMS_INLINE V FN(add_val)(const T *x, const T *r, const void *w, V vr, size_t t, const int hasw,
                         const int before, V *h) {
    *h = V_RND(V_ADD(LDX(x, t), LDX(r, t)));
    V v = V_MUL(*h, vr);
    if (before)
        v = V_RND(v);
    return hasw ? V_MUL(v, LDW(w, t, hasw)) : v;
}

RMS_INLINE void FN(add_vec)(const T *x, const T *r, T *h, T *y, const void *w, V vr, size_t t,
                            const int hasw, const int before, const int nt) {
    V hv, v = FN(add_val)(x, r, w, vr, t, hasw, before, &hv);
    FN(put)(h, hv, t, nt);
    FN(put)(y, v, t, nt);
}

RMS_INLINE void FN(add_span)(const T *x, const T *r, T *h, T *y, const void *w, V vr, size_t n,
                             size_t head, const T *pfx, const T *pfr, const int hasw,
                             const int before, const int nt) {
    size_t i = head;
    const int near = FN(near)(n, RMS_P_ADD);
    if (head)
        FN(add_vec)(x, r, h, y, w, vr, head, hasw, before, 0);
#ifdef V_ST2
    for (; i + 2 * W <= n; i += 2 * W) {
        FN(pf2)(pfx, pfr, i, near);
        V h0, h1, v0 = FN(add_val)(x + i, r + i, W_AT(w, i, hasw), vr, W, hasw, before, &h0);
        V v1 = FN(add_val)(x + i + W, r + i + W, W_AT(w, i + W, hasw), vr, W, hasw, before, &h1);
        V_ST2(h + i, h0, h1, nt);
        V_ST2(y + i, v0, v1, nt);
    }
#endif
    for (; i + W <= n; i += W) {
        FN(pf2)(pfx, pfr, i, near);
        FN(add_vec)(x + i, r + i, h + i, y + i, W_AT(w, i, hasw), vr, W, hasw, before, nt);
    }
    if (i < n)
        FN(add_vec)(x + i, r + i, h + i, y + i, W_AT(w, i, hasw), vr, n - i, hasw, before, 0);
}

static void FN(add_scale)(const void *x, const void *r, void *h, void *y, const void *w,
                          double rs, size_t n, int flags) {
    size_t head;
    int opt = FN(opts)(w, flags, FN(plan_stream)((T *)y, (T *)h, n, flags, &head));
#define RMS_X(hw, bf, nt)                                                                          \
    FN(add_span)((const T *)x, (const T *)r, (T *)h, (T *)y, w, V_SET((C)rs), n, head, NULL, NULL, \
                 hw, bf, nt)
    RMS_SWITCH3(opt, flags, RMS_X);
#undef RMS_X
}

RMS_INLINE void FN(add_row)(const T *x, ptrdiff_t xs, const T *r, ptrdiff_t rs, T *h,
                            ptrdiff_t hs, T *y, ptrdiff_t ys, const void *w, const C *rstd,
                            size_t i, size_t m, size_t k, size_t d, const int hasw,
                            const int before, const int nt) {
    const T *xr = x + (ptrdiff_t)i * xs, *rr = r + (ptrdiff_t)i * rs;
    T *hr = h + (ptrdiff_t)i * hs, *yr = y + (ptrdiff_t)i * ys;
    int last = i + d >= m;
    const T *px = last ? NULL : xr + (ptrdiff_t)d * xs, *pr = last ? NULL : rr + (ptrdiff_t)d * rs;
    size_t head;
    V vr = V_SET(rstd[i]);
    if (nt && FN(plan_stream)(yr, hr, k, RMS_STREAM, &head))
        FN(add_span)(xr, rr, hr, yr, w, vr, k, head, px, pr, hasw, before, nt);
    else
        FN(add_span)(xr, rr, hr, yr, w, vr, k, 0, px, pr, hasw, before, 0);
}

/* Pipelined by group for short rows, as fwd_loop is. */
RMS_INLINE void FN(add_loop)(const T *x, ptrdiff_t xs, const T *r, ptrdiff_t rs, T *h,
                             ptrdiff_t hs, T *y, ptrdiff_t ys, const void *w, C *rstd, size_t m,
                             size_t k, double eps, const int hasw, const int before,
                             const int nt) {
    size_t g = FN(group)(2 * k), d = FN(ahead)(g, k, RMS_P_ADD), n = 0;
    const double inv_k = rms_inv_pow2(k);
    const int pipe = k * sizeof(T) < RMS_PIPE_BYTES;
    double ss[RMS_GROUP];
    for (size_t i = 0; i < m; i += g) {
        if (!pipe || i == 0) {
            n = rms_group_rows(i, m, g);
            for (size_t j = 0; j < n; j++)
                ss[j] = FN(reduce)(x + (ptrdiff_t)(i + j) * xs, r + (ptrdiff_t)(i + j) * rs, NULL,
                                   (C)1, k, RMS_ADDSQ);
        }
        for (size_t j = 0; j < n; j++)
            rstd[i + j] = (C)FN(rstd)(ss[j], x + (ptrdiff_t)(i + j) * xs,
                                      r + (ptrdiff_t)(i + j) * rs, k, eps, inv_k);
        size_t next = i + g, n2 = pipe ? rms_group_rows(next, m, g) : 0;
        for (size_t j = 0; j < n; j++) {
            if (j < n2)
                ss[j] = FN(reduce)(x + (ptrdiff_t)(next + j) * xs, r + (ptrdiff_t)(next + j) * rs,
                                   NULL, (C)1, k, RMS_ADDSQ);
            FN(add_row)(x, xs, r, rs, h, hs, y, ys, w, rstd, i + j, m, k, d, hasw, before, nt);
        }
        n = n2;
    }
}

static void FN(add_rows)(const void *x, ptrdiff_t xs, const void *r, ptrdiff_t rs, void *h,
                         ptrdiff_t hs, void *y, ptrdiff_t ys, const void *w, void *rstd,
                         size_t m, size_t k, double eps, int flags) {
    int opt = FN(opts)(w, flags, flags & RMS_STREAM);
#define RMS_X(hw, bf, nt)                                                                          \
    FN(add_loop)((const T *)x, xs, (const T *)r, rs, (T *)h, hs, (T *)y, ys, w,                    \
                 (C *)rstd, m, k, eps, hw, bf, nt)
    RMS_SWITCH3(opt, flags, RMS_X);
#undef RMS_X
}

/* ---------------------------------------------------------------- backward */

/* dx = r * (g - xhat * c), given vnc = -c: one explicit FMA, so that the compiler has no product
 * left to fuse in one place and not in another, and every path gives the same bits. */
RMS_INLINE V FN(dx_val)(V g, V xh, V vr, V vnc) { return V_MUL(vr, V_FMA(xh, vnc, g)); }

/* Per row, with xhat = x * r and g = dy * w: c = mean(g * xhat), dx = r * (g - xhat * c), and
 * the dgamma partial row gains dy * xhat in the same pass (hasdg 1; hasdg 2 stores it). Every
 * intermediate stays near the scale of dy, so huge or tiny rows neither overflow nor underflow. */
RMS_INLINE V FN(bwd_val)(const T *dy, const T *x, const void *w, C *dg, V vr, V vnc, size_t t,
                         const int hasw, const int hasdg) {
    V dyv = LDX(dy, t), xh = V_MUL(LDX(x, t), vr);
    V g = hasw ? V_MUL(dyv, LDW(w, t, hasw)) : dyv;
    if (hasdg == 1)
        STCX(dg, V_FMA(dyv, xh, LDCX(dg, t)), t);
    else if (hasdg == 2)
        STCX(dg, V_MUL(dyv, xh), t);
    return FN(dx_val)(g, xh, vr, vnc);
}

RMS_INLINE void FN(bwd_span)(const T *dy, const T *x, const void *w, T *dx, C *dg, V vr, V vnc,
                             size_t n, size_t head, const T *pdy, const T *px, const int hasw,
                             const int hasdg, const int nt) {
    size_t i = head;
    const int near = FN(near)(n, RMS_P_BWD);
    if (head)
        FN(put)(dx, FN(bwd_val)(dy, x, w, dg, vr, vnc, head, hasw, hasdg), head, 0);
#ifdef V_ST2
    for (; i + 2 * W <= n; i += 2 * W) {
        FN(pf2)(pdy, px, i, near);
        V o0 = FN(bwd_val)(dy + i, x + i, W_AT(w, i, hasw), hasdg ? dg + i : dg, vr, vnc, W, hasw,
                           hasdg);
        V o1 = FN(bwd_val)(dy + i + W, x + i + W, W_AT(w, i + W, hasw),
                           hasdg ? dg + i + W : dg, vr, vnc, W, hasw, hasdg);
        V_ST2(dx + i, o0, o1, nt);
    }
#endif
    for (; i + W <= n; i += W) {
        FN(pf2)(pdy, px, i, near);
        FN(put)(dx + i,
                FN(bwd_val)(dy + i, x + i, W_AT(w, i, hasw), hasdg ? dg + i : dg, vr, vnc, W,
                            hasw, hasdg),
                W, nt);
    }
    if (i < n)
        FN(put)(dx + i,
                FN(bwd_val)(dy + i, x + i, W_AT(w, i, hasw), hasdg ? dg + i : dg, vr, vnc, n - i,
                            hasw, hasdg),
                n - i, 0);
}

/* X(hasw, hasdg, nt) with constant arguments for o = (hasw != 0) | hasdg << 1 | nt << 3 |
 * (hasw == 2) << 4, where hasdg is 0 (none), 1 (accumulate into dg) or 2 (store: one row) and
 * needs a weight; then the fence. */
#define RMS_SWITCH_BWD(o, flags, X)                                                                \
    do {                                                                                           \
        switch (o) {                                                                               \
        case 0: X(0, 0, 0); break;                                                                 \
        case 8: X(0, 0, 1); break;                                                                 \
        case 1: X(1, 0, 0); break;                                                                 \
        case 9: X(1, 0, 1); break;                                                                 \
        case 3: X(1, 1, 0); break;                                                                 \
        case 11: X(1, 1, 1); break;                                                                \
        case 5: X(1, 2, 0); break;                                                                 \
        case 13: X(1, 2, 1); break;                                                                \
        case 17: X(RMS_HW_S, 0, 0); break;                                                         \
        case 25: X(RMS_HW_S, 0, 1); break;                                                         \
        case 19: X(RMS_HW_S, 1, 0); break;                                                         \
        case 27: X(RMS_HW_S, 1, 1); break;                                                         \
        case 21: X(RMS_HW_S, 2, 0); break;                                                         \
        default: X(RMS_HW_S, 2, 1); break;                                                         \
        }                                                                                          \
        if ((flags) & RMS_STREAM)                                                                  \
            V_FENCE();                                                                             \
    } while (0)

static inline int FN(bwd_opt)(const void *w, const void *dg, int flags, int nt) {
    int hasdg = w && dg ? ((flags & RMS_DG_STORE) ? 2 : 1) : 0;
    return (w ? 1 : 0) | (hasdg << 1) | (nt ? 8 : 0) | (w && (flags & RMS_W_STORAGE) ? 16 : 0);
}

static void FN(bwd)(const void *dy, const void *x, const void *w, void *dx, double r, double c,
                    void *dg, size_t n, int flags) {
    size_t head;
    int opt = FN(bwd_opt)(w, dg, flags, FN(plan_stream)((T *)dx, NULL, n, flags, &head));
#define RMS_X(hw, hg, nt)                                                                          \
    FN(bwd_span)((const T *)dy, (const T *)x, w, (T *)dx, (C *)dg, V_SET((C)r),                    \
                 V_SET((C)-c), n, head, NULL, NULL, hw, hg, nt)
    RMS_SWITCH_BWD(opt, flags, RMS_X);
#undef RMS_X
}

RMS_INLINE void FN(bwd_row)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, T *dx,
                            ptrdiff_t dxs, const void *w, const C *rstd, C *dg, double c, size_t i,
                            size_t m, size_t k, size_t d, const int hasw, const int hasdg,
                            const int nt) {
    const T *dyr = dy + (ptrdiff_t)i * dys, *xr = x + (ptrdiff_t)i * xs;
    T *dxr = dx + (ptrdiff_t)i * dxs;
    int last = i + d >= m;
    const T *pdy = last ? NULL : dyr + (ptrdiff_t)d * dys,
            *px = last ? NULL : xr + (ptrdiff_t)d * xs;
    V vr = V_SET(rstd[i]), vnc = V_SET((C)-c);
    size_t head;
    if (nt && FN(plan_stream)(dxr, NULL, k, RMS_STREAM, &head))
        FN(bwd_span)(dyr, xr, w, dxr, dg, vr, vnc, k, head, pdy, px, hasw, hasdg, nt);
    else
        FN(bwd_span)(dyr, xr, w, dxr, dg, vr, vnc, k, 0, pdy, px, hasw, hasdg, 0);
}

/* t elements of two rows (a at dy, x -> dx; b one stride further) at once, accumulating
 * dgamma: the weight and the dgamma row are loaded and stored once for both, and dg gains row a's
 * term, then row b's, as it does row by row. */
RMS_INLINE void FN(bwd_pair_vec)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, T *dx,
                                 ptrdiff_t dxs, const void *w, C *dg, V vr0, V vnc0, V vr1,
                                 V vnc1, size_t t, const int hasw, const int nt) {
    V dyv0 = LDX(dy, t), xh0 = V_MUL(LDX(x, t), vr0);
    V dyv1 = LDX(dy + dys, t), xh1 = V_MUL(LDX(x + xs, t), vr1);
    V wv = LDW(w, t, hasw);
    STCX(dg, V_FMA(dyv1, xh1, V_FMA(dyv0, xh0, LDCX(dg, t))), t);
    FN(put)(dx, FN(dx_val)(V_MUL(dyv0, wv), xh0, vr0, vnc0), t, nt);
    FN(put)(dx + dxs, FN(dx_val)(V_MUL(dyv1, wv), xh1, vr1, vnc1), t, nt);
}

/* The second pass of two rows, as bwd_span is of one; pdy, px: the rows to prefetch, or NULL. */
RMS_INLINE void FN(bwd_pair_span)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, T *dx,
                                  ptrdiff_t dxs, const void *w, C *dg, V vr0, V vnc0, V vr1,
                                  V vnc1, size_t n, size_t head, const T *pdy, const T *px,
                                  const int hasw, const int nt) {
    size_t i = head;
    const int near = FN(near)(n, RMS_P_BWD);
    if (head)
        FN(bwd_pair_vec)(dy, dys, x, xs, dx, dxs, w, dg, vr0, vnc0, vr1, vnc1, head, hasw, 0);
    for (; i + W <= n; i += W) {
        FN(pf2)(pdy, px, i, near);
        FN(pf2)(pdy ? pdy + dys : NULL, px ? px + xs : NULL, i, near);
        FN(bwd_pair_vec)(dy + i, dys, x + i, xs, dx + i, dxs, W_AT(w, i, hasw), dg + i, vr0,
                         vnc0, vr1, vnc1, W, hasw, nt);
    }
    if (i < n)
        FN(bwd_pair_vec)(dy + i, dys, x + i, xs, dx + i, dxs, W_AT(w, i, hasw), dg + i, vr0,
                         vnc0, vr1, vnc1, n - i, hasw, 0);
}

/* Rows i and i + 1 (with a weight, accumulating dgamma), given their c; as bwd_row is of one. */
RMS_INLINE void FN(bwd_pair)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, T *dx,
                             ptrdiff_t dxs, const void *w, const C *rstd, C *dg, double c0,
                             double c1, size_t i, size_t m, size_t k, size_t d, const int hasw,
                             const int nt) {
    const T *dyr = dy + (ptrdiff_t)i * dys, *xr = x + (ptrdiff_t)i * xs;
    T *dxr = dx + (ptrdiff_t)i * dxs;
    int last = i + 1 + d >= m;
    const T *pdy = last ? NULL : dyr + (ptrdiff_t)d * dys,
            *px = last ? NULL : xr + (ptrdiff_t)d * xs;
    V vr0 = V_SET(rstd[i]), vnc0 = V_SET((C)-c0), vr1 = V_SET(rstd[i + 1]), vnc1 = V_SET((C)-c1);
    size_t head, head1;
    if (nt && FN(plan_stream)(dxr, NULL, k, RMS_STREAM, &head) &&
        FN(plan_stream)(dxr + dxs, NULL, k, RMS_STREAM, &head1)) {
        if (head == head1) {
            FN(bwd_pair_span)(dyr, dys, xr, xs, dxr, dxs, w, dg, vr0, vnc0, vr1, vnc1, k, head,
                              pdy, px, hasw, nt);
        } else { /* rows that align differently go one at a time */
            FN(bwd_row)(dy, dys, x, xs, dx, dxs, w, rstd, dg, c0, i, m, k, d, hasw, 1, nt);
            FN(bwd_row)(dy, dys, x, xs, dx, dxs, w, rstd, dg, c1, i + 1, m, k, d, hasw, 1, nt);
        }
    } else {
        FN(bwd_pair_span)(dyr, dys, xr, xs, dxr, dxs, w, dg, vr0, vnc0, vr1, vnc1, k, 0, pdy, px,
                          hasw, 0);
    }
}

/* c = sum(dy * w * xhat) / k of row i. */
RMS_INLINE double FN(bwd_c)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, const void *w,
                            const C *rstd, size_t i, size_t k, double inv_k, const int hasw) {
    double s = FN(reduce)(dy + (ptrdiff_t)i * dys, x + (ptrdiff_t)i * xs, w, rstd[i], k,
                          hasw == 2 ? RMS_DOTWS : hasw ? RMS_DOTW : RMS_DOT);
    return rms_mean(s, k, inv_k);
}

/* hasdg: 0 none, 1 accumulate into dg, 2 store (one row). Short 16-bit rows are pipelined by
 * group, as in fwd_loop (1M x 64 bfloat16, one thread: 1.25 -> 1.21 of its roofline); 32- and
 * 64-bit rows measured slower that way (float32 1.05 -> 1.07). Accumulating dgamma, they go two
 * at a time through the second pass instead, which loads the weight and the dgamma row once for
 * both (float32, one thread: 64 x 4096 from 176 to 147 us, 512 x 12288 from 7.7 to 6.9 ms,
 * 8192 x 4096 2% faster); 16-bit rows keep their paired-vector stores one row at a time. */
#define RMS_BWD_PAIRS (sizeof(T) >= 4)
RMS_INLINE void FN(bwd_loop)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, T *dx,
                             ptrdiff_t dxs, const void *w, const C *rstd, C *dg, size_t m, size_t k,
                             const int hasw, const int hasdg, const int nt) {
    size_t g = FN(group)(2 * k), d = FN(ahead)(g, k, RMS_P_BWD), n = 0;
    const double inv_k = rms_inv_pow2(k);
    const int pipe = RMS_GROUP > 1 && k * sizeof(T) < RMS_PIPE_BYTES;
    double c[RMS_GROUP];
    for (size_t i = 0; i < m; i += g) {
        if (!pipe || i == 0) {
            n = rms_group_rows(i, m, g);
            for (size_t j = 0; j < n; j++)
                c[j] = FN(bwd_c)(dy, dys, x, xs, w, rstd, i + j, k, inv_k, hasw);
        }
        if (RMS_BWD_PAIRS && !pipe && hasdg == 1 && i + 1 < m) {
            double c1 = FN(bwd_c)(dy, dys, x, xs, w, rstd, i + 1, k, inv_k, hasw);
            FN(bwd_pair)(dy, dys, x, xs, dx, dxs, w, rstd, dg, c[0], c1, i, m, k, d, hasw, nt);
            i++; /* g is 1 here */
            continue;
        }
        size_t next = i + g, n2 = pipe ? rms_group_rows(next, m, g) : 0;
        for (size_t j = 0; j < n; j++) {
            double cj = c[j];
            if (j < n2)
                c[j] = FN(bwd_c)(dy, dys, x, xs, w, rstd, next + j, k, inv_k, hasw);
            FN(bwd_row)(dy, dys, x, xs, dx, dxs, w, rstd, dg, cj, i + j, m, k, d, hasw, hasdg,
                        nt);
        }
        n = n2;
    }
}

#undef RMS_BWD_PAIRS

static void FN(bwd_rows)(const void *dy, ptrdiff_t dys, const void *x, ptrdiff_t xs, void *dx,
                         ptrdiff_t dxs, const void *w, const void *rstd, void *dg, size_t m,
                         size_t k, int flags) {
    int opt = FN(bwd_opt)(w, dg, flags, flags & RMS_STREAM);
#define RMS_X(hw, hg, nt)                                                                          \
    FN(bwd_loop)((const T *)dy, dys, (const T *)x, xs, (T *)dx, dxs, w,                            \
                 (const C *)rstd, (C *)dg, m, k, hw, hg, nt)
    RMS_SWITCH_BWD(opt, flags, RMS_X);
#undef RMS_X
}
