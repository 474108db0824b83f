/* Roofline reference kernels (copy, triad) used by the benchmarks. */
#ifndef RMSNORM_REFERENCE_H
#define RMSNORM_REFERENCE_H

#include <stddef.h>
#include <stdint.h>

void rms_copy_span(void *dst, const void *src, size_t bytes, int stream);
void rms_triad_span(void *dst, const void *a, const void *b, size_t n, int f64, int stream);

#endif
