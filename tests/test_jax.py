# Tests for the JAX adapter (rmsnorm.jax) against the plain jnp formula: forward, jit, grad,
# vmap (shared and per-example weights, nested), every dtype, and the error paths.
import functools
import importlib
import sys

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

# Imported after the skip check; an ImportError here with jax installed is a real failure.
rj = importlib.import_module("rmsnorm.jax")

# (rtol, atol) against the jnp formula at the same dtype.
TOLERANCES = {
    np.dtype(np.float64): (1e-10, 1e-12),
    np.dtype(np.float32): (2e-5, 2e-5),
    np.dtype(ml_dtypes.bfloat16): (3e-2, 3e-2),
    np.dtype(np.float16): (4e-3, 4e-3),
}
# (id, x shape, weight shape or None, offset)
CASES = [
    ("rows", (5, 33), (33,), 0.0),
    ("offset", (4, 17), (17,), 1.0),
    ("2d_weight", (2, 3, 4, 8), (4, 8), 0.0),
    ("no_weight", (6, 16), None, 0.0),
    ("1d", (40,), (40,), 0.5),
]


@pytest.fixture
def x64():
    """float64 tests need JAX's x64 mode, only for their own duration."""
    if hasattr(jax, "enable_x64"):
        context = jax.enable_x64(True)
    else:  # older JAX
        from jax.experimental import enable_x64

        context = enable_x64()
    with context:
        yield


# Jitted: one compilation costs much less than compiling each eager jnp op.
@functools.partial(jax.jit, static_argnums=(2, 3))
def reference(x, weight, eps=1e-6, offset=0.0):
    """The plain jnp formula, computed in float32 (float64 for float64 x)."""
    compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    axes = tuple(range(x.ndim - (1 if weight is None else weight.ndim), x.ndim))
    xf = x.astype(compute)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axes, keepdims=True) + eps)
    if weight is not None:
        y = y * (offset + weight.astype(compute))
    return y.astype(x.dtype)


def assert_close(actual, expected):
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    rtol, atol = TOLERANCES[np.dtype(expected.dtype)]
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=rtol, atol=atol
    )


def random(shape, dtype, seed, scale=1.0, center=0.0):
    values = center + scale * np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(values.astype(dtype))


def loss(fn, offset):
    """A scalar whose gradient exercises a non-trivial upstream dy."""

    def f(x, weight, dy):
        return jnp.sum(fn(x, weight, 1e-6, offset).astype(jnp.float32) * dy)

    return f


def inputs(case, dtype):
    _, shape, weight_shape, offset = case
    x = random(shape, dtype, 0)
    weight = None if weight_shape is None else random(weight_shape, dtype, 1, 0.5, 1.0)
    dy = random(shape, np.float32, 2)
    return x, weight, dy, offset


def check_against_reference(case, dtype):
    x, weight, dy, offset = inputs(case, dtype)
    expected = reference(x, weight, 1e-6, offset)
    assert_close(rj.rms_norm(x, weight, 1e-6, offset), expected)
    jitted = jax.jit(rj.rms_norm, static_argnums=(2, 3))
    assert_close(jitted(x, weight, 1e-6, offset), expected)
    argnums = (0,) if weight is None else (0, 1)
    ours = jax.grad(loss(rj.rms_norm, offset), argnums)(x, weight, dy)
    theirs = jax.jit(jax.grad(loss(reference, offset), argnums))(x, weight, dy)
    for got, want in zip(ours, theirs, strict=True):
        assert_close(got, want)


@pytest.mark.parametrize(
    "dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["f32", "bf16", "f16"]
)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, dtype):
    check_against_reference(case, dtype)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_float64(case, x64):
    check_against_reference(case, np.float64)
    x = random(case[1], np.float64, 0)
    assert rj.rms_norm(x, None).dtype == jnp.float64


