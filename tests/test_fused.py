"""add_rms_norm vs the oracle and vs rms_norm(h) (bitwise), aliasing of out / residual_out,
out= for rms_norm_backward, offset=1.0 (Gemma), and gradients of the fused op by finite
differences."""

import ml_dtypes
import numpy as np
import oracle
import pytest
from oracle import ALL_DTYPES, F64, SHAPES, dtype_id

import rmsnorm

FUSED_SHAPES = [s for s in SHAPES if s[0] in ("N1", "N7", "N16", "N33", "N64", "N128", "N1025",
                                              "N17389", "zero_rows", "1d", "gamma2d", "long_rows")]
OFFSETS = (0.0, 1.0)


def data(rng, xs, gs, dtype, gamma_dtype=None):
    x = oracle.make_x(rng, xs, dtype)
    res = oracle.make_x(rng, xs, dtype)
    gamma = None if gs is None else oracle.make_gamma(rng, gs, gamma_dtype or dtype)
    return x, res, gamma


@pytest.mark.parametrize("offset", OFFSETS, ids=lambda o: f"off{o}")
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=lambda s: s[0])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_add_rms_norm_matches_oracle(dtype, shape, offset, isa_threads, rng):
    _, xs, gs = shape
    x, res, gamma = data(rng, xs, gs, dtype)
    y, rstd, h = rmsnorm.add_rms_norm(x, res, gamma, offset=offset)
    h_ref, y64, _, r64, _ = oracle.add_rms_norm(x, res, gamma, offset=offset)
    # h is x + residual in float32/float64 rounded once to x.dtype: exact
    assert h.dtype == dtype and h.shape == xs
    assert oracle.bits_equal(h, h_ref), "h is not round(x + residual)"
    oracle.assert_y_close(y, y64, len(xs) - len(gs), dtype)
    oracle.assert_rstd_close(rstd, r64, dtype)
    # y, rstd are exactly rms_norm(h)
    y2, r2 = rmsnorm.rms_norm(h, gamma, offset=offset)
    assert oracle.bits_equal(y, y2), "y != rms_norm(h) bitwise"
    assert oracle.bits_equal(rstd, r2), "rstd != rms_norm(h) bitwise"


@pytest.mark.parametrize("k", (64, 128))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_add_rms_norm_short_rows_gamma_none(dtype, k, isa_threads, rng):
    """Rows of the lengths that the 16-bit add compiles as constants, without a weight."""
    x, res, _ = data(rng, (40, k), None, dtype)
    y, rstd, h = rmsnorm.add_rms_norm(x, res, None)
    h_ref, y64, _, r64, _ = oracle.add_rms_norm(x, res, None)
    assert oracle.bits_equal(h, h_ref), "h is not round(x + residual)"
    oracle.assert_y_close(y, y64, 1, dtype)
    oracle.assert_rstd_close(rstd, r64, dtype)
    y2, r2 = rmsnorm.rms_norm(h)
    assert oracle.bits_equal(y, y2) and oracle.bits_equal(rstd, r2)


