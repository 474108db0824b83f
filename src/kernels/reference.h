/* Roofline reference kernels (copy, triad) used by the benchmarks. */
#ifndef RMSNORM_REFERENCE_H
#define RMSNORM_REFERENCE_H

#include <stddef.h>
#include <stdint.h>

/* How far ahead the prefetching copy reads (PREFETCHNTA, on x86 with SSE2). */
#define RMS_COPY_AHEAD 4096
/* dst = src; streamed (non-temporal stores) when `stream`. With `prefetch`, each line is also
 * prefetched RMS_COPY_AHEAD bytes ahead: on an AMD EPYC (Zen 4), one thread, 256 MiB, 13.9 ms ->
 * 11.2 ms; on an Intel Xeon, 48.8 ms -> 79.3 ms. The benchmarks time both copies and take the
 * faster as the roofline. */
void rms_copy_span(void *dst, const void *src, size_t bytes, int stream, int prefetch);
void rms_triad_span(void *dst, const void *a, const void *b, size_t n, int f64, int stream);
/* Orders the streaming stores before it (SFENCE on x86) before the stores after it. */
void rms_stream_fence(void);

#endif
