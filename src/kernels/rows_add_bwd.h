/* The residual add and the backward row loops: the second half of rows_impl.h, included by it
 * once per dtype x ISA with the same macros in force (see there). */

/* ---------------------------------------------------------------- residual add */

/* Residual add: h = round(x + r). The first pass only reads; the second recomputes h from the
 * cached row, so h and y can both be streamed and h may alias x or r. */
RMS_INLINE void FN(add_span)(const T *x, const T *r, T *h, T *y, const void *w, V vr, size_t n,
                             size_t head, const T *pfx, const T *pfr, int pm, const int hasw,
                             const int before, const int nt) {
    FN(span_rows) s = {x, r, y, h, NULL, w, 0, 0, 0, vr, vr, vr, vr};
    FN(span)(&s, n, head, pfx, pfr, pm, RMS_S_ADD, hasw, before, 0, nt);
}

static void FN(add_scale)(const void *x, const void *r, void *h, void *y, const void *w,
                          double rs, size_t n, int flags) {
    size_t head;
    int opt = FN(opts)(w, flags, FN(plan_stream)((T *)y, (T *)h, n, flags, &head));
#define RMS_X(hw, bf, nt)                                                                          \
    FN(add_span)((const T *)x, (const T *)r, (T *)h, (T *)y, w, V_SET((C)rs), n, head, NULL, NULL, \
                 RMS_PF_L2, hw, bf, nt)
    RMS_SWITCH3(opt, flags, RMS_X);
#undef RMS_X
}

RMS_INLINE void FN(add_row)(const T *x, ptrdiff_t xs, const T *r, ptrdiff_t rs, T *h,
                            ptrdiff_t hs, T *y, ptrdiff_t ys, const void *w, const C *rstd,
                            size_t i, size_t m, size_t k, size_t d, int pm, int flags,
                            const int hasw, const int before, const int nt) {
    const T *xr = x + (ptrdiff_t)i * xs, *rr = r + (ptrdiff_t)i * rs;
    T *hr = h + (ptrdiff_t)i * hs, *yr = y + (ptrdiff_t)i * ys;
    const T *px = FN(row_ahead)(x, xs, i, d, m, flags), *pr = FN(row_ahead)(r, rs, i, d, m, flags);
    size_t head;
    V vr = V_SET(rstd[i]);
    if (nt && FN(plan_stream)(yr, hr, k, RMS_STREAM, &head))
        FN(add_span)(xr, rr, hr, yr, w, vr, k, head, px, pr, pm, hasw, before, nt);
    else
        FN(add_span)(xr, rr, hr, yr, w, vr, k, 0, px, pr, pm, hasw, before, 0);
}

/* The staged add of 16-bit rows. Rounding h = x + r to a 16-bit type costs more arithmetic than
 * reading the row again, and the plain add rounds every h twice, once per pass. Rows of up to
 * RMS_STAGE_MAX elements instead round h once into a stage: the first pass writes the stage and
 * sums its squares as the forward does; the second scales the stage into y as the forward does,
 * and copies it into h. The bits are the same either way, and h, y may alias x or r. One thread,
 * ratio to copying the bytes (two reads, two writes), plain -> staged:
 *   bfloat16, AVX512-BF16: 8192x4096 1.44-1.56 -> 1.26-1.33; 65536x512 1.48-1.49 -> 1.24-1.26;
 *     1M x 64 1.53-1.59 -> 1.34-1.42; 2048x16384 1.63-1.66 -> 1.51-1.52; 256x65536
 *     1.53-1.55 -> 1.40-1.49 (two threads 1.37-1.42 -> 1.21-1.31);
 *   bfloat16, AVX2: 8192x4096 3.19-3.34 -> 2.03-2.07;
 *   float16, AVX-512: 8192x4096 1.34-1.37 -> 1.32-1.39; 65536x512 1.37-1.38 -> 1.27-1.28.
 * The stage lives on the stack up to RMS_STAGE elements (L1), in a heap row above (L2); longer
 * rows measured no faster staged (128x131072 bfloat16: 1.58-1.60 either way).
 * Where rounding to 16 bits is integer code (RMS_STAGE_IN_H: AVX2), h itself is the stage
 * (FN(add_long), h stored plainly) for rows longer than RMS_STAGE_MAX, and for rows longer than
 * RMS_STAGE whose outputs are not streamed. AMD EPYC (Zen 3), two builds alternating in one
 * process, new time over old at one thread (two), the same bits: bfloat16 128x131072 0.27
 * (0.30), 1x1048576 0.54, 29x17389 0.91, 64x16384 0.91 (0.92); float16 128x131072 0.48 (0.62),
 * 64x16384 0.85 (0.84), 29x17389 0.94. Streamed rows of up to RMS_STAGE_MAX
 * measured 2-4% slower with h as the stage (bfloat16 1024x32768 1.03, 4096x12288 1.02-1.04)
 * and keep the heap stage, whose copy streams h. On the 16-core Xeon (AVX512-BF16), whose
 * rounding is one instruction, the heap stage and the plain loop with its streamed h stay
 * faster (h as the stage, one thread: bfloat16 2048x16384 1.16, 128x131072 1.29; float16
 * 128x131072 1.41). Float32 measured slower with h as the stage (Zen 3, one thread: 1024x32768
 * 1.28, 16x1048576 1.23). */
#define RMS_STAGE 8192
#define RMS_STAGE_MAX 65536
#ifndef RMS_STAGE_IN_H
#define RMS_STAGE_IN_H 0
#endif

/* h = round(x + r) of elements [i, e) of a row into s, prefetching the rows pfx and pfr (if
 * any). */
RMS_INLINE void FN(stage_part)(const T *x, const T *r, T *s, size_t i, size_t e, const T *pfx,
                               const T *pfr) {
#ifdef V_ST2
    for (; i + 2 * W <= e; i += 2 * W) {
        FN(pf2)(pfx, pfr, i, 0);
        V_ST2(s + i, V_ADD(V_LD(x + i), V_LD(r + i)), V_ADD(V_LD(x + i + W), V_LD(r + i + W)), 0);
    }
#endif
    for (; i + W <= e; i += W) {
        FN(pf2)(pfx, pfr, i, 0);
        V_ST(s + i, V_ADD(V_LD(x + i), V_LD(r + i)));
    }
    if (i < e)
        V_STP(s + i, V_ADD(V_LDP(x + i, e - i), V_LDP(r + i, e - i)), e - i);
}

/* h = round(x + r) of k elements into s, prefetching the rows pfx and pfr (if any); returns the
 * sum of squares of s. */
RMS_INLINE A FN(stage_row)(const T *x, const T *r, T *s, size_t k, const T *pfx,
                           const T *pfr) {
    FN(stage_part)(x, r, s, 0, k, pfx, pfr);
    return FN(reduce_a)(s, NULL, NULL, NULL, (C)1, k, RMS_SQ);
}

