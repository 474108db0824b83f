"""Property tests (hypothesis): random small shapes, views (slices / transposes), dtypes,
gamma ranks and dtypes, eps, offset, cast and ISA against the float64 oracle."""

import numpy as np
import oracle
import pytest
from conftest import ISAS, using
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import ALL_DTYPES

import rmsnorm

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(ALL_DTYPES))
    gamma_dtype = draw(st.sampled_from(ALL_DTYPES))
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    if draw(st.booleans()):  # a longer last axis now and then, to reach SIMD bodies
        shape = shape[:-1] + (draw(st.integers(10, 300)),)
    gamma_ndim = draw(st.integers(0, ndim))  # 0 -> gamma None
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)

    # build x as a view: transpose of a permuted array and/or a stepped slice
    perm = tuple(draw(st.permutations(range(ndim))))
    steps = tuple(draw(st.lists(st.sampled_from([1, 1, 2, -1, -2]), min_size=ndim,
                                max_size=ndim)))
    base_shape = tuple(abs(s) * n for s, n in zip(steps, shape))
    base = oracle.make_x(rng, tuple(base_shape[p] for p in perm), dtype, spread=False)
    base = base * oracle.round_to(10.0 ** rng.uniform(-3, 3), dtype)
    inv = np.argsort(perm)
    x = base.transpose(inv)[tuple(slice(None, None, s) for s in steps)]
    assert x.shape == shape

    gamma = None
    if gamma_ndim:
        gamma = oracle.make_gamma(rng, shape[ndim - gamma_ndim :], gamma_dtype)
        if draw(st.booleans()):
            gamma = np.ascontiguousarray(gamma.T).T
    eps = draw(st.sampled_from([0.0, 1e-12, 1e-6, 1e-3, 1.0]))
    offset = draw(st.sampled_from([0.0, 1.0, -0.25]))
    cast = draw(st.sampled_from(["end", "before_weight"]))
    isa = draw(st.sampled_from(ISAS))
    threads = draw(st.sampled_from([1, 2]))
    return x, gamma, eps, offset, cast, isa, threads, rng


@SETTINGS
@given(problems())
def test_forward_property(p):
    x, gamma, eps, offset, cast, isa, threads, _ = p
    x_before = x.copy()
    with using(isa, threads):
        y, rstd = rmsnorm.rms_norm(x, gamma, eps, offset=offset, cast=cast)
    assert oracle.bits_equal(x, x_before)
    gnd = 1 if gamma is None else gamma.ndim
    y64, _, r64, _ = oracle.forward(x, gamma, eps, offset, cast, rstd)
    oracle.assert_y_close(y, y64, x.ndim - gnd, x.dtype)
    oracle.assert_rstd_close(rstd, r64, x.dtype)


@SETTINGS
@given(problems())
def test_backward_property(p):
    x, gamma, eps, offset, _, isa, threads, rng = p
    dy = oracle.make_x(rng, x.shape, x.dtype, spread=False)
    if dy.ndim >= 2:
        dy = np.ascontiguousarray(dy.T).T
    with using(isa, threads):
        _, rstd = rmsnorm.rms_norm(x, gamma, eps, offset=offset)
        dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd, offset=offset)
    dx64, dg64, scale, dg_abs = oracle.backward(dy, x, gamma, rstd, offset=offset)
    oracle.assert_dx_close(dx, dx64, scale, x.dtype)
    if gamma is None:
        assert dg is None
    else:
        oracle.assert_dgamma_close(dg, dg64, dg_abs, gamma.dtype, x.dtype)


@SETTINGS
@given(problems())
def test_add_rms_norm_property(p):
    x, gamma, eps, offset, cast, isa, threads, rng = p
    res = oracle.make_x(rng, x.shape, x.dtype, spread=False)
    with using(isa, threads):
        y, rstd, h = rmsnorm.add_rms_norm(x, res, gamma, eps, offset=offset, cast=cast)
        y2, r2 = rmsnorm.rms_norm(h, gamma, eps, offset=offset, cast=cast)
    assert oracle.bits_equal(h, oracle.add(x, res))
    assert oracle.bits_equal(y, y2) and oracle.bits_equal(rstd, r2)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=oracle.dtype_id)
@SETTINGS
@given(scale=st.floats(-30, 30), n=st.integers(1, 70))
def test_scale_invariance(dtype, scale, n):
    """With eps=0, y(x * 2**k) == y(x) exactly (power-of-two scaling is exact), as long
    as x * 2**k stays in range."""
    k = int(scale) if dtype != np.float16 else int(scale) // 4
    rng = np.random.default_rng(n)
    x = oracle.round_to(rng.uniform(0.5, 2, (3, n)) * rng.choice([-1, 1], (3, n)), dtype)
    xs = (oracle.as_f64(x) * 2.0**k)
    xs = oracle.round_to(xs, dtype)
    assert oracle.bits_equal(oracle.round_to(oracle.as_f64(xs) * 2.0**-k, dtype), x)
    y0, r0 = rmsnorm.rms_norm(x, eps=0.0)
    y1, r1 = rmsnorm.rms_norm(xs, eps=0.0)
    assert oracle.bits_equal(y0, y1)
    np.testing.assert_array_equal(oracle.as_f64(r1) * 2.0**k, oracle.as_f64(r0))
