"""dgamma has the same bits at any thread count: the backward sums it over fixed blocks of rows
and combines the blocks along a fixed tree, however the rows fall to threads. Each thread count
really runs (the per-thread minimum lowered, the team's size asserted), and every result is
checked against the float64 oracle too."""

import contextlib

import numpy as np
import oracle
import pytest
from conftest import ISAS, using
from oracle import ALL_DTYPES, dtype_id

import rmsnorm
from rmsnorm import _core

THREADS = (1, 2, 3, 7)
# Rows x columns that take each way of sharing the rows: one row (its columns split), a few
# rows (one block, columns split), several blocks with fewer members than blocks, more members
# than blocks (each block's columns split among its members), and many short rows.
SHAPES = [(1, 4099), (5, 1031), (9, 1031), (40, 333), (300, 257), (2000, 64)]


@contextlib.contextmanager
def every_call_split():
    """Work splits across every thread asked for, however small."""
    prev = _core._set_min_per_thread(0)
    try:
        yield
    finally:
        _core._set_min_per_thread(prev)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("isa", ISAS)
def test_dgamma_bits_independent_of_threads(isa, dtype, shape, rng):
    x = oracle.make_x(rng, shape, dtype)
    gamma = oracle.make_gamma(rng, shape[-1:], dtype)
    dy = oracle.make_x(rng, shape, dtype, spread=False)
    with using(isa, 1):
        _, rstd = rmsnorm.rms_norm(x, gamma)
    dx64, dg64, scale, dg_abs = oracle.backward(dy, x, gamma, rstd)
    first = None
    with every_call_split():
        for threads in THREADS:
            with using(isa, threads):
                dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
                assert _core._last_team_size() == threads
            oracle.assert_dx_close(dx, dx64, scale, dtype)
            oracle.assert_dgamma_close(dg, dg64, dg_abs, dtype, dtype)
            if first is None:
                first = dg
            assert oracle.bits_equal(dg, first), f"{threads} threads"


@pytest.mark.parametrize("gamma_dtype", ALL_DTYPES, ids=lambda d: "g" + dtype_id(d))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_dgamma_bits_independent_of_threads_any_gamma_dtype(dtype, gamma_dtype, rng):
    """The same for every gamma dtype (dgamma rounded to it), with an offset."""
    shape = (37, 515)
    x = oracle.make_x(rng, shape, dtype)
    gamma = oracle.make_gamma(rng, shape[-1:], gamma_dtype)
    dy = oracle.make_x(rng, shape, dtype, spread=False)
    _, rstd = rmsnorm.rms_norm(x, gamma, offset=1.0)
    _, dg64, _, dg_abs = oracle.backward(dy, x, gamma, rstd, offset=1.0)
    dgs = []
    with every_call_split():
        for threads in THREADS:
            with using(threads=threads):
                dgs.append(rmsnorm.rms_norm_backward(dy, x, gamma, rstd, offset=1.0)[1])
                assert _core._last_team_size() == threads
    for threads, dg in zip(THREADS, dgs, strict=True):
        assert dg.dtype == gamma_dtype
        oracle.assert_dgamma_close(dg, dg64, dg_abs, gamma_dtype, dtype)
        assert oracle.bits_equal(dg, dgs[0]), f"{threads} threads"


def test_dgamma_bits_of_long_rows_at_the_default_split(rng):
    """At the default per-thread minimum too, on rows that every thread count splits."""
    x = rng.standard_normal((64, 8192)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, 8192).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    _, rstd = rmsnorm.rms_norm(x, gamma)
    dgs = []
    for threads in THREADS:
        with using(threads=threads):
            dgs.append(rmsnorm.rms_norm_backward(dy, x, gamma, rstd)[1])
            assert _core._last_team_size() == threads
    assert all(oracle.bits_equal(dg, dgs[0]) for dg in dgs)