/* A piece of a row shared across threads, staged into h (see kernels.h) */
static double FN(add_stage)(const void *x, const void *r, void *h, size_t n) {
    return A_SUM(FN(stage_row)((const T *)x, (const T *)r, (T *)h, n, NULL, NULL));
}

/* n elements of s at h: non-temporally in pieces when `pieces` (see FN(edge_nt)), else plainly. */
static inline void FN(copy_edge)(T *h, const T *s, size_t n, int pieces) {
#if RMS_NT_EDGES
    if (pieces) {
        rms_nt_bytes((char *)h, (const char *)s, n * sizeof(T));
        return;
    }
#endif
    (void)pieces;
    memcpy(h, s, n * sizeof(T));
}

/* Copies n elements of s into h, the full vectors from `head` on non-temporally when nt (V_CPNT:
 * V_STB bytes), and the partial lines at either end too where they fall on 4 bytes, as FN(span)
 * stores them; prefetching the row pf (if any). */
RMS_INLINE void FN(copy_span)(const T *s, T *h, size_t n, size_t head, const T *pf,
                              const int nt) {
    size_t i = 0, end = n;
    int pieces = 0;
    if (nt) {
        pieces = RMS_NT_EDGES && FN(edge_nt)(h, 0, n);
        FN(copy_edge)(h, s, head, pieces);
        i = head;
        end = FN(stream_end)(head, n);
    }
    for (; i + 2 * W <= end; i += 2 * W) {
        if (pf)
            RMS_PREFETCH(pf + i, RMS_PF_L2);
        if (nt) {
            V_CPNT(h + i, s + i);
            V_CPNT(h + i + W, s + i + W);
        } else {
            memcpy(h + i, s + i, 2 * W * sizeof(T));
        }
    }
    FN(copy_edge)(h + i, s + i, n - i, pieces);
}

/* Elements staged at a time by FN(stage_row_h): 1 KiB, whole lines. */
#define RMS_EARLY_CHUNK 512

/* FN(stage_row) with h streamed out as the row is staged (RMS_EARLY_H): each chunk of the stage is
 * copied into h while it is in L1, so that h's writes go out beside the reads of x and r. The
 * partial lines at h's ends (`head` elements before its first whole line) go as in FN(copy_span).
 * h may be x or r: each chunk is read before it is written. */
RMS_INLINE A FN(stage_row_h)(const T *x, const T *r, T *s, T *h, size_t k, size_t head,
                             const T *pfx, const T *pfr) {
    const int pieces = RMS_NT_EDGES && FN(edge_nt)(h, 0, k);
    const size_t end = FN(stream_end)(head, k);
    FN(stage_part)(x, r, s, 0, head, pfx, pfr);
    FN(copy_edge)(h, s, head, pieces);
    for (size_t c = head; c < end; c += RMS_EARLY_CHUNK) {
        size_t e = end - c < RMS_EARLY_CHUNK ? end : c + RMS_EARLY_CHUNK;
        FN(stage_part)(x, r, s, c, e, pfx, pfr);
        FN(copy_span)(s + c, h + c, e - c, 0, NULL, 1); /* whole lines: no partial one */
    }
    FN(stage_part)(x, r, s, end, k, pfx, pfr);
    FN(copy_edge)(h + end, s + end, k - end, pieces);
    return FN(reduce_a)(s, NULL, NULL, NULL, (C)1, k, RMS_SQ);
}

/* The second pass of a staged row (stage s, rstd rs): y from s as the forward scales x, then
 * h = s unless h is NULL (stored in the first pass), prefetching the rows px and pr (if any), one
 * in each loop. */
RMS_INLINE void FN(staged_row)(const T *s, T *h, T *y, const void *w, C rs, size_t k, const T *px,
                               const T *pr, int flags, const int hasw, const int before,
                               const int nt) {
    size_t head = 0;
    if (!nt || FN(plan_stream)(y, NULL, k, RMS_STREAM, &head))
        FN(scale_span)(s, y, w, V_SET(rs), k, head, px, RMS_PF_L2, hasw, before, nt);
    else /* not aligned to its elements, as in fwd_row */
        FN(scale)(s, y, w, rs, k, flags & ~RMS_STREAM);
    if (!h)
        return;
    if (nt && FN(plan_stream)(h, NULL, k, RMS_STREAM, &head))
        FN(copy_span)(s, h, k, head, pr, nt);
    else
        FN(copy_span)(s, h, k, 0, pr, 0);
}

/* add_loop for 16-bit rows of up to RMS_STAGE_MAX elements. Short rows are pipelined by group as
 * there, each group staged into one half of the stage while the rows of the other are scaled,
 * and the second pass prefetches. Longer rows prefetch in the first pass, which does the more
 * arithmetic here (bfloat16 8192x4096, one thread: 1.32-1.34 -> 1.26 of its copies; short rows
 * measured 0.02-0.04 slower that way). */
RMS_INLINE void FN(add_staged)(T *st, const T *x, ptrdiff_t xs, const T *r, ptrdiff_t rs, T *h,
                               ptrdiff_t hs, T *y, ptrdiff_t ys, const void *w, C *rstd, size_t m,
                               size_t k, double eps, int flags, const int hasw, const int before,
                               const int nt) {
    size_t g = FN(group)(2 * k), d = FN(ahead)(g, k, RMS_P_ADD, flags), n = 0;
    const double inv_k = rms_inv_pow2(k);
    const int pipe = k * sizeof(T) < RMS_PIPE_BYTES;
    const size_t half = pipe ? RMS_STAGE / 2 : 0; /* g * k < RMS_STAGE / 2 for short rows */
    const size_t pf1 = pipe ? 0 : d, pf2 = pipe ? d : 0; /* 0: no prefetch in that pass */
    /* h streamed in the first pass (FN(stage_row_h)), row by row where it can stream */
    const int early_ok = nt && !pipe && (flags & RMS_EARLY_H);
    int early[RMS_GROUP] = {0};
    A sa[RMS_GROUP];
    for (size_t i = 0, p = 0; i < m; i += g, p ^= half) {
        T *cur = st + p, *nxt = st + (p ^ half);
        if (!pipe || i == 0) {
            n = rms_group_rows(i, m, g);
            for (size_t j = 0; j < n; j++) {
                const T *xr = x + (ptrdiff_t)(i + j) * xs, *rr = r + (ptrdiff_t)(i + j) * rs;
                const T *px = FN(row_ahead)(x, xs, i + j, pf1, m, flags),
                        *pr = FN(row_ahead)(r, rs, i + j, pf1, m, flags);
                T *hr = h + (ptrdiff_t)(i + j) * hs;
                size_t head;
                early[j] = early_ok && FN(plan_stream)(hr, NULL, k, RMS_STREAM, &head);
                sa[j] = early[j] ? FN(stage_row_h)(xr, rr, cur + j * k, hr, k, head, px, pr)
                                 : FN(stage_row)(xr, rr, cur + j * k, k, px, pr);
            }
        }
        FN(rstds)(sa, rstd + i, n, cur, (ptrdiff_t)k, NULL, 0, k, eps, inv_k);
        size_t next = i + g, n2 = pipe ? rms_group_rows(next, m, g) : 0;
        for (size_t j = 0; j < n; j++) {
            if (j < n2)
                sa[j] = FN(stage_row)(x + (ptrdiff_t)(next + j) * xs,
                                      r + (ptrdiff_t)(next + j) * rs, nxt + j * k, k, NULL, NULL);
            FN(staged_row)(cur + j * k, early[j] ? NULL : h + (ptrdiff_t)(i + j) * hs,
                           y + (ptrdiff_t)(i + j) * ys,
                           w, rstd[i + j], k, FN(row_ahead)(x, xs, i + j, pf2, m, flags),
                           FN(row_ahead)(r, rs, i + j, pf2, m, flags), flags, hasw, before, nt);
        }
        n = n2;
    }
}

