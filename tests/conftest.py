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
from rmsnorm import _core  # noqa: E402

# Every kernel table this machine runs, a family's variants included (avx512bf16: the avx512
# family's bfloat16 kernels with AVX512-BF16), so that each path is tested where it can run.
ISAS = tuple(_core._variants())
THREADS = (1, 2)
BACKENDS = tuple((isa, t) for isa in ISAS for t in THREADS)


def _probe_outputs(script, env, dtype):
    import subprocess

    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=True)
    return np.frombuffer(out.stdout, dtype)


def outputs_under_env(script, name, values, dtype):
    """Runs `script` in a fresh Python once per value of the environment variable `name` (read
    at import), and returns what each run wrote to stdout, as arrays of `dtype`."""
    return [_probe_outputs(script, dict(os.environ, **{name: v}), dtype) for v in values]


def outputs_with(script, placeholder, values, dtype):
    """Runs `script` in a fresh Python once per value, written in place of `placeholder` in its
    text, and returns what each run wrote to stdout, as arrays of `dtype`."""
    return [_probe_outputs(script.replace(placeholder, v), None, dtype) for v in values]


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
def using(isa=None, threads=None, stream_bytes=None):
    """Switch ISA / thread count / streaming threshold (bytes; 0 streams every output that can),
    restoring them afterwards. A thread count also drops the work a thread needs (16 Ki elements
    by default) to nothing, so that every call with work for that many threads splits it among
    them, whatever its size."""
    prev_isa = _core._variant()
    prev_threads = rmsnorm.get_num_threads()
    prev_min = _core._set_min_per_thread(0)
    if threads is None:
        _core._set_min_per_thread(prev_min)
    prev_stream = _core._set_stream_bytes(0)
    _core._set_stream_bytes(prev_stream if stream_bytes is None else stream_bytes)
    try:
        if isa is not None:
            _core._set_variant(isa)
        if threads is not None:
            rmsnorm.set_num_threads(threads)
        yield
    finally:
        _core._set_variant(prev_isa)
        rmsnorm.set_num_threads(prev_threads)
        _core._set_min_per_thread(prev_min)
        _core._set_stream_bytes(prev_stream)


def last_team():
    """Threads that the last forward, add or backward ran on (1: the calling thread)."""
    return _core._last_team_size()


def expected_team(name, size, gamma_size, threads):
    """The team a call gets when `using(threads=...)` lets any work split: as many threads as
    elements at most; the backward of up to 16 rows with a weight splits the columns, 32 or more
    a thread."""
    team = max(1, min(threads, size))
    if name == "rms_norm_backward" and gamma_size and size // gamma_size <= 16:
        team = max(1, min(team, gamma_size // 32))
    return team


class TeamLog:
    """Records, for every call of the public functions made while it is installed, its work and
    the team that ran it."""

    NAMES = ("rms_norm", "add_rms_norm", "rms_norm_backward")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            monkeypatch.setattr(rmsnorm, name, self._wrap(name, getattr(rmsnorm, name)))

    def _wrap(self, name, f):
        def call(*args, **kwargs):
            result = f(*args, **kwargs)
            at = 1 if name == "rms_norm_backward" else 0  # x's position
            x = args[at] if len(args) > at else kwargs["x"]
            at = 1 if name == "rms_norm" else 2  # gamma's
            gamma = args[at] if len(args) > at else kwargs.get("gamma")
            gsize = 0 if gamma is None else int(np.size(gamma))
            threads = rmsnorm.get_num_threads()
            self.calls.append((name, int(np.size(x)), gsize, threads, last_team()))
            return result

        return call

    def check(self):
        """Every call ran on the team that its work allows at the thread count it was made at."""
        for name, size, gsize, threads, team in self.calls:
            assert team == expected_team(name, size, gsize, threads), (
                f"{name} of {size} elements ran on {team} threads, not {threads}"
            )


@pytest.fixture(autouse=True)
def _restore_runtime_state():
    """No test may leak an ISA, thread-count or streaming change into the next one."""
    with using():
        yield


@pytest.fixture(params=BACKENDS, ids=backend_id)
def isa_threads(request, monkeypatch):
    """Every ISA this machine runs x threads (1, 2); every call that has work for the threads
    must run on that many (checked after the test)."""
    isa, threads = request.param
    log = TeamLog(monkeypatch)
    with using(isa, threads):
        assert _core._variant() == isa
        assert rmsnorm.get_num_threads() == threads
        yield request.param
    log.check()


@pytest.fixture(params=ISAS)
def each_isa(request, monkeypatch):
    """Every ISA this machine runs, with 2 threads (every call that has work for two runs on
    two, checked after the test)."""
    log = TeamLog(monkeypatch)
    with using(request.param, 2):
        assert _core._variant() == request.param
        yield request.param
    log.check()


@pytest.fixture
def rng(request):
    """A generator seeded from the test id: deterministic, different per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
