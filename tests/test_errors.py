"""Every documented error: exception type, a message naming the offending shapes/dtypes,
and nothing touched (inputs and out unchanged) when a call fails."""

import re

import numpy as np
import oracle
import pytest
from oracle import BF16, F16, F32, F64

import rmsnorm


def shapes_re(*shapes):
    """Regex requiring every shape's str(tuple) to appear in the message (any order)."""
    return "".join(rf"(?=[\s\S]*{re.escape(str(tuple(s)))})" for s in shapes)


def snapshot(*arrays):
    return [None if a is None else np.array(a, copy=True) for a in arrays]


def assert_untouched(before, *arrays):
    for b, a in zip(before, arrays):
        if b is not None:
            assert oracle.bits_equal(a, b), "an array was modified by a failing call"


@pytest.fixture
def f32data(rng):
    x = rng.standard_normal((4, 8)).astype(F32)
    gamma = rng.uniform(0.5, 1.5, 8).astype(F32)
    _, rstd = rmsnorm.rms_norm(x, gamma)
    dy = rng.standard_normal((4, 8)).astype(F32)
    return x, gamma, rstd, dy


# ---------------------------------------------------------------------------------------
# dtypes

BAD_DTYPES = [
    ("int32", np.int32, "int32"),
    ("int64", np.int64, "int64"),
    ("uint8", np.uint8, "uint8"),
    ("bool", np.bool_, "bool"),
    ("complex64", np.complex64, "complex64"),
    ("complex128", np.complex128, "complex128"),
    ("object", object, "object"),
    ("str", "U3", r"U3|str|unicode"),
    ("float128", np.longdouble, r"float128|longdouble|float96"),
]


def bad_array(dt, shape):
    if dt == "U3":
        return np.full(shape, "abc", dtype="U3")
    if dt is object:
        a = np.empty(shape, dtype=object)
        a[...] = 1.0
        return a
    return np.ones(shape, dtype=dt)


@pytest.mark.parametrize("bad", BAD_DTYPES, ids=lambda b: b[0])
def test_bad_dtype_x(bad, f32data):
    _, dt, name = bad
    if dt is np.longdouble and np.dtype(np.longdouble) == F64:
        pytest.skip("longdouble is float64 here")
    x = bad_array(dt, (4, 8))
    with pytest.raises(TypeError, match=name):
        rmsnorm.rms_norm(x)
    with pytest.raises(TypeError, match=name):
        rmsnorm.rms_norm(x, np.ones(8, F32))
    with pytest.raises(TypeError, match=name):
        rmsnorm.add_rms_norm(x, x)
    _, gamma, rstd, dy = f32data
    with pytest.raises(TypeError, match=name):
        rmsnorm.rms_norm_backward(x, x, gamma, rstd)


@pytest.mark.parametrize("bad", BAD_DTYPES[:7], ids=lambda b: b[0])
def test_bad_dtype_other_arguments(bad, f32data):
    _, dt, name = bad
    x, gamma, rstd, dy = f32data
    before = snapshot(x, gamma, rstd, dy)
    with pytest.raises(TypeError, match=name):
        rmsnorm.rms_norm(x, bad_array(dt, (8,)))
    with pytest.raises(TypeError, match=name):
        rmsnorm.rms_norm_backward(bad_array(dt, (4, 8)), x, gamma, rstd)
    with pytest.raises(TypeError, match=name):
        rmsnorm.rms_norm_backward(dy, x, bad_array(dt, (8,)), rstd)
    with pytest.raises(TypeError, match=name):
        rmsnorm.rms_norm_backward(dy, x, gamma, bad_array(dt, (4,)))
    with pytest.raises(TypeError, match=name):
        rmsnorm.add_rms_norm(x, bad_array(dt, (4, 8)), gamma)
    with pytest.raises(TypeError, match=name):
        rmsnorm.add_rms_norm(x, x, bad_array(dt, (8,)))
    assert_untouched(before, x, gamma, rstd, dy)


@pytest.mark.parametrize(
    "xdt, odt",
    [(F32, F64), (F64, F32), (F16, BF16), (BF16, F16), (F32, F16)],
    ids=lambda d: oracle.dtype_id(d),
)
def test_dtype_mismatch_names_both(xdt, odt, rng):
    x = oracle.make_x(rng, (4, 8), xdt)
    other = oracle.make_x(rng, (4, 8), odt)
    gamma = np.ones(8, F32)
    _, rstd = rmsnorm.rms_norm(x, gamma)
    both = f"(?=[\\s\\S]*{oracle.dtype_re(xdt)})(?=[\\s\\S]*{oracle.dtype_re(odt)})"
    before = snapshot(x, other, rstd)
    with pytest.raises(TypeError, match=both):  # dy
        rmsnorm.rms_norm_backward(other, x, gamma, rstd)
    with pytest.raises(TypeError, match=both):  # residual
        rmsnorm.add_rms_norm(x, other, gamma)
    out = other.copy()
    with pytest.raises(TypeError, match=both):  # out
        rmsnorm.rms_norm(x, gamma, out=out)
    with pytest.raises(TypeError, match=both):
        rmsnorm.add_rms_norm(x, x, gamma, out=out)
    with pytest.raises(TypeError, match=both):
        rmsnorm.add_rms_norm(x, x, gamma, residual_out=out)
    with pytest.raises(TypeError, match=both):
        rmsnorm.rms_norm_backward(x, x, gamma, rstd, out=out)
    assert_untouched(before + [other], x, other, rstd, out)


