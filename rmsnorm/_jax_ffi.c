/* XLA FFI handlers that run rmsnorm's kernels directly on XLA's CPU buffers, with no copies.
 * Compiled by rmsnorm.jax at first use against the headers of the installed jaxlib
 * (jax.ffi.include_dir()), and bound to rmsnorm._core through its C API capsule.
 *
 * rmsnorm_ffi_forward(x[..., k], w[k] or w[0]; eps, offset) -> y[..., k], rstd[...]
 * rmsnorm_ffi_backward(dy[..., k], x[..., k], w[k] or w[0], rstd[...]; offset)
 *     -> dx[..., k], dw[k] or dw[0]
 * w (and dw, in w's dtype) is in the compute type (float64 for float64 x, float32 otherwise), or
 * float16 / bfloat16 for a float32 compute type: it is widened, and offset added, here (XLA's
 * own 16-bit conversions cost more than a small call of the kernels), or, in x's own dtype with
 * no offset, passed as it is where rmsnorm._core reads it faster that way (a few rows); dw of one
 * such row is rounded by the kernels. An empty w means no weight. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rms_capi.h"
#include "xla/ffi/api/c_api.h"

static const rms_capi *api;

/* Returns 0, or -1 when rmsnorm._core speaks another version of the C API. */
int rmsnorm_ffi_init(const void *capi) {
    const rms_capi *c = (const rms_capi *)capi;
    if (!c || c->version != RMS_CAPI_VERSION)
        return -1;
    api = c;
    return 0;
}

/* XLA's CPU runtime runs independent operations at once on its own thread pool (a loss
 * reduction beside the backward pass, say). The kernels run on that pool too, so they share
 * its cores instead of competing with it from a second pool. */
typedef struct {
    const XLA_FFI_Api *api;
    XLA_FFI_ExecutionContext *ctx;
} xla_pool;

/* 0 when an XLA call succeeded; else -1, its error destroyed. */
static int xla_ok(const XLA_FFI_Api *api, XLA_FFI_Error *e) {
    if (!e)
        return 0;
    XLA_FFI_Error_Destroy_Args d = {XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, NULL, e};
    api->XLA_FFI_Error_Destroy(&d);
    return -1;
}

static int xla_schedule(void *data, void (*task)(void *), void *arg) {
    const xla_pool *p = (const xla_pool *)data;
    XLA_FFI_ThreadPool_Schedule_Args a = {XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE, NULL,
                                          p->ctx, task, arg};
    return xla_ok(p->api, p->api->XLA_FFI_ThreadPool_Schedule(&a));
}

#define HAS_FIELD(api, field)                                                                  \
    ((api)->struct_size >= offsetof(XLA_FFI_Api, field) + sizeof((api)->field) && (api)->field)

/* *pool describes XLA's intra-op pool, or NULL when this runtime has none to lend. */
static const rms_pool *xla_thread_pool(XLA_FFI_CallFrame *f, xla_pool *xp, rms_pool *pool) {
    const XLA_FFI_Api *x = f->api;
    if (!HAS_FIELD(x, XLA_FFI_ThreadPool_NumThreads) || !HAS_FIELD(x, XLA_FFI_ThreadPool_Schedule))
        return NULL;
    int64_t n = 0;
    XLA_FFI_ThreadPool_NumThreads_Args a = {XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE, NULL,
                                            f->ctx, &n};
    if (xla_ok(x, x->XLA_FFI_ThreadPool_NumThreads(&a)) != 0 || n < 1)
        return NULL;
    *xp = (xla_pool){x, f->ctx};
    *pool = (rms_pool){n > 256 ? 256 : (int)n, xla_schedule, xp};
    return pool;
}

static XLA_FFI_Error *error(const XLA_FFI_CallFrame *f, const char *message) {
    XLA_FFI_Error_Create_Args a = {XLA_FFI_Error_Create_Args_STRUCT_SIZE, NULL, message,
                                   XLA_FFI_Error_Code_INVALID_ARGUMENT};
    return f->api->XLA_FFI_Error_Create(&a);
}

