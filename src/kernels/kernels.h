/* The kernel interface: pure C row loops over raw buffers, one table per ISA family.
 * No Python, no NumPy, no threads: the driver splits work and calls these on row ranges. */
#ifndef RMSNORM_KERNELS_H
#define RMSNORM_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* Storage dtypes. Compute type is double for F64 and float for the rest. */
enum rms_dtype { RMS_F32 = 0, RMS_F64 = 1, RMS_F16 = 2, RMS_BF16 = 3, RMS_NDTYPES = 4 };

/* Flags for the scaling passes. */
enum {
    RMS_CAST_BEFORE = 1, /* round x*rstd to the storage type before multiplying by w */
    RMS_STREAM = 2,      /* non-temporal stores for outputs larger than the cache */
    RMS_DG_STORE = 4,    /* backward: store dgamma terms instead of accumulating (one row) */
    RMS_W_STORAGE = 8,   /* w holds x's storage type (offset 0) rather than the compute type */
    RMS_ROW_PAIRS = 16,  /* backward: rows through the second pass two at a time (bwd_loop) */
    RMS_HW_PREFETCH = 32, /* lean on the hardware prefetcher (FN(ahead), FN(near), FN(pf_mode)) */
    RMS_DG_NARROW = 64,   /* backward, one row of a 16-bit type (with RMS_DG_STORE): dgamma is
                           * that type, each term rounded to it as it is stored */
    RMS_FUSE_16 = 128,    /* 16-bit rows are fused across rows too (FN(fused)) */
    RMS_ANY_K = 256,      /* forward and add: the output's rows do not all start on cache
                           * lines, so rows of the lengths that loops compile as constants
                           * (RMS_KSW_K1, RMS_KSW_K2) take the general loop */
    RMS_NEAR_16 = 512,    /* backward: 16-bit rows of up to 2 KiB are prefetched into L1,
                           * 16 KiB ahead (FN(near)) */
    RMS_PF_PAST = 1024,   /* the inputs' rows go on past the m of the call (a batch of a longer
                           * run): prefetch past m too (FN(row_ahead)) */
    RMS_NO_FUSE_32 = 2048, /* 32- and 64-bit rows are not fused across rows (FN(fused)) */
    RMS_EARLY_H = 4096,    /* add: streamed 32- and 64-bit rows store h in their first pass
                            * (FN(add_early)) */
    RMS_BWD_AHEAD_32 = 8192, /* backward: 32- and 64-bit rows are prefetched 32 KiB ahead rather
                              * than 64 (FN(ahead)) */
    RMS_FWD_NEAR = 16384,    /* forward: rows over 16 KiB are prefetched into L1 too, a row
                              * ahead (FN(near)) */
    RMS_FWD_AHEAD_32 = 32768 /* forward, with RMS_FWD_NEAR: contiguous 32- and 64-bit rows over
                              * 32 KiB are prefetched 32 KiB ahead, not a row (FN(fwd_ahead)) */
};

/* Whether the kernels store the partial cache lines at the ends of a streamed row non-temporally
 * too (x86-64: rms_nt_bytes in rows_impl.h; every 32- and 64-bit row, 16-bit rows that start and
 * end on 4 bytes): rows that do not start on a line then stream with no plain store into a line
 * that streaming stores also write (see streamable in driver.c). */
#if defined(__x86_64__) && defined(__SSE2__)
#define RMS_NT_EDGES 1
#else
#define RMS_NT_EDGES 0
#endif

/* The row lengths that row loops compile as constants (RMS_KSW in rows_impl.h). Those loops keep
 * plain partial lines, so rows of these lengths whose outputs do not start on lines take the
 * general loop instead (RMS_ANY_K, which rms_forward in driver.c sets). */
#define RMS_KSW_K1 64
#define RMS_KSW_K2 128
static inline int rms_ksw_k(size_t k) { return k == RMS_KSW_K1 || k == RMS_KSW_K2; }

/* A 2-D view: m rows of k contiguous elements, consecutive rows `stride` elements apart
 * (stride may be negative). Pointers are void so one table type serves every dtype; the
 * compute-type arrays (w, rstd, dgamma partials) are float for 16/32-bit and double for F64.
 * Every buffer is aligned to its element type (the glue copies arrays that are not); an output
 * that is not anyway is stored without streaming (out of line in the forward and backward). */
