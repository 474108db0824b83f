# The torch.library ops torch.ops.rmsnorm.*: torch.library.opcheck (schema and mutation
# annotations, fake kernels, autograd registration, AOT dispatch) for every dtype, with and
# without weight, offset and cast; every op's values against the float64 oracle; the eager
# path, the dispatcher path and the NumPy API agree bit for bit; clear errors.
import importlib
import itertools

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
rt = importlib.import_module("rmsnorm.torch")

import oracle  # noqa: E402

import rmsnorm  # noqa: E402

OPS = torch.ops.rmsnorm
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
DTYPE_IDS = ["f32", "f64", "bf16", "f16"]
NP_DTYPE = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bfloat16: ml_dtypes.bfloat16,
    torch.float16: np.float16,
}
# weight: none, same dtype as x, float32 (mixed for 16-bit x: bfloat16 activations with float32
# weights); options: (offset, cast)
WEIGHTS = ["none", "same", "f32"]
OPTIONS = list(itertools.product([0.0, 0.5], ["end", "before_weight"]))
OPTION_IDS = [f"off{o}-{c}" for o, c in OPTIONS]
SHAPE = (3, 5, 16)


def to_np(t):
    """A NumPy copy of a tensor, bfloat16 as ml_dtypes.bfloat16 (test side, independent of the
    adapter's own views)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).clone().numpy().view(ml_dtypes.bfloat16)
    return t.clone().numpy()


def make(shape, dtype, seed, scale=1.0, shift=0.0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    t = (shift + scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
    return t.requires_grad_(requires_grad)


def make_weight(kind, dtype, requires_grad=False):
    if kind == "none":
        return None
    wdtype = dtype if kind == "same" else torch.float32
    return make(SHAPE[-1:], wdtype, 1, 0.5, 1.0, requires_grad)


def weight_cases(dtype):
    """f32 weights are a separate case only for 16-bit x."""
    return [w for w in WEIGHTS if not (w == "f32" and dtype in (torch.float32, torch.float64))]


def opcheck(op, args, kwargs=None):
    torch.library.opcheck(op, args, kwargs)


# --- opcheck ----------------------------------------------------------------------------------


@pytest.mark.parametrize("option", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_opcheck_rms_norm(dtype, option):
    offset, cast = option
    for kind in weight_cases(dtype):
        x = make(SHAPE, dtype, 0, requires_grad=True)
        w = make_weight(kind, dtype, requires_grad=True)
        opcheck(OPS.rms_norm.default, (x, w, 1e-6, offset, cast))
        out = torch.empty(SHAPE, dtype=dtype)
        opcheck(
            OPS.rms_norm.out,
            (x.detach(), w if w is None else w.detach(), 1e-6, offset, cast),
            {"out": out},
        )


@pytest.mark.parametrize("offset", [0.0, 0.5])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_opcheck_rms_norm_backward(dtype, offset):
    for kind in weight_cases(dtype):
        x = make(SHAPE, dtype, 0)
        w = make_weight(kind, dtype)
        _, rstd = OPS.rms_norm(x, w, 1e-6, offset)
        dy = make(SHAPE, dtype, 2)
        opcheck(OPS.rms_norm_backward.default, (dy, x, w, rstd, offset))


@pytest.mark.parametrize("option", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_opcheck_add_rms_norm(dtype, option):
    offset, cast = option
    for kind in weight_cases(dtype):
        x = make(SHAPE, dtype, 0, requires_grad=True)
        res = make(SHAPE, dtype, 3, requires_grad=True)
        w = make_weight(kind, dtype, requires_grad=True)
        opcheck(OPS.add_rms_norm.default, (x, res, w, 1e-6, offset, cast))
        xd, rd, wd = x.detach(), res.detach(), None if w is None else w.detach()
        outs = {"out": torch.empty_like(xd), "residual_out": torch.empty_like(xd)}
        opcheck(OPS.add_rms_norm.out, (xd, rd, wd, 1e-6, offset, cast), outs)
        opcheck(OPS.add_rms_norm.inplace, (xd.clone(), rd.clone(), wd, 1e-6, offset, cast))


def test_schemas_declare_mutations():
    def mutable(op):
        return [a.name for a in op._schema.arguments if a.alias_info and a.alias_info.is_write]

    assert mutable(OPS.rms_norm.default) == []
    assert mutable(OPS.rms_norm_backward.default) == []
    assert mutable(OPS.add_rms_norm.default) == []
    assert mutable(OPS.rms_norm.out) == ["out"]
    assert mutable(OPS.add_rms_norm.out) == ["out", "residual_out"]
    assert mutable(OPS.add_rms_norm.inplace) == ["x", "residual"]


# --- values against the float64 oracle ---------------------------------------------------------


@pytest.mark.parametrize("option", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_op_values_against_oracle(dtype, option):
    offset, cast = option
    for kind in weight_cases(dtype):
        x, res, dy = make(SHAPE, dtype, 0), make(SHAPE, dtype, 3), make(SHAPE, dtype, 2)
        w = make_weight(kind, dtype)
        xn, rn, dyn = to_np(x), to_np(res), to_np(dy)
        wn = None if w is None else to_np(w)

        y, rstd = OPS.rms_norm(x, w, 1e-6, offset, cast)
        y_f64, _, r_f64, _ = oracle.forward(xn, wn, 1e-6, offset, cast, rstd=to_np(rstd))
        oracle.assert_y_close(to_np(y), y_f64, 2)
        oracle.assert_rstd_close(to_np(rstd), r_f64, xn.dtype)

        dx, dw = OPS.rms_norm_backward(dy, x, w, rstd, offset)
        dx_f64, dw_f64, scale, dw_abs = oracle.backward(dyn, xn, wn, to_np(rstd), offset)
        oracle.assert_dx_close(to_np(dx), dx_f64, scale, xn.dtype)
        if w is None:
            assert dw is None
        else:
            oracle.assert_dgamma_close(to_np(dw), dw_f64, dw_abs, wn.dtype, xn.dtype)

        y, rstd, h = OPS.add_rms_norm(x, res, w, 1e-6, offset, cast)
        h_ref = oracle.add(xn, rn)
        np.testing.assert_array_equal(to_np(h), h_ref)
        y_f64 = oracle.forward(h_ref, wn, 1e-6, offset, cast, rstd=to_np(rstd))[0]
        oracle.assert_y_close(to_np(y), y_f64, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_out_and_inplace_overloads_write_their_outputs(dtype):
    x, res, w = make(SHAPE, dtype, 0), make(SHAPE, dtype, 3), make_weight("same", dtype)
    x_before, res_before, w_before = x.clone(), res.clone(), w.clone()
    y, rstd, h = OPS.add_rms_norm(x, res, w, 1e-6, 0.5, "before_weight")

    out = torch.full(SHAPE, 7.0, dtype=dtype)
    y1, rstd1 = OPS.rms_norm(x, w, 1e-6, 0.5, "before_weight")
    assert torch.equal(OPS.rms_norm(x, w, 1e-6, 0.5, "before_weight", out=out), rstd1)
    assert torch.equal(out, y1)

    out, res_out = torch.empty_like(x), torch.empty_like(x)
    got = OPS.add_rms_norm.out(x, res, w, 1e-6, 0.5, "before_weight", out=out, residual_out=res_out)
    assert torch.equal(got, rstd) and torch.equal(out, y) and torch.equal(res_out, h)
    for a, b in ((x, x_before), (res, res_before), (w, w_before)):
        assert torch.equal(a, b)  # the functional and out= calls leave their inputs alone

    xi, ri = x.clone(), res.clone()
    assert torch.equal(OPS.add_rms_norm.inplace(xi, ri, w, 1e-6, 0.5, "before_weight"), rstd)
    assert torch.equal(xi, y) and torch.equal(ri, h)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", WEIGHTS)
def test_eager_path_dispatcher_and_numpy_agree_bitwise(dtype, kind):
    """rt.rms_norm on plain tensors skips the dispatcher; the op (under a dispatch mode, which
    forces the dispatcher path) and the NumPy API give the same bits, gradients included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func)
            return func(*args, **(kwargs or {}))

    w = make_weight(kind, dtype)
    x = make(SHAPE, dtype, 0).transpose(0, 1)  # non-contiguous
    dy = make(x.shape, dtype, 2)
    res = make(x.shape, dtype, 3)
    ref_y, ref_rstd = rmsnorm.rms_norm(
        to_np(x), None if w is None else to_np(w), 1e-6, offset=0.5, cast="before_weight"
    )
    ref_dx, ref_dw = rmsnorm.rms_norm_backward(
        to_np(dy), to_np(x), None if w is None else to_np(w), ref_rstd, offset=0.5
    )
    ref_add = rmsnorm.add_rms_norm(
        to_np(x),
        to_np(res),
        None if w is None else to_np(w),
        1e-6,
        offset=0.5,
        cast="before_weight",
    )
    mode = Passthrough()
    mode.seen = set()
    for traced in (False, True):
        xg = x.detach().requires_grad_()
        wg = None if w is None else w.detach().requires_grad_()
        with mode if traced else torch.enable_grad():
            y = rt.rms_norm(xg, SHAPE[-1], wg, 1e-6, offset=0.5, cast="before_weight")
            grads = torch.autograd.grad(y, [t for t in (xg, wg) if t is not None], dy)
            y2, h = rt.add_rms_norm(x, res, SHAPE[-1], w, 1e-6, offset=0.5, cast="before_weight")
        np.testing.assert_array_equal(to_np(y), ref_y)
        np.testing.assert_array_equal(to_np(grads[0]), ref_dx)
        if w is not None:
            np.testing.assert_array_equal(to_np(grads[1]), ref_dw)
        np.testing.assert_array_equal(to_np(y2), ref_add[0])
        np.testing.assert_array_equal(to_np(h), ref_add[2])
    assert {OPS.rms_norm.default, OPS.rms_norm_backward.default, OPS.add_rms_norm.default} <= (
        mode.seen
    )


