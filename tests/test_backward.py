"""rms_norm_backward vs the float64 oracle (dx, dgamma) over dtypes x shapes x ISAs x
threads, and a float64 finite-difference gradient check of the forward."""

import numpy as np
import oracle
import pytest
from conftest import ISAS, using
from oracle import ALL_DTYPES, F64, SHAPE_IDS, SHAPES, dtype_id

import rmsnorm


def run_and_check(x, gamma, dy, offset=0.0, eps=1e-6):
    y, rstd = rmsnorm.rms_norm(x, gamma, eps, offset=offset)
    dx, dgamma = rmsnorm.rms_norm_backward(dy, x, gamma, rstd, offset=offset)
    dx64, dg64, scale, dg_abs = oracle.backward(dy, x, gamma, rstd, offset=offset)
    oracle.assert_dx_close(dx, dx64, scale, x.dtype)
    if gamma is None:
        assert dgamma is None
    else:
        oracle.assert_dgamma_close(dgamma, dg64, dg_abs, gamma.dtype, x.dtype)
    return dx, dgamma


def inputs(rng, shape, dtype):
    """x, a gamma of x's dtype over its last axis, and dy."""
    x = oracle.make_x(rng, shape, dtype)
    gamma = oracle.make_gamma(rng, shape[-1:], dtype)
    return x, gamma, oracle.make_x(rng, shape, dtype, spread=False)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_backward_matches_oracle(dtype, shape, isa_threads, rng):
    _, xs, gs = shape
    x = oracle.make_x(rng, xs, dtype, lead_ndim=len(xs) - len(gs))
    gamma = oracle.make_gamma(rng, gs, dtype)
    dy = oracle.make_x(rng, xs, dtype, spread=False)
    dx, dgamma = run_and_check(x, gamma, dy)
    assert dx.shape == xs and dgamma.shape == gs


@pytest.mark.parametrize("offset", (0.0, 1.0))
@pytest.mark.parametrize("gamma_dtype", ALL_DTYPES, ids=lambda d: "g" + dtype_id(d))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_backward_gamma_dtypes_and_offset(dtype, gamma_dtype, offset, rng):
    x = oracle.make_x(rng, (9, 77), dtype)
    gamma = oracle.make_gamma(rng, (77,), gamma_dtype)
    dy = oracle.make_x(rng, (9, 77), dtype, spread=False)
    run_and_check(x, gamma, dy, offset=offset)


@pytest.mark.parametrize("dtype", [np.float32, oracle.BF16], ids=dtype_id)
def test_backward_xhat_below_float32_range(dtype, each_isa, rng):
    """Rows of huge and tiny elements: rstd is about 1e-37, so x * rstd of the tiny elements
    falls into float32's subnormals (few bits, or 0) while float64 keeps it. The oracle allows
    float32's absolute rounding error there (oracle.UNDERFLOW32); its relative tolerance alone
    would not (a fuzzer run found this in dgamma), and a wrong term of a normal size still fails."""
    m, k = 6, 200
    x = (rng.uniform(1e-10, 1e-8, (m, k)) * rng.choice([-1, 1], (m, k))).astype(dtype)
    x[:, ::37] = (rng.uniform(1e36, 2.6e37, (m, len(range(0, k, 37))))).astype(dtype)
    gamma = oracle.make_gamma(rng, (k,), np.float64)
    # dy large, so that the lost terms dy * x * rstd (~1e-25) lie far above any absolute floor
    dy = (oracle.make_x(rng, (m, k), np.float64, spread=False) * 1e20).astype(dtype)
    dx, dgamma = run_and_check(x, gamma, dy)
    tiny = np.ones(k, bool)
    tiny[::37] = False
    assert np.all(np.abs(dgamma[tiny]) < 1e-18)  # products of terms below float32's range
    assert np.all(np.abs(dgamma[~tiny]) > 1e15)


