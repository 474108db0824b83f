# Tests for the C API that native callers use (rmsnorm._core._c_api, rmsnorm/rms_capi.h), called
# through ctypes: above all the thread pools a caller may lend the kernels (rms_pool), which
# may run the scheduled tasks at once, later, on other threads, or not at all.
import ctypes
import threading

import numpy as np
import oracle
import pytest
from conftest import using

import rmsnorm
from rmsnorm import _core

TASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
SCHEDULE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
SIZE, PTR = ctypes.c_size_t, ctypes.c_void_p


class Pool(ctypes.Structure):
    _fields_ = [("nthreads", ctypes.c_int), ("schedule", SCHEDULE), ("ctx", PTR)]


class CApi(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int),
        ("forward", ctypes.CFUNCTYPE(None, ctypes.c_int, PTR, PTR, ctypes.c_int, PTR, PTR, SIZE,
                                     SIZE, ctypes.c_double, ctypes.POINTER(Pool))),
        ("backward", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, PTR, PTR, PTR, ctypes.c_int, PTR,
                                      PTR, PTR, SIZE, SIZE, ctypes.POINTER(Pool))),
        ("convert", ctypes.CFUNCTYPE(None, ctypes.c_int, PTR, PTR, ctypes.c_double, SIZE,
                                     ctypes.c_int)),
        ("weight_as_is", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, SIZE, SIZE)),
    ]
W_AS_X, DG_AS_X = 8, 64  # rms_capi.h's flags


def c_api():
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    api = ctypes.cast(get(_core._c_api, b"rmsnorm._core._c_api"), ctypes.POINTER(CApi)).contents
    assert api.version == 4
    return api


class FakePool:
    """A caller's pool whose tasks run at once (inline), after the call (deferred), on Python
    threads (threads), or never, the pool refusing them (refuse)."""

    def __init__(self, mode, nthreads):
        self.mode, self.pending, self.threads = mode, [], []
        self.schedule = SCHEDULE(self._schedule)  # kept alive with the pool
        self.struct = Pool(nthreads, self.schedule, None)

    def _schedule(self, ctx, task, data):
        run = TASK(task)
        if self.mode == "refuse":
            return 1
        if self.mode == "inline":
            run(data)
        elif self.mode == "deferred":
            self.pending.append((run, data))
        else:
            thread = threading.Thread(target=run, args=(data,))
            thread.start()
            self.threads.append(thread)
        return 0

    def finish(self):
        """Run what was deferred (nothing is left to claim by then) and join the threads."""
        for run, data in self.pending:
            run(data)
        for thread in self.threads:
            thread.join()


MODES = ("inline", "deferred", "threads", "refuse")
# many short rows, and a few long rows that the pool's members share
SHAPES = [(4099, 64), (3, 70001)]


def ptr(a):
    return a.ctypes.data_as(PTR)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_forward_on_a_callers_pool(mode, shape, rng):
    api = c_api()
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.uniform(0.5, 1.5, shape[1]).astype(np.float32)
    y = np.empty_like(x)
    rstd = np.empty(shape[0], np.float32)
    pool = FakePool(mode, 4)
    with using(threads=4):
        api.forward(0, ptr(x), ptr(w), 0, ptr(y), ptr(rstd), shape[0], shape[1], 1e-6,
                    ctypes.byref(pool.struct))
        pool.finish()
        y_omp, rstd_omp = rmsnorm.rms_norm(x, w, 1e-6)
    # the same split into four, so the same sums in the same order as on OpenMP threads
    assert oracle.bits_equal(y, y_omp) and oracle.bits_equal(rstd, rstd_omp)
    y64, _, r64, _ = oracle.forward(x, w)
    oracle.assert_y_close(y, y64, 1)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_backward_on_a_callers_pool(mode, shape, rng):
    api = c_api()
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    w = rng.uniform(0.5, 1.5, shape[1]).astype(np.float32)
    _, rstd = rmsnorm.rms_norm(x, w, 1e-6)
    dx, dw = np.empty_like(x), np.empty_like(w)
    pool = FakePool(mode, 4)
    with using(threads=4):
        rc = api.backward(0, ptr(dy), ptr(x), ptr(w), 0, ptr(rstd), ptr(dx), ptr(dw), shape[0],
                          shape[1], ctypes.byref(pool.struct))
        pool.finish()
        dx_omp, dw_omp = rmsnorm.rms_norm_backward(dy, x, w, rstd)
    assert rc == 0
    assert oracle.bits_equal(dx, dx_omp) and oracle.bits_equal(dw, dw_omp)


