/* Checks every ISA table this CPU (or emulator) runs against the scalar kernels, in pure C with
 * no Python: the way the NEON kernels are tested on x86 machines, cross-compiled and run under
 * qemu (tests/c/run_neon.sh). Prints "N passed, M failed" and exits non-zero on a failure.
 *
 * Tolerances: float64 1e-12 and float32 4e-6, relative to the largest |value| of the output
 * (row sums are accumulated in different orders); 16-bit outputs within one unit in the last
 * place of the format (an rstd that differs in its last float32 bit may flip one rounding);
 * h = round(x + r) is exact, so it must match bit for bit. */
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

static void compare(const rms_isa_table *isa, int dt, size_t k) {
    const rms_kernels *ref = &rms_isa_scalar.k[dt], *kt = &isa->k[dt];
    size_t m = 3, s = k + 3, es = esize(dt), cs = csize(dt);
    char *x = malloc(m * s * es), *r = malloc(m * s * es), *dy = malloc(m * s * es);
    char *w = malloc(k * cs), *out[2], *h[2], *rs[2], *dg[2];
    fill(x, m * s, dt, 3.0);
    fill(r, m * s, dt, 1.0);
    fill(dy, m * s, dt, 1.0);
    fill(w, k, dt == RMS_F64 ? RMS_F64 : RMS_F32, 1.0);
    for (int j = 0; j < 2; j++) {
        out[j] = calloc(m * s, es);
        h[j] = calloc(m * s, es);
        rs[j] = calloc(m, cs);
        dg[j] = calloc(k, cs);
    }
    for (int flags = 0; flags <= RMS_CAST_BEFORE; flags += RMS_CAST_BEFORE) {
        for (int j = 0; j < 2; j++)
            (j ? kt : ref)->fwd_rows(x, (ptrdiff_t)s, out[j], (ptrdiff_t)s, w, rs[j], m, k, 1e-6,
                                     flags);
        check("fwd y", isa->name, dt, k, out[1], out[0], m * s, 0, 0);
        check("fwd rstd", isa->name, dt, k, rs[1], rs[0], m, 1, 0);
        for (int j = 0; j < 2; j++)
            (j ? kt : ref)->add_rows(x, (ptrdiff_t)s, r, (ptrdiff_t)s, h[j], (ptrdiff_t)s, out[j],
                                     (ptrdiff_t)s, w, rs[j], m, k, 1e-6, flags);
        check("add h", isa->name, dt, k, h[1], h[0], m * s, 0, 1);
        check("add y", isa->name, dt, k, out[1], out[0], m * s, 0, 0);
    }
    for (int j = 0; j < 2; j++) {
        memset(dg[j], 0, k * cs);
        (j ? kt : ref)->bwd_rows(dy, (ptrdiff_t)s, x, (ptrdiff_t)s, out[j], (ptrdiff_t)s, w, rs[0],
                                 dg[j], m, k, 0);
    }
    check("bwd dx", isa->name, dt, k, out[1], out[0], m * s, 0, 0);
    check("bwd dgamma", isa->name, dt, k, dg[1], dg[0], k, 1, 0);
    for (int j = 0; j < 2; j++) {
        free(out[j]);
        free(h[j]);
        free(rs[j]);
        free(dg[j]);
    }
    free(x);
    free(r);
    free(dy);
    free(w);
}

int main(void) {
    static const size_t tails[] = {1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 33, 64, 100, 1025, 4097};
    const rms_isa_table *isas[RMS_MAX_ISAS];
    rms_dispatch_init();
    int n = rms_isa_list(isas);
    for (int i = 0; i < n; i++) {
        printf("checking %s against scalar\n", isas[i]->name);
        for (int dt = 0; dt < RMS_NDTYPES; dt++)
            for (size_t t = 0; t < sizeof(tails) / sizeof(tails[0]); t++)
                compare(isas[i], dt, tails[t]);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
