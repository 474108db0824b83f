"""Dask bindings for rmsnorm: the NumPy API on dask arrays, lazily, block by block.

``import rmsnorm.dask`` is opt-in (``pip install rmsnorm[dask]``); the core package never
imports it.

Each function takes dask arrays (NumPy arrays and array-likes are wrapped with
:func:`dask.array.asarray`) and returns dask arrays; nothing runs until they are computed. The
chunks of the leading (row) axes are kept; the normalized axes are merged into one chunk when
they are split, since a row must be whole to be normalized. Each task calls the NumPy API
(:func:`rmsnorm.rms_norm` and friends) on one block, so every result except dgamma has the bits
of one NumPy call on the whole array; dgamma is the sum of each block's float32 (float64 for
float64 x) partial, combined by Dask's tree reduction, and returned in gamma's dtype.

Threads: tasks already run in parallel (one per worker thread or process), so by default each
task runs the kernels on one thread where Dask runs tasks concurrently (a ``distributed``
worker, the threaded scheduler, the processes scheduler) and with the process's own setting
(:func:`rmsnorm.get_num_threads`) under the synchronous scheduler. ``threads=n`` sets the kernel
threads of every task instead: give a ``distributed`` worker with ``nthreads=1`` on a machine
of several cores ``threads=`` its share of them. The count is rmsnorm's process-wide setting,
set while tasks of this module run and restored when the last of them ends; other rmsnorm calls
that the same process makes meanwhile use it too.
"""

import contextlib
import math
import multiprocessing
import numbers
import threading

import ml_dtypes
import numpy as np

try:
    import dask.array as da
except ImportError as exc:  # pragma: no cover - exercised by simulating a missing dask
    raise ImportError(
        "rmsnorm.dask needs Dask, which is not installed: pip install rmsnorm[dask]"
    ) from exc

import rmsnorm as _rmsnorm

__all__ = ["add_rms_norm", "rms_norm", "rms_norm_backward"]

_SUPPORTED = tuple(np.dtype(d) for d in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64))


def rms_norm(x, gamma=None, eps=1e-6, *, offset=0.0, cast="end", threads=None):
    """``y, rstd = rmsnorm.rms_norm(x, gamma, eps, offset=offset, cast=cast)``, block by block.

    ``x`` is a dask array (or array-like); ``gamma`` None, a NumPy array or a dask array whose
    shape equals x's trailing ``gamma.ndim`` axes. Returns dask arrays: ``y`` with x's shape,
    dtype and leading chunks, and ``rstd`` with x's leading shape and chunks (float32; float64
    for float64 x). ``threads``: kernel threads per task (see the module's docstring).
    """
    x, gamma, norm_ndim = _prepare("rms_norm", x, gamma, eps, cast, threads)
    task = _Task("rms_norm", gamma is not None, threads, eps=eps, offset=offset, cast=cast)
    return _rowwise(task, x, norm_ndim, [x], gamma, ("x", "rstd"))


def add_rms_norm(x, residual, gamma=None, eps=1e-6, *, offset=0.0, cast="end", threads=None):
    """``y, rstd, h = rmsnorm.add_rms_norm(x, residual, gamma, eps, ...)``, block by block.

    ``h = x + residual`` rounded to x's dtype; ``residual`` has x's shape and dtype (it is
    rechunked to x's chunks). Returns dask arrays ``y``, ``rstd`` and ``h``; see
    :func:`rms_norm`.
    """
    x, gamma, norm_ndim = _prepare("add_rms_norm", x, gamma, eps, cast, threads)
    residual = _like_x("add_rms_norm", "residual", residual, x)
    task = _Task("add_rms_norm", gamma is not None, threads, eps=eps, offset=offset, cast=cast)
    return _rowwise(task, x, norm_ndim, [x, residual], gamma, ("x", "rstd", "x"))