@pytest.mark.parametrize("shape", [(3, 70001), (4099, 64)], ids=["long_rows", "short_rows"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_inputs_split_across_threads(shape, dtype):
    """Inputs large enough for the kernels to split them across the threads of XLA's pool,
    rows shared by several threads included: checked against the float64 oracle."""
    import oracle

    rng = np.random.default_rng(0)
    x = oracle.make_x(rng, shape, dtype)
    weight = oracle.make_gamma(rng, (shape[1],), dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    y, back = jax.vjp(jax.jit(lambda x, w: rj.rms_norm(x, w)), jnp.asarray(x), jnp.asarray(weight))
    dx, dweight = back(jnp.asarray(dy))
    y64, _, r64, _ = oracle.forward(x, weight)
    oracle.assert_y_close(np.asarray(y), y64, 1, np.dtype(dtype))
    dx64, dw64, scale, dw_abs = oracle.backward(dy, x, weight, oracle.round_to(r64, np.float32))
    oracle.assert_dx_close(np.asarray(dx), dx64, scale, np.dtype(dtype))
    oracle.assert_dgamma_close(np.asarray(dweight), dw64, dw_abs, np.dtype(dtype), np.dtype(dtype))


@pytest.mark.parametrize("shape", [(1, 4099), (3, 4099), (1, 7), (64, 256)], ids=str)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "f16"])
def test_sixteen_bit_weight_gives_the_direct_calls_bits(shape, dtype):
    """A 16-bit x with a weight of its dtype: the forward and backward under jax.jit give the
    bits of rmsnorm's own calls, whichever way the weight reaches the kernels (as it is for a few
    rows, widened first for many) and however dgamma is rounded (by the kernels for one row).
    Small enough to stay on one thread on both sides."""
    import rmsnorm

    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(dtype)
    weight = rng.uniform(0.5, 1.5, shape[-1]).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    y, back = jax.vjp(jax.jit(lambda x, w: rj.rms_norm(x, w)), jnp.asarray(x), jnp.asarray(weight))
    dx, dweight = back(jnp.asarray(dy))
    y0, rstd = rmsnorm.rms_norm(x, weight)
    dx0, dweight0 = rmsnorm.rms_norm_backward(dy, x, weight, rstd)
    for got, want in ((y, y0), (dx, dx0), (dweight, dweight0)):
        got = np.asarray(got)
        assert got.dtype == want.dtype
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_mixed_dtypes():
    x = random((3, 16), ml_dtypes.bfloat16, 0)
    weight = random((16,), np.float32, 1, 0.5, 1.0)
    dy = random((3, 16), np.float32, 2)
    assert_close(rj.rms_norm(x, weight), reference(x, weight))
    dx, dweight = jax.grad(loss(rj.rms_norm, 0.0), (0, 1))(x, weight, dy)
    ref_dx, ref_dweight = jax.grad(loss(reference, 0.0), (0, 1))(x, weight, dy)
    assert dweight.dtype == jnp.float32
    assert_close(dx, ref_dx)
    assert_close(dweight, ref_dweight)


def check_weight_dtype(x_dtype, w_dtype):
    x = random((5, 48), x_dtype, 0)
    weight = random((48,), w_dtype, 1, 0.5, 1.0)
    dy = random((5, 48), np.float32, 2)
    for offset in (0.0, 1.0):
        assert_close(
            jax.jit(rj.rms_norm, static_argnums=(2, 3))(x, weight, 1e-6, offset),
            reference(x, weight, 1e-6, offset),
        )
        ours = jax.jit(jax.grad(loss(rj.rms_norm, offset), (0, 1)))(x, weight, dy)
        theirs = jax.jit(jax.grad(loss(reference, offset), (0, 1)))(x, weight, dy)
        assert ours[1].dtype == weight.dtype
        for got, want in zip(ours, theirs, strict=True):
            assert_close(got, want)


@pytest.mark.parametrize(
    "x_dtype, w_dtype",
    [(np.float32, ml_dtypes.bfloat16), (np.float32, np.float16), (ml_dtypes.bfloat16, np.float16)],
    ids=["f32-bf16", "f32-f16", "bf16-f16"],
)
def test_weight_of_another_dtype(x_dtype, w_dtype):
    """A 16-bit weight goes to the kernels as it is (widened, with the offset, in C), and its
    gradient comes back in its own dtype."""
    check_weight_dtype(x_dtype, w_dtype)


def test_float32_weight_with_float64_x(x64):
    check_weight_dtype(np.float64, np.float32)


def test_vmap_shared_and_per_example_weights():
    x = random((4, 3, 8), np.float32, 0)
    weights = random((4, 8), np.float32, 1, 0.5, 1.0)
    shared = jax.vmap(rj.rms_norm, in_axes=(0, None))(x, weights[0])
    assert_close(shared, reference(x, weights[0]))
    per_example = jax.jit(jax.vmap(rj.rms_norm))(x, weights)
    assert_close(per_example, jax.vmap(reference)(x, weights))
    # weight batched, x not; and a nested vmap over a batch axis that is not the first
    assert_close(
        jax.vmap(rj.rms_norm, in_axes=(None, 0))(x[0], weights),
        jax.vmap(reference, in_axes=(None, 0))(x[0], weights),
    )
    nested = jax.vmap(jax.vmap(rj.rms_norm, in_axes=(0, None)), in_axes=(1, None))(x, weights[0])
    assert_close(nested, jnp.swapaxes(reference(x, weights[0]), 0, 1))
    assert_close(jax.vmap(rj.rms_norm, in_axes=(0, None))(x, None), reference(x, None))


def test_vmap_of_grad_gives_per_example_gradients():
    x = random((4, 3, 8), np.float32, 0)
    weight = random((8,), np.float32, 1, 0.5, 1.0)
    dy = random((4, 3, 8), np.float32, 2)
    per_example = jax.vmap(jax.grad(loss(rj.rms_norm, 0.5), (0, 1)), in_axes=(0, None, 0))
    ours = jax.jit(per_example)(x, weight, dy)
    theirs = jax.vmap(jax.grad(loss(reference, 0.5), (0, 1)), in_axes=(0, None, 0))(x, weight, dy)
    assert ours[1].shape == (4, 8)
    for got, want in zip(ours, theirs, strict=True):
        assert_close(got, want)


def test_grad_of_vmap():
    x = random((4, 3, 8), np.float32, 0)
    weight = random((8,), np.float32, 1, 0.5, 1.0)
    dy = random((4, 3, 8), np.float32, 2)

    def batched(fn):
        return lambda x, w, dy: jnp.sum(jax.vmap(fn, in_axes=(0, None))(x, w) * dy)

    ours = jax.grad(batched(rj.rms_norm), (0, 1))(x, weight, dy)
    theirs = jax.grad(batched(reference), (0, 1))(x, weight, dy)
    for got, want in zip(ours, theirs, strict=True):
        assert_close(got, want)


def add_reference(x, residual, weight, eps=1e-6, offset=0.0):
    """h = x + residual (added in the compute type, rounded to x's dtype), then the formula."""
    compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    h = (x.astype(compute) + residual.astype(compute)).astype(x.dtype)
    return reference(h, weight, eps, offset), h


@pytest.mark.parametrize(
    "dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["f32", "bf16", "f16"]
)
def test_add_rms_norm_matches_reference(dtype):
    """y and h, jitted, and the gradients of both outputs reaching x, residual and weight."""
    x = random((4, 3, 40), dtype, 0)
    residual = random((4, 3, 40), dtype, 3)
    weight = random((40,), dtype, 1, 0.5, 1.0)
    dy, dh = random((4, 3, 40), np.float32, 2), random((4, 3, 40), np.float32, 4)
    for got, want in zip(
        jax.jit(rj.add_rms_norm)(x, residual, weight), add_reference(x, residual, weight)
    ):
        assert_close(got, want)

    def add_loss(fn):
        def f(x, residual, weight):
            y, h = fn(x, residual, weight, 1e-6, 0.5)
            return jnp.sum(y.astype(jnp.float32) * dy) + jnp.sum(h.astype(jnp.float32) * dh)

        return f

    ours = jax.jit(jax.grad(add_loss(rj.add_rms_norm), (0, 1, 2)))(x, residual, weight)
    theirs = jax.jit(jax.grad(add_loss(add_reference), (0, 1, 2)))(x, residual, weight)
    for got, want in zip(ours, theirs, strict=True):
        assert_close(got, want)


def test_add_rms_norm_errors():
    x = jnp.ones((3, 8))
    with pytest.raises(ValueError, match=r"\(3, 7\).*\(3, 8\)"):
        rj.add_rms_norm(x, jnp.ones((3, 7)))
    with pytest.raises(TypeError, match="bfloat16.*float32"):
        rj.add_rms_norm(x, jnp.ones((3, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\(7,\).*\(3, 8\)"):
        rj.add_rms_norm(x, x, jnp.ones(7))


def test_errors():
    x = jnp.ones((3, 8))
    with pytest.raises(TypeError, match="int32"):
        rj.rms_norm(jnp.ones((3, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"\(7,\).*\(3, 8\)"):
        rj.rms_norm(x, jnp.ones(7))
    with pytest.raises(ValueError, match="eps"):
        rj.rms_norm(x, eps=-1.0)
    with pytest.raises(ValueError, match="no elements"):
        rj.rms_norm(jnp.ones((3, 0)))
    with pytest.raises(TypeError, match="eps"):
        jax.jit(rj.rms_norm)(x, None, 1e-6)  # a traced eps cannot reach the kernel


def test_missing_jax_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)
    monkeypatch.delitem(sys.modules, "rmsnorm.jax")
    with pytest.raises(ImportError, match=r"pip install rmsnorm\[jax\]"):
        __import__("rmsnorm.jax")


def test_ffi_backend_is_used_where_it_can_be_built():
    """With a C compiler at hand the adapter runs the kernels as XLA FFI custom calls (CI runs
    this file once more with RMSNORM_JAX_FFI=0 for the pure_callback backend)."""
    import os

    if os.environ.get("RMSNORM_JAX_FFI") == "0":
        assert rj.BACKEND == "callback"
        return
    try:
        importlib.import_module("rmsnorm._jax_build").compiler()
    except FileNotFoundError:
        pytest.skip("no C compiler: the pure_callback backend is in use")
    assert rj.BACKEND == "ffi", rj.FFI_ERROR


def test_ffi_custom_calls_are_what_the_cpu_compiles():
    """Where XLA compiles for the CPU, the jitted forward and gradient are the FFI custom calls
    (the host callback is only the fallback for arrays on other devices)."""
    if rj.BACKEND != "ffi":
        pytest.skip("the pure_callback backend is in use")
    x, weight, dy, offset = inputs(CASES[0], np.float32)
    cpu = jax.devices("cpu")[0]
    x, weight, dy = (jax.device_put(a, cpu) for a in (x, weight, dy))
    grad = jax.jit(jax.grad(loss(rj.rms_norm, offset), (0, 1)))
    text = grad.trace(x, weight, dy).lower(lowering_platforms=("cpu",)).as_text()
    assert "rmsnorm_forward" in text and "rmsnorm_backward" in text
    assert "callback" not in text


@pytest.mark.skipif(
    jax.default_backend() == "cpu", reason="JAX's default device is the CPU (no GPU/TPU JAX)"
)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_arrays_on_another_device_go_through_the_host(dtype):
    """With a GPU JAX, arrays live on the GPU, where no FFI handler is registered: the adapter
    copies them through the host and runs the same kernels there, jitted and under grad."""
    case = CASES[0]
    x, weight, dy, offset = inputs(case, dtype)
    assert x.devices() == {jax.devices()[0]}
    expected = reference(x, weight, 1e-6, offset)
    jitted = jax.jit(rj.rms_norm, static_argnums=(2, 3))
    assert_close(jitted(x, weight, 1e-6, offset), expected)
    ours = jax.jit(jax.grad(loss(rj.rms_norm, offset), (0, 1)))(x, weight, dy)
    theirs = jax.jit(jax.grad(loss(reference, offset), (0, 1)))(x, weight, dy)
    for got, want in zip(ours, theirs, strict=True):
        assert_close(got, want)


REUSE_PROBE = """
import ctypes, threading, numpy as np, rmsnorm.jax as rj
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
def mmapped():
    return libc.mallinfo2().hblkhd
big = 64 << 20
before = mmapped(); a = np.empty(big, np.uint8); by_default = mmapped() - before; del a
took = rj.reuse_large_buffers()
before = mmapped(); a = np.empty(big, np.uint8); with_reuse = mmapped() - before
held = []
worker = threading.Thread(target=lambda: held.append(np.empty(big, np.uint8)))
before = mmapped(); worker.start(); worker.join(); from_thread = mmapped() - before
print(took, by_default, with_reuse, from_thread)
"""


def test_reuse_large_buffers_serves_large_blocks_from_the_heap():
    """By default glibc maps a 64 MiB block on its own (fresh pages every time); after
    reuse_large_buffers() it comes from the heap, whose freed memory stays mapped, also when
    another thread allocates it (as XLA's workers do)."""
    import ctypes
    import subprocess

    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("not glibc >= 2.33 (no mallinfo2)")
    out = subprocess.run(
        [sys.executable, "-c", REUSE_PROBE], capture_output=True, text=True, check=True
    ).stdout.split()
    took, by_default, with_reuse, from_thread = out[0], int(out[1]), int(out[2]), int(out[3])
    assert took == "True"
    assert by_default >= 64 << 20
    assert with_reuse == 0
    assert from_thread == 0


def test_reuse_large_buffers_rejects_a_negative_limit():
    with pytest.raises(ValueError, match="limit"):
        rj.reuse_large_buffers(-1)