/* The 16-bit add with h itself as the stage (RMS_STAGE_IN_H, see RMS_STAGE): the first pass
 * stores h plainly and sums its squares; the second scales h into y as the forward does. h may
 * be x or r. */
RMS_INLINE void FN(add_long)(const T *x, ptrdiff_t xs, const T *r, ptrdiff_t rs, T *h,
                             ptrdiff_t hs, T *y, ptrdiff_t ys, const void *w, C *rstd, size_t m,
                             size_t k, double eps, int flags, const int hasw, const int before,
                             const int nt) {
    size_t d = FN(ahead)(1, k, RMS_P_ADD, flags);
    const double inv_k = rms_inv_pow2(k);
    for (size_t i = 0; i < m; i++) {
        T *hr = h + (ptrdiff_t)i * hs;
        A sa = FN(stage_row)(x + (ptrdiff_t)i * xs, r + (ptrdiff_t)i * rs, hr, k,
                             FN(row_ahead)(x, xs, i, d, m, flags),
                             FN(row_ahead)(r, rs, i, d, m, flags));
        FN(rstds)(&sa, rstd + i, 1, hr, hs, NULL, 0, k, eps, inv_k);
        /* the forward's second pass over row i of h, with no prefetch (d = 0) */
        FN(fwd_row)(h, hs, y, ys, w, rstd, i, m, k, 0, RMS_PF_L2, flags, hasw, before, nt);
    }
}

/* h = round(x + r) of the n elements at c of a streamed row, the first `head` elements before
 * its first whole line (RMS_FUSE_PASS's CHUNK). */
RMS_INLINE void FN(h_chunk)(const T *x, const T *r, T *h, size_t c, size_t n, size_t head) {
    const V z = V_SET((C)0);
    FN(span_rows) s = {x + c, r + c, h + c, NULL, NULL, NULL, 0, 0, 0, z, z, z, z};
    FN(span)(&s, n, head, NULL, NULL, RMS_PF_L2, RMS_S_H, 0, 0, 0, 1);
}

/* The add of streamed 32- and 64-bit rows with RMS_EARLY_H, h apart from x and r: the first pass
 * streams h out block by block as it sums (x + r)^2 (RMS_FUSE_PASS over the row itself, the
 * same sums in the same order), the second computes h again from the cached row and streams y,
 * prefetching the rows ahead as add_row does. Memory then takes a stream of writes beside the
 * reads of each first pass, as in a copy, rather than the reads of one pass and then the writes
 * of the other. A row whose outputs cannot stream takes add_row. */
RMS_INLINE void FN(add_early)(const T *x, ptrdiff_t xs, const T *r, ptrdiff_t rs, T *h,
                              ptrdiff_t hs, T *y, ptrdiff_t ys, const void *w, C *rstd, size_t m,
                              size_t k, double eps, int flags, const int hasw, const int before) {
    const size_t d = FN(ahead)(1, k, RMS_P_ADD, flags);
    const int pm = FN(pf_mode)(k, RMS_P_ADD, flags);
    const double inv_k = rms_inv_pow2(k);
    const V one = V_SET((C)1);
    for (size_t i = 0; i < m; i++) {
        const T *xr = x + (ptrdiff_t)i * xs, *rr = r + (ptrdiff_t)i * rs;
        T *hr = h + (ptrdiff_t)i * hs, *yr = y + (ptrdiff_t)i * ys;
        size_t head;
        A sa;
        if (!FN(plan_stream)(yr, hr, k, RMS_STREAM, &head)) {
            sa = FN(reduce_a)(xr, rr, NULL, NULL, (C)1, k, RMS_ADDSQ);
            FN(rstds)(&sa, rstd + i, 1, xr, xs, rr, rs, k, eps, inv_k);
            FN(add_row)(x, xs, r, rs, h, hs, y, ys, w, rstd, i, m, k, d, pm, flags, hasw, before,
                        1);
            continue;
        }
#define RMS_CHUNK(c, n, hd) FN(h_chunk)(xr, rr, hr, c, n, hd)
        RMS_FUSE_PASS(sa, xr, rr, NULL, one, k, RMS_ADDSQ, head, RMS_CHUNK);
#undef RMS_CHUNK
        FN(rstds)(&sa, rstd + i, 1, xr, xs, rr, rs, k, eps, inv_k);
        const T *px = FN(row_ahead)(x, xs, i, d, m, flags);
        const T *pr = FN(row_ahead)(r, rs, i, d, m, flags);
        const V vr = V_SET(rstd[i]);
        FN(span_rows) s = {xr, rr, yr, NULL, NULL, w, 0, 0, 0, vr, vr, vr, vr};
        FN(span)(&s, k, head, px, pr, pm, RMS_S_ADD_Y, hasw, before, 0, 1);
    }
}

