/* XLA FFI handlers that run rmsnorm's kernels directly on XLA's CPU buffers, with no copies.
 * Compiled by rmsnorm.jax at first use against the headers of the installed jaxlib
 * (jax.ffi.include_dir()), and bound to rmsnorm._core through its C API capsule.
 *
 * rmsnorm_ffi_forward(x[..., k], w[k] or w[0]; eps) -> y[..., k], rstd[...]
 * rmsnorm_ffi_backward(dy[..., k], x[..., k], w[k] or w[0], rstd[...]) -> dx[..., k], dw[k] or dw[0]
 * w and dw are in the compute type (float64 for float64 x, float32 otherwise); an empty w means
 * no weight. */
#include <stddef.h>
#include <stdint.h>

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

static int xla_schedule(void *data, void (*task)(void *), void *arg) {
    const xla_pool *p = (const xla_pool *)data;
    XLA_FFI_ThreadPool_Schedule_Args a = {XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE, NULL,
                                          p->ctx, task, arg};
    XLA_FFI_Error *e = p->api->XLA_FFI_ThreadPool_Schedule(&a);
    if (!e)
        return 0;
    XLA_FFI_Error_Destroy_Args d = {XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, NULL, e};
    p->api->XLA_FFI_Error_Destroy(&d);
    return -1;
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
    XLA_FFI_Error *e = x->XLA_FFI_ThreadPool_NumThreads(&a);
    if (e) {
        XLA_FFI_Error_Destroy_Args d = {XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, NULL, e};
        x->XLA_FFI_Error_Destroy(&d);
        return NULL;
    }
    if (n < 1)
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
    if (!api || f->args.size != 2 || f->rets.size != 2 || f->attrs.size != 1 ||
        f->attrs.types[0] != XLA_FFI_AttrType_SCALAR)
        return error(f, "rmsnorm_ffi_forward: unexpected call signature");
    XLA_FFI_Buffer *x = arg(f, 0), *w = arg(f, 1), *y = ret(f, 0), *rstd = ret(f, 1);
    XLA_FFI_Scalar *eps = (XLA_FFI_Scalar *)f->attrs.attrs[0];
    int code = x ? dtype_code(x->dtype) : -1;
    if (code < 0 || !w || !y || !rstd || x->rank < 1 || eps->dtype != XLA_FFI_DataType_F64)
        return error(f, "rmsnorm_ffi_forward: unsupported arguments");
    size_t k = (size_t)x->dims[x->rank - 1], n = elements(x);
    if (k == 0 || (elements(w) != 0 && elements(w) != k))
        return error(f, "rmsnorm_ffi_forward: weight does not match the last axis of x");
    xla_pool xp;
    rms_pool pool;
    api->forward(code, x->data, elements(w) ? w->data : NULL, y->data, rstd->data, n / k, k,
                 *(double *)eps->value, xla_thread_pool(f, &xp, &pool));
    return NULL;
}

XLA_FFI_Error *rmsnorm_ffi_backward(XLA_FFI_CallFrame *f) {
    if (metadata(f) || f->stage != XLA_FFI_ExecutionStage_EXECUTE)
        return NULL;
    if (!api || f->args.size != 4 || f->rets.size != 2)
        return error(f, "rmsnorm_ffi_backward: unexpected call signature");
    XLA_FFI_Buffer *dy = arg(f, 0), *x = arg(f, 1), *w = arg(f, 2), *rstd = arg(f, 3);
    XLA_FFI_Buffer *dx = ret(f, 0), *dw = ret(f, 1);
    int code = x ? dtype_code(x->dtype) : -1;
    if (code < 0 || !dy || !w || !rstd || !dx || !dw || x->rank < 1)
        return error(f, "rmsnorm_ffi_backward: unsupported arguments");
    size_t k = (size_t)x->dims[x->rank - 1], n = elements(x);
    if (k == 0 || (elements(w) != 0 && elements(w) != k) || elements(dw) != elements(w))
        return error(f, "rmsnorm_ffi_backward: weight does not match the last axis of x");
    int has_w = elements(w) != 0;
    xla_pool xp;
    rms_pool pool;
    if (api->backward(code, dy->data, x->data, has_w ? w->data : NULL, rstd->data, dx->data,
                      has_w ? dw->data : NULL, n / k, k, xla_thread_pool(f, &xp, &pool)) < 0)
        return error(f, "rmsnorm_ffi_backward: out of memory");
    return NULL;
}
