# JAX adapter: rms_norm and add_rms_norm with a custom VJP whose forward and backward run the
# rmsnorm C kernels, through an XLA FFI custom call where one can be built, else through
# jax.pure_callback, each device on its own rows of a sharded array.
"""JAX bindings for rmsnorm (CPU).

``import rmsnorm.jax`` is opt-in: the core package never imports it.

:func:`rms_norm` and :func:`add_rms_norm` work under :func:`jax.jit`, :func:`jax.grad` and
:func:`jax.vmap`. The forward returns ``y`` and the per-row ``rstd``; the VJP reuses that ``rstd``.
Under vmap, a weight shared by the batch makes the batch just more rows (one kernel call); a
batched weight, or per-example weight gradients, run once per batch element.

Sharded arrays (``NamedSharding`` on a mesh of several devices), inside ``jit``: each device
normalizes its own rows, with no all-gather of x, and the backward sums the weight gradient across
the devices that hold different rows (a ``psum`` of float32 partials, float64 for float64 x,
rounded to the weight's dtype once). With a mesh of Auto axes this is a ``custom_partitioning``
of the kernel call; with Explicit axes, where the sharding is part of the arrays' types, a
``shard_map``. The normalized axes must be whole on each device: where x is sharded along one,
XLA gathers them first (the result is correct; the all-gather costs what it costs). Two cases
also take the gathered route: per-example weight gradients under vmap with Auto axes, and the
``"callback"`` backend with Auto axes (XLA cannot run host callbacks inside a custom partitioning).

Two backends, chosen at import (``BACKEND``):

* ``"ffi"``: XLA FFI custom calls (``rmsnorm/_jax_ffi.c``) run the kernels directly on XLA's
  buffers, with no copies. The handlers are compiled at first import against the installed
  jaxlib's headers (which a plain ``pip install`` of this package does not have at build time,
  and which change with jaxlib) with the system C compiler, and cached in
  ``$RMSNORM_CACHE_DIR``, else ``$XDG_CACHE_HOME/rmsnorm`` or ``~/.cache/rmsnorm``. A shared
  library is loaded only from a directory that no other user can write: the cache must belong
  to this user, with no group or other write bits (it is created, or tightened, to mode 0700),
  in directories that only this user or root can write (or sticky ones, as /tmp); the library
  file is checked the same way just before it is loaded. Where the cache fails a check
  (``CACHE_NOTE`` says why), the handlers are built in a new private ``tempfile.mkdtemp()``
  directory for this process, removed once they are loaded.
* ``"callback"``: ``jax.pure_callback``, which copies arguments and results. It is used when no
  compiler is available or ``RMSNORM_JAX_FFI=0``.

The FFI handlers are registered for the CPU only. Where XLA compiles for another platform (arrays
on a GPU with a CUDA or ROCm JAX), the call takes the ``pure_callback`` path there: the arrays are
copied to the host and back, and the same kernels run on the host's cores.
"""

import ctypes
import functools
import math
import numbers
import os
import shutil
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
from rmsnorm import _jax_build

__all__ = ["BACKEND", "add_rms_norm", "reuse_large_buffers", "rms_norm"]

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


def add_rms_norm(x, residual, weight=None, eps=1e-6, offset=0.0):
    """The pre-norm residual step: ``h = x + residual`` (added in float32, float64 for float64
    x, and rounded to x's dtype, as :func:`rmsnorm.add_rms_norm` does), then
    ``y = rms_norm(h, weight, eps, offset)``. Returns ``(y, h)``; differentiable in x, residual
    and weight (the gradient reaching x and residual is h's).

    XLA does the add (it fuses it with whatever produces x); the kernels normalize h.
    """
    x, residual = jnp.asarray(x), jnp.asarray(residual)
    weight = None if weight is None else jnp.asarray(weight)
    _check_arrays(x, weight)
    if residual.dtype != x.dtype or residual.shape != x.shape:
        raise (TypeError if residual.shape == x.shape else ValueError)(
            f"residual of shape {residual.shape} and dtype {residual.dtype} does not match x of "
            f"shape {x.shape} and dtype {x.dtype}"
        )
    compute = _rstd_dtype(x.dtype)
    h = (x.astype(compute) + residual.astype(compute)).astype(x.dtype)
    return _rms_norm(h, weight, _check_eps(eps), _as_float(offset, "offset")), h


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


def _local_forward(x, weight, eps, offset):
    """(y, rstd) from the kernels, on the arrays of one device."""
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


def _local_backward(dy, x, weight, rstd, offset):
    """(dx, dweight) from the kernels, on the arrays of one device; dweight is None when weight
    is None."""
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