/* Pipelined by group for short rows, as fwd_loop is. */
RMS_INLINE void FN(add_loop)(const T *x, ptrdiff_t xs, const T *r, ptrdiff_t rs, T *h,
                             ptrdiff_t hs, T *y, ptrdiff_t ys, const void *w, C *rstd, size_t m,
                             size_t k, double eps, int flags, const int hasw, const int before,
                             const int nt) {
    if (sizeof(T) == 2 && RMS_STAGE_IN_H && (k > RMS_STAGE_MAX || (!nt && k > RMS_STAGE))) {
        FN(add_long)(x, xs, r, rs, h, hs, y, ys, w, rstd, m, k, eps, flags, hasw, before, nt);
        return;
    }
    if (sizeof(T) == 2 && k <= RMS_STAGE_MAX) {
        T buf[RMS_STAGE] __attribute__((aligned(64)));
        T *st = k <= RMS_STAGE ? buf : aligned_alloc(64, (k * sizeof(T) + 63) / 64 * 64);
        if (st) {
            FN(add_staged)(st, x, xs, r, rs, h, hs, y, ys, w, rstd, m, k, eps, flags, hasw, before,
                           nt);
            if (st != buf)
                free(st);
            return;
        }
    }
    if (sizeof(T) >= 4 && nt && (flags & RMS_EARLY_H) && h != x && h != r) {
        FN(add_early)(x, xs, r, rs, h, hs, y, ys, w, rstd, m, k, eps, flags, hasw, before);
        return;
    }
    size_t g = FN(group)(2 * k), d = FN(ahead)(g, k, RMS_P_ADD, flags), n = 0;
    const double inv_k = rms_inv_pow2(k);
    const int pipe = k * sizeof(T) < RMS_PIPE_BYTES, pm = FN(pf_mode)(k, RMS_P_ADD, flags);
    A sa[RMS_GROUP];
    for (size_t i = 0; i < m; i += g) {
        if (!pipe || i == 0) {
            n = rms_group_rows(i, m, g);
            for (size_t j = 0; j < n; j++)
                sa[j] = FN(reduce_a)(x + (ptrdiff_t)(i + j) * xs, r + (ptrdiff_t)(i + j) * rs,
                                     NULL, NULL, (C)1, k, RMS_ADDSQ);
        }
        FN(rstds)(sa, rstd + i, n, x + (ptrdiff_t)i * xs, xs, r + (ptrdiff_t)i * rs, rs, k, eps,
                  inv_k);
        size_t next = i + g, n2 = pipe ? rms_group_rows(next, m, g) : 0;
        for (size_t j = 0; j < n; j++) {
            if (j < n2)
                sa[j] = FN(reduce_a)(x + (ptrdiff_t)(next + j) * xs,
                                     r + (ptrdiff_t)(next + j) * rs, NULL, NULL, (C)1, k,
                                     RMS_ADDSQ);
            FN(add_row)(x, xs, r, rs, h, hs, y, ys, w, rstd, i + j, m, k, d, pm, flags, hasw,
                        before, nt);
        }
        n = n2;
    }
}

/* The add of FN(fused) 32- and 64-bit rows, as FN(fwd_fused) is of the forward: each block of
 * row i + 1's sum of (x + r)^2, then as many elements of row i's h and y. h and y may be x or r
 * (row i + 1 is read before row i + 1 is written). */
RMS_INLINE void FN(add_fused)(const T *x, ptrdiff_t xs, const T *r, ptrdiff_t rs, T *h,
                              ptrdiff_t hs, T *y, ptrdiff_t ys, const void *w, C *rstd, size_t m,
                              size_t k, double eps, int flags, const int hasw, const int before) {
    const size_t d = FN(fused_ahead)(k, RMS_P_ADD, flags);
    const double inv_k = rms_inv_pow2(k);
    const V one = V_SET((C)1);
    A sa = FN(reduce_a)(x, r, NULL, NULL, (C)1, k, RMS_ADDSQ);
    FN(rstds)(&sa, rstd, 1, x, xs, r, rs, k, eps, inv_k);
    for (size_t i = 0; i < m; i++) {
        const T *xr = x + (ptrdiff_t)i * xs, *rr = r + (ptrdiff_t)i * rs;
        const T *xn = i + 1 < m ? xr + xs : NULL, *rn = xn ? rr + rs : NULL;
        T *hr = h + (ptrdiff_t)i * hs, *yr = y + (ptrdiff_t)i * ys;
        size_t head;
        if (!xn || !FN(plan_stream)(yr, hr, k, RMS_STREAM, &head)) {
            if (xn)
                sa = FN(reduce_a)(xn, rn, NULL, NULL, (C)1, k, RMS_ADDSQ);
            FN(add_row)(x, xs, r, rs, h, hs, y, ys, w, rstd, i, m, k, d, RMS_PF_L2, flags, hasw,
                        before, 1);
        } else {
            const T *px = FN(row_ahead)(x, xs, i, d, m, flags),
                    *pr = FN(row_ahead)(r, rs, i, d, m, flags);
            const V vr = V_SET(rstd[i]);
#define RMS_CHUNK(c, n, hd)                                                                        \
    FN(add_span)(xr + (c), rr + (c), hr + (c), yr + (c), hasw ? W_AT(w, (c), hasw) : NULL, vr, n, \
                 hd, px ? px + (c) : NULL, px ? pr + (c) : NULL, RMS_PF_L2, hasw, before, 1)
            RMS_FUSE_PASS(sa, xn, rn, NULL, one, k, RMS_ADDSQ, head, RMS_CHUNK);
#undef RMS_CHUNK
        }
        if (xn)
            FN(rstds)(&sa, rstd + i + 1, 1, xn, xs, rn, rs, k, eps, inv_k);
    }
}

#define RMS_ADD_ARGS                                                                               \
    const void *x, ptrdiff_t xs, const void *r, ptrdiff_t rs, void *h, ptrdiff_t hs, void *y,      \
        ptrdiff_t ys, const void *w, void *rstd, size_t m, size_t k, double eps, int flags
#define RMS_X(o, hw, bf, nt)                                                                       \
    RMS_VARIANT RMS_VFN(add_fused_v, o)(RMS_ADD_ARGS) {                                           \
        if (nt) /* always: fused rows stream */                                                    \
            FN(add_fused)((const T *)x, xs, (const T *)r, rs, (T *)h, hs, (T *)y, ys, w,           \
                          (C *)rstd, m, k, eps, flags, hw, bf);                                    \
    }
RMS_VARIANTS3(RMS_X)
#undef RMS_X

static void FN(add_fused_rows)(RMS_ADD_ARGS) {
#define RMS_X(o) RMS_VFN(add_fused_v, o)(x, xs, r, rs, h, hs, y, ys, w, rstd, m, k, eps, flags)
    RMS_VSWITCH3(FN(opts)(w, flags, 1), flags, RMS_X);
#undef RMS_X
}

/* 16-bit rows of the constant lengths with no weight or one cast at the end, through the general
 * loop (RMS_ANY_K), as fwd_rows_any. */
__attribute__((noinline)) static void FN(add_rows_any)(const void *x, ptrdiff_t xs, const void *r,
                                                       ptrdiff_t rs, void *h, ptrdiff_t hs,
                                                       void *y, ptrdiff_t ys, const void *w,
                                                       void *rstd, size_t m, size_t k, double eps,
                                                       int flags) {
    if (!w)
        FN(add_loop)((const T *)x, xs, (const T *)r, rs, (T *)h, hs, (T *)y, ys, w, (C *)rstd, m,
                     k, eps, flags, 0, 0, RMS_NT_ON);
    else if (flags & RMS_W_STORAGE)
        FN(add_loop)((const T *)x, xs, (const T *)r, rs, (T *)h, hs, (T *)y, ys, w, (C *)rstd, m,
                     k, eps, flags, RMS_HW_S, 0, RMS_NT_ON);
    else
        FN(add_loop)((const T *)x, xs, (const T *)r, rs, (T *)h, hs, (T *)y, ys, w, (C *)rstd, m,
                     k, eps, flags, 1, 0, RMS_NT_ON);
    if (flags & RMS_STREAM)
        V_FENCE();
}

