/* Coverage hooks for the fuzzer, preloaded ahead of the sanitizer runtimes. libasan and libubsan
 * define weak, empty versions of libFuzzer's hooks; preloaded first, they would take both the
 * extension's comparisons (gcc's -fsanitize-coverage=trace-cmp) and the counters atheris
 * registers for Python code, and the fuzzer would run blind. These forward each hook to
 * atheris' libFuzzer (core_with_libfuzzer, loaded later by Python) as a tail call, so that
 * libFuzzer still sees the caller's address. gcc also reports floating-point comparisons,
 * through hooks libFuzzer does not have: those are dropped. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdint.h>
#include <string.h>

typedef void (*hook)(uintptr_t, uintptr_t, uintptr_t);

static int find_core(struct dl_phdr_info *info, size_t size, void *out) {
    (void)size;
    if (info->dlpi_name && strstr(info->dlpi_name, "core_with_libfuzzer")) {
        *(void **)out = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
        return 1;
    }
    return 0;
}

static hook lookup(const char *name) {
    static void *core;
    if (!core)
        dl_iterate_phdr(find_core, &core);
    return core ? (hook)dlsym(core, name) : (hook)0;
}

#define FORWARD(name)                                                                          \
    void name(uintptr_t a, uintptr_t b, uintptr_t c);                                          \
    void name(uintptr_t a, uintptr_t b, uintptr_t c) {                                         \
        static hook f;                                                                         \
        if (!f && !(f = lookup(#name)))                                                        \
            return;                                                                            \
        f(a, b, c);                                                                            \
    }

FORWARD(__sanitizer_cov_8bit_counters_init)
FORWARD(__sanitizer_cov_bool_flag_init)
FORWARD(__sanitizer_cov_pcs_init)
FORWARD(__sanitizer_cov_trace_cmp1)
FORWARD(__sanitizer_cov_trace_cmp2)
FORWARD(__sanitizer_cov_trace_cmp4)
FORWARD(__sanitizer_cov_trace_cmp8)
FORWARD(__sanitizer_cov_trace_const_cmp1)
FORWARD(__sanitizer_cov_trace_const_cmp2)
FORWARD(__sanitizer_cov_trace_const_cmp4)
FORWARD(__sanitizer_cov_trace_const_cmp8)
FORWARD(__sanitizer_cov_trace_div4)
FORWARD(__sanitizer_cov_trace_div8)
FORWARD(__sanitizer_cov_trace_gep)
FORWARD(__sanitizer_cov_trace_pc_indir)
FORWARD(__sanitizer_cov_trace_switch)

void __sanitizer_cov_trace_cmpf(float a, float b);
void __sanitizer_cov_trace_cmpd(double a, double b);
void __sanitizer_cov_trace_cmpf(float a, float b) {
    (void)a;
    (void)b;
}
void __sanitizer_cov_trace_cmpd(double a, double b) {
    (void)a;
    (void)b;
}
