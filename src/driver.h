/* The driver: the one place that owns threading. It splits the rows (or long rows themselves)
 * across an OpenMP team, or across a thread pool that a native caller lends (rms_pool), and
 * calls the kernels of the ISA table in use on each piece. */
#ifndef RMSNORM_DRIVER_H
#define RMSNORM_DRIVER_H

#include "../rmsnorm/rms_capi.h"
#include "kernels/kernels.h"

/* A flag of rms_fwd_args and rms_bwd_args only, which never reaches the kernels: w holds x's
 * 16-bit storage type (rows of up to RMS_W_OWN_K elements), and each member of the team widens
 * w_offset + w into a float row of its own before its rows (own_w in driver.c). */
#define RMS_W_OWN (1 << 20)
#define RMS_W_OWN_K 8192

/* Forward (and residual add when r != NULL). Strides are in elements; rstd is in the compute
 * type (double for F64, float otherwise); w may be NULL, else in the compute type, or in x's
 * storage type with RMS_W_STORAGE in flags (offset 0) or with RMS_W_OWN (offset w_offset). */
typedef struct {
    int dtype, flags;
    size_t m, k;
    const void *x;
    ptrdiff_t xs;
    const void *r; /* residual, or NULL for plain rms_norm */
    ptrdiff_t rs;
    void *h; /* h = round(x + r); only with r */
    ptrdiff_t hs;
    void *y;
    ptrdiff_t ys;
    const void *w;
    void *rstd;
    double eps;
    double w_offset; /* with RMS_W_OWN */
} rms_fwd_args;

/* Backward. dgamma (k entries, compute type) is NULL when there is no weight; w and w_offset as
 * in rms_fwd_args. flags: RMS_W_STORAGE or RMS_W_OWN, and RMS_DG_NARROW for one row (m == 1) of
 * a 16-bit type, whose dgamma then has that type (each term rounded to it once, as a narrowing
 * of the compute-type row would round it). */
typedef struct {
    int dtype, flags;
    size_t m, k;
    const void *dy;
    ptrdiff_t dys;
    const void *x;
    ptrdiff_t xs;
    void *dx;
    ptrdiff_t dxs;
    const void *w;
    const void *rstd;
    void *dgamma;
    double w_offset;
    void *dgamma_x; /* or NULL: dgamma rounded to x's 16-bit type too, by the members whose
                     * columns it is (not with RMS_DG_NARROW) */
} rms_bwd_args;

/* pool: run the team on the caller's thread pool (see rms_pool) instead of OpenMP, or NULL.
 * Returns 0, or -1 when the members' weight rows (RMS_W_OWN) could not be allocated (nothing
 * written). */
int rms_forward(const rms_kernels *kt, const rms_fwd_args *a, int nthreads,
                const rms_pool *pool);
/* Returns 0, or -1 when the per-thread dgamma rows or the members' weight rows could not be
 * allocated (nothing written). */
int rms_backward(const rms_kernels *kt, const rms_bwd_args *a, int nthreads,
                 const rms_pool *pool);

/* Weights: dst = offset + src (widen: storage -> compute type of `dtype`), or dst = round(src)
 * (narrow: compute -> storage type), split across threads when long. */
void rms_convert(const rms_kernels *kt, int dtype, const void *src, void *dst, double offset,
                 size_t n, int widen, int nthreads);

/* Thread count: RMSNORM_NUM_THREADS, then OMP_NUM_THREADS, then the CPUs this process may use. */
/* Asks the OS to back the whole 2 MiB pages inside [p, p + bytes) with huge pages when they are
 * first touched (Linux transparent huge pages in "madvise" mode; a no-op elsewhere). A fresh
 * output written in 4 KiB pages costs a page fault per page, several times the kernel itself. */
void rms_advise_huge(void *p, size_t bytes);

/* Bytes per element of a storage dtype (enum rms_dtype). */
size_t rms_esize(int dtype);

void rms_threads_init(void);
/* The output size from which stores bypass the cache, and the L3 it came from (0 if unknown). */
size_t rms_stream_bytes(size_t *l3);
int rms_threads_get(void);
void rms_threads_set(int n);
int rms_have_openmp(void);

/* Test hooks. The team size of the last forward, add or backward in this process (1 when it ran
 * on the calling thread); the fewest elements of work a thread gets, below which work stays on
 * fewer threads (0: split whenever possible); the output size from which stores stream (0:
 * always, where alignment allows). The setters return the previous value. */
int rms_last_team_size(void);
size_t rms_set_min_per_thread(size_t n);
size_t rms_set_stream_bytes(size_t n);

/* Roofline references for the benchmarks, threaded the same way: dst = src (prefetching ahead
 * with `prefetch`, see rms_copy_span), and dst = a + 0.5 * b (float32 or float64). */
void rms_ref_copy(void *dst, const void *src, size_t bytes, int prefetch, int nthreads);
void rms_ref_triad(void *dst, const void *a, const void *b, size_t n, int f64, int nthreads);

#endif
