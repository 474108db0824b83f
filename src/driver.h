/* The driver: the one place that owns threading. It splits the rows (or long rows themselves)
 * across an OpenMP team, or across a thread pool that a native caller lends (rms_pool), and
 * calls the kernels of the ISA table in use on each piece. */
#ifndef RMSNORM_DRIVER_H
#define RMSNORM_DRIVER_H

#include "../rmsnorm/rms_capi.h"
#include "kernels/kernels.h"

/* Forward (and residual add when r != NULL). Strides are in elements. rstd is in the compute
 * type (double for F64, float otherwise). w: NULL, or k weights of dtype w_dtype (whose compute
 * type is x's), to which w_offset is added (the driver widens them when they are not already
 * the compute type with offset 0). flags: RMS_CAST_BEFORE. */
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
    int w_dtype;
    double w_offset;
    void *rstd;
    double eps;
} rms_fwd_args;

/* Backward. w as in rms_fwd_args. dgamma: k values of dg_dtype (whose compute type is x's),
 * or NULL for none; summed over the rows in an order that does not depend on the thread
 * count, so it has the same bits on any team. */
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
    int w_dtype;
    double w_offset;
    const void *rstd;
    void *dgamma;
    int dg_dtype;
} rms_bwd_args;

/* pool: run the team on the caller's thread pool (see rms_pool) instead of OpenMP, or NULL.
 * Return 0, or -1 when scratch memory could not be allocated (nothing written). */
int rms_forward(const rms_isa_table *isa, const rms_fwd_args *a, int nthreads,
                const rms_pool *pool);
int rms_backward(const rms_isa_table *isa, const rms_bwd_args *a, int nthreads,
                 const rms_pool *pool);

/* n weights: dst = offset + src (widen: storage -> compute type of `dtype`), or dst =
 * round(src) (narrow: compute -> storage type), split across threads when long. */
void rms_convert(const rms_kernels *kt, int dtype, const void *src, void *dst, double offset,
                 size_t n, int widen, int nthreads);

/* Asks the OS to back the whole 2 MiB pages inside [p, p + bytes) with huge pages when they are
 * first touched (Linux transparent huge pages in "madvise" mode; a no-op elsewhere). A fresh
 * output written in 4 KiB pages costs a page fault per page, several times the kernel itself. */
void rms_advise_huge(void *p, size_t bytes);

/* Bytes per element of a storage dtype (enum rms_dtype). */
size_t rms_esize(int dtype);

/* Reads RMSNORM_NUM_THREADS (then OMP_NUM_THREADS, then the CPUs this process may use) and
 * RMSNORM_STREAM_BYTES, and the caches from sysfs. A malformed variable is ignored, and
 * rms_env_warning() then says which (NULL when there is nothing to say). */
void rms_threads_init(void);
const char *rms_env_warning(void);
/* The output size from which stores bypass the cache, and the L3 it came from (0 if unknown). */
size_t rms_stream_bytes(size_t *l3);
int rms_threads_get(void);
void rms_threads_set(int n);
int rms_have_openmp(void);

/* Test hooks. The members of the team that ran the last forward, add or backward call's rows
 * in this process (1 when it stayed on the caller's thread). */
int rms_last_team_size(void);
/* The least elements of work per thread below which work stays on fewer threads; 0 splits
 * whenever there are two rows or a row long enough to split. Returns the previous value. */
size_t rms_set_min_per_thread(size_t n);
/* Outputs of at least n bytes use streaming stores (0: every output, where alignment allows).
 * Returns the previous value. */
size_t rms_set_stream_bytes(size_t n);

/* Roofline references for the benchmarks, threaded the same way: dst = src (prefetching ahead
 * with `prefetch`, see rms_copy_span), and dst = a + 0.5 * b (float32 or float64). */
void rms_ref_copy(void *dst, const void *src, size_t bytes, int prefetch, int nthreads);
void rms_ref_triad(void *dst, const void *a, const void *b, size_t n, int f64, int nthreads);

#endif
