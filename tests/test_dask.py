# Tests for rmsnorm.dask on the threaded scheduler and on a LocalCluster of two worker processes:
# y, rstd, h and dx have the NumPy API's bits, dgamma is within float32 summation error of the
# float64 oracle, for chunkings that split the leading axes unevenly and the normalized axes.
import collections
import importlib
import os
import sys

import ml_dtypes
import numpy as np
import pytest

da = pytest.importorskip("dask.array")

import oracle  # noqa: E402
from conftest import using  # noqa: E402

import rmsnorm  # noqa: E402

# Imported after the skip checks; an ImportError here with dask installed is a real failure.
rd = importlib.import_module("rmsnorm.dask")

TIMEOUT = 120  # seconds for any one computation on the cluster

DTYPES = [np.float32, np.float64, ml_dtypes.bfloat16, np.float16]
DTYPE_IDS = ["f32", "f64", "bf16", "f16"]

# (id, x shape, x chunks, gamma shape or None)
CHUNKINGS = [
    ("uneven_rows", (37, 64), ((10, 20, 7), 64), (64,)),
    ("split_norm_axis", (3, 11, 48), ((2, 1), (5, 6), (16, 32)), (48,)),
    ("split_2d_gamma", (6, 4, 24), ((3, 3), (1, 3), (12, 12)), (4, 24)),
    ("no_gamma", (9, 40), ((4, 5), (30, 10)), None),
    ("one_row", (50,), ((20, 30),), (50,)),
]


@pytest.fixture(scope="module")
def client():
    """One LocalCluster of two worker processes (one thread each) for the whole module."""
    pytest.importorskip("distributed")
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            timeout=TIMEOUT,
        ) as cluster,
        Client(cluster, timeout=TIMEOUT) as c,
    ):
        c.wait_for_workers(2, timeout=TIMEOUT)
        pids = c.run(os.getpid)
        assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()
        yield c


@pytest.fixture(params=["threads", "cluster"])
def compute(request):
    """dask.compute on the threaded scheduler, or on the two-process cluster."""
    if request.param == "threads":
        return lambda *arrays: da.compute(*arrays, scheduler="threads")
    c = request.getfixturevalue("client")

    def on_cluster(*arrays):
        futures = c.compute(list(arrays))
        from distributed import wait

        wait(futures, timeout=TIMEOUT)
        return tuple(c.gather(futures))

    return on_cluster


