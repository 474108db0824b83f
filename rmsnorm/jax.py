# JAX adapter: rms_norm with a custom VJP whose forward and backward run the rmsnorm C kernels,
# through an XLA FFI custom call where one can be built, else through jax.pure_callback.
"""JAX bindings for rmsnorm (CPU).

``import rmsnorm.jax`` is opt-in: the core package never imports it.

:func:`rms_norm` works under :func:`jax.jit`, :func:`jax.grad` and :func:`jax.vmap`. Its forward
returns ``y`` and the per-row ``rstd``; the VJP reuses that ``rstd``.

Two backends, chosen at import (``BACKEND``):

* ``"ffi"``: XLA FFI custom calls (``rmsnorm/_jax_ffi.c``, compiled at first import against the
  installed jaxlib's headers with the system C compiler and cached) run the kernels directly on
  XLA's buffers, with no copies. Under vmap they run once per batch element.
* ``"callback"``: ``jax.pure_callback``, which copies arguments and results. It is used when no
  compiler is available or ``RMSNORM_JAX_FFI=0``. Under vmap the callbacks use
  ``vmap_method="expand_dims"``: a batch with a shared weight is one kernel call.

The FFI handlers are registered for the CPU only. Where XLA compiles for another platform (arrays
on a GPU with a CUDA or ROCm JAX), the call takes the ``pure_callback`` path there: the arrays are
copied to the host and back, and the same kernels run on the host's cores.
"""

import ctypes
import functools
import hashlib
import math
import numbers
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # pragma: no cover - exercised by simulating a missing jax
    raise ImportError(
        "rmsnorm.jax needs JAX, which is not installed: pip install rmsnorm[jax]"
    ) from exc

import rmsnorm as _rmsnorm

__all__ = ["BACKEND", "reuse_large_buffers", "rms_norm"]

_SUPPORTED_DTYPES = tuple(
    np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
)


def rms_norm(x, weight=None, eps=1e-6, offset=0.0):
    """RMSNorm of ``x`` over ``weight``'s trailing axes: ``y = x * rstd * (offset + weight)``.

    ``weight`` is None (normalize the last axis, no scale; ``offset`` ignored) or an array whose
    shape equals the trailing ``weight.ndim`` axes of ``x``; its dtype may differ from ``x``'s.
    ``eps`` and ``offset`` are Python floats (static: they are not traced or differentiated).
    Returns ``y`` with ``x``'s shape and dtype; differentiable in ``x`` and ``weight``.
    """
    x = jnp.asarray(x)
    weight = None if weight is None else jnp.asarray(weight)
    _check_arrays(x, weight)
    return _rms_norm(x, weight, _check_eps(eps), _as_float(offset, "offset"))