typedef struct {
    /* Row loops: process rows [0, m). */
    void (*fwd_rows)(const void *x, ptrdiff_t xs, void *y, ptrdiff_t ys, const void *w,
                     void *rstd, size_t m, size_t k, double eps, int flags);
    void (*add_rows)(const void *x, ptrdiff_t xs, const void *r, ptrdiff_t rs, void *h,
                     ptrdiff_t hs, void *y, ptrdiff_t ys, const void *w, void *rstd, size_t m,
                     size_t k, double eps, int flags);
    /* dg: a k-long partial dgamma row to accumulate into, or NULL. */
    void (*bwd_rows)(const void *dy, ptrdiff_t dys, const void *x, ptrdiff_t xs, void *dx,
                     ptrdiff_t dxs, const void *w, const void *rstd, void *dg, size_t m,
                     size_t k, int flags);
    /* Pieces of one row, for splitting a long row across threads. */
    double (*sumsq)(const void *x, size_t n);
    void (*scale)(const void *x, void *y, const void *w, double r, size_t n, int flags);
    double (*add_sumsq)(const void *x, const void *r, size_t n);
    void (*add_scale)(const void *x, const void *r, void *h, void *y, const void *w, double rs,
                      size_t n, int flags);
    /* h = round(x + r), stored plainly (h may be x or r), and the sum of squares of h as sumsq
     * takes it: a piece's first pass, after which scale(h) gives the same y as add_scale. */
    double (*add_stage)(const void *x, const void *r, void *h, size_t n);
    /* Slow path for a row whose sum of squares is not usable (rms_sumsq_ok): returns its rstd,
     * NaN when the row holds NaN or Inf, else rescaled by the row's largest magnitude. r may be
     * NULL; else the row is round(x + r) as in add_rows. */
    double (*rescue)(const void *x, const void *r, size_t n, double eps);
    /* sum(dy * w * x * r) */
    double (*dot)(const void *dy, const void *x, const void *w, double r, size_t n, int flags);
    /* dx = r * (dy * w - x * r * c), c = dot / k; dg += dy * x * r */
    void (*bwd)(const void *dy, const void *x, const void *w, void *dx, double r, double c,
                void *dg, size_t n, int flags);
    /* Weights: dst (compute type) = offset + src (storage type), and back, rounded. */
    void (*widen)(const void *src, void *dst, double offset, size_t n);
    void (*narrow)(const void *src, void *dst, size_t n);
} rms_kernels;

/* A row's sum of squares can be used as it is: finite, and not so small that squares of its
 * elements underflowed in the compute type (float32 partial sums, or float64). Otherwise the
 * row takes the rescaling slow path (rescue). */
#define RMS_SUMSQ_MAX 1.79769313486231570e308 /* DBL_MAX: finite */
#define RMS_SUMSQ_MIN_F32 1e-30
#define RMS_SUMSQ_MIN_F64 1e-290
static inline int rms_sumsq_ok(double ss, int f64) {
    return ss <= RMS_SUMSQ_MAX && ss >= (f64 ? RMS_SUMSQ_MIN_F64 : RMS_SUMSQ_MIN_F32);
}

/* 1/n when n is a power of two, else 0: then s * (1/n) is exactly s / n, and spares the divider
 * one of the three operations it does per row. */
static inline double rms_inv_pow2(size_t n) {
    return n && !(n & (n - 1)) ? 1.0 / (double)n : 0.0;
}

/* s / n, as a multiplication when inv_n (rms_inv_pow2) allows it. */
static inline double rms_mean(double s, size_t n, double inv_n) {
    return inv_n != 0.0 ? s * inv_n : s / (double)n;
}

/* Rows in the group that starts at row i of m, groups of g rows: min(g, m - i), 0 past the end. */
static inline size_t rms_group_rows(size_t i, size_t m, size_t g) {
    return i >= m ? 0 : m - i < g ? m - i : g;
}

typedef struct {
    const char *name;
    rms_kernels k[RMS_NDTYPES];
    /* Rows of this many elements or more read a 16-bit weight of x's dtype as it is however many
     * rows there are (see make_weights in module.c); 0 for never. */
    size_t storage_weight_k;
    /* Output rows of a 16-bit type that start on cache lines stream from this many bytes (see
     * streamable in driver.c); 0 for any length. */
    size_t stream_row_16;
    /* On CPUs whose forward does not fuse 16-bit rows across rows and whose backward does (see
     * rms_cpu_fuse_16), the backward's shortest such rows, in bytes; SIZE_MAX for none. */
    size_t fuse_bwd_16;
    /* Whether the backward prefetches 16-bit rows into L1 on CPUs where that measured faster (see
     * rms_cpu_near_16). */
    int near_bwd_16;
    /* Whole 64-byte lines from src to dst (both on lines) with this family's streaming stores,
     * unfenced (see line_rows in driver.c); NULL where it has none. */
    void (*stream_lines)(void *dst, const void *src, size_t lines);
} rms_isa_table;

extern const rms_isa_table rms_isa_scalar;
#if defined(RMSNORM_HAVE_AVX2)
extern const rms_isa_table rms_isa_avx2;
#endif
#if defined(RMSNORM_HAVE_AVX512)
extern const rms_isa_table rms_isa_avx512;
#endif
#if defined(RMSNORM_HAVE_AVX512BF16)
extern const rms_kernels rms_bf16_avx512bf16;
#endif
#if defined(RMSNORM_HAVE_NEON)
extern const rms_isa_table rms_isa_neon;
#endif

#endif
