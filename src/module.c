/* Python glue: the only file that includes Python and NumPy. It parses arguments, validates
 * dtypes and shapes (raising before any work starts), allocates outputs, releases the GIL and
 * hands 2-D row views to the driver. Anything the kernels cannot address as rows of contiguous
 * elements with one row stride (misaligned, byte-swapped, exotic strides) is copied first. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#include <numpy/arrayobject.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../rmsnorm/rms_capi.h"
#include "dispatch.h"
#include "driver.h"

static int bf16_typenum = -1; /* ml_dtypes.bfloat16, registered at import when available */

/* ---------------------------------------------------------------- argument parsing */

static int str_eq(PyObject *u, const char *s) { return PyUnicode_CompareWithASCIIString(u, s) == 0; }

/* Fills o[0..n) from positional args (at most npos) and keywords; o[i] stays NULL if absent. */
static int parse_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      const char *const *names, int n, int npos, int nreq, PyObject **o) {
    if (nargs > npos) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional arguments (%zd given)", fn,
                     npos, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        o[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, j);
        int i = 0;
        while (i < n && !str_eq(key, names[i]))
            i++;
        if (i == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fn, key);
            return -1;
        }
        if (o[i]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn,
                         names[i]);
            return -1;
        }
        o[i] = args[nargs + j];
    }
    for (int i = 0; i < nreq; i++)
        if (!o[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[i]);
            return -1;
        }
    return 0;
}

static int is_real(PyObject *v) {
    return PyFloat_Check(v) || (PyLong_Check(v) && !PyBool_Check(v)) ||
           PyArray_IsScalar(v, Floating) || PyArray_IsScalar(v, Integer);
}

static int parse_real(const char *fn, const char *name, PyObject *v, double dflt, double *out) {
    if (!v) {
        *out = dflt;
        return 0;
    }
    if (!is_real(v)) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be a real number, not %s", fn, name,
                     Py_TYPE(v)->tp_name);
        return -1;
    }
    *out = PyFloat_AsDouble(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static int parse_eps(const char *fn, PyObject *v, double *eps) {
    if (parse_real(fn, "eps", v, 1e-6, eps) < 0)
        return -1;
    if (!isfinite(*eps) || *eps < 0) {
        PyErr_Format(PyExc_ValueError, "%s(): eps must be finite and >= 0, got %R", fn, v);
        return -1;
    }
    return 0;
}

static int parse_offset(const char *fn, PyObject *v, double *offset) {
    if (parse_real(fn, "offset", v, 0.0, offset) < 0)
        return -1;
    if (!isfinite(*offset)) {
        PyErr_Format(PyExc_ValueError, "%s(): offset must be finite, got %R", fn, v);
        return -1;
    }
    return 0;
}

static int parse_cast(const char *fn, PyObject *v, int *flags) {
    *flags = 0;
    if (!v)
        return 0;
    if (!PyUnicode_Check(v)) {
        PyErr_Format(PyExc_TypeError, "%s(): cast must be a str, not %s", fn, Py_TYPE(v)->tp_name);
        return -1;
    }
    if (str_eq(v, "before_weight"))
        *flags = RMS_CAST_BEFORE;
    else if (!str_eq(v, "end")) {
        PyErr_Format(PyExc_ValueError, "%s(): cast must be 'end' or 'before_weight', got %R", fn,
                     v);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- dtypes and arrays */

static int dtype_code(PyArray_Descr *d) {
    switch (d->type_num) {
    case NPY_FLOAT:
        return RMS_F32;
    case NPY_DOUBLE:
        return RMS_F64;
    case NPY_HALF:
        return RMS_F16;
    default:
        return d->type_num == bf16_typenum && bf16_typenum >= 0 ? RMS_BF16 : -1;
    }
}

static int compute_typenum(int code) { return code == RMS_F64 ? NPY_DOUBLE : NPY_FLOAT; }

static PyObject *shape_of(PyArrayObject *a, int start, int stop) {
    PyObject *t = PyTuple_New(stop - start);
    for (int i = start; t && i < stop; i++) {
        PyObject *v = PyLong_FromSsize_t(PyArray_DIM(a, i));
        if (!v) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i - start, v);
    }
    return t;
}

static void shape_error(const char *fn, const char *msg, const char *na, PyArrayObject *a, int a0,
                        int a1, const char *nb, PyArrayObject *b, int b0, int b1) {
    PyObject *sa = shape_of(a, a0, a1), *sb = shape_of(b, b0, b1);
    if (sa && sb)
        PyErr_Format(PyExc_ValueError, "%s(): %s: %s has shape %R but %s has shape %R", fn, msg,
                     na, sa, nb, sb);
    Py_XDECREF(sa);
    Py_XDECREF(sb);
}

static int same_shape(PyArrayObject *a, int a0, int a1, PyArrayObject *b, int b0, int b1) {
    if (a1 - a0 != b1 - b0)
        return 0;
    for (int i = 0; i < a1 - a0; i++)
        if (PyArray_DIM(a, a0 + i) != PyArray_DIM(b, b0 + i))
            return 0;
    return 1;
}

/* A native, aligned float array for an argument (new reference). Array-likes that are not
 * ndarrays are converted; integer ones become float64. Unsupported dtypes raise TypeError. */
static PyArrayObject *as_float_array(const char *fn, const char *name, PyObject *o, int *code) {
    PyArrayObject *a;
    if (PyArray_Check(o)) {
        a = (PyArrayObject *)o;
        Py_INCREF(a);
    } else {
        a = (PyArrayObject *)PyArray_FromAny(o, NULL, 0, 0, 0, NULL);
        if (!a)
            return NULL;
        if (PyTypeNum_ISINTEGER(PyArray_TYPE(a))) {
            PyArrayObject *f = (PyArrayObject *)PyArray_Cast(a, NPY_DOUBLE);
            Py_SETREF(a, f);
            if (!a)
                return NULL;
        }
    }
    *code = dtype_code(PyArray_DESCR(a));
    if (*code < 0) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): %s has unsupported dtype %S; expected float16, bfloat16, float32 or "
                     "float64",
                     fn, name, (PyObject *)PyArray_DESCR(a));
        Py_DECREF(a);
        return NULL;
    }
    if (PyArray_ISALIGNED(a) && PyArray_ISNOTSWAPPED(a))
        return a;
    PyArray_Descr *d = PyArray_DescrFromType(PyArray_TYPE(a)); /* native byte order */
    PyArrayObject *c = (PyArrayObject *)PyArray_FromAny((PyObject *)a, d, 0, 0,
                                                        NPY_ARRAY_ALIGNED, NULL);
    Py_DECREF(a);
    return c;
}