# Sharding. XLA's partitioner knows nothing of a custom call, so under jit it would gather the
# operands of one onto every device. Each call is wrapped in custom_partitioning instead: the
# rows stay where they are, every device runs the kernels on its own rows, and the backward's
# weight gradient, one float32 (float64) partial per device, is summed across the devices that
# hold different rows (psum) and rounded to the weight's dtype once. The normalized axes must be
# whole on each device: where they are sharded, XLA gathers them first (a correct result, with
# the all-gather that costs). With one device the wrapper lowers to the plain call.
#
# custom_partitioning has no batching rule, so custom_vmap gives it one: under vmap a shared
# weight makes the vmapped axis more rows (still partitioned); a batched weight, or the
# backward's per-example weight gradient, runs per batch element as the unwrapped calls do.


def _forward(x, weight, eps, offset):
    """(y, rstd), each device computing its own rows."""
    norm_ndim = 1 if weight is None else weight.ndim
    arrays = (x,) if weight is None else (x, weight)
    return _sharded("forward", norm_ndim, len(arrays), eps, offset)(arrays)


def _backward(dy, x, weight, rstd, offset):
    """(dx, dweight), dweight summed across the devices that hold different rows."""
    norm_ndim = 1 if weight is None else weight.ndim
    arrays = (dy, x, rstd) if weight is None else (dy, x, weight, rstd)
    outs = _sharded("backward", norm_ndim, len(arrays), 0.0, offset)(arrays)
    return outs[0], None if weight is None else outs[1].astype(weight.dtype)


def _local(kind, eps, offset, arrays):
    """The unpartitioned call on ``arrays`` as ``_sharded`` passes them; the backward's
    dweight in the compute type, so that partials from several devices add up unrounded."""
    if kind == "forward":
        x, *weight = arrays
        return _local_forward(x, weight[0] if weight else None, eps, offset)
    dy, x, *weight, rstd = arrays
    dx, dweight = _local_backward(dy, x, weight[0] if weight else None, rstd, offset)
    return (dx,) if dweight is None else (dx, dweight.astype(_rstd_dtype(x.dtype)))


@functools.lru_cache(maxsize=None)
def _sharded(kind, norm_ndim, nargs, eps, offset):
    """``f(arrays)``: the kernels' forward or backward, partitioned by rows and batchable."""
    try:
        partitioned = _partition_by_rows(kind, norm_ndim, nargs, eps, offset)
    except (ImportError, TypeError):  # a JAX without Shardy sharding rules: XLA's gathered route
        partitioned = None

    @jax.custom_batching.custom_vmap
    def call(arrays):
        explicit = _explicit(kind, norm_ndim, nargs, eps, offset, arrays)
        if explicit is not None:
            return explicit(*arrays)
        if BACKEND != "ffi" or partitioned is None:
            # XLA keeps no host callback of a custom partitioning's per-device module alive
            # (it crashes calling it): host callbacks take XLA's default, gathered, route, as
            # does a JAX whose custom_partitioning takes no sharding rule.
            return _local(kind, eps, offset, arrays)
        return jax.lax.platform_dependent(
            *arrays, cpu=partitioned, default=lambda *a: _local(kind, eps, offset, a)
        )

    @call.def_vmap
    def _vmap(axis_size, in_batched, arrays):
        (batched,) = in_batched
        if kind == "forward" and not (nargs == 2 and batched[1]) or nargs == 3:
            # A shared weight (or none, in the backward): the vmapped axis, which custom_vmap
            # moved to the front, is just more rows.
            rows_at = (0,) if kind == "forward" else (0, 1, 2)
            outs = call(
                tuple(
                    a if b or i not in rows_at else jnp.broadcast_to(a, (axis_size,) + a.shape)
                    for i, (a, b) in enumerate(zip(arrays, batched))
                )
            )
        else:
            explicit = _explicit(kind, norm_ndim, nargs, eps, offset, arrays, batched)
            if explicit is not None:
                outs = explicit(*arrays)
            else:
                in_axes = tuple(0 if b else None for b in batched)
                outs = jax.vmap(lambda *a: _local(kind, eps, offset, a), in_axes=in_axes)(*arrays)
        return outs, tuple(True for _ in outs)

    return call


def _row_shardings(kind, norm_ndim, nargs, x_spec, x_ndim, batched=None, batch_entry=None):
    """Per argument and per result of the call, the PartitionSpec that keeps x's rows where
    they are and its normalized axes whole; and the mesh axes that split the rows. Under vmap
    (``batched``: per argument, whether it has the vmapped axis in front), that axis is split
    as ``batch_entry`` says, in every argument that has it and in every result."""
    from jax.sharding import PartitionSpec

    lead = x_ndim - norm_ndim
    rows = (tuple(x_spec) + (None,) * lead)[:lead]
    whole = (*rows, *(None,) * norm_ndim)
    axes = tuple(
        name
        for entry in rows
        if entry is not None
        for name in (entry if isinstance(entry, tuple) else (entry,))
    )
    if kind == "forward":
        args, outs = (whole, ())[:nargs], (whole, rows)
    else:
        args, outs = (whole, whole, ())[: nargs - 1] + (rows,), (whole, ())[: nargs - 2]
    if batched is not None:
        args = tuple((batch_entry, *a) if b else a for a, b in zip(args, batched))
        outs = tuple((batch_entry, *o) for o in outs)
    return (
        tuple(PartitionSpec(*a) for a in args),
        tuple(PartitionSpec(*o) for o in outs),
        axes,
    )


