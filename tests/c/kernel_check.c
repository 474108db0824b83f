/* Checks every SIMD kernel family this build has against a float64 reference written here (and
 * against the scalar family), in pure C with no Python: the way the NEON kernels are tested on
 * x86 machines, cross-compiled and run under qemu (tests/c/run_neon.sh). A family the CPU cannot
 * run is skipped with a line saying so. Prints "N passed, M failed" and exits non-zero on a
 * failure.
 *
 * Tolerances: against the float64 reference, y and dx within 2 units in the last place of the
 * storage type plus float32 (float64: 1e-13) noise of the row's largest |value|; rstd within 4
 * float32 ulps (float64: 16 + k / 256, two sums of k squares in different orders); dgamma within float32 summation error. Against the scalar family, h =
 * round(x + r) must match bit for bit, and 16-bit outputs within one unit in the last place. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "kernels/convert.h"

static int passed, failed;
/* The least "largest |value|" that check's noise is relative to: dx of a row of one element is a
 * difference of two equal terms, zero but for rounding, which is relative to |dy * w * rstd|. */
static double scale_floor;
static unsigned long long rng_state = 88172645463325252ull;

static double uniform(void) { /* xorshift64: deterministic test data */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static size_t esize(int dt) { return dt == RMS_F64 ? 8 : dt == RMS_F32 ? 4 : 2; }
static size_t csize(int dt) { return dt == RMS_F64 ? 8 : 4; }
static int ctype(int dt) { return dt == RMS_F64 ? RMS_F64 : RMS_F32; }

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

static double round_to(double v, int dt) {
    char b[8];
    put(b, 0, dt, v);
    return get(b, 0, dt);
}

static void fill(void *p, size_t n, int dt, double scale) {
    for (size_t i = 0; i < n; i++)
        put(p, i, dt, uniform() * scale);
}

/* One unit in the last place of v in dtype dt. */
static double ulp(double v, int dt) {
    double a = fmax(fabs(v), dt == RMS_F16 ? 6.1e-5 : 1.2e-38);
    int bits = dt == RMS_F16 ? 10 : dt == RMS_BF16 ? 7 : dt == RMS_F32 ? 23 : 52;
    return ldexp(1.0, ilogb(a) - bits);
}

/* got[i] against ref[i] (both dtype dt; ref as doubles when ref_f64) over n values: within
 * `ulps` units in the last place of dt plus `noise` times the largest |ref|, or bit for bit
 * when ulps < 0. */
static void check(const char *what, const char *isa, int dt, size_t k, const void *got,
                  const void *ref, int ref_f64, size_t n, double ulps, double noise) {
    double scale = scale_floor, worst = 0.0;
    for (size_t i = 0; i < n; i++)
        scale = fmax(scale, fabs(ref_f64 ? ((const double *)ref)[i] : get(ref, i, dt)));
    for (size_t i = 0; i < n; i++) {
        double a = get(got, i, dt), b = ref_f64 ? ((const double *)ref)[i] : get(ref, i, dt);
        if (isnan(a) && isnan(b))
            continue;
        double tol = ulps < 0 ? 0.0 : ulps * ulp(b, dt) + noise * scale;
        double err = fabs(a - b);
        if (!(err <= tol))
            worst = fmax(worst, tol > 0 ? err / tol : 1.0);
    }
    if (worst == 0.0) {
        passed++;
    } else {
        failed++;
        printf("FAIL %s %s dtype %d k %zu: worst error %.3g of the tolerance\n", what, isa, dt, k,
               worst);
    }
}

/* The float64 reference of the forward (r: the add, with h rounded to dt), backward and dgamma
 * of m rows of k (stride s) in dtype dt. */
static void reference(int dt, size_t m, size_t k, size_t s, const void *x, const void *r,
                      const void *dy, const double *w, int before, double *y, double *h,
                      double *rstd, double *dx, double *dg) {
    for (size_t j = 0; j < k; j++)
        dg[j] = 0.0;
    for (size_t i = 0; i < m; i++) {
        double ss = 0.0, dot = 0.0;
        for (size_t j = 0; j < k; j++) {
            double v = get(x, i * s + j, dt);
            if (r)
                v = round_to(v + get(r, i * s + j, dt), dt);
            h[i * s + j] = v;
            ss += v * v;
        }
        double rs = 1.0 / sqrt(ss / (double)k + 1e-6);
        rstd[i] = rs;
        for (size_t j = 0; j < k; j++) {
            double xh = h[i * s + j] * rs;
            y[i * s + j] = (before ? round_to(xh, dt) : xh) * w[j];
            dot += get(dy, i * s + j, dt) * w[j] * xh;
        }
        for (size_t j = 0; j < k; j++) {
            double xh = h[i * s + j] * rs, d = get(dy, i * s + j, dt);
            dx[i * s + j] = rs * (d * w[j] - xh * dot / (double)k);
            dg[j] += d * xh;
        }
    }
}

static void compare(const rms_isa_table *isa, int dt, size_t k) {
    const rms_kernels *kt = &isa->k[dt], *sc = &rms_isa_scalar.k[dt];
    size_t m = k <= 128 ? 19 : 3, s = k + 3, cs = csize(dt), es = esize(dt), n = m * s;
    char *x = calloc(n, es), *r = calloc(n, es), *dy = calloc(n, es), *y = calloc(n, es);
    char *h = calloc(n, es), *h2 = calloc(n, es), *rs = calloc(m, cs), *dg = calloc(k, cs);
    char *w = calloc(k, cs), *ws = calloc(k, es), *dx = calloc(n, es);
    double *wd = calloc(k, 8), *ry = calloc(n, 8), *rh = calloc(n, 8), *rr = calloc(m, 8);
    double *rdx = calloc(n, 8), *rdg = calloc(k, 8);
    /* fwd's staging buffer, as the driver gives it: 64-byte aligned, RMS_FWD_BUF bytes */
    size_t bufsize = (RMS_FWD_BUF(k, es) + 63) / 64 * 64;
    void *buf = aligned_alloc(64, bufsize);
    fill(x, n, dt, 3.0);
    fill(r, n, dt, 1.0);
    fill(dy, n, dt, 1.0);
    fill(ws, k, dt, 1.0);
    kt->widen(ws, w, 0.0, k);
    for (size_t j = 0; j < k; j++)
        wd[j] = get(w, j, ctype(dt));
    const double noise = dt == RMS_F64 ? 1e-13 : 4e-6, ulps = dt == RMS_F64 ? 4 : 2;
    char name[64];
    /* forward and add: weight widened or read as it is, cast at the end or before the weight,
     * stored plainly or streamed (rows of stride k + 3 start at every alignment) */
    for (int f = 0; f < 16; f++) {
        int add = f & 1, flags = (f & 2 ? RMS_CAST_BEFORE : 0) | (f & 4 ? RMS_STREAM : 0) |
                                 (f & 8 ? RMS_W_STORAGE : 0);
        reference(dt, m, k, s, x, add ? r : NULL, dy, wd, f & 2, ry, rh, rr, rdx, rdg);
        kt->fwd(x, (ptrdiff_t)s, add ? r : NULL, (ptrdiff_t)s, h, (ptrdiff_t)s, y, (ptrdiff_t)s,
                f & 8 ? (const void *)ws : w, rs, m, k, 1e-6, flags, buf);
        snprintf(name, sizeof name, "%s flags %d", add ? "add" : "fwd", flags);
        check(name, isa->name, dt, k, y, ry, 1, n, ulps, noise);
        for (size_t i = 0; i < m; i++) /* rstd: float32 (float64) ulps */
            ((double *)rr)[i] = fabs(get(rs, i, ctype(dt)) - rr[i]) / ulp(rr[i], ctype(dt));
        double worst = 0.0;
        for (size_t i = 0; i < m; i++)
            worst = fmax(worst, rr[i]);
        if (worst <= (dt == RMS_F64 ? 16 + (double)k / 256 : 4)) /* float64: sums in another order */
            passed++;
        else
            failed++, printf("FAIL rstd %s %s dtype %d k %zu: %.3g ulps\n", name, isa->name, dt,
                             k, worst);
        if (add) { /* h exactly, and the scalar family's h */
            sc->fwd(x, (ptrdiff_t)s, r, (ptrdiff_t)s, h2, (ptrdiff_t)s, y, (ptrdiff_t)s, w, rs, m,
                    k, 1e-6, 0, NULL);
            check("add h", isa->name, dt, k, h, h2, 0, n, -1, 0);
        }
    }
    /* backward: dgamma accumulated, or its first row stored; weight widened or as it is */
    reference(dt, m, k, s, x, NULL, dy, wd, 0, ry, rh, rr, rdx, rdg);
    kt->fwd(x, (ptrdiff_t)s, NULL, 0, NULL, 0, y, (ptrdiff_t)s, w, rs, m, k, 1e-6, 0, NULL);
    for (int f = 0; f < 8; f++) {
        int flags = (f & 1 ? RMS_STREAM : 0) | (f & 2 ? RMS_DG_STORE : 0) |
                    (f & 4 ? RMS_W_STORAGE : 0);
        memset(dg, 0, k * cs);
        kt->bwd(dy, (ptrdiff_t)s, x, (ptrdiff_t)s, dx, (ptrdiff_t)s, f & 4 ? (const void *)ws : w,
                rs, dg, m, k, flags);
        snprintf(name, sizeof name, "bwd flags %d", flags);
        scale_floor = 1.0;
        check(name, isa->name, dt, k, dx, rdx, 1, n, ulps, noise);
        scale_floor = 0.0;
        /* float32 summation of m terms of at most |dy * xhat| (a few units) */
        check("bwd dgamma", isa->name, ctype(dt), k, dg, rdg, 1, k, 0, noise * (double)m);
    }
    /* the pieces of a row split across threads (row 0), against the reference */
    {
        reference(dt, 1, k, s, x, NULL, dy, wd, 0, ry, rh, rr, rdx, rdg);
        double ss = kt->sumsq(x, NULL, NULL, k, NULL), ss_ref = (1.0 / (rr[0] * rr[0]) - 1e-6) * k;
        int ok = fabs(ss - ss_ref) <= 1e-5 * ss_ref;
        kt->scale(x, y, w, 1.0 / sqrt(ss / (double)k + 1e-6), k, 0);
        check("scale", isa->name, dt, k, y, ry, 1, k, ulps, noise);
        double c = kt->dot(dy, x, w, rr[0], k, 0, NULL) / (double)k;
        kt->bwd_piece(dy, x, w, dx, rr[0], c, dg, k, RMS_DG_STORE);
        scale_floor = 1.0;
        check("bwd_piece", isa->name, dt, k, dx, rdx, 1, k, ulps, noise);
        scale_floor = 0.0;
        check("bwd_piece dgamma", isa->name, ctype(dt), k, dg, rdg, 1, k, 0, noise);
        reference(dt, 1, k, s, x, r, dy, wd, 0, ry, rh, rr, rdx, rdg);
        double sr = kt->sumsq(x, r, h2, k, NULL);
        ss_ref = (1.0 / (rr[0] * rr[0]) - 1e-6) * k;
        if (ok && fabs(sr - ss_ref) <= 1e-5 * ss_ref)
            passed++;
        else
            failed++, printf("FAIL sumsq %s dtype %d k %zu\n", isa->name, dt, k);
        sc->fwd(x, 0, r, 0, h, 0, y, 0, NULL, rs, 1, k, 1e-6, 0, NULL);
        check("sumsq h", isa->name, dt, k, h2, h, 0, k, -1, 0);
    }
    /* narrow(widen(w)) is w */
    kt->narrow(w, h, k);
    check("widen + narrow", isa->name, dt, k, h, ws, 0, k, -1, 0);
    free(x), free(r), free(dy), free(y), free(h), free(h2), free(rs), free(dg), free(w);
    free(ws), free(dx), free(wd), free(ry), free(rh), free(rr), free(rdx), free(rdg), free(buf);
}

int main(void) {
    static const size_t tails[] = {1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31,
                                   33, 64, 100, 128, 1025, 4097, 32771};
    static const char *built[] = {
#if defined(RMSNORM_HAVE_AVX512BF16)
        "avx512bf16",
#endif
#if defined(RMSNORM_HAVE_AVX512)
        "avx512",
#endif
#if defined(RMSNORM_HAVE_AVX2)
        "avx2",
#endif
#if defined(RMSNORM_HAVE_NEON)
        "neon",
#endif
        "scalar"};
    rms_dispatch_init();
    for (size_t b = 0; b < sizeof built / sizeof built[0]; b++) {
        const rms_isa_table *isa = rms_isa_find_variant(built[b]);
        if (!isa) {
            printf("skipping %s: this CPU cannot run it\n", built[b]);
            continue;
        }
        printf("checking %s against the float64 reference%s\n", isa->name,
               isa == &rms_isa_scalar ? "" : " and the scalar kernels");
        for (int dt = 0; dt < RMS_NDTYPES; dt++)
            for (size_t t = 0; t < sizeof(tails) / sizeof(tails[0]); t++)
                compare(isa, dt, tails[t]);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
