/* Threading for every kernel. Rows are split across a team: many rows by whole rows, a few long
 * rows by a flattened split of the m x k elements (a member gets whole rows plus at most a
 * partial row at each end), whose partial sums every sharer of a row combines in the same
 * fixed order after a barrier. The backward's dgamma is summed over fixed blocks of rows
 * ("leaves", chosen from m alone) and the leaves' sums are combined along a fixed binary tree,
 * so dgamma has the same bits whatever the team. Tiny inputs run on the calling thread. */
#include "driver.h"

#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kernels/reference.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#define RMS_MAX_THREADS 256
#define RMS_NONE ((size_t)-1)
#define AT(p, row, stride, col, es)                                                        \
    ((char *)(p) + ((ptrdiff_t)(row) * (stride) + (ptrdiff_t)(col)) * (ptrdiff_t)(es))

static int n_threads = 1, last_team = 1;
/* Elements below which a thread costs more than it saves. */
static size_t min_per_thread = 16 * 1024;
static size_t stream_bytes = (size_t)32 << 20, l3 = 0;
static char env_warning[256];

size_t rms_esize(int dtype) { return dtype == RMS_F64 ? 8 : dtype == RMS_F32 ? 4 : 2; }
static size_t csize(int dtype) { return dtype == RMS_F64 ? 8 : 4; }
static int compute_dtype(int dtype) { return dtype == RMS_F64 ? RMS_F64 : RMS_F32; }

/* ---------------------------------------------------------------- settings */

static void warn_env(const char *name, const char *value) {
    size_t n = strlen(env_warning);
    snprintf(env_warning + n, sizeof env_warning - n, "%s%s=%.40s is not a whole number >= %s; "
             "ignored", n ? "; " : "", name, value, strcmp(name, "RMSNORM_NUM_THREADS") ? "0" : "1");
}

/* The variable's whole number, or -1 when unset (or malformed: then warned when `ours`). */
static long long env_number(const char *name, int ours, long long min) {
    const char *s = getenv(name);
    if (!s || !*s)
        return -1;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (!ours) /* OMP_NUM_THREADS may be a list "8,4": take the first */
        return end != s && v >= min && errno == 0 ? v : -1;
    while (*end == ' ' || *end == '\n')
        end++;
    if (end == s || *end || v < min || errno) {
        warn_env(name, s);
        return -1;
    }
    return v;
}

/* The size of the cache of `level` that CPU 0 has, in bytes (0 if unknown). Linux lists it in
 * sysfs from the CPU's cache topology; glibc's sysconf can report a virtual machine's host. */
