"""Coverage-guided fuzzing (atheris / libFuzzer) of rms_norm, add_rms_norm and
rms_norm_backward: random shapes, strides, transposes, offsets (misaligned too), byte orders,
dtypes, gamma ranks and dtypes, eps, offset, cast, ISA, thread count, streaming, outputs that
overlap inputs or each other, and one broken argument at a time. Every call either matches the
float64 oracle (tests/oracle.py) for its inputs as they were before the call, leaving the inputs
that no output overlaps untouched, or raises the exception the broken argument calls for,
touching nothing.

Run by .ci/fuzz.sh, against an extension built with AddressSanitizer and UndefinedBehaviorSanitizer
whose comparisons report to libFuzzer (gcc's -fsanitize-coverage=trace-cmp, with
-use_value_profile=1), alongside the Python coverage of this harness and the package.
"""

import os
import sys

# The extension's comparison hooks (__sanitizer_cov_trace_cmp*) bind to atheris' libFuzzer,
# which must therefore be loaded into the global symbol scope before the extension is.
sys.setdlopenflags(os.RTLD_NOW | os.RTLD_GLOBAL)

import atheris  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

with atheris.instrument_imports(include=["rmsnorm"]):
    import rmsnorm

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import oracle  # noqa: E402

from rmsnorm import _core  # noqa: E402

DTYPES = (
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
)
BAD_DTYPES = (np.dtype(np.int32), np.dtype(np.complex64), np.dtype(np.uint8))
ISAS = tuple(_core._variants())  # a family's variants included
DEFAULT_MIN = _core._set_min_per_thread(0)
DEFAULT_STREAM = _core._set_stream_bytes(0)
# the defects, one at a time (None: a valid call), and the exception each must raise
DEFECTS = (None,) * 8 + (
    "eps",
    "dtype",
    "gamma_shape",
    "out_shape",
    "out_dtype",
    "read_only",
    "outs_overlap",
    "rstd_dtype",
    "rstd_shape",
    "residual_shape",
)
RAISES = {
    "eps": ValueError,
    "dtype": TypeError,
    "gamma_shape": ValueError,
    "out_shape": ValueError,
    "out_dtype": TypeError,
    "read_only": ValueError,
    "outs_overlap": ValueError,
    "rstd_dtype": TypeError,
    "rstd_shape": ValueError,
    "residual_shape": ValueError,
}


class Gen:
    """Draws from the fuzzer's bytes."""

    def __init__(self, data):
        self.f = atheris.FuzzedDataProvider(data)
        self.rng = np.random.default_rng(self.f.ConsumeUInt(4))

    def int(self, lo, hi):
        return self.f.ConsumeIntInRange(lo, hi)

    def pick(self, seq):
        return seq[self.f.ConsumeIntInRange(0, len(seq) - 1)]

    def bool(self):
        return self.f.ConsumeBool()

    @atheris.instrument_func
    def values(self, shape, dtype, huge=True):
        """Values of dtype: normal numbers of a random scale, with now and then a zero row, a
        NaN, an Inf, huge or tiny rows."""
        a = self.rng.standard_normal(shape) * 10.0 ** self.int(-4, 4)
        with np.errstate(all="ignore"):
            return oracle.round_to(self._special(a, dtype, huge), dtype)

    def _special(self, a, dtype, huge):
        if a.size and a.ndim >= 1:
            flat = a.reshape(-1)
            kind = self.int(0, 7)
            i = self.int(0, flat.size - 1)
            if kind == 1:
                flat[i] = np.nan
            elif kind == 2:
                flat[i] = np.inf if self.bool() else -np.inf
            elif kind == 3 and a.ndim >= 2:
                a[self.int(0, a.shape[0] - 1)] = 0.0
            elif kind == 4:
                a *= float(ml_dtypes.finfo(dtype).tiny) * 3
            elif kind == 5 and huge:
                a *= float(ml_dtypes.finfo(dtype).max) / 8
        return a