@pytest.mark.parametrize("xdt", (F32, F16, BF16, F64), ids=oracle.dtype_id)
def test_rstd_wrong_dtype(xdt, rng):
    x = oracle.make_x(rng, (4, 8), xdt)
    _, rstd = rmsnorm.rms_norm(x)
    wrong = rstd.astype(F32 if rstd.dtype == F64 else F64)
    with pytest.raises(TypeError, match=oracle.dtype_re(wrong.dtype)):
        rmsnorm.rms_norm_backward(x, x, None, wrong)


# ---------------------------------------------------------------------------------------
# shapes


def test_zero_dim_x():
    with pytest.raises(ValueError):
        rmsnorm.rms_norm(np.float32(1.0))
    with pytest.raises(ValueError):
        rmsnorm.rms_norm(np.array(1.0))
    with pytest.raises(ValueError):
        rmsnorm.add_rms_norm(np.array(1.0), np.array(1.0))
    with pytest.raises(ValueError):
        rmsnorm.rms_norm(3.0)


@pytest.mark.parametrize(
    "xs, gs",
    [
        ((4, 8), (7,)),
        ((4, 8), (4, 8, 1)),
        ((4, 8), (2, 4, 8)),
        ((3, 5, 6, 7), (5, 7)),
        ((3, 5, 6, 7), (6, 6)),
        ((4, 8), (8, 4)),
        ((8,), (4, 8)),
    ],
    ids=str,
)
def test_gamma_shape_mismatch(xs, gs, rng):
    x = rng.standard_normal(xs).astype(F32)
    gamma = np.ones(gs, F32)
    before = snapshot(x, gamma)
    with pytest.raises(ValueError, match=shapes_re(xs, gs)):
        rmsnorm.rms_norm(x, gamma)
    with pytest.raises(ValueError, match=shapes_re(xs, gs)):
        rmsnorm.add_rms_norm(x, x, gamma)
    # (which of gamma / rstd is checked first is the package's choice)
    rstd = np.ones(xs[:-1], F32)
    with pytest.raises(ValueError):
        rmsnorm.rms_norm_backward(x, x, gamma, rstd)
    assert_untouched(before, x, gamma)


def test_zero_dim_gamma(rng):
    x = rng.standard_normal((4, 8)).astype(F32)
    with pytest.raises(ValueError):
        rmsnorm.rms_norm(x, np.float32(2.0))
    with pytest.raises(ValueError):
        rmsnorm.rms_norm(x, np.array(2.0, F32))
    with pytest.raises(ValueError):
        rmsnorm.rms_norm(x, 2.0)


@pytest.mark.parametrize(
    "xs, gs", [((4, 0), None), ((4, 0), (0,)), ((0,), None), ((3, 2, 0), (2, 0))], ids=str
)
def test_zero_length_normalized_axes(xs, gs):
    x = np.zeros(xs, F32)
    gamma = None if gs is None else np.zeros(gs, F32)
    with pytest.raises(ValueError):
        rmsnorm.rms_norm(x, gamma)
    with pytest.raises(ValueError):
        rmsnorm.add_rms_norm(x, x, gamma)


@pytest.mark.parametrize("which", ["dy", "rstd", "out"])
def test_backward_wrong_shapes(which, f32data):
    x, gamma, rstd, dy = f32data
    args = {"dy": dy, "rstd": rstd, "out": None}
    bad = {"dy": np.ones((4, 9), F32), "rstd": np.ones((5,), F32), "out": np.ones((8, 4), F32)}[
        which
    ]
    args[which] = bad
    before = snapshot(x, gamma, rstd, dy, bad)
    # the message names the wrong shape and x's shape (or, for rstd, the expected one)
    ref = re.escape(str(x.shape))
    if which == "rstd":
        ref += "|" + re.escape(str(x.shape[:-1]))
    with pytest.raises(ValueError, match=shapes_re(bad.shape) + rf"(?=[\s\S]*({ref}))"):
        rmsnorm.rms_norm_backward(args["dy"], x, gamma, args["rstd"], out=args["out"])
    assert_untouched(before, x, gamma, rstd, dy, bad)