/* The row loop of each option (RMS_VARIANTS3) */
#define RMS_X(o, hw, bf, nt)                                                                       \
    RMS_VARIANT RMS_VFN(add_v, o)(RMS_ADD_ARGS) {                                                 \
        RMS_KSW(RMS_KSW_ADD(bf), k,                                                                \
                FN(add_loop)((const T *)x, xs, (const T *)r, rs, (T *)h, hs, (T *)y, ys, w,        \
                             (C *)rstd, m, KK, eps, flags, hw, bf, nt));                           \
    }
RMS_VARIANTS3(RMS_X)
#undef RMS_X

static void FN(add_rows)(RMS_ADD_ARGS) {
    if (sizeof(T) >= 4 && FN(fused)(m, k, flags, (flags & RMS_STREAM) && RMS_NT_ON, RMS_P_ADD)) {
        FN(add_fused_rows)(x, xs, r, rs, h, hs, y, ys, w, rstd, m, k, eps, flags);
        return;
    }
    if ((flags & RMS_ANY_K) && (flags & RMS_STREAM) &&
        RMS_KSW_ADD(flags & RMS_CAST_BEFORE) && rms_ksw_k(k)) {
        FN(add_rows_any)(x, xs, r, rs, h, hs, y, ys, w, rstd, m, k, eps, flags);
        return;
    }
    int opt = FN(opts)(w, flags, flags & RMS_STREAM);
#define RMS_X(o) RMS_VFN(add_v, o)(x, xs, r, rs, h, hs, y, ys, w, rstd, m, k, eps, flags)
    RMS_VSWITCH3(opt, flags, RMS_X);
#undef RMS_X
}
#undef RMS_ADD_ARGS

/* ---------------------------------------------------------------- backward */

/* The flags that the prefetch mode of the second pass over rows of k elements depends on:
 * RMS_NEAR_16 where FN(near) says so for the whole row (the chunks of a fused row are shorter). */
static inline int FN(bwd_pf)(size_t k, int flags) {
    return FN(near)(k, RMS_P_BWD, flags) ? flags & RMS_NEAR_16 : 0;
}

/* The second pass of the backward over a row (see span_val); pf from FN(bwd_pf). */
RMS_INLINE void FN(bwd_span)(const T *dy, const T *x, const void *w, T *dx, C *dg, V vr, V vnc,
                             size_t n, size_t head, const T *pdy, const T *px, int pf,
                             const int hasw, const int hasdg, const int nt) {
    FN(span_rows) s = {dy, x, dx, NULL, dg, w, 0, 0, 0, vr, vnc, vr, vnc};
    FN(span)(&s, n, head, pdy, px, FN(pf_mode)(n, RMS_P_BWD, pf), RMS_S_BWD, hasw,
             0, hasdg, nt);
}

/* The options o = (hasw != 0) | hasdg << 1 | nt << 3 | (hasw == 2) << 4 of the backward, where
 * hasdg is 0 (none), 1 (accumulate into dg), 2 (store: one row) or 3 (store rounded to T: one
 * 16-bit row, RMS_DG_NARROW) and needs a weight: C(X, o, hasw, hasdg, nt) for each, and D for the
 * default (29; 21 without streamed loops), as in RMS_CASES3. Only 16-bit types narrow dgamma
 * (RMS_BWD_HG). */
#define RMS_CASES_BWD(C, D, X)                                                                     \
    C(X, 0, 0, 0, 0) C(X, 1, 1, 0, 0) C(X, 3, 1, 1, 0) C(X, 5, 1, 2, 0) C(X, 7, 1, 3, 0)           \
    C(X, 23, RMS_HW_S, 3, 0) C(X, 17, RMS_HW_S, 0, 0) C(X, 19, RMS_HW_S, 1, 0)                     \
    RMS_IF_NT(C(X, 8, 0, 0, 1) C(X, 9, 1, 0, 1) C(X, 11, 1, 1, 1) C(X, 13, 1, 2, 1)                \
              C(X, 25, RMS_HW_S, 0, 1) C(X, 27, RMS_HW_S, 1, 1) C(X, 15, 1, 3, 1)                  \
              C(X, 31, RMS_HW_S, 3, 1) C(X, 21, RMS_HW_S, 2, 0))                                   \
    D(X, 29, RMS_HW_S, 2, RMS_NT_ON)
#define RMS_BWD_HG(hg) (sizeof(T) == 2 || (hg) != 3)
#define RMS_CASE_BWD(X, o, a, b, c)                                                                \
    case o:                                                                                        \
        if (RMS_BWD_HG(b))                                                                         \
            X(a, b, c);                                                                            \
        break;
/* X(hasw, hasdg, nt) with constant arguments for o, then the fence. */
#define RMS_SWITCH_BWD(o, flags, X)                                                                \
    RMS_OPT_SWITCH(RMS_CASES_BWD, RMS_CASE_BWD, RMS_DFLT3, o, flags, X)
/* As RMS_VARIANTS3 and RMS_VSWITCH3 for the backward's options */
#define RMS_VARIANTS_BWD(X) RMS_CASES_BWD(RMS_VDEF, RMS_VDEF, X)
#define RMS_VSWITCH_BWD(o, flags, CALL)                                                            \
    RMS_OPT_SWITCH(RMS_CASES_BWD, RMS_VCASE, RMS_VDFLT, o, flags, CALL)

/* RMS_SWITCH_BWD's o for hasw 0, 1 or 2 (storage-type weight), hasdg and nt */
static inline int FN(bwd_o)(int hasw, int hasdg, int nt) {
    return (hasw != 0) | hasdg << 1 | (nt && RMS_NT_ON ? 8 : 0) | (hasw == 2) << 4;
}

static inline int FN(bwd_opt)(const void *w, const void *dg, int flags, int nt) {
    int store = sizeof(T) == 2 && (flags & RMS_DG_NARROW) ? 3 : 2;
    int hasdg = w && dg ? ((flags & RMS_DG_STORE) ? store : 1) : 0;
    return FN(bwd_o)(w ? ((flags & RMS_W_STORAGE) ? 2 : 1) : 0, hasdg, nt);
}

