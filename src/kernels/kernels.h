/* The kernel interface: what one kernel family (scalar, avx2, avx512, neon) provides for each
 * dtype. Pure C on raw buffers: no Python, no NumPy, no threads. The driver (src/driver.c)
 * splits the work and calls these on row ranges or on pieces of one long row. */
#ifndef RMSNORM_KERNELS_H
#define RMSNORM_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* Storage dtypes. The compute type is double for F64 and float for the rest. */
enum rms_dtype { RMS_F32 = 0, RMS_F64 = 1, RMS_F16 = 2, RMS_BF16 = 3, RMS_NDTYPES = 4 };

/* Row sums are taken in chunks of this many elements (a power of two), and a row is split
 * across threads only at chunk bounds. */
#define RMS_CHUNK 1024

/* fwd's buf for rows of k elements of es bytes: room for two rows, and for a block of short
 * rows. */
#define RMS_FWD_BLOCK 4096
#define RMS_FWD_BUF(k, es) ((k) * (es) * 2 + RMS_FWD_BLOCK)

/* Flags of the row functions. */
enum {
    RMS_CAST_BEFORE = 1, /* y = round(x * rstd) * w rather than round(x * rstd * w) */
    RMS_STREAM = 2,      /* outputs bypass the cache (non-temporal stores) where aligned */
    RMS_DG_STORE = 4,    /* backward: the first row stores its dgamma terms, later rows add */
    RMS_W_STORAGE = 8,   /* w holds x's storage type, not the compute type */
    RMS_DG_NARROW = 16   /* backward of one row with RMS_DG_STORE: dg holds x's storage type,
                          * each term rounded to it as it is stored */
};

/* Pointers are void so that one table type serves every dtype. x, r, h, y, dy, dx hold the
 * storage type; rstd and dg the compute type; w the compute type, or with RMS_W_STORAGE x's
 * storage type (a 16-bit weight read as it is, for a few rows or long ones). Strides are in elements and may be
 * negative. Every buffer is aligned to its element type. */
typedef struct {
    /* Rows [0, m): rstd[i] = 1 / sqrt(mean(h_i^2) + eps) and y_i = h_i * rstd[i] * w, where
     * h_i = x_i, or round(x_i + r_i) stored into h when r is not NULL (h may be x or r, and y
     * may be x, r or h's other operand). w may be NULL (no weight). One DRAM read per row: the
     * second pass reads the row from cache; the rows ahead are prefetched. buf: for the add
     * with RMS_STREAM, RMS_FWD_BUF(k, es) bytes (64-byte aligned) in which a kernel may stage h
     * between its passes; otherwise unused (may be NULL). */
    void (*fwd)(const void *x, ptrdiff_t xs, const void *r, ptrdiff_t rs, void *h, ptrdiff_t hs,
                void *y, ptrdiff_t ys, const void *w, void *rstd, size_t m, size_t k,
                double eps, int flags, void *buf);
    /* Rows [0, m): c_i = sum(dy_i * w * x_i * rstd[i]) / k, dx_i = rstd[i] * (dy_i * w -
     * x_i * rstd[i] * c_i) (dx may be dy or x), and dg += dy_i * x_i * rstd[i] in row order
     * (dg NULL: none; RMS_DG_STORE: row 0 stores). */
    void (*bwd)(const void *dy, ptrdiff_t dys, const void *x, ptrdiff_t xs, void *dx,
                ptrdiff_t dxs, const void *w, const void *rstd, void *dg, size_t m, size_t k,
                int flags);
    /* Pieces of one row, for a row split across threads. sumsq: sum of x^2 over n elements,
     * or with r, h = round(x + r) stored plainly and the sum of h^2 (then scale(h) gives the
     * add's y). Row sums (here, in dot and in fwd/bwd) add RMS_CHUNK-element chunk sums left to
     * right; parts, when not NULL, receives each chunk's sum, so that a row split at chunk
     * bounds gets the same bits as one thread's. */
    double (*sumsq)(const void *x, const void *r, void *h, size_t n, double *parts);
    /* y = x * rstd * w over n elements (fwd's second pass). */
    void (*scale)(const void *x, void *y, const void *w, double rstd, size_t n, int flags);
    /* sum(dy * w * x * rstd) over n elements (w may be NULL; flags: RMS_W_STORAGE). */
    double (*dot)(const void *dy, const void *x, const void *w, double rstd, size_t n,
                  int flags, double *parts);
    /* bwd's second pass over n elements, given the row's rstd and c. */
    void (*bwd_piece)(const void *dy, const void *x, const void *w, void *dx, double rstd,
                      double c, void *dg, size_t n, int flags);
    /* The rstd of a row whose sum of squares is unusable (rms_sumsq_ok): NaN when the row
     * holds NaN or Inf, else computed with the row rescaled by its largest magnitude. With r,
     * the row is round(x + r). */
    double (*rescue)(const void *x, const void *r, size_t n, double eps);
    /* Weights: dst (compute type) = offset + src (storage type); and dst = round(src). */
    void (*widen)(const void *src, void *dst, double offset, size_t n);
    void (*narrow)(const void *src, void *dst, size_t n);
} rms_kernels;

typedef struct {
    const char *name;            /* this table's own name (tests select it by this) */
    rms_kernels k[RMS_NDTYPES];
    const char *family;          /* the public family it is a variant of; NULL: name */
} rms_isa_table;

/* A row's sum of squares is usable as it is when finite and not so small that squares of its
 * elements underflowed in the compute type; otherwise the row takes rescue. */
static inline int rms_sumsq_ok(double ss, int f64) {
    return ss <= 1.79769313486231570e308 && ss >= (f64 ? 1e-290 : 1e-30);
}

/* rstd from a usable sum of squares of n elements, in double (rounded by the caller). */
static inline double rms_rstd(double ss, size_t n, double eps) {
    return 1.0 / sqrt(ss / (double)n + eps);
}

/* The backward's c from the row's sum(dy * w * x * rstd) (rounded by the caller). */
static inline double rms_bwd_c(double dot, size_t n) { return dot / (double)n; }

extern const rms_isa_table rms_isa_scalar;
#if defined(RMSNORM_HAVE_AVX2)
extern const rms_isa_table rms_isa_avx2;
#endif
#if defined(RMSNORM_HAVE_AVX512)
extern const rms_isa_table rms_isa_avx512;
#endif
#if defined(RMSNORM_HAVE_AVX512BF16)
extern const rms_isa_table rms_isa_avx512bf16;
#endif
#if defined(RMSNORM_HAVE_NEON)
extern const rms_isa_table rms_isa_neon;
#endif

#endif
