"""The fuzzer's findings (tests/fuzz/findings, the inputs .ci/fuzz.sh stopped on) replayed
through its harness against the float64 oracle, so that each stays fixed. The harness draws the
kernel table and thread count from the input among those this machine runs: on the machine
where a finding was made it reproduces that call exactly, elsewhere it is a call like it."""

import os

import pytest

pytest.importorskip("atheris")  # the harness instruments its functions with atheris

HERE = os.path.dirname(os.path.abspath(__file__))
FINDINGS = sorted(os.listdir(os.path.join(HERE, "fuzz", "findings")))


@pytest.fixture(scope="module")
def harness():
    import sys

    sys.path.insert(0, os.path.join(HERE, "fuzz"))
    try:
        import fuzz_rmsnorm
    finally:
        sys.path.pop(0)
    return fuzz_rmsnorm


@pytest.mark.parametrize("name", FINDINGS)
def test_fuzz_finding_passes(name, harness):
    with open(os.path.join(HERE, "fuzz", "findings", name), "rb") as f:
        harness.one(f.read())  # raises AssertionError on a result the oracle rejects