def _as_float(value, name):
    """A Python float from a real number; traced or array values are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
    return float(value)


def _check_eps(eps):
    """eps as a float, finite and >= 0."""
    eps = _as_float(eps, "eps")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return eps


def _check_arrays(x, weight):
    """Fail at trace time with a clear message rather than inside a host callback."""
    for name, array in (("x", x), ("weight", weight)):
        if array is not None and np.dtype(array.dtype) not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"rmsnorm.jax supports float16, bfloat16, float32 and float64; "
                f"{name} has dtype {array.dtype}"
            )
    if x.ndim == 0:
        raise ValueError("x must have at least one axis, got shape ()")
    norm_shape = x.shape[-1:] if weight is None else weight.shape
    if weight is not None and (
        weight.ndim == 0 or weight.ndim > x.ndim or x.shape[-weight.ndim :] != weight.shape
    ):
        raise ValueError(
            f"weight of shape {weight.shape} does not match the trailing axes of x of shape "
            f"{x.shape}"
        )
    if math.prod(norm_shape) == 0:
        raise ValueError(f"the normalized axes {norm_shape} have no elements")


def _rstd_dtype(x_dtype):
    return np.dtype(np.float64 if x_dtype == np.float64 else np.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x, weight, eps, offset):
    return _forward(x, weight, eps, offset)[0]


def _rms_norm_fwd(x, weight, eps, offset):
    y, rstd = _forward(x, weight, eps, offset)
    return y, (x, weight, rstd)


def _rms_norm_bwd(eps, offset, residuals, dy):
    del eps  # the saved rstd already includes it
    x, weight, rstd = residuals
    return _backward(dy, x, weight, rstd, offset)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def _forward(x, weight, eps, offset):
    """(y, rstd) from the kernels."""
    if BACKEND == "ffi":
        return _on_platform(_ffi_forward, _callback_forward, (x, weight), (eps, offset))
    return _callback_forward(x, weight, eps, offset)


def _callback_forward(x, weight, eps, offset):
    norm_ndim = 1 if weight is None else weight.ndim
    result_shapes = (
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(x.shape[: x.ndim - norm_ndim], _rstd_dtype(x.dtype)),
    )
    host = functools.partial(_host_forward, eps=eps, offset=offset, x_ndim=x.ndim)
    return jax.pure_callback(host, result_shapes, x, weight, vmap_method="expand_dims")


def _backward(dy, x, weight, rstd, offset):
    """(dx, dweight) from the kernels; dweight is None when weight is None."""
    if BACKEND == "ffi":
        return _on_platform(_ffi_backward, _callback_backward, (dy, x, weight, rstd), (offset,))
    return _callback_backward(dy, x, weight, rstd, offset)


def _callback_backward(dy, x, weight, rstd, offset):
    if weight is None:
        result_shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype), None)
    else:
        result_shapes = (
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(weight.shape, weight.dtype),
        )
    host = functools.partial(_host_backward, offset=offset, x_ndim=x.ndim)
    return jax.pure_callback(host, result_shapes, dy, x, weight, rstd, vmap_method="expand_dims")


def _on_platform(ffi, callback, arrays, floats):
    """``ffi(*arrays, *floats)`` where XLA compiles for the CPU, ``callback(...)`` elsewhere.

    The FFI handlers are registered for the CPU only. Where the arrays live on another device
    (a GPU, say), the host callback copies them to the host and back and runs the same kernels.
    The floats (eps, offset) stay Python floats: only the arrays go through the branch."""
    return jax.lax.platform_dependent(
        *arrays,
        cpu=lambda *a: ffi(*a, *floats),
        default=lambda *a: callback(*a, *floats),
    )


# Host side. Under vmap(expand_dims) every argument gets the same number of new leading axes,
# of the batch size when that argument is batched and of size 1 when it is not.


def _split_batch(x, x_ndim, *others):
    """Number of vmap axes in front of x, and their broadcast shape over all arguments."""
    lead = x.ndim - x_ndim
    shapes = [a.shape[:lead] for a in (x, *others) if a is not None]
    return lead, np.broadcast_shapes(*shapes)


def _expand(array, batch, lead):
    """Broadcast the vmap axes of ``array`` to ``batch`` (a zero-copy view)."""
    return np.broadcast_to(array, batch + array.shape[lead:])


def _is_unbatched(array, lead):
    return all(n == 1 for n in array.shape[:lead])


def _host_forward(x, weight, *, eps, offset, x_ndim):
    x = np.asarray(x)
    weight = None if weight is None else np.asarray(weight)
    lead, batch = _split_batch(x, x_ndim, weight)
    x = _expand(x, batch, lead)
    if weight is None or _is_unbatched(weight, lead):
        # Shared weight: the vmap axes are just more rows, one kernel call does them all.
        gamma = None if weight is None else weight.reshape(weight.shape[lead:])
        return _rmsnorm.rms_norm(x, gamma, eps, offset=offset)
    weight = _expand(weight, batch, lead)
    y = np.empty(x.shape, x.dtype)
    rstd = np.empty(x.shape[: x.ndim - (weight.ndim - lead)], _rstd_dtype(x.dtype))
    for index in np.ndindex(*batch):
        _, rstd[index] = _rmsnorm.rms_norm(
            x[index], weight[index], eps, offset=offset, out=y[index]
        )
    return y, rstd


def _host_backward(dy, x, weight, rstd, *, offset, x_ndim):
    dy, x, rstd = np.asarray(dy), np.asarray(x), np.asarray(rstd)
    weight = None if weight is None else np.asarray(weight)
    lead, batch = _split_batch(x, x_ndim, dy, weight, rstd)
    dy, x, rstd = (_expand(a, batch, lead) for a in (dy, x, rstd))
    if weight is None or not batch:
        # No weight gradient to keep per batch element: all rows in one kernel call.
        gamma = None if weight is None else weight.reshape(weight.shape[lead:])
        return _rmsnorm.rms_norm_backward(dy, x, gamma, rstd, offset=offset)
    # Each batch element needs its own weight gradient, so run the kernel per element.
    weight = _expand(weight, batch, lead)
    dx = np.empty(x.shape, x.dtype)
    dweight = np.empty(weight.shape, weight.dtype)
    for index in np.ndindex(*batch):
        _, dweight[index] = _rmsnorm.rms_norm_backward(
            dy[index], x[index], weight[index], rstd[index], offset=offset, out=dx[index]
        )
    return dx, dweight


# FFI backend. The kernels see x as rows of its normalized axes. The weight goes as it is when
# its dtype is the compute type, or float16 / bfloat16 with a float32 compute type (the handler
# widens it and adds the offset, or for a few rows of x's own dtype passes it as it is: XLA's own
# 16-bit conversions cost more than a small call);
# other dtypes are converted here first. An empty weight array stands for no weight.


def _ffi_rows(x, weight):
    k = x.shape[-1] if weight is None else math.prod(weight.shape)
    lead = x.shape[: x.ndim - (1 if weight is None else weight.ndim)]
    return x.reshape(lead + (k,)), lead


_SIXTEEN_BIT = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def _ffi_weight(weight, compute):
    if weight is None:
        return jnp.zeros((0,), compute)
    w = weight.reshape(-1)
    if w.dtype == compute or (compute == np.float32 and w.dtype in _SIXTEEN_BIT):
        return w
    return w.astype(compute)


def _ffi_forward(x, weight, eps, offset):
    compute = _rstd_dtype(x.dtype)
    rows, lead = _ffi_rows(x, weight)
    call = jax.ffi.ffi_call(
        "rmsnorm_forward",
        (jax.ShapeDtypeStruct(rows.shape, x.dtype), jax.ShapeDtypeStruct(lead, compute)),
        vmap_method="sequential",
    )
    y, rstd = call(
        rows, _ffi_weight(weight, compute), eps=np.float64(eps), offset=np.float64(offset)
    )
    return y.reshape(x.shape), rstd


def _ffi_backward(dy, x, weight, rstd, offset):
    compute = _rstd_dtype(x.dtype)
    rows, _ = _ffi_rows(x, weight)
    w = _ffi_weight(weight, compute)
    call = jax.ffi.ffi_call(
        "rmsnorm_backward",
        (jax.ShapeDtypeStruct(rows.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype)),
        vmap_method="sequential",
    )
    dx, dw = call(dy.reshape(rows.shape), rows, w, rstd, offset=np.float64(offset))
    dweight = None if weight is None else dw.reshape(weight.shape).astype(weight.dtype)
    return dx.reshape(x.shape), dweight


def _build_ffi():
    """Compile (once, cached by content) and register the FFI handlers; True on success."""
    here = Path(__file__).parent
    source = here / "_jax_ffi.c"
    include = Path(jax.ffi.include_dir())
    digest = hashlib.sha256()
    for part in (source, here / "rms_capi.h", include / "xla" / "ffi" / "api" / "c_api.h"):
        digest.update(part.read_bytes())
    cache = Path(os.environ.get("RMSNORM_CACHE_DIR", Path.home() / ".cache" / "rmsnorm"))
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir()) / "rmsnorm-cache"
        cache.mkdir(parents=True, exist_ok=True)
    library = cache / f"jax_ffi_{digest.hexdigest()[:16]}.so"
    if not library.exists():
        compiler = _compiler()
        scratch = library.with_suffix(f".{os.getpid()}.tmp")
        command = [compiler, "-O2", "-std=gnu11", "-shared", "-fPIC", f"-I{include}", f"-I{here}"]
        done = subprocess.run(command + [str(source), "-o", str(scratch)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(scratch, library)
    lib = ctypes.CDLL(str(library))
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    lib.rmsnorm_ffi_init.argtypes = [ctypes.c_void_p]
    lib.rmsnorm_ffi_init.restype = ctypes.c_int
    if lib.rmsnorm_ffi_init(get_pointer(_rmsnorm._core._c_api, b"rmsnorm._core._c_api")) != 0:
        raise RuntimeError("rmsnorm._core speaks another version of the C API than _jax_ffi.c")
    for name in ("forward", "backward"):
        handler = getattr(lib, f"rmsnorm_ffi_{name}")
        jax.ffi.register_ffi_target(f"rmsnorm_{name}", jax.ffi.pycapsule(handler), platform="cpu")
    globals()["_ffi_library"] = lib  # keep it loaded
    return True


def _compiler():
    """The first C compiler found: $CC, Python's own, cc, gcc."""
    names = [os.environ.get("CC", ""), sysconfig.get_config_var("CC") or "", "cc", "gcc"]
    for name in names:
        found = name.split()[0] if name.split() else None
        if found and shutil.which(found):
            return found
    raise FileNotFoundError("no C compiler found ($CC, cc, gcc)")


