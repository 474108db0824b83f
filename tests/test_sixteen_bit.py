"""float16 / bfloat16: correct rounding vs the oracle for every gamma dtype x ISA x tail
shape, overflow near 65504, NaN/Inf isolation, dgamma accumulation precision, agreement
between ISAs, cast="before_weight", and dtype mismatches."""

import re

import numpy as np
import oracle
import pytest
from conftest import ISAS, using
from oracle import ALL_DTYPES, BF16, F16, F32, SIXTEEN, TAILS, as_f64, dtype_id

import rmsnorm

GAMMA_IDS = lambda d: "g" + dtype_id(d)  # noqa: E731


@pytest.mark.parametrize("n", TAILS, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("gamma_dtype", ALL_DTYPES, ids=GAMMA_IDS)
@pytest.mark.parametrize("dtype", SIXTEEN, ids=dtype_id)
def test_forward_correctly_rounded(dtype, gamma_dtype, n, each_isa, rng):
    x = oracle.make_x(rng, (6, n), dtype)
    gamma = oracle.make_gamma(rng, (n,), gamma_dtype)
    y, rstd = rmsnorm.rms_norm(x, gamma)
    y64, _, r64, _ = oracle.forward(x, gamma)
    oracle.assert_y_close(y, y64, 1, dtype)
    oracle.assert_rstd_close(rstd, r64, dtype)


@pytest.mark.parametrize("n", (7, 16, 33, 4097), ids=lambda n: f"N{n}")
@pytest.mark.parametrize("gamma_dtype", ALL_DTYPES, ids=GAMMA_IDS)
@pytest.mark.parametrize("dtype", SIXTEEN, ids=dtype_id)
def test_backward(dtype, gamma_dtype, n, each_isa, rng):
    x = oracle.make_x(rng, (6, n), dtype)
    gamma = oracle.make_gamma(rng, (n,), gamma_dtype)
    dy = oracle.make_x(rng, (6, n), dtype, spread=False)
    _, rstd = rmsnorm.rms_norm(x, gamma)
    dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    dx64, dg64, scale, dg_abs = oracle.backward(dy, x, gamma, rstd)
    oracle.assert_dx_close(dx, dx64, scale, dtype)
    oracle.assert_dgamma_close(dg, dg64, dg_abs, gamma_dtype, dtype)


@pytest.mark.parametrize("gamma_dtype", ALL_DTYPES, ids=GAMMA_IDS)
@pytest.mark.parametrize("dtype", SIXTEEN, ids=dtype_id)
@pytest.mark.parametrize("n", (7, 33, 1025), ids=lambda n: f"N{n}")
def test_cast_before_weight(dtype, gamma_dtype, n, each_isa, rng):
    x = oracle.make_x(rng, (8, n), dtype)
    # |w| spread so that the two roundings differ from one rounding in many elements
    gamma = oracle.round_to(rng.uniform(-3, 3, n), gamma_dtype)
    y, rstd = rmsnorm.rms_norm(x, gamma, cast="before_weight")
    y64, y_bw, r64, _ = oracle.forward(x, gamma, cast="before_weight", rstd=rstd)
    oracle.assert_y_close(y, y64, 1, dtype)
    oracle.assert_rstd_close(rstd, r64, dtype)
    # and it really is a different mode: where one and two roundings differ, the package
    # picked the two-rounding value
    _, y_end, _, _ = oracle.forward(x, gamma, cast="end")
    if n >= 33:
        differ = oracle.ulp_distance16(y_bw, y_end) > 0
        assert differ.any()
        ok = oracle.ulp_distance16(y, y_bw)[differ] == 0
        assert ok.mean() >= 0.95


def test_one_element_rows_round_the_float32_value():
    """A row of one element has x * rstd == 1.0 in float32, and w = 1 + gamma = 1.51171875, a
    midpoint of bfloat16, puts y exactly on it: y is that float32 value rounded to even
    (1.515625), while the float64 value lies just below the midpoint (1.5078125 correctly
    rounded). The oracle's check allows exactly such elements (near_midpoint16)."""
    x = np.array([[-71.5], [37.5], [1000.0]], BF16)
    gamma = np.array([0.51171875], BF16)
    y64 = oracle.forward(x, gamma, offset=1.0)[0]
    assert oracle.near_midpoint16(y64, BF16).all()
    expected = [[-1.5078125], [1.5078125], [1.5078125]]
    assert np.array_equal(as_f64(oracle.round_to(y64, BF16)), expected)
    for isa in ISAS:
        with using(isa, 1):
            y, _ = rmsnorm.rms_norm(x, gamma, offset=1.0)
        assert np.array_equal(as_f64(y), [[-1.515625], [1.515625], [1.515625]]), isa
        oracle.assert_y_close(y, y64, 1, BF16)


@pytest.mark.parametrize("dtype", SIXTEEN, ids=dtype_id)
def test_cast_end_vs_before_weight_default(dtype, rng):
    """The default is cast="end"."""
    x = oracle.make_x(rng, (16, 255), dtype)
    gamma = oracle.round_to(rng.uniform(-3, 3, 255), F32)
    y0, _ = rmsnorm.rms_norm(x, gamma)
    y1, _ = rmsnorm.rms_norm(x, gamma, cast="end")
    y2, _ = rmsnorm.rms_norm(x, gamma, cast="before_weight")
    assert oracle.bits_equal(y0, y1)
    assert not oracle.bits_equal(y0, y2)


@pytest.mark.parametrize("gamma_dtype", (F32, F16), ids=GAMMA_IDS)
def test_float16_near_max_does_not_overflow(gamma_dtype, each_isa, rng):
    # x*x overflows float16 (65504**2 = 4.3e9); the math must be done in float32
    x = (rng.uniform(30000, 65504, (5, 1031)) * rng.choice([-1, 1], (5, 1031))).astype(F16)
    x[0, :] = 65504
    x[1, :] = -65504
    gamma = oracle.make_gamma(rng, (1031,), gamma_dtype)
    y, rstd = rmsnorm.rms_norm(x, gamma)
    assert np.all(np.isfinite(y.astype(np.float64)))
    assert np.all(np.isfinite(rstd)) and np.all(rstd > 0)
    y64, _, r64, _ = oracle.forward(x, gamma)
    oracle.assert_y_close(y, y64, 1, F16)
    oracle.assert_rstd_close(rstd, r64, F16)


def test_float16_result_near_max_is_finite(each_isa):
    # y = x*rstd*w with w = 65504: exactly representable maximum, must not become inf
    x = np.full((3, 64), 65504, dtype=F16)
    x[1] *= -1
    x[2] = 1
    gamma = np.full(64, 65504, dtype=F32)
    y, _ = rmsnorm.rms_norm(x, gamma)
    expected = np.where(x > 0, 65504, -65504).astype(F16)
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("bad", (np.nan, np.inf, -np.inf), ids=("nan", "inf", "-inf"))
@pytest.mark.parametrize("dtype", SIXTEEN, ids=dtype_id)
def test_nonfinite_stays_in_its_row(dtype, bad, each_isa, rng):
    x = oracle.make_x(rng, (7, 1033), dtype)
    x[2, 500] = bad
    x[5, 1032] = bad  # in the tail
    gamma = oracle.make_gamma(rng, (1033,), F32)
    y, rstd = rmsnorm.rms_norm(x, gamma)
    bad_rows = [2, 5]
    good = [i for i in range(7) if i not in bad_rows]
    yf = oracle.as_f64(y)
    assert np.all(np.isnan(yf[bad_rows])) and np.all(np.isnan(rstd[bad_rows]))
    y64, _, r64, _ = oracle.forward(x[good], gamma)
    oracle.assert_y_close(y[good], y64, 1, dtype)
    oracle.assert_rstd_close(rstd[good], r64, dtype)
    # backward: the bad rows give NaN dx, the others the right dx
    dy = oracle.make_x(rng, (7, 1033), dtype, spread=False)
    dx, _ = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    assert np.all(np.isnan(oracle.as_f64(dx)[bad_rows]))
    dx64, _, scale, _ = oracle.backward(dy[good], x[good], gamma, rstd[good])
    oracle.assert_dx_close(dx[good], dx64, scale, dtype)


@pytest.mark.parametrize("gamma_dtype", SIXTEEN, ids=GAMMA_IDS)
@pytest.mark.parametrize("dtype", SIXTEEN, ids=dtype_id)
def test_dgamma_no_16bit_accumulation(dtype, gamma_dtype, each_isa, rng):
    """4096 positive terms per column: summing in 16 bits would stall (adding ~0.5 to ~2000
    in bfloat16 is lost entirely); the float32 sum rounded once matches the oracle rounded
    once."""
    rows, n = 4096, 40
    x = oracle.round_to(rng.uniform(0.5, 1.5, (rows, n)), dtype)
    dy = oracle.round_to(rng.uniform(0.0, 1.0, (rows, n)), dtype)
    gamma = oracle.round_to(rng.uniform(0.5, 1.5, n), gamma_dtype)
    _, rstd = rmsnorm.rms_norm(x, gamma)
    _, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    assert dg.dtype == gamma_dtype
    _, dg64, _, _ = oracle.backward(dy, x, gamma, rstd)
    expected = oracle.round_to(dg64, gamma_dtype)
    d = oracle.ulp_distance16(dg, expected)
    assert d.max() <= 1, f"dgamma off by up to {d.max()} ulp: {dg[:4]} vs {expected[:4]}"
    assert np.mean(d == 0) >= 0.9


@pytest.mark.parametrize("offset", (0.0, 1.0), ids=lambda o: f"offset{o:g}")
@pytest.mark.parametrize("dtype", SIXTEEN, ids=dtype_id)
@pytest.mark.parametrize(
    "shape",
    (
        (1, 64),
        (3, 4101),
        (7, 33),
        (12, 33),
        (16, 2048),
        (12, 4096),
        (12, 4097),
        (9, 6144),
        (12, 8199),
        (2, 1 << 17),
    ),
    ids=str,
)
def test_gamma_of_x_dtype_read_as_it_is(dtype, shape, offset, isa_threads, rng):
    """A 16-bit gamma of x's dtype is read as it is for few rows or long rows (offset 0; from
    8192 elements, over 4096 on Zen 5), or widened to float32 first: by each thread into a row
    of its own for rows of up to 8192, by the calling thread past that. Every way, bit for bit
    what its float32 widening gives.
    (A widened -0 is +0, as when an offset of 0.0 is added to it.) 16x2048 has float32 weight
    rows that end on a page."""
    x = oracle.make_x(rng, shape, dtype)
    r = oracle.make_x(rng, shape, dtype, spread=False)
    dy = oracle.make_x(rng, shape, dtype, spread=False)
    gamma = oracle.make_gamma(rng, shape[-1:], dtype)
    gamma[0] = -0.0
    wide = gamma.astype(F32) + np.float32(offset)
    y, rstd = rmsnorm.rms_norm(x, gamma, offset=offset)
    y32, rstd32 = rmsnorm.rms_norm(x, wide)
    assert oracle.bits_equal(y, y32) and oracle.bits_equal(rstd, rstd32)
    fused = rmsnorm.add_rms_norm(x, r, gamma, offset=offset)
    for a, b in zip(fused, rmsnorm.add_rms_norm(x, r, wide)):
        assert oracle.bits_equal(a, b)
    dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd, offset=offset)
    dx32, dg32 = rmsnorm.rms_norm_backward(dy, x, wide, rstd)
    assert oracle.bits_equal(dx, dx32)
    assert dg.dtype == dtype and oracle.bits_equal(dg, dg32.astype(dtype))


