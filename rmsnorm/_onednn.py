"""A minimal ctypes binding to oneDNN's RMS-mode layer normalization, for ``rmsnorm.bench``.

The benchmark times oneDNN (``libdnnl.so.3``) as a peer of this library's RMSNorm on CPU, where
a oneDNN with the layer normalization's RMS mode (``dnnl_rms_norm``) can be loaded: the
``onednn-cpu-gomp`` wheel (oneDNN 3.2) predates that mode; the ``onednn`` wheel (3.13, a SYCL
build) has it and runs on the CPU through Intel's OpenCL CPU runtime (``benchmarks/NOTES.md``
says how). Only what the benchmark needs is bound: the layer-normalization
primitive with ``dnnl_use_scale | dnnl_rms_norm`` on a plain row-major ``(m, k)`` tensor,
normalized over ``k``, run forward (training, so it writes the per-row statistic) and, on
request, backward (``diff_src`` and ``diff_scale``).

oneDNN's statistic is ``var = mean(x**2)`` per row (float32), so ``rstd = 1 / sqrt(var + eps)``
and ``y = x * rstd * gamma``. ``gamma``, its gradient and ``var`` are float32; ``x``, ``y``,
``dy`` and ``dx`` share the dtype given at construction (float32, bfloat16 or float16).

>>> op = RMSNorm(m, k, np.float32, 1e-6, backward=True)
>>> op.forward(x, gamma, y, var)
>>> op.backward(dy, x, gamma, var, dx, dgamma)
>>> op.close()

Nothing here is imported by the package itself; ``load`` raises ``OSError`` when the library is
missing, which the benchmark treats as "peer not installed".
"""

import ctypes
import ctypes.util
import os
import sys

import ml_dtypes
import numpy as np

__all__ = ["RMSNorm", "load", "version"]

# Values from oneDNN's C API headers (dnnl_common_types.h, dnnl_types.h); stable across 3.x.
_STATUS_NAMES = {
    0: "dnnl_success",
    1: "dnnl_out_of_memory",
    2: "dnnl_invalid_arguments",
    3: "dnnl_unimplemented",
    4: "dnnl_last_impl_reached",
    5: "dnnl_runtime_error",
    6: "dnnl_not_required",
    7: "dnnl_invalid_graph",
    8: "dnnl_invalid_graph_op",
    9: "dnnl_invalid_shape",
    10: "dnnl_invalid_data_type",
}
_SUCCESS = 0
_UNIMPLEMENTED = 3

_DATA_TYPES = {  # dnnl_data_type_t
    np.dtype(np.float16): 1,  # dnnl_f16
    np.dtype(ml_dtypes.bfloat16): 2,  # dnnl_bf16
    np.dtype(np.float32): 3,  # dnnl_f32
}
_F32 = 3
_NP_F32 = np.dtype(np.float32)
_TAG_A = 2  # dnnl_a: plain 1-D
_TAG_AB = 3  # dnnl_ab: plain 2-D, row-major
_ENGINE_CPU = 1  # dnnl_cpu
_STREAM_DEFAULT_FLAGS = 0x1  # dnnl_stream_in_order
_FORWARD_TRAINING = 64  # dnnl_forward_training
_BACKWARD = 128  # dnnl_backward
_USE_SCALE = 0x2  # dnnl_use_scale
_RMS_NORM = 0x20  # dnnl_rms_norm
_MAX_NDIMS = 12  # DNNL_MAX_NDIMS

_ARG_SRC = 1
_ARG_DST = 17
_ARG_VARIANCE = 50
_ARG_SCALE = 51
_ARG_DIFF_SRC = 129
_ARG_DIFF_DST = 145
_ARG_DIFF_SCALE = 255

_p = ctypes.c_void_p
_pp = ctypes.POINTER(ctypes.c_void_p)
_Dims = ctypes.c_int64 * _MAX_NDIMS


class _ExecArg(ctypes.Structure):
    """``dnnl_exec_arg_t``: an argument index and the memory object bound to it."""

    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


