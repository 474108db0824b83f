"""Outputs that share memory with inputs: every output (out, residual_out, the backward's out)
against every input (x, residual, gamma, dy, rstd), overlapping exactly, partly, and through
other strides, on one thread and on two that split the rows, with outputs stored plainly and
streamed. The result must be the float64 oracle's for the inputs as they were before the call
(NumPy's rule for ufuncs); the aliases that are allowed (an output that is x, residual or dy
itself) are not copied."""

import tracemalloc

import numpy as np
import oracle
import pytest
from conftest import last_team, using
from oracle import ALL_DTYPES, F32, dtype_id

import rmsnorm

M, K = 6, 67  # rows with a SIMD tail; the two threads cut the rows mid-row

# (function, output, input): every pair of an output and an input of the same call
PAIRS = [
    ("rms_norm", "out", "x"),
    ("rms_norm", "out", "gamma"),
    ("add_rms_norm", "out", "x"),
    ("add_rms_norm", "out", "residual"),
    ("add_rms_norm", "out", "gamma"),
    ("add_rms_norm", "residual_out", "x"),
    ("add_rms_norm", "residual_out", "residual"),
    ("add_rms_norm", "residual_out", "gamma"),
    ("rms_norm_backward", "out", "dy"),
    ("rms_norm_backward", "out", "x"),
    ("rms_norm_backward", "out", "gamma"),
    ("rms_norm_backward", "out", "rstd"),
]
ROW_INPUTS = ("x", "residual", "dy")  # of x's shape; gamma is (K,), rstd (M,)

# How the input lies in the output's buffer. For inputs of x's shape: the output itself, shifted
# by a few elements either way, by one row, its rows in reverse order, its transpose's memory,
# and the other rows of a buffer of twice as many (bounds that meet, no element shared). For
# gamma and rstd: the first or last row of the output, straddling two rows, and strided.
ROW_LAYOUTS = ("same", "shift+1", "shift-3", "shift+row", "reversed", "transposed", "interleaved")
VEC_LAYOUTS = ("first_row", "last_row", "straddling", "strided")


def row_views(layout, dtype):
    """(output, input), views of one buffer, of shape (M, K)."""
    n = M * K
    if layout == "same":
        out = np.zeros((M, K), dtype)
        return out, out
    if layout.startswith("shift"):
        s = {"shift+1": 1, "shift-3": -3, "shift+row": K}[layout]
        buf = np.zeros(n + abs(s), dtype)
        a, b = buf[max(s, 0) : max(s, 0) + n], buf[max(-s, 0) : max(-s, 0) + n]
        return a.reshape(M, K), b.reshape(M, K)
    if layout == "reversed":
        out = np.zeros((M, K), dtype)
        return out, out[::-1]
    if layout == "transposed":
        buf = np.zeros(n, dtype)
        return buf.reshape(M, K), buf.reshape(K, M).T
    if layout == "interleaved":
        buf = np.zeros((2 * M, K), dtype)
        return buf[::2], buf[1::2]
    raise AssertionError(layout)


