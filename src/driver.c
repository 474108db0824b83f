/* Threading for every kernel. The m x k elements are cut into one contiguous range per
 * thread, whatever the shape: a thread gets whole rows plus at most a partial row at each end.
 * Whole rows are finished at once; partial rows publish their partial sums, and after one
 * barrier every thread sharing a row combines them in the same fixed order, so a long row
 * (1 x 1M, 29 x 17389) and many short rows (1M x 64) both spread evenly. Tiny inputs run on
 * the calling thread with no team at all. */
#include "driver.h"
#include "dispatch.h"

#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kernels/reference.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#define RMS_MAX_THREADS 256
#define RMS_MIN_PER_THREAD (16 * 1024) /* elements: below this a thread costs more than it saves */
#define RMS_NONE ((size_t)-1)

static int n_threads = 1;
static size_t stream_bytes = (size_t)32 << 20, l3 = 0;

size_t rms_esize(int dtype) { return dtype == RMS_F64 ? 8 : dtype == RMS_F32 ? 4 : 2; }
static size_t csize(int dtype) { return dtype == RMS_F64 ? 8 : 4; }

/* Bytes per weight: x's storage type with RMS_W_STORAGE, else the compute type. */
static size_t wsize(int dtype, int flags) {
    return (flags & RMS_W_STORAGE) ? rms_esize(dtype) : csize(dtype);
}

static int env_threads(const char *name) {
    const char *s = getenv(name);
    if (!s || !*s)
        return 0;
    char *end;
    long v = strtol(s, &end, 10); /* OMP_NUM_THREADS may be a list "8,4": take the first */
    return (end != s && v > 0) ? (int)(v < RMS_MAX_THREADS ? v : RMS_MAX_THREADS) : 0;
}

/* Row pieces of this many bytes or more run their second pass backwards (see back_start). */
static size_t back_bytes = (size_t)1 << 20;

/* The add's streamed rows of this many bytes or more (32- and 64-bit: rms_cpu_early_h_bytes, 32
 * KiB, or over 16 KiB on Zen 5; 16-bit: every row) store h in their first pass (RMS_EARLY_H),
 * where it streams out beside the reads of x and r, and y alone in the second, rather than h and y
 * both in the second: 32- and 64-bit rows not fused across rows, and whose h is not x or r
 * (FN(add_early)); 16-bit rows that are staged and not pipelined, 1 KiB or more (FN(stage_row_h)).
 * The choice on and off alternating in one process, new time over old at one / two threads, 2-core
 * AMD EPYC Zen 5 VM: float32 4096x12288 0.91 / 0.91-0.92, 8192x8192 0.93-0.94 / 0.92-0.96,
 * 1024x32768 0.93 / 0.92, 2048x16384 0.95 / 0.97, 256x65536 0.95 / 1.02; float64 8192x4096 0.93 /
 * 0.95; shorter float32 rows lost (16384x4096 1.04 / 1.02, 65536x1024 1.07 / 1.03, 262144x256 1.14
 * / 1.04); bfloat16 131072x512 0.85 / 0.94, 65536x1024 0.93 / 0.92, 16384x4096 0.92 / 0.91,
 * 8192x8192 0.95 / 0.92, 4096x12288 0.92-0.94 / 0.91, 1024x32768 0.95 / 0.86; float16 131072x512
 * 0.83 / 0.92, 65536x1024 0.85 / 0.92, 8192x8192 0.93 / 0.89, 2048x16384 0.99 / 0.95. 16-core
 * Xeon, 1 / 4 / 16 threads: float32 32768x8192 1.01 / 0.99 / 0.99, 8192x32768 0.97 / 0.99 / 1.01;
 * bfloat16 32768x8192 0.94 / 0.93 / 0.96, 524288x512 0.96 / 0.95 / 0.97; float16 8192x32768 0.91 /
 * 0.92 / 0.97. For rows of 20 to 28 KiB see rms_cpu_early_h_bytes. */
static size_t early_h_bytes = 32768, early_h_bytes_16 = 0;

/* The L3 cache that CPU 0 shares with its neighbours, in bytes (0 if unknown). Linux lists it in
 * sysfs from the CPU's cache topology; glibc's sysconf can report a virtual machine's host instead
 * (384 MiB on a 2-core AMD EPYC Zen 5 VM whose cores share a 32 MiB L3). There, outputs of 16 to
 * 32 MiB, which do not fit in the L3 beside their inputs, took plain stores; streamed, the two
 * builds alternating in one process, new time over old at one / two threads: float32 forward
 * 4096x1024 0.56 / 0.94, backward 0.98 / 0.85; bfloat16 forward 2048x4096 0.55 / 0.65, backward
 * 1024x12288 0.48 / 0.60; the add, whose two outputs already streamed, 0.99 / 1.00. */
static size_t l3_bytes(void) {
#if defined(__linux__)
    for (int i = 0; i < 16; i++) {
        char path[64];
        int level = 0;
        unsigned long long v = 0;
        char unit = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        FILE *f = fopen(path, "r");
        if (!f)
            break;
        int ok = fscanf(f, "%d", &level) == 1;
        fclose(f);
        if (!ok || level != 3)
            continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        if (!(f = fopen(path, "r")))
            continue;
        int n = fscanf(f, "%llu%c", &v, &unit);
        fclose(f);
        if (n < 1 || v == 0)
            continue;
        int shift = n < 2 ? 0 : unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0;
        if (v <= (SIZE_MAX >> shift))
            return (size_t)v << shift;
    }
#endif
#if defined(_SC_LEVEL3_CACHE_SIZE)
    long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return llc > 0 ? (size_t)llc : 0;
#else
    return 0;
#endif
}

void rms_threads_init(void) {
    int n = env_threads("RMSNORM_NUM_THREADS");
    if (!n)
        n = env_threads("OMP_NUM_THREADS");
#if defined(_OPENMP)
    if (!n)
        n = omp_get_num_procs(); /* honours the affinity mask */
#endif
    rms_threads_set(n > 0 ? n : 1);
    /* Outputs larger than about half the last-level cache bypass it. */
    size_t llc = l3 = l3_bytes();
    if (llc > 0 && llc / 2 < stream_bytes)
        stream_bytes = llc / 2;
    const char *s = getenv("RMSNORM_STREAM_BYTES"); /* tuning knob: 0 streams everything */
    if (s && *s)
        stream_bytes = (size_t)strtoull(s, NULL, 10);
    s = getenv("RMSNORM_BACK_BYTES"); /* tuning knob: a huge value turns it off */
    if (s && *s)
        back_bytes = (size_t)strtoull(s, NULL, 10);
    early_h_bytes = rms_cpu_early_h_bytes();
    s = getenv("RMSNORM_EARLY_H_BYTES"); /* tuning knob: 0 for every row, a huge value for none */
    if (s && *s)
        early_h_bytes = early_h_bytes_16 = (size_t)strtoull(s, NULL, 10);
}

size_t rms_stream_bytes(size_t *l3_out) {
    if (l3_out)
        *l3_out = l3;
    return stream_bytes;
}