def rms_norm_backward(dy, x, gamma, rstd, *, offset=0.0, split_every=None, threads=None):
    """``dx, dgamma = rmsnorm.rms_norm_backward(dy, x, gamma, rstd, offset=offset)`` on dask
    arrays.

    ``dx`` (x's shape, dtype and leading chunks) has the bits of the NumPy call. ``dgamma``
    (gamma's shape and dtype; None when gamma is None) is the sum of each block's partial,
    accumulated in float32 (float64 for float64 x) by Dask's tree reduction, which combines
    ``split_every`` partials per task (Dask's default when None), and rounded to gamma's dtype
    once: it equals the NumPy call's to float32 summation accuracy, not bit for bit.
    """
    fn = "rms_norm_backward"
    x, gamma, norm_ndim = _prepare(fn, x, gamma, 0.0, "end", threads)
    dy = _like_x(fn, "dy", dy, x)
    lead = x.ndim - norm_ndim
    compute = _compute_dtype(x.dtype)
    rstd = _as_dask(rstd)
    _check_dtype(fn, "rstd", rstd)
    if rstd.dtype != compute:
        raise TypeError(
            f"{fn}(): rstd has dtype {rstd.dtype} but must be {compute} for x of dtype {x.dtype}"
        )
    if rstd.shape != x.shape[:lead]:
        raise ValueError(
            f"{fn}(): rstd of shape {rstd.shape} does not have the leading (row) shape of x of "
            f"shape {x.shape}"
        )
    rstd = rstd.rechunk(x.chunks[:lead])
    task = _Task(fn, gamma is not None, threads, offset=offset)
    if gamma is None:
        (dx,) = _rowwise(task, x, norm_ndim, [dy, x], None, ("x",), rstd)
        return dx, None
    # gamma reaches the kernels in the compute type (an exact widening, and what they compute
    # with anyway) so that each block's partial dgamma comes back unrounded.
    dx, partials = _rowwise(
        task, x, norm_ndim, [dy, x], gamma.astype(compute), ("x", "partial"), rstd
    )
    dgamma = partials.sum(axis=tuple(range(lead)), dtype=compute, split_every=split_every)
    return dx, dgamma.astype(gamma.dtype)


class _Task:
    """A block function (picklable, for worker processes): one NumPy API call on one block of
    rows, with the kernel threads of the task's setting. Blocks come in the order of the
    NumPy function's arguments, gamma among them when ``has_gamma``."""

    def __init__(self, name, has_gamma, threads, **kwargs):
        self.name, self.has_gamma, self.threads, self.kwargs = name, has_gamma, threads, kwargs

    def __dask_tokenize__(self):
        return (self.name, self.has_gamma, self.threads, sorted(self.kwargs.items()))

    def __call__(self, *blocks):
        blocks = list(blocks)
        if not self.has_gamma:  # the NumPy functions take gamma=None in its place
            blocks.insert(2 if self.name != "rms_norm" else 1, None)
        with _kernel_threads(self.threads):
            result = getattr(_rmsnorm, self.name)(*blocks, **self.kwargs)
        if self.name != "rms_norm_backward":
            return result
        dx, dgamma = result
        if dgamma is None:
            return (dx,)
        # One block of the partials array: a length-1 axis per leading axis, then gamma's axes.
        rows = blocks[3].ndim
        return dx, dgamma.reshape((1,) * rows + dgamma.shape)


def _rowwise(task, x, norm_ndim, arrays, gamma, kinds, rstd=None):
    """Dask arrays of ``task``'s outputs over row blocks: ``arrays`` have x's shape and chunks,
    ``gamma`` (or None) is whole in every task, ``rstd`` (or None) has x's leading shape and
    chunks. ``kinds`` says each output's shape: "x" (x's), "rstd" (x's leading axes) or
    "partial" (one partial dgamma per block). The outputs' dtypes and metas are given, so Dask
    never calls the kernels to find them."""
    lead = x.ndim - norm_ndim
    rows, everything, normalized = tuple(range(lead)), tuple(range(x.ndim)), range(lead, x.ndim)
    args = []
    for a in arrays:
        args += [a, everything]
    if gamma is not None:
        args += [gamma, tuple(normalized)]
    if rstd is not None:
        args += [rstd, rows]
    compute = _compute_dtype(x.dtype)
    dtypes = {"x": x.dtype, "rstd": compute, "partial": compute}
    ndims = {"x": x.ndim, "rstd": lead, "partial": x.ndim}
    metas = tuple(np.empty((0,) * ndims[k], dtypes[k]) for k in kinds)
    # Every input axis is an output axis of this layer, so Dask passes blocks as they are
    # (contracted axes would make it concatenate, which copies even a single block).
    blocks = da.blockwise(
        task, everything, *args, concatenate=True, meta=metas, token=task.name.replace("_", "-")
    )
    outputs = []
    for index, kind in enumerate(kinds):
        if kind == "rstd":
            # The normalized axes are contracted here: Dask passes their one block in a list.
            out = da.blockwise(
                _item,
                rows,
                blocks,
                everything,
                index=index,
                dtype=dtypes[kind],
                meta=metas[index],
                token=_NAMES[task.name][index],
            )
        else:
            extra = {}
            if kind == "partial":
                extra["chunks"] = tuple((1,) * len(c) for c in x.chunks[:lead]) + x.chunks[lead:]
            out = blocks.map_blocks(
                _item,
                index=index,
                dtype=dtypes[kind],
                meta=metas[index],
                token=_NAMES[task.name][index],
                **extra,
            )
        outputs.append(out)
    return tuple(outputs)


