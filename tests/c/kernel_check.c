/* Checks every ISA table this CPU (or emulator) runs against the scalar kernels, in pure C with
 * no Python: the way the NEON kernels are tested on x86 machines, cross-compiled and run under
 * qemu (tests/c/run_neon.sh). Prints "N passed, M failed" and exits non-zero on a failure.
 *
 * Tolerances: float64 1e-12 and float32 4e-6, relative to the largest |value| of the output
 * (row sums are accumulated in different orders); 16-bit outputs within one unit in the last
 * place of the format (an rstd that differs in its last float32 bit may flip one rounding);
 * h = round(x + r) is exact, so it must match bit for bit. Every ISA, scalar included, must
 * also give the same bits with 16-bit weights read as they are as with the weights widened. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "kernels/convert.h"

static int passed, failed;
static unsigned long long rng_state = 88172645463325252ull;

static double uniform(void) { /* xorshift64: deterministic test data */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static size_t esize(int dt) { return dt == RMS_F64 ? 8 : dt == RMS_F32 ? 4 : 2; }
static size_t csize(int dt) { return dt == RMS_F64 ? 8 : 4; }

static double get(const void *p, size_t i, int dt) {
    switch (dt) {
    case RMS_F32: return ((const float *)p)[i];
    case RMS_F64: return ((const double *)p)[i];
    case RMS_F16: return rms_f16_to_f32(((const uint16_t *)p)[i]);
    default: return rms_bf16_to_f32(((const uint16_t *)p)[i]);
    }
}

static void put(void *p, size_t i, int dt, double v) {
    switch (dt) {
    case RMS_F32: ((float *)p)[i] = (float)v; break;
    case RMS_F64: ((double *)p)[i] = v; break;
    case RMS_F16: ((uint16_t *)p)[i] = rms_f32_to_f16((float)v); break;
    default: ((uint16_t *)p)[i] = rms_f32_to_bf16((float)v);
    }
}

static void fill(void *p, size_t n, int dt, double scale) {
    for (size_t i = 0; i < n; i++)
        put(p, i, dt, uniform() * scale);
}

/* Compare n values of dtype dt (compute type when ctype) against the reference. */
static void check(const char *what, const char *isa, int dt, size_t k, const void *got,
                  const void *ref, size_t n, int ctype, int exact) {
    int t = ctype ? (dt == RMS_F64 ? RMS_F64 : RMS_F32) : dt;
    double scale = 0.0, worst = 0.0;
    for (size_t i = 0; i < n; i++)
        scale = fmax(scale, fabs(get(ref, i, t)));
    for (size_t i = 0; i < n; i++) {
        double a = get(got, i, t), b = get(ref, i, t);
        double ulp = t == RMS_F16 ? ldexp(1.0, ilogb(fmax(fabs(b), 6.1e-5)) - 10)
                   : t == RMS_BF16 ? ldexp(1.0, ilogb(fmax(fabs(b), 1.2e-38)) - 7)
                                   : scale * (t == RMS_F64 ? 1e-12 : 4e-6);
        double err = fabs(a - b) / (exact ? 1.0 : ulp);
        if (exact ? a != b && !(isnan(a) && isnan(b)) : !(err <= 1.0001))
            worst = fmax(worst, exact ? 1.0 : err);
    }
    if (worst == 0.0) {
        passed++;
    } else {
        failed++;
        printf("FAIL %s %s dtype %d k %zu: worst error %.3g of the tolerance\n", what, isa, dt, k,
               worst);
    }
}

/* Inputs x, r, dy of n elements (random), and a pair of zeroed outputs of each kind: y (or dx),
 * h, rstd of m rows, dgamma of k, for the two sides of a comparison. */
typedef struct {
    char *x, *r, *dy, *out[2], *h[2], *rs[2], *dg[2];
} buffers;

static buffers make_buffers(int dt, size_t n, size_t m, size_t k) {
    size_t es = esize(dt), cs = csize(dt);
    buffers b = {malloc(n * es), malloc(n * es), malloc(n * es), {0}, {0}, {0}, {0}};
    fill(b.x, n, dt, 3.0);
    fill(b.r, n, dt, 1.0);
    fill(b.dy, n, dt, 1.0);
    for (int j = 0; j < 2; j++) {
        b.out[j] = calloc(n, es);
        b.h[j] = calloc(n, es);
        b.rs[j] = calloc(m, cs);
        b.dg[j] = calloc(k, cs);
    }
    return b;
}

static void free_buffers(buffers *b) {
    for (int j = 0; j < 2; j++) {
        free(b->out[j]);
        free(b->h[j]);
        free(b->rs[j]);
        free(b->dg[j]);
    }
    free(b->x);
    free(b->r);
    free(b->dy);
}