/* Rows of k contiguous elements, one row stride apart: how the kernels see an array whose
 * last (ndim - nlead) axes are normalized. */
typedef struct {
    char *data;
    size_t m, k;
    ptrdiff_t rs; /* elements */
} rows2d;

static int rows_of(PyArrayObject *a, int nlead, rows2d *v) {
    int nd = PyArray_NDIM(a);
    npy_intp *sh = PyArray_DIMS(a), *st = PyArray_STRIDES(a), es = PyArray_ITEMSIZE(a);
    npy_intp expect = es, rs = 0, next = 0;
    size_t m = 1, k = 1;
    if (PyArray_SIZE(a) == 0) { /* no rows to touch: strides do not matter */
        for (int i = 0; i < nd; i++)
            *(i < nlead ? &m : &k) *= (size_t)sh[i];
        *v = (rows2d){PyArray_BYTES(a), m, k, (ptrdiff_t)k};
        return 1;
    }
    for (int i = nd - 1; i >= nlead; i--) {
        if (sh[i] != 1 && st[i] != expect)
            return 0;
        expect *= sh[i];
        k *= (size_t)sh[i];
    }
    int found = 0;
    rs = expect;
    for (int i = nlead - 1; i >= 0; i--) {
        m *= (size_t)sh[i];
        if (sh[i] == 1)
            continue;
        if (found && st[i] != next)
            return 0;
        if (!found)
            rs = st[i];
        found = 1;
        next = st[i] * sh[i];
    }
    if (rs % es)
        return 0;
    *v = (rows2d){PyArray_BYTES(a), m, k, (ptrdiff_t)(rs / es)};
    return 1;
}

/* rows_of, copying the input to C order first when its layout does not allow it. */
static int input_rows(PyArrayObject **a, int nlead, rows2d *v) {
    if (rows_of(*a, nlead, v))
        return 0;
    PyArrayObject *c = (PyArrayObject *)PyArray_NewCopy(*a, NPY_CORDER);
    if (!c)
        return -1;
    Py_SETREF(*a, c);
    return rows_of(*a, nlead, v) ? 0 : -1;
}

static void extent(PyArrayObject *a, char **lo, char **hi) {
    char *l = PyArray_BYTES(a), *h = l;
    for (int i = 0; i < PyArray_NDIM(a); i++) {
        npy_intp span = PyArray_STRIDE(a, i) * (PyArray_DIM(a, i) - 1);
        if (span < 0)
            l += span;
        else
            h += span;
    }
    *lo = l;
    *hi = h + PyArray_ITEMSIZE(a);
}

static int same_view(PyArrayObject *a, PyArrayObject *b) {
    if (PyArray_BYTES(a) != PyArray_BYTES(b) || PyArray_NDIM(a) != PyArray_NDIM(b) ||
        PyArray_TYPE(a) != PyArray_TYPE(b))
        return 0;
    for (int i = 0; i < PyArray_NDIM(a); i++)
        if (PyArray_DIM(a, i) != PyArray_DIM(b, i) ||
            (PyArray_DIM(a, i) > 1 && PyArray_STRIDE(a, i) != PyArray_STRIDE(b, i)))
            return 0;
    return 1;
}

/* Whether the memory bounds of two arrays meet (neither empty). */
static int shares_bounds(PyArrayObject *a, PyArrayObject *b) {
    if (PyArray_SIZE(a) == 0 || PyArray_SIZE(b) == 0)
        return 0;
    char *l1, *h1, *l2, *h2;
    extent(a, &l1, &h1);
    extent(b, &l2, &h2);
    return l1 < h2 && l2 < h1;
}

/* Large outputs come from a small cache of page-aligned buffers. A fresh mapping costs a page
 * fault per 4 KiB on first touch, several times the kernel itself, so a loop that calls
 * rms_norm without out= reuses the buffers of results it has dropped. The GIL guards the cache
 * (allocation and the capsule destructor both run with it held). */
#define RMS_CACHE_SLOTS 8
#define RMS_CACHE_MAX_BYTES ((size_t)512 << 20)
#define RMS_CACHE_MIN_BYTES ((size_t)1 << 20)

static struct {
    void *p;
    size_t bytes;
} cache[RMS_CACHE_SLOTS];
static size_t cache_bytes;

static void *buffer_get(size_t bytes) {
    for (int i = 0; i < RMS_CACHE_SLOTS; i++)
        if (cache[i].p && cache[i].bytes == bytes) {
            void *p = cache[i].p;
            cache[i].p = NULL;
            cache_bytes -= bytes;
            return p;
        }
    void *p = NULL;
    if (posix_memalign(&p, 4096, bytes))
        return NULL;
    rms_advise_huge(p, bytes);
    return p;
}

