"""Shared pytest setup: run tests under every ISA x thread count, a per-test seeded RNG,
and the opt-in `slow` marker (--runslow or RMSNORM_SLOW=1)."""

import contextlib
import os
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import oracle`

import rmsnorm  # noqa: E402

ISAS = tuple(rmsnorm.available_isas())
THREADS = (1, 2)
BACKENDS = tuple((isa, t) for isa in ISAS for t in THREADS)


def outputs_under_env(script, name, values, dtype):
    """Runs `script` in a fresh Python once per value of the environment variable `name` (read
    at import), and returns what each run wrote to stdout, as arrays of `dtype`."""
    import subprocess

    runs = []
    for value in values:
        env = dict(os.environ, **{name: value})
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, check=True
        )
        runs.append(np.frombuffer(out.stdout, dtype))
    return runs


def backend_id(p):
    return f"{p[0]}-t{p[1]}"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow tests")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: long or huge-memory test; run with --runslow or RMSNORM_SLOW=1"
    )


def _run_slow(config):
    try:
        flag = config.getoption("--runslow")
    except ValueError:  # option not registered (conftest not an initial one)
        flag = False
    return flag or os.environ.get("RMSNORM_SLOW", "") == "1"


def pytest_collection_modifyitems(config, items):
    if _run_slow(config):
        return
    skip = pytest.mark.skip(reason="slow: use --runslow or RMSNORM_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def using(isa=None, threads=None):
    """Switch ISA / thread count, restoring the previous ones afterwards."""
    prev_isa = rmsnorm.isa()
    prev_threads = rmsnorm.get_num_threads()
    try:
        if isa is not None:
            rmsnorm.set_isa(isa)
        if threads is not None:
            rmsnorm.set_num_threads(threads)
        yield
    finally:
        rmsnorm.set_isa(prev_isa)
        rmsnorm.set_num_threads(prev_threads)


@pytest.fixture(autouse=True)
def _restore_runtime_state():
    """No test may leak an ISA or thread-count change into the next one."""
    with using():
        yield


@pytest.fixture(params=BACKENDS, ids=backend_id)
def isa_threads(request):
    """Every ISA this machine runs x threads (1, 2)."""
    isa, threads = request.param
    with using(isa, threads):
        assert rmsnorm.isa() == isa
        assert rmsnorm.get_num_threads() == threads
        yield request.param


@pytest.fixture(params=ISAS)
def each_isa(request):
    """Every ISA this machine runs, with 2 threads."""
    with using(request.param, 2):
        assert rmsnorm.isa() == request.param
        yield request.param


@pytest.fixture
def rng(request):
    """A generator seeded from the test id: deterministic, different per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