@atheris.instrument_func
def strided(g, pool, shape, dtype):
    """A view of `shape` and `dtype` inside `pool` (a uint8 buffer): random start (misaligned
    now and then), axis order and steps. Returns None where the pool is too small."""
    nd = len(shape)
    perm = list(range(nd))
    g.rng.shuffle(perm) if g.bool() else None
    steps = [g.pick((1, 1, 1, 2, -1, -3)) for _ in range(nd)]
    es = dtype.itemsize
    # strides in elements of a C-order layout of the permuted axes, times the steps
    span = 1
    strides = [0] * nd
    for ax in reversed(perm):
        strides[ax] = span * steps[ax]
        span *= abs(steps[ax]) * max(shape[ax], 1)
    lo = sum(s * (n - 1) for s, n in zip(strides, shape) if s < 0 and n > 0)
    hi = sum(s * (n - 1) for s, n in zip(strides, shape) if s > 0 and n > 0)
    need = (hi - lo + 1) * es
    if need > pool.size:
        return None
    start = g.int(0, pool.size - need)
    if g.int(0, 3) and start % es:  # aligned, mostly
        start -= start % es
    base = start - lo * es
    return np.ndarray(shape, dtype, buffer=pool, offset=base, strides=[s * es for s in strides])


@atheris.instrument_func
def placed(g, pool, value, fresh_ok=True):
    """value (an array) copied into a random view of the pool, or a fresh copy of it: in its own
    buffer (perhaps byte-swapped), when fresh_ok and the draw says so or the pool is too small."""
    if fresh_ok and g.int(0, 2) == 0 or pool is None:
        v = np.array(value, copy=True)
        if g.int(0, 5) == 0 and v.dtype != DTYPES[3] and v.size:
            v = v.astype(v.dtype.newbyteorder(">"))
        return v
    view = strided(g, pool, value.shape, value.dtype)
    if view is None:
        return np.array(value, copy=True)
    view[...] = value
    return view


def native(a):
    """A copy in native byte order (the oracle takes only those), or None."""
    return None if a is None else np.array(a, dtype=a.dtype.newbyteorder("="), copy=True)