static void buffer_put(void *p, size_t bytes) {
    if (bytes >= RMS_CACHE_MIN_BYTES && cache_bytes + bytes <= RMS_CACHE_MAX_BYTES)
        for (int i = 0; i < RMS_CACHE_SLOTS; i++)
            if (!cache[i].p) {
                cache[i].p = p;
                cache[i].bytes = bytes;
                cache_bytes += bytes;
                return;
            }
    free(p);
}

static void free_buffer(PyObject *capsule) {
    buffer_put(PyCapsule_GetPointer(capsule, "rmsnorm.buffer"),
               (size_t)PyCapsule_GetContext(capsule));
}

/* A new C-order array (descr stolen). Large ones are page-aligned, so rows whose size is a
 * multiple of 64 bytes start on cache lines and can be streamed whole. */
static PyArrayObject *new_output(PyArray_Descr *descr, int nd, npy_intp *dims) {
    size_t bytes = (size_t)PyDataType_ELSIZE(descr);
    for (int i = 0; i < nd; i++)
        bytes *= (size_t)dims[i];
    if (bytes < ((size_t)1 << 16))
        return (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, NULL, NULL,
                                                     0, NULL);
    bytes = (bytes + 4095) & ~(size_t)4095;
    void *p = buffer_get(bytes);
    if (!p) {
        Py_DECREF(descr);
        return (PyArrayObject *)PyErr_NoMemory();
    }
    PyObject *cap = PyCapsule_New(p, "rmsnorm.buffer", free_buffer);
    if (!cap || PyCapsule_SetContext(cap, (void *)bytes) < 0) {
        if (cap) {
            PyCapsule_SetDestructor(cap, NULL);
            Py_DECREF(cap);
        }
        buffer_put(p, bytes);
        Py_DECREF(descr);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, NULL,
                                                              p, NPY_ARRAY_CARRAY, NULL);
    if (!a || PyArray_SetBaseObject(a, cap) < 0) { /* SetBaseObject steals cap either way */
        if (!a)
            Py_DECREF(cap);
        Py_XDECREF(a);
        return NULL;
    }
    return a;
}

/* An output: the user's array when the kernels can write it directly, else a C-order temporary
 * copied into it at the end. */
typedef struct {
    PyArrayObject *user, *arr;
    rows2d v;
} outbuf;

