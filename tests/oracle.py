"""Float64 NumPy reference for rmsnorm (forward, both cast modes, backward, add_rms_norm)
and the comparison helpers the tests share.

Everything is computed in float64 from the exact input values; 16-bit results are rounded
once from float64 (correctly rounded), so the tolerances in the assert helpers below measure
only the error of the package.
"""

import ml_dtypes
import numpy as np

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
SIXTEEN = (F16, BF16)
ALL_DTYPES = (F32, F64, F16, BF16)
DTYPE_IDS = {F32: "f32", F64: "f64", F16: "f16", BF16: "bf16"}


def dtype_id(dt):
    return DTYPE_IDS[np.dtype(dt)]


def dtype_re(dt):
    """Regex matching the dtype's name as a word ("float16" must not match "bfloat16")."""
    return rf"(?<![A-Za-z0-9_]){np.dtype(dt).name}(?![0-9])"


def compute_dtype(dtype):
    """The dtype the package does its arithmetic (and stores rstd) in."""
    return F64 if np.dtype(dtype) == F64 else F32


# ---------------------------------------------------------------------------------------
# shapes shared by the test modules

TAILS = (1, 7, 15, 16, 17, 33, 1025, 4097, 17389)
# (id, x shape, gamma shape): row lengths that hit every SIMD tail, plus the odd cases
SHAPES = [(f"N{n}", (5, n), (n,)) for n in TAILS] + [
    ("N65539", (3, 65539), (65539,)),
    # short rows of the lengths the 16-bit add and backward compile as constants, over groups
    ("N64", (40, 64), (64,)),
    ("N128", (40, 128), (128,)),
    ("zero_rows", (0, 8), (8,)),
    ("1d", (37,), (37,)),
    ("gamma2d", (3, 5, 6, 7), (6, 7)),
    ("long_rows", (2, 300000), (300000,)),  # few rows: the row itself is split across threads
    ("short_rows", (20000, 3), (3,)),
]
SHAPE_IDS = [s[0] for s in SHAPES]

# ---------------------------------------------------------------------------------------
# rounding


def round_to(a, dtype):
    """Correctly rounded (RNE) conversion of a float64 array to dtype.

    ml_dtypes converts float64 -> bfloat16 through float32, which double-rounds (e.g.
    1 + 2**-8 + 2**-30 becomes 1.0). Rounding to float32 with round-to-odd first and then
    to bfloat16 is exact, because float32 carries more than 2 extra bits.
    """
    dtype = np.dtype(dtype)
    a = np.asarray(a, dtype=F64)
    if dtype != BF16:
        return a.astype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        f = a.astype(F32)
        f64 = f.astype(F64)
        inexact = np.isfinite(a) & np.isfinite(f) & (f64 != a)
        # truncate toward zero, then force the last bit to 1 when inexact
        too_big = inexact & (np.abs(f64) > np.abs(a))
        f = np.where(too_big, np.nextafter(f, np.float32(0)), f).astype(F32)
        bits = f.view(np.uint32) | inexact.astype(np.uint32)
        return bits.view(F32).astype(BF16)


def as_f64(a):
    return np.asarray(a).astype(F64)


# ---------------------------------------------------------------------------------------
# reference math


def _rows(x, gamma_ndim):
    """Reshape x (float64) to (rows, K) and return the leading (rstd) shape."""
    x = np.asarray(x)
    lead = x.shape[: x.ndim - gamma_ndim]
    k = int(np.prod(x.shape[x.ndim - gamma_ndim :], dtype=np.int64))
    rows = int(np.prod(lead, dtype=np.int64))
    return as_f64(x).reshape(rows, k), lead, k


def weight(gamma, offset, x_dtype, k):
    """w = offset + gamma, in the package's compute dtype (float32 / float64), as float64."""
    if gamma is None:
        return np.ones(k, dtype=F64)
    ct = compute_dtype(x_dtype)
    g = np.asarray(gamma).astype(ct).reshape(k)
    return (ct.type(offset) + g).astype(F64)


