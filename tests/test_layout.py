"""Memory layouts: transposed, stepped, negative-stride, Fortran, broadcast (stride 0),
misaligned, byte-swapped and read-only inputs (and non-contiguous out) give the same numbers
as their contiguous native copies; no input is ever modified; lists and scalars work."""

import numpy as np
import oracle
import pytest
from oracle import ALL_DTYPES, BF16, F32, F64, SIXTEEN, dtype_id

import rmsnorm

ROWS, N = 5, 67  # a SIMD tail on every ISA


def _transposed(v):
    return np.ascontiguousarray(v.T).T


def _stepped(v):
    big = np.zeros(tuple(2 * s + 1 for s in v.shape), dtype=v.dtype)
    view = big[tuple(slice(1, None, 2) for _ in v.shape)]
    view[...] = v
    return view


def _negative(v):
    flip = tuple(slice(None, None, -1) for _ in v.shape)
    return np.ascontiguousarray(v[flip])[flip]


def _padded(v):  # rows with a stride longer than the row (a slice of a wider array)
    big = np.zeros(v.shape[:-1] + (v.shape[-1] + 5,), dtype=v.dtype)
    big[..., 2 : 2 + v.shape[-1]] = v
    return big[..., 2 : 2 + v.shape[-1]]


def _fortran(v):
    return np.asfortranarray(v)


def _broadcast(v):  # stride 0 along the first axis (all rows equal)
    return np.broadcast_to(v[:1], v.shape)


def _misaligned(v):
    buf = np.zeros(v.nbytes + 1, dtype=np.uint8)
    view = np.ndarray(v.shape, dtype=v.dtype, buffer=buf, offset=1)
    view[...] = v
    assert view.ctypes.data % v.dtype.itemsize != 0 or v.dtype.itemsize == 1
    return view


def _byteswapped(v):
    return v.astype(v.dtype.newbyteorder(">"))


def _read_only(v):
    c = v.copy()
    c.flags.writeable = False
    return c


LAYOUTS = {
    "transposed": _transposed,
    "stepped": _stepped,
    "negative": _negative,
    "padded": _padded,
    "fortran": _fortran,
    "broadcast": _broadcast,
    "misaligned": _misaligned,
    "byteswapped": _byteswapped,
    "read_only": _read_only,
}


def layout(name, v):
    """(view, contiguous native copy with the same values)."""
    if name == "byteswapped" and v.dtype == BF16:
        pytest.skip("ml_dtypes has no byte-swapped bfloat16")
    view = LAYOUTS[name](v)
    native = np.ascontiguousarray(view).astype(v.dtype)
    assert oracle.bits_equal(np.asarray(view).astype(v.dtype), native)
    return view, native


def assert_same(actual, ref, what, exact=True):
    """Same numbers as the contiguous call. Exact for elementwise results (y, rstd, h; a
    reduction in float64 rounded to float32 can't tell the layout); float64 results and the
    float32-accumulated backward results may differ by a few ulps if the strided path sums in
    another order."""
    if ref is None:
        assert actual is None
        return
    actual = np.asarray(actual)
    assert actual.shape == ref.shape and actual.dtype == ref.dtype, what
    if exact and ref.dtype != F64:
        assert oracle.bits_equal(actual, ref), f"{what} differs from the contiguous result"
        return
    a = oracle.as_f64(actual)
    r = oracle.as_f64(ref)
    rtol = 1e-13 if ref.dtype == F64 else (1e-5 if ref.dtype == F32 else 1e-2)
    # the scale from the finite values: an Inf (a 16-bit result that overflowed) would make
    # the tolerance infinite; assert_allclose checks the Inf and NaN positions themselves
    scale = np.max(np.abs(r[np.isfinite(r)]), initial=0)
    np.testing.assert_allclose(a, r, rtol=rtol, atol=rtol * scale, err_msg=what)


def snapshots(args):
    return {k: np.array(v, copy=True) for k, v in args.items() if isinstance(v, np.ndarray)}


