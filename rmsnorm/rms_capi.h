/* The raw-buffer entry points that rmsnorm._core exports (as the PyCapsule
 * rmsnorm._core._c_api) for native callers such as the JAX FFI handler: m rows of k contiguous
 * elements; w, rstd and dgamma in the compute type (double for float64, float otherwise); the
 * ISA and thread count in use apply. dtype codes: 0 float32, 1 float64, 2 float16, 3 bfloat16. */
#ifndef RMSNORM_CAPI_H
#define RMSNORM_CAPI_H

#include <stddef.h>

#define RMS_CAPI_VERSION 1

typedef struct {
    int version;
    void (*forward)(int dtype, const void *x, const void *w, void *y, void *rstd, size_t m,
                    size_t k, double eps);
    /* Returns 0, or -1 when the per-thread dgamma rows could not be allocated. */
    int (*backward)(int dtype, const void *dy, const void *x, const void *w, const void *rstd,
                    void *dx, void *dgamma, size_t m, size_t k);
} rms_capi;

#endif