@pytest.mark.parametrize("dtype", SIXTEEN, ids=dtype_id)
@pytest.mark.parametrize("n", (1, 15, 17, 1025, 17389), ids=lambda n: f"N{n}")
def test_every_isa_agrees_with_scalar(dtype, n, rng):
    x = oracle.make_x(rng, (9, n), dtype)
    gamma = oracle.make_gamma(rng, (n,), F32)
    with using("scalar", 1):
        ref_y, ref_r = rmsnorm.rms_norm(x, gamma)
        ref_h = rmsnorm.add_rms_norm(x, x[::-1].copy(), gamma)[2]
    for isa in ISAS:
        for threads in (1, 2):
            with using(isa, threads):
                y, r = rmsnorm.rms_norm(x, gamma)
                h = rmsnorm.add_rms_norm(x, x[::-1].copy(), gamma)[2]
            d = oracle.ulp_distance16(y, ref_y)
            assert d.max(initial=0) <= 1, f"{isa} t{threads}: {d.max()} ulp from scalar"
            np.testing.assert_allclose(r, ref_r, rtol=2.5e-7, err_msg=f"{isa} t{threads}")
            assert oracle.bits_equal(h, ref_h), f"{isa} t{threads}: h differs"


@pytest.mark.parametrize(
    "a, b",
    [(F16, BF16), (BF16, F16), (BF16, F32), (F32, BF16), (F16, F32)],
    ids=lambda d: dtype_id(d),
)
def test_mismatched_dtypes_raise(a, b, rng):
    x = oracle.make_x(rng, (3, 8), a)
    other = oracle.make_x(rng, (3, 8), b)
    gamma = np.ones(8, dtype=F32)
    _, rstd = rmsnorm.rms_norm(x, gamma)
    with pytest.raises(TypeError, match=oracle.dtype_re(a)) as ei:
        rmsnorm.rms_norm_backward(other, x, gamma, rstd)
    assert re.search(oracle.dtype_re(b), str(ei.value))
    with pytest.raises(TypeError, match=oracle.dtype_re(b)) as ei:
        rmsnorm.add_rms_norm(x, other, gamma)
    assert re.search(oracle.dtype_re(a), str(ei.value))


def test_float16_subnormals(rng):
    """Rows of float16 subnormals normalize like any other (eps=0); their squares are
    normal float32 numbers, so no rescaling is needed for a correct result."""
    dtype = F16
    tiny = float(np.finfo(F16).smallest_subnormal)
    x = oracle.round_to(rng.integers(1, 64, (4, 40)) * tiny * rng.choice([-1, 1], (4, 40)), F16)
    y, rstd = rmsnorm.rms_norm(x, eps=0.0)
    y64, _, r64, _ = oracle.forward(x, eps=0.0)
    oracle.assert_y_close(y, y64, 1, dtype)
    oracle.assert_rstd_close(rstd, r64, dtype)