def assert_unmodified(args, snaps):
    for k, before in snaps.items():
        assert oracle.bits_equal(np.asarray(args[k]), before), f"input {k} was modified"


def inputs(rng, dtype, gamma_dtype=None):
    x = oracle.make_x(rng, (ROWS, N), dtype)
    gamma = oracle.make_gamma(rng, (N,), gamma_dtype or dtype)
    dy = oracle.make_x(rng, (ROWS, N), dtype, spread=False)
    res = oracle.make_x(rng, (ROWS, N), dtype)
    return x, gamma, dy, res


# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ("x", "gamma"))
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_rms_norm_layouts(dtype, name, which, rng):
    x, gamma, _, _ = inputs(rng, dtype)
    args = {"x": x, "gamma": gamma}
    view, native = layout(name, args[which])
    args[which] = native
    ref = rmsnorm.rms_norm(args["x"], args["gamma"], offset=0.5)
    args[which] = view
    snaps = snapshots(args)
    got = rmsnorm.rms_norm(args["x"], args["gamma"], offset=0.5)
    assert_unmodified(args, snaps)
    assert_same(got[0], ref[0], "y")
    assert_same(got[1], ref[1], "rstd")


@pytest.mark.parametrize("which", ("dy", "x", "gamma", "rstd"))
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_backward_layouts(dtype, name, which, rng):
    x, gamma, dy, _ = inputs(rng, dtype)
    _, rstd = rmsnorm.rms_norm(x, gamma)
    args = {"dy": dy, "x": x, "gamma": gamma, "rstd": rstd}
    view, native = layout(name, args[which])
    args[which] = native
    ref = rmsnorm.rms_norm_backward(args["dy"], args["x"], args["gamma"], args["rstd"],
                                    offset=1.0)
    args[which] = view
    snaps = snapshots(args)
    got = rmsnorm.rms_norm_backward(args["dy"], args["x"], args["gamma"], args["rstd"],
                                    offset=1.0)
    assert_unmodified(args, snaps)
    assert_same(got[0], ref[0], "dx", exact=False)
    assert_same(got[1], ref[1], "dgamma", exact=False)


@pytest.mark.parametrize("which", ("x", "residual", "gamma"))
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_add_rms_norm_layouts(dtype, name, which, rng):
    x, gamma, _, res = inputs(rng, dtype)
    args = {"x": x, "residual": res, "gamma": gamma}
    view, native = layout(name, args[which])
    args[which] = native
    ref = rmsnorm.add_rms_norm(args["x"], args["residual"], args["gamma"], cast="before_weight")
    args[which] = view
    snaps = snapshots(args)
    got = rmsnorm.add_rms_norm(args["x"], args["residual"], args["gamma"], cast="before_weight")
    assert_unmodified(args, snaps)
    for g, r, what in zip(got, ref, ("y", "rstd", "h")):
        assert_same(g, r, what)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_all_inputs_in_odd_layouts_at_once(dtype, rng):
    x, gamma, dy, res = inputs(rng, dtype)
    xv, gv, dv, rv = _transposed(x), _stepped(gamma), _negative(dy), _misaligned(res)
    for a in (xv, gv, dv, rv):
        a.flags.writeable = False
    ref_y, ref_r, ref_h = rmsnorm.add_rms_norm(x, res, gamma)
    y, r, h = rmsnorm.add_rms_norm(xv, rv, gv)
    assert_same(y, ref_y, "y")
    assert_same(r, ref_r, "rstd")
    assert_same(h, ref_h, "h")
    rv_ = _negative(r)
    ref_dx, ref_dg = rmsnorm.rms_norm_backward(dy, x, gamma, r)
    dx, dg = rmsnorm.rms_norm_backward(dv, xv, gv, rv_)
    assert_same(dx, ref_dx, "dx", exact=False)
    assert_same(dg, ref_dg, "dgamma", exact=False)


