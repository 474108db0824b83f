/* CPU feature detection and the ISA table in use. */
#ifndef RMSNORM_DISPATCH_H
#define RMSNORM_DISPATCH_H

#include "kernels/kernels.h"

#define RMS_MAX_ISAS 4

/* Detects the CPU once; the current table starts as the best available one. */
void rms_dispatch_init(void);
/* The tables this CPU and build can run, best first, "scalar" last. Returns the count. */
int rms_isa_list(const rms_isa_table *out[RMS_MAX_ISAS]);
/* The table named `name` if it is available here, else NULL. */
const rms_isa_table *rms_isa_find(const char *name);
/* The table in use. Reads and writes are atomic, so calls in flight keep the table they read. */
const rms_isa_table *rms_isa_current(void);
/* Whether the backward may pair rows of row_bytes (elements of es bytes) on this CPU, `aliased`
 * when consecutive rows share their offsets within 4 KiB pages (see rms_backward). Aliased rows
 * pair on Intel CPUs, where pairing measured faster, and on CPUs other than x86; on AMD CPUs
 * with AVX-512 from 32 KiB on Zen 4 and from 12 KiB on Zen 5 and later; never on other AMD CPUs.
 * On Intel CPUs, 32- and 64-bit rows of 32 to 128 KiB never pair, nor on AMD CPUs from Zen 5 on
 * those under 4 KiB: one at a time measured faster there (single_min in dispatch.c).
 * RMSNORM_PAIR_ROWS=1 / 0 pairs every row the kernels can / none. */
int rms_cpu_pairs(size_t row_bytes, size_t es, int aliased);
/* Whether the backward of a call run by nthreads threads prefetches its 32- and 64-bit rows 32 KiB
 * ahead rather than 64 (RMS_BWD_AHEAD_32): on AMD CPUs from Zen 5 on, at one thread only. There,
 * one thread, the two choices alternating in one process, page-aligned, new time over old (rows of
 * 12 and 16 KiB in pairs): float32 8192x3072 0.93, 8192x4096 0.94, 16384x4096 0.93-0.94, and with
 * dx 16 bytes past a page (np.empty_like) 0.92, 0.93 and 0.92; float64 8192x2048 0.96; rows of 4,
 * 8 and 32 KiB the same (65536x1024 1.00, 16384x2048 1.01, 4096x8192 1.00), and so in cache
 * (64x4096 1.00, 29x17389 1.00). At two threads it lost (8192x4096 1.02-1.05, 16384x4096 1.03;
 * 8192x3072 0.99, 4096x8192 0.99). No software prefetch at all gained less at one thread and lost
 * more at two (8192x4096 0.96 / 1.08, 4096x8192 1.00 / 1.04). RMSNORM_BWD_AHEAD_32=1 / 0 sets it
 * for every call / none. */
int rms_cpu_bwd_ahead_32(int nthreads);
/* The forward's prefetch flags for a call run by nthreads threads: RMS_FWD_NEAR (rows over 16 KiB
 * prefetched into L1, a row ahead, rather than into L2, 64 KiB ahead, and 32- and 64-bit rows of
 * 256 bytes to 4 KiB into L1, 16 KiB ahead, rather than left to the CPU's prefetcher: see
 * FN(fwd_near) in rows_impl.h) on AMD CPUs from Zen 5 on,
 * and with it RMS_FWD_AHEAD_32 (contiguous 32- and 64-bit rows over 32 KiB prefetched 32 KiB
 * ahead rather than a row) at one thread only. The driver asks for them only where the output
 * streams: in cache they cost time (float32 29x17389, one thread, 1.02 to 1.04 of it). There,
 * the two builds alternating in one process, page-aligned, new time over old, one / two threads:
 * float32 8192x6144 0.94-0.96 / 0.94-0.96, 4096x8192 0.96-1.00 / 0.91-0.93, 2048x16384
 * 0.95-0.96 / 0.94, 1024x32768 0.94-0.95 / 0.94-0.96, 256x65536 0.91-0.95 / 0.97-0.99; float64
 * 8192x4096 0.95-0.98 / 0.96-0.97; bfloat16 4096x12288 0.93 / 0.97, 1024x32768 1.01 / 0.93,
 * 256x65536 0.87 / 0.99; float16 1024x32768 0.95 / 0.87, 512x65536 0.81 / 0.87; rows of 16 KiB
 * unchanged (float32 16384x4096 1.00-1.01). 32 KiB ahead over a row, the same build with the
 * switch on and off: one thread, float32 1024x32768 0.91-0.93, 256x65536 0.88-0.90; two threads,
 * a loss (1024x32768 1.12, 256x65536 1.06-1.07). RMSNORM_FWD_NEAR=1 / 0 and RMSNORM_FWD_AHEAD_32=1
 * / 0 set them for every such call / none (FWD_AHEAD_32 only with FWD_NEAR on). */
