/* Roofline references for the benchmarks: a copy and a triad that move the same bytes as the
 * forward and backward passes, with non-temporal stores under the same rule as the kernels. */
#include "reference.h"

#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#if defined(__SSE2__)
/* Whole 64-byte blocks from i, streamed; with `ahead`, each block first prefetches the line
 * `ahead` bytes further on (PREFETCHNTA), while that line is still inside the source. */
static inline size_t copy_blocks(char *d, const char *s, size_t i, size_t bytes,
                                 const size_t ahead) {
    for (; i + 64 <= bytes; i += 64) {
        if (ahead && i + ahead < bytes)
            _mm_prefetch(s + i + ahead, _MM_HINT_NTA);
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    return i;
}
#endif

void rms_copy_span(void *dst, const void *src, size_t bytes, int stream, int prefetch) {
#if defined(__SSE2__)
    if (stream) {
        char *d = (char *)dst;
        const char *s = (const char *)src;
        size_t head = (16 - (uintptr_t)d % 16) % 16;
        head = head < bytes ? head : bytes;
        memcpy(d, s, head);
        size_t i = prefetch ? copy_blocks(d, s, head, bytes, RMS_COPY_AHEAD)
                            : copy_blocks(d, s, head, bytes, 0);
        memcpy(d + i, s + i, bytes - i);
        _mm_sfence();
        return;
    }
#endif
    (void)stream;
    (void)prefetch;
    memcpy(dst, src, bytes);
}

void rms_stream_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

#define RMS_TRIAD(T)                                                                           \
    do {                                                                                       \
        T *d = (T *)dst;                                                                       \
        const T *x = (const T *)a, *z = (const T *)b;                                         \
        for (size_t i = 0; i < n; i++)                                                         \
            d[i] = x[i] + (T)0.5 * z[i];                                                       \
    } while (0)

void rms_triad_span(void *dst, const void *a, const void *b, size_t n, int f64, int stream) {
#if defined(__SSE2__)
    if (stream && !f64 && (uintptr_t)dst % 16 == 0) {
        float *d = (float *)dst;
        const float *x = (const float *)a, *z = (const float *)b;
        __m128 half = _mm_set1_ps(0.5f);
        size_t i = 0;
        for (; i + 4 <= n; i += 4)
            _mm_stream_ps(d + i, _mm_add_ps(_mm_loadu_ps(x + i),
                                            _mm_mul_ps(half, _mm_loadu_ps(z + i))));
        for (; i < n; i++)
            d[i] = x[i] + 0.5f * z[i];
        _mm_sfence();
        return;
    }
#endif
    (void)stream;
    if (f64)
        RMS_TRIAD(double);
    else
        RMS_TRIAD(float);
}
