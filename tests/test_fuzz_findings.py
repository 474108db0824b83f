"""The fuzzer's findings (tests/fuzz/findings, the inputs .ci/fuzz.sh stopped on) replayed
through its harness against the float64 oracle, so that each stays fixed. The harness draws the
kernel table and thread count from the input among those this machine runs: on the machine
where a finding was made it reproduces that call exactly, elsewhere it is a call like it. Each
runs in a process of its own, as the fuzzer runs it: atheris, which the harness is built on,
is not made to share a process with the other tests' libraries."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("atheris")

HERE = os.path.dirname(os.path.abspath(__file__))
FUZZ = os.path.join(HERE, "fuzz")
FINDINGS = sorted(os.listdir(os.path.join(FUZZ, "findings")))


@pytest.mark.parametrize("name", FINDINGS)
def test_fuzz_finding_passes(name):
    import rmsnorm

    env = dict(os.environ)
    # the rmsnorm this test session imports (the installed package, or a checkout on the path)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(rmsnorm.__file__)), env.get("PYTHONPATH", "")]
    )
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(FUZZ, "fuzz_rmsnorm.py"),
            os.path.join(FUZZ, "findings", name),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "Uncaught" not in out, out[-3000:]
