/* CPU feature detection and the kernel family in use. */
#ifndef RMSNORM_DISPATCH_H
#define RMSNORM_DISPATCH_H

#include "kernels/kernels.h"

#define RMS_MAX_ISAS 5

/* Detects the CPU's features once; the current table starts as the best available one. */
void rms_dispatch_init(void);
/* The tables this CPU and build can run, best first, "scalar" last. Returns the count. */
int rms_isa_list(const rms_isa_table *out[RMS_MAX_ISAS]);
/* The table named `name` if it is available here, else NULL. */
const rms_isa_table *rms_isa_find(const char *name);
/* The table in use. Reads and writes are atomic, so calls in flight keep the table they read. */
const rms_isa_table *rms_isa_current(void);
void rms_isa_select(const rms_isa_table *t);

#endif