static int check_out(const char *fn, const char *name, PyObject *o, PyArrayObject *like,
                     const char *like_name) {
    if (!PyArray_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be a numpy.ndarray, not %s", fn, name,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)o;
    if (PyArray_TYPE(a) != PyArray_TYPE(like)) {
        PyErr_Format(PyExc_TypeError, "%s(): %s has dtype %S but %s has dtype %S", fn, name,
                     (PyObject *)PyArray_DESCR(a), like_name, (PyObject *)PyArray_DESCR(like));
        return -1;
    }
    if (!same_shape(a, 0, PyArray_NDIM(a), like, 0, PyArray_NDIM(like))) {
        shape_error(fn, "shape mismatch", name, a, 0, PyArray_NDIM(a), like_name, like, 0,
                    PyArray_NDIM(like));
        return -1;
    }
    if (!PyArray_ISWRITEABLE(a)) {
        PyErr_Format(PyExc_ValueError, "%s(): %s is read-only", fn, name);
        return -1;
    }
    return 0;
}

static int open_out(PyObject *o, PyArrayObject *like, int nlead, outbuf *b) {
    b->user = (PyArrayObject *)o;
    if (o && PyArray_ISALIGNED(b->user) && PyArray_ISNOTSWAPPED(b->user) &&
        rows_of(b->user, nlead, &b->v)) {
        Py_INCREF(o);
        b->arr = b->user;
        return 0;
    }
    PyArray_Descr *d = PyArray_DESCR(like);
    Py_INCREF(d);
    b->arr = new_output(d, PyArray_NDIM(like), PyArray_DIMS(like));
    return b->arr && rows_of(b->arr, nlead, &b->v) ? 0 : -1;
}

/* Returns a new reference to the array to hand back, after copying a temporary into the user's. */
static PyObject *close_out(outbuf *b) {
    if (b->user && b->arr != b->user && PyArray_CopyInto(b->user, b->arr) < 0)
        return NULL;
    PyObject *r = (PyObject *)(b->user ? b->user : b->arr);
    Py_INCREF(r);
    return r;
}

/* ---------------------------------------------------------------- outputs over inputs */

/* An input the kernels read: where it is (or copy, to be read in its place) and whether it may
 * be the very view of an output (x, residual, dy: the kernels read each of its elements before
 * they write that element; gamma and rstd are read again by later rows). */
typedef struct {
    PyArrayObject **arr;
    rows2d *v; /* its rows (of nlead leading axes), or NULL */
    int may_alias;
} input_ref;

/* NumPy's rule for ufuncs: the result is as if no output overlapped an input. Each input whose
 * memory bounds meet an output that the kernels write directly (not a temporary copied into the
 * user's array after them) is replaced by a C-order copy, unless it is that output's own view
 * and may alias it. The copied operand is the input: at most an output's size, a row's for gamma
 * and rstd. Called with the GIL, after every check, before the kernels. */
static int detach_inputs(input_ref *in, int nin, const outbuf *outs, int nout, int nlead) {
    for (int i = 0; i < nin; i++) {
        PyArrayObject **a = in[i].arr;
        for (int j = 0; *a && j < nout; j++) {
            PyArrayObject *o = outs[j].arr;
            if (!o || o != outs[j].user || !shares_bounds(*a, o) ||
                (in[i].may_alias && same_view(*a, o)))
                continue;
            PyArrayObject *c = (PyArrayObject *)PyArray_NewCopy(*a, NPY_CORDER);
            if (!c)
                return -1;
            Py_SETREF(*a, c);
            if (in[i].v && !rows_of(*a, nlead, in[i].v))
                return -1; /* not reached: a C-order copy has rows */
            break;
        }
    }
    return 0;
}

/* gamma checked against x: returns the number of leading (row) axes of x, or -1. */
static int check_gamma(const char *fn, PyArrayObject *x, PyArrayObject *g) {
    int nx = PyArray_NDIM(x), ng = g ? PyArray_NDIM(g) : 1;
    if (g && (ng == 0 || ng > nx || !same_shape(g, 0, ng, x, nx - ng, nx))) {
        shape_error(fn, "gamma must match the trailing axes of x", "gamma", g, 0, ng, "x", x, 0,
                    nx);
        return -1;
    }
    int nlead = nx - ng;
    npy_intp k = 1;
    for (int i = nlead; i < nx; i++)
        k *= PyArray_DIM(x, i);
    if (k == 0) {
        PyObject *s = shape_of(x, 0, nx);
        if (s)
            PyErr_Format(PyExc_ValueError,
                         "%s(): the normalized axes of x (shape %R) have no elements", fn, s);
        Py_XDECREF(s);
        return -1;
    }
    return nlead;
}

static PyArrayObject *check_x(const char *fn, PyObject *o, int *code) {
    PyArrayObject *x = as_float_array(fn, "x", o, code);
    if (x && PyArray_NDIM(x) == 0) {
        PyErr_Format(PyExc_ValueError, "%s(): x must have at least 1 dimension, got a 0-d array",
                     fn);
        Py_CLEAR(x);
    }
    return x;
}

static int sixteen_bit(int code) { return code == RMS_F16 || code == RMS_BF16; }

/* gamma as contiguous data for the driver, which widens offset + gamma to the compute type
 * (with the GIL released) unless it is that type with offset 0: gamma itself when its compute
 * type is x's, else cast by NumPy to x's compute type (*wcode says which dtype *w holds). *w =
 * NULL for no gamma. */
static int make_weights(const char *fn, PyObject *gobj, PyArrayObject *x, int code,
                        PyArrayObject **g, PyArrayObject **w, int *wcode) {
    *g = *w = NULL;
    *wcode = code == RMS_F64 ? RMS_F64 : RMS_F32;
    if (!gobj || gobj == Py_None)
        return check_gamma(fn, x, NULL);
    if (!(*g = as_float_array(fn, "gamma", gobj, wcode)))
        return -1;
    int nlead = check_gamma(fn, x, *g);
    if (nlead < 0)
        return -1;
    int tn = compute_typenum(code);
    PyArray_Descr *cast = NULL;
    if (compute_typenum(*wcode) != tn) {
        cast = PyArray_DescrFromType(tn);
        *wcode = tn == NPY_DOUBLE ? RMS_F64 : RMS_F32;
    }
    *w = (PyArrayObject *)PyArray_FromAny(
        (PyObject *)*g, cast, 0, 0,
        NPY_ARRAY_FORCECAST | NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, NULL);
    return *w ? nlead : -1;
}

/* A new C-order array of typenum, large ones from the cache of dropped buffers (new_output):
 * rstd of many rows, and dgamma of long rows, which a training loop drops every step. */
static PyArrayObject *new_array(int nd, npy_intp *dims, int typenum) {
    PyArray_Descr *d = PyArray_DescrFromType(typenum);
    return d ? new_output(d, nd, dims) : NULL;
}

/* ---------------------------------------------------------------- forward */

static PyObject *forward(const char *fn, PyObject *xo, PyObject *ro, PyObject *go, PyObject *epso,
                         PyObject *offo, PyObject *casto, PyObject *outo, PyObject *hout) {
    PyArrayObject *x = NULL, *r = NULL, *g = NULL, *w = NULL, *rstd = NULL;
    outbuf y = {0}, h = {0};
    PyObject *ret = NULL, *yret = NULL, *hret = NULL;
    double eps, offset;
    int code, rcode, flags;
    if (parse_eps(fn, epso, &eps) < 0 || parse_offset(fn, offo, &offset) < 0 ||
        parse_cast(fn, casto, &flags) < 0 || !(x = check_x(fn, xo, &code)))
        goto fail;
    if (ro) {
        if (!(r = as_float_array(fn, "residual", ro, &rcode)))
            goto fail;
        if (rcode != code) {
            PyErr_Format(PyExc_TypeError, "%s(): residual has dtype %S but x has dtype %S", fn,
                         (PyObject *)PyArray_DESCR(r), (PyObject *)PyArray_DESCR(x));
            goto fail;
        }
        if (!same_shape(r, 0, PyArray_NDIM(r), x, 0, PyArray_NDIM(x))) {
            shape_error(fn, "shape mismatch", "residual", r, 0, PyArray_NDIM(r), "x", x, 0,
                        PyArray_NDIM(x));
            goto fail;
        }
    }
    int wcode;
    int nlead = make_weights(fn, go, x, code, &g, &w, &wcode);
    if (nlead < 0)
        goto fail;
    if (outo && outo != Py_None) {
        if (check_out(fn, "out", outo, x, "x") < 0)
            goto fail;
    } else
        outo = NULL;
    if (hout && hout != Py_None) {
        if (check_out(fn, "residual_out", hout, x, "x") < 0)
            goto fail;
        if (outo && shares_bounds((PyArrayObject *)hout, (PyArrayObject *)outo)) {
            PyErr_Format(PyExc_ValueError, "%s(): residual_out and out share memory", fn);
            goto fail;
        }
    } else
        hout = NULL;

    rows2d xv, rv = {0};
    if (input_rows(&x, nlead, &xv) < 0 || (r && input_rows(&r, nlead, &rv) < 0))
        goto fail;
    if (open_out(outo, x, nlead, &y) < 0 || (r && open_out(hout, x, nlead, &h) < 0))
        goto fail;
    input_ref fin[] = {{&x, &xv, 1}, {&r, &rv, 1}, {&w, NULL, 0}};
    outbuf fout[] = {y, h};
    if (detach_inputs(fin, 3, fout, 2, nlead) < 0)
        goto fail;
    if (!(rstd = new_array(nlead, PyArray_DIMS(x), compute_typenum(code))))
        goto fail;

    rms_fwd_args a = {code, flags, xv.m, xv.k, xv.data, xv.rs, r ? rv.data : NULL, rv.rs,
                      h.arr ? h.v.data : NULL, h.v.rs, y.v.data, y.v.rs,
                      w ? PyArray_DATA(w) : NULL, wcode, offset, PyArray_DATA(rstd), eps};
    const rms_isa_table *isa = rms_isa_current();
    int nthreads = rms_threads_get(), rc;
    Py_BEGIN_ALLOW_THREADS
    rc = rms_forward(isa, &a, nthreads, NULL);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_NoMemory();
        goto fail;
    }

    if (!(yret = close_out(&y)) || (r && !(hret = close_out(&h))))
        goto fail;
    ret = r ? PyTuple_Pack(3, yret, (PyObject *)rstd, hret)
            : PyTuple_Pack(2, yret, (PyObject *)rstd);
fail:
    Py_XDECREF(x);
    Py_XDECREF(r);
    Py_XDECREF(g);
    Py_XDECREF(w);
    Py_XDECREF(rstd);
    Py_XDECREF(y.arr);
    Py_XDECREF(h.arr);
    Py_XDECREF(yret);
    Py_XDECREF(hret);
    return ret;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
    static const char *const names[] = {"x", "gamma", "eps", "offset", "cast", "out"};
    PyObject *o[6] = {0};
    (void)self;
    if (parse_args("rms_norm", args, nargs, kwnames, names, 6, 3, 1, o) < 0)
        return NULL;
    return forward("rms_norm", o[0], NULL, o[1], o[2], o[3], o[4], o[5], NULL);
}

