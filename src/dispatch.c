/* Picks the kernel family at run time. A family counts as available only when the CPU has the
 * instructions (CPUID) AND the OS saves their registers (XCR0 via XGETBV); the build may also
 * have left a family out when the compiler could not target it. */
#include "dispatch.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
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

static int x86_has_avx512(void) {
    unsigned a, b, c, d;
    if ((read_xcr0() & 0xe6) != 0xe6) /* XMM, YMM, opmask, ZMM0-15 and ZMM16-31 state */
        return 0;
    if (!x86_has_avx2() || !__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    int f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    return f && dq && bw && vl;
}

#if defined(RMSNORM_HAVE_AVX512BF16)
static int x86_has_avx512bf16(void) {
    unsigned a, b, c, d;
    return x86_has_avx512() && __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
}
#endif
#endif

static const rms_isa_table *available[RMS_MAX_ISAS];
#if defined(RMSNORM_HAVE_AVX512)
static rms_isa_table avx512; /* rms_isa_avx512, with native bfloat16 rounding where available */
#endif
static int n_available;
static size_t pairs_aliased_min = 0;         /* the shortest aliased rows paired, in bytes */
static int pairs_env = -1;                    /* RMSNORM_PAIR_ROWS: 1 every row, 0 none */
static int bwd_ahead_32 = 0, bwd_ahead_32_env = -1; /* rms_cpu_bwd_ahead_32; its override */
static int fwd_near = 0, fwd_ahead_32 = 0, fwd_ahead_32_env = -1; /* rms_cpu_fwd_flags */
/* 32- and 64-bit rows not paired: [min, max). On Intel CPUs rows of 32 to 128 KiB (rms_cpu_pairs
 * in dispatch.h). On AMD CPUs from Zen 5 on, rows under 4 KiB, which the CPU's own prefetcher
 * fetches there (rms_cpu_hw_prefetch): the same build in one process with RMSNORM_PAIR_ROWS off
 * and on, each pair in both orders, 64 MiB of x, page-aligned, one thread (two), one row at a
 * time over pairs: float32 rows of 384 bytes 0.90 (0.97), 512 0.92 (0.98), 768 0.68 (0.81), 896
 * 0.94 (0.93), 1 KiB 0.98 (0.98), 1280 bytes 0.69 (0.84), 1.5 KiB 0.80 (0.97), 2 KiB 0.80 (0.90),
 * 3 KiB 0.86 (0.90), but 640 bytes 1.11-1.13 (0.97); float64 768 bytes 0.75, 1280 0.70, 2 KiB
 * 0.78 (0.87), 3 KiB 0.82 (0.88); outputs 16 bytes past a page, float32 512 bytes 0.91, 640 0.88,
 * 1280 0.88, 2 KiB 1.05, 3 KiB 0.91 (two); in cache the same within noise (2048x256 0.94, 4096x128
 * 1.03, 4096x320 0.98, 1024x768 1.02; float64 2048x256 1.06). Rows of 4 and 8 KiB measured the
 * same either way (0.97 to 1.00) and pair. */
static size_t single_min = 0, single_max = 0;
/* rms_cpu_hw_prefetch: rows shorter than this lean on the CPU's own prefetcher. */
static size_t hw_prefetch_below = 0;
/* 16-bit rows fused across rows (rms_cpu_fuse_16): in both passes (AMD CPUs), or in the
 * backward only, from the kernel family's fuse_bwd_16 bytes (other x86 CPUs: 1 KiB with AVX-512,
 * 512 bytes with AVX2). Fused against two passes in turn (rows of 8 KiB or more in pairs on
 * AVX-512), the same build in one process with RMSNORM_FUSE_16 on and off, each pair in both
 * orders (the geometric mean), page-aligned:
 *   2-core Xeon (AVX-512), one / two threads: bfloat16 131072x512 0.93 / 0.93, 65536x1024
 *     0.94-0.95 / 0.97, 16384x4096 0.91 / 0.99, 8192x8192 0.96 / 1.00, 4096x12288 0.95,
 *     1024x32768 0.90 / 0.87, 256x65536 0.92 / 0.93; float16 131072x512 0.95 / 0.98,
 *     16384x4096 1.01 (two), 8192x8192 0.96 (two), 4096x12288 0.93, 1024x32768 0.88 / 0.84,
 *     256x65536 0.90 / 0.93; but rows of 512 bytes slower (bfloat16 262144x256 1.03 / 1.07,
 *     float16 1.05). Its AVX2 kernels gained from 512 bytes: bfloat16 262144x256 0.87 / 0.91,
 *     131072x512 0.88, 16384x4096 0.93; float16 262144x256 0.87 / 0.93, 16384x4096 0.90.
 *   16-core Xeon (AVX-512), 1 / 4 / 16 threads: bfloat16 131072x512 0.87 / 0.96 / 0.99,
 *     65536x1024 0.91 / 0.92 / 0.91, 2048x32768 0.86 / 0.86 / 0.93, 16384x4096 1.02 / 1.00 /
 *     1.02; float16 16384x4096 1.01 / 1.00 / 1.00; from memory, 32768x8192 at 1 / 4 / 8
 *     threads: bfloat16 0.96 / 1.02 / 0.97, float16 1.00 (4) / 0.99 (8). Its AVX2 kernels, 1 /
 *     4 / 16 threads: bfloat16 262144x256 0.86 / 0.90 / 0.94, 131072x512 0.90 / 0.95 / 0.89,
 *     16384x4096 1.01 / 0.94 / 0.85; float16 262144x256 0.92 / 1.00 / 1.00.
 * The forward fused measured slower (2-core Xeon, bfloat16, one thread: 16384x4096 1.04,
 * 65536x1024 1.15, 1024x32768 1.04). */
static int fuse_16 = 0, fuse_16_bwd = 0;
static size_t early_h_32 = 32768; /* rms_cpu_early_h_bytes */
/* rms_cpu_storage_weight_k: on Zen 5 and later, 16-bit rows of over 4096 elements read a 16-bit
 * weight as it is, rather than from the kernel family's storage_weight_k (8192) on: beside the
 * two rows of the fused forward (FN(fused), rms_cpu_fuse_16), a float32 weight of 20 KiB or more
 * overflowed the 48 KiB L1, and rows of 10 to 15 KiB took up to twice their time. The 2-core Zen
 * 5 VM, two builds alternating in one process, page-aligned, each pair in both orders, new time
 * over old, one thread, the forward fused: bfloat16 rows of 10 KiB 0.88, 12 KiB 0.64, 14 KiB
 * 0.51, 15 KiB 0.49 (1.56-2.13 of a copy before, 0.95-1.06 after); float16 0.51 to 0.89; in two
 * passes at two threads 0.96 to 1.01; the backward 0.97 / 0.96 (bfloat16 8192x6144, one / two
 * threads), the add 0.98 / 1.01; in cache the same (64x6144 1.01). Rows of 4096 keep the float32
 * weight: in cache, read again for every row from L1, it is faster there (64x4096 one / two
 * threads: forward 1.11 / 1.13, backward 1.12, float16 forward 1.13 of the time with the 16-bit
 * weight). A 16-core Intel Xeon, whose forward does not fuse, measured the same change the other
 * way at 1 / 4 / 16 threads: bfloat16 32768x6144 forward 0.98 / 0.98 / 0.94, but backward 1.08 /
 * 1.01 / 1.02, add 1.05 / 1.07 / 1.03, and in cache 64x6144 forward 1.23 / 1.05 / 1.11, backward
 * 1.17 (one thread), so other CPUs keep the family's length. */
static size_t storage_k_zen5 = 0;
/* On Zen 4 (AMD, AVX-512, before Zen 5) the backward widens a 16-bit weight however long its rows
 * (rms_cpu_storage_weight_k(1) is 0): read as it is, the weight's conversions beside those of dy
 * and x cost more than the float32 row's extra bytes. The 2-core Zen 4 VM, the same build in one
 * process with the family's 8192 and with none, page-aligned, widened over as it is, one / two
 * threads: bfloat16 8192x8192 0.83 / 0.89, 4096x12288 0.84 / 1.00, 4096x16384 0.82 / 0.92,
 * 2048x32768 0.87 / 0.87, 512x65536 0.95 / 0.98, 256x262144 0.86 / 0.96; float16 8192x8192 0.80 /
 * 0.80, 4096x12288 0.84 / 0.96, 2048x32768 0.82 / 0.88; in cache (one thread) bfloat16 64x8192
 * 0.86, 256x8192 0.86, 16x32768 0.89, float16 8x65536 0.95. The forward keeps the family's rule:
 * its fused rows of 16 to 32 KiB measured slower widened (bfloat16 8192x8192 1.33 / 1.12,
 * 4096x12288 1.21 / 1.12, 4096x16384 1.14 / 1.39), and the add, which takes the forward's
 * weight, gained less (bfloat16 8192x8192 0.91 / 0.99, 2048x32768 0.94 / 1.01, float16 8192x8192
 * 0.94 / 1.02). */
static int bwd_widen_16 = 0;
/* With fuse_16, the forward's rows of this many bytes or more still go in two passes: on AMD CPUs
 * with AVX-512, whose fused forward rows of 64 KiB or more take no prefetch (FN(fused_ahead)). On
 * Zen 5, the same build in one process with RMSNORM_FUSE_16 off and on, each pair in both orders,
 * one thread, new time over old: bfloat16 1024x32768 0.39, 256x65536 0.37, float16 1024x32768 0.42;
 * rows of 32 KiB and less measured faster fused (bfloat16 2048x16384 1.18, 8192x8192 1.11,
 * 4096x8192 1.08; float16 2048x16384 1.19), and so did the backward and the add of 64 KiB (bfloat16
 * 1024x32768 1.05 and 1.03), which keep it. And the forward's rows under fuse_16_fwd_min bytes go
 * in two passes there too (the kernels fuse none under 512 bytes): with the same switches, outputs
 * 16 bytes past a page (page-aligned), one / two threads: bfloat16 262144x256 0.82-0.83 / 0.94-0.98
 * (0.65 / 0.80), float16 174762x384 0.92 / 0.97 (0.92 / 1.08). Rows of 1 KiB measured either way
 * (bfloat16 131072x512 1.05 / 0.94, float16 1.07 / 0.92; 65536x1024 1.10 / 0.79) and stay fused.
 * Zen 4 (AMD EPYC, 2 cores, 1 MiB of L2 a core) takes both rules: the same build in one process
 * with RMSNORM_FUSE_16 on and off, page-aligned, unfused over fused at one / two threads: bfloat16
 * 2048x32768 0.53 / 0.77, 512x65536 0.54 / 0.74, 256x131072 0.57 / 0.73; float16 2048x32768 0.60 /
 * 0.81, 512x65536 0.58 / 0.58, 256x131072 0.61 / 0.60; rows of 512 KiB either way (128x262144
 * bfloat16 0.85 / 1.11, float16 0.89 / 1.14), of 1 and 2 MiB the same (0.99 to 1.03); rows of 16 to
 * 48 KiB faster fused (bfloat16 1.06 / 1.01 to 1.16, float16 1.02 / 1.01 to 1.22). Under 1 KiB:
 * bfloat16 262144x256 0.72 / 0.98, 174762x384 0.76 / 1.02, float16 0.97 / 1.00 and 1.07 / 0.96;
 * rows of 1 and 2 KiB either way (bfloat16 0.88 to 0.97, float16 1.04 to 1.06). Measured again
 * later, each pair in both orders, page-aligned, one thread, rows of 1 to 1.75 KiB gained
 * unfused (bfloat16 131072x512 0.88 and 0.89, 104857x640 0.87, 87381x768 0.90, 74898x896 0.95;
 * float16 0.98 and 0.97, 0.91 and 0.93, 0.94 and 0.96, 0.94; two threads, 131072x512 0.98 either
 * type) and rows of 2 KiB measured the same (65536x1024 0.98 and 1.01), so on Zen 4 the forward
 * fuses its 16-bit rows from 2 KiB. */
static size_t fuse_16_fwd_below = SIZE_MAX, fuse_16_fwd_min = 0;
/* On Zen 4 the backward's 16-bit rows under fuse_16_bwd_min bytes go in two passes too. The same
 * build in one process with RMSNORM_FUSE_16 on and off, page-aligned, unfused over fused at one /
 * two threads: bfloat16 262144x256 0.79 / 0.94 and 0.84 / 0.96 in two runs, 174762x384 0.90 /
 * 0.92; float16 262144x256 0.80 / 0.75 and 0.80 / 0.98, 174762x384 0.88 / 0.93; rows of 1 KiB
 * and more the same or slower (bfloat16 131072x512 1.02 / 0.99, 65536x1024 1.00 / 1.06, 16384x4096
 * 0.99 / 1.15; float16 0.98 / 1.03, 0.99 / 1.05, 0.99 / 1.11). */
static size_t fuse_16_bwd_min = 0;
/* And on Zen 5 the forward fuses its 16-bit rows on one thread only (fuse_16_fwd_one). The same
 * build in one process with RMSNORM_FUSE_16 off and on, each pair in both orders, page-aligned, 96
 * MiB of x, unfused over fused, two threads: bfloat16 rows of 2 KiB 0.97, 4 KiB 0.94, 6 KiB 0.94,
 * 8 KiB 0.93, 16 KiB 0.92, 24 KiB 0.91, 32 KiB 0.93, 48 KiB 0.96; float16 0.83 to 1.00 (24 KiB
 * 0.96, 32 KiB 0.99); with the 16-bit weight of rows over 4096 elements
 * (rms_cpu_storage_weight_k), rows of 9 to 15 KiB 0.90 to 1.03 (bfloat16 10 KiB 0.96, 15 KiB 0.90;
 * float16 12 KiB 0.98). One thread: bfloat16 rows from 16 KiB 1.09 to 1.18 (16 KiB 1.09, 20 KiB
 * 1.18, 32 KiB 1.15, 48 KiB 1.11), float16 1.14 to 1.25; rows of 1 to 8 KiB 0.96 to 1.14; rows of
 * 9 to 15 KiB with the 16-bit weight either way (bfloat16 1.07 to 1.11 and float16 1.03 to 1.15 in
 * one process; bfloat16 0.91 to 1.06 in later ones). The backward keeps its rows fused at both
 * (bfloat16 rows of 4 to 24 KiB, unfused over fused, 1.05 to 1.20 at one thread and 1.07 to 1.14
 * at two). */
static int fuse_16_fwd_one = 0;
/* rms_cpu_stream_edges: 32- and 64-bit rows of edges_min bytes or more, 16-bit rows of
 * edges_min_16. Intel CPUs: every row. AMD CPUs from Zen 5 on: 32- and 64-bit rows of 256 bytes
 * or more, and 16-bit rows of 512, measured on a 2-core EPYC Zen 5 VM (AVX-512), every output
 * 16 bytes past a page as np.empty_like gives it, each pair in both orders (the geometric mean),
 * new time over old, one thread (two). The same build in one process with RMSNORM_STREAM_EDGES
 * on and off:
 *   float32 1M x 64: forward 0.93 (0.94), backward 0.93 (0.89), add 0.73 (0.72); 699050x96:
 *   forward 0.90, backward 0.83, add 0.80; float64 1M x 32: forward 0.85, backward 0.96, add
 *   0.72; rows of 1 KiB and more the same within noise (float32 262144x256 forward 1.00 (0.92 to
 *   1.02), backward 0.99 (0.99), add 0.90 to 1.01 (0.93 to 1.10); 65536x1024 forward 1.02,
 *   backward 0.98, add 1.01; 16384x4096 forward 1.01, backward 0.99, add 1.01).
 *   bfloat16 262144x256, in three processes: forward 0.80 to 1.25 (0.69 to 1.27), backward 0.72
 *   to 0.80 (0.77 to 1.09), add 0.80 to 0.83 (0.71 to 0.84); float16 262144x256 forward 0.93,
 *   backward 0.78, add 0.83 (0.76); rows of 1 KiB and more the same within noise (bfloat16
 *   131072x512 add 1.02 (0.99), 65536x1024 forward 1.07, backward 1.00, add 0.96).
 * Two builds alternating in one process, 16-bit rows from 512 bytes against none, in two
 * processes: bfloat16 262144x256 forward 0.79 to 1.24 (0.68 to 0.79), backward 0.96 to 1.05
 * (0.77 to 0.97), add 0.61 to 0.83 (0.59 to 0.72); float16 174762x384 forward 0.96 to 1.15 (0.74
 * to 0.95), backward 0.80 to 0.81, add 0.61 to 0.62. The forward's losses came fused (see
 * fuse_16_fwd_min: unfused, the same rows took 0.82 of the time).
 * Shorter rows keep the rule for other CPUs, where they lost or measured either way: float32 2M
 * x 32 forward 1.49 (add 0.92, backward 0.97); bfloat16 524288x128 forward 0.90 (0.98),
 * backward 1.01 (1.01), float16 add 1.26 (1.05), bfloat16 add 1.03 (0.89), 1M x 64 0.99 to 1.03. */
static size_t edges_min = SIZE_MAX, edges_min_16 = SIZE_MAX;
/* rms_cpu_fuse_32: whether 32- and 64-bit rows may be fused across rows. On an AMD EPYC Zen 5
 * (2 cores, AVX-512), fused rows took longer than rows in two passes whose second pass prefetches
 * the rows ahead into L2, at every length the kernels fuse. The same build in one process with
 * RMSNORM_FUSE_32 on and off, the software prefetch on (RMSNORM_HW_PREFETCH=0), each pair in both
 * orders, new time over old, one thread: float32 forward 16384x4096 0.67, 65536x1024 0.91,
 * 32768x2048 0.90; add 65536x1024 0.93, 32768x2048 1.01; backward 1024x32768 0.62, 256x65536
 * 0.69. 16-bit rows, fused on AMD CPUs, stay fused there (bfloat16 forward 65536x1024 1.12,
 * float16 forward 16384x4096 1.11, backward 1.08 in two passes). Zen 4 (AMD EPYC, 2 cores,
 * AVX-512) too, with its own prefetch settings: the same build in one process with
 * RMSNORM_FUSE_32 on and off, page-aligned, two passes over fused, one / two threads: float32
 * forward 65536x1024 0.68 / 0.69, 32768x2048 0.85 / 0.82, 16384x4096 0.81 / 0.95; add 65536x1024
 * 0.63 / 0.63; backward 1024x32768 0.64 / 0.88, 4096x12288 0.99 / 0.92; float64 forward
 * 32768x1024 0.71 / 0.66; the other shapes from 1M x 64 to 256x131072 0.91 to 1.04 (float32
 * backward 1M x 64 1.08 and 1.02 in two runs, float64 backward 32768x1024 at two threads 1.14,
 * then 0.96 and 1.02). */
static int fuse_32 = 1;
static int near_16 = 0;      /* rms_cpu_near_16: on Intel CPUs */
static int near_16_env = -1; /* RMSNORM_L1_PREFETCH_16, or -1 */
static const rms_isa_table *current = &rms_isa_scalar;

#if defined(__x86_64__) || defined(__i386__)
/* Whether CPUID's vendor string (EBX, EDX, ECX of leaf 0) is `name`, e.g. "GenuineIntel". */
static int x86_vendor_is(const char *name) {
    unsigned a = 0, r[3] = {0, 0, 0};
    if (!__get_cpuid(0, &a, &r[0], &r[2], &r[1]))
        return 0;
    return memcmp(r, name, 12) == 0;
}

/* The CPU's family: CPUID leaf 1's base family, plus its extended family where the base is 0xf
 * (AMD: 0x19 Zen 3 and Zen 4, 0x1a Zen 5). */
static unsigned x86_family(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    unsigned base = (a >> 8) & 0xf;
    return base == 0xf ? base + ((a >> 20) & 0xff) : base;
}
#endif

/* An on/off tuning knob: 1 when the variable `name` is "1", 0 when it is "0", else dflt. */
static int env_switch(const char *name, int dflt) {
    const char *s = getenv(name);
    return s && strcmp(s, "1") == 0 ? 1 : s && strcmp(s, "0") == 0 ? 0 : dflt;
}

int rms_cpu_pairs(size_t row_bytes, size_t es, int aliased) {
    if (pairs_env >= 0)
        return pairs_env;
    return (!aliased || row_bytes >= pairs_aliased_min) &&
           (es < 4 || row_bytes < single_min || row_bytes >= single_max);
}

/* A choice made for calls on one thread only (`on`: this CPU's), unless env (a knob's override,
 * -1 for none) sets it for every call. */
static int one_thread_choice(int env, int on, int nthreads) {
    return env >= 0 ? env : on && nthreads == 1;
}

int rms_cpu_bwd_ahead_32(int nthreads) {
    return one_thread_choice(bwd_ahead_32_env, bwd_ahead_32, nthreads);
}

int rms_cpu_fwd_flags(int nthreads) {
    int ahead = one_thread_choice(fwd_ahead_32_env, fwd_ahead_32, nthreads);
    return fwd_near ? RMS_FWD_NEAR | (ahead ? RMS_FWD_AHEAD_32 : 0) : 0;
}

int rms_cpu_hw_prefetch(size_t row_bytes) { return row_bytes < hw_prefetch_below; }

int rms_cpu_fuse_32(void) { return fuse_32; }

size_t rms_cpu_early_h_bytes(void) { return early_h_32; }

size_t rms_cpu_storage_weight_k(int backward) {
    if (backward && bwd_widen_16)
        return 0;
    size_t k = rms_isa_current()->storage_weight_k;
    return k && storage_k_zen5 && storage_k_zen5 < k ? storage_k_zen5 : k;
}

int rms_cpu_fuse_16(int backward, size_t row_bytes, int nthreads) {
    if (fuse_16)
        return backward ? row_bytes >= fuse_16_bwd_min :
               (row_bytes >= fuse_16_fwd_min && row_bytes < fuse_16_fwd_below &&
                (!fuse_16_fwd_one || nthreads == 1));
    return backward && fuse_16_bwd && row_bytes >= rms_isa_current()->fuse_bwd_16;
}

int rms_cpu_stream_edges(size_t es, size_t row_bytes) {
    return row_bytes >= (es >= 4 ? edges_min : edges_min_16);
}

int rms_cpu_near_16(void) {
    return near_16_env >= 0 ? near_16_env : near_16 && rms_isa_current()->near_bwd_16;
}

void rms_dispatch_init(void) {
    int n = 0;
#if defined(__x86_64__) || defined(__i386__)
    /* AMD CPUs with AVX-512 (Zen 4 and later); on Zen 3 the software prefetch measured faster.
     * pairs_aliased_min matters only to kernels that pair rows (32 vector registers: AVX-512),
     * so on CPUs without AVX-512, Zen 3 among them, it changes nothing. */
    const int amd = x86_vendor_is("AuthenticAMD"), intel = x86_vendor_is("GenuineIntel");
    int amd_avx512 = amd && x86_has_avx512(), zen5 = amd && x86_family() >= 0x1a;
    int zen4 = amd_avx512 && !zen5; /* AMD with AVX-512 before Zen 5 */
    int zen45 = amd_avx512 || zen5; /* Zen 4 and later */
    /* Zen 4: every row the kernels would prefetch less far than the hardware; Zen 5 and later:
     * rows under 4 KiB (see rms_cpu_hw_prefetch in dispatch.h). */
    hw_prefetch_below = !amd_avx512 ? 0 : zen5 ? 4096 : SIZE_MAX;
    fuse_32 = !zen45;
    bwd_ahead_32 = zen5;
    fwd_near = fwd_ahead_32 = zen5;
    fuse_16_fwd_below = zen45 ? 65536 : SIZE_MAX;
    fuse_16_fwd_min = zen4 ? 2048 : zen5 ? 1024 : 0;
    fuse_16_fwd_one = zen5;
    fuse_16_bwd_min = zen4 ? 1024 : 0;
    early_h_32 = zen5 ? 16385 : 32768;
    storage_k_zen5 = zen5 ? 4097 : 0;
    bwd_widen_16 = zen4;
    fuse_16 = amd;
    fuse_16_bwd = !fuse_16;
    edges_min = intel ? 0 : zen5 ? 256 : SIZE_MAX;
    edges_min_16 = intel ? 0 : zen5 ? 512 : SIZE_MAX;
    near_16 = intel;
    if (!intel) {
        pairs_aliased_min = !amd_avx512 ? (size_t)-1 : zen5 ? 12288 : 32768;
        single_max = zen5 ? 4096 : 0; /* single_min 0: every row under 4 KiB */
    } else {
        single_min = 32768;
        single_max = 131072;
    }
#endif
    int hw = env_switch("RMSNORM_HW_PREFETCH", -1); /* 1: every row; 0: none */
    if (hw >= 0)
        hw_prefetch_below = hw ? SIZE_MAX : 0;
    int fuse = env_switch("RMSNORM_FUSE_16", -1); /* 1: every 16-bit row; 0: none */
    if (fuse >= 0) {
        fuse_16 = fuse;
        fuse_16_bwd = 0;
        fuse_16_fwd_below = SIZE_MAX;
        fuse_16_fwd_min = 0;
        fuse_16_fwd_one = 0;
        fuse_16_bwd_min = 0;
    }
    int edges = env_switch("RMSNORM_STREAM_EDGES", -1); /* 1: every row; 0: none */
    if (edges >= 0) {
        edges_min = edges_min_16 = edges ? 0 : SIZE_MAX;
    }
    fuse_32 = env_switch("RMSNORM_FUSE_32", fuse_32);
    near_16_env = env_switch("RMSNORM_L1_PREFETCH_16", -1);
    pairs_env = env_switch("RMSNORM_PAIR_ROWS", -1);
    bwd_ahead_32_env = env_switch("RMSNORM_BWD_AHEAD_32", -1);
    fwd_near = env_switch("RMSNORM_FWD_NEAR", fwd_near);
    fwd_ahead_32_env = env_switch("RMSNORM_FWD_AHEAD_32", -1);
#if defined(RMSNORM_HAVE_AVX512)
    if (x86_has_avx512()) {
        avx512 = rms_isa_avx512;
#if defined(RMSNORM_HAVE_AVX512BF16)
        if (x86_has_avx512bf16() && !env_switch("RMSNORM_NO_AVX512BF16", 0))
            avx512.k[RMS_BF16] = rms_bf16_avx512bf16;
#endif
        available[n++] = &avx512;
    }
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

const rms_isa_table *rms_isa_find(const char *name) {
    for (int i = 0; i < n_available; i++)
        if (strcmp(available[i]->name, name) == 0)
            return available[i];
    return NULL;
}

const rms_isa_table *rms_isa_current(void) { return __atomic_load_n(&current, __ATOMIC_ACQUIRE); }

void rms_isa_select(const rms_isa_table *t) { __atomic_store_n(&current, t, __ATOMIC_RELEASE); }
