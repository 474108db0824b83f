"""The benchmark's roofline references (rmsnorm._core.copy and triad) compute what they claim:
a ratio to a copy that drops bytes would flatter every kernel it is compared with."""

import numpy as np
import pytest
from conftest import using

from rmsnorm import _core

# Below and above the size from which the references stream their stores (at most 32 MiB),
# with tails that fill no whole vector or cache line.
SIZES = (0, 1, 63, 64, 65, 4097, (33 << 20) + 37)


def _unaligned(nbytes, offset):
    """A C-contiguous uint8 array of nbytes starting `offset` bytes past a 64-byte boundary."""
    buf = np.empty(nbytes + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    return buf[start : start + nbytes]


@pytest.mark.parametrize("prefetch", (False, True), ids=("plain", "prefetch"))
@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("offset", (0, 3))
@pytest.mark.parametrize("nbytes", SIZES)
def test_copy_moves_every_byte(nbytes, offset, threads, prefetch, rng):
    src = _unaligned(nbytes, 0)
    src[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = _unaligned(nbytes, offset)
    dst[:] = ~src  # every byte differs until copied
    before = src.copy()
    with using(threads=threads):
        _core.copy(src, dst, prefetch)
    assert np.array_equal(dst, src)
    assert np.array_equal(src, before)


@pytest.mark.parametrize("dtype", (np.float32, np.float64))
@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("n", (1, 15, 17, (9 << 20) + 5))
def test_triad(n, dtype, threads, rng):
    a = rng.standard_normal(n).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    dst = np.full(n, np.nan, dtype)
    with using(threads=threads):
        _core.triad(a, b, dst)
    # a + 0.5 * b: the halving is exact, so the one rounding is the addition's
    assert np.array_equal(dst, a + dtype(0.5) * b)


def test_reference_arguments_are_checked():
    a, b = np.zeros(8, np.float32), np.zeros(9, np.float32)
    with pytest.raises(TypeError, match="takes 2 arrays"):
        _core.copy(a)
    with pytest.raises(ValueError, match="one dtype and size"):
        _core.copy(a, b)
    with pytest.raises(ValueError, match="one dtype and size"):
        _core.copy(a, b, True)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(8, np.float32)
        ro.flags.writeable = False
        _core.copy(a, ro)
    with pytest.raises(TypeError, match="float32 or float64"):
        _core.triad(*(np.zeros(8, np.int32) for _ in range(3)))