static PyObject *py_add_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames) {
    static const char *const names[] = {"x",      "residual", "gamma", "eps",
                                        "offset", "cast",     "out",   "residual_out"};
    PyObject *o[8] = {0};
    (void)self;
    if (parse_args("add_rms_norm", args, nargs, kwnames, names, 8, 4, 2, o) < 0)
        return NULL;
    return forward("add_rms_norm", o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]);
}

/* ---------------------------------------------------------------- backward */

static PyObject *py_rms_norm_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                      PyObject *kwnames) {
    static const char *const names[] = {"dy", "x", "gamma", "rstd", "offset", "out"};
    static const char *fn = "rms_norm_backward";
    PyObject *o[6] = {0};
    PyArrayObject *dy = NULL, *x = NULL, *g = NULL, *w = NULL, *rs = NULL, *dgc = NULL;
    outbuf dx = {0};
    PyObject *ret = NULL, *dxret = NULL, *dgret = NULL;
    double offset;
    int code, dycode, rcode;
    (void)self;
    if (parse_args(fn, args, nargs, kwnames, names, 6, 4, 4, o) < 0 ||
        parse_offset(fn, o[4], &offset) < 0 || !(x = check_x(fn, o[1], &code)) ||
        !(dy = as_float_array(fn, "dy", o[0], &dycode)))
        goto fail;
    if (dycode != code) {
        PyErr_Format(PyExc_TypeError, "%s(): dy has dtype %S but x has dtype %S", fn,
                     (PyObject *)PyArray_DESCR(dy), (PyObject *)PyArray_DESCR(x));
        goto fail;
    }
    if (!same_shape(dy, 0, PyArray_NDIM(dy), x, 0, PyArray_NDIM(x))) {
        shape_error(fn, "shape mismatch", "dy", dy, 0, PyArray_NDIM(dy), "x", x, 0,
                    PyArray_NDIM(x));
        goto fail;
    }
    int wcode;
    int nlead = make_weights(fn, o[2], x, code, &g, &w, &wcode);
    if (nlead < 0 || !(rs = as_float_array(fn, "rstd", o[3], &rcode)))
        goto fail;
    if (rcode != (code == RMS_F64 ? RMS_F64 : RMS_F32)) {
        PyErr_Format(PyExc_TypeError, "%s(): rstd has dtype %S but must be %s for x of dtype %S",
                     fn, (PyObject *)PyArray_DESCR(rs), code == RMS_F64 ? "float64" : "float32",
                     (PyObject *)PyArray_DESCR(x));
        goto fail;
    }
    if (!same_shape(rs, 0, PyArray_NDIM(rs), x, 0, nlead)) {
        shape_error(fn, "rstd must have the leading (row) shape of x", "rstd", rs, 0,
                    PyArray_NDIM(rs), "x", x, 0, PyArray_NDIM(x));
        goto fail;
    }
    PyObject *outo = o[5] && o[5] != Py_None ? o[5] : NULL;
    if (outo) {
        if (check_out(fn, "out", outo, x, "x") < 0)
            goto fail;
    }
    Py_SETREF(rs, (PyArrayObject *)PyArray_FromAny((PyObject *)rs, NULL, 0, 0,
                                                   NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED,
                                                   NULL));
    rows2d xv, dyv;
    if (!rs || input_rows(&x, nlead, &xv) < 0 || input_rows(&dy, nlead, &dyv) < 0 ||
        open_out(outo, x, nlead, &dx) < 0)
        goto fail;
    input_ref bin[] = {{&dy, &dyv, 1}, {&x, &xv, 1}, {&w, NULL, 0}, {&rs, NULL, 0}};
    if (detach_inputs(bin, 4, &dx, 1, nlead) < 0)
        goto fail;
    /* dgamma in gamma's dtype where that shares x's compute type (the driver rounds it), else
     * in the compute type and cast by NumPy */
    int dgcode = g ? dtype_code(PyArray_DESCR(g)) : -1;
    int dg_direct = g && compute_typenum(dgcode) == compute_typenum(code);
    if (g && !(dgc = new_array(PyArray_NDIM(g), PyArray_DIMS(g),
                               dg_direct ? PyArray_TYPE(g) : compute_typenum(code))))
        goto fail;
    rms_bwd_args a = {code, 0, xv.m, xv.k, dyv.data, dyv.rs, xv.data, xv.rs, dx.v.data, dx.v.rs,
                      w ? PyArray_DATA(w) : NULL, wcode, offset, PyArray_DATA(rs),
                      dgc ? PyArray_DATA(dgc) : NULL,
                      dg_direct ? dgcode : (code == RMS_F64 ? RMS_F64 : RMS_F32)};
    const rms_isa_table *isa = rms_isa_current();
    int nthreads = rms_threads_get(), rc;
    Py_BEGIN_ALLOW_THREADS
    rc = rms_backward(isa, &a, nthreads, NULL);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_NoMemory();
        goto fail;
    }
    if (!(dxret = close_out(&dx)))
        goto fail;
    if (!g) {
        dgret = Py_None;
        Py_INCREF(dgret);
    } else if (dg_direct) {
        dgret = (PyObject *)dgc;
        Py_INCREF(dgret);
    } else if (!(dgret = PyArray_CastToType(dgc, PyArray_DescrFromType(PyArray_TYPE(g)), 0)))
        goto fail;
    ret = PyTuple_Pack(2, dxret, dgret);