def rstd_f64(x2d, eps):
    """1/sqrt(mean(x^2) + eps) per row in float64, also where x^2 over/underflows: such
    rows are scaled by a power of two (exact) before squaring."""
    rows = x2d.shape[0]
    if x2d.shape[1] == 0:
        return np.full(rows, np.nan)
    with np.errstate(all="ignore"):
        amax = np.max(np.abs(x2d), axis=1)
        r = 1.0 / np.sqrt(np.mean(x2d * x2d, axis=1) + eps)
        odd = np.isfinite(amax) & (amax > 0) & ((amax > 2.0**500) | (amax < 2.0**-500))
        for i in np.nonzero(odd)[0]:
            s = np.ldexp(1.0, int(np.frexp(amax[i])[1]) - 1)  # |x/s| < 2
            xs = x2d[i] / s
            ms = np.mean(xs * xs)
            if amax[i] > 1:
                # 1/s is exact (>= 2**-1023); eps/s^2 negligible or exact
                r[i] = (1.0 / s) / np.sqrt(ms + eps / (s * s))
            elif eps > 0:
                r[i] = 1.0 / np.sqrt(ms * s * s + eps)
            else:
                r[i] = 1.0 / (s * np.sqrt(ms))
    r[~np.isfinite(amax)] = np.nan
    return r


def forward(x, gamma=None, eps=1e-6, offset=0.0, cast="end", rstd=None):
    """Returns (y_f64, y_rounded, rstd_f64, rstd_rounded).

    y_f64 is the exact (float64) value before the final rounding to x.dtype; for
    cast="before_weight" the intermediate x*rstd is rounded to x.dtype first.

    rstd: the package's rstd, for cast="before_weight": the intermediate is then x * rstd as
    the package forms it, a product in the compute dtype rounded to x.dtype. The float64
    rstd alone cannot predict that rounding: the package's float32 rstd may be an ulp from
    the float64 one (assert_rstd_close), and the float32 product is rounded twice, so where
    x * rstd lies next to a midpoint of x.dtype the intermediate moves by an ulp of x.dtype,
    and y by up to |w| of those (2 ulps of y and more). rstd itself is checked on its own.
    """
    x = np.asarray(x)
    dt = x.dtype
    gnd = 1 if gamma is None else np.asarray(gamma).ndim
    x2, lead, k = _rows(x, gnd)
    w = weight(gamma, offset, dt, k)
    r = rstd_f64(x2, eps)
    with np.errstate(all="ignore"):
        xhat = x2 * r[:, None]
        if cast == "before_weight":
            if rstd is not None:
                ct = compute_dtype(dt)
                rc = np.asarray(rstd, ct).reshape(-1)
                xhat = x2.astype(ct) * rc[:, None]  # rounded once, to ct (x2 is exact in ct)
            xhat = as_f64(round_to(as_f64(xhat), dt))
        y = xhat * w[None, :]
    y = y.reshape(x.shape)
    r = r.reshape(lead)
    return y, round_to(y, dt), r, round_to(r, compute_dtype(dt))


# float32's smallest subnormal: the absolute error of one rounding below its normal range
UNDERFLOW32 = 2.0**-149
# float32's largest finite value: beyond it, float32 arithmetic gives Inf
OVERFLOW32 = float(np.finfo(np.float32).max)
# dx and dgamma of 16- and 32-bit inputs: relative to the magnitude of their terms (float32
# reductions of up to ~3e5 terms)
DX_RTOL32 = 1e-5