@pytest.mark.parametrize("shape, gshape", [((3, 4, 5, 6), (5, 6)), ((4, 6, 5), (6, 5))],
                         ids=("4d", "3d"))
@pytest.mark.parametrize("dtype", (F32, BF16), ids=dtype_id)
def test_multi_axis_transposes(dtype, shape, gshape, rng):
    """Arbitrary axis permutations of x and a transposed multi-dim gamma."""
    base = oracle.make_x(rng, shape[::-1], dtype)
    x = base.transpose(tuple(range(len(shape)))[::-1])  # non-contiguous, shape == shape
    assert x.shape == shape and not x.flags.c_contiguous
    gamma = oracle.make_gamma(rng, gshape[::-1], dtype).T
    ref = rmsnorm.rms_norm(np.ascontiguousarray(x), np.ascontiguousarray(gamma))
    got = rmsnorm.rms_norm(x, gamma)
    assert_same(got[0], ref[0], "y")
    assert_same(got[1], ref[1], "rstd")
    y64, _, r64, _ = oracle.forward(x, gamma)
    oracle.assert_y_close(got[0], y64, len(shape) - len(gshape), dtype)


# ---------------------------------------------------------------------------------------
# non-contiguous out

OUT_LAYOUTS = ("transposed", "stepped", "negative", "padded", "misaligned")