@pytest.mark.parametrize("dtype", [np.float32, oracle.BF16], ids=dtype_id)
def test_backward_float32_overflow_stays_in_its_row(dtype, each_isa, rng):
    """dy near float32's largest value times a weight above 1: g = dy * w overflows in float32
    (the arithmetic the SPEC names), so that row's dx is Inf or NaN where float64 holds about
    1e36; the oracle accepts any value there (oracle.OVERFLOW32) and checks every other row,
    which must be finite and right (a fuzzer run found such a row)."""
    m, k = 5, 96
    x = oracle.make_x(rng, (m, k), dtype)
    dy = oracle.make_x(rng, (m, k), dtype, spread=False)
    dy[2, ::3] = np.asarray(3.0e38, dtype) * np.where(np.arange(0, k, 3) % 2, 1, -1)
    gamma = np.full(k, 1.5, np.float32)
    dx, _ = run_and_check(x, gamma, dy)
    dxf = np.asarray(dx, np.float64)
    assert not np.all(np.isfinite(dxf[2]))  # float32's overflow, kept in its row
    assert np.all(np.isfinite(np.delete(dxf, 2, axis=0)))


@pytest.mark.parametrize(
    "shape", [(5, 17), (3, 4, 33), (1025,), (0, 8), (40, 64), (40, 128)], ids=str
)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_backward_gamma_none(dtype, shape, isa_threads, rng):
    x = oracle.make_x(rng, shape, dtype)
    dy = oracle.make_x(rng, shape, dtype, spread=False)
    run_and_check(x, None, dy)


@pytest.mark.parametrize("shape", [(5, 33), (4, 1024), (3, 16384)], ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("isa", ISAS)
def test_dx_rows_independent(isa, dtype, shape, rng):
    """On one thread, each row's dx is bit for bit the dx of that row alone, however rows are
    grouped (two at a time for 32- and 64-bit rows with a weight, one at a time alone). (A row
    that threads share sums its c in another order, so the test keeps to one thread.)"""
    x, gamma, dy = inputs(rng, shape, dtype)
    with using(isa, 1):
        _, rstd = rmsnorm.rms_norm(x, gamma)
        dx, _ = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
        for i in range(shape[0]):
            one, _ = rmsnorm.rms_norm_backward(dy[i : i + 1], x[i : i + 1], gamma, rstd[i : i + 1])
            assert oracle.bits_equal(dx[i : i + 1], one), f"row {i}"


@pytest.mark.parametrize("shape", [(1, 70001), (3, 65539), (16, 4099)], ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("isa", ISAS)
def test_few_rows_dgamma_independent_of_threads(isa, dtype, shape, rng):
    """Up to 16 rows, threads split the columns, and each column of dgamma gains its rows'
    terms in row order, as on one thread: the same bits for any thread count. dx stays within
    the oracle's bounds (its c sums the threads' pieces in another order)."""
    x, gamma, dy = inputs(rng, shape, dtype)
    with using(isa, 1):
        _, rstd = rmsnorm.rms_norm(x, gamma)
        _, dg1 = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    dx64, _, scale, _ = oracle.backward(dy, x, gamma, rstd)
    for threads in (2, 3, 4):
        with using(isa, threads):
            dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
        assert oracle.bits_equal(dg, dg1), f"{threads} threads"
        oracle.assert_dx_close(dx, dx64, scale, x.dtype)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (1, 33), (1, 1, 4099), (1, 70001)], ids=str)