def test_convert_widens_with_the_offset_and_narrows(rng):
    api = c_api()
    src = oracle.round_to(rng.standard_normal(37), oracle.BF16)
    wide = np.empty(37, np.float32)
    api.convert(3, ptr(src), ptr(wide), 1.0, 37, 1)
    np.testing.assert_array_equal(wide, src.astype(np.float32) + np.float32(1.0))
    back = np.empty(37, oracle.BF16)
    api.convert(3, ptr(wide), ptr(back), 0.0, 37, 0)
    assert oracle.bits_equal(back, oracle.round_to(wide.astype(np.float64), oracle.BF16))


@pytest.mark.parametrize("shape", [(1, 4099), (3, 4099), (1, 70001)], ids=str)
@pytest.mark.parametrize("dtype", oracle.SIXTEEN, ids=oracle.dtype_id)
def test_sixteen_bit_weight_and_dgamma_as_x(dtype, shape, rng):
    """A 16-bit weight of x's dtype passed as it is (W_AS_X, where weight_as_is allows it), and
    one row's dgamma in x's dtype (DG_AS_X): the bits of rmsnorm's own calls."""
    api = c_api()
    code = 2 if dtype == np.float16 else 3
    m, k = shape
    assert api.weight_as_is(code, m, k) == 1
    assert api.weight_as_is(0, m, k) == 0  # only 16-bit weights
    assert api.weight_as_is(code, 100000, 64) == 0  # many short rows widen it first
    x = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    w = rng.uniform(0.5, 1.5, k).astype(dtype)
    y, rstd = np.empty_like(x), np.empty(m, np.float32)
    dx = np.empty_like(x)
    dw = np.empty(k, dtype) if m == 1 else np.empty(k, np.float32)
    with using(threads=2):
        api.forward(code, ptr(x), ptr(w), W_AS_X, ptr(y), ptr(rstd), m, k, 1e-6, None)
        rc = api.backward(code, ptr(dy), ptr(x), ptr(w), W_AS_X | DG_AS_X, ptr(rstd), ptr(dx),
                          ptr(dw), m, k, None)
        y0, rstd0 = rmsnorm.rms_norm(x, w, 1e-6)
        dx0, dw0 = rmsnorm.rms_norm_backward(dy, x, w, rstd0)
    assert rc == 0
    assert oracle.bits_equal(y, y0) and oracle.bits_equal(rstd, rstd0)
    assert oracle.bits_equal(dx, dx0)
    # one row: dgamma rounded by the kernels; more rows: DG_AS_X is ignored, and dgamma is the
    # float32 row that rms_norm_backward rounds
    assert oracle.bits_equal(dw if m == 1 else oracle.round_to(dw, dtype), dw0)


def test_flags_for_other_dtypes_are_ignored(rng):
    """W_AS_X and DG_AS_X apply only to 16-bit x: float32 with them gives what it gives without."""
    api = c_api()
    x = rng.standard_normal((1, 333)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 333).astype(np.float32)
    outs = []
    for flags in (0, W_AS_X | DG_AS_X):
        y, dx, dw = np.empty_like(x), np.empty_like(x), np.empty_like(w)
        rstd = np.empty(1, np.float32)
        api.forward(0, ptr(x), ptr(w), flags, ptr(y), ptr(rstd), 1, 333, 1e-6, None)
        assert api.backward(0, ptr(x), ptr(x), ptr(w), flags, ptr(rstd), ptr(dx), ptr(dw), 1, 333,
                            None) == 0
        outs.append((y, rstd, dx, dw))
    for a, b in zip(*outs, strict=True):
        assert oracle.bits_equal(a, b)