def _per_device(kind, eps, offset, nargs, axes):
    """The call each device makes on its own rows: the backward's dweight, a partial from
    those rows, is summed over ``axes`` (in the compute type, so each partial is unrounded)."""
    if kind == "forward" or nargs == 3 or not axes:
        return lambda *arrays: _local(kind, eps, offset, arrays)

    def backward(dy, x, weight, rstd):
        wide = weight.astype(_rstd_dtype(x.dtype))
        dx, dweight = _local(kind, eps, offset, (dy, x, wide, rstd))
        return dx, jax.lax.psum(dweight, axes)

    return backward


def _explicit(kind, norm_ndim, nargs, eps, offset, arrays, batched=None):
    """Where x's type carries its sharding (a mesh of Explicit axes), a shard_map of the
    per-device call with the arguments resharded to fit it; None otherwise. ``batched``: as in
    custom_vmap's rule (the per-device call is then vmapped on each device's examples)."""
    try:
        from jax.sharding import AxisType, NamedSharding
    except ImportError:  # a JAX from before sharding in types
        return None
    if not hasattr(jax, "typeof"):
        return None
    position = 0 if kind == "forward" else 1
    x = arrays[position]
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    spec, x_ndim, entry = tuple(sharding.spec), x.ndim, None
    if batched is not None:
        if batched[position]:
            spec, x_ndim = (spec + (None,))[1:], x_ndim - 1
        rows_at = (0,) if kind == "forward" else (0, 1, nargs - 1)
        first = next((i for i in rows_at if batched[i]), None)
        if first is not None:
            entry = (tuple(jax.typeof(arrays[first]).sharding.spec) + (None,))[0]
    in_specs, out_specs, axes = _row_shardings(kind, norm_ndim, nargs, spec, x_ndim, batched, entry)
    body = _per_device(kind, eps, offset, nargs, axes)
    if batched is not None:
        body = jax.vmap(body, in_axes=tuple(0 if b else None for b in batched))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def run(*arrays):
        outs = mapped(
            *(jax.sharding.reshard(a, NamedSharding(mesh, p)) for a, p in zip(arrays, in_specs))
        )
        if batched is not None:
            return outs
        # y and dx in x's sharding, dweight in the weight's (when a normalized axis of x was
        # gathered, say), as the types of the arguments they stand for say they are.
        like = (x, None) if kind == "forward" else (x, arrays[2] if nargs == 4 else None)
        return tuple(
            o
            if a is None
            else jax.sharding.reshard(o, NamedSharding(mesh, jax.typeof(a).sharding.spec))
            for o, a in zip(outs, like)
        )

    return run


def _partition_by_rows(kind, norm_ndim, nargs, eps, offset):
    from jax.experimental.custom_partitioning import custom_partitioning
    from jax.sharding import NamedSharding

    k = " ".join(f"k{i}" for i in range(norm_ndim))
    if kind == "forward":
        operands = [f"... {k}", k][:nargs]
        results = [f"... {k}", "..."]
    else:
        operands = [f"... {k}", f"... {k}"] + [k] * (nargs - 3) + ["..."]
        results = [f"... {k}", k][: nargs - 2]
    rule = ", ".join(operands) + " -> " + ", ".join(results)

    @custom_partitioning
    def partitioned(*arrays):
        return _local(kind, eps, offset, arrays)

    def partition(mesh, arg_shapes, result_shape):
        x = arg_shapes[0 if kind == "forward" else 1]
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else ()
        args, outs, axes = _row_shardings(kind, norm_ndim, nargs, spec, len(x.shape))
        named = lambda specs: tuple(NamedSharding(mesh, s) for s in specs)  # noqa: E731
        return mesh, _per_device(kind, eps, offset, nargs, axes), named(outs), named(args)

    partitioned.def_partition(
        partition, sharding_rule=rule, need_replication_factors=tuple(k.split())
    )
    return partitioned


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
    global FFI_LIBRARY, CACHE_NOTE
    library, scratch, CACHE_NOTE = _jax_build.library_file(Path(jax.ffi.include_dir()))
    try:
        # Checked again just before loading: nothing that another user can write gets loaded.
        problem = _jax_build.unsafe(library, directory=False)
        if problem is not None:
            raise RuntimeError(f"{library} {problem}: not loaded")
        lib = ctypes.CDLL(str(library))
    finally:
        if scratch is not None:  # the loaded library stays mapped after its file is gone
            shutil.rmtree(scratch, ignore_errors=True)
    FFI_LIBRARY = str(library)
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


FFI_ERROR = None  # why the FFI backend could not be built, when it could not
FFI_LIBRARY = None  # the path the FFI handlers were loaded from
CACHE_NOTE = None  # why the user's cache directory was not used, when it was not


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