@pytest.mark.parametrize("cast", ("end", "before_weight"))
@pytest.mark.parametrize("gamma_dtype", ALL_DTYPES, ids=lambda d: "g" + dtype_id(d))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_add_rms_norm_gamma_dtypes_cast_none(dtype, gamma_dtype, cast, rng):
    x, res, gamma = data(rng, (6, 97), (97,), dtype, gamma_dtype)
    for g in (gamma, None):
        y, rstd, h = rmsnorm.add_rms_norm(x, res, g, 1e-5, offset=1.0, cast=cast)
        y2, r2 = rmsnorm.rms_norm(h, g, 1e-5, offset=1.0, cast=cast)
        assert oracle.bits_equal(h, oracle.add(x, res))
        assert oracle.bits_equal(y, y2) and oracle.bits_equal(rstd, r2)
        y64, _, r64, _ = oracle.forward(h, g, 1e-5, offset=1.0, cast=cast, rstd=rstd)
        oracle.assert_y_close(y, y64, 1, dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_add_overflowing_to_inf_makes_nan_row(dtype):
    """h rounds to inf (e.g. float16 60000 + 60000): that row of y is NaN, others fine."""
    big = float(ml_dtypes.finfo(dtype).max)
    x = np.ones((3, 8), dtype=dtype)
    res = np.ones((3, 8), dtype=dtype)
    x[1, 3] = big
    res[1, 3] = big
    y, rstd, h = rmsnorm.add_rms_norm(x, res)
    assert np.isinf(oracle.as_f64(h)[1, 3])
    assert np.all(np.isnan(oracle.as_f64(y)[1])) and np.isnan(rstd[1])
    assert np.all(np.isfinite(oracle.as_f64(y)[[0, 2]]))


# ---------------------------------------------------------------------------------------
# aliasing


@pytest.mark.parametrize("offset", OFFSETS, ids=lambda o: f"off{o}")
@pytest.mark.parametrize("shape", [s for s in FUSED_SHAPES if s[0] in ("N7", "N1025", "gamma2d",
                                                                      "long_rows")],
                         ids=lambda s: s[0])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_add_rms_norm_aliasing(dtype, shape, offset, isa_threads, rng):
    _, xs, gs = shape
    x, res, gamma = data(rng, xs, gs, dtype)
    ref_y, ref_r, ref_h = rmsnorm.add_rms_norm(x, res, gamma, offset=offset)

    def same(y, r, h):
        assert oracle.bits_equal(y, ref_y) and oracle.bits_equal(r, ref_r)
        assert oracle.bits_equal(h, ref_h)

    # out=x: y overwrites x
    xc, rc = x.copy(), res.copy()
    y, r, h = rmsnorm.add_rms_norm(xc, rc, gamma, offset=offset, out=xc)
    assert y is xc
    same(y, r, h)
    assert oracle.bits_equal(rc, res)
    # residual_out=residual: h overwrites the residual stream
    xc, rc = x.copy(), res.copy()
    y, r, h = rmsnorm.add_rms_norm(xc, rc, gamma, offset=offset, residual_out=rc)
    assert h is rc
    same(y, r, h)
    assert oracle.bits_equal(xc, x)
    # residual_out=x
    xc, rc = x.copy(), res.copy()
    y, r, h = rmsnorm.add_rms_norm(xc, rc, gamma, offset=offset, residual_out=xc)
    assert h is xc
    same(y, r, h)
    assert oracle.bits_equal(rc, res)
    # both in place: y into x, h into residual (the usual pre-norm block update)
    xc, rc = x.copy(), res.copy()
    y, r, h = rmsnorm.add_rms_norm(xc, rc, gamma, offset=offset, out=xc, residual_out=rc)
    assert y is xc and h is rc
    same(y, r, h)
    # fresh preallocated buffers
    yo = np.full(xs, 3, dtype=dtype)
    ho = np.full(xs, 5, dtype=dtype)
    y, r, h = rmsnorm.add_rms_norm(x, res, gamma, offset=offset, out=yo, residual_out=ho)
    assert y is yo and h is ho
    same(y, r, h)


@pytest.mark.parametrize("alias", ("fresh", "x", "residual"))
@pytest.mark.parametrize("shape", ((1, 100003), (3, 70001), (5, 12289)), ids=str)
@pytest.mark.parametrize(
    "dtype, magnitude",  # float16 cannot hold the magnitudes whose squares leave float32
    [(d, m) for d in (oracle.F32, oracle.BF16) for m in (1.0, 1e30, 1e-25)] + [(oracle.F16, 1.0)],
    ids=lambda v: dtype_id(v) if isinstance(v, np.dtype) else f"mag{v:g}",
)
def test_add_long_rows_stage_h(dtype, magnitude, shape, alias, isa_threads, rng):
    """Rows split across threads, and long 16-bit rows, may round h into h itself in the first
    pass and scale it in the second: h, y and rstd are still round(x + r) and rms_norm(h) bit for
    bit, when h is x or the residual too, and for rows whose squares overflow or underflow
    float32 (the rescaling path, which then reads h)."""
    x = oracle.round_to(oracle.make_x(rng, shape, F64, spread=False) * magnitude, dtype)
    res = oracle.round_to(oracle.make_x(rng, shape, F64, spread=False) * magnitude, dtype)
    gamma = oracle.make_gamma(rng, shape[-1:], dtype)
    h_ref = oracle.add(x, res)
    xc, rc = x.copy(), res.copy()
    kw = {"x": {"residual_out": xc}, "residual": {"residual_out": rc}, "fresh": {}}[alias]
    y, rstd, h = rmsnorm.add_rms_norm(xc, rc, gamma, **kw)
    assert oracle.bits_equal(h, h_ref), "h is not round(x + residual)"
    y2, r2 = rmsnorm.rms_norm(h_ref, gamma)
    assert oracle.bits_equal(y, y2), "y != rms_norm(h) bitwise"
    assert oracle.bits_equal(rstd, r2), "rstd != rms_norm(h) bitwise"
    y64, _, r64, _ = oracle.forward(h_ref, gamma)
    oracle.assert_y_close(y, y64, 1, dtype)
    oracle.assert_rstd_close(rstd, r64, dtype)


@pytest.mark.parametrize("offset", OFFSETS, ids=lambda o: f"off{o}")
@pytest.mark.parametrize("shape", [s for s in FUSED_SHAPES if s[0] in ("N7", "N1025", "gamma2d",
                                                                      "long_rows", "1d")],
                         ids=lambda s: s[0])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_backward_out(dtype, shape, offset, isa_threads, rng):
    _, xs, gs = shape
    x, dy, gamma = data(rng, xs, gs, dtype)
    _, rstd = rmsnorm.rms_norm(x, gamma, offset=offset)
    ref_dx, ref_dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd, offset=offset)
    dx64, dg64, scale, dg_abs = oracle.backward(dy, x, gamma, rstd, offset=offset)
    oracle.assert_dx_close(ref_dx, dx64, scale, dtype)
    oracle.assert_dgamma_close(ref_dg, dg64, dg_abs, gamma.dtype, dtype)
    # out = a preallocated buffer
    out = np.full(xs, 9, dtype=dtype)
    dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd, offset=offset, out=out)
    assert dx is out
    assert oracle.bits_equal(dx, ref_dx)
    np.testing.assert_array_equal(oracle.as_f64(dg), oracle.as_f64(ref_dg))
    # out = dy (in place)
    dyc = dy.copy()
    dx, dg = rmsnorm.rms_norm_backward(dyc, x, gamma, rstd, offset=offset, out=dyc)
    assert dx is dyc
    assert oracle.bits_equal(dx, ref_dx)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_offset_one_is_gemma(dtype, rng):
    """offset=1 with gamma == rms_norm with gamma + 1 (computed in float32 / float64)."""
    x = oracle.make_x(rng, (5, 130), dtype)
    gamma = oracle.round_to(rng.uniform(-0.5, 0.5, 130), np.float32)
    ct = oracle.compute_dtype(dtype)
    gp1 = gamma.astype(ct) + ct.type(1)
    ya, ra = rmsnorm.rms_norm(x, gamma, offset=1.0)
    yb, rb = rmsnorm.rms_norm(x, gp1)
    assert oracle.bits_equal(ya, yb) and oracle.bits_equal(ra, rb)
    dy = oracle.make_x(rng, (5, 130), dtype, spread=False)
    dxa, dga = rmsnorm.rms_norm_backward(dy, x, gamma, ra, offset=1.0)
    dxb, dgb = rmsnorm.rms_norm_backward(dy, x, gp1, rb)
    assert oracle.bits_equal(dxa, dxb)
    # dgamma doesn't depend on the offset (returned in each gamma's dtype)
    np.testing.assert_array_equal(oracle.as_f64(dga), oracle.as_f64(dgb).astype(np.float32))