def backward(dy, x, gamma, rstd=None, offset=0.0, eps=1e-6):
    """Returns (dx_f64, dgamma_f64, scale, dgamma_abs): scale (shape of x) is the magnitude
    of the terms that make up dx (a tolerance that survives cancellation); dgamma_f64 and
    dgamma_abs = sum |dy*xhat| have gamma's shape (None when gamma is None).

    rstd: the package's rstd (used as given, like the package does); None -> oracle rstd.
    """
    x = np.asarray(x)
    dt = x.dtype
    gnd = 1 if gamma is None else np.asarray(gamma).ndim
    x2, lead, k = _rows(x, gnd)
    dy2 = as_f64(dy).reshape(x2.shape)
    if rstd is None:
        r = rstd_f64(x2, eps)
    else:
        r = as_f64(rstd).reshape(-1)
    w = weight(gamma, offset, dt, k)
    with np.errstate(all="ignore"):
        xhat = x2 * r[:, None]
        g = dy2 * w[None, :]
        c = np.sum(g * xhat, axis=1) / k if k else np.zeros(x2.shape[0])
        dx = r[:, None] * (g - xhat * c[:, None])
        mean_abs = np.sum(np.abs(g * xhat), axis=1) / max(k, 1)
        scale = np.abs(r)[:, None] * (np.abs(g) + np.abs(xhat) * mean_abs[:, None])
        dgamma = None
        dgamma_abs = None
        if gamma is not None:
            dgamma = np.sum(dy2 * xhat, axis=0).reshape(np.shape(gamma))
            dgamma_abs = np.sum(np.abs(dy2 * xhat), axis=0).reshape(np.shape(gamma))
        if compute_dtype(dt) == F32:
            # float32 arithmetic also has an absolute error: a product below its normal range
            # keeps fewer bits, losing up to UNDERFLOW32 (xhat = x*rstd, g = dy*w, the terms
            # of c, the fma and the final product). In units of the relative tolerance
            # (DX_RTOL32) these join the magnitudes, so that tiny terms are not held to 1e-5
            # of themselves.
            mean_xg = np.sum(np.abs(xhat) + np.abs(g), axis=1) / max(k, 1)
            floor = (
                np.abs(r)[:, None]
                * (np.abs(c)[:, None] + 2 + np.abs(xhat) * (mean_xg + 1)[:, None])
                + 1
            )
            scale = scale + floor * (UNDERFLOW32 / DX_RTOL32)
            if gamma is not None:
                dg_floor = (np.sum(np.abs(dy2), axis=0) + x2.shape[0]).reshape(np.shape(gamma))
                dgamma_abs = dgamma_abs + dg_floor * (UNDERFLOW32 / DX_RTOL32)
            # ... and a ceiling: where a float32 evaluation of the formula overflows (a term
            # of xhat, g, g*xhat, their sum, xhat*c, g - xhat*c or dx itself beyond float32's
            # range), float32 gives Inf or NaN for a value that float64 holds. Those rows of dx
            # (columns of dgamma) may be non-finite: the tolerance there is infinite, and
            # assert_dx_close / assert_dgamma_close accept any value. The rest is checked.
            big = OVERFLOW32 * (1 - DX_RTOL32)
            hc = xhat * c[:, None]
            row_over = np.zeros(x2.shape[0], bool)
            for t in (xhat, g, g * xhat, hc, g - hc, dx):
                row_over |= np.any(np.abs(t) > big, axis=1)
            row_over |= np.abs(c) * k > big
            # (rows with NaN or Inf among their inputs keep their NaN rule)
            finite_in = np.all(np.isfinite(x2) & np.isfinite(dy2) & np.isfinite(w), axis=1)
            finite_in &= np.isfinite(r)
            scale[row_over & finite_in] = np.inf
            if gamma is not None:
                col_over = np.any(np.abs(dy2 * xhat)[finite_in] > big, axis=0)
                if finite_in.all():
                    col_over |= (np.abs(dgamma) > big).reshape(-1)
                dgamma_abs = np.where(col_over.reshape(np.shape(gamma)), np.inf, dgamma_abs)
    return dx.reshape(x.shape), dgamma, scale.reshape(x.shape), dgamma_abs