/* bwd_span out of line for the options o (RMS_SWITCH_BWD's), with no fence. Rows of
 * RMS_OOL_BYTES or more take it rather than the copy inlined in the row loop: alone in a function,
 * the loop keeps its pointers in registers (inlined in the row loop, the dgamma and weight
 * pointers, the end of the row and the test of the prefetch row were reloaded from the stack on
 * every vector; bfloat16 on AVX2: 33 -> 29 instructions a vector). AMD EPYC (Zen 3), AVX2, two
 * builds alternating in one process, new time over old, one thread (two); the same bits:
 *   in cache: bfloat16 64x4096 0.92-0.93, 256x1024 0.93; float16 64x4096 0.88;
 *   from memory: bfloat16 16384x4096 0.92 (0.91), 4096x12288 0.90 (0.95), 65536x1024 0.92
 *   (0.85); float16 16384x4096 0.86 (0.86), 65536x1024 0.85 (0.90).
 * Rows of 512 bytes gained less and less surely (bfloat16 131072x256 0.93-0.97), and rows of 64
 * elements lost 10-17% (the call). On the 16-core Xeon (AVX-512), one thread / 16: bfloat16
 * 65536x2048 0.99 / 0.95, 131072x1024 0.95 / 1.01, 262144x512 0.84 / 0.95; float16 131072x1024
 * 1.02 / 0.98; 256x1024 in cache 1.00. Pairs of rows out of line gained nothing: float32
 * on AVX2 (64x4096 in cache 1.01), 16-bit on AVX-512 (bfloat16 32768x8192 1.00 at 1 and 16
 * threads, float16 0.95 and 1.01). The forward's second pass out of line lost 4-7% in cache
 * (bfloat16 64x4096 on AVX2) and was not kept. */
#define RMS_OOL_BYTES 1024
static __attribute__((noinline)) void FN(bwd_span_ool)(const T *dy, const T *x, const void *w,
                                                       T *dx, C *dg, V vr, V vnc, size_t n,
                                                       size_t head, const T *pdy, const T *px,
                                                       int pf, int o) {
#define RMS_X(hw, hg, nt)                                                                          \
    FN(bwd_span)(dy, x, w, dx, dg, vr, vnc, n, head, pdy, px, pf, hw, hg, nt)
    RMS_SWITCH_BWD(o, 0, RMS_X);
#undef RMS_X
}

static void FN(bwd)(const void *dy, const void *x, const void *w, void *dx, double r, double c,
                    void *dg, size_t n, int flags) {
    size_t head;
    int opt = FN(bwd_opt)(w, dg, flags, FN(plan_stream)((T *)dx, NULL, n, flags, &head));
    FN(bwd_span_ool)((const T *)dy, (const T *)x, w, (T *)dx, (C *)dg, V_SET((C)r), V_SET((C)-c),
                     n, head, NULL, NULL, FN(bwd_pf)(n, flags), opt);
    if (flags & RMS_STREAM)
        V_FENCE();
}

/* Row i, given its c. A row of a streamed loop that plan_stream cannot stream (dx not aligned to
 * its elements) is stored normally, out of line (FN(bwd)). dg1: the first pass accumulated
 * dgamma already (FN(bwd_dg1), rows of RMS_OOL_BYTES or more only). */
RMS_INLINE void FN(bwd_row)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, T *dx,
                            ptrdiff_t dxs, const void *w, const C *rstd, C *dg, double c, size_t i,
                            size_t m, size_t k, size_t d, int flags, const int hasw,
                            const int hasdg, const int nt, int dg1) {
    const T *dyr = dy + (ptrdiff_t)i * dys, *xr = x + (ptrdiff_t)i * xs;
    T *dxr = dx + (ptrdiff_t)i * dxs;
    const T *pdy = FN(row_ahead)(dy, dys, i, d, m, flags);
    const T *px = FN(row_ahead)(x, xs, i, d, m, flags);
    size_t head = 0;
    if (nt && !FN(plan_stream)(dxr, NULL, k, RMS_STREAM, &head))
        FN(bwd)(dyr, xr, w, dxr, rstd[i], c, dg1 ? NULL : dg, k, flags & ~RMS_STREAM);
    else if (k * sizeof(T) >= RMS_OOL_BYTES)
        FN(bwd_span_ool)(dyr, xr, w, dxr, dg, V_SET(rstd[i]), V_SET((C)-c), k, head, pdy, px,
                         FN(bwd_pf)(k, flags), FN(bwd_o)(hasw, dg1 ? 0 : hasdg, nt));
    else
        FN(bwd_span)(dyr, xr, w, dxr, dg, V_SET(rstd[i]), V_SET((C)-c), k, head, pdy, px,
                     FN(bwd_pf)(k, flags), hasw, hasdg, nt);
}

/* The second pass of two rows (a at dy, x -> dx; b one stride further) at once, accumulating
 * dgamma: the weight and the dgamma row are loaded and stored once for both, and dg gains row a's
 * term, then row b's, as it does row by row. pdy, px: the rows to prefetch, or NULL. */
RMS_INLINE void FN(bwd_pair_span)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, T *dx,
                                  ptrdiff_t dxs, const void *w, C *dg, V vr0, V vnc0, V vr1,
                                  V vnc1, size_t n, size_t head, const T *pdy, const T *px,
                                  int pf, const int hasw, const int nt) {
    FN(span_rows) s = {dy, x, dx, NULL, dg, w, dys, xs, dxs, vr0, vnc0, vr1, vnc1};
    FN(span)(&s, n, head, pdy, px, FN(pf_mode)(n, RMS_P_BWD, pf), RMS_S_PAIR, hasw,
             0, 1, nt);
}

/* Rows i and i + 1 (with a weight, accumulating dgamma), given their c; as bwd_row is of one.
 * Streamed rows that align differently go one at a time (dgamma gains row i's term, then row
 * i + 1's, in the same order either way). */
RMS_INLINE void FN(bwd_pair)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, T *dx,
                             ptrdiff_t dxs, const void *w, const C *rstd, C *dg, double c0,
                             double c1, size_t i, size_t m, size_t k, size_t d, int flags,
                             const int hasw, const int nt) {
    const T *dyr = dy + (ptrdiff_t)i * dys, *xr = x + (ptrdiff_t)i * xs;
    T *dxr = dx + (ptrdiff_t)i * dxs;
    int last = i + 1 + d >= m;
    const T *pdy = last ? NULL : dyr + (ptrdiff_t)d * dys,
            *px = last ? NULL : xr + (ptrdiff_t)d * xs;
    size_t head = 0, head1 = 0;
    if (!nt || (FN(plan_stream)(dxr, NULL, k, RMS_STREAM, &head) &&
                FN(plan_stream)(dxr + dxs, NULL, k, RMS_STREAM, &head1) && head == head1)) {
        FN(bwd_pair_span)(dyr, dys, xr, xs, dxr, dxs, w, dg, V_SET(rstd[i]), V_SET((C)-c0),
                          V_SET(rstd[i + 1]), V_SET((C)-c1), k, head, pdy, px,
                          FN(bwd_pf)(k, flags), hasw, nt);
    } else {
        FN(bwd_row)(dy, dys, x, xs, dx, dxs, w, rstd, dg, c0, i, m, k, d, flags, hasw, 1, nt, 0);
        FN(bwd_row)(dy, dys, x, xs, dx, dxs, w, rstd, dg, c1, i + 1, m, k, d, flags, hasw, 1, nt,
                    0);
    }
}

