# Tests for the PyTorch adapter (rmsnorm.torch) against torch's own RMSNorm: forward, gradients,
# gradcheck, torch's OpInfo sample inputs, the nn.Module contract and the error paths.
import importlib
import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
# Imported after the skip check; an ImportError here with torch installed is a real failure.
rt = importlib.import_module("rmsnorm.torch")

import oracle  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
DTYPE_IDS = ["f32", "f64", "bf16", "f16"]
# (rtol, atol) against torch at the same dtype: a few units in the last place of the dtype.
TOLERANCES = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (4e-3, 4e-3),
}
# (id, x shape, normalized_shape, with weight, offset, make x non-contiguous)
CASES = [
    ("rows", (5, 33), (33,), True, 0.0, False),
    ("offset", (4, 17), (17,), True, 1.0, False),
    ("2d_weight", (2, 3, 4, 8), (4, 8), True, 0.0, False),
    ("no_weight", (6, 16), (16,), False, 0.0, False),
    ("no_weight_2d", (3, 5, 7), (5, 7), False, 0.0, False),
    ("transposed", (2, 9, 5), (5,), True, 0.5, True),
    ("1d", (40,), (40,), True, 0.0, False),
    ("zero_rows", (0, 8), (8,), True, 0.0, False),
]


def assert_close(actual, expected, dtype):
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def make_x(shape, dtype, transposed=False, seed=0):
    """Random x of the given (logical) shape; a non-contiguous view when transposed."""
    gen = torch.Generator().manual_seed(seed)
    if transposed:
        base = torch.randn((*shape[:-2], shape[-1], shape[-2]), generator=gen, dtype=torch.float64)
        x = base.to(dtype).transpose(-1, -2)
        assert not x.is_contiguous()
    else:
        x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return x.requires_grad_()