@pytest.mark.parametrize("dtype", oracle.SIXTEEN, ids=dtype_id)
@pytest.mark.parametrize("isa", ISAS)
def test_one_row_dgamma_rounded_once(isa, dtype, shape, rng):
    """For one row, a 16-bit gamma of x's dtype gets a dgamma that the kernels round to that
    dtype as they store it: bit for bit the float32 dgamma (which the same gamma as float32
    gives, with the same dx) rounded to nearest even, at any thread count."""
    x, gamma, dy = inputs(rng, shape, dtype)
    for threads in (1, 2, 3):
        with using(isa, threads):
            _, rstd = rmsnorm.rms_norm(x, gamma)
            dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
            dx32, dg32 = rmsnorm.rms_norm_backward(dy, x, gamma.astype(np.float32), rstd)
        assert dg.dtype == dtype and dg32.dtype == np.float32
        assert oracle.bits_equal(dx, dx32), f"{threads} threads"
        assert oracle.bits_equal(dg, oracle.round_to(dg32, dtype)), f"{threads} threads"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_zero_dy_gives_zero_gradients(dtype, rng):
    x = oracle.make_x(rng, (6, 40), dtype)
    gamma = oracle.make_gamma(rng, (40,), dtype)
    _, rstd = rmsnorm.rms_norm(x, gamma)
    dx, dg = rmsnorm.rms_norm_backward(np.zeros_like(x), x, gamma, rstd)
    assert not np.any(oracle.as_f64(dx)) and not np.any(oracle.as_f64(dg))


def test_backward_uses_given_rstd(rng):
    """dx must be computed from the rstd argument (the saved forward state)."""
    x = rng.standard_normal((3, 50))
    gamma = rng.uniform(0.5, 1.5, 50)
    dy = rng.standard_normal((3, 50))
    _, rstd = rmsnorm.rms_norm(x, gamma)
    dx1, _ = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    dx2, _ = rmsnorm.rms_norm_backward(dy, x, gamma, rstd * 2)
    ref, _, scale, _ = oracle.backward(dy, x, gamma, rstd * 2)
    assert not np.allclose(dx1, dx2)
    oracle.assert_dx_close(dx2, ref, scale, F64)


def test_dgamma_accumulates_over_all_leading_axes(rng):
    x = rng.standard_normal((2, 3, 4, 5))
    gamma = rng.uniform(0.5, 1.5, (4, 5))
    dy = rng.standard_normal(x.shape)
    _, rstd = rmsnorm.rms_norm(x, gamma)
    assert rstd.shape == (2, 3)
    _, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    expected = np.sum(dy * x * rstd[..., None, None], axis=(0, 1))
    np.testing.assert_allclose(dg, expected, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------
# finite differences (float64): L = sum(y * c)

FD_CASES = [
    ("2d", (3, 7), (7,)),
    ("3d_gamma2d", (2, 3, 4), (3, 4)),
    ("1d", (5,), (5,)),
    ("gamma_none", (4, 6), None),
]


def _loss(x, gamma, c, eps, offset):
    return float(np.sum(rmsnorm.rms_norm(x, gamma, eps, offset=offset)[0] * c))


@pytest.mark.parametrize("offset", (0.0, 1.0))
@pytest.mark.parametrize("eps", (1e-6, 0.5))
@pytest.mark.parametrize("case", FD_CASES, ids=lambda c: c[0])
def test_finite_differences(case, eps, offset, each_isa, rng):
    _, xs, gs = case
    x = rng.standard_normal(xs)
    gamma = None if gs is None else rng.uniform(0.5, 1.5, gs)
    c = rng.standard_normal(xs)
    _, rstd = rmsnorm.rms_norm(x, gamma, eps, offset=offset)
    dx, dgamma = rmsnorm.rms_norm_backward(c, x, gamma, rstd, offset=offset)

    num = oracle.numeric_grad(lambda a: _loss(a, gamma, c, eps, offset), x)
    np.testing.assert_allclose(dx, num, rtol=1e-6, atol=1e-7)
    assert np.max(np.abs(num)) > 1e-3  # the check is not vacuous

    if gamma is None:
        assert dgamma is None
        return
    numg = oracle.numeric_grad(lambda g: _loss(x, g, c, eps, offset), gamma)
    np.testing.assert_allclose(dgamma, numg, rtol=1e-6, atol=1e-7)