def vec_view(layout, out, length):
    """An input vector of `length` elements inside `out` (M x K, C order), any dtype viewing
    the same bytes."""
    flat = out.reshape(-1)
    if layout == "first_row":
        return flat[:length]
    if layout == "last_row":
        return flat[flat.size - length :]
    if layout == "straddling":
        return flat[K // 2 : K // 2 + length]
    if layout == "strided":  # every third element
        return flat[: length * 3 : 3]
    raise AssertionError(layout)


def fill(dst, src):
    dst[...] = src
    return dst


def inputs(rng, dtype):
    x = oracle.make_x(rng, (M, K), dtype)
    res = oracle.make_x(rng, (M, K), dtype)
    dy = oracle.make_x(rng, (M, K), dtype, spread=False)
    gamma = oracle.make_gamma(rng, (K,), dtype)
    return x, res, dy, gamma


def call(fn, out_name, in_name, layout, dtype, offset, rng):
    """Runs fn with output `out_name` and input `in_name` laid out as `layout`; returns what to
    check: the returned arrays, the output arrays passed, and the inputs' values beforehand."""
    x, res, dy, gamma = inputs(rng, dtype)
    vals = {"x": x, "residual": res, "dy": dy, "gamma": gamma}
    _, rstd = rmsnorm.rms_norm(x, gamma, offset=offset)
    vals["rstd"] = rstd
    if in_name in ROW_INPUTS:
        out, src = row_views(layout, dtype)
        args = {in_name: fill(src, vals[in_name])}
    else:
        out = np.zeros((M, K), dtype)
        if in_name == "rstd":  # float32 (float64) values in the output's bytes
            src = rstd_view(layout, out, oracle.compute_dtype(dtype))
        else:
            src = vec_view(layout, out, K)
        args = {in_name: fill(src, vals[in_name])}
    before = {k: np.array(v, copy=True) for k, v in vals.items()}
    x_, res_, dy_ = (args.get(k, vals[k]) for k in ("x", "residual", "dy"))
    g_, r_ = args.get("gamma", gamma), args.get("rstd", rstd)
    if fn == "rms_norm":
        got = rmsnorm.rms_norm(x_, g_, offset=offset, **{out_name: out})
    elif fn == "add_rms_norm":
        got = rmsnorm.add_rms_norm(x_, res_, g_, offset=offset, **{out_name: out})
    else:
        got = rmsnorm.rms_norm_backward(dy_, x_, g_, r_, offset=offset, out=out)
    return got, out, before


def rstd_view(layout, out, ct):
    """M values of dtype ct in the output's bytes, laid out as `layout`."""
    raw = out.reshape(-1).view(np.uint8)
    step = ct.itemsize
    whole = raw[: raw.size // step * step].view(ct)
    if layout == "first_row":
        return whole[:M]
    if layout == "last_row":
        return whole[whole.size - M :]
    if layout == "straddling":
        start = (K * out.itemsize) // step - M // 2  # across the end of the first row
        return whole[start : start + M]
    if layout == "strided":  # about a row apart
        return whole[:: (K * out.itemsize) // step][:M]
    raise AssertionError(layout)


def check(fn, got, out, out_name, before, offset):
    x, res, dy, gamma, rstd = (before[k] for k in ("x", "residual", "dy", "gamma", "rstd"))
    dtype = x.dtype
    if fn == "rms_norm":
        y, r = got
        assert y is out
        y64, _, r64, _ = oracle.forward(x, gamma, offset=offset)
        oracle.assert_y_close(y, y64, 1, dtype)
        oracle.assert_rstd_close(r, r64, dtype)
    elif fn == "add_rms_norm":
        y, r, h = got
        assert (y if out_name == "out" else h) is out
        h_ref, y64, _, r64, _ = oracle.add_rms_norm(x, res, gamma, offset=offset)
        assert oracle.bits_equal(h, h_ref), "h is not round(x + residual)"
        oracle.assert_y_close(y, y64, 1, dtype)
        oracle.assert_rstd_close(r, r64, dtype)
    else:
        dx, dg = got
        assert dx is out
        dx64, dg64, scale, dg_abs = oracle.backward(dy, x, gamma, rstd, offset=offset)
        oracle.assert_dx_close(dx, dx64, scale, dtype)
        oracle.assert_dgamma_close(dg, dg64, dg_abs, gamma.dtype, dtype)


def cases():
    for fn, out_name, in_name in PAIRS:
        for layout in ROW_LAYOUTS if in_name in ROW_INPUTS else VEC_LAYOUTS:
            yield pytest.param(
                fn, out_name, in_name, layout, id=f"{fn}-{out_name}-{in_name}-{layout}"
            )


# threads, and the streaming threshold (None: the default, which these sizes are far below)
MODES = {"t1": (1, None), "t2": (2, None), "t2-streamed": (2, 0)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("fn, out_name, in_name, layout", list(cases()))
def test_output_over_input(fn, out_name, in_name, layout, dtype, mode, rng):
    threads, stream = MODES[mode]
    with using(threads=threads, stream_bytes=stream):
        got, out, before = call(fn, out_name, in_name, layout, dtype, 0.0, rng)
        assert last_team() == threads
    check(fn, got, out, out_name, before, 0.0)


@pytest.mark.parametrize("dtype", (F32,), ids=dtype_id)
def test_offset_gamma_over_output(dtype, rng):
    """A gamma that the call widens first (offset 1.0) inside the output, too."""
    with using(threads=2):
        got, out, before = call("rms_norm", "out", "gamma", "first_row", dtype, 1.0, rng)
    check("rms_norm", got, out, "out", before, 1.0)


def test_both_outputs_in_one_buffer_raise_naming_both(rng):
    x, res, _, gamma = inputs(rng, np.dtype(F32))
    buf = np.zeros(M * K + 1, F32)
    out, h = buf[1:].reshape(M, K), buf[:-1].reshape(M, K)
    for a, b in ((out, h), (out, out)):
        with pytest.raises(ValueError, match=r"residual_out.*out") as e:
            rmsnorm.add_rms_norm(x, res, gamma, out=a, residual_out=b)
        assert "share memory" in str(e.value)
    assert not buf.any()


# ---------------------------------------------------------------------------------------
# the allowed aliases run in place, without a copy

BIG = (64, 16384)  # 4 MiB of float32: a copy of an input would be seen


def traced_peak(f):
    """Peak bytes NumPy allocated while f ran (NumPy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        f()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_allowed_aliases_are_not_copied(rng):
    x = rng.standard_normal(BIG).astype(F32)
    res = rng.standard_normal(BIG).astype(F32)
    gamma = rng.uniform(0.5, 1.5, BIG[1]).astype(F32)
    _, rstd = rmsnorm.rms_norm(x, gamma)
    nbytes = x.nbytes
    calls = {
        "rms_norm out=x": lambda: rmsnorm.rms_norm(x, gamma, out=x),
        "add out=x": lambda: rmsnorm.add_rms_norm(x, res, gamma, out=x),
        "add out=residual": lambda: rmsnorm.add_rms_norm(x, res, gamma, out=res),
        "add residual_out=residual": lambda: rmsnorm.add_rms_norm(x, res, gamma, residual_out=res),
        "add residual_out=x": lambda: rmsnorm.add_rms_norm(x, res, gamma, residual_out=x),
        "add out=x, residual_out=residual": lambda: rmsnorm.add_rms_norm(
            x, res, gamma, out=x, residual_out=res
        ),
        "add out=residual, residual_out=x": lambda: rmsnorm.add_rms_norm(
            x, res, gamma, out=res, residual_out=x
        ),
        "backward out=dy": lambda: rmsnorm.rms_norm_backward(res, x, gamma, rstd, out=res),
        "backward out=x": lambda: rmsnorm.rms_norm_backward(res, x, gamma, rstd, out=x),
    }
    for what, f in calls.items():
        # the fresh outputs (y or h where not given, rstd, dgamma) are the only allocations
        fresh = nbytes if what.startswith("add") and "," not in what else 0
        assert traced_peak(f) < fresh + nbytes // 4, what
    # and the measurement sees a copy where one is made: x one element past the output
    buf = np.zeros(x.size + 1, F32)
    xs, out = buf[1:].reshape(BIG), buf[:-1].reshape(BIG)
    assert traced_peak(lambda: rmsnorm.rms_norm(xs, gamma, out=out)) >= nbytes


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("threads", (1, 2), ids=("t1", "t2"))
def test_every_pairing_of_aliases(dtype, threads, rng):
    """out and residual_out each x, residual or a fresh array; the backward's out dy or x: the
    oracle's results, on rows the threads share."""
    x, res, dy, gamma = inputs(rng, dtype)
    h_ref, y64, _, r64, _ = oracle.add_rms_norm(x, res, gamma)
    with using(threads=threads):
        for o, ro in ((0, 1), (1, 0), (0, None), (1, None), (None, 0), (None, 1)):
            xc, rc = x.copy(), res.copy()
            pick = {0: xc, 1: rc, None: None}
            y, r, h = rmsnorm.add_rms_norm(xc, rc, gamma, out=pick[o], residual_out=pick[ro])
            assert last_team() == threads
            assert pick[o] is None or y is pick[o]
            assert pick[ro] is None or h is pick[ro]
            assert oracle.bits_equal(h, h_ref)
            oracle.assert_y_close(y, y64, 1, dtype)
            oracle.assert_rstd_close(r, r64, dtype)
        _, rstd = rmsnorm.rms_norm(x, gamma)
        dx64, dg64, scale, dg_abs = oracle.backward(dy, x, gamma, rstd)
        for which in ("dy", "x", "both"):
            dyc, xc = dy.copy(), x.copy()
            if which == "both":
                dyc = xc = fill(xc, dy)
                dx64b, dg64b, scaleb, dg_absb = oracle.backward(dy, dy, gamma, rstd)
            out = dyc if which == "dy" else xc
            dx, dg = rmsnorm.rms_norm_backward(dyc, xc, gamma, rstd, out=out)
            assert dx is out
            if which == "both":
                oracle.assert_dx_close(dx, dx64b, scaleb, dtype)
                oracle.assert_dgamma_close(dg, dg64b, dg_absb, gamma.dtype, dtype)
            else:
                oracle.assert_dx_close(dx, dx64, scale, dtype)
                oracle.assert_dgamma_close(dg, dg64, dg_abs, gamma.dtype, dtype)
