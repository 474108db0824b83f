"""rms_norm forward vs the float64 oracle: every dtype x tail shape x ISA x thread count,
plus gamma dtypes/None, offset, eps, cast modes, rstd shapes and out=."""

import numpy as np
import oracle
import pytest
from oracle import ALL_DTYPES, F32, F64, SHAPE_IDS, SHAPES, SIXTEEN, dtype_id

import rmsnorm

SMALL = [s for s in SHAPES if s[0] in ("N7", "N17", "N1025", "gamma2d", "1d", "zero_rows")]


def check(x, gamma, y, rstd, eps=1e-6, offset=0.0, cast="end"):
    gnd = 1 if gamma is None else np.ndim(gamma)
    y64, _, r64, _ = oracle.forward(x, gamma, eps, offset, cast, rstd)
    oracle.assert_y_close(y, y64, x.ndim - gnd, x.dtype)
    oracle.assert_rstd_close(rstd, r64, x.dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_forward_matches_oracle(dtype, shape, isa_threads, rng):
    _, xs, gs = shape
    x = oracle.make_x(rng, xs, dtype, lead_ndim=len(xs) - len(gs))
    gamma = oracle.make_gamma(rng, gs, dtype)
    y, rstd = rmsnorm.rms_norm(x, gamma)
    assert isinstance(y, np.ndarray) and isinstance(rstd, np.ndarray)
    assert y.shape == xs and y.dtype == dtype
    assert rstd.shape == xs[: len(xs) - len(gs)]
    check(x, gamma, y, rstd)


@pytest.mark.parametrize(
    "shape", SMALL + [s for s in SHAPES if s[0] in ("long_rows", "N64", "N128")], ids=lambda s: s[0]
)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_gamma_none(dtype, shape, isa_threads, rng):
    _, xs, _ = shape
    x = oracle.make_x(rng, xs, dtype)
    y, rstd = rmsnorm.rms_norm(x)
    # gamma None normalizes only the last axis
    assert rstd.shape == xs[:-1]
    check(x, None, y, rstd)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_gamma_none_equals_ones_and_ignores_offset(dtype, rng):
    x = oracle.make_x(rng, (9, 131), dtype)
    y0, r0 = rmsnorm.rms_norm(x)
    y1, r1 = rmsnorm.rms_norm(x, np.ones(131, dtype=F32))
    y2, r2 = rmsnorm.rms_norm(x, None, offset=1.0)
    assert oracle.bits_equal(y0, y1) and oracle.bits_equal(r0, r1)
    assert oracle.bits_equal(y0, y2) and oracle.bits_equal(r0, r2)


@pytest.mark.parametrize("gamma_dtype", ALL_DTYPES, ids=lambda d: "g" + dtype_id(d))
@pytest.mark.parametrize("dtype", (F32, F64), ids=dtype_id)
@pytest.mark.parametrize("n", (33, 1025))
def test_gamma_dtype_independent(dtype, gamma_dtype, n, each_isa, rng):
    x = oracle.make_x(rng, (6, n), dtype)
    gamma = oracle.make_gamma(rng, (n,), gamma_dtype)
    y, rstd = rmsnorm.rms_norm(x, gamma)
    assert y.dtype == dtype and rstd.dtype == oracle.compute_dtype(dtype)
    check(x, gamma, y, rstd)


@pytest.mark.parametrize("eps", (0.0, 1e-6, 1e-2, 10.0))
@pytest.mark.parametrize("offset", (0.0, 1.0, -0.5))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_offset_and_eps(dtype, offset, eps, rng):
    # row scales around 1 so that eps=10 changes rstd substantially
    x = oracle.round_to(rng.standard_normal((7, 257)), dtype)
    gamma = oracle.make_gamma(rng, (257,), dtype) * np.asarray(0.5, dtype=dtype)
    y, rstd = rmsnorm.rms_norm(x, gamma, eps, offset=offset)
    check(x, gamma, y, rstd, eps=eps, offset=offset)


def test_eps_and_offset_take_effect(rng):
    """Guard against ignored arguments: results must move with eps and offset."""
    x = rng.standard_normal((4, 64))
    g = rng.uniform(0.5, 1.5, 64)
    y0, r0 = rmsnorm.rms_norm(x, g, 1e-6)
    y1, r1 = rmsnorm.rms_norm(x, g, 1.0)
    assert np.all(r1 < r0)
    y2, _ = rmsnorm.rms_norm(x, g, 1e-6, offset=1.0)
    np.testing.assert_allclose(y2, y0 + x * r0[:, None], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cast", ("end", "before_weight"))
@pytest.mark.parametrize("dtype", (F32, F64), ids=dtype_id)
@pytest.mark.parametrize("n", (7, 1025))
def test_cast_modes_float(dtype, n, cast, each_isa, rng):
    x = oracle.make_x(rng, (5, n), dtype)
    gamma = oracle.make_gamma(rng, (n,), F32)
    y, rstd = rmsnorm.rms_norm(x, gamma, cast=cast)
    check(x, gamma, y, rstd, cast=cast)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_single_row_rstd_is_0d_array(dtype, rng):
    x = oracle.make_x(rng, (19,), dtype)
    y, rstd = rmsnorm.rms_norm(x)
    assert isinstance(rstd, np.ndarray) and rstd.shape == ()
    assert rstd.dtype == oracle.compute_dtype(dtype)
    assert y.shape == (19,)
    check(x, None, y, rstd)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_gamma_covers_all_axes(dtype, rng):
    """gamma.ndim == x.ndim: the whole array is one row, rstd is 0-d."""
    x = oracle.make_x(rng, (4, 6, 5), dtype)
    gamma = oracle.make_gamma(rng, (4, 6, 5), dtype)
    y, rstd = rmsnorm.rms_norm(x, gamma)
    assert rstd.shape == ()
    check(x, gamma, y, rstd)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_zero_rows_gamma_none_and_3d(dtype):
    for shape in ((0, 8), (0, 3, 8), (2, 0, 8)):
        x = np.zeros(shape, dtype=dtype)
        y, rstd = rmsnorm.rms_norm(x)
        assert y.shape == shape and y.dtype == dtype
        assert rstd.shape == shape[:-1] and rstd.dtype == oracle.compute_dtype(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] in ("N17", "N4097", "gamma2d",
                                                                "short_rows")],
                         ids=lambda s: s[0])