fail:
    Py_XDECREF(dy);
    Py_XDECREF(x);
    Py_XDECREF(g);
    Py_XDECREF(w);
    Py_XDECREF(rs);
    Py_XDECREF(dgc);
    Py_XDECREF(dx.arr);
    Py_XDECREF(dxret);
    Py_XDECREF(dgret);
    return ret;
}

/* ---------------------------------------------------------------- runtime controls */

static PyObject *py_get_num_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(rms_threads_get());
}

static PyObject *py_stream_bytes(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    size_t l3 = 0, sb = rms_stream_bytes(&l3);
    return Py_BuildValue("(nn)", (Py_ssize_t)(sb > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : sb),
                         (Py_ssize_t)(l3 > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : l3));
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyLong_Check(arg) || PyBool_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "set_num_threads(): n must be an int, not %s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "set_num_threads(): n must be >= 1, got %ld", n);
        return NULL;
    }
    rms_threads_set(n > 1 << 20 ? 1 << 20 : (int)n);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- test hooks */

static PyObject *py_last_team_size(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(rms_last_team_size());
}

/* A setter's argument: an int >= 0, clamped to SIZE_MAX. */
static int size_arg(const char *fn, PyObject *arg, size_t *n) {
    if (!PyLong_Check(arg) || PyBool_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s(): n must be an int, not %s", fn, Py_TYPE(arg)->tp_name);
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow < 0 || (!overflow && v < 0)) {
        PyErr_Format(PyExc_ValueError, "%s(): n must be >= 0, got %R", fn, arg);
        return -1;
    }
    *n = overflow > 0 || (unsigned long long)v > SIZE_MAX ? SIZE_MAX : (size_t)v;
    return 0;
}

static PyObject *py_set_min_per_thread(PyObject *self, PyObject *arg) {
    size_t n;
    (void)self;
    if (size_arg("_set_min_per_thread", arg, &n) < 0)
        return NULL;
    return PyLong_FromSize_t(rms_set_min_per_thread(n));
}

static PyObject *py_set_stream_bytes(PyObject *self, PyObject *arg) {
    size_t n;
    (void)self;
    if (size_arg("_set_stream_bytes", arg, &n) < 0)
        return NULL;
    return PyLong_FromSize_t(rms_set_stream_bytes(n));
}

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(rms_isa_family(rms_isa_current()));
}

/* The available tables' names, best first: the families' (each once), or with variants every
 * table's own name. */
static PyObject *isa_names(int variants) {
    const rms_isa_table *t[RMS_MAX_ISAS];
    int n = rms_isa_list(t);
    PyObject *l = PyList_New(0);
    for (int i = 0; l && i < n; i++) {
        const char *name = variants ? t[i]->name : rms_isa_family(t[i]);
        int seen = 0;
        for (int j = 0; j < i && !variants; j++)
            seen |= strcmp(rms_isa_family(t[j]), name) == 0;
        PyObject *s = seen ? NULL : PyUnicode_FromString(name);
        if (!seen && (!s || PyList_Append(l, s) < 0))
            Py_CLEAR(l);
        Py_XDECREF(s);
    }
    return l;
}

static PyObject *py_available_isas(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return isa_names(0);
}

static PyObject *py_variants(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return isa_names(1);
}

static PyObject *py_variant(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(rms_isa_current()->name);
}