/* sum(dy * w * xhat) of row i, its float64 lanes not yet added up (FN(reduce_a)); with dg1 (and
 * dg), the dgamma row dg gains the row's dy * xhat as well (RMS_KDG, see FN(bwd_dg1)). */
RMS_INLINE A FN(bwd_dot)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, const void *w,
                         const C *rstd, C *dg, size_t i, size_t k, const int hasw, int dg1) {
    const T *a = dy + (ptrdiff_t)i * dys, *b = x + (ptrdiff_t)i * xs;
    const int kind = hasw == 2 ? RMS_DOTWS : hasw ? RMS_DOTW : RMS_DOT;
    if (dg1)
        return FN(reduce_a)(a, b, w, dg, rstd[i], k, kind | RMS_KDG);
    return FN(reduce_a)(a, b, w, NULL, rstd[i], k, kind);
}

/* Whether the backward's first pass accumulates dgamma (FN(bwd_dot)) as it reads dy and x, and
 * the second pass leaves the dgamma row alone: rows of 32- and 64-bit elements of over 3.5 KiB
 * and up to 4 KiB that prefetch no row ahead (d == 0: RMS_HW_PREFETCH, FN(ahead)), accumulating
 * dgamma (hasdg 1) one row at a time. Each element of the row gains the same product, in the same
 * order of rows, so no bit changes. AMD EPYC (Zen 4), the two alternating in one process, each
 * order, inputs 256 MiB + 16 or 20 KiB apart, new time over old, one thread: float32 65536x1024
 * 0.86 and 0.92, float64 65536x512 0.90 and 0.90; two threads 0.95 and 0.98. Rows of 256 bytes
 * to 3.5 KiB, and of 5 to 8 KiB, measured the same within 0.03 either way. */
static inline int FN(bwd_dg1)(size_t k, size_t d, int flags) {
    return sizeof(T) >= 4 && !d && (flags & RMS_HW_PREFETCH) && k * sizeof(T) > 3584 &&
           k * sizeof(T) <= 4096 && k * sizeof(T) >= RMS_OOL_BYTES;
}

/* hasdg: 0 none, 1 accumulate into dg, 2 store (one row). Short 16-bit rows are pipelined by
 * group, as in fwd_loop (1M x 64 bfloat16, one thread: 1.25 -> 1.21 of its roofline); 32- and
 * 64-bit rows measured slower that way (float32 1.05 -> 1.07). Accumulating dgamma, they go two
 * at a time through the second pass instead, which loads the weight and the dgamma row once for
 * both (float32, one thread: 64 x 4096 from 176 to 147 us, 512 x 12288 from 7.7 to 6.9 ms,
 * 8192 x 4096 2% faster). 16-bit rows go in pairs too where the ISA has the registers to keep
 * its paired-vector stores for both rows (RMS_PAIRS_16: AVX-512) and the rows are 8 KiB or
 * longer: there the float32 dgamma row, twice the bytes of each input row, is read and written
 * once for two rows (see avx512_defs.h for the figures). Pairs run where the driver asks
 * (RMS_ROW_PAIRS, `pairs`): see rms_backward. */
#ifndef RMS_PAIRS_16
#define RMS_PAIRS_16 0
#endif
/* Whether rows of k elements may go in pairs: only where the ISA has 32 vector registers. With
 * 16 (AVX2, scalar) a pair's span computes no block ahead of its stores (FN(span_block) is 1),
 * and single rows, which do, measured faster everywhere: ratio single / paired, float32, rows
 * 16 bytes into a line, two builds alternating in one process. AMD EPYC (Zen 3), one / two
 * threads: 524288x128 0.71 / 0.90, 349525x192 0.61 / 0.76, 262144x256 0.63 / 0.76, 131072x512
 * 0.73 / 0.89, 87381x768 0.94 / 1.03, 1M x 64 0.93 / 0.99 (page-aligned rows 0.59 to 0.78 /
 * 0.72 to 0.92); in cache 0.87 to 1.04. The 16-core Xeon's AVX2 kernels, one / 16 threads:
 * 128 to 1024 columns 0.82 to 1.01 / 0.79 to 0.98, 16384x4096 0.96 / 0.97, float64 0.85 to
 * 0.95. Its AVX-512 kernels keep the pairs: there single rows of 64 to 192 measured 1.03 to
 * 1.12 at one to four threads, and longer ones the same within noise. */
#define RMS_BWD_PAIRS(k)                                                                           \
    (V_REGS >= 32 && (sizeof(T) >= 4 || (RMS_PAIRS_16 && (k) * sizeof(T) >= 8192)))
RMS_INLINE void FN(bwd_loop)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, T *dx,
                             ptrdiff_t dxs, const void *w, const C *rstd, C *dg, size_t m, size_t k,
                             int flags, const int hasw, const int hasdg, const int nt) {
    size_t g = FN(group)(2 * k), d = FN(ahead)(g, k, RMS_P_BWD, flags), n = 0;
    const int pairs = (flags & RMS_ROW_PAIRS) != 0;
    const double inv_k = rms_inv_pow2(k);
    const int pipe = RMS_GROUP > 1 && k * sizeof(T) < RMS_PIPE_BYTES;
    /* pairs replace rows one at a time (g == 1), never a group */
    const int paired = RMS_BWD_PAIRS(k) && pairs && hasdg == 1 && g == 1;
    const int dg1 = hasdg == 1 && !paired && FN(bwd_dg1)(k, d, flags);
    A dot[RMS_GROUP];
    double c[RMS_GROUP]; /* c = sum(dy * w * xhat) / k of each row of the group */
    for (size_t i = 0; i < m; i += g) {
        if (!pipe || i == 0) {
            n = rms_group_rows(i, m, g);
            for (size_t j = 0; j < n; j++)
                dot[j] = FN(bwd_dot)(dy, dys, x, xs, w, rstd, dg, i + j, k, hasw, dg1);
        }
        FN(sums)(dot, c, n);
        for (size_t j = 0; j < n; j++)
            c[j] = rms_mean(c[j], k, inv_k);
        if (paired && i + 1 < m) {
            double c1 = rms_mean(
                A_SUM(FN(bwd_dot)(dy, dys, x, xs, w, rstd, NULL, i + 1, k, hasw, 0)), k, inv_k);
            FN(bwd_pair)(dy, dys, x, xs, dx, dxs, w, rstd, dg, c[0], c1, i, m, k, d, flags, hasw,
                         nt);
            i++;
            continue;
        }
        size_t next = i + g, n2 = pipe ? rms_group_rows(next, m, g) : 0;
        for (size_t j = 0; j < n; j++) {
            if (j < n2)
                dot[j] = FN(bwd_dot)(dy, dys, x, xs, w, rstd, dg, next + j, k, hasw, dg1);
            FN(bwd_row)(dy, dys, x, xs, dx, dxs, w, rstd, dg, c[j], i + j, m, k, d, flags, hasw,
                        hasdg, nt, dg1);
        }
        n = n2;
    }
}