def test_input_storages_stay_resizable():
    # FSDP2 frees the storage of unsharded parameters after use; Tensor.numpy() would forbid it.
    x = make(SHAPE, torch.bfloat16, 0, requires_grad=True)
    w = make_weight("same", torch.bfloat16, requires_grad=True)
    res = make(SHAPE, torch.bfloat16, 3)
    rt.rms_norm(x, SHAPE[-1], w).sum().backward()
    rt.add_rms_norm(x, res, SHAPE[-1], w)[0].sum().backward()
    for t in (x, w, res):
        t.untyped_storage().resize_(0)


def test_zero_rows_and_single_row():
    w = make_weight("same", torch.float32)
    y, rstd = OPS.rms_norm(torch.empty(0, 16), w, 1e-6)
    assert y.shape == (0, 16) and rstd.shape == (0,)
    x = make((16,), torch.float32, 0)
    y, rstd = OPS.rms_norm(x, w, 1e-6)
    assert y.shape == (16,) and rstd.shape == () and rstd.dtype == torch.float32
    y_f64 = oracle.forward(to_np(x), to_np(w), 1e-6)[0]
    oracle.assert_y_close(to_np(y), y_f64, 0)


# --- errors ------------------------------------------------------------------------------------


def test_errors_through_the_ops():
    x, w = torch.ones(3, 8), torch.ones(8)
    with pytest.raises(TypeError, match="int32"):
        OPS.rms_norm(x.int(), None, 1e-6)
    with pytest.raises(ValueError, match=r"\(7,\)"):
        OPS.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        OPS.rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="cast"):
        OPS.rms_norm(x, w, 1e-6, 0.0, "middle")
    with pytest.raises(ValueError, match=r"\(2, 8\)"):
        OPS.add_rms_norm(x, torch.ones(2, 8), w, 1e-6)
    with pytest.raises(ValueError, match=r"\(3, 7\)"):
        OPS.rms_norm(x, w, 1e-6, out=torch.empty(3, 7))


