"""The float64 oracle against streamed outputs: every output streamed where its rows allow it
(threshold 0), rows split across two threads (their shares cut rows mid-row), the forward (both
cast modes), the add (also in place) and the backward, every dtype and ISA, rows that hit every
SIMD tail, short rows in groups, long rows, a multi-axis gamma, views as inputs, and outputs on a
cache line and off it."""

import numpy as np
import oracle
import pytest
from conftest import ISAS, last_team, using
from oracle import ALL_DTYPES, dtype_id

import rmsnorm

SHAPES = [
    ("N1", (5, 1), (1,)),
    ("N7", (5, 7), (7,)),
    ("N17", (5, 17), (17,)),
    ("N33", (5, 33), (33,)),
    ("N64", (40, 64), (64,)),
    ("N128", (40, 128), (128,)),
    ("N1025", (5, 1025), (1025,)),
    ("N4097", (5, 4097), (4097,)),
    ("N17389", (3, 17389), (17389,)),
    ("gamma2d", (3, 5, 6, 70), (6, 70)),
    ("long_rows", (2, 70001), (70001,)),
    ("zero_rows", (0, 64), (64,)),
]


def at(shape, dtype, shift):
    """A C-order array `shift` elements past the start of a cache line."""
    n = int(np.prod(shape))
    buf = np.zeros(n + 64, dtype)
    start = (-buf.ctypes.data % 64) // buf.itemsize + shift
    return buf[start : start + n].reshape(shape)


def view(a, kind):
    """a's values in a view: contiguous, rows in reverse order (a negative row stride), or rows
    one row apart (a stride of two rows)."""
    if kind == "contiguous" or a.ndim < 2:
        return a
    if kind == "reversed":
        return np.ascontiguousarray(a[::-1])[::-1]
    big = np.zeros((2 * a.shape[0],) + a.shape[1:], a.dtype)
    big[::2] = a
    return big[::2]


@pytest.mark.parametrize("threads", (1, 2), ids=("t1", "t2"))
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_streamed_outputs_match_oracle(shape, dtype, isa, threads, rng):
    _, xs, gs = shape
    lead = len(xs) - len(gs)
    x = oracle.make_x(rng, xs, dtype, lead_ndim=lead)
    res = oracle.make_x(rng, xs, dtype, lead_ndim=lead)
    dy = oracle.make_x(rng, xs, dtype, spread=False)
    gamma = oracle.make_gamma(rng, gs, dtype)
    if x.size and xs[0] > 2:  # rows that take the slow path: zero, squares that underflow
        x[1] = 0
        x[2] = oracle.round_to(oracle.as_f64(x[2]) * 1e-30, dtype) if dtype.itemsize > 2 else x[2]
    team = min(threads, x.size) or 1
    y64, _, r64, _ = oracle.forward(x, gamma)
    h_ref, ya64, _, ra64, _ = oracle.add_rms_norm(x, res, gamma)
    with using(isa, threads, stream_bytes=0):
        for kind, shift in (("contiguous", 0), ("reversed", 1), ("spaced", 3)):
            xv, rv, dyv = view(x, kind), view(res, kind), view(dy, kind)
            # forward, cast at the end
            y, rstd = rmsnorm.rms_norm(xv, gamma, out=at(xs, dtype, shift))
            assert last_team() == team
            oracle.assert_y_close(y, y64, lead, dtype)
            oracle.assert_rstd_close(rstd, r64, dtype)
            # cast before the weight
            yb, rb = rmsnorm.rms_norm(xv, gamma, cast="before_weight", out=at(xs, dtype, shift))
            yb64, _, _, _ = oracle.forward(x, gamma, cast="before_weight", rstd=rb)
            oracle.assert_y_close(yb, yb64, lead, dtype)
            # the add into fresh outputs, and in place (y over x, h over the residual)
            ya, ra, h = rmsnorm.add_rms_norm(
                xv, rv, gamma, out=at(xs, dtype, shift), residual_out=at(xs, dtype, shift)
            )
            assert oracle.bits_equal(h, h_ref), f"h ({kind}, shift {shift})"
            oracle.assert_y_close(ya, ya64, lead, dtype)
            oracle.assert_rstd_close(ra, ra64, dtype)
            xi, ri = at(xs, dtype, shift), at(xs, dtype, shift)
            xi[...], ri[...] = x, res
            rmsnorm.add_rms_norm(xi, ri, gamma, out=xi, residual_out=ri)
            assert oracle.bits_equal(ri, h_ref)
            oracle.assert_y_close(xi, ya64, lead, dtype)
            # the backward, with and without a weight
            dx, dg = rmsnorm.rms_norm_backward(dyv, xv, gamma, rstd, out=at(xs, dtype, shift))
            dx64, dg64, scale, dg_abs = oracle.backward(dy, x, gamma, rstd)
            oracle.assert_dx_close(dx, dx64, scale, dtype)
            oracle.assert_dgamma_close(dg, dg64, dg_abs, dtype, dtype)
            if lead == len(xs) - 1:
                dx0, _ = rmsnorm.rms_norm_backward(dyv, xv, None, rstd, out=at(xs, dtype, shift))
                dx064, _, scale0, _ = oracle.backward(dy, x, None, rstd)
                oracle.assert_dx_close(dx0, dx064, scale0, dtype)
                assert last_team() == team
