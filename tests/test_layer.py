"""The RMSNorm layer: weight init, forward/backward against the functions and the oracle,
weight_grad accumulation and zero_grad, offset=1 (Gemma), multi-dim normalized_shape,
backward before forward."""

import numpy as np
import oracle
import pytest
from oracle import ALL_DTYPES, BF16, F32, F64, dtype_id

import rmsnorm


@pytest.mark.parametrize("wdtype", (F32, F64, BF16), ids=dtype_id)
@pytest.mark.parametrize("shape", (8, (8,), (3, 4)), ids=repr)
def test_weight_init(shape, wdtype):
    layer = rmsnorm.RMSNorm(shape, dtype=wdtype)
    expected_shape = (shape,) if isinstance(shape, int) else shape
    assert layer.weight.shape == expected_shape and layer.weight.dtype == wdtype
    assert np.all(oracle.as_f64(layer.weight) == 1.0)
    gemma = rmsnorm.RMSNorm(shape, offset=1.0, dtype=wdtype)
    assert gemma.weight.shape == expected_shape and gemma.weight.dtype == wdtype
    assert np.all(oracle.as_f64(gemma.weight) == 0.0)


def test_default_dtype_is_float32():
    assert rmsnorm.RMSNorm(5).weight.dtype == F32


@pytest.mark.parametrize("offset", (0.0, 1.0))
@pytest.mark.parametrize("nshape, xshape", [((16,), (4, 16)), ((3, 5), (2, 4, 3, 5)),
                                            (7, (7,))], ids=("1d", "2d", "single_row"))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_forward_backward_match_functions(dtype, nshape, xshape, offset, rng):
    layer = rmsnorm.RMSNorm(nshape, eps=1e-5, offset=offset)
    layer.weight[...] = rng.uniform(-0.5, 1.5, layer.weight.shape)
    x = oracle.make_x(rng, xshape, dtype)
    dy = oracle.make_x(rng, xshape, dtype, spread=False)

    y = layer(x)
    y_ref, rstd = rmsnorm.rms_norm(x, layer.weight, 1e-5, offset=offset)
    assert oracle.bits_equal(y, y_ref)
    gnd = layer.weight.ndim
    y64, _, _, _ = oracle.forward(x, layer.weight, 1e-5, offset)
    oracle.assert_y_close(y, y64, x.ndim - gnd, dtype)

    dx = layer.backward(dy)
    dx_ref, dg_ref = rmsnorm.rms_norm_backward(dy, x, layer.weight, rstd, offset=offset)
    assert oracle.bits_equal(dx, dx_ref)
    assert layer.weight_grad.shape == layer.weight.shape
    assert layer.weight_grad.dtype == layer.weight.dtype
    np.testing.assert_array_equal(layer.weight_grad, dg_ref)
    dx64, dg64, scale, dg_abs = oracle.backward(dy, x, layer.weight, rstd, offset=offset)
    oracle.assert_dx_close(dx, dx64, scale, dtype)
    oracle.assert_dgamma_close(layer.weight_grad, dg64, dg_abs, F32, dtype)


def test_forward_method_equals_call(rng):
    layer = rmsnorm.RMSNorm(10)
    x = rng.standard_normal((3, 10)).astype(F32)
    assert oracle.bits_equal(layer(x), layer.forward(x))


@pytest.mark.parametrize("wdtype", (F32, F64), ids=dtype_id)
def test_weight_grad_accumulates_and_zero_grad(wdtype, rng):
    layer = rmsnorm.RMSNorm((3, 6), dtype=wdtype)
    layer.weight[...] = rng.uniform(0.5, 1.5, (3, 6))
    x1 = rng.standard_normal((5, 3, 6)).astype(F32)
    x2 = rng.standard_normal((2, 3, 6)).astype(F32)
    dy1 = rng.standard_normal(x1.shape).astype(F32)
    dy2 = rng.standard_normal(x2.shape).astype(F32)

    layer(x1)
    layer.backward(dy1)
    g1 = layer.weight_grad.copy()
    layer(x2)
    layer.backward(dy2)
    _, r1 = rmsnorm.rms_norm(x1, layer.weight)
    _, r2 = rmsnorm.rms_norm(x2, layer.weight)
    d1 = rmsnorm.rms_norm_backward(dy1, x1, layer.weight, r1)[1]
    d2 = rmsnorm.rms_norm_backward(dy2, x2, layer.weight, r2)[1]
    np.testing.assert_array_equal(g1, d1)
    np.testing.assert_allclose(layer.weight_grad, d1 + d2, rtol=1e-6, atol=1e-6)
    assert not np.allclose(layer.weight_grad, d2)

    # two backward calls after one forward also accumulate
    layer.zero_grad()
    assert layer.weight_grad is None or not np.any(layer.weight_grad)
    layer(x1)
    layer.backward(dy1)
    layer.backward(dy1)
    np.testing.assert_allclose(layer.weight_grad, 2 * d1, rtol=1e-6, atol=1e-6)

    layer.zero_grad()
    layer(x2)
    dx = layer.backward(dy2)
    np.testing.assert_allclose(layer.weight_grad, d2, rtol=1e-6, atol=1e-6)
    assert dx.shape == x2.shape


def test_gemma_layer_equals_unit_weight(rng):
    """offset=1 with the zero init is exactly rms_norm with unit weight."""
    layer = rmsnorm.RMSNorm(33, offset=1.0)
    x = rng.standard_normal((4, 33)).astype(F32)
    y_ref, _ = rmsnorm.rms_norm(x, np.ones(33, F32))
    assert oracle.bits_equal(layer(x), y_ref)


def test_cast_before_weight_layer(rng):
    layer = rmsnorm.RMSNorm(64, cast="before_weight")
    layer.weight[...] = rng.uniform(-3, 3, 64)
    x = oracle.make_x(rng, (8, 64), BF16)
    y_ref, _ = rmsnorm.rms_norm(x, layer.weight, cast="before_weight")
    assert oracle.bits_equal(layer(x), y_ref)


def test_backward_before_forward():
    layer = rmsnorm.RMSNorm(4)
    with pytest.raises(RuntimeError):
        layer.backward(np.ones((2, 4), F32))


def test_layer_shape_errors(rng):
    layer = rmsnorm.RMSNorm((3, 4))
    with pytest.raises(ValueError):
        layer(rng.standard_normal((2, 4, 3)).astype(F32))
    layer(rng.standard_normal((2, 3, 4)).astype(F32))
    with pytest.raises(ValueError):
        layer.backward(np.ones((2, 4, 3), F32))