static void compare(const rms_isa_table *isa, int dt, size_t k) {
    const rms_kernels *ref = &rms_isa_scalar.k[dt], *kt = &isa->k[dt];
    /* short rows come 19 at a time: two full groups of 8, whose rstds the 16-bit loops take
     * together (V_RSTD8), and a partial group */
    size_t m = k <= 128 ? 19 : 3, s = k + 3, cs = csize(dt), n = m * s;
    buffers b = make_buffers(dt, n, m, k);
    char *w = malloc(k * cs);
    fill(w, k, dt == RMS_F64 ? RMS_F64 : RMS_F32, 1.0);
    /* every option that changes a loop: the cast before the weight, non-temporal stores (rows
     * of stride k + 3 start at every alignment, so the streaming heads are exercised too), the
     * prefetch left to the hardware, 16-bit rows fused across rows (streamed only), and rows of
     * the constant lengths through the general loop */
    const int opts = RMS_CAST_BEFORE | RMS_STREAM | RMS_HW_PREFETCH | RMS_FUSE_16 | RMS_ANY_K;
    for (int flags = 0; flags <= opts; flags++) {
        if ((flags & ~opts) || ((flags & RMS_FUSE_16) && !(flags & RMS_STREAM)))
            continue;
        for (int j = 0; j < 2; j++)
            (j ? kt : ref)->fwd_rows(b.x, (ptrdiff_t)s, b.out[j], (ptrdiff_t)s, w, b.rs[j], m, k,
                                     1e-6, flags);
        check("fwd y", isa->name, dt, k, b.out[1], b.out[0], n, 0, 0);
        check("fwd rstd", isa->name, dt, k, b.rs[1], b.rs[0], m, 1, 0);
        for (int j = 0; j < 2; j++)
            (j ? kt : ref)->add_rows(b.x, (ptrdiff_t)s, b.r, (ptrdiff_t)s, b.h[j], (ptrdiff_t)s,
                                     b.out[j], (ptrdiff_t)s, w, b.rs[j], m, k, 1e-6, flags);
        check("add h", isa->name, dt, k, b.h[1], b.h[0], n, 0, 1);
        check("add y", isa->name, dt, k, b.out[1], b.out[0], n, 0, 0);
    }
    /* the add storing h in its first pass (RMS_EARLY_H), against the scalar kernels without it */
    for (int f = 0; f < 4; f++) {
        int flags = RMS_STREAM | (f & 1 ? RMS_CAST_BEFORE : 0) | (f & 2 ? RMS_HW_PREFETCH : 0);
        for (int j = 0; j < 2; j++)
            (j ? kt : ref)->add_rows(b.x, (ptrdiff_t)s, b.r, (ptrdiff_t)s, b.h[j], (ptrdiff_t)s,
                                     b.out[j], (ptrdiff_t)s, w, b.rs[j], m, k, 1e-6,
                                     j ? flags | RMS_EARLY_H : flags);
        check("add h (h first)", isa->name, dt, k, b.h[1], b.h[0], n, 0, 1);
        check("add y (h first)", isa->name, dt, k, b.out[1], b.out[0], n, 0, 0);
        check("add rstd (h first)", isa->name, dt, k, b.rs[1], b.rs[0], m, 1, 0);
    }
    /* streaming or not, rows one at a time or paired, prefetch, 16-bit rows fused (streamed) */
    for (int f = 0; f < 16; f++) {
        int flags = (f & 1 ? RMS_STREAM : 0) | (f & 2 ? RMS_ROW_PAIRS : 0) |
                    (f & 4 ? RMS_HW_PREFETCH : 0) | (f & 8 ? RMS_FUSE_16 : 0);
        if ((f & 8) && !(f & 1))
            continue;
        for (int j = 0; j < 2; j++) {
            memset(b.dg[j], 0, k * cs);
            (j ? kt : ref)->bwd_rows(b.dy, (ptrdiff_t)s, b.x, (ptrdiff_t)s, b.out[j], (ptrdiff_t)s,
                                     w, b.rs[0], b.dg[j], m, k, flags);
        }
        check("bwd dx", isa->name, dt, k, b.out[1], b.out[0], n, 0, 0);
        check("bwd dgamma", isa->name, dt, k, b.dg[1], b.dg[0], k, 1, 0);
    }
    /* one row: dgamma stored, not accumulated; a 16-bit one also rounded to x's type as it is
     * stored (RMS_DG_NARROW), bit for bit the kernels' compute-type row narrowed */
    for (int f = 0; f < 2; f++) {
        int flags = RMS_DG_STORE | (f ? RMS_STREAM : 0);
        for (int j = 0; j < 2; j++)
            (j ? kt : ref)->bwd_rows(b.dy, 0, b.x, 0, b.out[j], 0, w, b.rs[0], b.dg[j], 1, k,
                                     flags);
        check("bwd one row dx", isa->name, dt, k, b.out[1], b.out[0], k, 0, 0);
        check("bwd one row dgamma", isa->name, dt, k, b.dg[1], b.dg[0], k, 1, 0);
        if (dt == RMS_F16 || dt == RMS_BF16) {
            kt->narrow(b.dg[1], b.h[0], k);
            kt->bwd_rows(b.dy, 0, b.x, 0, b.out[1], 0, w, b.rs[0], b.h[1], 1, k,
                         flags | RMS_DG_NARROW);
            check("bwd one row narrowed dgamma", isa->name, dt, k, b.h[1], b.h[0], k, 0, 1);
        }
    }
    free_buffers(&b);
    free(w);
}