# The outputs' names in the task graph (what the dashboard shows).
_NAMES = {
    "rms_norm": ("rms-norm-y", "rms-norm-rstd"),
    "add_rms_norm": ("add-rms-norm-y", "add-rms-norm-rstd", "add-rms-norm-h"),
    "rms_norm_backward": ("rms-norm-dx", "rms-norm-dgamma-partial"),
}


def _item(results, index):
    while isinstance(results, list):
        (results,) = results
    return results[index]


def _compute_dtype(dtype):
    return np.dtype(np.float64 if dtype == np.float64 else np.float32)


def _as_dask(a):
    return a if isinstance(a, da.Array) else da.asarray(a)


def _check_dtype(fn, name, a):
    if np.dtype(a.dtype) not in _SUPPORTED:
        raise TypeError(
            f"{fn}(): {name} has unsupported dtype {a.dtype}; expected float16, bfloat16, "
            f"float32 or float64"
        )


def _prepare(fn, x, gamma, eps, cast, threads):
    """Checks what can be checked before any work; returns x (its normalized axes in one
    chunk), gamma (a single-chunk dask array, or None) and the number of normalized axes."""
    x = _as_dask(x)
    _check_dtype(fn, "x", x)
    if x.ndim == 0:
        raise ValueError(f"{fn}(): x must have at least one axis, got shape ()")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{fn}(): eps must be a real number, not {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{fn}(): eps must be finite and >= 0, got {eps}")
    if cast not in ("end", "before_weight"):
        raise ValueError(f"{fn}(): cast must be 'end' or 'before_weight', got {cast!r}")
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1
    ):
        raise ValueError(f"{fn}(): threads must be None or an int >= 1, got {threads!r}")
    norm_ndim = 1
    if gamma is not None:
        gamma = _as_dask(gamma)
        _check_dtype(fn, "gamma", gamma)
        norm_ndim = gamma.ndim
        if gamma.ndim == 0 or gamma.ndim > x.ndim or x.shape[x.ndim - gamma.ndim :] != gamma.shape:
            raise ValueError(
                f"{fn}(): gamma of shape {gamma.shape} does not match the trailing axes of x of "
                f"shape {x.shape}"
            )
        gamma = gamma.rechunk(-1)
    if any(len(c) > 1 for c in x.chunks[x.ndim - norm_ndim :]):
        x = x.rechunk({axis: -1 for axis in range(x.ndim - norm_ndim, x.ndim)})
    return x, gamma, norm_ndim


def _like_x(fn, name, a, x):
    """``a`` (residual, dy) checked against x and cut into x's chunks."""
    a = _as_dask(a)
    _check_dtype(fn, name, a)
    if a.dtype != x.dtype:
        raise TypeError(f"{fn}(): {name} has dtype {a.dtype} but x has dtype {x.dtype}")
    if a.shape != x.shape:
        raise ValueError(f"{fn}(): shape mismatch: {name} of shape {a.shape}, x of shape {x.shape}")
    return a.rechunk(x.chunks)


# Kernel threads. The count is rmsnorm's process-wide setting: the first task of this module to
# start in a process remembers it, and the last to end restores it.
_threads_lock = threading.Lock()
_threads_users = 0
_threads_saved = None


def _default_threads():
    """One thread where Dask runs tasks side by side: on a worker thread (a distributed
    worker, the threaded scheduler) or in a worker process (the processes scheduler); None
    (the process's setting) on the main thread of the main process (the sync scheduler)."""
    if threading.current_thread() is not threading.main_thread():
        return 1
    if multiprocessing.parent_process() is not None:
        return 1
    return None


@contextlib.contextmanager
def _kernel_threads(threads):
    global _threads_users, _threads_saved
    n = threads if threads is not None else _default_threads()
    if n is None:
        yield
        return
    with _threads_lock:
        if _threads_users == 0:
            _threads_saved = _rmsnorm.get_num_threads()
        _threads_users += 1
        _rmsnorm.set_num_threads(n)
    try:
        yield
    finally:
        with _threads_lock:
            _threads_users -= 1
            if _threads_users == 0:
                _rmsnorm.set_num_threads(_threads_saved)