#undef RMS_BWD_PAIRS

/* Elements [c, c + n) of row dy, x's second pass into dx (and dg), streamed; as FN(fwd_chunk). */
RMS_INLINE void FN(bwd_chunk)(const T *dy, const T *x, const void *w, T *dx, C *dg, V vr, V vnc,
                              size_t c, size_t n, size_t head, const T *pdy, const T *px,
                              int pf, const int hasw, const int hasdg) {
    FN(bwd_span)(dy + c, x + c, hasw ? W_AT(w, c, hasw) : NULL, dx + c, hasdg ? dg + c : NULL, vr,
                 vnc, n, head, pdy ? pdy + c : NULL, pdy ? px + c : NULL, pf, hasw, hasdg, 1);
}

/* The backward of FN(fused) rows, as FN(fwd_fused) is of the forward: each block of row i + 1's
 * sum(dy * w * xhat), then as many elements of row i's second pass, so that memory sees the two
 * streams of reads beside the stream of writes, as a triad does. dgamma gains row i's terms
 * before row i + 1's in every column and every sum keeps its order, so the bits are those of
 * FN(bwd_loop). */
RMS_INLINE void FN(bwd_fused)(const T *dy, ptrdiff_t dys, const T *x, ptrdiff_t xs, T *dx,
                              ptrdiff_t dxs, const void *w, const C *rstd, C *dg, size_t m,
                              size_t k, int flags, const int hasw, const int hasdg) {
    const size_t d = FN(fused_ahead)(k, RMS_P_BWD, flags);
    const double inv_k = rms_inv_pow2(k);
    const int kind = hasw == 2 ? RMS_DOTWS : hasw ? RMS_DOTW : RMS_DOT, pf = FN(bwd_pf)(k, flags);
    A sa = FN(bwd_dot)(dy, dys, x, xs, w, rstd, NULL, 0, k, hasw, 0);
    for (size_t i = 0; i < m; i++) {
        const double c = rms_mean(A_SUM(sa), k, inv_k);
        const T *dyr = dy + (ptrdiff_t)i * dys, *xr = x + (ptrdiff_t)i * xs;
        T *dxr = dx + (ptrdiff_t)i * dxs;
        const int next = i + 1 < m;
        size_t head;
        if (!next || !FN(plan_stream)(dxr, NULL, k, RMS_STREAM, &head)) {
            if (next)
                sa = FN(bwd_dot)(dy, dys, x, xs, w, rstd, NULL, i + 1, k, hasw, 0);
            FN(bwd_row)(dy, dys, x, xs, dx, dxs, w, rstd, dg, c, i, m, k, d, flags, hasw, hasdg, 1,
                        0);
        } else {
            const T *dyn = dyr + dys, *xn = xr + xs;
            const V vr = V_SET(rstd[i]), vnc = V_SET((C)-c), vrn = V_SET(rstd[i + 1]);
            const T *pdy = FN(row_ahead)(dy, dys, i, d, m, flags),
                    *px = FN(row_ahead)(x, xs, i, d, m, flags);
#define RMS_CHUNK(c, n, hd)                                                                        \
    FN(bwd_chunk)(dyr, xr, w, dxr, dg, vr, vnc, c, n, hd, pdy, px, pf, hasw, hasdg)
            RMS_FUSE_PASS(sa, dyn, xn, w, vrn, k, kind, head, RMS_CHUNK);
#undef RMS_CHUNK
        }
    }
}

/* FN(bwd_fused) of each option in a function of its own (see fwd_fused_rows). */
#define RMS_BWD_ARGS                                                                               \
    const void *dy, ptrdiff_t dys, const void *x, ptrdiff_t xs, void *dx, ptrdiff_t dxs,           \
        const void *w, const void *rstd, void *dg, size_t m, size_t k, int flags
#define RMS_X(o, hw, hg, nt)                                                                       \
    RMS_VARIANT RMS_VFN(bwd_fused_v, o)(RMS_BWD_ARGS) {                                           \
        /* always: fused rows stream, and are more than one (no RMS_DG_STORE) */                   \
        if ((nt) && (hg) < 2)                                                                      \
            FN(bwd_fused)((const T *)dy, dys, (const T *)x, xs, (T *)dx, dxs, w, (const C *)rstd,  \
                          (C *)dg, m, k, flags, hw, hg);                                           \
    }
RMS_VARIANTS_BWD(RMS_X)
#undef RMS_X

static void FN(bwd_fused_rows)(RMS_BWD_ARGS) {
#define RMS_X(o) RMS_VFN(bwd_fused_v, o)(dy, dys, x, xs, dx, dxs, w, rstd, dg, m, k, flags)
    RMS_VSWITCH_BWD(FN(bwd_opt)(w, dg, flags, 1), flags, RMS_X);
#undef RMS_X
}

/* The row loop of each option (RMS_VARIANTS_BWD) */
#define RMS_X(o, hw, hg, nt)                                                                       \
    RMS_VARIANT RMS_VFN(bwd_v, o)(RMS_BWD_ARGS) {                                                 \
        if (RMS_BWD_HG(hg))                                                                        \
            RMS_KSW(sizeof(T) == 2 && (!(hw) || (hg) == 1), k,                                     \
                    FN(bwd_loop)((const T *)dy, dys, (const T *)x, xs, (T *)dx, dxs, w,            \
                                 (const C *)rstd, (C *)dg, m, KK, flags, hw, hg, nt));             \
    }
RMS_VARIANTS_BWD(RMS_X)
#undef RMS_X

static void FN(bwd_rows)(RMS_BWD_ARGS) {
    if (FN(fused)(m, k, flags, (flags & RMS_STREAM) && RMS_NT_ON, RMS_P_BWD)) { /* m > 1 */
        FN(bwd_fused_rows)(dy, dys, x, xs, dx, dxs, w, rstd, dg, m, k, flags);
        return;
    }
    int opt = FN(bwd_opt)(w, dg, flags, flags & RMS_STREAM);
#define RMS_X(o) RMS_VFN(bwd_v, o)(dy, dys, x, xs, dx, dxs, w, rstd, dg, m, k, flags)
    RMS_VSWITCH_BWD(opt, flags, RMS_X);
#undef RMS_X
}
#undef RMS_BWD_ARGS