/* set_isa (a family's best table) and _set_variant (a table by its own name). */
static PyObject *select_isa(PyObject *arg, int variant) {
    const char *what = variant ? "_set_variant" : "set_isa";
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s(): name must be a str, not %s", what,
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    const rms_isa_table *t = variant ? rms_isa_find_variant(name) : rms_isa_find(name);
    if (!t) {
        PyObject *avail = isa_names(variant);
        if (avail)
            PyErr_Format(PyExc_ValueError, "%s(): %R is not available here; choose from %R",
                         what, arg, avail);
        Py_XDECREF(avail);
        return NULL;
    }
    rms_isa_select(t);
    Py_RETURN_NONE;
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    return select_isa(arg, 0);
}

static PyObject *py_set_variant(PyObject *self, PyObject *arg) {
    (void)self;
    return select_isa(arg, 1);
}

static PyObject *py_have_openmp(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(rms_have_openmp());
}

/* ---------------------------------------------------------------- roofline references */

static int ref_arrays(const char *fn, PyObject *const *args, Py_ssize_t nargs, int n,
                      PyArrayObject **a) {
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d arrays", fn, n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        a[i] = (PyArrayObject *)args[i];
        if (!PyArray_Check(args[i]) || !PyArray_IS_C_CONTIGUOUS(a[i]) ||
            PyArray_NBYTES(a[i]) != PyArray_NBYTES(a[0]) || PyArray_TYPE(a[i]) != PyArray_TYPE(a[0])) {
            PyErr_Format(PyExc_ValueError, "%s(): arrays must be C-contiguous, of one dtype and size",
                         fn);
            return -1;
        }
    }
    if (!PyArray_ISWRITEABLE(a[n - 1])) {
        PyErr_Format(PyExc_ValueError, "%s(): the destination is read-only", fn);
        return -1;
    }
    return 0;
}