def test_out_preallocated(dtype, shape, isa_threads, rng):
    _, xs, gs = shape
    x = oracle.make_x(rng, xs, dtype)
    gamma = oracle.make_gamma(rng, gs, dtype)
    ref_y, ref_r = rmsnorm.rms_norm(x, gamma)
    out = np.full(xs, 7, dtype=dtype)
    y, rstd = rmsnorm.rms_norm(x, gamma, out=out)
    assert y is out
    assert oracle.bits_equal(out, ref_y) and oracle.bits_equal(rstd, ref_r)
    # in place
    xc = x.copy()
    y2, r2 = rmsnorm.rms_norm(xc, gamma, out=xc)
    assert y2 is xc
    assert oracle.bits_equal(xc, ref_y) and oracle.bits_equal(r2, ref_r)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_repeatable(dtype, rng):
    """Same input, same backend: bitwise the same output (no uninitialised reads)."""
    x = oracle.make_x(rng, (33, 1031), dtype)
    a = rmsnorm.rms_norm(x, x[0])
    b = rmsnorm.rms_norm(x, x[0])
    assert oracle.bits_equal(a[0], b[0]) and oracle.bits_equal(a[1], b[1])


def test_output_independent_of_other_rows(rng):
    """A row's result does not depend on its neighbours (no cross-row mixing)."""
    x = rng.standard_normal((64, 300))
    y, r = rmsnorm.rms_norm(x)
    for i in (0, 17, 63):
        yi, ri = rmsnorm.rms_norm(x[i : i + 1])
        np.testing.assert_allclose(yi[0], y[i], rtol=1e-14, atol=0)
        np.testing.assert_allclose(ri[0], r[i], rtol=1e-14)


def test_sixteen_bit_rstd_dtype_is_float32(rng):
    for dt in SIXTEEN:
        _, rstd = rmsnorm.rms_norm(oracle.make_x(rng, (3, 5), dt))
        assert rstd.dtype == F32


def test_float64_not_computed_in_float32(rng):
    """float64 must keep float64 precision (a float32 path would be ~1e-7 off)."""
    x = 1.0 + rng.standard_normal((4, 1000)) * 1e-9
    y, rstd = rmsnorm.rms_norm(x)
    y64, _, r64, _ = oracle.forward(x)
    assert np.max(np.abs(y - y64)) < 1e-13
    assert np.max(np.abs(rstd - r64)) < 1e-13