# ---------------------------------------------------------------------------------------
# finite differences of the fused op (float64)


@pytest.mark.parametrize("offset", OFFSETS, ids=lambda o: f"off{o}")
@pytest.mark.parametrize("case", [((3, 6), (6,)), ((2, 2, 5), (2, 5)), ((4, 5), None)],
                         ids=("2d", "gamma2d", "gamma_none"))
def test_add_rms_norm_gradient(case, offset, each_isa, rng):
    xs, gs = case
    x = rng.standard_normal(xs)
    res = rng.standard_normal(xs)
    gamma = None if gs is None else rng.uniform(0.5, 1.5, gs)
    c = rng.standard_normal(xs)
    _, rstd, h = rmsnorm.add_rms_norm(x, res, gamma, offset=offset)
    dh, _ = rmsnorm.rms_norm_backward(c, h, gamma, rstd, offset=offset)

    def loss(a, b):
        return float(np.sum(rmsnorm.add_rms_norm(a, b, gamma, offset=offset)[0] * c))

    num_x = oracle.numeric_grad(lambda a: loss(a, res), x)
    num_r = oracle.numeric_grad(lambda b: loss(x, b), res)
    assert np.max(np.abs(num_x)) > 1e-3
    np.testing.assert_allclose(dh, num_x, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dh, num_r, rtol=1e-6, atol=1e-7)
    assert dh.dtype == F64