/* 16-bit weights read in x's storage type (RMS_W_STORAGE) must give bit for bit what the same
 * kernels give with those weights widened first, -0 included: forward, add and backward. */
static void compare_storage_weights(const rms_isa_table *isa, int dt, size_t k) {
    const rms_kernels *kt = &isa->k[dt];
    unsigned long long saved = rng_state; /* leave compare()'s data as it was */
    size_t m = 3, s = k + 3, n = m * s;
    buffers b = make_buffers(dt, n, m, k);
    char *ws = malloc(k * esize(dt)), *wc = malloc(k * 4);
    fill(ws, k, dt, 1.0);
    put(ws, 0, dt, -0.0);
    kt->widen(ws, wc, 0.0, k);
    for (int j = 0; j < 2; j++) /* j = 0: widened; 1: as stored */
        kt->fwd_rows(b.x, (ptrdiff_t)s, b.out[j], (ptrdiff_t)s, j ? ws : wc, b.rs[j], m, k, 1e-6,
                     j ? RMS_W_STORAGE : 0);
    check("storage w fwd y", isa->name, dt, k, b.out[1], b.out[0], n, 0, 1);
    for (int j = 0; j < 2; j++)
        kt->add_rows(b.x, (ptrdiff_t)s, b.r, (ptrdiff_t)s, b.h[j], (ptrdiff_t)s, b.out[j],
                     (ptrdiff_t)s, j ? ws : wc, b.rs[j], m, k, 1e-6,
                     (j ? RMS_W_STORAGE : 0) | RMS_CAST_BEFORE);
    check("storage w add y", isa->name, dt, k, b.out[1], b.out[0], n, 0, 1);
    for (int f = 0; f < 2; f++) { /* rows one at a time, or streamed and fused across rows */
        int flags = f ? RMS_STREAM | RMS_FUSE_16 : 0;
        for (int j = 0; j < 2; j++) {
            memset(b.dg[j], 0, k * 4);
            kt->bwd_rows(b.dy, (ptrdiff_t)s, b.x, (ptrdiff_t)s, b.out[j], (ptrdiff_t)s,
                         j ? ws : wc, b.rs[0], b.dg[j], m, k, flags | (j ? RMS_W_STORAGE : 0));
        }
        check("storage w bwd dx", isa->name, dt, k, b.out[1], b.out[0], n, 0, 1);
        check("storage w bwd dgamma", isa->name, dt, k, b.dg[1], b.dg[0], k, 1, 1);
    }
    for (int j = 0; j < 2; j++) { /* the pieces of a row split across threads */
        const void *w = j ? ws : wc;
        int f = j ? RMS_W_STORAGE : 0;
        double d = kt->dot(b.dy, b.x, w, 0.5, k, f);
        kt->scale(b.x, b.out[j], w, 0.5, k, f);
        kt->bwd(b.dy, b.x, w, b.h[j], 0.5, d / (double)k, NULL, k, f);
    }
    check("storage w scale", isa->name, dt, k, b.out[1], b.out[0], k, 0, 1);
    check("storage w dot + bwd", isa->name, dt, k, b.h[1], b.h[0], k, 0, 1);
    free_buffers(&b);
    free(ws);
    free(wc);
    rng_state = saved;
}

int main(void) {
    static const size_t tails[] = {1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31,
                                   33, 64, 100, 128, 1025, 4097, 32771};
    const rms_isa_table *isas[RMS_MAX_ISAS];
    rms_dispatch_init();
    int n = rms_isa_list(isas);
    for (int i = 0; i < n; i++) {
        printf("checking %s against scalar\n", isas[i]->name);
        for (int dt = 0; dt < RMS_NDTYPES; dt++)
            for (size_t t = 0; t < sizeof(tails) / sizeof(tails[0]); t++) {
                compare(isas[i], dt, tails[t]);
                if (dt == RMS_F16 || dt == RMS_BF16)
                    compare_storage_weights(isas[i], dt, tails[t]);
            }
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