def test_rstd_wrong_shape_keeps_full_shape(f32data):
    x, gamma, _, dy = f32data
    # rstd with x's full shape, or with one element per row but flattened differently
    for bad in (np.ones((4, 8), F32), np.ones((4, 1), F32), np.ones((2, 2), F32)):
        with pytest.raises(ValueError, match=shapes_re(bad.shape)):
            rmsnorm.rms_norm_backward(dy, x, gamma, bad)


def test_wrong_argument_order(f32data):
    """rms_norm_backward(dy, x, rstd, gamma): rstd (4,) is taken as gamma -> ValueError."""
    x, gamma, rstd, dy = f32data
    before = snapshot(x, gamma, rstd, dy)
    with pytest.raises(ValueError, match=shapes_re((4,), (4, 8))):
        rmsnorm.rms_norm_backward(dy, x, rstd, gamma)
    assert_untouched(before, x, gamma, rstd, dy)


@pytest.mark.parametrize("which", ["residual", "out", "residual_out"])
def test_add_rms_norm_wrong_shapes(which, f32data):
    x, gamma, _, dy = f32data
    kw = {"residual": dy, "out": None, "residual_out": None}
    bad = np.zeros((4, 9), F32) if which == "residual" else np.zeros((3, 8), F32)
    kw[which] = bad
    before = snapshot(x, gamma, dy, bad)
    with pytest.raises(ValueError, match=shapes_re(bad.shape, x.shape)):
        rmsnorm.add_rms_norm(
            x, kw["residual"], gamma, out=kw["out"], residual_out=kw["residual_out"]
        )
    assert_untouched(before, x, gamma, dy, bad)


def test_rms_norm_out_wrong_shape(f32data):
    x, gamma, _, _ = f32data
    for bad in (np.zeros((8, 4), F32), np.zeros((4, 8, 1), F32), np.zeros((32,), F32)):
        before = snapshot(bad)
        with pytest.raises(ValueError, match=shapes_re(bad.shape, x.shape)):
            rmsnorm.rms_norm(x, gamma, out=bad)
        assert_untouched(before, bad)


# ---------------------------------------------------------------------------------------
# out: read-only, outputs sharing memory


def test_read_only_out(f32data):
    x, gamma, rstd, dy = f32data
    out = np.zeros_like(x)
    out.flags.writeable = False
    with pytest.raises(ValueError):
        rmsnorm.rms_norm(x, gamma, out=out)
    with pytest.raises(ValueError):
        rmsnorm.add_rms_norm(x, dy, gamma, out=out)
    with pytest.raises(ValueError):
        rmsnorm.add_rms_norm(x, dy, gamma, residual_out=out)
    with pytest.raises(ValueError):
        rmsnorm.rms_norm_backward(dy, x, gamma, rstd, out=out)
    assert not np.any(out)
    # a read-only x passed as its own out
    xr = x.copy()
    xr.flags.writeable = False
    with pytest.raises(ValueError):
        rmsnorm.rms_norm(xr, gamma, out=xr)
    assert oracle.bits_equal(xr, x)


def test_outputs_sharing_memory(rng):
    """Outputs that overlap inputs give the oracle's results (test_overlap.py); outputs that
    overlap each other raise, naming both, with nothing touched."""
    buf = rng.standard_normal((4, 9)).astype(F32)
    x, other = buf[:, :8].copy(), rng.standard_normal((4, 8)).astype(F32)
    before = buf.copy()
    with pytest.raises(ValueError, match="residual_out and out share memory"):
        rmsnorm.add_rms_norm(x, other, out=buf[:, 1:], residual_out=buf[:, :8])
    assert oracle.bits_equal(buf, before)


# ---------------------------------------------------------------------------------------
# eps / offset / cast


@pytest.mark.parametrize("eps", (-1e-6, -1.0, float("nan"), float("inf"), -float("inf")), ids=str)
def test_bad_eps_value(eps, f32data):
    x, gamma, _, dy = f32data
    before = snapshot(x, gamma)
    with pytest.raises(ValueError):
        rmsnorm.rms_norm(x, gamma, eps)
    with pytest.raises(ValueError):
        rmsnorm.add_rms_norm(x, dy, gamma, eps)
    assert_untouched(before, x, gamma)


@pytest.mark.parametrize("eps", ("1e-6", None, np.array([1e-6]), [1e-6], 1j), ids=repr)
def test_non_real_eps(eps, f32data):
    x, gamma, _, dy = f32data
    with pytest.raises(TypeError):
        rmsnorm.rms_norm(x, gamma, eps)
    with pytest.raises(TypeError):
        rmsnorm.add_rms_norm(x, dy, gamma, eps)