int rms_cpu_fwd_flags(int nthreads);
/* Whether rows of row_bytes lean on the CPU's own prefetcher (RMS_HW_PREFETCH: short rows left to
 * it, longer ones prefetched on every second line into L2): on AMD CPUs with AVX-512, every row on
 * Zen 4 and rows under 4 KiB on Zen 5 and later, whatever kernel family runs on them.
 * RMSNORM_HW_PREFETCH=0 / 1 sets it for no row / every row. */
int rms_cpu_hw_prefetch(size_t row_bytes);
/* Whether 32- and 64-bit rows may be fused across rows (else RMS_NO_FUSE_32): not on AMD CPUs
 * with AVX-512 (Zen 4 and later), where rows in two passes measured faster. RMSNORM_FUSE_32=0 / 1
 * sets it. */
int rms_cpu_fuse_32(void);
/* The shortest 32- and 64-bit rows, in bytes, whose add stores h in its first pass (RMS_EARLY_H;
 * see early_h_bytes in driver.c): 32 KiB, and on AMD CPUs from Zen 5 on rows over 16 KiB. Rows of
 * 20 to 28 KiB, first left out, gained there: the 2-core Zen 5 VM, RMSNORM_EARLY_H_BYTES=16385
 * over 32768 in one process, each pair in both orders, 64 MiB of x, one / two threads: float32
 * rows of 20 KiB 0.97 / 0.94, 24 KiB 0.96 / 0.96, 28 KiB 0.92 / 0.93, outputs 16 bytes past a page
 * 0.94-0.98 / 0.93-0.94; float64 20 KiB 0.98 / 0.94, 24 KiB 0.96 / 0.94, 28 KiB 0.94 / 0.96;
 * rows of 16 KiB lost (1.04 / 1.00). A 16-core Intel Xeon measured them the other way, 1 / 4 /
 * 16 threads, 256 MiB of x: float32 20 KiB 1.00 / 1.03 / 1.03, 24 KiB 0.98 / 0.99 / 1.02, 28 KiB
 * 1.00 / 1.05 / 1.03; float64 24 KiB 1.00 / 0.99 / 1.01. RMSNORM_EARLY_H_BYTES sets the length
 * for every type. */
size_t rms_cpu_early_h_bytes(void);
/* The shortest 16-bit rows, in elements, that read a 16-bit weight of x's dtype as it is however
 * many rows there are in the forward (backward = 0) or the backward (1) (see make_weights in
 * module.c): the kernel family's storage_weight_k (0 for never), or on AMD CPUs from Zen 5 on
 * rows over 4096 elements where the family reads it as it is at all, or in the backward on Zen 4
 * none (see dispatch.c). */
size_t rms_cpu_storage_weight_k(int backward);
/* Whether the forward (backward = 0) or the backward (1) on nthreads threads fuses 16-bit rows of
 * row_bytes across rows as it does 32- and 64-bit ones (RMS_FUSE_16; the kernels fuse none under
 * 512 bytes). On AMD CPUs both passes fuse, where it measured faster (Zen 3, AVX2; Zen 4; Zen 5),
 * except, with AVX-512 (Zen 4 and Zen 5), the forward's rows under 1 KiB and of 64 KiB or more,
 * on Zen 4 the backward's rows under 1 KiB, and on Zen 5 the forward on more than one thread. On
 * other x86 CPUs the forward does not (an Intel Xeon measured it slower) and the backward fuses
 * rows of the kernel family's fuse_bwd_16 bytes or more (see dispatch.c).
 * RMSNORM_FUSE_16=1 / 0 fuses every row / none. */
int rms_cpu_fuse_16(int backward, size_t row_bytes, int nthreads);
/* Whether outputs of es-byte elements in rows of row_bytes that do not start on cache lines
 * stream as rows on lines do (the kernels stream their partial lines in pieces: RMS_NT_EDGES;
 * 16-bit rows only where they start and end on 4 bytes), where it measured faster (see
 * streamable in driver.c): every row on Intel CPUs; on AMD CPUs from Zen 5 on, 32- and 64-bit
 * rows of 256 bytes or more and 16-bit rows of 512 (see dispatch.c). RMSNORM_STREAM_EDGES=1 / 0:
 * every row / none. */
int rms_cpu_stream_edges(size_t es, size_t row_bytes);
/* Whether the backward prefetches 16-bit rows of up to 2 KiB into L1, 16 KiB ahead, rather than
 * into L2, 64 KiB ahead (RMS_NEAR_16; see FN(near) in rows_impl.h): on Intel CPUs, with the
 * kernel families whose near_bwd_16 says so (AVX-512), where it measured faster.
 * RMSNORM_L1_PREFETCH_16=0 / 1 sets it for every family. */
int rms_cpu_near_16(void);
void rms_isa_select(const rms_isa_table *t);

#endif