def add(x, residual):
    """h = x + residual, the add done in float32 (float64 for float64 x) as the package
    specifies, then rounded once to x.dtype (exact for float32/float64)."""
    x = np.asarray(x)
    ct = compute_dtype(x.dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        s = x.astype(ct) + np.asarray(residual).astype(ct)
    return round_to(as_f64(s), x.dtype)


def add_rms_norm(x, residual, gamma=None, eps=1e-6, offset=0.0, cast="end"):
    h = add(x, residual)
    return (h,) + forward(h, gamma, eps, offset, cast)


# ---------------------------------------------------------------------------------------
# comparisons


def ulp_distance16(a, b):
    """Distance in units in the last place between two 16-bit arrays of the same dtype
    (+0 and -0 are equal). NaNs must be handled by the caller."""

    def ordered(v):
        bits = np.ascontiguousarray(v).view(np.uint16).astype(np.int64)
        mag = bits & 0x7FFF
        return np.where(bits & 0x8000, -mag, mag)

    return np.abs(ordered(a) - ordered(b))


def spacing16(v, dtype):
    """ulp of the 16-bit dtype at the (float64) values v."""
    v16 = np.ascontiguousarray(round_to(np.abs(as_f64(v)), dtype))
    # the successor is the next bit pattern (non-negative values)
    bits = v16.view(np.uint16)
    up = (bits + np.uint16(1)).view(np.dtype(dtype))
    with np.errstate(invalid="ignore"):
        return np.abs(as_f64(up) - as_f64(v16))


def _row_max(a, lead_ndim):
    """max |a| over the trailing (normalized) axes, broadcast back to a's shape."""
    a = np.abs(as_f64(a))
    if a.size == 0:
        return a
    axes = tuple(range(lead_ndim, a.ndim))
    return np.broadcast_to(np.max(a, axis=axes, keepdims=True), a.shape)


def same_nan(actual, expected_f64, free=None):
    """NaNs exactly where expected (NaN rows), returns the mask of finite expected values;
    free: where any value is accepted (float32 overflow, see backward)."""
    act = as_f64(actual)
    exp_nan = np.isnan(expected_f64)
    if free is None:
        free = np.zeros(exp_nan.shape, bool)
    np.testing.assert_array_equal(
        np.isnan(act) & ~free, exp_nan & ~free, err_msg="NaN positions differ"
    )
    return ~exp_nan & ~free


# float64: the sum of squares, the sqrt and the two products each add O(1e-16) relative
# error; with SIMD partial sums the accumulation error over 3e5 terms stays far below 1e-13.
# 1e-12 of the row's max |y| leaves margin and still catches any float32 step (~1e-7).
RTOL_F64 = 1e-12
# float32: rstd rounded to float32 (0.5 ulp = 6e-8), x*rstd and *w rounded (2 x 6e-8), y
# rounded (6e-8): <= ~3e-7 of the row's max |y|; 4e-6 allows a float32 partial-sum
# reduction of long rows while still catching a wrong eps, a wrong K or 16-bit math (4e-3).
RTOL_F32 = 4e-6
# 16-bit: the package computes y in float32 and rounds it once. Its float32 value is within
# Y_REL_ERR_F32 of the float64 one: rstd within 2.5e-7 (assert_rstd_close: 4.2 x 2**-24) and
# x * rstd and * w each rounded once (2 x 2**-24), under 8 x 2**-24 = 2**-21 in all. So every
# element must be the correctly rounded value, except where the float64 value lies within
# that distance of a rounding midpoint (near_midpoint16), and there within 1 ulp. Such
# elements are rare in random data but not in structured data: a row of one element has
# x * rstd == 1.0 in float32, and a weight on a midpoint of the 16-bit dtype (bfloat16 w =
# 1 + gamma with gamma's last bit set) then puts y exactly on it, to be rounded to even,
# while the float64 value lies just below.
Y_REL_ERR_F32 = 2.0**-21


# Below this, y's float32 products (x * rstd, then the weight: up to 16 here) may have passed
# through float32's subnormals, whose absolute error (UNDERFLOW32) is no longer small beside y.
SUBNORMAL_Y32 = 2.0**-122


def near_midpoint16(y_f64, dtype):
    """Whether each float64 value lies so near a rounding midpoint of the 16-bit dtype that a
    value within Y_REL_ERR_F32 of it may round to either neighbour (or so small that float32's
    subnormals may have carried it, SUBNORMAL_Y32: either neighbour too)."""
    with np.errstate(all="ignore"):
        lo = round_to(y_f64 * (1 - Y_REL_ERR_F32), dtype)
        hi = round_to(y_f64 * (1 + Y_REL_ERR_F32), dtype)
    return (ulp_distance16(lo, hi) > 0) | (np.abs(y_f64) < SUBNORMAL_Y32)


def assert_y_close(y, y_f64, lead_ndim, dtype=None, what="y"):
    """Compare a result (any dtype) with the float64 oracle value before rounding."""
    y = np.asarray(y)
    dtype = np.dtype(dtype or y.dtype)
    assert y.dtype == dtype, f"{what} dtype {y.dtype} != {dtype}"
    assert y.shape == np.shape(y_f64), f"{what} shape {y.shape} != {np.shape(y_f64)}"
    if y.size == 0:
        return
    fin = same_nan(y, y_f64)
    if dtype in SIXTEEN:
        expected = round_to(y_f64, dtype)
        d = ulp_distance16(y[fin], expected[fin])
        bad = (d > 0) & ~near_midpoint16(as_f64(y_f64)[fin], dtype)
        assert d.max(initial=0) <= 1, (
            f"{what}: {int((d > 1).sum())} elements more than 1 ulp off; worst {d.max()} ulp"
        )
        assert not bad.any(), (
            f"{what}: {int(bad.sum())}/{d.size} elements not correctly rounded, although "
            f"not within {Y_REL_ERR_F32:.3g} of a rounding midpoint"
        )
    else:
        rtol = RTOL_F64 if dtype == F64 else RTOL_F32
        scale = _row_max(np.where(np.isnan(y_f64), 0, y_f64), lead_ndim)
        err = np.abs(as_f64(y) - y_f64)
        tol = rtol * scale + np.finfo(dtype).tiny
        viol = fin & (err > tol)
        assert not viol.any(), (
            f"{what}: {int(viol.sum())} elements off; worst rel err "
            f"{np.max(err[fin] / np.maximum(scale[fin], 1e-300)):.3g} (rtol {rtol})"
        )


def assert_rstd_close(rstd, r_f64, x_dtype):
    """rstd is compared in its own dtype (float32 or float64)."""
    rstd = np.asarray(rstd)
    ct = compute_dtype(x_dtype)
    assert rstd.dtype == ct, f"rstd dtype {rstd.dtype} != {ct}"
    assert rstd.shape == np.shape(r_f64), f"rstd shape {rstd.shape} != {np.shape(r_f64)}"
    if rstd.size == 0:
        return
    fin = np.isfinite(r_f64)
    np.testing.assert_array_equal(np.isnan(rstd), np.isnan(r_f64), err_msg="rstd NaN positions")
    np.testing.assert_array_equal(np.isposinf(rstd), np.isposinf(r_f64), err_msg="rstd inf")
    # float64: a few ulps; float32: rounded once from a float64 computation -> <= 1 ulp
    # (2 allowed for a float32 sqrt/division)
    rtol = 1e-14 if ct == F64 else 2.5e-7
    np.testing.assert_allclose(as_f64(rstd)[fin], r_f64[fin], rtol=rtol, atol=0, err_msg="rstd")


def assert_dx_close(dx, dx_f64, scale, dtype):
    dx = np.asarray(dx)
    assert dx.dtype == dtype, f"dx dtype {dx.dtype} != {dtype}"
    assert dx.shape == np.shape(dx_f64), f"dx shape {dx.shape} != {np.shape(dx_f64)}"
    if dx.size == 0:
        return
    fin = same_nan(dx, dx_f64, free=np.isinf(scale) & ~np.isnan(dx_f64))
    err = np.abs(as_f64(dx) - dx_f64)
    # dx = rstd*(g - xhat*c) cancels; the error is relative to the size of its terms
    # (scale), not to dx itself: float64 1e-12, float32 / 16-bit arithmetic 1e-5 (row
    # reduction of g*xhat in float32), plus the final rounding of 16-bit results (1 ulp).
    if dtype == F64:
        tol = 1e-12 * scale
    elif dtype == F32:
        tol = DX_RTOL32 * scale
    else:
        tol = DX_RTOL32 * scale + spacing16(dx_f64, dtype)
    tol = tol + np.finfo(np.float32).tiny
    viol = fin & (err > tol)
    assert not viol.any(), (
        f"dx: {int(viol.sum())} elements off; worst err/tol {np.max((err / tol)[fin]):.3g}"
    )


def assert_dgamma_close(dg, dg_f64, dg_abs, gamma_dtype, x_dtype):
    """dgamma: accumulated in float32 (float64 for float64 x) over the rows, so the error is
    relative to sum |dy*xhat|: 1e-5 (float32, ~3e5 terms), 1e-12 (float64); plus one rounding
    to gamma's dtype (1 ulp of a 16-bit gamma dtype)."""
    dg = np.asarray(dg)
    gamma_dtype = np.dtype(gamma_dtype)
    assert dg.dtype == gamma_dtype, f"dgamma dtype {dg.dtype} != {gamma_dtype}"
    assert dg.shape == np.shape(dg_f64), f"dgamma shape {dg.shape} != {np.shape(dg_f64)}"
    if dg.size == 0:
        return
    fin = same_nan(dg, dg_f64, free=np.isinf(dg_abs) & ~np.isnan(dg_f64))
    rtol = 1e-12 if np.dtype(x_dtype) == F64 else DX_RTOL32
    tol = rtol * dg_abs
    if gamma_dtype in SIXTEEN:
        tol = tol + spacing16(dg_f64, gamma_dtype)
    elif gamma_dtype == F32:
        tol = tol + np.abs(dg_f64) * 2**-23
    tol = tol + 1e-30
    err = np.abs(as_f64(dg) - dg_f64)
    viol = fin & (err > tol)
    assert not viol.any(), (
        f"dgamma: {int(viol.sum())} elements off; worst err/tol {np.max((err / tol)[fin]):.3g}"
    )


def numeric_grad(loss, a, step=1e-6):
    """Central differences of the scalar loss(a) with respect to every element of a (float64):
    truncation error O(step**2) ~ 1e-12, round-off ~ 1e-16 / step ~ 1e-10."""
    grad = np.zeros(a.shape)
    for idx in np.ndindex(*a.shape):
        e = np.zeros(a.shape)
        e[idx] = step
        grad[idx] = (loss(a + e) - loss(a - e)) / (2 * step)
    return grad


def bits_equal(a, b):
    """Bitwise equality (NaN payloads included), for 'inputs never modified' checks."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


# ---------------------------------------------------------------------------------------
# data


def make_x(rng, shape, dtype, lead_ndim=None, spread=True):
    """Normal data with row scales spread over 1e-2..1e2 (so a wrong rstd shows), rounded
    to dtype."""
    shape = tuple(shape)
    a = rng.standard_normal(shape)
    if spread and len(shape) >= 2:
        lead = shape[: (len(shape) - 1 if lead_ndim is None else lead_ndim)]
        s = 10.0 ** rng.uniform(-2, 2, size=lead)
        a = a * s.reshape(lead + (1,) * (len(shape) - len(lead)))
    return round_to(a, dtype)


def make_gamma(rng, shape, dtype):
    return round_to(rng.uniform(0.5, 1.5, size=shape) * rng.choice([-1.0, 1.0], size=shape), dtype)