static PyObject *py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyArrayObject *a[2];
    (void)self;
    int prefetch = 0;
    if (nargs == 3) {
        if ((prefetch = PyObject_IsTrue(args[2])) < 0)
            return NULL;
        nargs = 2;
    }
    if (ref_arrays("copy", args, nargs, 2, a) < 0)
        return NULL;
    int nthreads = rms_threads_get();
    Py_BEGIN_ALLOW_THREADS
    rms_ref_copy(PyArray_DATA(a[1]), PyArray_DATA(a[0]), (size_t)PyArray_NBYTES(a[0]), prefetch,
                 nthreads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_triad(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyArrayObject *a[3];
    (void)self;
    if (ref_arrays("triad", args, nargs, 3, a) < 0)
        return NULL;
    int tn = PyArray_TYPE(a[0]);
    if (tn != NPY_FLOAT && tn != NPY_DOUBLE) {
        PyErr_SetString(PyExc_TypeError, "triad(): arrays must be float32 or float64");
        return NULL;
    }
    int nthreads = rms_threads_get();
    Py_BEGIN_ALLOW_THREADS
    rms_ref_triad(PyArray_DATA(a[2]), PyArray_DATA(a[0]), PyArray_DATA(a[1]),
                  (size_t)PyArray_SIZE(a[0]), tn == NPY_DOUBLE, nthreads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- C API for native callers */

/* The outputs of native callers (XLA's, for the JAX adapter) are usually fresh memory: their
 * huge pages are asked for before the kernels first touch them. */
static void advise_output(int dtype, void *p, size_t n) {
    rms_advise_huge(p, n * rms_esize(dtype));
}

static void capi_forward(int dtype, const void *x, const void *w, int flags, void *y, void *rstd,
                         size_t m, size_t k, double eps, const rms_pool *pool) {
    int wcode = sixteen_bit(dtype) && (flags & RMS_CAPI_W_AS_X) ? dtype
                : dtype == RMS_F64                              ? RMS_F64
                                                                : RMS_F32;
    rms_fwd_args a = {dtype, 0, m, k, x, (ptrdiff_t)k, NULL, 0, NULL, 0, y, (ptrdiff_t)k,
                      w, wcode, 0.0, rstd, eps};
    advise_output(dtype, y, m * k);
    /* out of memory (a 16-bit weight's widened row): nothing written, as documented */
    (void)rms_forward(rms_isa_current(), &a, rms_threads_get(), pool);
}

static int capi_backward(int dtype, const void *dy, const void *x, const void *w, int flags,
                         const void *rstd, void *dx, void *dgamma, size_t m, size_t k,
                         const rms_pool *pool) {
    int ccode = dtype == RMS_F64 ? RMS_F64 : RMS_F32, s16 = sixteen_bit(dtype);
    rms_bwd_args a = {dtype, 0, m, k, dy, (ptrdiff_t)k, x, (ptrdiff_t)k, dx, (ptrdiff_t)k, w,
                      s16 && (flags & RMS_CAPI_W_AS_X) ? dtype : ccode, 0.0, rstd, dgamma,
                      s16 && m == 1 && (flags & RMS_CAPI_DG_AS_X) ? dtype : ccode};
    advise_output(dtype, dx, m * k);
    return rms_backward(rms_isa_current(), &a, rms_threads_get(), pool);
}

static void capi_convert(int dtype, const void *src, void *dst, double offset, size_t n,
                         int widen) {
    rms_convert(&rms_isa_current()->k[dtype], dtype, src, dst, offset, n, widen, 1);
}

/* A 16-bit weight goes to the driver as it is for a few rows or long ones (the driver widens
 * it on its own threads); for many short rows the caller widens it once and keeps it. The bits
 * are the same either way. */
static int capi_weight_as_is(int dtype, size_t m, size_t k) {
    return sixteen_bit(dtype) && (m < 8 || k >= 8192);
}

static const rms_capi c_api = {RMS_CAPI_VERSION, capi_forward, capi_backward, capi_convert,
                               capi_weight_as_is};

/* ---------------------------------------------------------------- module */

#define KW (METH_FASTCALL | METH_KEYWORDS)
static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, KW,
     "rms_norm(x, gamma=None, eps=1e-6, *, offset=0.0, cast='end', out=None) -> (y, rstd)\n\n"
     "RMSNorm over the trailing gamma.ndim axes of x (the last axis when gamma is None):\n"
     "rstd = 1/sqrt(mean(x**2) + eps), y = x * rstd * (offset + gamma), rounded once to x.dtype\n"
     "(cast='before_weight' rounds x * rstd first). rstd is float32 (float64 for float64 x)."},
    {"add_rms_norm", (PyCFunction)(void (*)(void))py_add_rms_norm, KW,
     "add_rms_norm(x, residual, gamma=None, eps=1e-6, *, offset=0.0, cast='end', out=None,\n"
     "             residual_out=None) -> (y, rstd, h)\n\n"
     "Fused residual add: h = x + residual rounded to x.dtype, then y, rstd = rms_norm(h, ...),\n"
     "in one pass over memory. residual_out=residual updates the residual stream in place."},
    {"rms_norm_backward", (PyCFunction)(void (*)(void))py_rms_norm_backward, KW,
     "rms_norm_backward(dy, x, gamma, rstd, *, offset=0.0, out=None) -> (dx, dgamma)\n\n"
     "Gradients of rms_norm given the saved rstd. dx has x's dtype (out=dy reuses dy's buffer);\n"
     "dgamma is accumulated in float32 (float64 for float64 x) and returned in gamma's dtype,\n"
     "or None when gamma is None."},
    {"get_num_threads", py_get_num_threads, METH_NOARGS,
     "get_num_threads() -> int: threads the kernels may use."},
    {"set_num_threads", py_set_num_threads, METH_O,
     "set_num_threads(n): threads the kernels may use (n >= 1); OpenMP's global state is untouched."},
    {"isa", py_isa, METH_NOARGS, "isa() -> str: the kernel family in use."},
    {"available_isas", py_available_isas, METH_NOARGS,
     "available_isas() -> list[str]: kernel families this CPU and build can run, best first."},
    {"set_isa", py_set_isa, METH_O, "set_isa(name): switch the kernel family (ValueError if unavailable)."},
    {"_variants", py_variants, METH_NOARGS,
     "_variants() -> list[str]: every kernel table available here by its own name, a family's "
     "variants included (for tests: avx512bf16 is the avx512 family's with AVX512-BF16)."},
    {"_variant", py_variant, METH_NOARGS, "_variant() -> str: the own name of the table in use."},
    {"_set_variant", py_set_variant, METH_O, "_set_variant(name): select a table by its own name."},
    {"have_openmp", py_have_openmp, METH_NOARGS, "have_openmp() -> bool: built with OpenMP."},
    {"stream_bytes", py_stream_bytes, METH_NOARGS,
     "stream_bytes() -> (threshold, l3): outputs of threshold bytes or more bypass the cache;\n"
     "l3 is the L3 size it came from (0 if unknown; RMSNORM_STREAM_BYTES overrides)."},
    {"_last_team_size", py_last_team_size, METH_NOARGS,
     "_last_team_size() -> int: threads of the last forward, add or backward (1: the caller's)."},
    {"_set_min_per_thread", py_set_min_per_thread, METH_O,
     "_set_min_per_thread(n) -> int: the fewest elements a thread gets (0: split whenever\n"
     "possible); returns the previous value. For tests."},
    {"_set_stream_bytes", py_set_stream_bytes, METH_O,
     "_set_stream_bytes(n) -> int: outputs of n bytes or more stream (0: every one where\n"
     "alignment allows); returns the previous value. For tests."},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL,
     "copy(src, dst, prefetch=False): threaded copy of contiguous arrays (roofline reference "
     "for benchmarks); with prefetch, each line is also prefetched 4 KiB ahead."},
    {"triad", (PyCFunction)(void (*)(void))py_triad, METH_FASTCALL,
     "triad(a, b, dst): dst = a + 0.5*b, threaded (roofline reference for benchmarks)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_core",
                                       "RMSNorm kernels for NumPy arrays.", -1, methods,
                                       NULL, NULL, NULL, NULL};

/* bfloat16 comes from ml_dtypes; without it the other dtypes still work. */
static void find_bfloat16(void) {
    PyObject *mod = PyImport_ImportModule("ml_dtypes");
    if (!mod) {
        PyErr_Clear();
        return;
    }
    PyObject *type = PyObject_GetAttrString(mod, "bfloat16");
    PyArray_Descr *d = NULL;
    if (type && PyArray_DescrConverter(type, &d) == NPY_SUCCEED) {
        bf16_typenum = d->type_num;
        Py_DECREF(d);
    }
    PyErr_Clear();
    Py_XDECREF(type);
    Py_DECREF(mod);
}

PyMODINIT_FUNC PyInit__core(void) {
    import_array();
    rms_dispatch_init();
    rms_threads_init();
    find_bfloat16();
    if (rms_env_warning() && PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "rmsnorm: %s",
                                              rms_env_warning()) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&moduledef);
    PyObject *cap = mod ? PyCapsule_New((void *)&c_api, "rmsnorm._core._c_api", NULL) : NULL;
    if (!cap || PyModule_AddObject(mod, "_c_api", cap) < 0) {
        Py_XDECREF(cap);
        Py_XDECREF(mod);
        return NULL;
    }
    return mod;
}