static size_t cache_bytes(int level) {
#if defined(__linux__)
    for (int i = 0; i < 16; i++) {
        char path[64];
        int lv = 0;
        unsigned long long v = 0;
        char unit = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        FILE *f = fopen(path, "r");
        if (!f)
            break;
        int ok = fscanf(f, "%d", &lv) == 1;
        fclose(f);
        if (!ok || lv != level)
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
    (void)level;
    return 0;
}

void rms_threads_init(void) {
    long long n = env_number("RMSNORM_NUM_THREADS", 1, 1);
    if (n < 0)
        n = env_number("OMP_NUM_THREADS", 0, 1);
#if defined(_OPENMP)
    if (n < 0)
        n = omp_get_num_procs(); /* honours the affinity mask */
#endif
    rms_threads_set(n > 0 ? (n < RMS_MAX_THREADS ? (int)n : RMS_MAX_THREADS) : 1);
    /* Outputs that do not fit in about half the last-level cache beside their inputs bypass
     * it; a machine whose sysfs lists no L3 uses its L2 (measured in benchmarks/NOTES.md). */
    l3 = cache_bytes(3);
    size_t llc = l3 ? l3 : cache_bytes(2);
    if (llc > 0 && llc / 2 < stream_bytes)
        stream_bytes = llc / 2;
    long long s = env_number("RMSNORM_STREAM_BYTES", 1, 0);
    if (s >= 0)
        stream_bytes = (size_t)s;
}

const char *rms_env_warning(void) { return env_warning[0] ? env_warning : NULL; }

size_t rms_stream_bytes(size_t *l3_out) {
    if (l3_out)
        *l3_out = l3;
    return __atomic_load_n(&stream_bytes, __ATOMIC_RELAXED);
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

int rms_last_team_size(void) { return __atomic_load_n(&last_team, __ATOMIC_RELAXED); }

size_t rms_set_min_per_thread(size_t n) {
    return __atomic_exchange_n(&min_per_thread, n, __ATOMIC_RELAXED);
}

size_t rms_set_stream_bytes(size_t n) {
    return __atomic_exchange_n(&stream_bytes, n, __ATOMIC_RELAXED);
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

/* ---------------------------------------------------------------- teams */

/* Members to ask for: nthreads (at most the pool's size), fewer when there is too little work
 * (`elements`), and at most `most`. */
static int team_size(size_t elements, int nthreads, const rms_pool *pool, size_t most) {
#if defined(_OPENMP)
    (void)pool;
#else
    if (!pool)
        return 1;
#endif
    if (pool && pool->nthreads < nthreads)
        nthreads = pool->nthreads;
    size_t mpt = __atomic_load_n(&min_per_thread, __ATOMIC_RELAXED);
    size_t useful = mpt ? elements / mpt : elements;
    if (useful > most)
        useful = most;
    if (useful < (size_t)nthreads)
        nthreads = useful > 1 ? (int)useful : 1;
    return nthreads;
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

/* [*lo, *hi): member t's contiguous share of n items, boundaries rounded down to multiples of
 * `align` (a power of two) so that members stay off each other's cache lines. */
static void chunk(size_t n, int t, int nt, size_t align, size_t *lo, size_t *hi) {
    *lo = (size_t)((unsigned __int128)n * (unsigned)t / (unsigned)nt) & ~(align - 1);
    *hi = t + 1 == nt ? n : (size_t)((unsigned __int128)n * (unsigned)(t + 1) / (unsigned)nt) &
                                ~(align - 1);
}

/* A team runs fn(job, t, nt, phase) for every member t < nt, phase by phase: every member
 * finishes a phase before any starts the next, and a phase that skip(job, nt, phase) declines
 * (every member gets the same answer) is left out. On OpenMP the team is one parallel region
 * with a barrier between phases; on a caller's pool (rms_pool) each phase is a fork-join whose
 * members are claimed by whichever thread comes first, the caller included, so the work
 * finishes even when the pool runs nothing in parallel. */
typedef void (*phase_fn)(void *job, int t, int nt, int phase);
typedef int (*skip_fn)(const void *job, int nt, int phase);

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

static void run_team(int nt, int phases, phase_fn fn, skip_fn skip, void *job,
                     const rms_pool *pool) {
    __atomic_store_n(&last_team, nt, __ATOMIC_RELAXED);
    if (nt <= 1 || pool) {
        for (int phase = 0; phase < phases; phase++) {
            if (phase > 0 && skip && skip(job, nt, phase))
                continue;
            if (nt > 1 && pool_run(pool, nt, phase, fn, job) == 0)
                continue;
            for (int t = 0; t < nt; t++) /* one member, or out of memory: the calling thread */
                fn(job, t, nt, phase);
        }
        return;
    }
#pragma omp parallel num_threads(nt)
    {
        int t = thread_id(), n = team_threads();
        if (t == 0 && n != nt)
            __atomic_store_n(&last_team, n, __ATOMIC_RELAXED);
        for (int phase = 0; phase < phases; phase++) {
            if (phase > 0) {
#pragma omp barrier
                if (skip && skip(job, n, phase))
                    continue; /* every member skips, or none */
            }
            fn(job, t, n, phase);
        }
    }
}

/* ---------------------------------------------------------------- scratch rows
 * Rows of the driver's own (widened weights, dgamma partial sums), each on pages of its own
 * with a page between neighbours: rows that shared a page, or lay on neighbouring pages, slowed
 * each other's threads through the CPUs' prefetchers (benchmarks/NOTES.md). */
#define RMS_PAGE 4096
static size_t row_pitch(size_t bytes) {
    return (bytes + RMS_PAGE - 1) / RMS_PAGE * RMS_PAGE + RMS_PAGE;
}

/* Scratch memory (dgamma's partial rows, widened weights, the add's staged h), page-aligned.
 * glibc maps a large block afresh and unmaps it when freed, so every call would fault in zeroed
 * pages again, which for one long row took several times the kernels' own time
 * (benchmarks/NOTES.md); the last RMS_KEPT blocks freed, each up to RMS_KEEP_MAX bytes, are
 * kept for the next calls instead (a call takes at most two: weights and dgamma's rows or the
 * stage). Each block carries its size in the page before it. */
#define RMS_KEEP_MAX ((size_t)64 << 20)
#define RMS_KEPT 2
static char *kept[RMS_KEPT];
#define BLOCK_SIZE(b) (*(size_t *)(b))

static void keep(char *b) {
    for (int i = 0; i < RMS_KEPT; i++) {
        char *none = NULL;
        if (__atomic_compare_exchange_n(&kept[i], &none, b, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return;
    }
    free(__atomic_exchange_n(&kept[0], b, __ATOMIC_ACQ_REL));
}

/* The smallest kept block that is large enough, or a new one. */
static void *scratch_get(size_t bytes) {
    char *b[RMS_KEPT];
    int u = -1;
    for (int i = 0; i < RMS_KEPT; i++) {
        b[i] = __atomic_exchange_n(&kept[i], NULL, __ATOMIC_ACQ_REL);
        if (b[i] && BLOCK_SIZE(b[i]) >= bytes && (u < 0 || BLOCK_SIZE(b[i]) < BLOCK_SIZE(b[u])))
            u = i;
    }
    for (int i = 0; i < RMS_KEPT; i++)
        if (i != u && b[i])
            keep(b[i]);
    if (u >= 0)
        return b[u] + RMS_PAGE;
    void *p;
    if (bytes > SIZE_MAX - RMS_PAGE || posix_memalign(&p, RMS_PAGE, bytes + RMS_PAGE))
        return NULL;
    BLOCK_SIZE(p) = bytes;
    return (char *)p + RMS_PAGE;
}

static void scratch_put(void *q) {
    if (!q)
        return;
    char *b = (char *)q - RMS_PAGE;
    if (BLOCK_SIZE(b) > RMS_KEEP_MAX)
        free(b);
    else
        keep(b);
}

static char *scratch_rows(size_t n, size_t bytes) {
    return n ? scratch_get(n * row_pitch(bytes)) : NULL;
}

/* A 16-bit weight of x's dtype (offset 0) goes to the kernels as it is (RMS_W_STORAGE) for
 * fewer than this many rows, which would not pay back its widening, or forward rows of
 * RMS_W_AS_IS_K or more, whose float32 row would crowd L1 beside the rows. The backward (bwd)
 * widens longer rows too: its float32 dgamma row is there beside them anyway, and a weight read
 * as it is costs a widening per element per row (benchmarks/NOTES.md). */
#define RMS_W_AS_IS_ROWS 8
#define RMS_W_AS_IS_K 8192

/* The weights as the kernels read them: *out, with RMS_W_STORAGE in *flags where they are x's
 * 16-bit type, else the compute type with the offset added; *own is a row for scratch_put, or NULL.
 * Returns -1 when it cannot be allocated. */
static int kernel_weights(const rms_isa_table *isa, int dtype, const void *w, int w_dtype,
                          double offset, size_t m, size_t k, int nthreads, int bwd,
                          const void **out, void **own, int *flags) {
    *own = NULL;
    *out = w;
    if (!w || (w_dtype == compute_dtype(dtype) && offset == 0.0))
        return 0;
    if (w_dtype == dtype && offset == 0.0 &&
        (m < RMS_W_AS_IS_ROWS || (!bwd && k >= RMS_W_AS_IS_K))) {
        *flags |= RMS_W_STORAGE;
        return 0;
    }
    if (!(*own = scratch_get(k * csize(dtype) + 64)))
        return -1;
    rms_convert(&isa->k[w_dtype], w_dtype, w, *own, offset, k, 1, nthreads);
    *out = *own;
    return 0;
}

/* Bytes of one weight as the kernels read it. */
static size_t wbytes(int dtype, int flags) {
    return flags & RMS_W_STORAGE ? rms_esize(dtype) : csize(dtype);
}

/* ---------------------------------------------------------------- the element split */

/* Member t's share of the flattened m*k elements: full rows [r0, r1) and up to two partial
 * rows (p[0]: the end of the row before r0, p[1]: the start of row r1). */
typedef struct {
    size_t row, c0, c1; /* c0 a multiple of RMS_CHUNK */
    double *parts;      /* the sums of the piece's chunks (the kernels' sumsq and dot) */
} piece;

typedef struct {
    size_t r0, r1;
    piece p[2];
} share;

/* Element offset b of the flattened rows moved up to the next chunk bound of its row (or the
 * row's end): members that share a row then meet where a one-thread sum's chunks meet. */
static size_t chunk_bound(size_t b, size_t k) {
    size_t row = b / k, col = b % k;
    col = (col + RMS_CHUNK - 1) / RMS_CHUNK * RMS_CHUNK;
    return row * k + (col < k ? col : k);
}

static size_t nchunks(size_t n) { return (n + RMS_CHUNK - 1) / RMS_CHUNK; }

static share split(size_t m, size_t k, int t, int nt, int by_rows) {
    share s = {0, 0, {{RMS_NONE, 0, 0, NULL}, {RMS_NONE, 0, 0, NULL}}};
    size_t e0, e1, total = m * k;
    if (by_rows) {
        chunk(m, t, nt, 1, &s.r0, &s.r1);
        return s;
    }
    chunk(total, t, nt, total >= (size_t)nt * 256 ? 16 : 1, &e0, &e1);
    e0 = chunk_bound(e0, k), e1 = chunk_bound(e1, k);
    if (e0 >= e1)
        return s;
    size_t row = e0 / k, col = e0 % k;
    if (col) {
        size_t end = e1 - row * k < k ? e1 - row * k : k;
        s.p[0] = (piece){row, col, end, NULL};
        e0 = row * k + end;
        row++;
    }
    s.r0 = s.r1 = row;
    if (e0 < e1) {
        s.r1 = e1 / k;
        if (e1 % k)
            s.p[1] = (piece){s.r1, 0, e1 % k, NULL};
    }
    return s;
}

/* Whole rows when they spread evenly, else the flattened split. */
static int split_by_rows(size_t m, int nt) { return m % (size_t)nt == 0 || m >= 16 * (size_t)nt; }

/* The sum of `row`: its pieces' chunk sums left to right (member order is column order), as
 * the kernels add a whole row's. */
static double row_sum(const share *sh, int nt, size_t row) {
    double s = 0.0;
    for (int t = 0; t < nt; t++)
        for (int j = 0; j < 2; j++)
            if (sh[t].p[j].row == row)
                for (size_t q = 0; q < nchunks(sh[t].p[j].c1 - sh[t].p[j].c0); q++)
                    s += sh[t].p[j].parts[q];
    return s;
}

static double load_c(const void *arr, size_t i, int f64) {
    return f64 ? ((const double *)arr)[i] : (double)((const float *)arr)[i];
}

static void store_c(void *arr, size_t i, double v, int f64) {
    if (f64)
        ((double *)arr)[i] = v;
    else
        ((float *)arr)[i] = (float)v;
}

/* ---------------------------------------------------------------- forward */

typedef struct {
    const rms_kernels *kt;
    const rms_fwd_args *a;
    const void *w;
    int flags, by_rows;
    double *parts; /* [2 x members x chunks of a row]: the pieces' chunk sums */
    char *stage;   /* the streamed add's buf for each member (NULL: none), pitch bytes apart */
    size_t pitch;
    share sh[];    /* one a member */
} fwd_job;

/* The second phase (rescue) only where a shared row's sum of squares is unusable. */
static int fwd_skip(const void *job, int nt, int phase) {
    const fwd_job *j = job;
    if (phase != 1)
        return 0;
    for (int t = 0; t < nt; t++)
        for (int i = 0; i < 2; i++) {
            const piece *p = &j->sh[t].p[i];
            if (p->row != RMS_NONE && p->c0 == 0 &&
                !rms_sumsq_ok(row_sum(j->sh, nt, p->row), j->a->dtype == RMS_F64))
                return 0;
        }
    return 1;
}

/* Phase 0: the pieces' sums (the add stages h = round(x + r) of its pieces), and the whole
 * rows. Phase 1: the first sharer of an unusable row rescues it from the whole row, before
 * anyone writes over it (out=x). Phase 2: the pieces scaled by their row's rstd. */
static void fwd_phase(void *job, int t, int nt, int phase) {
    fwd_job *j = job;
    const rms_fwd_args *a = j->a;
    const rms_kernels *kt = j->kt;
    size_t es = rms_esize(a->dtype), cs = csize(a->dtype), k = a->k;
    int f64 = a->dtype == RMS_F64;
    const void *src = a->r ? a->h : a->x; /* a piece's second pass reads h (staged) or x */
    ptrdiff_t ss = a->r ? a->hs : a->xs;
    if (phase == 0) {
        share s = split(a->m, k, t, nt, j->by_rows);
        for (int i = 0; i < 2; i++) {
            piece *p = &s.p[i];
            if (p->row == RMS_NONE)
                continue;
            p->parts = j->parts + (2 * (size_t)t + (size_t)i) * nchunks(k);
            kt->sumsq(AT(a->x, p->row, a->xs, p->c0, es),
                      a->r ? AT(a->r, p->row, a->rs, p->c0, es) : NULL,
                      a->r ? AT(a->h, p->row, a->hs, p->c0, es) : NULL, p->c1 - p->c0, p->parts);
        }
        j->sh[t] = s;
        if (s.r1 > s.r0)
            kt->fwd(AT(a->x, s.r0, a->xs, 0, es), a->xs,
                    a->r ? AT(a->r, s.r0, a->rs, 0, es) : NULL, a->rs,
                    a->r ? AT(a->h, s.r0, a->hs, 0, es) : NULL, a->hs,
                    AT(a->y, s.r0, a->ys, 0, es), a->ys, j->w, (char *)a->rstd + s.r0 * cs,
                    s.r1 - s.r0, k, a->eps, j->flags,
                    j->stage ? j->stage + (size_t)t * j->pitch : NULL);
        return;
    }
    for (int i = 0; i < 2; i++) {
        const piece *p = &j->sh[t].p[i];
        if (p->row == RMS_NONE)
            continue;
        double sum = row_sum(j->sh, nt, p->row);
        if (phase == 1) {
            if (p->c0 == 0 && !rms_sumsq_ok(sum, f64))
                store_c(a->rstd, p->row,
                        kt->rescue(AT(src, p->row, ss, 0, es), NULL, k, a->eps), f64);
            continue;
        }
        double r = rms_sumsq_ok(sum, f64) ? rms_rstd(sum, k, a->eps) : load_c(a->rstd, p->row, f64);
        r = f64 ? r : (double)(float)r;
        if (p->c0 == 0)
            store_c(a->rstd, p->row, r, f64);
        kt->scale(AT(src, p->row, ss, p->c0, es), AT(a->y, p->row, a->ys, p->c0, es),
                  j->w ? (const char *)j->w + p->c0 * wbytes(a->dtype, j->flags) : NULL, r,
                  p->c1 - p->c0, j->flags);
    }
}

int rms_forward(const rms_isa_table *isa, const rms_fwd_args *a, int nthreads,
                const rms_pool *pool) {
    size_t total = a->m * a->k, es = rms_esize(a->dtype);
    if (total == 0) {
        __atomic_store_n(&last_team, 1, __ATOMIC_RELAXED);
        return 0;
    }
    int nt = team_size(total, nthreads, pool, total);
    /* OpenMP may give fewer members than asked, never more */
    fwd_job *j = malloc(sizeof *j + (size_t)nt * sizeof(share));
    void *own_w;
    int flags = (a->flags & RMS_CAST_BEFORE) |
                (total * es * (a->r ? 2 : 1) >= rms_stream_bytes(NULL) ? RMS_STREAM : 0);
    if (!j || kernel_weights(isa, a->dtype, a->w, a->w_dtype, a->w_offset, a->m, a->k, nthreads,
                             0, &j->w, &own_w, &flags) < 0) {
        free(j);
        return -1;
    }
    j->kt = &isa->k[a->dtype];
    j->a = a;
    j->flags = flags;
    j->by_rows = nt == 1 || split_by_rows(a->m, nt);
    j->parts = j->by_rows ? NULL : malloc(2 * (size_t)nt * nchunks(a->k) * sizeof(double));
    const int staging = a->r && (flags & RMS_STREAM);
    j->pitch = row_pitch(RMS_FWD_BUF(a->k, es));
    j->stage = staging ? scratch_rows((size_t)nt, RMS_FWD_BUF(a->k, es)) : NULL;
    int rc = (j->by_rows || j->parts) && (j->stage || !staging) ? 0 : -1;
    if (rc == 0)
        run_team(nt, j->by_rows ? 1 : 3, fwd_phase, fwd_skip, j, pool);
    free(j->parts);
    scratch_put(j->stage);
    scratch_put(own_w);
    free(j);
    return rc;
}

/* ---------------------------------------------------------------- backward without dgamma */

typedef struct {
    const rms_kernels *kt;
    const rms_bwd_args *a;
    const void *w;
    int flags, by_rows;
    double *parts; /* [2 x members x chunks of a row]: the pieces' chunk sums */
    share sh[];    /* one a member */
} bwd_job;

/* Phase 0: the pieces' dot products, and the whole rows. Phase 1: the pieces' dx. */
static void bwd_phase(void *job, int t, int nt, int phase) {
    bwd_job *j = job;
    const rms_bwd_args *a = j->a;
    const rms_kernels *kt = j->kt;
    size_t es = rms_esize(a->dtype), cs = csize(a->dtype), k = a->k;
    int f64 = a->dtype == RMS_F64;
    if (phase == 0) {
        share s = split(a->m, k, t, nt, j->by_rows);
        for (int i = 0; i < 2; i++) {
            piece *p = &s.p[i];
            if (p->row == RMS_NONE)
                continue;
            p->parts = j->parts + (2 * (size_t)t + (size_t)i) * nchunks(k);
            kt->dot(AT(a->dy, p->row, a->dys, p->c0, es), AT(a->x, p->row, a->xs, p->c0, es),
                    j->w ? (const char *)j->w + p->c0 * wbytes(a->dtype, j->flags) : NULL,
                    load_c(a->rstd, p->row, f64), p->c1 - p->c0, j->flags, p->parts);
        }
        j->sh[t] = s;
        if (s.r1 > s.r0)
            kt->bwd(AT(a->dy, s.r0, a->dys, 0, es), a->dys, AT(a->x, s.r0, a->xs, 0, es), a->xs,
                    AT(a->dx, s.r0, a->dxs, 0, es), a->dxs, j->w,
                    (const char *)a->rstd + s.r0 * cs, NULL, s.r1 - s.r0, k, j->flags);
        return;
    }
    for (int i = 0; i < 2; i++) {
        const piece *p = &j->sh[t].p[i];
        if (p->row == RMS_NONE)
            continue;
        double r = load_c(a->rstd, p->row, f64);
        double c = rms_bwd_c(row_sum(j->sh, nt, p->row), k);
        kt->bwd_piece(AT(a->dy, p->row, a->dys, p->c0, es), AT(a->x, p->row, a->xs, p->c0, es),
                      j->w ? (const char *)j->w + p->c0 * wbytes(a->dtype, j->flags) : NULL,
                      AT(a->dx, p->row, a->dxs, p->c0, es), r, f64 ? c : (double)(float)c, NULL,
                      p->c1 - p->c0, j->flags);
    }
}

/* ---------------------------------------------------------------- backward with dgamma
 * The rows are cut into P leaves (a power of two that depends on m alone), and dgamma is the
 * sum of the leaves' partial rows along the binary tree over them: node (l, i), stored at
 * index (P >> l) + i, covers leaves [i << l, (i + 1) << l). With as many members as leaves or
 * fewer, a member takes a run of whole leaves and adds up the nodes that lie inside its run as
 * it goes (a binary counter); with more, each leaf's columns are split among its members. A
 * last phase adds up the remaining nodes, the members splitting the columns. Either way every
 * column of every leaf gains its rows' terms in row order, and the leaves meet in the same
 * tree, so the bits do not depend on the team. */
#ifndef RMS_LEAVES_MAX
#define RMS_LEAVES_MAX 64
#endif
#define RMS_LEAF_ROWS 16 /* the fewest rows a leaf has where there are several */
#define RMS_STACK (2 * 6 + 2) /* a member's nodes at once: 2 log2(RMS_LEAVES_MAX) + 2 */

static size_t leaves_for(size_t m) {
    size_t p = 1;
    while (p * 2 <= RMS_LEAVES_MAX && p * 2 * RMS_LEAF_ROWS <= m)
        p *= 2;
    return p;
}

typedef struct {
    const rms_kernels *kt;
    const rms_isa_table *isa;
    const rms_bwd_args *a;
    const void *w;
    int flags;
    size_t leaves, pitch, dots_n, stack;
    char *rows;      /* members' rows: `stack` each (whole leaves), or one a leaf */
    char **node;     /* [2 * leaves]: each finished node's row, or NULL */
    double *dots;    /* [leaves x dots_n x chunks of a row]: split leaves' chunk sums */
    char *dg;        /* one leaf summed straight into a->dgamma (compute type, or one row's
                      * RMS_DG_NARROW): that row; else NULL */
} dg_job;

static void rows_add(void *dst, const void *src, size_t c0, size_t c1, int f64) {
    if (f64) {
        double *d = dst;
        const double *s = src;
        for (size_t c = c0; c < c1; c++)
            d[c] += s[c];
    } else {
        float *d = dst;
        const float *s = src;
        for (size_t c = c0; c < c1; c++)
            d[c] += s[c];
    }
}

/* The leaves' rows [*r0, *r1), and a leaf's members [*t0, *t1) when there are more members. */
static void leaf_rows(const dg_job *j, size_t leaf, size_t *r0, size_t *r1) {
    chunk(j->a->m, (int)leaf, (int)j->leaves, 1, r0, r1);
}

static void leaf_members(const dg_job *j, size_t leaf, int nt, int *t0, int *t1) {
    *t0 = (int)((size_t)nt * leaf / j->leaves);
    *t1 = (int)((size_t)nt * (leaf + 1) / j->leaves);
}

/* Member t's whole leaves, each into a row of its own, adding up sibling nodes as they finish. */
static void dg_leaves(dg_job *j, int t, int nt) {
    const rms_bwd_args *a = j->a;
    size_t es = rms_esize(a->dtype), cs = csize(a->dtype), lo, hi;
    int f64 = a->dtype == RMS_F64;
    char *free_rows[RMS_STACK];
    int nfree = 0, depth = 0;
    struct {
        size_t id; /* the heap index of the node */
        char *row;
    } stack[RMS_STACK];
    for (int i = (int)j->stack - 1; i >= 0 && !j->dg; i--) /* j->dg: no rows of ours */
        free_rows[nfree++] = j->rows + ((size_t)t * j->stack + (size_t)i) * j->pitch;
    chunk(j->leaves, t, nt, 1, &lo, &hi);
    for (size_t leaf = lo; leaf < hi; leaf++) {
        size_t r0, r1;
        leaf_rows(j, leaf, &r0, &r1);
        char *row = j->dg ? j->dg : free_rows[--nfree];
        j->kt->bwd(AT(a->dy, r0, a->dys, 0, es), a->dys, AT(a->x, r0, a->xs, 0, es), a->xs,
                   AT(a->dx, r0, a->dxs, 0, es), a->dxs, j->w, (const char *)a->rstd + r0 * cs,
                   row, r1 - r0, a->k, j->flags | RMS_DG_STORE);
        size_t id = j->leaves + leaf;
        /* a right child whose left sibling is below it on the stack: the two make their parent */
        while (depth > 0 && (id & 1) && stack[depth - 1].id == id - 1) {
            char *left = stack[--depth].row;
            rows_add(left, row, 0, a->k, f64);
            free_rows[nfree++] = row;
            row = left;
            id >>= 1;
        }
        stack[depth].id = id;
        stack[depth++].row = row;
    }
    for (int i = 0; i < depth; i++)
        j->node[stack[i].id] = stack[i].row;
}

/* A leaf split among members [t0, t1): phase 0 their dot products over their columns, phase 1
 * their columns of dx and of the leaf's dgamma row. */
static void dg_split_leaf(dg_job *j, size_t leaf, int t, int t0, int t1, int phase) {
    const rms_bwd_args *a = j->a;
    size_t es = rms_esize(a->dtype), cs = csize(a->dtype), r0, r1, c0, c1;
    int f64 = a->dtype == RMS_F64;
    leaf_rows(j, leaf, &r0, &r1);
    chunk(a->k, t - t0, t1 - t0, RMS_CHUNK, &c0, &c1);
    char *row = j->dg ? j->dg : j->rows + leaf * j->pitch;
    const char *w = j->w ? (const char *)j->w + c0 * wbytes(a->dtype, j->flags) : NULL;
    size_t nch = nchunks(a->k);
    for (size_t i = r0; i < r1; i++) {
        double *parts = j->dots + (leaf * j->dots_n + i - r0) * nch; /* members side by side */
        if (phase == 0) {
            if (c1 > c0)
                j->kt->dot(AT(a->dy, i, a->dys, c0, es), AT(a->x, i, a->xs, c0, es), w,
                           load_c(a->rstd, i, f64), c1 - c0, j->flags, parts + c0 / RMS_CHUNK);
            continue;
        }
        double s = 0.0, r = load_c(a->rstd, i, f64);
        for (size_t q = 0; q < nch; q++) /* left to right, as one thread's sum */
            s += parts[q];
        double c = rms_bwd_c(s, a->k);
        if (c1 > c0)
            j->kt->bwd_piece(AT(a->dy, i, a->dys, c0, es), AT(a->x, i, a->xs, c0, es), w,
                             AT(a->dx, i, a->dxs, c0, es), r, f64 ? c : (double)(float)c,
                             row + c0 * (j->flags & RMS_DG_NARROW ? es : cs), c1 - c0,
                             j->flags | (i == r0 ? RMS_DG_STORE : 0));
    }
    if (phase == 1 && t == t0)
        j->node[j->leaves + leaf] = row;
}

/* The node's sum over columns [c0, c1), in the row of its leftmost stored descendant. */
static char *dg_eval(const dg_job *j, size_t id, size_t c0, size_t c1, int f64) {
    if (j->node[id])
        return j->node[id];
    char *left = dg_eval(j, 2 * id, c0, c1, f64);
    rows_add(left, dg_eval(j, 2 * id + 1, c0, c1, f64), c0, c1, f64);
    return left;
}

static void dg_phase(void *job, int t, int nt, int phase) {
    dg_job *j = job;
    const rms_bwd_args *a = j->a;
    if (phase < 2 && (size_t)nt <= j->leaves) {
        if (phase == 0)
            dg_leaves(j, t, nt);
        return;
    }
    if (phase < 2) {
        for (size_t leaf = 0; leaf < j->leaves; leaf++) {
            int t0, t1;
            leaf_members(j, leaf, nt, &t0, &t1);
            if (t >= t0 && t < t1)
                dg_split_leaf(j, leaf, t, t0, t1, phase);
        }
        return;
    }
    size_t cs = csize(a->dtype), c0, c1;
    int f64 = a->dtype == RMS_F64;
    chunk(a->k, t, nt, a->k >= (size_t)nt * 64 ? 16 : 1, &c0, &c1);
    if (c1 <= c0)
        return;
    const char *sum = dg_eval(j, 1, c0, c1, f64);
    if (sum == j->dg) /* the leaf's row was dgamma */
        return;
    if (a->dg_dtype == compute_dtype(a->dtype))
        memcpy((char *)a->dgamma + c0 * cs, sum + c0 * cs, (c1 - c0) * cs);
    else
        j->isa->k[a->dg_dtype].narrow(sum + c0 * cs,
                                      (char *)a->dgamma + c0 * rms_esize(a->dg_dtype), c1 - c0);
}

/* Phase 1 serves only leaves split among members. */
static int dg_skip(const void *job, int nt, int phase) {
    const dg_job *j = job;
    return phase == 1 && (size_t)nt <= j->leaves;
}

static int bwd_dgamma(const rms_isa_table *isa, const rms_bwd_args *a, const void *w, int flags,
                      int nthreads, const rms_pool *pool) {
    size_t total = a->m * a->k, cs = csize(a->dtype);
    size_t leaves = leaves_for(a->m);
    /* a few rows split their columns: 32 or more a member */
    int nt = team_size(total, nthreads, pool, a->m <= 16 ? (a->k >= 64 ? a->k / 32 : 1) : total);
    /* a member's nodes at once: at most one more than its leaves, and RMS_STACK */
    size_t stack = (leaves + (size_t)nt - 1) / (size_t)nt + 1;
    dg_job j = {&isa->k[a->dtype], isa, a, w, flags, leaves, row_pitch(a->k * cs), 0,
                stack < RMS_STACK ? stack : RMS_STACK, NULL, NULL, NULL, NULL};
    /* one leaf (fewer than 2 * RMS_LEAF_ROWS rows) sums straight into dgamma where it is in
     * the compute type, and one row of a 16-bit type rounds its terms into dgamma of that type
     * (RMS_DG_NARROW): no row of ours to copy out or round, which for one long row costs as much
     * as its dx (benchmarks/NOTES.md) */
    int narrow = a->m == 1 && a->dg_dtype == a->dtype && cs > rms_esize(a->dtype);
    if (leaves == 1 && (narrow || a->dg_dtype == compute_dtype(a->dtype)))
        j.dg = a->dgamma;
    if (narrow)
        j.flags |= RMS_DG_NARROW;
    size_t nrows = j.dg ? 0 : (size_t)nt <= leaves ? (size_t)nt * j.stack : leaves;
    j.dots_n = (size_t)nt > leaves ? (a->m + leaves - 1) / leaves : 0;
    j.rows = scratch_rows(nrows, a->k * cs);
    j.node = calloc(2 * leaves, sizeof *j.node);
    j.dots = j.dots_n ? malloc(leaves * j.dots_n * nchunks(a->k) * sizeof(double)) : NULL;
    int rc = -1;
    if ((j.rows || !nrows) && j.node && (j.dots || !j.dots_n)) {
        run_team(nt, 3, dg_phase, dg_skip, &j, pool);
        rc = 0;
    }
    scratch_put(j.rows);
    free(j.node);
    free(j.dots);
    return rc;
}

int rms_backward(const rms_isa_table *isa, const rms_bwd_args *a, int nthreads,
                 const rms_pool *pool) {
    size_t total = a->m * a->k, es = rms_esize(a->dtype);
    if (total == 0) {
        if (a->dgamma) /* no rows: dgamma is zeros */
            memset(a->dgamma, 0, a->k * rms_esize(a->dg_dtype));
        __atomic_store_n(&last_team, 1, __ATOMIC_RELAXED);
        return 0;
    }
    const void *w;
    void *own_w;
    int flags = total * es >= rms_stream_bytes(NULL) ? RMS_STREAM : 0, rc = 0;
    if (kernel_weights(isa, a->dtype, a->w, a->w_dtype, a->w_offset, a->m, a->k, nthreads, 1,
                       &w, &own_w, &flags) < 0)
        return -1;
    if (a->dgamma && a->w) {
        rc = bwd_dgamma(isa, a, w, flags, nthreads, pool);
    } else {
        int nt = team_size(total, nthreads, pool, total);
        bwd_job *j = malloc(sizeof *j + (size_t)nt * sizeof(share));
        if (j) {
            int by_rows = nt == 1 || split_by_rows(a->m, nt);
            *j = (bwd_job){&isa->k[a->dtype], a, w, flags, by_rows,
                           by_rows ? NULL : malloc(2 * (size_t)nt * nchunks(a->k) * sizeof(double))};
            if (by_rows || j->parts)
                run_team(nt, j->by_rows ? 1 : 2, bwd_phase, NULL, j, pool);
            else
                rc = -1;
            free(j->parts);
        }
        rc = j && rc == 0 ? 0 : -1;
        free(j);
    }
    scratch_put(own_w);
    return rc;
}

/* ---------------------------------------------------------------- weights and references */

/* Weight conversions: gamma is as long as a row, so for one long row it costs as much as the
 * row itself and is split across the team too. */
void rms_convert(const rms_kernels *kt, int dtype, const void *src, void *dst, double offset,
                 size_t n, int widen, int nthreads) {
    size_t es = rms_esize(dtype), cs = csize(dtype);
    size_t in = widen ? es : cs, out = widen ? cs : es;
    int nt = team_size(n, nthreads, NULL, n / 64 + 1);
    if (nt == 1) { /* no parallel region at all: even a serial one costs a microsecond */
        if (widen)
            kt->widen(src, dst, offset, n);
        else
            kt->narrow(src, dst, n);
        return;
    }
#pragma omp parallel num_threads(nt)
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

void rms_ref_copy(void *dst, const void *src, size_t bytes, int prefetch, int nthreads) {
    int nt = team_size(bytes / 4, nthreads, NULL, bytes / 4);
    int stream = bytes >= rms_stream_bytes(NULL);
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
    int nt = team_size(n, nthreads, NULL, n), stream = n * es >= rms_stream_bytes(NULL);
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