def make_weight(shape, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (1 + 0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)


def forward_and_grads(fn, x, weight, dy):
    """y and the gradients of sum(y * dy) with respect to x and weight."""
    y = fn(x, weight)
    inputs = [x] if weight is None else [x, weight]
    grads = torch.autograd.grad(y, inputs, dy, allow_unused=True)
    return (y, *grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_torch(case, dtype):
    _, shape, norm_shape, with_weight, offset, transposed = case
    x = make_x(shape, dtype, transposed)
    weight = make_weight(norm_shape, dtype).requires_grad_() if with_weight else None
    dy = torch.randn(shape, dtype=torch.float64).to(dtype)

    def ours(x, weight):
        return rt.rms_norm(x, norm_shape, weight, 1e-6, offset=offset)

    def theirs(x, weight):
        return F.rms_norm(x, norm_shape, None if weight is None else offset + weight, 1e-6)

    for got, want in zip(
        forward_and_grads(ours, x, weight, dy),
        forward_and_grads(theirs, x, weight, dy),
        strict=True,
    ):
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        assert_close(got, want, dtype)


def test_gradcheck_float64():
    x = make_x((3, 2, 5), torch.float64, transposed=True)
    weight = make_weight((2, 5), torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, w: rt.rms_norm(a, (2, 5), w, 1e-5, offset=0.5), (x, weight)
    )
    assert torch.autograd.gradcheck(lambda a: rt.rms_norm(a, (5,), eps=1e-5), (x,))
    res = make_x((3, 2, 5), torch.float64, seed=4)
    assert torch.autograd.gradcheck(
        lambda a, r, w: rt.add_rms_norm(a, r, (2, 5), w, 1e-5, offset=0.5), (x, res, weight)
    )
    # The registered op's autograd (the path compile and export take) as well.
    assert torch.autograd.gradcheck(
        lambda a, w: torch.ops.rmsnorm.rms_norm(a, w, 1e-5, 0.5, "end")[0], (x, weight)
    )
    assert torch.autograd.gradcheck(
        lambda a, r, w: torch.ops.rmsnorm.add_rms_norm(a, r, w, 1e-5, 0.5, "end")[::2],
        (x, res, weight),
    )


def op_db_samples(dtype):
    from torch.testing._internal.common_methods_invocations import op_db

    (op,) = [o for o in op_db if o.name == "nn.functional.rms_norm"]
    return list(op.sample_inputs("cpu", dtype, requires_grad=True))


def unsupported_reason(sample):
    """Why our API cannot take this sample, or None when it can."""
    eps = sample.kwargs.get("eps")
    if eps is not None and eps < 0:
        # rmsnorm.rms_norm rejects a negative eps (ValueError); torch computes with it.
        return "negative eps"
    if not tuple(sample.args[0]):
        return "empty normalized_shape"  # no normalized axes; torch refuses it too
    return None


def compare_sample(sample, dtype):
    """Our functional against torch's on one OpInfo sample: y and both gradients."""
    norm_shape, *rest = sample.args
    weight = rest[0] if rest else None
    dy = torch.randn(sample.input.shape, dtype=torch.float64).to(dtype)

    def ours(x, w):
        return rt.rms_norm(x, norm_shape, w, **sample.kwargs)

    def theirs(x, w):
        return F.rms_norm(x, norm_shape, w, **sample.kwargs)

    got = forward_and_grads(ours, sample.input, weight, dy)
    want = forward_and_grads(theirs, sample.input, weight, dy)
    for actual, expected in zip(got, want, strict=True):
        assert_close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_torch_op_db_samples(dtype):
    pytest.importorskip("expecttest")  # torch.testing._internal imports it
    supported = [s for s in op_db_samples(dtype) if unsupported_reason(s) is None]
    assert len(supported) >= 3
    for sample in supported:
        compare_sample(sample, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_default_eps_like_torch(dtype):
    # eps=None: torch uses the machine epsilon of the compute type; tiny rows show it.
    x = 1e-4 * make_x((4, 8), dtype).detach()
    assert_close(rt.rms_norm(x, (8,)), F.rms_norm(x, (8,)), dtype)
    assert_close(rt.RMSNorm(8, eps=None)(x), torch.nn.RMSNorm(8, dtype=dtype)(x), dtype)


def test_mixed_dtypes_like_torch():
    x = make_x((3, 16), torch.bfloat16)
    weight = make_weight((16,), torch.float32).requires_grad_()
    dy = torch.randn(3, 16).to(torch.bfloat16)
    with pytest.warns(
        UserWarning, match="[Mm]ismatch dtype"
    ):  # torch's fallback for mixed dtypes warns
        theirs = forward_and_grads(lambda a, w: F.rms_norm(a, (16,), w, 1e-6), x, weight, dy)
    ours = forward_and_grads(lambda a, w: rt.rms_norm(a, (16,), w, 1e-6), x, weight, dy)
    for got, want in zip(ours, theirs, strict=True):
        assert got.dtype == want.dtype
        assert_close(got.double(), want.double(), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_numpy_views_share_memory(dtype):
    views = importlib.import_module("rmsnorm._torch_ops")
    for x in (make_x((4, 6), dtype, transposed=True).detach(), make_x((3, 5), dtype).detach()):
        view = views.to_numpy(x)
        assert view.__array_interface__["data"][0] == x.data_ptr()
        assert view.strides == tuple(s * x.element_size() for s in x.stride())
        back = views.from_numpy(view)
        assert back.dtype == dtype
        assert back.data_ptr() == x.data_ptr()
        assert torch.equal(back, x)


def test_expanded_upstream_gradient():
    # y.sum().backward() hands backward a zero-stride dy.
    x = make_x((3, 8), torch.float32)
    layer = rt.RMSNorm(8)
    layer(x).sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    ref = torch.nn.RMSNorm(8, eps=1e-6)
    ref(ref_x).sum().backward()
    assert_close(x.grad, ref_x.grad, torch.float32)
    assert_close(layer.weight.grad, ref.weight.grad, torch.float32)


def test_inputs_unmodified_and_no_grad():
    x = make_x((4, 8), torch.float32).detach()
    weight = make_weight((8,), torch.float32)
    x_before, weight_before = x.clone(), weight.clone()
    with torch.no_grad():
        y = rt.rms_norm(x, (8,), weight)
    assert not y.requires_grad
    assert torch.equal(x, x_before)
    assert torch.equal(weight, weight_before)
    with torch.inference_mode():
        assert_close(rt.rms_norm(x, (8,), weight), y, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paths_with_and_without_autograd_agree(case, dtype):
    """With no gradient to track (no_grad, or no input requiring one) the kernel runs without
    the autograd Function; its y is bit-identical to the Function's, which runs otherwise."""
    _, shape, normalized, affine, offset, transposed = case
    x = make_x(shape, dtype, transposed).detach()
    weight = make_weight(normalized, dtype) if affine else None
    tracked = rt.rms_norm(x.clone().requires_grad_(), normalized, weight, 1e-6, offset=offset)
    assert tracked.grad_fn is not None
    for context in (torch.no_grad, torch.enable_grad):
        with context():
            plain = rt.rms_norm(x, normalized, weight, 1e-6, offset=offset)
        assert plain.grad_fn is None and not plain.requires_grad
        assert plain.dtype == dtype and plain.shape == x.shape
        assert torch.equal(plain, tracked.detach())
    with torch.no_grad():
        y = rt.rms_norm(x.clone().requires_grad_(), normalized, weight, 1e-6, offset=offset)
        assert y.grad_fn is None


def _np(t):
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).clone().numpy().view(ml_dtypes.bfloat16)
    return t.clone().numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cast", ["end", "before_weight"])
def test_cast_and_fused_add_against_oracle(dtype, cast):
    """rms_norm, add_rms_norm and RMSNorm with offset and cast: values and gradients against
    the float64 oracle (the rounding of x * rstd for cast="before_weight" is the package's)."""
    x = make_x((4, 3, 24), dtype, transposed=True)
    res = make_x((4, 3, 24), dtype, seed=5)
    weight = make_weight((24,), dtype).requires_grad_()
    dy = make_x((4, 3, 24), dtype, seed=6).detach()
    dh = make_x((4, 3, 24), dtype, seed=7).detach()
    xn, rn, wn, dyn, dhn = (_np(t) for t in (x, res, weight, dy, dh))

    layer = rt.RMSNorm(24, eps=1e-5, offset=0.5, cast=cast, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
    rstd = torch.ops.rmsnorm.rms_norm(x, weight, 1e-5, 0.5, cast)[1]
    y_f64 = oracle.forward(xn, wn, 1e-5, 0.5, cast, rstd=_np(rstd))[0]
    dx_f64, dw_f64, scale, dw_abs = oracle.backward(dyn, xn, wn, _np(rstd), 0.5)
    for y, w in (
        (rt.rms_norm(x, 24, weight, 1e-5, offset=0.5, cast=cast), weight),
        (layer(x), layer.weight),
    ):
        oracle.assert_y_close(_np(y), y_f64, 2)
        dx, dw = torch.autograd.grad(y, [x, w], dy)
        oracle.assert_dx_close(_np(dx), dx_f64, scale, xn.dtype)
        oracle.assert_dgamma_close(_np(dw), dw_f64, dw_abs, wn.dtype, xn.dtype)

    y, h = rt.add_rms_norm(x, res, 24, weight, 1e-5, offset=0.5, cast=cast)
    h_ref = oracle.add(xn, rn)
    np.testing.assert_array_equal(_np(h), h_ref)
    rstd = torch.ops.rmsnorm.rms_norm(h, weight, 1e-5, 0.5, cast)[1]
    oracle.assert_y_close(_np(y), oracle.forward(h_ref, wn, 1e-5, 0.5, cast, rstd=_np(rstd))[0], 2)
    dx, dr, dw = torch.autograd.grad([y, h], [x, res, weight], [dy, dh])
    dx_f64, dw_f64, scale, dw_abs = oracle.backward(dyn, h_ref, wn, _np(rstd), 0.5)
    # x and residual both receive dL/dh: the norm's dx, rounded to x's dtype, plus the gradient
    # reaching h directly, the sum rounded again (as torch sums gradients): one more ulp of the
    # norm's dx for 16-bit dtypes (the scale term is multiplied by 1e-5 in assert_dx_close).
    dhf = oracle.as_f64(dhn)
    scale = scale + np.abs(dhf)
    if xn.dtype in oracle.SIXTEEN:
        scale = scale + oracle.spacing16(dx_f64, xn.dtype) / 1e-5
    for got in (dx, dr):
        oracle.assert_dx_close(_np(got), dx_f64 + dhf, scale, xn.dtype)
    oracle.assert_dgamma_close(_np(dw), dw_f64, dw_abs, wn.dtype, xn.dtype)


# --- the nn.Module contract ------------------------------------------------------------------


@pytest.mark.parametrize("affine", [True, False])
def test_module_state_dict_matches_torch(affine):
    ours = rt.RMSNorm((4, 8), elementwise_affine=affine)
    theirs = torch.nn.RMSNorm((4, 8), eps=1e-6, elementwise_affine=affine)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert len(list(ours.parameters())) == (1 if affine else 0)
    if affine:
        with torch.no_grad():
            theirs.weight.uniform_(0.5, 1.5)
        ours.load_state_dict(theirs.state_dict())
    x = make_x((2, 4, 8), torch.float32).detach()
    assert_close(ours(x), theirs(x), torch.float32)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_module_follows_every_change_of_its_weight(grad):
    """The module keeps its weight's NumPy view between calls: every way of changing the weight
    (in place, new storage through .data, a new Parameter of another dtype, a strided view)
    must show in the next result, checked against the float64 oracle."""
    m = rt.RMSNorm(64)
    x = make_x((3, 64), torch.float32).detach().requires_grad_(grad)

    def check():
        y = m(x)
        w = m.weight.detach()
        y64 = oracle.forward(x.detach().numpy(), w.double().numpy(), 1e-6)[0]
        oracle.assert_y_close(y.detach().numpy(), y64, 1)

    check()
    with torch.no_grad():
        m.weight.mul_(2.5)  # same storage, new values
    check()
    m.weight.data = torch.linspace(0.5, 1.5, 64)  # new storage
    check()
    m.weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 64, dtype=torch.float64))
    check()
    m.weight = torch.nn.Parameter(torch.linspace(1.0, 2.0, 128)[::2])  # strided
    check()


def test_module_init_reset_and_repr():
    layer = rt.RMSNorm([3, 4], dtype=torch.float64)
    assert layer.weight.shape == (3, 4)
    assert layer.weight.dtype == torch.float64
    assert torch.equal(layer.weight, torch.ones(3, 4, dtype=torch.float64))
    gemma = rt.RMSNorm(4, offset=1.0)
    assert torch.equal(gemma.weight, torch.zeros(4))
    with torch.no_grad():
        gemma.weight.fill_(3.0)
    gemma.reset_parameters()
    assert torch.equal(gemma.weight, torch.zeros(4))
    assert repr(rt.RMSNorm(8)) == "RMSNorm((8,), eps=1e-06, elementwise_affine=True)"
    assert "offset=1.0" in repr(gemma)
    x = make_x((2, 4), torch.float32).detach()
    assert_close(gemma(x), F.rms_norm(x, (4,), torch.ones(4), 1e-6), torch.float32)


def test_module_on_meta_device_gives_shapes():
    # Meta tensors (deferred initialisation, shape inference) take the fake kernel.
    layer = rt.RMSNorm(8, device="meta", dtype=torch.bfloat16)
    assert layer.weight.device.type == "meta"
    y = layer(torch.ones(2, 8, device="meta", dtype=torch.bfloat16))
    assert y.device.type == "meta" and y.shape == (2, 8) and y.dtype == torch.bfloat16


# --- errors ----------------------------------------------------------------------------------


def test_errors():
    x = torch.ones(3, 8)
    with pytest.raises(TypeError, match="int32"):
        rt.rms_norm(torch.ones(3, 8, dtype=torch.int32), (8,))
    with pytest.raises(ValueError, match=r"\(7,\)"):
        rt.rms_norm(x, (7,))
    with pytest.raises(ValueError, match=r"\(7,\)"):
        rt.rms_norm(x, (8,), torch.ones(7))
    with pytest.raises(ValueError, match="normalized_shape"):
        rt.rms_norm(x, ())
    with pytest.raises(ValueError, match="eps"):
        rt.rms_norm(x, (8,), eps=-1.0)
    with pytest.raises(ValueError, match="cast"):
        rt.rms_norm(x, (8,), cast="start")
    with pytest.raises(ValueError, match="cast"):
        rt.RMSNorm(8, cast="start")
    with pytest.raises(TypeError, match="complex64"):
        rt.rms_norm(x.to(torch.complex64), (8,))
    with pytest.raises(TypeError, match="int64"):
        rt.RMSNorm(8)(torch.ones(3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="one device.*weight on meta"):
        rt.rms_norm(x, (8,), torch.ones(8, device="meta"))
    with pytest.raises(ValueError, match=r"residual of shape \(3, 7\)"):
        rt.add_rms_norm(x, torch.ones(3, 7), (8,))


def test_missing_torch_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "rmsnorm.torch")
    with pytest.raises(ImportError, match=r"pip install rmsnorm\[torch\]"):
        __import__("rmsnorm.torch")


def test_core_package_does_not_import_adapters():
    code = (
        "import sys, rmsnorm; "
        "bad = {'torch', 'jax', 'rmsnorm.torch', 'rmsnorm.jax'} & set(sys.modules); "
        "assert not bad, bad"
    )
    package_root = pathlib.Path(rt.__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], check=True, cwd=package_root)


def test_adapter_imports_the_real_torch():
    assert rt.torch is torch


def test_saved_tensor_hooks_and_checkpoint():
    """Under saved-tensor hooks (activation checkpointing, offloading) the backward rebuilds
    its inputs from what the hooks return; the gradients are unchanged."""
    x = make_x((4, 3, 16), torch.float32, seed=8)
    res = make_x((4, 3, 16), torch.float32, seed=9)
    layer = rt.RMSNorm(16, cast="before_weight")
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)

    def loss():
        y, h = rt.add_rms_norm(x, res, 16, layer.weight)
        return (layer(y) * h).sum()

    want = torch.autograd.grad(loss(), [x, res, layer.weight])
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: packed.append(1) or t.clone(), lambda t: t
    ):
        got = torch.autograd.grad(loss(), [x, res, layer.weight])
    assert packed
    checkpointed = torch.utils.checkpoint.checkpoint(loss, use_reentrant=False)
    got_ckpt = torch.autograd.grad(checkpointed, [x, res, layer.weight])
    for a, b, c in zip(got, got_ckpt, want, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_modifying_a_saved_input_in_place_is_caught():
    x = make_x((3, 8), torch.float32)
    a = x * 1.0
    y = rt.rms_norm(a, 8, torch.ones(8, requires_grad=True))
    a.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
