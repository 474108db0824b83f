"""Edge values and robustness: NaN/Inf row isolation (also across a row split between
threads), zero rows, overflowing squares, extreme sizes, concurrent use from Python threads
while the ISA / thread count changes, and no reference or memory leaks."""

import gc
import os
import sys
import threading
import time
import tracemalloc

import numpy as np
import oracle
import pytest
from conftest import ISAS, outputs_with, using
from oracle import ALL_DTYPES, F16, F32, F64, dtype_id

import rmsnorm

# ---------------------------------------------------------------------------------------
# NaN / Inf isolation


@pytest.mark.parametrize("where", ("first", "middle", "tail", "second_half"))
@pytest.mark.parametrize("bad", (np.nan, np.inf, -np.inf), ids=("nan", "inf", "-inf"))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_nonfinite_row_isolation(dtype, bad, where, isa_threads, rng):
    rows, n = 4, (300000 if where == "second_half" else 1031)
    x = oracle.make_x(rng, (rows, n), dtype)
    col = {"first": 0, "middle": n // 2, "tail": n - 1, "second_half": n - 1000}[where]
    x[1, col] = bad
    gamma = oracle.make_gamma(rng, (n,), dtype)
    dy = oracle.make_x(rng, (rows, n), dtype, spread=False)
    res = oracle.make_x(rng, (rows, n), dtype)
    good = [0, 2, 3]

    y, rstd = rmsnorm.rms_norm(x, gamma)
    assert np.all(np.isnan(oracle.as_f64(y[1]))), "whole row must be NaN"
    assert np.isnan(rstd[1])
    y64, _, r64, _ = oracle.forward(x[good], gamma)
    oracle.assert_y_close(y[good], y64, 1, dtype)
    oracle.assert_rstd_close(rstd[good], r64, dtype)

    dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    assert np.all(np.isnan(oracle.as_f64(dx[1])))
    dx64, _, scale, _ = oracle.backward(dy[good], x[good], gamma, rstd[good])
    oracle.assert_dx_close(dx[good], dx64, scale, dtype)

    # residual with the bad value: the same row of y is NaN, h keeps the value
    yr, rr, h = rmsnorm.add_rms_norm(res, x, gamma)
    assert np.all(np.isnan(oracle.as_f64(yr[1]))) and np.isnan(rr[1])
    assert np.all(np.isfinite(oracle.as_f64(yr[good])))


@pytest.mark.parametrize("k", (8, 64, 320))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_short_rows_with_odd_rows_in_several_groups(dtype, k, each_isa, rng):
    """Short rows run in pipelined groups (the next group's sums are taken between this group's
    rows): rows that take the slow path (zero, NaN, squares that underflow) in several groups,
    and a row count that leaves a partial group at the end."""
    m = 8 * 5 + 3
    x = oracle.make_x(rng, (m, k), dtype)
    tiny = 1e-150 if np.dtype(dtype) == F64 else 1e-16
    if np.dtype(dtype) == F16:
        tiny = 1e-7  # a float16 subnormal
    x[3] = 0
    x[11, k // 2] = np.nan
    x[20] = oracle.round_to(np.full(k, tiny), dtype)
    x[m - 1] = 0
    gamma = oracle.make_gamma(rng, (k,), dtype)
    y, rstd = rmsnorm.rms_norm(x, gamma)
    y64, _, r64, _ = oracle.forward(x, gamma)
    oracle.assert_y_close(y, y64, 1, dtype)
    oracle.assert_rstd_close(rstd, r64, dtype)
    res = oracle.make_x(rng, (m, k), dtype)
    res[[3, 20, m - 1]] = 0
    yr, rr, h = rmsnorm.add_rms_norm(x, res, gamma)
    h64, y64, _, r64, _ = oracle.add_rms_norm(x, res, gamma)
    assert oracle.bits_equal(h, oracle.round_to(h64, dtype))
    oracle.assert_y_close(yr, y64, 1, dtype)
    oracle.assert_rstd_close(rr, r64, dtype)


@pytest.mark.parametrize("n", (7, 1031, 4096))
@pytest.mark.parametrize("gamma_f32", (False, True), ids=("gamma_x_dtype", "gamma_f32"))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_nonfinite_gamma(dtype, gamma_f32, n, isa_threads, rng):
    """NaN and +-Inf in gamma, with finite rows: the forward and the add give NaN in the NaN
    weight's column and +-Inf in an infinite weight's (NaN where x is 0: 0 * Inf), and every
    other column, rstd and h as with finite weights. The NaN has every payload bit set, which
    rounding a float32 NaN to 16 bits by integer arithmetic alone would carry into the sign
    (-0.0). The backward's dx depends on every weight through c = mean(dy * w * xhat), so it is
    NaN throughout; dgamma does not, and stays finite."""
    m = 6
    x = oracle.make_x(rng, (m, n), dtype)
    res = oracle.make_x(rng, (m, n), dtype)
    dy = oracle.make_x(rng, (m, n), dtype, spread=False)
    gdt = np.dtype(F32 if gamma_f32 and np.dtype(dtype) != F64 else dtype)
    gamma = oracle.make_gamma(rng, (n,), gdt)
    bad = [1, n // 2, n - 1]
    ubits = np.dtype(f"u{gdt.itemsize}")
    gamma[bad[0]] = np.array(np.iinfo(ubits).max >> 1, ubits).view(gdt)  # NaN, all payload bits
    gamma[bad[1:]] = [np.inf, -np.inf]
    assert np.isnan(oracle.as_f64(gamma[bad[0]]))
    x[0, n // 2] = x[2, n - 1] = 0
    res[0, n // 2] = res[2, n - 1] = 0
    keep = np.setdiff1d(np.arange(n), bad)

    def check(y, y64, rstd, r64):
        oracle.assert_rstd_close(rstd, r64, dtype)
        oracle.assert_y_close(y[:, keep], y64[:, keep], 1, dtype)
        got = oracle.as_f64(y[:, bad])
        assert np.array_equal(got, y64[:, bad], equal_nan=True), (got, y64[:, bad])

    y, rstd = rmsnorm.rms_norm(x, gamma)
    y64, _, r64, _ = oracle.forward(x, gamma)
    check(y, y64, rstd, r64)
    assert np.isnan(y64[0, n // 2]) and np.isinf(y64[1, n // 2])  # the oracle's own columns

    yr, rr, h = rmsnorm.add_rms_norm(x, res, gamma)
    h64, yr64, _, rr64, _ = oracle.add_rms_norm(x, res, gamma)
    assert oracle.bits_equal(h, oracle.round_to(h64, dtype))
    check(yr, yr64, rr, rr64)

    dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    assert np.all(np.isnan(oracle.as_f64(dx)))
    _, dg64, _, dg_abs = oracle.backward(dy, x, gamma, rstd)
    assert np.all(np.isfinite(oracle.as_f64(dg)))
    oracle.assert_dgamma_close(dg, dg64, dg_abs, gamma.dtype, dtype)


# ---------------------------------------------------------------------------------------
# zero rows


@pytest.mark.parametrize("n", (1, 7, 64, 1031))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_all_zero_rows(dtype, n, each_isa, rng):
    x = oracle.make_x(rng, (3, n), dtype)
    x[1] = 0
    gamma = oracle.make_gamma(rng, (n,), dtype)
    # eps = 0: rstd = 1/sqrt(0) = inf, y = 0 * inf = NaN
    y, rstd = rmsnorm.rms_norm(x, gamma, 0.0)
    assert np.isposinf(rstd[1])
    assert np.all(np.isnan(oracle.as_f64(y[1])))
    y64, _, r64, _ = oracle.forward(x[[0, 2]], gamma, 0.0)
    oracle.assert_y_close(y[[0, 2]], y64, 1, dtype)
    # eps > 0: rstd = 1/sqrt(eps), y = 0
    eps = 1e-2
    y, rstd = rmsnorm.rms_norm(x, gamma, eps)
    np.testing.assert_allclose(rstd[1], 1 / np.sqrt(eps), rtol=1e-7)
    assert not np.any(oracle.as_f64(y[1]))
    dy = oracle.make_x(rng, (3, n), dtype, spread=False)
    dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    dx64, dg64, scale, dg_abs = oracle.backward(dy, x, gamma, rstd)
    oracle.assert_dx_close(dx, dx64, scale, dtype)  # zero row: dx = rstd * dy * w
    oracle.assert_dgamma_close(dg, dg64, dg_abs, dtype, dtype)


# ---------------------------------------------------------------------------------------
# huge and tiny values


@pytest.mark.parametrize("magnitude", (1e160, 1e200, 1e300, 1.7e308), ids=str)
def test_float64_overflowing_squares(magnitude, each_isa, rng):
    n = 1029
    x = rng.uniform(0.1, 1.0, (4, n)) * rng.choice([-1, 1], (4, n)) * magnitude
    x[2, ::7] = 1.0  # mixed magnitudes in one row
    x[3] = rng.standard_normal(n)  # a normal row next to them
    gamma = rng.uniform(0.5, 1.5, n)
    y, rstd = rmsnorm.rms_norm(x, gamma)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(rstd)) and np.all(rstd > 0)
    y64, _, r64, _ = oracle.forward(x, gamma)
    oracle.assert_y_close(y, y64, 1, F64)
    oracle.assert_rstd_close(rstd, r64, F64)
    dy = rng.standard_normal((4, n))
    dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    dx64, dg64, scale, dg_abs = oracle.backward(dy, x, gamma, rstd)
    oracle.assert_dx_close(dx, dx64, scale, F64)
    oracle.assert_dgamma_close(dg, dg64, dg_abs, F64, F64)


def test_float64_overflow_single_element_and_eps(each_isa):
    x = np.array([[1e300], [-1.7e308], [3.0]])
    y, rstd = rmsnorm.rms_norm(x, eps=1e-6)
    np.testing.assert_allclose(y[:2, 0], [1.0, -1.0], rtol=1e-15)
    np.testing.assert_allclose(rstd[:2], [1e-300, 1 / 1.7e308], rtol=1e-14)
    y, rstd = rmsnorm.rms_norm(np.full((1, 4), 1e300), eps=1e-3)
    np.testing.assert_allclose(y, 1.0, rtol=1e-15)


@pytest.mark.parametrize("magnitude", (1e-155, 1e-160, 1e-200, 5e-324), ids=str)
@pytest.mark.parametrize("eps", (1e-12, 1e-6))
def test_float64_tiny_rows_beside_eps(magnitude, eps, each_isa, rng):
    # eps / max|x|**2 overflows (or nearly) for these rows: their mean square vanishes beside eps,
    # so rstd is 1 / sqrt(eps) within the two roundings of the rescaled formula (2 ulp).
    x = rng.uniform(0.5, 1.0, (3, 37)) * magnitude
    x[1] = 0.0
    x[1, 5] = magnitude
    gamma = rng.uniform(0.5, 1.5, 37)
    for y, rstd in (
        rmsnorm.rms_norm(x, gamma, eps),
        rmsnorm.add_rms_norm(x, 0 * x, gamma, eps)[:2],
    ):
        np.testing.assert_allclose(rstd, 1.0 / np.sqrt(eps), rtol=4.5e-16, atol=0)
        np.testing.assert_allclose(y, x * (1.0 / np.sqrt(eps)) * gamma, rtol=1e-15, atol=0)


@pytest.mark.parametrize("magnitude", (1e30, 3e38), ids=str)
@pytest.mark.parametrize("dtype", (F32, oracle.BF16), ids=dtype_id)
def test_float32_huge_values(dtype, magnitude, each_isa, rng):
    n = 517
    x = oracle.round_to(
        rng.uniform(0.1, 1.0, (3, n)) * rng.choice([-1, 1], (3, n)) * magnitude, dtype
    )
    gamma = oracle.make_gamma(rng, (n,), F32)
    y, rstd = rmsnorm.rms_norm(x, gamma)
    assert np.all(np.isfinite(oracle.as_f64(y))) and np.all(rstd > 0)
    y64, _, r64, _ = oracle.forward(x, gamma)
    oracle.assert_y_close(y, y64, 1, dtype)
    oracle.assert_rstd_close(rstd, r64, dtype)


@pytest.mark.parametrize(
    "dtype, magnitude",
    [(F32, 1e30), (F32, 1e15), (F32, 1e-20), (F64, 1e160), (F64, 1e-120), (F64, 1e-5)],
    ids=lambda v: dtype_id(v) if isinstance(v, np.dtype) else str(v),
)
def test_backward_extreme_magnitudes(dtype, magnitude, each_isa, rng):
    """dx = rstd*(g - xhat*mean(g*xhat)) stays right for any row scale: forming it as
    x*rstd**3*sum(g*x) over/underflows (rstd**2 = 1e-60 / 1e40 in float32)."""
    n = 37
    x = (rng.uniform(0.5, 1.5, (3, n)) * rng.choice([-1, 1], (3, n)) * magnitude).astype(dtype)
    gamma = oracle.make_gamma(rng, (n,), dtype)
    dy = rng.standard_normal((3, n)).astype(dtype)
    y, rstd = rmsnorm.rms_norm(x, gamma, 0.0)
    dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    dx64, dg64, scale, dg_abs = oracle.backward(dy, x, gamma, rstd)
    oracle.assert_dx_close(dx, dx64, scale, dtype)
    oracle.assert_dgamma_close(dg, dg64, dg_abs, dtype, dtype)
    # scale invariance: dx * magnitude is the same for every magnitude
    ref_x = (x.astype(F64) / magnitude).astype(dtype)
    _, r_ref = rmsnorm.rms_norm(ref_x, gamma, 0.0)
    dx_ref, _ = rmsnorm.rms_norm_backward(dy, ref_x, gamma, r_ref)
    np.testing.assert_allclose(
        dx.astype(F64) * magnitude, dx_ref, rtol=1e-4, atol=1e-4 * np.abs(dx_ref).max()
    )


# ---------------------------------------------------------------------------------------
# extreme shapes


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_n_equals_one(dtype, isa_threads, rng):
    x = oracle.make_x(rng, (257, 1), dtype)
    gamma = oracle.make_gamma(rng, (1,), dtype)
    y, rstd = rmsnorm.rms_norm(x, gamma)
    y64, _, r64, _ = oracle.forward(x, gamma)
    oracle.assert_y_close(y, y64, 1, dtype)
    oracle.assert_rstd_close(rstd, r64, dtype)
    dy = oracle.make_x(rng, (257, 1), dtype, spread=False)
    dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    dx64, dg64, scale, dg_abs = oracle.backward(dy, x, gamma, rstd)
    oracle.assert_dx_close(dx, dx64, scale, dtype)
    oracle.assert_dgamma_close(dg, dg64, dg_abs, dtype, dtype)


@pytest.mark.parametrize("threads", (1, 2))
def test_one_long_row(threads, rng):
    n = 2**22
    x = rng.standard_normal((1, n)).astype(F32)
    x[0, -5:] *= 1000  # the tail matters
    gamma = rng.uniform(0.5, 1.5, n).astype(F32)
    with using(threads=threads):
        y, rstd = rmsnorm.rms_norm(x, gamma)
    y64, _, r64, _ = oracle.forward(x, gamma)
    oracle.assert_y_close(y, y64, 1, F32)
    oracle.assert_rstd_close(rstd, r64, F32)


@pytest.mark.parametrize("op", ("add_zero_row", "forward_tiny_row"))
def test_in_place_row_shared_across_threads_keeps_its_rstd(op, rng):
    """A row that the threads share, and whose sum of squares is not usable (h = x + r all
    zero; squares that underflow), is rescued from the whole row, while the outputs overwrite
    the inputs (residual_out=residual; out=x): its rstd must come from the inputs as they were,
    whatever the timing. Three rows of 2**20 on two threads share the middle one."""
    k = 2**20
    for _ in range(4):
        x = rng.standard_normal((3, k)).astype(F32)
        r = rng.standard_normal((3, k)).astype(F32)
        if op == "add_zero_row":
            x[1] = -r[1]
            _, _, r64, _ = oracle.forward(x + r, None)  # float32 x + r: h as the add rounds it
            with using(threads=2):
                y, rstd, h = rmsnorm.add_rms_norm(x, r, residual_out=r)
            assert h is r
        else:
            x[1] *= np.float32(1e-30)
            _, _, r64, _ = oracle.forward(x, None)
            with using(threads=2):
                y, rstd = rmsnorm.rms_norm(x, out=x)
        oracle.assert_rstd_close(rstd, r64, F32)


@pytest.mark.parametrize("threads", (1, 2))
def test_a_million_rows_of_one(threads, rng):
    x = rng.standard_normal((10**6, 1)).astype(F32)
    with using(threads=threads):
        y, rstd = rmsnorm.rms_norm(x, eps=1e-3)
    assert rstd.shape == (10**6,)
    y64, _, r64, _ = oracle.forward(x, None, 1e-3)
    oracle.assert_y_close(y, y64, 1, F32)
    oracle.assert_rstd_close(rstd, r64, F32)


# ---------------------------------------------------------------------------------------
# concurrency


def repeat_on_threads(calls, seconds):
    """Calls step(arg) over and over for `seconds`, on a Python thread of its own for each
    (step, arg) pair, all starting together; fails on a thread that hangs (60 s) or on the
    errors the threads met. Returns how many times each step ran."""
    stop = time.monotonic() + seconds
    barrier = threading.Barrier(len(calls))
    counts = [0] * len(calls)
    errors = []

    def loop(i):
        step, arg = calls[i]
        barrier.wait()
        try:
            while time.monotonic() < stop:
                step(arg)
                counts[i] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((step.__name__, arg, e))

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[:3]
    return counts


def test_concurrent_calls_with_changing_settings(rng):
    """8 Python threads: 6 compute (all three functions, several dtypes) and check every
    result, 2 keep switching the ISA and the thread count meanwhile."""
    cases = []
    for i, dt in enumerate((F32, F64, F16, oracle.BF16, F32, F64)):
        x = oracle.make_x(rng, (64, 1000 + 13 * i), dt)
        g = oracle.make_gamma(rng, x.shape[1:], F32)
        res = oracle.make_x(rng, x.shape, dt)
        dy = oracle.make_x(rng, x.shape, dt, spread=False)
        h_ref, y64, _, r64, _ = oracle.add_rms_norm(x, res, g)
        cases.append((x, g, res, dy, h_ref, y64, r64))

    def compute(i):
        x, g, res, dy, h_ref, y64, r64 = cases[i]
        y, rstd, h = rmsnorm.add_rms_norm(x, res, g)
        assert oracle.bits_equal(h, h_ref)
        oracle.assert_y_close(y, y64, 1, x.dtype)
        oracle.assert_rstd_close(rstd, r64, x.dtype)
        y2, _ = rmsnorm.rms_norm(h, g)
        oracle.assert_y_close(y2, y64, 1, x.dtype)
        dx, _ = rmsnorm.rms_norm_backward(dy, h, g, rstd)
        assert dx.shape == x.shape and np.all(np.isfinite(oracle.as_f64(dx)))

    def switch(r):
        rmsnorm._core._set_variant(str(r.choice(ISAS)))
        rmsnorm.set_num_threads(int(r.integers(1, 5)))
        time.sleep(0.0005)

    switches = [(switch, np.random.default_rng(seed)) for seed in (1, 2)]
    with using():
        counts = repeat_on_threads([(compute, i) for i in range(6)] + switches, 2.0)
    assert all(c > 0 for c in counts[:6])


def test_members_rows_kept_between_calls(rng):
    """The members' own weight rows (16-bit gamma of x's dtype) and partial dgamma rows are kept
    from call to call: 6 Python threads, each calling on a team of 4 with rows of its own
    length at once, get the bits each case gives alone (dgamma: within the oracle's bound, as
    the team may differ), and the case alone matches the float64 oracle."""
    shapes = (
        (oracle.BF16, 64, 4096),
        (F16, 96, 2000),
        (oracle.BF16, 24, 8192),
        (F32, 64, 5000),
        (oracle.BF16, 32, 1024),
        (F16, 48, 6000),
    )
    cases = []
    with using(threads=4):
        for dt, m, k in shapes:
            x = oracle.make_x(rng, (m, k), dt)
            g = oracle.make_gamma(rng, (k,), dt)
            dy = oracle.make_x(rng, (m, k), dt, spread=False)
            y, rstd = rmsnorm.rms_norm(x, g)
            dx, dg = rmsnorm.rms_norm_backward(dy, x, g, rstd)
            y64, _, r64, _ = oracle.forward(x, g)
            oracle.assert_y_close(y, y64, 1, dt)
            oracle.assert_rstd_close(rstd, r64, dt)
            dx64, dg64, scale, dg_abs = oracle.backward(dy, x, g, rstd)
            oracle.assert_dx_close(dx, dx64, scale, dt)
            oracle.assert_dgamma_close(dg, dg64, dg_abs, dt, dt)
            cases.append((x, g, dy, y, rstd, dx, dg64, dg_abs))

    def compute(i):
        x, g, dy, y_ref, rstd_ref, dx_ref, dg64, dg_abs = cases[i]
        y, rstd = rmsnorm.rms_norm(x, g)
        assert oracle.bits_equal(y, y_ref) and oracle.bits_equal(rstd, rstd_ref)
        dx, dg = rmsnorm.rms_norm_backward(dy, x, g, rstd)
        assert oracle.bits_equal(dx, dx_ref)
        oracle.assert_dgamma_close(dg, dg64, dg_abs, x.dtype, x.dtype)

    with using(threads=4):
        counts = repeat_on_threads([(compute, i) for i in range(len(cases))], 1.5)
    assert all(c > 0 for c in counts)


def test_threads_results_match_single_thread(rng):
    """The result doesn't depend on the thread count beyond rounding."""
    x = rng.standard_normal((3, 200003)).astype(F32)
    with using(threads=1):
        y1, r1 = rmsnorm.rms_norm(x)
    for t in (2, 3, 4):
        with using(threads=t):
            y, r = rmsnorm.rms_norm(x)
        np.testing.assert_allclose(r, r1, rtol=2.5e-7)
        np.testing.assert_allclose(y, y1, rtol=0, atol=4e-6 * np.abs(y1).max())


THREAD_LIMIT_PROBE = """
import numpy as np, rmsnorm
rng = np.random.default_rng(0)
x = rng.standard_normal((3, 200003)).astype(np.float32)
g = rng.uniform(0.5, 1.5, 200003).astype(np.float32)
dy = rng.standard_normal(x.shape).astype(np.float32)
y, rstd = rmsnorm.rms_norm(x, g)
dx, dg = rmsnorm.rms_norm_backward(dy, x, g, rstd)
np.savez(__import__("sys").argv[1], y=y, rstd=rstd, dx=dx, dg=dg)
"""


def test_fewer_threads_than_asked_still_do_all_the_work(tmp_path):
    """OpenMP may give a team fewer threads than asked (OMP_THREAD_LIMIT, or a call from inside
    another parallel region): the work is split among the threads it gives, none is lost."""
    import subprocess

    env = dict(os.environ, RMSNORM_NUM_THREADS="4", OMP_THREAD_LIMIT="1")
    path = tmp_path / "out.npz"
    subprocess.run([sys.executable, "-c", THREAD_LIMIT_PROBE, str(path)], env=env, check=True)
    got = np.load(path)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 200003)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, 200003).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    y64, _, r64, _ = oracle.forward(x, g)
    oracle.assert_rstd_close(got["rstd"], r64, F32)
    oracle.assert_y_close(got["y"], y64, 1, F32)
    dx64, dg64, scale, dg_abs = oracle.backward(dy, x, g)
    oracle.assert_dx_close(got["dx"], dx64, scale, F32)
    oracle.assert_dgamma_close(got["dg"], dg64, dg_abs, F32, F32)


# For the probes: an output `shift` elements past a cache line, as np.empty_like(x) may give.
AT_OFFSET = """
def at(shape, dt, shift):
    n = int(np.prod(shape))
    buf = np.zeros(n + 64, dt)
    start = (-buf.ctypes.data % 64) // buf.itemsize + shift
    return buf[start : start + n].reshape(shape)
"""

# For the probes: the bytes of each array appended to out, every NaN as one NaN (the sign and
# payload of a NaN that meets another NaN in one instruction depend on the order of its operands).
KEEP = """
def keep(out, arrays):  # every NaN as one NaN
    for a in arrays:
        a = np.where(np.isnan(a.astype(np.float64)), np.nan, a).astype(a.dtype)
        out.append(a.ravel().view(np.uint8))
"""

STREAM_PROBE = (
    """
import os
import sys, ml_dtypes, numpy as np, rmsnorm
rmsnorm._core._set_stream_bytes({stream})  # 0: every output streamed
rmsnorm._core._set_min_per_thread(0)  # two threads split every call, however small
rng = np.random.default_rng(2)
out = []
"""
    + AT_OFFSET
    + KEEP
    + """
for isa in rmsnorm.available_isas():
    rmsnorm.set_isa(isa)
    for dt in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
        for m, k in ((40, 64), (9, 1000), (3, 4099), (6, 2053), (5, 32771)):
            x = rng.standard_normal((m, k)).astype(dt)
            if m > 20:  # rows that take the slow path, in several of the short rows' groups
                x[3] = 0
                x[11, k // 2] = np.nan
                x[20] = float(ml_dtypes.finfo(dt).tiny) * 4
            elif m in (5, 6):  # and among long rows, whose sums the streamed passes take in blocks
                x[1] = 0
                x[2, k // 2] = np.nan
                x[4] = float(ml_dtypes.finfo(dt).tiny) * 4
            r = rng.standard_normal((m, k)).astype(dt)
            g = rng.uniform(0.5, 1.5, k).astype(dt)
            for shift in (0, 1, 2, 3, 8):
                for t in (1, 2):
                    rmsnorm.set_num_threads(t)
                    y, rstd = rmsnorm.rms_norm(x, g, out=at(x.shape, dt, shift))
                    # and without a weight
                    y0, rstd0 = rmsnorm.rms_norm(x, out=at(x.shape, dt, shift))
                    dx0, _ = rmsnorm.rms_norm_backward(
                        r, x, None, rstd0, out=at(x.shape, dt, shift)
                    )
                    ya0, ra0, h0 = rmsnorm.add_rms_norm(
                        x, r, out=at(x.shape, dt, shift), residual_out=at(x.shape, dt, shift)
                    )
                    dx, dg = rmsnorm.rms_norm_backward(r, x, g, rstd, out=at(x.shape, dt, shift))
                    ya, ra, h = rmsnorm.add_rms_norm(
                        x, r, g, out=at(x.shape, dt, shift), residual_out=at(x.shape, dt, shift)
                    )
                    xi, ri = at(x.shape, dt, shift), at(x.shape, dt, shift)
                    xi[...], ri[...] = x, r  # in place: y over x, h over r
                    rmsnorm.add_rms_norm(xi, ri, g, out=xi, residual_out=ri)
                    keep(out, (y, rstd, y0, rstd0, dx0, ya0, ra0, h0, dx, dg, ya, ra, h, xi, ri))
sys.stdout.buffer.write(np.concatenate(out).tobytes())
"""
)


STREAM_0 = STREAM_PROBE.replace("{stream}", "0")


def test_streaming_does_not_change_results():
    """A streaming threshold of 0 streams every output (whole cache lines non-temporally, the
    partial lines of rows that start or end inside one plainly, or on x86-64 non-temporally in
    pieces of 16, 8 and 4 bytes where the row starts and ends on 4 bytes: every 32- and 64-bit
    row, and the 16-bit rows here of even length shifted 0, 2 or 8 elements; the forward's and
    the 16-bit add's rows of 64, with a weight or without, shifted off lines, then take the
    general loop rather than the one compiled for their length); a huge value streams none.
    Every ISA, dtype, output offset and thread count must give the same bits either way, with
    rows that take the slow path (zero, NaN, squares that underflow) among the short rows, which
    the streamed float32 forward takes in groups, and among the long rows, whose sums the forward,
    the backward and the add take a block at a time between the chunks of the row before (16-bit
    rows too, as on AMD CPUs), the add also in place. NaNs
    are compared by place only: the sign and payload of a NaN that meets another NaN in one
    instruction depend on the order of its operands, which the compiler picks per loop."""
    runs = outputs_with(STREAM_PROBE, "{stream}", ("0", str(1 << 62)), np.uint8)
    assert runs[0].size > 0
    assert np.array_equal(runs[0], runs[1])


def _sysfs_l3_bytes():
    """CPU 0's L3 from Linux's sysfs, parsed here independently of the C code (None if absent)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    for i in range(16):
        try:
            with open(f"{base}/index{i}/level") as f:
                level = int(f.read())
            if level != 3:
                continue
            with open(f"{base}/index{i}/size") as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    return None


STREAM_BYTES_PROBE = "import rmsnorm; print(*rmsnorm._core.stream_bytes())"


@pytest.mark.parametrize("setting", (None, "0", "12345", str(1 << 62)))
def test_stream_threshold_from_the_l3_or_the_environment(setting):
    """Outputs stream from half the L3 that Linux's sysfs lists for CPU 0 (glibc's figure where
    sysfs has none), at most 32 MiB; RMSNORM_STREAM_BYTES sets the threshold instead."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "RMSNORM_STREAM_BYTES"}
    if setting is not None:
        env["RMSNORM_STREAM_BYTES"] = setting
    out = subprocess.run(
        [sys.executable, "-c", STREAM_BYTES_PROBE],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    threshold, l3 = map(int, out.split())
    if setting is not None:
        assert threshold == int(setting)
        return
    sysfs = _sysfs_l3_bytes() if sys.platform.startswith("linux") else None
    if sysfs:
        assert l3 == sysfs
    assert threshold == (min(32 << 20, l3 // 2) if l3 else 32 << 20)


# Outputs in buffers of sentinel bytes, for the probes below.
OUT_HELPERS = (
    """
SENTINEL = 0x5A
def at(shape, dt, shift):
    # a packed output `shift` elements past a cache line, in a buffer of sentinel bytes
    n = int(np.prod(shape))
    buf = np.full((n + 128) * np.dtype(dt).itemsize, SENTINEL, np.uint8)
    start = (-buf.ctypes.data % 64) + shift * np.dtype(dt).itemsize
    return buf, buf[start : start + n * np.dtype(dt).itemsize].view(dt).reshape(shape), start
def check(buf, start, a):  # no byte stored outside the output, before it or after it
    end = start + a.nbytes
    assert (buf[:start] == SENTINEL).all() and (buf[end:] == SENTINEL).all(), (a.shape, a.dtype)
def calls(x, r, g, rstd, dt, shift):
    # the forward, the backward with and without a weight, the add, and the add in place, each
    # output checked
    by, y, sy = at(x.shape, dt, shift)
    _, ry = rmsnorm.rms_norm(x, g, out=y)
    bd, dx, sd = at(x.shape, dt, shift)
    _, dg = rmsnorm.rms_norm_backward(r, x, g, rstd, out=dx)
    bz, dz, sz = at(x.shape, dt, shift)
    rmsnorm.rms_norm_backward(r, x, None, rstd, out=dz)
    ba, ya, sa = at(x.shape, dt, shift)
    bh, h, sh = at(x.shape, dt, shift)
    _, ra, _ = rmsnorm.add_rms_norm(x, r, g, out=ya, residual_out=h)
    bx, xi, sx = at(x.shape, dt, shift)
    br, ri, sr = at(x.shape, dt, shift)
    xi[...], ri[...] = x, r  # in place: y over x, h over r
    rmsnorm.add_rms_norm(xi, ri, g, out=xi, residual_out=ri)
    outs = ((by, sy, y), (bd, sd, dx), (bz, sz, dz), (ba, sa, ya), (bh, sh, h), (bx, sx, xi),
            (br, sr, ri))
    for b, s, a in outs:
        check(b, s, a)
    return y, ry, dx, dg, dz, ya, ra, h, xi, ri
"""
    + KEEP
    + """
def cases(shapes, shifts, mark):
    # every ISA, dtype and shape (x given rows that take the slow path by mark), output offset
    # and one thread or two: what calls returns, in turn
    for isa in rmsnorm.available_isas():
        rmsnorm.set_isa(isa)
        for dt, dims in shapes.items():
            for m, k in dims:
                x = rng.standard_normal((m, k)).astype(dt)
                mark(x)
                r = rng.standard_normal((m, k)).astype(dt)
                g = rng.uniform(0.5, 1.5, k).astype(dt)
                _, rstd = rmsnorm.rms_norm(x, g)
                for shift in shifts:
                    for t in (1, 2):
                        rmsnorm.set_num_threads(t)
                        yield calls(x, r, g, rstd, dt, shift)
"""
)

LINE_PROBE = (
    """
import sys, ml_dtypes, numpy as np, rmsnorm
rmsnorm._core._set_stream_bytes({stream})
rmsnorm._core._set_min_per_thread(0)  # two threads split every call, however small
rng = np.random.default_rng(4)
out = []
"""
    + OUT_HELPERS
    + """# rows of 64 to 508 bytes, enough of them that each of two threads takes several batches
# of the line buffer, the threads' shares starting and ending inside rows
shapes = {np.float16: ((601, 64), (601, 65), (401, 96), (301, 128)),
          ml_dtypes.bfloat16: ((601, 64), (301, 128), (601, 127)),
          np.float32: ((2051, 16), (1025, 64), (401, 96), (301, 127)),
          np.float64: ((1025, 32), (601, 63))}
def mark(x):  # rows that take the slow path
    x[5] = 0
    x[77, x.shape[1] // 2] = np.nan
for y, _, dx, _, dz, ya, _, h, xi, ri in cases(shapes, (1, 3, 8), mark):
    keep(out, (y, dx, dz, ya, h, xi, ri))
sys.stdout.buffer.write(np.concatenate(out).tobytes())
"""
)


def test_line_buffer_does_not_change_results():
    """Outputs larger than the cache whose short rows are packed but do not start on cache lines
    (np.empty_like) go through a line buffer on Intel CPUs: a batch of rows into L1, its whole
    lines streamed out, the partial line carried over to the next batch (the add's 16-bit rows of
    128 to 256 bytes, the forward's of 256; the backward's 32- and 64-bit rows of 64 to 511
    bytes, and of 256 to 511 on AMD CPUs from Zen 5 on; the rest here store plainly or stream
    either way). A streaming threshold of 0
    takes that path for every output here; a huge value stores every row plainly. Every ISA,
    dtype, offset within a line (and one on a line), one thread or two: the same bits either
    way, and no byte stored outside the output, however the threads' shares cut the rows."""
    runs = outputs_with(LINE_PROBE, "{stream}", ("0", str(1 << 62)), np.uint8)
    assert runs[0].size > 0
    assert np.array_equal(runs[0], runs[1])


# ---------------------------------------------------------------------------------------
# leaks


def _mixed_calls(x, g, dy, rstd, out, bad_gamma):
    rmsnorm.rms_norm(x, g)
    rmsnorm.rms_norm(x, None)
    rmsnorm.rms_norm(x, g, out=out)
    rmsnorm.rms_norm_backward(dy, x, g, rstd)
    rmsnorm.rms_norm_backward(dy, x, g, rstd, out=out)
    rmsnorm.add_rms_norm(x, dy, g)
    rmsnorm.add_rms_norm(x, dy, g, out=out)
    rmsnorm.rms_norm([[1.0, 2.0]], [1, 2])
    for call in (
        lambda: rmsnorm.rms_norm(x, bad_gamma),
        lambda: rmsnorm.rms_norm(x.astype(np.int32)),
        lambda: rmsnorm.rms_norm_backward(dy, x, g, rstd[:-1]),
        lambda: rmsnorm.rms_norm(x, g, -1.0),
        lambda: rmsnorm.rms_norm(x, g, "a"),
        lambda: rmsnorm.add_rms_norm(x, dy[:, :-1], g),
    ):
        try:
            call()
        except (ValueError, TypeError):
            pass
        else:
            raise AssertionError("expected an error")


def _leak_inputs(rng, n=64):
    x = rng.standard_normal((8, n)).astype(F32)
    g = rng.uniform(0.5, 1.5, n).astype(F32)
    dy = rng.standard_normal((8, n)).astype(F32)
    _, rstd = rmsnorm.rms_norm(x, g)
    return x, g, dy, rstd, np.empty_like(x), np.ones(n + 1, F32)


def test_no_refcount_leaks(rng):
    args = _leak_inputs(rng)
    _mixed_calls(*args)
    before = [sys.getrefcount(a) for a in args]
    for _ in range(500):
        _mixed_calls(*args)
    after = [sys.getrefcount(a) for a in args]
    assert after == before, f"refcounts changed: {before} -> {after}"


def test_no_memory_growth_tracemalloc(rng):
    args = _leak_inputs(rng)
    for _ in range(200):
        _mixed_calls(*args)
    gc.collect()
    tracemalloc.start()
    try:
        for _ in range(200):
            _mixed_calls(*args)
        gc.collect()
        start, _ = tracemalloc.get_traced_memory()
        for _ in range(1500):  # x 14 calls = 21000 calls, 9000 of them raising
            _mixed_calls(*args)
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # one leaked array object (>= 100 bytes) per call would be >= 2 MB
    assert end - start < 256 * 1024, f"traced memory grew by {end - start} bytes"


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_no_rss_growth(rng):
    # bigger arrays (128 KB per result): a leaked buffer per call would be GBs
    args = _leak_inputs(rng, n=4096)
    for _ in range(100):
        _mixed_calls(*args)
    gc.collect()
    start = _rss_bytes()
    for _ in range(1500):
        _mixed_calls(*args)
    gc.collect()
    grown = _rss_bytes() - start
    assert grown < 32 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------------------
# > 2**31 elements


@pytest.mark.slow
def test_more_than_2_31_elements_float16(rng):
    n = 4096
    rows = 2**31 // n + 1  # 2**31 + 4096 elements, 4 GiB
    x = np.zeros((rows, n), dtype=F16)  # untouched pages stay shared zero pages
    check_rows = [0, rows // 2 + 1, rows - 2, rows - 1]  # the last row starts at 2**31
    for r in check_rows:
        x[r] = oracle.make_x(rng, (n,), F16)
    gamma = oracle.make_gamma(rng, (n,), F32)
    y, rstd = rmsnorm.rms_norm(x, gamma, 1e-6)
    assert y.shape == x.shape and rstd.shape == (rows,)
    y64, _, r64, _ = oracle.forward(x[check_rows], gamma, 1e-6)
    oracle.assert_y_close(y[check_rows], y64, 1, F16)
    oracle.assert_rstd_close(rstd[check_rows], r64, F16)
    # the zero rows between them: y = 0, rstd = 1/sqrt(eps)
    for r in (1, rows // 2, rows - 3):
        assert not np.any(y[r].astype(F32))
        np.testing.assert_allclose(rstd[r], 1e3, rtol=1e-6)
    del y
    dy = np.zeros_like(x)
    for r in check_rows:
        dy[r] = oracle.make_x(rng, (n,), F16, spread=False)
    dx, dg = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    dx64, _, scale, _ = oracle.backward(dy[check_rows], x[check_rows], gamma, rstd[check_rows])
    oracle.assert_dx_close(dx[check_rows], dx64, scale, F16)