@atheris.instrument_func
def one(data):
    g = Gen(data)
    op = g.pick(("rms_norm", "add_rms_norm", "rms_norm_backward"))
    dtype = g.pick(DTYPES)
    nd = g.int(1, 3)
    shape = [g.int(0, 6) if g.int(0, 4) == 0 else g.int(1, 9) for _ in range(nd)]
    if g.bool():  # a longer last axis, for the SIMD bodies and split rows
        shape[-1] = g.pick((16, 17, 31, 64, 65, 127, 128, 255, 1000, 1025, 4097, 9000))
    while int(np.prod(shape)) > 20000:  # a few milliseconds of oracle a call
        i = int(np.argmax(shape[:-1]))  # the longest leading axis (the last is under 20000)
        shape[i] = max(shape[i] // 2, 1)
    shape = tuple(shape)
    gnd = g.int(0, nd)  # 0: gamma None
    if int(np.prod(shape[nd - max(gnd, 1) :])) == 0:
        shape = tuple(max(n, 1) for n in shape)  # normalized axes of no elements: see defects
    defect = g.pick(DEFECTS)
    gdtype = dtype if g.bool() else g.pick(DTYPES)
    eps = g.pick((1e-6, 0.0, 1e-12, 1e-3, 1.0, 10.0))
    offset = g.pick((0.0, 0.0, 1.0, -0.5))
    cast = g.pick(("end", "before_weight"))
    isa, threads = g.pick(ISAS), g.int(1, 3)
    _core._set_min_per_thread(0 if g.bool() else DEFAULT_MIN)
    _core._set_stream_bytes(0 if g.bool() else DEFAULT_STREAM)
    _core._set_variant(isa)
    rmsnorm.set_num_threads(threads)

    # the values (the backward's terms, products of several inputs, overflow float32 from far
    # smaller values than the forward's, which rescales its rows: no huge values there)
    huge = op != "rms_norm_backward"
    x0 = g.values(shape, dtype, huge)
    gamma0 = oracle.make_gamma(g.rng, shape[nd - gnd :], gdtype) if gnd else None
    r0 = g.values(shape, dtype, huge)
    dy0 = g.values(shape, dtype, huge)
    # one pool that inputs and outputs are carved from, so that they overlap now and then
    n = int(np.prod(shape))
    pool = np.zeros(g.int(0, 3 * n * 8 + 64), np.uint8) if g.bool() else None
    placed_so_far = []

    def put(value):
        """value placed in the pool, or fresh where it would overlap an input placed before
        (whose bytes, read as this input's, would be values of any size: NaN, 1e300). Outputs,
        not inputs, are what overlaps inputs here."""
        v = placed(g, pool, value)
        if any(np.may_share_memory(p, v) for p in placed_so_far):
            v = np.array(value, copy=True)
        placed_so_far.append(v)
        return v

    x = put(x0)
    r = put(r0)
    dy = put(dy0)
    gamma = None if gamma0 is None else put(gamma0)
    rstd = rstd0 = None
    if op == "rms_norm_backward":  # the forward's rstd of x as placed, as in training
        with np.errstate(all="ignore"):
            rstd0 = oracle.forward(native(x), gamma0, eps)[3]
        rstd = placed(g, None, rstd0)
    inputs = {"x": x, "residual": r, "dy": dy, "gamma": gamma, "rstd": rstd}
    if op != "add_rms_norm":
        del inputs["residual"]
    if op != "rms_norm_backward":
        del inputs["dy"], inputs["rstd"]
    # the values the inputs hold now: a later input placed over an earlier one changed it
    vals = {k: native(v) for k, v in inputs.items()}

    # outputs: none, fresh, an input itself, or a view of the pool
    outs = {}
    names = ("out", "residual_out") if op == "add_rms_norm" else ("out",)
    for name in names:
        kind = g.int(0, 4)
        if kind == 1:
            outs[name] = np.full(shape, 7, dtype)
        elif kind == 2:
            k = g.pick(tuple(k for k in ("x", "residual", "dy") if k in inputs))
            if inputs[k].dtype == dtype and inputs[k].dtype.isnative:
                outs[name] = inputs[k]
        elif kind == 3 and pool is not None:
            v = strided(g, pool, shape, dtype)
            if v is not None:
                outs[name] = v

    # one defect
    if defect == "eps" and op != "rms_norm_backward":
        eps = g.pick((-1e-6, float("nan"), float("inf")))
    elif defect == "dtype":
        key = g.pick(tuple(k for k in ("x", "residual", "dy") if k in inputs))
        inputs[key] = inputs[key].astype(g.pick(BAD_DTYPES))
    elif defect == "gamma_shape" and gamma is not None:
        inputs["gamma"] = np.ones(tuple(s + 1 for s in gamma.shape), gdtype)
    elif defect == "out_shape":
        outs["out"] = np.zeros(shape + (1,), dtype)
    elif defect == "out_dtype":
        outs["out"] = np.zeros(shape, DTYPES[(DTYPES.index(dtype) + 1) % 4])
    elif defect == "read_only":
        o = np.zeros(shape, dtype)
        o.flags.writeable = False
        outs[g.pick(names)] = o
    elif defect == "outs_overlap" and op == "add_rms_norm" and n >= 2:  # one element shared
        buf = np.zeros(n + 1, dtype)
        outs["out"], outs["residual_out"] = buf[1:].reshape(shape), buf[:-1].reshape(shape)
    elif defect == "rstd_dtype" and op == "rms_norm_backward":
        inputs["rstd"] = rstd0.astype(np.float16)
    elif defect == "rstd_shape" and op == "rms_norm_backward":
        inputs["rstd"] = np.ones(rstd0.shape + (2,), rstd0.dtype)
    elif defect == "residual_shape" and op == "add_rms_norm":
        inputs["residual"] = np.ones(shape + (2,), dtype)
    else:
        defect = None
    if op == "add_rms_norm" and defect is None and "out" in outs and "residual_out" in outs:
        if np.may_share_memory(outs["out"], outs["residual_out"]):  # bounds, as the C code
            defect = "outs_overlap"  # outputs in one place, however they came to be
    if defect in ("out_shape", "out_dtype") and op == "rms_norm_backward" and n == 0:
        pass

    if defect is None and known_finding(op, vals, eps):
        return
    if os.environ.get("RMSNORM_FUZZ_VERBOSE"):  # what an input does, to reproduce a finding
        print(describe(op, inputs, outs, eps, offset, cast, isa, threads, defect), flush=True)
    snap = {k: None if v is None else np.array(v, copy=True) for k, v in inputs.items()}
    snap_out = {k: np.array(v, copy=True) for k, v in outs.items()}
    try:
        if op == "rms_norm":
            got = rmsnorm.rms_norm(
                inputs["x"], inputs["gamma"], eps, offset=offset, cast=cast, **outs
            )
        elif op == "add_rms_norm":
            got = rmsnorm.add_rms_norm(
                inputs["x"],
                inputs["residual"],
                inputs["gamma"],
                eps,
                offset=offset,
                cast=cast,
                **outs,
            )
        else:
            got = rmsnorm.rms_norm_backward(
                inputs["dy"], inputs["x"], inputs["gamma"], inputs["rstd"], offset=offset, **outs
            )
    except (ValueError, TypeError) as e:
        if defect is None or not isinstance(e, RAISES[defect]):
            raise AssertionError(f"{op} raised {e!r} for defect {defect}") from e
        for k, v in list(inputs.items()) + list(outs.items()):
            if v is not None:
                before = snap.get(k, snap_out.get(k))
                assert oracle.bits_equal(np.asarray(v), before), f"{k} touched by a failing call"
        return
    assert defect is None, f"{op} accepted defect {defect}"
    check(op, got, vals, outs, eps, offset, cast)
    # inputs that no output overlaps are untouched
    for k, v in inputs.items():
        if v is not None and not any(np.shares_memory(v, o) for o in outs.values()):
            assert oracle.bits_equal(v, snap[k]), f"input {k} was modified"


# Findings, left out of a run by RMSNORM_FUZZ_SKIP=name,name while not fixed (a longer run then
# goes on to find others): the inputs each covers.
def _f64_tiny_rows(op, vals, eps):
    """float64 rows whose largest magnitude m makes eps / m**2 overflow (|x| < about 1e-154 for
    eps = 1e-12): rstd comes out 0, not 1 / sqrt(eps) (the rescaling slow path)."""
    x = vals["x"]
    if x.dtype != np.float64 or eps <= 0 or op == "rms_norm_backward":
        return False
    with np.errstate(all="ignore"):
        h = oracle.add(x, vals["residual"]) if op == "add_rms_norm" else x
        gnd = 1 if vals["gamma"] is None else vals["gamma"].ndim
        rows = oracle.as_f64(h).reshape(-1, int(np.prod(h.shape[h.ndim - gnd :])))
        m = np.max(np.abs(rows), axis=1, initial=0)
        return bool(np.any((m > 0) & np.isinf(eps / m / m)))


def _f32_rstd_overflow(op, vals, eps):
    """16- and 32-bit rows so small (subnormal float32, eps 0) that rstd exceeds float32's range:
    rstd is Inf (its correct rounding), and y = x * rstd * w Inf or NaN, where y itself is about
    1. (The backward then takes that rstd as given.)"""
    x = vals["x"]
    if x.dtype == np.float64 or op == "rms_norm_backward":
        return False
    with np.errstate(all="ignore"):
        h = oracle.add(x, vals["residual"]) if op == "add_rms_norm" else x
        gnd = 1 if vals["gamma"] is None else vals["gamma"].ndim
        rows = oracle.as_f64(h).reshape(-1, int(np.prod(h.shape[h.ndim - gnd :])))
        r = oracle.rstd_f64(rows, eps) if rows.shape[0] else np.zeros(0)
        return bool(np.any(np.isfinite(r) & (r > float(np.finfo(np.float32).max))))


KNOWN = {"f64_tiny_rows": _f64_tiny_rows, "f32_rstd_overflow": _f32_rstd_overflow}
# the README's documented limit (float32 and 16-bit rows of RMS below about 1e-38) always
SKIP = [_f32_rstd_overflow] + [
    KNOWN[name] for name in os.environ.get("RMSNORM_FUZZ_SKIP", "").split(",") if name
]


def known_finding(op, vals, eps):
    return any(f(op, vals, eps) for f in SKIP)


def describe(op, inputs, outs, eps, offset, cast, isa, threads, defect):
    def arr(a):
        if a is None:
            return "None"
        return (
            f"{a.dtype}{list(a.shape)} strides={a.strides} at={a.ctypes.data % 64} "
            f"values={np.asarray(a).ravel()[:4]}"
        )

    lines = [
        f"{op} eps={eps} offset={offset} cast={cast} isa={isa} threads={threads} "
        f"min_per_thread={_core._set_min_per_thread(0)} defect={defect}"
    ]
    _core._set_min_per_thread(int(lines[0].split("min_per_thread=")[1].split()[0]))
    lines += [f"  {k}: {arr(v)}" for k, v in inputs.items()]
    lines += [f"  {k}: {arr(v)}" for k, v in outs.items()]
    return "\n".join(lines)


@atheris.instrument_func
def check(op, got, vals, outs, eps, offset, cast):
    x, gamma = vals["x"], vals["gamma"]
    dtype = x.dtype
    gnd = 1 if gamma is None else gamma.ndim
    lead = x.ndim - gnd
    with np.errstate(all="ignore"):
        if op == "rms_norm_backward":
            dx, dg = got
            if "out" in outs:
                assert dx is outs["out"]
            dx64, dg64, scale, dg_abs = oracle.backward(
                vals["dy"], x, gamma, vals["rstd"], offset=offset
            )
            # terms past the dtype's range overflow its arithmetic (float32 for 16- and 32-bit
            # x) in an order of its own: those elements are left out
            over = scale > float(ml_dtypes.finfo(oracle.compute_dtype(dtype)).max) / 4
            # a row with a NaN or an Inf in dy or x: its dx is NaN or Inf, as the order of the
            # terms has it (float64 keeps Infs where float32 makes NaNs), left out here
            lead = x.ndim - (1 if gamma is None else gamma.ndim)
            axes = tuple(range(lead, x.ndim))
            with np.errstate(all="ignore"):
                bad = ~np.isfinite(oracle.as_f64(x) * oracle.as_f64(vals["dy"]))
            bad_rows = np.broadcast_to(np.any(bad, axis=axes, keepdims=True), x.shape)
            assert not np.isfinite(oracle.as_f64(dx)[bad_rows & ~np.isfinite(dx64)]).any()
            over = over | bad_rows
            dx64 = np.where(over, np.nan, dx64)
            dx = np.where(over, np.nan, dx).astype(dx.dtype)
            oracle.assert_dx_close(dx, dx64, scale, dtype)
            if gamma is None:
                assert dg is None
            else:
                # where the sum leaves gamma's dtype, it rounds to an Inf of its sign
                big = np.isinf(oracle.as_f64(oracle.round_to(dg64, gamma.dtype))) & ~np.isinf(dg64)
                assert np.array_equal(oracle.as_f64(dg)[big], np.sign(dg64[big]) * np.inf)
                # the columns of non-finite rows: NaN or Inf, as the order of their terms has it
                lost = ~np.isfinite(dg64) | (np.isnan(oracle.as_f64(dg)) & bad.any())
                dg64 = np.where(big | lost, 0.0, dg64)
                dg = np.where(big | lost, 0, dg).astype(dg.dtype)
                oracle.assert_dgamma_close(dg, dg64, dg_abs, gamma.dtype, dtype)
            return
        if op == "add_rms_norm":
            y, rstd, h = got
            h_ref = oracle.add(x, vals["residual"])
            # (a NaN's sign and payload depend on the order of the operands)
            nan = np.isnan(oracle.as_f64(h_ref))
            assert np.array_equal(np.isnan(oracle.as_f64(h)), nan), "h: NaN positions"
            assert oracle.bits_equal(h[~nan], h_ref[~nan]), "h is not round(x + residual)"
            if "residual_out" in outs:
                assert h is outs["residual_out"]
            src = h_ref
        else:
            y, rstd = got
            src = x
        if "out" in outs:
            assert y is outs["out"]
        y64, _, r64, _ = oracle.forward(src, gamma, eps, offset, cast, rstd)
    oracle.assert_rstd_close(rstd, r64, dtype)
    oracle.assert_y_close(y, y64, lead, dtype)


def TestOneInput(data):  # noqa: N802 - atheris' name
    try:
        one(data)
    finally:
        _core._set_min_per_thread(DEFAULT_MIN)
        _core._set_stream_bytes(DEFAULT_STREAM)


def main():
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
