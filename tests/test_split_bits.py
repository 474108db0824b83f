"""A row split across threads has the bits of the same row on one thread and inside a batch:
rstd, y, h and dx (SPEC, "Bits"), on every ISA, for rows long enough to be split."""

import numpy as np
import oracle
import pytest
from conftest import ISAS, using
from oracle import ALL_DTYPES, F32, dtype_id

import rmsnorm
from rmsnorm import _core

SHAPES = ((1, 1 << 18), (3, 70001), (2, 8209))


def run_all(x, r, dy, gamma):
    y, rstd = rmsnorm.rms_norm(x, gamma)
    ya, rstda, h = rmsnorm.add_rms_norm(x, r, gamma)
    dx, _ = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    dx0, _ = rmsnorm.rms_norm_backward(dy, x, None, rstd)
    return y, rstd, ya, rstda, h, dx, dx0


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_split_rows_same_bits(shape, dtype, isa, rng):
    x = oracle.make_x(rng, shape, dtype)
    r = oracle.make_x(rng, shape, dtype)
    dy = oracle.make_x(rng, shape, dtype, spread=False)
    gamma = oracle.make_gamma(rng, shape[-1:], F32)
    with using(isa, 1):
        base = run_all(x, r, dy, gamma)
    y64, _, r64, _ = oracle.forward(x, gamma)
    oracle.assert_y_close(base[0], y64, 1, dtype)
    oracle.assert_rstd_close(base[1], r64, dtype)
    for threads in (2, 3, 7):
        with using(isa, threads):
            got = run_all(x, r, dy, gamma)
            assert _core._last_team_size() == threads
        for a, b in zip(got, base):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    # the same rows inside a batch of 16 at 2 threads
    pad = (16 - shape[0],) + shape[1:]
    big = [np.concatenate([v, oracle.make_x(rng, pad, dtype)]) for v in (x, r, dy)]
    with using(isa, 2):
        got = run_all(*big, gamma)
    for a, b in zip(got, base):
        np.testing.assert_array_equal(a[: shape[0]].view(np.uint8), b.view(np.uint8))