void rms_advise_huge(void *p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t lo = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    uintptr_t hi = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (hi > lo)
        (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

int rms_threads_get(void) { return __atomic_load_n(&n_threads, __ATOMIC_RELAXED); }

void rms_threads_set(int n) {
    n = n < 1 ? 1 : n > RMS_MAX_THREADS ? RMS_MAX_THREADS : n;
    __atomic_store_n(&n_threads, n, __ATOMIC_RELAXED);
}

int rms_have_openmp(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

/* Test hooks (see driver.h): the per-thread minimum, and the last forward's or backward's team. */
static size_t min_per_thread = RMS_MIN_PER_THREAD;
static int last_team = 1;

int rms_last_team_size(void) { return __atomic_load_n(&last_team, __ATOMIC_RELAXED); }

static void set_last_team(int n) { __atomic_store_n(&last_team, n, __ATOMIC_RELAXED); }

size_t rms_set_min_per_thread(size_t n) {
    return __atomic_exchange_n(&min_per_thread, n, __ATOMIC_RELAXED);
}

size_t rms_set_stream_bytes(size_t n) {
    return __atomic_exchange_n(&stream_bytes, n, __ATOMIC_RELAXED);
}

static int team_size(size_t elements, int nthreads) {
#if defined(_OPENMP)
    size_t min = __atomic_load_n(&min_per_thread, __ATOMIC_RELAXED);
    size_t useful = min ? elements / min : elements;
    if (useful < (size_t)nthreads)
        nthreads = useful > 1 ? (int)useful : 1;
    return nthreads;
#else
    (void)elements;
    (void)nthreads;
    return 1;
#endif
}

static int thread_id(void) {
#if defined(_OPENMP)
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* The team's real size: OpenMP may give fewer threads than asked (nested in another parallel
 * region, OMP_THREAD_LIMIT), and the work is split among those it gives. */
static int team_threads(void) {
#if defined(_OPENMP)
    return omp_get_num_threads();
#else
    return 1;
#endif
}

static inline void rms_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* [*lo, *hi): thread t's contiguous share of n items, boundaries rounded down to multiples of
 * `align` (a power of two) so that threads stay off each other's cache lines. */
static void chunk(size_t n, int t, int nt, size_t align, size_t *lo, size_t *hi) {
    *lo = (size_t)((unsigned __int128)n * (unsigned)t / (unsigned)nt) & ~(align - 1);
    *hi = t + 1 == nt ? n : (size_t)((unsigned __int128)n * (unsigned)(t + 1) / (unsigned)nt) &
                                ~(align - 1);
}

/* Thread t's share of the flattened m*k elements: full rows [r0, r1) and up to two partial
 * rows (head: the end of the row before r0, tail: the start of row r1). */
typedef struct {
    size_t row, c0, c1;
    double s, r; /* the piece's sum; the row's rstd (fwd_phase, rstd_apart) */
} piece;

typedef struct {
    size_t r0, r1;
    piece p[2];
} share;

static share split(size_t total, size_t k, int t, int nt) {
    size_t e0, e1;
    chunk(total, t, nt, 16, &e0, &e1);
    share s = {0, 0, {{RMS_NONE, 0, 0, 0.0, 0.0}, {RMS_NONE, 0, 0, 0.0, 0.0}}};
    if (e0 >= e1)
        return s;
    size_t row = e0 / k, col = e0 % k;
    if (col) {
        size_t end = e1 - row * k < k ? e1 - row * k : k;
        s.p[0] = (piece){row, col, end, 0.0, 0.0};
        e0 = row * k + end;
        row++;
    }
    s.r0 = s.r1 = row;
    if (e0 < e1) {
        s.r1 = e1 / k;
        if (e1 % k)
            s.p[1] = (piece){s.r1, 0, e1 % k, 0.0, 0.0};
    }
    return s;
}

/* Whether share s is a single piece, which its first pass read last (see back_start). */
static int one_piece(const share *s) {
    return s->r1 == s->r0 && (s->p[0].row == RMS_NONE) != (s->p[1].row == RMS_NONE);
}

/* Sum of the partial results for `row`, always in thread order so every sharer agrees. */
static double row_sum(const share *sh, int nt, size_t row) {
    double s = 0.0;
    for (int t = 0; t < nt; t++)
        for (int j = 0; j < 2; j++)
            if (sh[t].p[j].row == row)
                s += sh[t].p[j].s;
    return s;
}

/* ---------------------------------------------------------------- teams
 * A team runs phase_fn(job, t, nt, phase) for every member t < nt, phase by phase: every
 * member finishes a phase before any starts the next. On OpenMP the team is one parallel
 * region with a barrier between phases. On a caller's pool (rms_pool) each phase is a
 * fork-join: the members are claimed one at a time by whichever thread comes first, the caller
 * included, so the work finishes even when the pool runs nothing in parallel. */
typedef void (*phase_fn)(void *job, int t, int nt, int phase);
/* Whether a team of nt runs its phases from the third on (NULL: always); every member must get
 * the same answer from what the first phase left. */
typedef int (*more_fn)(const void *job, int nt);

/* Threads to ask for: nthreads, at most the pool's size when there is a pool. */
static int pool_threads(const rms_pool *pool, int nthreads) {
    return pool && pool->nthreads < nthreads ? pool->nthreads : nthreads;
}

/* One phase on a pool. The scheduled tasks own a reference each, so one that starts after the
 * phase is over (nothing left to claim) still finds its job alive; the last reference frees it. */
typedef struct {
    int refs, next, done, nt, phase;
    phase_fn fn;
    void *job;
} pool_phase;

static void pool_claim(pool_phase *p) {
    int t;
    while ((t = __atomic_fetch_add(&p->next, 1, __ATOMIC_ACQ_REL)) < p->nt) {
        p->fn(p->job, t, p->nt, p->phase);
        __atomic_fetch_add(&p->done, 1, __ATOMIC_RELEASE);
    }
}

static void pool_release(pool_phase *p) {
    if (__atomic_sub_fetch(&p->refs, 1, __ATOMIC_ACQ_REL) == 0)
        free(p);
}

static void pool_task(void *data) {
    pool_claim(data);
    pool_release(data);
}

/* Returns 0, or -1 when the phase could not be allocated (nothing run). */
static int pool_run(const rms_pool *pool, int nt, int phase, phase_fn fn, void *job) {
    pool_phase *p = malloc(sizeof *p);
    if (!p)
        return -1;
    *p = (pool_phase){nt, 0, 0, nt, phase, fn, job};
    for (int i = 1; i < nt; i++)
        if (pool->schedule(pool->ctx, pool_task, p) != 0)
            pool_release(p); /* not scheduled: its share is claimed by someone else */
    pool_claim(p);
    for (unsigned spins = 0; __atomic_load_n(&p->done, __ATOMIC_ACQUIRE) < nt; spins++) {
        if (spins < 4096)
            rms_relax();
        else
            sched_yield(); /* a member was claimed by a thread that is not running now */
    }
    pool_release(p);
    return 0;
}

static void run_team(int nt, int phases, phase_fn fn, more_fn more, void *job,
                     const rms_pool *pool) {
    if (pool) {
        int phase = 0;
        set_last_team(nt);
        while (phase < phases && pool_run(pool, nt, phase, fn, job) == 0) {
            if (++phase == 2 && more && !more(job, nt))
                return;
        }
        if (phase == phases)
            return;
        if (phase > 0) { /* out of memory mid-way: finish on the calling thread */
            for (; phase < phases; phase++)
                for (int t = 0; t < nt; t++)
                    fn(job, t, nt, phase);
            return;
        }
    }
#pragma omp parallel num_threads(nt)
    {
        int t = thread_id(), n = team_threads();
        if (t == 0)
            set_last_team(n);
        for (int phase = 0; phase < phases; phase++) {
            if (phase == 2 && more && !more(job, n))
                break; /* every member breaks here, or none */
            if (phase > 0) {
#pragma omp barrier
            }
            fn(job, t, n, phase);
        }
    }
}

/* Bytes between the threads' partial dgamma rows, which start on a page (RMS_DG_ALIGN): whole
 * pages, and RMS_DG_GAP more, so that no two threads' rows share a page, nor a line (each row is
 * updated once per row of x), nor lie on neighbouring pages. Rows that shared a page, in pairs of
 * lines, ran slower at two threads than at one: the CPU's stream prefetcher, which runs ahead
 * within a page, fetched the lines of the next thread's row as this thread went through its own,
 * and the two cores took those lines from each other on every row. 2-core Xeon, two threads,
 * page-aligned arrays, two builds alternating in one process, each pair in both orders, rows on
 * pages of their own (no page between) over rows a pair of lines apart: bfloat16 262144x256
 * 0.65 (1.65 -> 1.04 of a triad), 131072x512 0.78, float16 262144x256 0.63, float32 262144x256
 * 0.95; rows of 4 KiB or more, whose pitch was already whole pages, 0.96 to 1.03. 16-core Xeon,
 * 4 / 16 threads: bfloat16 262144x256 0.65 / 0.77, 131072x512 0.75 / 0.85, float16 262144x256
 * 0.65 / 0.74, float32 262144x256 0.92 / 0.96.
 * Rows on neighbouring pages still slowed each other, less with each page between them up to two
 * (the prefetchers also fetch ahead into the next page): two threads on the 2-core Xeon, two
 * builds alternating as above, two pages between the rows over none: bfloat16 65536x1024 0.87,
 * 16384x4096 0.90, 8192x8192 0.94, float16 65536x1024 0.82, float32 0.97 to 0.99, rows under 4
 * KiB 1.00 (one page between over none: bfloat16 65536x1024 0.90, 16384x4096 0.95; 16 pages over
 * two: 1.00); 16-core Xeon, 4 / 16 threads: bfloat16 65536x1024 0.87 / 0.92, 16384x4096 0.96 /
 * 0.99-1.10, 8192x8192 0.97 / 0.96, float16 65536x1024 0.79 / 0.86, float32 0.96 / 0.99. */
#define RMS_DG_ALIGN 4096
#define RMS_DG_GAP 8192
static size_t dg_pitch(size_t k, size_t cs) {
    return (k * cs + RMS_DG_ALIGN - 1) / RMS_DG_ALIGN * RMS_DG_ALIGN + RMS_DG_GAP;
}

/* The members' rows (their weight rows and partial dgamma rows) take n x dg_pitch bytes a call.
 * glibc gives such page-aligned blocks above its mmap threshold (128 KiB, which six members' rows
 * of 4096 floats pass) a new mapping each time, so every call faulted the members' pages in and
 * unmapped them again, which interrupts every core the process runs on. Blocks of up to
 * RMS_KEEP_BYTES are kept for the next call instead, one in each of RMS_KEEP_SLOTS slots (a
 * backward holds two blocks at once). A call takes a slot's block by an atomic exchange, so no two
 * calls share one; a call that finds none large enough allocates its own. A block's first page
 * holds its size, and its rows start on the next. 16-core Xeon, 16 threads, two builds alternating
 * in one process, each pair in both orders, new time over old: bfloat16 16384x4096 forward (weight
 * rows of 4096 floats) 0.92-0.93, backward 0.93-0.94, 8192x8192 backward 0.95-0.96, float32
 * 8192x8192 backward 0.97; at 4 and 8 threads 0.98 to 1.00; forwards with no rows of their own
 * (bfloat16 and float32 8192x8192) 0.99 to 1.01. */
#define RMS_KEEP_BYTES ((size_t)8 << 20)
#define RMS_KEEP_SLOTS 2
static char *kept[RMS_KEEP_SLOTS];

/* The bytes of member_rows's block for n rows of k entries of cs bytes (its first page holds
 * the size); blocks of up to RMS_KEEP_BYTES are kept between calls. */
static size_t rows_bytes(int n, size_t k, size_t cs) {
    return (size_t)n * dg_pitch(k, cs) + RMS_DG_ALIGN;
}

/* n rows of k entries of cs bytes, dg_pitch apart, or NULL when out of memory; rows_free gives
 * them back. */
static char *member_rows(int n, size_t k, size_t cs) {
    size_t bytes = rows_bytes(n, k, cs);
    for (int i = 0; i < RMS_KEEP_SLOTS; i++) {
        char *b = __atomic_exchange_n(&kept[i], NULL, __ATOMIC_ACQ_REL);
        if (b && *(size_t *)b >= bytes)
            return b + RMS_DG_ALIGN;
        free(b); /* too small: a larger block takes its slot */
    }
    void *p = NULL;
    if (posix_memalign(&p, RMS_DG_ALIGN, bytes))
        return NULL;
    *(size_t *)p = bytes;
    return (char *)p + RMS_DG_ALIGN;
}

/* Rows from member_rows (or NULL), kept in a free slot where they are small enough. */
static void rows_free(char *rows) {
    if (!rows)
        return;
    char *b = rows - RMS_DG_ALIGN;
    for (int i = 0; i < RMS_KEEP_SLOTS && *(size_t *)b <= RMS_KEEP_BYTES; i++) {
        char *none = NULL;
        if (__atomic_compare_exchange_n(&kept[i], &none, b, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return;
    }
    free(b);
}

/* The line at p, which follows the part of a row of the driver's own (a member's weight row or
 * partial dgamma row, dg_pitch apart) that the member wrote, zeroed. The kernels' masked loads
 * at the end of a row read up to a vector past it, with the lanes past it masked off; where
 * that is the page after (a row that ends on one), nothing else may have touched that page, it
 * is then not mapped, and every such load takes a microcode assist. 2-core Xeon, bfloat16
 * 8192x2048 (float32 weight and dgamma rows of 8 KiB), outputs 16 bytes past a page, against
 * the build before the members' own weight rows, two builds alternating in one process, both
 * orders: forward at one thread 1.22 of its time without the line zeroed, 1.00 with it;
 * backward at two threads 1.27 without it in the dgamma rows too, 1.00 with it. */
static void touch_after(char *p) { memset(p, 0, 64); }

/* ---------------------------------------------------------------- members' own weight rows
 * With RMS_W_OWN, w holds x's 16-bit type, and each member of the team widens w_offset + w into
 * a float row of its own, on pages of its own (dg_pitch apart), in its first phase. A weight
 * widened once by the calling thread and read by every member cost each call the transfer of
 * its lines from the caller's core to the others, and their invalidation back on the next
 * call's widening: 4 to 5 us a call on the 2-core Xeon at two threads, against 0.7 us for the
 * widening itself. The same Xeon, bfloat16, page-aligned inputs and outputs 16 bytes past a
 * page, two builds alternating in one process, each pair in both orders, widened by the caller
 * -> by each member, one / two threads: forward 8x4096 0.90 / 0.56, 64x4096 0.98 / 0.79,
 * 16x8191 0.90 / 0.56; add 8x4096 0.94 / 0.60, 64x4096 0.98 / 0.90, 16x8191 0.96 / 0.69;
 * backward 8x4096 0.88 / 0.82, 64x4096 0.95 / 0.86, 16x8191 1.00 / 0.91; float16 64x4096
 * forward 0.98 / 0.76, backward 0.91 / 0.89. Rows from memory 0.96 to 1.03 (8192x2048 to
 * 65536x1024; backward 1024x4096 1.04 / 1.02, which another harness measured 0.96 / 1.08). */
typedef struct {
    const rms_kernels *kt;
    const void *src; /* the weight, x's storage type */
    double offset;
    size_t k, pitch;
    char *rows; /* [members x pitch] */
} own_w;

/* Returns 0 (o->rows NULL without RMS_W_OWN), or -1 when the rows could not be allocated. */
static int own_w_open(own_w *o, const rms_kernels *kt, const void *w, double offset, size_t k,
                      int flags, int members) {
    *o = (own_w){kt, w, offset, k, dg_pitch(k, sizeof(float)), NULL};
    if (!(flags & RMS_W_OWN) || !w)
        return 0;
    return (o->rows = member_rows(members, k, sizeof(float))) ? 0 : -1;
}

/* Member t's weight into *w (its own row, which it widens in phase 0; w as it is without own
 * rows), and RMS_W_OWN off in *flags. */
static void own_w_take(const own_w *o, int t, int phase, const void **w, int *flags) {
    *flags &= ~RMS_W_OWN;
    if (!o->rows)
        return;
    char *row = o->rows + (size_t)t * o->pitch;
    if (phase == 0) {
        o->kt->widen(o->src, row, o->offset, o->k);
        touch_after(row + o->k * sizeof(float));
    }
    *w = row;
}

#define AT(p, row, stride, col, es)                                                            \
    ((char *)(p) + ((ptrdiff_t)(row) * (stride) + (ptrdiff_t)(col)) * (ptrdiff_t)(es))

static void store_c(void *arr, size_t i, double v, int f64) {
    if (f64)
        ((double *)arr)[i] = v;
    else
        ((float *)arr)[i] = (float)v;
}

static double load_c(const void *arr, size_t i, int f64) {
    return f64 ? ((const double *)arr)[i] : (double)((const float *)arr)[i];
}

/* ---------------------------------------------------------------- long rows backwards
 * The second pass over a long row piece (back_bytes, 1 MiB, or more) goes backwards, a block at a
 * time, when the first pass over it was the last thing read: that pass leaves the piece's end in
 * L2, and a second pass going forwards would find each line evicted before it got there (the
 * least recently used go first), while one going backwards reads the end from L2 first. The
 * blocks end on multiples of RMS_BACK_BLK bytes of the output, so streamed blocks start and end
 * on its lines. The same bits either way. 2-core Xeon, AVX-512, two choices alternating in one
 * process, each pair in both orders, new time over old at one / two threads: forward float32
 * 1x1048576 0.93 / 0.90, 64x524288 0.78 / 0.77, 128x262144 0.76 / 0.78, bfloat16 1x1048576 0.90 /
 * 1.00, 64x524288 0.81 / 0.88; backward 1x1048576 float32 0.97 / 0.91, bfloat16 0.93 / 0.86;
 * add float32 1x1048576 0.96 / 0.94, 2x524288 0.83 / 0.92, bfloat16 1x1048576 0.87 / 0.95,
 * 2x524288 0.73 / 0.78, and streamed, float32 64x524288 0.82 / 0.78, 128x262144 0.79 / 0.74,
 * bfloat16 64x524288 0.84 / 0.88. Left forwards: rows of 64 KiB to 512 KiB from memory, which
 * lose the prefetch of the rows ahead (forward float32 1024x32768 1.26 / 1.29, bfloat16
 * 64x262144 1.01 / 1.06), the backward's runs of whole rows, fused across rows (float32
 * 64x524288 1.08 / 1.08), and pieces read before other rows in the first pass (float32
 * 3x1000000 at two threads 1.06).
 * Returns where the block that ends at element `end` of a piece of n elements starts: 0 for a
 * piece that goes forwards in one call (back 0, or a short piece). The blocks run `for (e = n;
 * e > 0; e = b) { b = back_start(e, n, ...); ...(b, e); }`. */
#define RMS_BACK_BLK 16384
static size_t back_start(size_t end, size_t n, const void *out, size_t es, int back) {
    if (!back || n * es < back_bytes || (uintptr_t)out % es)
        return 0;
    size_t len = ((uintptr_t)out + end * es) % RMS_BACK_BLK / es;
    len = len ? len : RMS_BACK_BLK / es;
    return end > len ? end - len : 0;
}

/* ---------------------------------------------------------------- line buffer
 * Short rows of a packed output that does not start on a cache line (np.empty_like gives arrays
 * 16 bytes past a page) share lines with the rows beside them, so the kernels cannot stream them,
 * and stored plainly each line is first read from memory. Such rows go through a buffer in L1
 * instead: a batch of rows is stored into it at the output's offset within a line, its whole
 * lines are streamed out (the kernel family's stream_lines), and its last partial line is carried
 * over to the front of the buffer for the next batch to complete. Only the first and last
 * partial lines of a thread's rows are stored plainly, and only their own bytes. The kernels
 * prefetch the rows past each batch (RMS_PF_PAST) as they would in one call. */
#define RMS_LINE_BUF 8192 /* bytes of rows in a batch, at most */
#define RMS_LINE_MIN 64
#define RMS_LINE_16_MIN 128
#define RMS_LINE_16_MAX 256
#define RMS_LINED (1 << 24) /* the driver's own flag, never passed to the kernels */
enum { LINE_FWD, LINE_ADD, LINE_BWD }; /* the passes, for lined */

/* Rows [r0, r1) of a kernel call into outputs out[] (packed rows). */
typedef void (*rows_fn)(const void *ctx, size_t r0, size_t r1, char *const *out);

/* Rows [r0, r1) through fn, with nout outputs (at most 2) whose row r0 starts at dst[j], rows of
 * rb bytes packed, every dst[j] at the same offset within a line. */
static void line_rows(rows_fn fn, const void *ctx, size_t r0, size_t r1, size_t rb,
                      char *const *dst, int nout) {
    char buf[2][RMS_LINE_BUF + 128] __attribute__((aligned(64)));
    void (*stream)(void *, const void *, size_t) = rms_isa_current()->stream_lines;
    size_t q = 64 / ((rb & -rb) < 64 ? (rb & -rb) : 64); /* rows that fill whole lines */
    size_t b = RMS_LINE_BUF / rb / q * q;
    if (!stream || b == 0 || r1 - r0 < 2 * b) { /* (stream: the ISA set since, by another thread) */
        fn(ctx, r0, r1, dst);
        return;
    }
    size_t o = (uintptr_t)dst[0] % 64;
    char *line[2] = {dst[0] - o, nout > 1 ? dst[1] - o : NULL};
    for (size_t i = r0; i < r1;) {
        size_t n = r1 - i < b ? r1 - i : b, end = o + n * rb, full = end / 64, tail = end % 64;
        char *out[2] = {buf[0] + o, buf[1] + o};
        fn(ctx, i, i + n, out);
        for (int j = 0; j < nout; j++) {
            size_t s = 0;
            if (i == r0 && o) { /* the first line: only its own bytes, plainly (end >= 64) */
                memcpy(line[j] + o, buf[j] + o, 64 - o);
                s = 1;
            }
            stream(line[j] + 64 * s, buf[j] + 64 * s, full - s);
            if (i + n == r1)
                memcpy(line[j] + 64 * full, buf[j] + 64 * full, tail);
            else
                memcpy(buf[j], buf[j] + 64 * full, tail);
            line[j] += 64 * full;
        }
        o = tail;
        i += n;
    }
    rms_stream_fence();
}

/* A kernel call over rows, for line_rows: the forward's or the add's arguments (fa), or the
 * backward's (ba) with its dgamma row dg. */
typedef struct {
    const rms_kernels *kt;
    const rms_fwd_args *fa;
    const rms_bwd_args *ba;
    void *dg;
    int flags;
    size_t es, cs;
} rows_ctx;

/* The kernels' flags, and an output's row stride: packed rows into the line buffer (RMS_LINED),
 * whose kernels prefetch past each batch, or the output's own. */
static int call_flags(int flags) {
    return flags & RMS_LINED ? (flags & ~RMS_LINED) | RMS_PF_PAST : flags;
}
static ptrdiff_t out_stride(int flags, size_t k, ptrdiff_t stride) {
    return flags & RMS_LINED ? (ptrdiff_t)k : stride;
}

static void fwd_call(const void *ctx, size_t r0, size_t r1, char *const *out) {
    const rows_ctx *c = ctx;
    const rms_fwd_args *a = c->fa;
    size_t es = c->es, k = a->k, m = r1 - r0;
    int flags = call_flags(c->flags);
    const char *x = AT(a->x, r0, a->xs, 0, es);
    char *rstd = (char *)a->rstd + r0 * c->cs;
    if (a->r)
        c->kt->add_rows(x, a->xs, AT(a->r, r0, a->rs, 0, es), a->rs, out[0],
                        out_stride(c->flags, k, a->hs), out[1], out_stride(c->flags, k, a->ys),
                        a->w, rstd, m, k, a->eps, flags);
    else
        c->kt->fwd_rows(x, a->xs, out[0], out_stride(c->flags, k, a->ys), a->w, rstd, m, k,
                        a->eps, flags);
}

static void fwd_rows(const rms_kernels *kt, const rms_fwd_args *a, size_t r0, size_t r1,
                     int flags, size_t es, size_t cs) {
    if (r1 <= r0)
        return;
    rows_ctx c = {kt, a, NULL, NULL, flags, es, cs};
    char *dst[2] = {AT(a->r ? a->h : a->y, r0, a->r ? a->hs : a->ys, 0, es),
                    a->r ? AT(a->y, r0, a->ys, 0, es) : NULL};
    if (flags & RMS_LINED)
        line_rows(fwd_call, &c, r0, r1, a->k * es, dst, a->r ? 2 : 1);
    else
        fwd_call(&c, r0, r1, dst);
}

typedef struct {
    const rms_kernels *kt;
    const rms_fwd_args *a;
    int flags, rstd_apart;
    own_w ow;
    share sh[RMS_MAX_THREADS];
} fwd_job;

/* Whether y or h is x or r (out=x, residual_out=residual): then a partial row whose sum of
 * squares is not usable (a row of zeros, squares that underflow or overflow) has its rstd taken
 * in a phase of its own, before any member writes (rstd_phase): it is rescued from the whole row
 * (rescue), which its other sharers would otherwise be overwriting at the same time, and its
 * rstd depended on the timing. */
static int writes_inputs(const rms_fwd_args *a) {
    const void *in[2] = {a->x, a->r};
    for (int i = 0; i < 2; i++)
        if (in[i] && (in[i] == (const void *)a->y || in[i] == (const void *)a->h))
            return 1;
    return 0;
}

/* Phase 0: the partial rows' sums, then the whole rows. Phase 1: the partial rows, scaled by
 * the rstd that their sharers' sums give (with rstd_phase, phase 1 takes the rstds and phase 2
 * scales). The add's partial rows, when its outputs are not
 * streamed, store h in phase 0 and scale it in phase 1, rather than rounding x + r once in each
 * phase (AMD EPYC Zen 3, AVX2, two threads, two builds alternating in one process, new time over
 * old, the same bits: 1x1048576 bfloat16 0.64-0.73, float32 0.81-0.88; 29x17389, whose other
 * rows are whole, bfloat16 0.80-0.90, float32 0.91-1.00; on the 16-core Xeon, AVX-512, an
 * environment switch in one build, at 4 / 16 threads: 1x1048576 bfloat16 0.67 / 0.59, float32
 * 0.70 / 0.43, float16 0.84 / 0.86; 29x17389 bfloat16 0.91 / 0.87, float32 0.91 / 0.57;
 * 4x262144 bfloat16 0.75 / 0.63). Streamed, h keeps its streaming stores in phase 1
 * (4x2097152, which streams, measured the same either way on Zen 3: bfloat16 0.99, float32
 * 1.00). */
static int stage_pieces(const fwd_job *j) { return j->a->r && !(j->flags & RMS_STREAM); }

/* Whether the partial rows' rstds take phase 1 and their scaling phase 2 (see writes_inputs):
 * only where the outputs are inputs and a partial row is rescued. The extra phase cost in-place
 * calls 1 to 7% when taken always (float32 add of 64x4096, residual_out=residual, two threads:
 * 25.0 -> 26.8 us). */
static int rstd_phase(const void *job, int nt) {
    const fwd_job *j = job;
    if (!j->rstd_apart)
        return 0;
    /* The pieces come row after row in member order, so one pass adds up each row's sum as
     * row_sum does, in the same order (every member calls this: O(nt), not a row_sum a row). */
    const int f64 = j->a->dtype == RMS_F64;
    size_t row = RMS_NONE;
    double s = 0.0;
    for (int t = 0; t < nt; t++)
        for (int i = 0; i < 2; i++) {
            const piece *p = &j->sh[t].p[i];
            if (p->row == RMS_NONE)
                continue;
            if (p->row != row) {
                if (row != RMS_NONE && !rms_sumsq_ok(s, f64))
                    return 1;
                row = p->row;
                s = 0.0;
            }
            s += p->s;
        }
    return row != RMS_NONE && !rms_sumsq_ok(s, f64);
}

/* A row's rstd from its sum of squares ss, rounded as it is stored, so that it scales with the
 * rstd that is stored. */
static double rstd_of(const rms_kernels *kt, const char *x, const char *res, double ss, size_t k,
                      double eps, int f64) {
    double r = rms_sumsq_ok(ss, f64) ? 1.0 / sqrt(ss / (double)k + eps)
                                     : kt->rescue(x, res, k, eps);
    return f64 ? r : (double)(float)r;
}

/* The forward's second pass over columns [c0, c0 + n) of a row whose first element x, residual
 * res, h and y start at: y = x * r * w (and h), or with res, h = x + res too; in blocks
 * backwards for long pieces (back_start). */
static void scale_piece(const rms_kernels *kt, const rms_fwd_args *a, const char *x,
                        const char *res, char *h, char *y, size_t c0, size_t n, double r,
                        int flags, int back) {
    size_t es = rms_esize(a->dtype), ws = wsize(a->dtype, a->flags);
    x += c0 * es;
    y += c0 * es;
    const char *w = a->w ? (const char *)a->w + c0 * ws : NULL;
    for (size_t e = n, b; e > 0; e = b) {
        b = back_start(e, n, y, es, back);
        const char *wb = w ? w + b * ws : NULL;
        if (res)
            kt->add_scale(x + b * es, res + (c0 + b) * es, h + (c0 + b) * es, y + b * es, wb, r,
                          e - b, flags & ~RMS_LINED);
        else
            kt->scale(x + b * es, y + b * es, wb, r, e - b, flags & ~RMS_LINED);
    }
}

/* Rows [r0, r1) of back_bytes or more: the sum, then the scale backwards (the same bits as
 * fwd_rows). The add's rows stage h first, as its pieces do, or where h and y stream (at one
 * offset within a line, so that the blocks start on lines of both), sum x + r, then store both
 * backwards. */
static void fwd_long(const rms_kernels *kt, const rms_fwd_args *a, size_t r0, size_t r1,
                     int flags, size_t es) {
    int f64 = a->dtype == RMS_F64;
    size_t k = a->k;
    for (size_t i = r0; i < r1; i++) {
        const char *x = AT(a->x, i, a->xs, 0, es);
        char *y = AT(a->y, i, a->ys, 0, es);
        double ss;
        const char *res = NULL;
        char *h = NULL;
        if (a->r && (flags & RMS_STREAM)) {
            res = AT(a->r, i, a->rs, 0, es);
            h = AT(a->h, i, a->hs, 0, es);
            ss = kt->add_sumsq(x, res, k);
        } else if (a->r) { /* then scale h, which add_stage stored */
            h = AT(a->h, i, a->hs, 0, es);
            ss = kt->add_stage(x, AT(a->r, i, a->rs, 0, es), h, k);
            x = h;
        } else {
            ss = kt->sumsq(x, k);
        }
        double r = rstd_of(kt, x, res, ss, k, a->eps, f64);
        store_c(a->rstd, i, r, f64);
        scale_piece(kt, a, x, res, h, y, 0, k, r, flags, 1);
    }
}

/* The forward's rows [r0, r1) of one thread. */
static void fwd_any(const rms_kernels *kt, const rms_fwd_args *a, size_t r0, size_t r1,
                    int flags, size_t es) {
    if (a->k * es >= back_bytes && !(flags & RMS_LINED) &&
        (!a->r || !(flags & RMS_STREAM) || (uintptr_t)a->h % 64 == (uintptr_t)a->y % 64))
        fwd_long(kt, a, r0, r1, flags, es);
    else
        fwd_rows(kt, a, r0, r1, flags, es, csize(a->dtype));
}

static void fwd_phase(void *job, int t, int nt, int phase) {
    fwd_job *j = job;
    const rms_kernels *kt = j->kt;
    rms_fwd_args mine = *j->a; /* with member t's weight */
    own_w_take(&j->ow, t, phase, &mine.w, &mine.flags);
    const rms_fwd_args *a = &mine;
    size_t es = rms_esize(a->dtype), k = a->k;
    int f64 = a->dtype == RMS_F64;
    if (phase == 0) {
        share s = split(a->m * k, k, t, nt);
        for (int i = 0; i < 2; i++) {
            piece *p = &s.p[i];
            if (p->row == RMS_NONE)
                continue;
            const char *x = AT(a->x, p->row, a->xs, p->c0, es);
            const char *res = a->r ? AT(a->r, p->row, a->rs, p->c0, es) : NULL;
            if (!res)
                p->s = kt->sumsq(x, p->c1 - p->c0);
            else if (stage_pieces(j))
                p->s = kt->add_stage(x, res, AT(a->h, p->row, a->hs, p->c0, es), p->c1 - p->c0);
            else
                p->s = kt->add_sumsq(x, res, p->c1 - p->c0);
        }
        j->sh[t] = s;
        fwd_any(kt, a, s.r0, s.r1, j->flags, es);
        return;
    }
    const int apart = rstd_phase(j, nt);
    for (int i = 0; i < 2; i++) {
        piece *p = &j->sh[t].p[i];
        if (p->row == RMS_NONE)
            continue;
        int staged = stage_pieces(j); /* then x is the row of h that phase 0 stored */
        const char *x = staged ? AT(a->h, p->row, a->hs, 0, es) : AT(a->x, p->row, a->xs, 0, es);
        const char *res = a->r && !staged ? AT(a->r, p->row, a->rs, 0, es) : NULL;
        if (phase == 1) {
            p->r = rstd_of(kt, x, res, row_sum(j->sh, nt, p->row), k, a->eps, f64);
            if (p->c0 == 0) /* exactly one sharer holds the start of the row */
                store_c(a->rstd, p->row, p->r, f64);
        }
        if (phase == 1 + apart)
            /* (the add's h and y, which may lie at different offsets within a line: forwards) */
            scale_piece(kt, a, x, res, res ? AT(a->h, p->row, a->hs, 0, es) : NULL,
                        AT(a->y, p->row, a->ys, 0, es), p->c0, p->c1 - p->c0, p->r, j->flags,
                        one_piece(&j->sh[t]) && !res);
    }
}

/* Stream an output of `bytes` in rows of k elements, `stride` apart, from `p`? Only when it
 * would not fit in the cache, and only when rows span `min_row` bytes or more (RMS_STREAM_ROW, or
 * RMS_STREAM_ROW_FWD for the forward's 32- and 64-bit rows) or start on cache lines, and 16-bit
 * rows that start on lines from the kernel family's stream_row_16 bytes. With AVX2 that is 512:
 * its shorter 16-bit rows are bound by their arithmetic rather than by memory, and measured much
 * faster stored plainly (into a page-aligned out=, two builds alternating in one process, plain
 * time over streamed. AMD EPYC Zen 3, 1 / 2 threads: bfloat16 1M x 64 forward 0.71 / 0.71,
 * backward 0.82 / 0.82, add 0.69 / 0.50; float16 0.61 / 0.70, 0.65 / 0.68, 0.39 / 0.65;
 * 524288x128 0.70 to 0.92 but the float16 add at two threads, 1.09; rows of 512 bytes either
 * way by shape and thread count, 0.88 to 1.28. 16-core Xeon running the AVX2 kernels, 1 / 4 / 16
 * threads: bfloat16 1M x 64 backward 0.77 to 0.80, add 0.89 / 0.95 / 1.09; float16 add 0.89 /
 * 1.03 / 1.34). Its AVX-512 kernels measured faster streamed (bfloat16 1M x 64 add 1.23 to
 * 1.38, float16 1.25 to 1.63) and stream rows of any length.
 * The kernels stream whole lines only and store the partial lines at a row's ends plainly
 * (FN(span)); rows that do not start on a line then pay for two plain lines a row, which
 * streaming outweighs from about 1 KiB (AMD EPYC Zen 4, one thread, ratio to a copy, output
 * rows 16 bytes into a line, plain -> streamed: float32 forward 65536x1024 1.56 -> 0.99,
 * 262144x256 1.40 -> 1.04, backward 262144x256 1.63 -> 1.23; bfloat16 forward 65536x1024 2.21
 * -> 1.28, add 131072x512 2.61 -> 1.92; but bfloat16 add 262144x256 2.25 -> 2.77, backward
 * 2.20 -> 3.09, and add 1M x 64 2.10 -> 3.72). The forward's 32- and 64-bit rows outweigh it
 * from 512 bytes (rows 16 bytes into a line, two builds alternating in one process, streamed
 * time over plain; AMD EPYC Zen 3, AVX2, 1 / 2 threads: float32 524288x128 0.90 / 0.74,
 * 335544x200 0.71 / 0.66, float64 524288x64 0.67 / 0.67, 335544x100 0.63 / 0.66; 16-core Xeon,
 * AVX-512, 1 / 4 / 16 threads: float32 524288x128 0.76 / 0.86 / 0.86, 335544x200 0.62 / 0.77 /
 * 0.78, float64 524288x64 0.64 / 0.67 / 0.80; its AVX2 kernels 0.69 to 0.94), but float32 rows
 * of 384 bytes lost on the Xeon (699050x96, 1.30 at one thread, 1.12 at four), and the 16-bit
 * forward's short rows lost on Zen 3 (bfloat16 524288x128 1.32 / 1.22, 262144x256 1.21 / 0.97;
 * float16 1M x 64 1.44 / 1.33). */
#define RMS_STREAM_ROW 1024
#define RMS_STREAM_ROW_FWD 512
/* Where the kernels stream the partial lines of 32- and 64-bit rows too (RMS_NT_EDGES), those
 * rows share no line between streaming and plain stores. Where rms_cpu_stream_edges says so
 * (every row on Intel CPUs; 32- and 64-bit rows of 256 bytes or more on AMD CPUs from Zen 5 on,
 * see dispatch.c) they then stream as rows on lines do: the forward and the add at any length
 * (edge_min 0), the backward from RMS_STREAM_ROW_EDGE_BWD bytes; elsewhere the rule above
 * stands. A 2-core Xeon (AVX-512), every array 16 bytes past a page as np.empty_like gives them,
 * two builds alternating in one process, time with the partial lines streamed over before
 * (stored plainly, and short rows not streamed), one / two threads: float32 forward 2M x 32
 * 0.78-0.80 / 0.76, 262144x256 0.71 / 0.71, 65536x1024 0.83-0.89 / 0.90, add 1M x 64 0.46-0.47 /
 * 0.47-0.49, 2M x 32 0.61 / 0.62, backward 524288x128 0.57-0.63 / 0.76-0.81, 262144x256
 * 0.81-0.83 / 0.78; float64 forward 1M x 32 0.63 / 0.61-0.62. Backward rows of 128 and 256
 * bytes lost at two threads (float32 2M x 32 1.47, 1M x 64 0.87-0.94 against 0.56-0.57 at one)
 * and are not streamed. The float32 forward compiles rows of 64 and 128 elements
 * as constants (RMS_KSW in rows_impl.h), and there the code of the streamed partial lines
 * slowed the rows on lines that never store one (page-aligned 1M x 64, 1.06-1.22 of the time;
 * through a call, as 16-bit rows below, 1.07, and 524288x128 1.15): those loops keep plain
 * partial lines (FN(span)), as do the 16-bit forward's and add's with a weight (RMS_KSW there
 * too), and outputs whose rows do not start on lines take the general loop instead when they
 * stream by this rule (RMS_ANY_K, rms_forward). Into empty_like, new over old at one / two
 * threads: float32 forward 1M x 64 0.66-0.69 / 0.68-0.69, 524288x128 0.75-0.85 / 0.77-0.80;
 * bfloat16 forward 524288x128 0.89-0.90 / 0.90-0.92, add 0.76-0.82 / 0.76-0.79; float16
 * forward 0.83-0.87. Rows on lines, which keep the constant-length loops, the same within 0.01.
 * 16-bit rows may start or end on 2 bytes, where no non-temporal piece fits: they take the
 * pieces where they start and end on 4 bytes (FN(edge_nt), through a call: FN(span_edge_nt)),
 * and stream by this rule only when every row of the output does, from RMS_STREAM_ROW_EDGE_16
 * bytes (bfloat16 forward 1M x 64 without a weight lost, 1.18-1.19 of the time, and 700000x96
 * gained nothing, 1.00). The same 2-core Xeon, every array 16 bytes past a page, new over old,
 * one / two threads: bfloat16 forward 262144x256 0.74-0.78 / 0.66-0.77, 131072x512 0.71 /
 * 0.73-0.74; add 262144x256 0.55-0.58 / 0.54-0.58, 131072x512 0.77 / 0.77-0.79; backward
 * 262144x256 0.60-0.81 / 0.77-0.92, 131072x512 0.69 / 0.76, 65536x1024 0.86 / 0.85; float16
 * forward 262144x256 0.68 / 0.69, 524288x128 without a weight 0.76 / 0.78, add 262144x256 0.63 /
 * 0.62, backward 131072x512 0.69-0.85 / 0.76-0.84. Outputs on lines measured the same within
 * 0.02. */
#define RMS_STREAM_ROW_EDGE_BWD 512
#define RMS_STREAM_ROW_EDGE_16 256
static int on_lines(const void *p, ptrdiff_t stride, size_t es) {
    return (uintptr_t)p % 64 == 0 && ((size_t)stride * es) % 64 == 0;
}
static int streamable(const void *p, ptrdiff_t stride, size_t k, size_t es, size_t bytes,
                      size_t min_row, size_t edge_min) {
    if (bytes < stream_bytes)
        return 0;
    int lines = on_lines(p, stride, es);
    size_t lines_min = es >= 4 ? 0 : rms_isa_current()->stream_row_16;
    /* 16-bit rows: where every row starts and ends on 4 bytes (FN(edge_nt)), and from
     * RMS_STREAM_ROW_EDGE_16 bytes or the rows on lines' minimum, whichever is more */
    int edges = RMS_NT_EDGES && rms_cpu_stream_edges(es, k * es) &&
                (es >= 4 || ((uintptr_t)p | (size_t)stride * es | k * es) % 4 == 0);
    if (es < 4 && edge_min < RMS_STREAM_ROW_EDGE_16)
        edge_min = RMS_STREAM_ROW_EDGE_16;
    if (edge_min < lines_min)
        edge_min = lines_min;
    return k * es >= min_row || (lines && k * es >= lines_min) || (edges && k * es >= edge_min);
}

/* Whether the output p (rows of k elements, stride apart, `bytes` in all) of a pass (LINE_FWD,
 * LINE_ADD or LINE_BWD) goes through the line buffer (line_rows): where rms_cpu_stream_edges
 * says so for its rows (Intel CPUs; Zen 5's 32- and 64-bit rows of 256 bytes or more), with a
 * family that streams, too large for the cache, packed and not on
 * lines, with rows that gained on both Xeons measured: the add's 16-bit rows of RMS_LINE_16_MIN
 * to RMS_LINE_16_MAX bytes, the forward's of RMS_LINE_16_MAX (ahead of the partial lines' rule in
 * streamable), no shorter than the family streams 16-bit rows on lines, and the backward's 32-
 * and 64-bit rows of RMS_LINE_MIN bytes up to those it streams (RMS_STREAM_ROW_EDGE_BWD). Into
 * empty_like, two builds (or the choice) alternating in one process, each pair in both orders,
 * new time over old. 2-core Xeon, AVX-512, one / two threads: bfloat16 add 1M x 64 0.62 / 0.62,
 * 524288x128 0.94 / 0.94, forward 524288x128 0.90 / 0.91; float16 add 1M x 64 0.75 / 0.74;
 * float32 backward 1M x 64 0.60 / 0.64, 2M x 32 0.76 / 0.76, 699050x96 0.72 / 0.71; float64
 * 1M x 32 0.65 / 0.63. 16-core Xeon, 1 / 4 / 16 threads: bfloat16 add 1M x 64 0.89 / 0.93 /
 * 0.85, 524288x128 0.68 / 0.63 / 0.57, forward 524288x128 0.74 / 0.51 / 0.62; float32 backward
 * 1M x 64 0.85 / 0.81 / 0.86, 699050x96 0.85 / 0.86 / 0.83; float64 1M x 32 0.87 / 0.83 / 0.80.
 * Left out: the 16-bit forward's shorter rows and the 16-bit backward, which gained on the
 * 2-core Xeon but not on the 16-core one (bfloat16 forward 1M x 64 0.78 / 0.77 there, 1.04 to
 * 1.14 here at 1 and 4 threads; backward 1M x 64 0.76 / 0.75 there, 0.94 / 1.07 / 0.98 here,
 * 524288x128 0.66 / 0.67 there, 1.11 / 1.11 / 1.04 here); 16-bit rows of 64 bytes (bfloat16 2M
 * x 32 forward 1.10, add 1.05 on the 2-core Xeon) and of 1 KiB (1.06 to 1.10 against the partial
 * lines' rule); the AVX2 kernels' 16-bit rows (1.04 to 1.07); the float32 forward and add (1M x
 * 64, 1.09 and 1.12); float32 backward rows of 32 bytes (8M x 8, 2.3). See benchmarks/NOTES.md. */
static int lined(const void *p, ptrdiff_t stride, size_t k, size_t es, size_t bytes, int pass) {
    const rms_isa_table *isa = rms_isa_current();
    size_t rb = k * es;
    if (!(RMS_NT_EDGES && isa->stream_lines && rms_cpu_stream_edges(es, rb) &&
          bytes >= stream_bytes && stride == (ptrdiff_t)k && (uintptr_t)p % 64 != 0 &&
          (uintptr_t)p % es == 0))
        return 0;
    if (es == 2)
        return pass != LINE_BWD && rb <= RMS_LINE_16_MAX && rb >= isa->stream_row_16 &&
               rb >= (pass == LINE_ADD ? RMS_LINE_16_MIN : RMS_LINE_16_MAX);
    return pass == LINE_BWD && rb >= RMS_LINE_MIN && rb < RMS_STREAM_ROW_EDGE_BWD;
}

/* The kernel flags of the CPU's choices for rows of row_bytes in the forward and the add
 * (backward 0) or the backward (1) on nt threads: the hardware prefetch and the fusing of rows
 * (dispatch.h). */
static int cpu_row_flags(int backward, size_t row_bytes, int nt) {
    return (rms_cpu_hw_prefetch(row_bytes) ? RMS_HW_PREFETCH : 0) |
           (rms_cpu_fuse_32() ? 0 : RMS_NO_FUSE_32) |
           (rms_cpu_fuse_16(backward, row_bytes, nt) ? RMS_FUSE_16 : 0);
}

int rms_forward(const rms_kernels *kt, const rms_fwd_args *a, int nthreads,
                const rms_pool *pool) {
    size_t total = a->m * a->k, es = rms_esize(a->dtype);
    set_last_team(1);
    if (total == 0)
        return 0;
    int nt = team_size(total, pool_threads(pool, nthreads));
    int flags = (a->flags & ~RMS_W_OWN) | cpu_row_flags(0, a->k * es, nt);
    if (a->r && a->k * es >= (es >= 4 ? early_h_bytes : early_h_bytes_16))
        flags |= RMS_EARLY_H;
    size_t bytes = total * es * (a->r ? 2 : 1);
    size_t min_row = a->r || es < 4 ? RMS_STREAM_ROW : RMS_STREAM_ROW_FWD;
    int pass = a->r ? LINE_ADD : LINE_FWD;
    if (lined(a->y, a->ys, a->k, es, bytes, pass) &&
        (!a->r || (lined(a->h, a->hs, a->k, es, bytes, pass) &&
                   (uintptr_t)a->h % 64 == (uintptr_t)a->y % 64))) {
        flags |= RMS_LINED;
    } else if (streamable(a->y, a->ys, a->k, es, bytes, min_row, 0) &&
               (!a->r || streamable(a->h, a->hs, a->k, es, bytes, min_row, 0))) {
        flags |= RMS_STREAM;
        /* outputs whose rows do not start on lines, streamed by the partial lines' rule (see
         * streamable): the loops the kernels compile for constant row lengths keep plain
         * partial lines, so such rows take the general loop instead (RMS_ANY_K) */
        if (RMS_NT_EDGES && rms_cpu_stream_edges(es, a->k * es) &&
            !(on_lines(a->y, a->ys, es) && (!a->r || on_lines(a->h, a->hs, es))))
            flags |= RMS_ANY_K;
    }
    if (!a->r && (flags & RMS_STREAM)) /* outputs too large to stay in the cache */
        flags |= rms_cpu_fwd_flags(nt);
    own_w ow;
    if (own_w_open(&ow, kt, a->w, a->w_offset, a->k, a->flags, nt) < 0)
        return -1;
    if (nt <= 1) { /* the rows of fwd_phase's one member, without its split */
        rms_fwd_args mine = *a;
        own_w_take(&ow, 0, 0, &mine.w, &mine.flags);
        fwd_any(kt, &mine, 0, a->m, flags, es);
    } else {
        fwd_job j; /* sh[t] is member t's to write in phase 0: not zeroed, 20 KiB a call */
        j.kt = kt;
        j.a = a;
        j.flags = flags;
        j.rstd_apart = writes_inputs(a);
        j.ow = ow;
        run_team(nt, 2 + j.rstd_apart, fwd_phase, rstd_phase, &j, pool);
    }
    rows_free(ow.rows);
    return 0;
}

/* Backward. Each thread accumulates dgamma into its own row of a [threads x k] buffer over the
 * columns it touches; the rows are then summed column-parallel in thread order. */
static void bwd_call(const void *ctx, size_t r0, size_t r1, char *const *out) {
    const rows_ctx *c = ctx;
    const rms_bwd_args *a = c->ba;
    size_t es = c->es;
    c->kt->bwd_rows(AT(a->dy, r0, a->dys, 0, es), a->dys, AT(a->x, r0, a->xs, 0, es), a->xs,
                    out[0], out_stride(c->flags, a->k, a->dxs), a->w,
                    (const char *)a->rstd + r0 * c->cs, c->dg, r1 - r0, a->k,
                    call_flags(c->flags));
}

/* Bytes of one dgamma entry: the compute type's, or x's with RMS_DG_NARROW (one row). */
static size_t dg_size(const rms_bwd_args *a) {
    return (a->flags & RMS_DG_NARROW) && a->m == 1 ? rms_esize(a->dtype) : csize(a->dtype);
}

/* dx over columns [c0, c0 + n) of row i with the row's rstd r and c = mean(dy * w * xhat), its
 * dgamma terms into dg (entries of dgs bytes, for column c0 on), backwards for long pieces. */
static void bwd_piece(const rms_kernels *kt, const rms_bwd_args *a, size_t i, size_t c0,
                      size_t n, double r, double c, char *dg, size_t dgs, int flags, int back) {
    size_t es = rms_esize(a->dtype), ws = wsize(a->dtype, a->flags);
    const char *dy = AT(a->dy, i, a->dys, c0, es), *x = AT(a->x, i, a->xs, c0, es);
    const char *w = a->w ? (const char *)a->w + c0 * ws : NULL;
    char *dx = AT(a->dx, i, a->dxs, c0, es);
    for (size_t e = n, b; e > 0; e = b) {
        b = back_start(e, n, dx, es, back);
        kt->bwd(dy + b * es, x + b * es, w ? w + b * ws : NULL, dx + b * es, r, c,
                dg ? dg + b * dgs : NULL, e - b, flags & ~RMS_LINED);
    }
}

static void bwd_rows(const rms_kernels *kt, const rms_bwd_args *a, size_t r0, size_t r1,
                     void *dg, size_t es, size_t cs, int flags) {
    if (r1 <= r0)
        return;
    /* a single long row: its dot product, then dx backwards (see back_start); runs of them are
     * fused across rows by the kernels, which measured faster (float32 64x524288 took 1.08 /
     * 1.08 of the time backwards, one / two threads) */
    if (r1 - r0 == 1 && a->k * es >= back_bytes && !(flags & RMS_LINED)) {
        double r = load_c(a->rstd, r0, a->dtype == RMS_F64);
        double d = kt->dot(AT(a->dy, r0, a->dys, 0, es), AT(a->x, r0, a->xs, 0, es), a->w, r,
                           a->k, a->flags);
        bwd_piece(kt, a, r0, 0, a->k, r, d / (double)a->k, dg, dg_size(a), flags, 1);
        return;
    }
    rows_ctx c = {kt, NULL, a, dg, flags, es, cs};
    char *dst[1] = {AT(a->dx, r0, a->dxs, 0, es)};
    if (flags & RMS_LINED)
        line_rows(bwd_call, &c, r0, r1, a->k * es, dst, 1);
    else
        bwd_call(&c, r0, r1, dst);
}

/* Columns [lo, hi) of the dgamma row that thread share s writes. */
static void touched(const share *s, size_t k, size_t *lo, size_t *hi) {
    *lo = k;
    *hi = 0;
    if (s->r1 > s->r0) {
        *lo = 0;
        *hi = k;
    }
    for (int j = 0; j < 2; j++) {
        const piece *p = &s->p[j];
        if (p->row == RMS_NONE)
            continue;
        *lo = p->c0 < *lo ? p->c0 : *lo;
        *hi = p->c1 > *hi ? p->c1 : *hi;
    }
}

/* d[lo..hi) += s[lo..hi): with restrict pointers of their own, so that the compiler need not
 * reload them after every store (the build does not assume strict aliasing) and vectorizes the
 * loop. */
static void add_row_f32(float *restrict d, const float *restrict s, size_t lo, size_t hi) {
    for (size_t j = lo; j < hi; j++)
        d[j] += s[j];
}

static void add_row_f64(double *restrict d, const double *restrict s, size_t lo, size_t hi) {
    for (size_t j = lo; j < hi; j++)
        d[j] += s[j];
}

static void reduce_columns(const rms_bwd_args *a, const char *parts, const share *sh, int nt,
                           size_t c0, size_t c1) {
    int f64 = a->dtype == RMS_F64;
    size_t cs = csize(a->dtype);
    void *dgamma = a->dgamma;
    memset((char *)dgamma + c0 * cs, 0, (c1 - c0) * cs);
    for (int t = 0; t < nt; t++) {
        size_t lo, hi;
        touched(&sh[t], a->k, &lo, &hi);
        lo = lo > c0 ? lo : c0;
        hi = hi < c1 ? hi : c1;
        const char *row = parts + (size_t)t * dg_pitch(a->k, cs);
        if (f64)
            add_row_f64(dgamma, (const double *)row, lo, hi);
        else
            add_row_f32(dgamma, (const float *)row, lo, hi);
    }
}

/* dgamma's columns [c0, c1), final, rounded into dgamma_x where the caller asks for it. */
static void dg_narrow(const rms_kernels *kt, const rms_bwd_args *a, size_t c0, size_t c1) {
    if (a->dgamma_x && c1 > c0)
        kt->narrow((const char *)a->dgamma + c0 * csize(a->dtype),
                   (char *)a->dgamma_x + c0 * rms_esize(a->dtype), c1 - c0);
}

typedef struct {
    const rms_kernels *kt;
    const rms_bwd_args *a;
    char *dg_rows; /* the [threads x k] partial dgamma rows, or NULL without a weight */
    int flags;
    own_w ow;
    share sh[RMS_MAX_THREADS];
} bwd_job;

/* Phase 0: the partial rows' dot products, then the whole rows. Phase 1: the partial rows.
 * Phase 2 (with dg_rows): dgamma, summed column-parallel in thread order. */
static void bwd_phase(void *job, int t, int nt, int phase) {
    bwd_job *j = job;
    const rms_kernels *kt = j->kt;
    rms_bwd_args mine = *j->a; /* with member t's weight */
    own_w_take(&j->ow, t, phase, &mine.w, &mine.flags);
    const rms_bwd_args *a = &mine;
    size_t es = rms_esize(a->dtype), cs = csize(a->dtype), k = a->k;
    int f64 = a->dtype == RMS_F64;
    char *dg = j->dg_rows ? j->dg_rows + (size_t)t * dg_pitch(k, cs) : (char *)a->dgamma;
    if (phase == 0) {
        share s = split(a->m * k, k, t, nt);
        if (j->dg_rows) {
            size_t lo, hi;
            touched(&s, k, &lo, &hi);
            if (hi > lo) {
                memset(dg + lo * cs, 0, (hi - lo) * cs);
                touch_after(dg + hi * cs);
            }
        }
        for (int i = 0; i < 2; i++) {
            piece *p = &s.p[i];
            if (p->row == RMS_NONE)
                continue;
            const char *w = a->w ? (const char *)a->w + p->c0 * wsize(a->dtype, a->flags) : NULL;
            p->s = kt->dot(AT(a->dy, p->row, a->dys, p->c0, es), AT(a->x, p->row, a->xs, p->c0, es),
                           w, load_c(a->rstd, p->row, f64), p->c1 - p->c0, a->flags);
        }
        j->sh[t] = s;
        bwd_rows(kt, a, s.r0, s.r1, dg, es, cs, j->flags);
    } else if (phase == 1) {
        for (int i = 0; i < 2; i++) {
            const piece *p = &j->sh[t].p[i];
            if (p->row == RMS_NONE)
                continue;
            bwd_piece(kt, a, p->row, p->c0, p->c1 - p->c0, load_c(a->rstd, p->row, f64),
                      row_sum(j->sh, nt, p->row) / (double)k, dg ? dg + p->c0 * cs : NULL, cs,
                      j->flags, one_piece(&j->sh[t]));
        }
    } else {
        size_t c0 = k * (size_t)t / (size_t)nt, c1 = k * (size_t)(t + 1) / (size_t)nt;
        reduce_columns(a, j->dg_rows, j->sh, nt, c0, c1);
        dg_narrow(kt, a, c0, c1);
    }
}

/* Few rows: the team splits the columns instead of the rows. Phase 0: each member's dot
 * products over its columns of every row (and its columns of dgamma zeroed). Phase 1: dx over
 * its columns, row by row, with dgamma's columns gaining the rows' terms in row order, exactly
 * as on one thread. No partial dgamma rows to zero, fill and reduce: for a few long rows on
 * many threads those cost more than the rows themselves. */
typedef struct {
    const rms_kernels *kt;
    const rms_bwd_args *a;
    double *dots; /* [nt x m]: member t's dot products of the rows over its columns */
    int flags;
    own_w ow;
    char *dg_rows; /* several rows: member t's columns of dgamma, accumulated at t * dg_pitch */
} cols_job;

static void cols_phase(void *job, int t, int nt, int phase) {
    cols_job *j = job;
    rms_bwd_args mine = *j->a; /* with member t's weight */
    own_w_take(&j->ow, t, phase, &mine.w, &mine.flags);
    const rms_bwd_args *a = &mine;
    size_t es = rms_esize(a->dtype), lo, hi;
    int f64 = a->dtype == RMS_F64;
    chunk(a->k, t, nt, 32, &lo, &hi);
    const char *w = a->w ? (const char *)a->w + lo * wsize(a->dtype, a->flags) : NULL;
    char *out = a->dgamma ? (char *)a->dgamma + lo * dg_size(a) : NULL;
    char *dg = j->dg_rows ? j->dg_rows + (size_t)t * dg_pitch(a->k, dg_size(a)) : out;
    for (size_t i = 0; i < a->m; i++) {
        if (phase == 0) {
            j->dots[(size_t)t * a->m + i] =
                hi > lo ? j->kt->dot(AT(a->dy, i, a->dys, lo, es), AT(a->x, i, a->xs, lo, es),
                                     w, load_c(a->rstd, i, f64), hi - lo, a->flags)
                        : 0.0;
            continue;
        }
        if (hi <= lo)
            continue;
        double c = 0.0;
        for (int u = 0; u < nt; u++) /* in member order, so every member agrees */
            c += j->dots[(size_t)u * a->m + i];
        bwd_piece(j->kt, a, i, lo, hi - lo, load_c(a->rstd, i, f64), c / (double)a->k, dg,
                  dg_size(a), j->flags, a->m == 1);
    }
    if (phase == 0 && dg && !(j->flags & RMS_DG_STORE) && hi > lo) {
        memset(dg, 0, (hi - lo) * dg_size(a));
        if (dg != out) /* a row of the member's own */
            touch_after(dg + (hi - lo) * dg_size(a));
    }
    if (phase == 1 && dg != out && hi > lo)
        memcpy(out, dg, (hi - lo) * dg_size(a));
    if (phase == 1)
        dg_narrow(j->kt, a, lo, hi);
}

/* Split the columns for up to 16 rows, or for more when each member's columns are long (1024
 * or more), its rows would have taken no more than 8 of their own partial dgamma rows' bytes,
 * and its columns of dy and x stay in the cache between the two phases (1 MiB, half an L2).
 * Past that the row split wins: the rows' partial dgamma rows cost less than the columns'
 * second reading of dy and x, and 32- and 64-bit rows go two at a time. Measured on 2 to 16
 * threads for 4 to 256 rows of 4096 to 262144. */
static int split_columns(const rms_bwd_args *a, int nt) {
    size_t es = rms_esize(a->dtype), cols = a->k / (size_t)nt;
    if (a->m <= 16)
        return 1;
    return cols >= 1024 && a->m * es <= (size_t)nt * 8 * csize(a->dtype) &&
           a->m * cols * es * 2 <= ((size_t)1 << 20);
}

/* The backward on nt members that split the columns (cols_phase). Where a member's columns of
 * dgamma take RMS_COLS_OWN_DG bytes or less, and no more than RMS_COLS_OWN_DG_ROW a row, the
 * members accumulate them in rows of their own, on pages of their own (as dg_pitch says why),
 * and copy them into dgamma at the end: in dgamma itself, each member's columns ended on the
 * next member's, and the lines across that boundary went between the cores on every row. The
 * copy costs as much as the columns. 2-core Xeon, two threads, two builds alternating, both
 * orders, new time over old: bfloat16 8x4096 0.86, 16x4096 0.82, 16x8192 0.88, 4x8192 0.95,
 * float16 16x4096 0.77, float32 8x4096 0.94, 16x4096 0.93; left as they were, bfloat16
 * 29x17389 (34 KiB a member) 1.01, 4x262144 1.01; lost that way, 2x16384 (32 KiB a member, 16
 * a row) 1.09, 4x16384 1.02. */
#define RMS_COLS_OWN_DG 32768
#define RMS_COLS_OWN_DG_ROW 4096
static int bwd_cols(const rms_kernels *kt, const rms_bwd_args *a, int nt, int flags,
                    const own_w *ow, const rms_pool *pool) {
    size_t cs = csize(a->dtype), bytes = a->k * cs / (size_t)nt; /* a member's, about */
    int own_dg = a->m > 1 && bytes <= RMS_COLS_OWN_DG && bytes <= a->m * RMS_COLS_OWN_DG_ROW;
    double *dots = malloc(a->m * (size_t)nt * sizeof(double));
    char *dg_rows = NULL;
    if (!dots || (own_dg && !(dg_rows = member_rows(nt, a->k, cs)))) {
        free(dots);
        return -1;
    }
    cols_job j = {kt, a, dots, flags, *ow, dg_rows};
    run_team(nt, 2, cols_phase, NULL, &j, pool);
    rows_free(dg_rows);
    free(dots);
    return 0;
}

/* On one thread, a backward of RMS_OWN_DG_ROWS rows or more accumulates dgamma in a row of the
 * driver's own (member_rows, on pages of its own), copied into dgamma at the end, as the members
 * of a team do: accumulated in dgamma's array itself, which NumPy places among other small
 * blocks, the one-thread backward ran at one of two speeds, fixed for a process, depending on
 * where that array fell. AMD EPYC (Zen 4, AVX-512), one thread, page-aligned arrays, two builds
 * alternating in one process, the same bits: bfloat16 262144x256 took 42 to 59 ms in four
 * processes with the array in dgamma, 19 to 29 ms with the row (new over old 0.39 to 0.50);
 * float16 65536x1024 in eight processes 15.4 to 23.4 ms before, 15.1 to 16.9 ms after; bfloat16
 * 65536x1024 0.74 / 0.85, float16 8192x8192 0.74 / 0.75, float32 8192x8192 0.88 / 0.90 in two
 * more. On a 16-core Intel Xeon (AVX-512), one thread, the same within noise (seven shapes, 0.94
 * to 1.02). With fewer rows the row's zeroing and copy cost more than they save (float32 and
 * bfloat16 rows of 512 bytes to 16 KiB, in cache: 2 rows 1.10 to 1.12 of the time, 8 rows 1.01
 * to 1.04, 16 and 64 rows 0.96 to 1.02), and so does a row too long to be kept for the next call
 * (RMS_KEEP_BYTES), which every call maps and faults in again (float32 16x2097152, a row of 8 MiB:
 * 1.02 to 1.05 of the time). */
#define RMS_OWN_DG_ROWS 16
/* The backward on nt members that split the rows (bwd_phase), or on the calling thread. */
static int bwd_split(const rms_kernels *kt, const rms_bwd_args *a, int nt, int flags,
                     const own_w *ow, const rms_pool *pool) {
    size_t cs = csize(a->dtype), es = rms_esize(a->dtype);
    if (nt <= 1) { /* the rows of bwd_phase's one member, without its split */
        rms_bwd_args mine = *a;
        own_w_take(ow, 0, 0, &mine.w, &mine.flags);
        int own = a->m >= RMS_OWN_DG_ROWS && a->dgamma && rows_bytes(1, a->k, cs) <= RMS_KEEP_BYTES;
        char *dg = own ? member_rows(1, a->k, cs) : NULL, *acc = dg ? dg : a->dgamma;
        if (a->m > 1 && acc)
            memset(acc, 0, a->k * cs);
        if (dg)
            touch_after(dg + a->k * cs);
        bwd_rows(kt, &mine, 0, a->m, acc, es, cs, flags);
        if (dg) {
            memcpy(a->dgamma, dg, a->k * cs);
            rows_free(dg);
        }
        dg_narrow(kt, a, 0, a->k);
        return 0;
    }
    if (a->m > 1 && a->dgamma)
        memset(a->dgamma, 0, a->k * cs);
    char *dg_rows = NULL;
    if (a->dgamma && !(dg_rows = member_rows(nt, a->k, cs)))
        return -1;
    bwd_job j; /* sh[t] is member t's to write in phase 0, as in rms_forward */
    j.kt = kt;
    j.a = a;
    j.dg_rows = dg_rows;
    j.flags = flags;
    j.ow = *ow;
    run_team(nt, dg_rows ? 3 : 2, bwd_phase, NULL, &j, pool);
    rows_free(dg_rows);
    return 0;
}

/* Whether consecutive rows s elements of es bytes apart start within 256 bytes of the same
 * offset in a 4 KiB page. */
static int rows_alias(ptrdiff_t s, size_t es) {
    size_t b = (size_t)(s < 0 ? -s : s) * es % 4096;
    return b < 256 || b > 4096 - 256;
}

/* The backward pairs 32- and 64-bit rows, and long 16-bit rows on AVX-512, in kernels with 32
 * vector registers (RMS_ROW_PAIRS: see bwd_loop in rows_add_bwd.h), except where two rows of dy, x
 * or dx share their page offsets and are shorter than rms_cpu_pairs() allows. On an AMD EPYC (Zen
 * 3), whose AVX2 kernels never pair, such rows measured slower in pairs (one thread, float32, in
 * pairs -> one at a time, ratio to a triad: 8192x4096 1.39 -> 0.99, 16384x1024 1.72 -> 0.94,
 * 2048x16384 2.12 -> 1.37), and so did rows that share no page offset. On an AMD EPYC (Zen 4), one
 * thread, page-aligned arrays, ratio to two copies, one at a time -> in pairs, rows of 32 KiB and
 * more gained (8192x8192 1.12-1.27 -> 1.08-1.21, 4096x12288 1.47-1.54 -> 1.32-1.40, 4096x16384
 * 1.20-1.24 -> 1.19-1.21) and shorter ones lost (16384x4096 1.12-1.15 -> 1.26-1.30, 65536x1024
 * 1.20-1.27 -> 1.63-1.67). On a Zen 5 EPYC (1 MiB of L2 a core, 48 KiB of L1d), the two
 * alternating in one process, page-aligned, in pairs over one at a time at one / two threads, rows
 * from 12 KiB gained (float32 8192x3072 0.92 / 0.99, 8192x4096 0.91-0.97 / 0.97-0.98, 16384x4096
 * 0.92 / 0.97, 4096x6144 0.97 / 1.02; float64 8192x2048 0.94 / 0.96; in cache, 8x4096 0.90) and
 * shorter ones lost (float32 16384x2048 1.06 / 1.03, 32768x1024 1.24 / 1.15), so they pair from 12
 * KiB there (16-bit rows, fused on AMD CPUs, the same within 0.02). On Intel CPUs, 32- and 64-bit
 * rows of 32 to 128 KiB go one at a time (rms_cpu_pairs). A 2-core Xeon (AVX-512, 2 MiB of L2 a
 * core), two choices alternating in one process, page-aligned arrays, time one at a time over in
 * pairs at one / two threads: float32 8192x8192 0.93-0.94 / 0.94, 4096x12288 0.92-0.95 /
 * 0.94-0.97, 2048x16384 0.97-0.98 / 0.97; float64 8192x4096 0.95 / 0.96, 4096x8192 0.96 / 0.95.
 * Shorter and longer rows measured faster in pairs (float32 16384x4096 1.04-1.05 / 1.00-1.03,
 * 65536x1024 1.16 / 1.16; float64 2048x16384 1.13 / 1.10), and so did 16-bit rows (bfloat16 and
 * float16 8192x8192 to 1024x32768 1.01 to 1.09). The 16-core Xeon (the same caches a core)
 * measured the two the same within its noise (one / four threads: float32 8192x8192 1.01-1.03 /
 * 1.01, 4096x12288 1.01 / 1.00; float64 4096x8192 0.86-1.11 / 1.05, 8192x4096 1.01 / 1.02). */
int rms_backward(const rms_kernels *kt, const rms_bwd_args *a, int nthreads,
                 const rms_pool *pool) {
    size_t total = a->m * a->k, es = rms_esize(a->dtype);
    int nt = team_size(total, pool_threads(pool, nthreads)), cols = 0;
    set_last_team(1);
    int flags = (a->flags & RMS_W_STORAGE) | cpu_row_flags(1, a->k * es, nt) |
                (rms_cpu_near_16() ? RMS_NEAR_16 : 0);
    if (rms_cpu_pairs(a->k * es, es,
                      rows_alias(a->dys, es) || rows_alias(a->xs, es) || rows_alias(a->dxs, es)))
        flags |= RMS_ROW_PAIRS;
    if (lined(a->dx, a->dxs, a->k, es, total * es, LINE_BWD))
        flags |= RMS_LINED;
    else if (streamable(a->dx, a->dxs, a->k, es, total * es, RMS_STREAM_ROW,
                        RMS_STREAM_ROW_EDGE_BWD))
        flags |= RMS_STREAM;
    if (a->m == 1) /* one row: dgamma = dy * xhat, stored, not accumulated */
        flags |= RMS_DG_STORE | (a->flags & RMS_DG_NARROW);
    if (total == 0) {
        if (a->dgamma) /* no rows: dgamma is zeros */
            memset(a->dgamma, 0, a->k * dg_size(a));
        if (a->dgamma_x)
            memset(a->dgamma_x, 0, a->k * es);
        return 0;
    }
    if (nt > 1 && a->dgamma && split_columns(a, nt)) {
        if ((size_t)nt > a->k / 32) /* members get 32 columns or more */
            nt = (int)(a->k / 32);
        cols = nt > 1;
    }
    if (rms_cpu_bwd_ahead_32(nt))
        flags |= RMS_BWD_AHEAD_32;
    own_w ow;
    if (own_w_open(&ow, kt, a->w, a->w_offset, a->k, a->flags, nt > 1 ? nt : 1) < 0)
        return -1;
    int rc = cols ? bwd_cols(kt, a, nt, flags, &ow, pool) : bwd_split(kt, a, nt, flags, &ow, pool);
    rows_free(ow.rows);
    return rc;
}

/* Weight conversions: gamma is as long as a row, so for one long row it costs as much as the
 * row itself and is split across the team too. */
void rms_convert(const rms_kernels *kt, int dtype, const void *src, void *dst, double offset,
                 size_t n, int widen, int nthreads) {
    size_t es = rms_esize(dtype), cs = csize(dtype);
    size_t in = widen ? es : cs, out = widen ? cs : es;
    int nt = team_size(n, nthreads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int t = thread_id(), team = team_threads();
        size_t i0, i1;
        chunk(n, t, team, 64, &i0, &i1);
        const char *s = (const char *)src + i0 * in;
        char *o = (char *)dst + i0 * out;
        if (i1 > i0 && widen)
            kt->widen(s, o, offset, i1 - i0);
        else if (i1 > i0)
            kt->narrow(s, o, i1 - i0);
    }
}

/* Roofline references, split across the team like the kernels. */
void rms_ref_copy(void *dst, const void *src, size_t bytes, int prefetch, int nthreads) {
    int nt = team_size(bytes / 4, nthreads), stream = bytes >= stream_bytes;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int t = thread_id(), team = team_threads();
        size_t b0, b1;
        chunk(bytes, t, team, 64, &b0, &b1);
        if (b1 > b0)
            rms_copy_span((char *)dst + b0, (const char *)src + b0, b1 - b0, stream, prefetch);
    }
}

void rms_ref_triad(void *dst, const void *a, const void *b, size_t n, int f64, int nthreads) {
    size_t es = f64 ? 8 : 4;
    int nt = team_size(n, nthreads), stream = n * es >= stream_bytes;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int t = thread_id(), team = team_threads();
        size_t i0, i1;
        chunk(n, t, team, 16, &i0, &i1);
        if (i1 > i0)
            rms_triad_span((char *)dst + i0 * es, (const char *)a + i0 * es,
                           (const char *)b + i0 * es, i1 - i0, f64, stream);
    }
}
