/* The raw-buffer entry points that rmsnorm._core exports (as the PyCapsule
 * rmsnorm._core._c_api) for native callers such as the JAX FFI handler: m rows of k contiguous
 * elements; w, rstd and dgamma in the compute type (double for float64, float otherwise, unless
 * flags say x's 16-bit dtype); the ISA and thread count in use apply. dtype codes: 0 float32,
 * 1 float64, 2 float16, 3 bfloat16. */
#ifndef RMSNORM_CAPI_H
#define RMSNORM_CAPI_H

#include <stddef.h>

#define RMS_CAPI_VERSION 4

/* flags of forward and backward */
#define RMS_CAPI_W_AS_X 8   /* w holds x's 16-bit dtype (offset 0), as weight_as_is allows */
#define RMS_CAPI_DG_AS_X 64 /* backward of one row (m == 1) of a 16-bit x: dgamma in x's dtype */

/* A caller's thread pool (XLA's, say) for the kernels to run on instead of their own OpenMP
 * threads, so that two pools never compete for the same cores. schedule(ctx, task, data) runs
 * task(data) once, later, on one of up to nthreads threads, and returns 0; or returns nonzero
 * when it cannot. Tasks need not run in parallel, nor start before the call returns: work that
 * no task has taken is done by the calling thread. */
typedef struct {
    int nthreads;
    int (*schedule)(void *ctx, void (*task)(void *), void *data);
    void *ctx;
} rms_pool;

/* pool: NULL for rmsnorm's own threads. */
typedef struct {
    int version;
    void (*forward)(int dtype, const void *x, const void *w, int flags, void *y, void *rstd,
                    size_t m, size_t k, double eps, const rms_pool *pool);
    /* Returns 0, or -1 when the per-thread dgamma rows could not be allocated. */
    int (*backward)(int dtype, const void *dy, const void *x, const void *w, int flags,
                    const void *rstd, void *dx, void *dgamma, size_t m, size_t k,
                    const rms_pool *pool);
    /* n weights between dtype's storage type and its compute type: dst = offset + src (widen),
     * or dst = src rounded (narrow; offset unused). */
    void (*convert)(int dtype, const void *src, void *dst, double offset, size_t n, int widen);
    /* Whether a weight of x's 16-bit dtype (offset 0) is faster read as it is (RMS_CAPI_W_AS_X)
     * than widened first, for the forward of m rows of k (the module's backward widens it on
     * more CPUs). */
    int (*weight_as_is)(int dtype, size_t m, size_t k);
} rms_capi;

#endif
