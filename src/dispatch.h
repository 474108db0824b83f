/* CPU feature detection and the kernel family in use. */
#ifndef RMSNORM_DISPATCH_H
#define RMSNORM_DISPATCH_H

#include "kernels/kernels.h"

#define RMS_MAX_ISAS 5

/* Detects the CPU's features once; the current table starts as the best available one. */
void rms_dispatch_init(void);
/* The tables this CPU and build can run, best first, "scalar" last. Returns the count. */
int rms_isa_list(const rms_isa_table *out[RMS_MAX_ISAS]);
/* The best available table of the family `name` ("avx512", "avx2", "neon", "scalar"), else
 * NULL. A family may have variants (avx512 on CPUs with AVX512-BF16: "avx512bf16" first). */
const rms_isa_table *rms_isa_find(const char *name);
/* The available table whose own name is `name` (a family's variant too), else NULL. */
const rms_isa_table *rms_isa_find_variant(const char *name);
/* The public family name of a table. */
static inline const char *rms_isa_family(const rms_isa_table *t) {
    return t->family ? t->family : t->name;
}
/* The table in use. Reads and writes are atomic, so calls in flight keep the table they read. */
const rms_isa_table *rms_isa_current(void);
void rms_isa_select(const rms_isa_table *t);

#endif