FFI_ERROR = None  # why the FFI backend could not be built, when it could not


def _choose_backend():
    global FFI_ERROR
    if os.environ.get("RMSNORM_JAX_FFI", "1") == "0":
        return "callback"
    try:
        return "ffi" if _build_ffi() else "callback"
    except Exception as exc:  # no compiler, no headers, an older jaxlib: callbacks always work
        FFI_ERROR = f"{type(exc).__name__}: {exc}"
        return "callback"


BACKEND = _choose_backend()


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def reuse_large_buffers(limit=2**31 - 1):
    """Let this process reuse the memory of freed large blocks (glibc on Linux); opt-in.

    XLA's CPU backend gives every call fresh output buffers. glibc serves blocks above 32 MiB
    with a new ``mmap`` and unmaps them when freed, so each call pays page faults and the
    kernel's zeroing of every page: for a 4096x4096 float32 forward that is several times the
    time of the kernel itself. This asks glibc to serve blocks up to ``limit`` bytes from its
    heap and to keep freed memory mapped, so the next call's buffers reuse pages already
    faulted in. XLA allocates from its worker threads, and glibc's per-thread heaps cannot
    hold a block of 64 MiB or more, so this also makes threads created from now on share the
    main heap (one malloc arena). It affects the whole process: its resident memory stays
    near its peak, and threads that allocate at once take turns on one heap lock. The
    environment variables ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` and
    ``MALLOC_ARENA_MAX=1`` do the same from process start.

    Returns True when glibc took every setting, False where there is no glibc ``mallopt``.
    """
    limit = int(limit)
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    limit = min(limit, 2**31 - 1)
    settings = ((_M_MMAP_THRESHOLD, limit), (_M_TRIM_THRESHOLD, limit), (_M_ARENA_MAX, 1))
    return all([bool(mallopt(option, value)) for option, value in settings])