@pytest.mark.parametrize("name", OUT_LAYOUTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_non_contiguous_out(dtype, name, rng):
    x, gamma, dy, res = inputs(rng, dtype)
    fill = np.full((ROWS, N), 3, dtype=dtype)

    ref_y, ref_r = rmsnorm.rms_norm(x, gamma)
    out = LAYOUTS[name](fill)
    y, _ = rmsnorm.rms_norm(x, gamma, out=out)
    assert y is out
    assert_same(np.ascontiguousarray(out), ref_y, "rms_norm out")

    ref_dx, _ = rmsnorm.rms_norm_backward(dy, x, gamma, ref_r)
    out = LAYOUTS[name](fill)
    dx, _ = rmsnorm.rms_norm_backward(dy, x, gamma, ref_r, out=out)
    assert dx is out
    assert_same(np.ascontiguousarray(out), ref_dx, "backward out", exact=False)

    ry, _, rh = rmsnorm.add_rms_norm(x, res, gamma)
    out = LAYOUTS[name](fill)
    rout = LAYOUTS[name](fill)
    y, _, h = rmsnorm.add_rms_norm(x, res, gamma, out=out, residual_out=rout)
    assert y is out and h is rout
    assert_same(np.ascontiguousarray(out), ry, "add_rms_norm out")
    assert_same(np.ascontiguousarray(rout), rh, "add_rms_norm residual_out")


def test_in_place_on_a_strided_view(rng):
    """out=x where x is a non-contiguous view: only the view's elements change."""
    big = rng.standard_normal((10, 40))
    before = big.copy()
    view = big[::2, 1::3]
    ref_y, _ = rmsnorm.rms_norm(view.copy())
    y, _ = rmsnorm.rms_norm(view, out=view)
    assert y is view
    assert_same(np.ascontiguousarray(view), ref_y, "y")
    mask = np.ones(big.shape, bool)
    mask[::2, 1::3] = False
    np.testing.assert_array_equal(big[mask], before[mask])


# ---------------------------------------------------------------------------------------
# inputs never modified (every function, every option)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_inputs_never_modified(dtype, rng):
    x, gamma, dy, res = inputs(rng, dtype, F32)
    x[1, 3] = np.nan  # non-finite rows too
    snaps = {k: v.copy() for k, v in dict(x=x, gamma=gamma, dy=dy, res=res).items()}

    def check():
        for k, v in dict(x=x, gamma=gamma, dy=dy, res=res).items():
            assert oracle.bits_equal(v, snaps[k]), f"{k} modified"

    for cast in ("end", "before_weight"):
        for offset in (0.0, 1.0):
            _, rstd = rmsnorm.rms_norm(x, gamma, 1e-5, offset=offset, cast=cast)
            check()
            r0 = rstd.copy()
            rmsnorm.rms_norm_backward(dy, x, gamma, rstd, offset=offset)
            check()
            assert oracle.bits_equal(rstd, r0), "rstd modified"
            rmsnorm.add_rms_norm(x, res, gamma, 1e-5, offset=offset, cast=cast)
            check()
            rmsnorm.rms_norm(x, None, cast=cast)
            rmsnorm.add_rms_norm(x, res, None, cast=cast)
            rmsnorm.rms_norm_backward(dy, x, None, r0)
            check()


# ---------------------------------------------------------------------------------------
# array-likes and scalars


def test_python_lists():
    xl = [[1.0, 2.0, 3.0], [4.0, -5.0, 6.5]]
    gl = [0.5, 1.0, 2.0]
    y, rstd = rmsnorm.rms_norm(xl, gl)
    ref = rmsnorm.rms_norm(np.array(xl), np.array(gl))
    assert y.dtype == F64 and rstd.dtype == F64
    assert_same(y, ref[0], "y")
    y64, _, r64, _ = oracle.forward(np.array(xl), np.array(gl))
    oracle.assert_y_close(y, y64, 1, F64)
    # integer lists become float64
    yi, ri = rmsnorm.rms_norm([[1, 2, 3], [4, 5, 6]], [1, 2, 3])
    assert yi.dtype == F64
    assert_same(yi, rmsnorm.rms_norm(np.array([[1.0, 2, 3], [4, 5, 6]]),
                                     np.array([1.0, 2, 3]))[0], "y int list")
    # 1-D list, tuple
    y1, r1 = rmsnorm.rms_norm((3.0, 4.0))
    assert r1.shape == ()
    np.testing.assert_allclose(y1, [0.6 * np.sqrt(2), 0.8 * np.sqrt(2)], rtol=1e-6)
    # backward and fused with lists
    dx, dg = rmsnorm.rms_norm_backward([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], xl, gl, rstd)
    ref_dx, ref_dg = rmsnorm.rms_norm_backward(np.array([[1.0, 0, 0], [0, 1.0, 0]]),
                                               np.array(xl), np.array(gl), rstd)
    assert_same(dx, ref_dx, "dx", exact=False)
    assert_same(dg, ref_dg, "dgamma", exact=False)
    y2, r2, h2 = rmsnorm.add_rms_norm(xl, [[1, 1, 1], [1, 1, 1]], gl)
    np.testing.assert_array_equal(h2, np.array(xl) + 1)


def test_list_with_16bit_gamma_and_float32_scalars(rng):
    x = np.array([[1.0, 2.0, 3.0]], dtype=F32)
    g = np.array([1.0, 2.0, 3.0], dtype=BF16)
    y, rstd = rmsnorm.rms_norm(x, g)
    assert y.dtype == F32
    np.testing.assert_allclose(y, x * rstd[:, None] * np.array([1.0, 2, 3]), rtol=1e-6)


@pytest.mark.parametrize("dtype", (F32, F64) + SIXTEEN, ids=dtype_id)
def test_scalar_eps_and_offset_types(dtype, rng):
    x, gamma, _, _ = inputs(rng, dtype)
    ref = rmsnorm.rms_norm(x, gamma, 0.0, offset=1.0)
    for eps in (0, np.float64(0.0), np.float32(0.0), np.int64(0)):
        for offset in (1, np.float64(1.0), np.float32(1.0), np.int32(1)):
            got = rmsnorm.rms_norm(x, gamma, eps, offset=offset)
            assert_same(got[0], ref[0], f"eps={eps!r} offset={offset!r}")
    eps32 = np.float32(1e-3)
    assert_same(rmsnorm.rms_norm(x, gamma, eps32)[1],
                rmsnorm.rms_norm(x, gamma, float(eps32))[1], "eps float32 scalar")