@pytest.mark.parametrize("offset", ("1.0", None, np.array([1.0]), 1j), ids=repr)
def test_non_real_offset(offset, f32data):
    x, gamma, rstd, dy = f32data
    with pytest.raises(TypeError):
        rmsnorm.rms_norm(x, gamma, offset=offset)
    with pytest.raises(TypeError):
        rmsnorm.rms_norm_backward(dy, x, gamma, rstd, offset=offset)
    with pytest.raises(TypeError):
        rmsnorm.add_rms_norm(x, dy, gamma, offset=offset)


@pytest.mark.parametrize("cast", ("middle", "End", "", "before-weight"))
def test_bad_cast(cast, f32data):
    x, gamma, _, dy = f32data
    with pytest.raises(ValueError):
        rmsnorm.rms_norm(x, gamma, cast=cast)
    with pytest.raises(ValueError):
        rmsnorm.add_rms_norm(x, dy, gamma, cast=cast)


def test_positional_only_keywords(f32data):
    """offset / cast / out are keyword-only."""
    x, gamma, _, _ = f32data
    with pytest.raises(TypeError):
        rmsnorm.rms_norm(x, gamma, 1e-6, 1.0)


# ---------------------------------------------------------------------------------------
# runtime controls


def test_set_isa_errors():
    prev = rmsnorm.isa()
    with pytest.raises(ValueError, match="bogus"):
        rmsnorm.set_isa("bogus")
    unavailable = [i for i in ("avx512", "avx2", "neon") if i not in rmsnorm.available_isas()]
    for name in unavailable:
        with pytest.raises(ValueError):
            rmsnorm.set_isa(name)
    assert rmsnorm.isa() == prev


def test_isa_listing():
    isas = rmsnorm.available_isas()
    assert isas[-1] == "scalar"
    assert set(isas) <= {"avx512", "avx2", "neon", "scalar"}
    assert rmsnorm.isa() in isas
    # the tables behind them, by their own names (tests select each): every family's best
    # table first, its variants after it; a variant is not a public name
    from rmsnorm import _core

    variants = _core._variants()
    assert variants[-1] == "scalar" and set(isas) <= set(variants)
    with pytest.raises(ValueError, match="avx512"):
        rmsnorm.set_isa("avx512bf16")
    families = ["avx512" if v == "avx512bf16" else v for v in variants]
    prev = _core._variant()
    try:
        for name, family in zip(variants, families):
            _core._set_variant(name)
            assert _core._variant() == name and rmsnorm.isa() == family
            rmsnorm.set_isa(family)  # the family's best table: its first
            assert _core._variant() == variants[families.index(family)]
    finally:
        _core._set_variant(prev)


@pytest.mark.parametrize(
    "n, exc",
    [(0, ValueError), (-1, ValueError), (1.5, TypeError), ("2", TypeError), (None, TypeError)],
    ids=repr,
)
def test_set_num_threads_errors(n, exc):
    prev = rmsnorm.get_num_threads()
    with pytest.raises(exc):
        rmsnorm.set_num_threads(n)
    assert rmsnorm.get_num_threads() == prev


def test_set_num_threads_roundtrip():
    prev = rmsnorm.get_num_threads()
    try:
        rmsnorm.set_num_threads(3)
        assert rmsnorm.get_num_threads() == 3
        rmsnorm.set_num_threads(1)
        assert rmsnorm.get_num_threads() == 1
    finally:
        rmsnorm.set_num_threads(prev)


def test_error_after_error_state_clean(f32data):
    """A failing call leaves nothing behind: the next valid call works."""
    x, gamma, _, _ = f32data
    with pytest.raises(ValueError):
        rmsnorm.rms_norm(x, np.ones(7, F32))
    y, rstd = rmsnorm.rms_norm(x, gamma)
    y64, _, r64, _ = oracle.forward(x, gamma)
    oracle.assert_y_close(y, y64, 1, F32)


def test_test_hooks_roundtrip_and_errors():
    """The hooks the tests use (rmsnorm._core): setters return the previous value, take ints
    >= 0 (huge ones clamp), and leave the setting alone on a bad argument."""
    from rmsnorm import _core

    for setter in (_core._set_min_per_thread, _core._set_stream_bytes):
        prev = setter(123)
        try:
            assert setter(1 << 70) == 123
            assert setter(5) == 2**64 - 1
            for bad, exc in (
                (-1, ValueError),
                (-(1 << 70), ValueError),
                (1.5, TypeError),
                (True, TypeError),
                ("1", TypeError),
            ):
                with pytest.raises(exc, match=setter.__name__):
                    setter(bad)
            assert setter(5) == 5
        finally:
            setter(prev)
    x = np.ones((4, 64), F32)
    rmsnorm.rms_norm(x[:0])
    assert _core._last_team_size() == 1