def test_meta_tensors_get_shapes_only():
    x = torch.empty(4, 6, 8, device="meta", dtype=torch.bfloat16)
    y, rstd = OPS.rms_norm(x, torch.empty(6, 8, device="meta"), 1e-6)
    assert y.device.type == "meta" and y.shape == x.shape and y.dtype == torch.bfloat16
    assert rstd.shape == (4,) and rstd.dtype == torch.float32
    assert rt.RMSNorm(8, device="meta")(x).shape == x.shape


def test_other_devices_get_a_clear_error():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False):
        x = torch.empty(2, 8, device="cuda")
        with pytest.raises(ValueError, match="CPU tensors only.*cuda"):
            rt.rms_norm(x, 8)
        with pytest.raises(ValueError, match="CPU tensors only.*cuda"):
            OPS.rms_norm(x, None, 1e-6)


def test_weight_moved_between_forward_and_backward():
    """FSDP2's pattern: the unsharded weight's memory is freed after the forward and gathered
    again, maybe elsewhere, before the backward. The backward must read the weight where it is
    then, not where the forward saw it (here the old memory is kept and overwritten)."""
    x = make(SHAPE, torch.float32, 0, requires_grad=True)
    w = make_weight("same", torch.float32, requires_grad=True)
    dy = make(SHAPE, torch.float32, 2)
    want = torch.autograd.grad(rt.rms_norm(x, SHAPE[-1], w), [x, w], dy)
    y = rt.rms_norm(x, SHAPE[-1], w)
    old = torch.empty(0).set_(w.untyped_storage(), 0, w.shape)  # own version counter
    w.data = w.detach().clone()  # the same values elsewhere; no version bump
    old.fill_(1e6)
    got = torch.autograd.grad(y, [x, w], dy)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
