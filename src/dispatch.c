/* Picks the kernel family at run time, by CPU features only. A family counts as available only
 * when the CPU has the instructions (CPUID) AND the OS saves their registers (XCR0 via XGETBV);
 * the build may also have left a family out when the compiler could not target it. */
#include "dispatch.h"

#include <string.h>

/* Only the probes of the families this build holds (an unused static function is an error
 * under -Werror, e.g. in the sanitizer build of an AVX2-only CPU). */
#if (defined(__x86_64__) || defined(__i386__)) &&                                              \
    (defined(RMSNORM_HAVE_AVX2) || defined(RMSNORM_HAVE_AVX512))
#include <cpuid.h>

static unsigned long long read_xcr0(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) /* OSXSAVE */
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

static int x86_has_avx2(void) {
    unsigned a, b, c, d;
    if ((read_xcr0() & 0x6) != 0x6) /* XMM and YMM state */
        return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    int fma = (c >> 12) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    return fma && avx && f16c && ((b >> 5) & 1);
}

#if defined(RMSNORM_HAVE_AVX512)
static int x86_has_avx512(void) {
    unsigned a, b, c, d;
    if ((read_xcr0() & 0xe6) != 0xe6) /* XMM, YMM, opmask, ZMM0-15 and ZMM16-31 state */
        return 0;
    if (!x86_has_avx2() || !__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    int f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    return f && dq && bw && vl;
}
#endif
#if defined(RMSNORM_HAVE_AVX512BF16)
static int x86_has_avx512bf16(void) {
    unsigned a, b, c, d;
    return x86_has_avx512() && __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
}
#endif
#endif

static const rms_isa_table *available[RMS_MAX_ISAS];
static int n_available;
static const rms_isa_table *current = &rms_isa_scalar;

void rms_dispatch_init(void) {
    int n = 0;
#if defined(RMSNORM_HAVE_AVX512BF16)
    if (x86_has_avx512bf16())
        available[n++] = &rms_isa_avx512bf16;
#endif
#if defined(RMSNORM_HAVE_AVX512)
    if (x86_has_avx512())
        available[n++] = &rms_isa_avx512;
#endif
#if defined(RMSNORM_HAVE_AVX2)
    if (x86_has_avx2())
        available[n++] = &rms_isa_avx2;
#endif
#if defined(RMSNORM_HAVE_NEON)
    available[n++] = &rms_isa_neon; /* Advanced SIMD is mandatory on AArch64 */
#endif
    available[n++] = &rms_isa_scalar;
    n_available = n;
    rms_isa_select(available[0]);
}

int rms_isa_list(const rms_isa_table *out[RMS_MAX_ISAS]) {
    for (int i = 0; i < n_available; i++)
        out[i] = available[i];
    return n_available;
}

/* The first available table whose family name (or, with variant, own name) is name. */
static const rms_isa_table *find(const char *name, int variant) {
    for (int i = 0; i < n_available; i++)
        if (strcmp(variant ? available[i]->name : rms_isa_family(available[i]), name) == 0)
            return available[i];
    return NULL;
}

const rms_isa_table *rms_isa_find(const char *name) { return find(name, 0); }

const rms_isa_table *rms_isa_find_variant(const char *name) { return find(name, 1); }

const rms_isa_table *rms_isa_current(void) { return __atomic_load_n(&current, __ATOMIC_ACQUIRE); }

void rms_isa_select(const rms_isa_table *t) { __atomic_store_n(&current, t, __ATOMIC_RELEASE); }