# name: argtypes; every function returns dnnl_status_t.
_SIGNATURES = {
    "dnnl_engine_create": [_pp, ctypes.c_int, ctypes.c_size_t],
    "dnnl_engine_destroy": [_p],
    "dnnl_stream_create": [_pp, _p, ctypes.c_uint],
    "dnnl_stream_wait": [_p],
    "dnnl_stream_destroy": [_p],
    "dnnl_memory_desc_create_with_tag": [_pp, ctypes.c_int, _Dims, ctypes.c_int, ctypes.c_int],
    "dnnl_memory_desc_destroy": [_p],
    "dnnl_memory_create": [_pp, _p, _p, _p],
    "dnnl_memory_set_data_handle": [_p, _p],
    "dnnl_memory_destroy": [_p],
    "dnnl_layer_normalization_forward_primitive_desc_create": [
        _pp, _p, ctypes.c_int, _p, _p, _p, ctypes.c_float, ctypes.c_uint, _p,
    ],
    "dnnl_layer_normalization_backward_primitive_desc_create": [
        _pp, _p, ctypes.c_int, _p, _p, _p, _p, ctypes.c_float, ctypes.c_uint, _p, _p,
    ],
    "dnnl_primitive_desc_destroy": [_p],
    "dnnl_primitive_create": [_pp, _p],
    "dnnl_primitive_execute": [_p, _p, ctypes.c_int, ctypes.POINTER(_ExecArg)],
    "dnnl_primitive_destroy": [_p],
}

_loaded = {}  # resolved path -> declared CDLL


class _Version(ctypes.Structure):
    """``dnnl_version_t``."""

    _fields_ = [
        ("major", ctypes.c_int),
        ("minor", ctypes.c_int),
        ("patch", ctypes.c_int),
        ("hash", ctypes.c_char_p),
        ("cpu_runtime", ctypes.c_uint),
        ("gpu_runtime", ctypes.c_uint),
    ]


def _declare(lib):
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    lib.dnnl_version.argtypes = []
    lib.dnnl_version.restype = ctypes.POINTER(_Version)
    return lib


def version(lib=None):
    """The loaded oneDNN's version, e.g. "3.13.0"."""
    v = (lib if lib is not None else load()).dnnl_version().contents
    return f"{v.major}.{v.minor}.{v.patch}"


def load(path=None):
    """Load (once) and return oneDNN's shared library as a ``ctypes.CDLL``.

    Tried in order: ``path``; the ``RMSNORM_ONEDNN_LIB`` environment variable;
    ``<sys.prefix>/lib/libdnnl.so.3`` (where oneDNN's wheels put it);
    ``ctypes.util.find_library("dnnl")``. Raises ``OSError`` when none of them loads.
    """
    if path is not None:
        candidates = [os.fspath(path)]
    else:
        candidates = [
            os.environ.get("RMSNORM_ONEDNN_LIB"),
            os.path.join(sys.prefix, "lib", "libdnnl.so.3"),
            ctypes.util.find_library("dnnl"),
        ]
    errors = []
    for candidate in candidates:
        if not candidate:
            continue
        if candidate in _loaded:
            return _loaded[candidate]
        try:
            lib = _declare(ctypes.CDLL(candidate))
        except (OSError, AttributeError) as exc:  # AttributeError: not oneDNN 3.x
            errors.append(f"{candidate}: {exc}")
            continue
        _loaded[candidate] = lib
        return lib
    tried = "; ".join(errors) if errors else "no candidate path"
    raise OSError(
        "oneDNN (libdnnl.so.3) could not be loaded; set RMSNORM_ONEDNN_LIB to the library's "
        f"path ({tried})"
    )


def _status_name(status):
    return _STATUS_NAMES.get(status, f"unknown status {status}")


def _check(status, name):
    if status != _SUCCESS:
        raise RuntimeError(f"{name} failed: {_status_name(status)} ({status})")