/* XLA asks a handler for its metadata (the FFI version it was built with) before using it.
 * The extension header's type name changed between FFI versions; its layout did not. */
static int metadata(XLA_FFI_CallFrame *f) {
    __typeof__(f->extension_start) e = f->extension_start;
    if (!e || e->type != XLA_FFI_Extension_Metadata)
        return 0;
    XLA_FFI_Metadata *m = ((XLA_FFI_Metadata_Extension *)e)->metadata;
    m->api_version.major_version = XLA_FFI_API_MAJOR;
    m->api_version.minor_version = XLA_FFI_API_MINOR;
    m->traits = 0;
    m->state_type_id.type_id = 0;
    return 1;
}

static int dtype_code(XLA_FFI_DataType t) {
    switch (t) {
    case XLA_FFI_DataType_F32: return 0;
    case XLA_FFI_DataType_F64: return 1;
    case XLA_FFI_DataType_F16: return 2;
    case XLA_FFI_DataType_BF16: return 3;
    default: return -1;
    }
}

static size_t elements(const XLA_FFI_Buffer *b);

/* The dtype code of x's compute type: float64 for float64 x, float32 otherwise. */
static int compute_code(int xcode) { return xcode == 1 ? 1 : 0; }

/* The float64 scalar attribute `name`, or NULL. */
static const double *attr_f64(const XLA_FFI_CallFrame *f, const char *name) {
    size_t len = strlen(name);
    for (int64_t i = 0; i < f->attrs.size; i++) {
        const XLA_FFI_ByteSpan *n = f->attrs.names[i];
        const XLA_FFI_Scalar *v = (const XLA_FFI_Scalar *)f->attrs.attrs[i];
        if (f->attrs.types[i] == XLA_FFI_AttrType_SCALAR && n->len == len &&
            !memcmp(n->ptr, name, len) && v->dtype == XLA_FFI_DataType_F64)
            return (const double *)v->value;
    }
    return NULL;
}

/* The weight as the kernels take it for m rows (compute type, offset added): w's own data, or
 * *scratch (to be freed); NULL for no weight. A weight of x's 16-bit dtype with no offset goes
 * as it is where rmsnorm._core reads it faster that way (few rows, as the Python API does), with
 * RMS_CAPI_W_AS_X in *flags. Returns 0, -1 for a weight dtype that does not go with x, -2 when
 * out of memory. */
static int weight_in(int xcode, const XLA_FFI_Buffer *w, double offset, size_t m,
                     const void **use, void **scratch, int *flags) {
    size_t n = elements(w);
    int wcode = dtype_code(w->dtype), compute = compute_code(xcode);
    *use = NULL;
    *scratch = NULL;
    *flags = 0;
    if (n == 0)
        return 0;
    if (wcode != compute && !(compute == 0 && (wcode == 2 || wcode == 3)))
        return -1;
    if ((wcode == compute || (wcode == xcode && api->weight_as_is(xcode, m, n))) &&
        offset == 0.0) {
        *use = w->data;
        *flags = wcode == compute ? 0 : RMS_CAPI_W_AS_X;
        return 0;
    }
    if (!(*scratch = malloc(n * (compute == 1 ? 8 : 4))))
        return -2;
    api->convert(wcode, w->data, *scratch, offset, n, 1);
    *use = *scratch;
    return 0;
}

static XLA_FFI_Error *weight_error(const XLA_FFI_CallFrame *f, int rc) {
    return error(f, rc == -1 ? "rmsnorm_ffi: the weight's dtype does not go with x's"
                             : "rmsnorm_ffi: out of memory");
}

static XLA_FFI_Buffer *arg(XLA_FFI_CallFrame *f, int i) {
    return f->args.types[i] == XLA_FFI_ArgType_BUFFER ? (XLA_FFI_Buffer *)f->args.args[i] : NULL;
}

static XLA_FFI_Buffer *ret(XLA_FFI_CallFrame *f, int i) {
    return f->rets.types[i] == XLA_FFI_RetType_BUFFER ? (XLA_FFI_Buffer *)f->rets.rets[i] : NULL;
}