def make(shape, gamma_shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = oracle.make_x(rng, shape, dtype)
    gamma = None if gamma_shape is None else oracle.make_gamma(rng, gamma_shape, dtype)
    return rng, x, gamma


def assert_same_bits(actual, expected, what):
    actual = np.asarray(actual)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    bits = np.dtype(f"u{expected.dtype.itemsize}")
    assert np.array_equal(actual.view(bits), expected.view(bits)), f"{what}: bits differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CHUNKINGS, ids=[c[0] for c in CHUNKINGS])
def test_forward_and_backward_match_the_numpy_api(case, dtype, compute):
    _, shape, chunks, gamma_shape = case
    rng, x, gamma = make(shape, gamma_shape, dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    dx_ = da.from_array(x, chunks=chunks)
    y, rstd = rd.rms_norm(dx_, gamma, offset=0.25)
    # leading chunks kept, normalized axes merged
    lead = x.ndim - (1 if gamma is None else gamma.ndim)
    assert y.chunks[:lead] == dx_.chunks[:lead] and all(len(c) == 1 for c in y.chunks[lead:])
    assert rstd.chunks == dx_.chunks[:lead]
    dxs, dgamma = rd.rms_norm_backward(
        da.from_array(dy, chunks=chunks), dx_, gamma, rstd, offset=0.25, split_every=2
    )
    lazy = (y, rstd, dxs) if dgamma is None else (y, rstd, dxs, dgamma)
    got = compute(*lazy)

    y0, rstd0 = rmsnorm.rms_norm(x, gamma, offset=0.25)
    dx0, _ = rmsnorm.rms_norm_backward(dy, x, gamma, rstd0, offset=0.25)
    assert_same_bits(got[0], y0, "y")
    assert_same_bits(got[1], rstd0, "rstd")
    assert_same_bits(got[2], dx0, "dx")
    if gamma is None:
        assert dgamma is None
        return
    _, dg64, _, dg_abs = oracle.backward(dy, x, gamma, rstd0, offset=0.25)
    oracle.assert_dgamma_close(got[3], dg64, dg_abs, gamma.dtype, x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_rms_norm_matches_the_numpy_api(dtype, compute):
    rng, x, gamma = make((29, 3, 16), (3, 16), dtype, seed=1)
    residual = oracle.make_x(rng, x.shape, dtype)
    y, rstd, h = rd.add_rms_norm(
        da.from_array(x, chunks=((9, 20), (2, 1), 8)),
        da.from_array(residual, chunks=((15, 14), 3, 16)),  # other chunks than x's
        gamma,
        cast="before_weight",
    )
    got = compute(y, rstd, h)
    for actual, expected, what in zip(
        got, rmsnorm.add_rms_norm(x, residual, gamma, cast="before_weight"), ("y", "rstd", "h")
    ):
        assert_same_bits(actual, expected, what)


def test_mixed_dtypes_and_a_dask_gamma(compute):
    """bfloat16 activations with a float32 weight that is itself a chunked dask array."""
    rng, x, _ = make((40, 32), None, ml_dtypes.bfloat16, seed=2)
    gamma = oracle.make_gamma(rng, (32,), np.float32)
    dy = rng.standard_normal(x.shape).astype(x.dtype)
    xs, gs = da.from_array(x, chunks=(7, 16)), da.from_array(gamma, chunks=8)
    y, rstd = rd.rms_norm(xs, gs)
    dx, dgamma = rd.rms_norm_backward(da.from_array(dy, chunks=(13, 32)), xs, gs, rstd)
    got = compute(y, rstd, dx, dgamma)
    y0, rstd0 = rmsnorm.rms_norm(x, gamma)
    dx0, _ = rmsnorm.rms_norm_backward(dy, x, gamma, rstd0)
    assert_same_bits(got[0], y0, "y")
    assert_same_bits(got[1], rstd0, "rstd")
    assert_same_bits(got[2], dx0, "dx")
    _, dg64, _, dg_abs = oracle.backward(dy, x, gamma, rstd0)
    oracle.assert_dgamma_close(got[3], dg64, dg_abs, np.float32, x.dtype)


def test_dgamma_is_a_tree_of_per_block_partials():
    """dgamma is a reduction over one float32 partial per row block, combined split_every at a
    time: the graph has a partial per block, and its result agrees with the oracle."""
    rng, x, gamma = make((64, 16), (16,), ml_dtypes.bfloat16, seed=3)
    dy = rng.standard_normal(x.shape).astype(x.dtype)
    xs = da.from_array(x, chunks=(4, 16))
    _, rstd0 = rmsnorm.rms_norm(x, gamma)
    _, dgamma = rd.rms_norm_backward(
        da.from_array(dy, chunks=(4, 16)), xs, gamma, rstd0, split_every=4
    )
    assert dgamma.dtype == gamma.dtype and dgamma.shape == gamma.shape
    layers = collections.Counter(
        (key[0] if isinstance(key, tuple) else key).rsplit("-", 1)[0]
        for key in dict(dgamma.__dask_graph__())
    )
    # 16 partials (one per block), summed 4 at a time, then the 4 sums in one task
    assert layers["rms-norm-dgamma-partial"] == 16
    assert (layers["sum-partial"], layers["sum-aggregate"]) == (4, 1)
    _, dg64, _, dg_abs = oracle.backward(dy, x, gamma, rstd0)
    oracle.assert_dgamma_close(
        dgamma.compute(scheduler="threads"), dg64, dg_abs, gamma.dtype, x.dtype
    )


def test_nothing_runs_until_computed(monkeypatch):
    """Building the graph calls no kernel (the outputs' dtypes and metas are given)."""
    calls = []
    for name in ("rms_norm", "add_rms_norm", "rms_norm_backward"):
        real = getattr(rmsnorm, name)
        monkeypatch.setattr(
            rmsnorm, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k)
        )
    x = da.ones((8, 16), chunks=(4, 8), dtype=np.float32)
    gamma = np.ones(16, np.float32)
    y, rstd = rd.rms_norm(x, gamma)
    rd.add_rms_norm(x, x, gamma)
    dx, dgamma = rd.rms_norm_backward(x, x, gamma, rstd)
    assert calls == []
    y.compute(scheduler="sync")
    assert len(calls) == 2  # one per row block


def test_zarr_arrays_on_disk(tmp_path, compute):
    """A zarr array normalized chunk by chunk into another zarr array on disk."""
    zarr = pytest.importorskip("zarr")
    rng, x, gamma = make((50, 24), (24,), np.float32, seed=4)
    source = zarr.open_array(
        str(tmp_path / "x.zarr"), mode="w", shape=x.shape, chunks=(16, 24), dtype=x.dtype
    )
    source[...] = x
    y, _ = rd.rms_norm(da.from_zarr(str(tmp_path / "x.zarr")), gamma)
    store = da.to_zarr(y, str(tmp_path / "y.zarr"), compute=False)
    compute(store)
    written = zarr.open_array(str(tmp_path / "y.zarr"), mode="r")
    assert written.chunks == (16, 24)
    assert_same_bits(written[...], rmsnorm.rms_norm(x, gamma)[0], "y")


@pytest.mark.parametrize(
    "scheduler, threads, expected",
    [("threads", None, 1), ("sync", None, "own"), ("threads", 3, 3), ("sync", 2, 2)],
)
def test_kernel_threads_per_task(monkeypatch, scheduler, threads, expected):
    """Each task's kernels see one thread on the threaded scheduler's worker threads, the
    process's own setting under the sync scheduler, and ``threads`` when given; the setting
    is restored afterwards."""
    seen = []
    real = rmsnorm.rms_norm

    def recording(*args, **kwargs):
        seen.append(rmsnorm.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(rmsnorm, "rms_norm", recording)
    x = da.ones((6, 8), chunks=(2, 8), dtype=np.float32)
    y, _ = rd.rms_norm(x, threads=threads)
    with using(threads=4):  # a process setting that no default equals
        y.compute(scheduler=scheduler)
        assert rmsnorm.get_num_threads() == 4
    assert seen == [4 if expected == "own" else expected] * 3


def test_errors_before_any_work():
    x = da.ones((4, 8), chunks=2, dtype=np.float32)
    with pytest.raises(TypeError, match="int32"):
        rd.rms_norm(da.ones((4, 8), dtype=np.int32))
    with pytest.raises(ValueError, match=r"\(7,\).*\(4, 8\)"):
        rd.rms_norm(x, np.ones(7, np.float32))
    with pytest.raises(ValueError, match="eps"):
        rd.rms_norm(x, eps=-1.0)
    with pytest.raises(ValueError, match="cast"):
        rd.rms_norm(x, cast="middle")
    with pytest.raises(ValueError, match="threads"):
        rd.rms_norm(x, threads=0)
    with pytest.raises(TypeError, match="residual has dtype float64 but x has dtype float32"):
        rd.add_rms_norm(x, da.ones((4, 8)))
    with pytest.raises(ValueError, match=r"residual of shape \(4, 7\).*\(4, 8\)"):
        rd.add_rms_norm(x, da.ones((4, 7), dtype=np.float32))
    rstd = da.ones(4, dtype=np.float32)
    with pytest.raises(ValueError, match=r"dy of shape \(8, 4\)"):
        rd.rms_norm_backward(x.T, x, None, rstd)
    with pytest.raises(TypeError, match="rstd has dtype float64 but must be float32"):
        rd.rms_norm_backward(x, x, None, rstd.astype(np.float64))
    with pytest.raises(ValueError, match=r"rstd of shape \(3,\)"):
        rd.rms_norm_backward(x, x, None, rstd[:3])


def test_missing_dask_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "dask.array", None)
    monkeypatch.delitem(sys.modules, "rmsnorm.dask")
    with pytest.raises(ImportError, match=r"pip install rmsnorm\[dask\]"):
        importlib.import_module("rmsnorm.dask")