class RMSNorm:
    """oneDNN's RMSNorm over the last axis of a C-contiguous ``(m, k)`` array.

    ``dtype`` (float32, bfloat16 or float16) is the type of ``x``, ``y``, ``dy`` and ``dx``;
    ``gamma``, ``dgamma`` and ``var`` are float32. With ``backward=True`` the backward primitive
    is built too. Raises ``NotImplementedError`` when oneDNN has no implementation for the
    dtype on this CPU (e.g. float16 without AVX512-FP16 / AVX-NE-CONVERT).

    The methods write into the arrays they are given and check only dtype, shape and
    contiguity, so the per-call cost stays close to oneDNN's own.
    """

    def __init__(self, m, k, dtype, eps, backward=False, *, lib=None):
        # Set first so close() works whatever point construction fails at.
        self._mds = []
        self._mems = []
        self._prims = []
        self._pds = []
        self._stream = None
        self._engine = None
        self._lib = lib if lib is not None else load()
        self.m, self.k = int(m), int(k)
        if self.m < 1 or self.k < 1:
            raise ValueError(f"m and k must be positive, got ({m}, {k})")
        self.dtype = np.dtype(dtype)
        if self.dtype not in _DATA_TYPES:
            raise TypeError(f"dtype must be float32, bfloat16 or float16, got {self.dtype}")
        self.eps = float(eps)
        self.has_backward = bool(backward)
        L = self._lib

        engine = ctypes.c_void_p()
        _check(L.dnnl_engine_create(ctypes.byref(engine), _ENGINE_CPU, 0), "dnnl_engine_create")
        self._engine = engine
        stream = ctypes.c_void_p()
        _check(
            L.dnnl_stream_create(ctypes.byref(stream), engine, _STREAM_DEFAULT_FLAGS),
            "dnnl_stream_create",
        )
        self._stream = stream

        data_md = self._md((self.m, self.k), _DATA_TYPES[self.dtype], _TAG_AB)
        scale_md = self._md((self.k,), _F32, _TAG_A)
        stat_md = self._md((self.m,), _F32, _TAG_A)
        flags = _USE_SCALE | _RMS_NORM

        fwd_pd = self._pd(
            "dnnl_layer_normalization_forward_primitive_desc_create",
            engine, _FORWARD_TRAINING, data_md, data_md, stat_md, self.eps, flags, None,
        )
        # (execution argument, descriptor, dtype, shape, name) of each array, in call order
        data = (data_md, self.dtype, (self.m, self.k))
        scale = (scale_md, _NP_F32, (self.k,))
        stat = (stat_md, _NP_F32, (self.m,))
        self._fwd = self._executable(
            fwd_pd,
            (_ARG_SRC, *data, "x"),
            (_ARG_SCALE, *scale, "gamma"),
            (_ARG_DST, *data, "y"),
            (_ARG_VARIANCE, *stat, "var"),
        )
        self._bwd = None
        if self.has_backward:
            bwd_pd = self._pd(
                "dnnl_layer_normalization_backward_primitive_desc_create",
                engine, _BACKWARD, data_md, data_md, data_md, stat_md, self.eps, flags,
                fwd_pd, None,
            )
            self._bwd = self._executable(
                bwd_pd,
                (_ARG_DIFF_DST, *data, "dy"),
                (_ARG_SRC, *data, "x"),
                (_ARG_SCALE, *scale, "gamma"),
                (_ARG_VARIANCE, *stat, "var"),
                (_ARG_DIFF_SRC, *data, "dx"),
                (_ARG_DIFF_SCALE, *scale, "dgamma"),
            )

    # -- construction helpers (each records what it creates for close()) ----------------------

    def _md(self, shape, data_type, tag):
        dims = _Dims(*shape)
        md = ctypes.c_void_p()
        _check(
            self._lib.dnnl_memory_desc_create_with_tag(
                ctypes.byref(md), len(shape), dims, data_type, tag
            ),
            "dnnl_memory_desc_create_with_tag",
        )
        self._mds.append(md)
        return md

    def _pd(self, name, *args):
        pd = ctypes.c_void_p()
        status = getattr(self._lib, name)(ctypes.byref(pd), *args)
        if status == _UNIMPLEMENTED:
            raise NotImplementedError(
                f"{name}: oneDNN has no RMS-norm implementation for {self.dtype} "
                f"({self.m}x{self.k}) on this CPU ({_status_name(status)})"
            )
        _check(status, name)
        self._pds.append(pd)
        return pd

    def _primitive(self, pd):
        prim = ctypes.c_void_p()
        _check(self._lib.dnnl_primitive_create(ctypes.byref(prim), pd), "dnnl_primitive_create")
        self._prims.append(prim)
        return prim

    def _memory(self, md):
        mem = ctypes.c_void_p()
        _check(
            self._lib.dnnl_memory_create(ctypes.byref(mem), md, self._engine, None),
            "dnnl_memory_create",
        )
        self._mems.append(mem)
        return mem

    def _executable(self, pd, *specs):
        """The primitive of ``pd`` with a memory object, without a buffer, for each array of
        ``specs`` ((argument, descriptor, dtype, shape, name) in call order): a list of the
        primitive, its execution arguments, the memories, the specs and the data handles last
        set (each call points the memories at the caller's arrays, see :meth:`_execute`)."""
        prim = self._primitive(pd)
        mems = [self._memory(md) for _, md, _, _, _ in specs]
        args = (_ExecArg * len(specs))()
        for slot, (arg, *_), mem in zip(args, specs, mems):
            slot.arg, slot.memory = arg, mem.value
        return [prim, args, mems, specs, [None] * len(specs)]

    # -- execution ------------------------------------------------------------------------------

    def _execute(self, exe, arrays):
        """Run an :meth:`_executable` on ``arrays``, each checked against its spec; a memory's
        data handle is set only when its array's address changed."""
        if self._stream is None:
            raise RuntimeError("RMSNorm is closed")
        prim, args, mems, specs, ptrs = exe
        L = self._lib
        for i, (a, mem, (_, _, dtype, shape, name)) in enumerate(zip(arrays, mems, specs)):
            if a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
                raise ValueError(
                    f"{name} must be a C-contiguous {dtype} array of shape {shape}, "
                    f"got {a.dtype} {a.shape}"
                )
            ptr = a.ctypes.data
            if ptrs[i] != ptr:
                ptrs[i] = None
                _check(L.dnnl_memory_set_data_handle(mem, ptr), "dnnl_memory_set_data_handle")
                ptrs[i] = ptr
        _check(L.dnnl_primitive_execute(prim, self._stream, len(args), args),
               "dnnl_primitive_execute")
        _check(L.dnnl_stream_wait(self._stream), "dnnl_stream_wait")

    def forward(self, x, gamma, y, var):
        """y = x / sqrt(mean(x**2) + eps) * gamma, row-wise; var[i] = mean(x[i]**2). Returns y."""
        self._execute(self._fwd, (x, gamma, y, var))
        return y

    def backward(self, dy, x, gamma, var, dx, dgamma):
        """Gradients of :meth:`forward` given its ``var``: writes dx and dgamma, returns both.

        ``dgamma`` is overwritten (not accumulated) with ``sum_rows(dy * x * rstd)``.
        """
        if self._bwd is None:
            raise RuntimeError("RMSNorm was constructed without backward=True")
        self._execute(self._bwd, (dy, x, gamma, var, dx, dgamma))
        return dx, dgamma

    # -- teardown -------------------------------------------------------------------------------

    def close(self):
        """Release every oneDNN object; safe to call more than once or after a failed init.

        Everything is released even if a destroy call fails; the first failure is then raised.
        """
        L = getattr(self, "_lib", None)
        if L is None:
            return
        failed = None
        for attr, name in (
            ("_prims", "dnnl_primitive_destroy"),
            ("_pds", "dnnl_primitive_desc_destroy"),
            ("_mems", "dnnl_memory_destroy"),
            ("_mds", "dnnl_memory_desc_destroy"),
            ("_stream", "dnnl_stream_destroy"),
            ("_engine", "dnnl_engine_destroy"),
        ):
            handles = getattr(self, attr, None)
            if not isinstance(handles, list):  # stream and engine: one handle or None
                setattr(self, attr, None)
                handles = [] if handles is None else [handles]
            while handles:
                status = getattr(L, name)(handles.pop())
                if status != _SUCCESS and failed is None:
                    failed = (status, name)
        if failed is not None:
            _check(*failed)

    def __del__(self):
        try:
            self.close()
        except Exception:  # never raise from a finalizer
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