static size_t elements(const XLA_FFI_Buffer *b) {
    size_t n = 1;
    for (int64_t i = 0; i < b->rank; i++)
        n *= (size_t)b->dims[i];
    return n;
}

XLA_FFI_Error *rmsnorm_ffi_forward(XLA_FFI_CallFrame *f) {
    if (metadata(f) || f->stage != XLA_FFI_ExecutionStage_EXECUTE)
        return NULL;
    if (!api || f->args.size != 2 || f->rets.size != 2)
        return error(f, "rmsnorm_ffi_forward: unexpected call signature");
    XLA_FFI_Buffer *x = arg(f, 0), *w = arg(f, 1), *y = ret(f, 0), *rstd = ret(f, 1);
    const double *eps = attr_f64(f, "eps"), *offset = attr_f64(f, "offset");
    int code = x ? dtype_code(x->dtype) : -1;
    if (code < 0 || !w || !y || !rstd || x->rank < 1 || !eps || !offset)
        return error(f, "rmsnorm_ffi_forward: unsupported arguments");
    size_t k = (size_t)x->dims[x->rank - 1], n = elements(x);
    if (k == 0 || (elements(w) != 0 && elements(w) != k))
        return error(f, "rmsnorm_ffi_forward: weight does not match the last axis of x");
    const void *wk;
    void *scratch;
    int flags, rc = weight_in(code, w, *offset, n / k, &wk, &scratch, &flags);
    if (rc < 0)
        return weight_error(f, rc);
    xla_pool xp;
    rms_pool pool;
    api->forward(code, x->data, wk, flags, y->data, rstd->data, n / k, k, *eps,
                 xla_thread_pool(f, &xp, &pool));
    free(scratch);
    return NULL;
}

XLA_FFI_Error *rmsnorm_ffi_backward(XLA_FFI_CallFrame *f) {
    if (metadata(f) || f->stage != XLA_FFI_ExecutionStage_EXECUTE)
        return NULL;
    if (!api || f->args.size != 4 || f->rets.size != 2)
        return error(f, "rmsnorm_ffi_backward: unexpected call signature");
    XLA_FFI_Buffer *dy = arg(f, 0), *x = arg(f, 1), *w = arg(f, 2), *rstd = arg(f, 3);
    XLA_FFI_Buffer *dx = ret(f, 0), *dw = ret(f, 1);
    const double *offset = attr_f64(f, "offset");
    int code = x ? dtype_code(x->dtype) : -1;
    if (code < 0 || !dy || !w || !rstd || !dx || !dw || x->rank < 1 || !offset ||
        dw->dtype != w->dtype)
        return error(f, "rmsnorm_ffi_backward: unsupported arguments");
    size_t k = (size_t)x->dims[x->rank - 1], n = elements(x);
    if (k == 0 || (elements(w) != 0 && elements(w) != k) || elements(dw) != elements(w))
        return error(f, "rmsnorm_ffi_backward: weight does not match the last axis of x");
    const void *wk;
    void *scratch, *dg = NULL;
    int flags, rc = weight_in(code, w, *offset, n / k, &wk, &scratch, &flags);
    if (rc < 0)
        return weight_error(f, rc);
    int narrow = wk && dtype_code(w->dtype) != compute_code(code); /* dw in a 16-bit dtype */
    if (narrow && n == k && dtype_code(w->dtype) == code) { /* one row: the kernels round dw */
        flags |= RMS_CAPI_DG_AS_X;
        narrow = 0;
    }
    if (wk)
        dg = narrow ? malloc(k * 4) : dw->data;
    xla_pool xp;
    rms_pool pool;
    rc = wk && !dg ? -1
                   : api->backward(code, dy->data, x->data, wk, flags, rstd->data, dx->data, dg,
                                   n / k, k, xla_thread_pool(f, &xp, &pool));
    if (rc == 0 && narrow)
        api->convert(dtype_code(w->dtype), dg, dw->data, 0.0, k, 0);
    if (narrow)
        free(dg);
    free(scratch);
    return rc < 0 ? error(f, "rmsnorm_ffi_backward: out of memory") : NULL;
}
