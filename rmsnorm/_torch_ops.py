# The rmsnorm operators as torch.library ops (rmsnorm::rms_norm, rms_norm_backward, add_rms_norm):
# schemas, CPU kernels over zero-copy NumPy views of the tensors, fake kernels for tracing,
# autograd formulas and DTensor sharding rules. rmsnorm.torch builds its public API on these.
"""torch.library registration of the rmsnorm operators (imported by :mod:`rmsnorm.torch`)."""

import ml_dtypes
import numpy as np
import torch

from . import _core

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CASTS = ("end", "before_weight")

# Functional ops first: a call on torch.ops.rmsnorm.<name> without out= resolves to them.
_SCHEMAS = {
    "rms_norm": "(Tensor x, Tensor? weight, float eps, float offset=0., str cast='end') "
    "-> (Tensor y, Tensor rstd)",
    "rms_norm.out": "(Tensor x, Tensor? weight, float eps, float offset=0., str cast='end', *, "
    "Tensor(a!) out) -> Tensor rstd",
    "rms_norm_backward": "(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, float offset=0.) "
    "-> (Tensor dx, Tensor? dweight)",
    "add_rms_norm": "(Tensor x, Tensor residual, Tensor? weight, float eps, float offset=0., "
    "str cast='end') -> (Tensor y, Tensor rstd, Tensor h)",
    "add_rms_norm.out": "(Tensor x, Tensor residual, Tensor? weight, float eps, float offset=0., "
    "str cast='end', *, Tensor(a!) out, Tensor(b!) residual_out) -> Tensor rstd",
    # vLLM's fused_add_rms_norm: x becomes y and residual becomes h, with no allocation.
    "add_rms_norm.inplace": "(Tensor(a!) x, Tensor(b!) residual, Tensor? weight, float eps, "
    "float offset=0., str cast='end') -> Tensor rstd",
}

_LIB = torch.library.Library("rmsnorm", "DEF")  # noqa: TOR901  (kept alive by the module)
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_name + _schema)

OPS = torch.ops.rmsnorm


# --- checks shared by the fake kernels and the Python API ------------------------------------


def check_tensor(tensor, name, *, allow_meta=True):
    """Device and dtype checks with messages naming the argument."""
    device = tensor.device.type
    if device != "cpu" and not (allow_meta and device == "meta"):
        raise ValueError(
            f"rmsnorm.torch runs on CPU tensors only; {name} is on device '{tensor.device}'"
        )
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"rmsnorm.torch supports float16, bfloat16, float32 and float64; "
            f"{name} has dtype {tensor.dtype}"
        )


def lead_shape(x, weight):
    """Shape of rstd: x's axes before the normalized ones (weight's, or the last one)."""
    nnorm = 1 if weight is None else weight.dim()
    return x.shape[: x.dim() - nnorm]


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_same_shape(a, a_name, b, b_name):
    if a.shape != b.shape:
        raise ValueError(
            f"{a_name} of shape {tuple(a.shape)} does not match {b_name} of shape {tuple(b.shape)}"
        )


def check_forward(x, weight, eps, cast):
    """What the C extension checks before any work, for the fake kernels (traced calls never
    reach it) with the same exception types."""
    check_tensor(x, "x")
    if x.dim() < 1:
        raise ValueError("rmsnorm needs x with at least one axis, got a 0-d tensor")
    if weight is not None:
        check_tensor(weight, "weight")
        nd = weight.dim()
        if nd < 1 or nd > x.dim() or x.shape[x.dim() - nd :] != weight.shape:
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} does not match the trailing axes of x "
                f"of shape {tuple(x.shape)}"
            )
    if not (eps >= 0 and eps != float("inf")):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    if cast not in CASTS:
        raise ValueError(f"cast must be 'end' or 'before_weight', got {cast!r}")


# --- zero-copy views between tensors and NumPy arrays -----------------------------------------


class _View:
    """Exposes a tensor's memory to NumPy through ``__array_interface__`` and keeps the tensor
    alive. ``Tensor.numpy()`` would mark the tensor's storage as never resizable again, which
    breaks FSDP2 (it frees the storage of unsharded parameters after use)."""

    __slots__ = ("__array_interface__", "_tensor")


# bfloat16 travels as int16 and is reinterpreted as ml_dtypes.bfloat16 (NumPy has none).
_TYPESTR = {
    torch.float16: "<f2",
    torch.bfloat16: "<i2",
    torch.float32: "<f4",
    torch.float64: "<f8",
}


def to_numpy(tensor):
    """NumPy view of a CPU tensor's memory, any strides (None passes through)."""
    if tensor is None:
        return None
    view = _View()
    view._tensor = tensor
    dtype = tensor.dtype
    view.__array_interface__ = interface = {
        "data": (tensor.data_ptr(), False),
        "shape": tensor.shape,
        "typestr": _TYPESTR[dtype],
    }
    if not tensor.is_contiguous():
        size = tensor.element_size()
        interface["strides"] = tuple([s * size for s in tensor.stride()])
    array = _asarray(view)
    return array.view(ml_dtypes.bfloat16) if dtype is torch.bfloat16 else array


_asarray = np.asarray


def weight_view(owner, weight):
    """to_numpy(weight), kept on owner (a module) while weight stays where it was with the same
    layout: a module's weight rarely moves, and its view costs as much as the kernels on a small
    call. Any change of tensor, address, shape, strides or dtype makes a new view."""
    if weight is None:
        return None
    key = (weight.data_ptr(), weight.shape, weight.stride(), weight.dtype)
    cached = owner.__dict__.get("_rms_weight_view")
    if cached is not None and cached[0] is weight and cached[1] == key:
        return cached[2]
    view = to_numpy(weight)
    owner.__dict__["_rms_weight_view"] = (weight, key, view)
    return view


def from_numpy(array):
    """Tensor over the memory of an array the kernels returned (None passes through)."""
    if array is None:
        return None
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


# --- CPU kernels ------------------------------------------------------------------------------


def _rms_norm_cpu(x, weight, eps, offset=0.0, cast="end"):
    y, rstd = _core.rms_norm(to_numpy(x), to_numpy(weight), eps, offset=offset, cast=cast)
    return from_numpy(y), from_numpy(np.asarray(rstd))


def _rms_norm_out_cpu(x, weight, eps, offset=0.0, cast="end", *, out):
    check_tensor(out, "out", allow_meta=False)
    _check_same_shape(out, "out", x, "x")
    _, rstd = _core.rms_norm(
        to_numpy(x), to_numpy(weight), eps, offset=offset, cast=cast, out=to_numpy(out)
    )
    return from_numpy(np.asarray(rstd))


def _rms_norm_backward_cpu(dy, x, weight, rstd, offset=0.0):
    dx, dweight = _core.rms_norm_backward(
        to_numpy(dy), to_numpy(x), to_numpy(weight), to_numpy(rstd), offset=offset
    )
    return from_numpy(dx), from_numpy(dweight)


def _add_rms_norm_cpu(x, residual, weight, eps, offset=0.0, cast="end"):
    y, rstd, h = _core.add_rms_norm(
        to_numpy(x), to_numpy(residual), to_numpy(weight), eps, offset=offset, cast=cast
    )
    return from_numpy(y), from_numpy(np.asarray(rstd)), from_numpy(h)


def _add_rms_norm_out_cpu(x, residual, weight, eps, offset=0.0, cast="end", *, out, residual_out):
    for t, name in ((out, "out"), (residual_out, "residual_out")):
        check_tensor(t, name, allow_meta=False)
        _check_same_shape(t, name, x, "x")
    _, rstd, _ = _core.add_rms_norm(
        to_numpy(x),
        to_numpy(residual),
        to_numpy(weight),
        eps,
        offset=offset,
        cast=cast,
        out=to_numpy(out),
        residual_out=to_numpy(residual_out),
    )
    return from_numpy(np.asarray(rstd))


def _add_rms_norm_inplace_cpu(x, residual, weight, eps, offset=0.0, cast="end"):
    xa, ra = to_numpy(x), to_numpy(residual)
    _, rstd, _ = _core.add_rms_norm(
        xa, ra, to_numpy(weight), eps, offset=offset, cast=cast, out=xa, residual_out=ra
    )
    return from_numpy(np.asarray(rstd))


def _unsupported_device(name):
    def kernel(*args, **kwargs):
        devices = sorted({str(a.device) for a in args if isinstance(a, torch.Tensor)})
        raise ValueError(
            f"rmsnorm::{name} runs on CPU tensors only; got tensors on {', '.join(devices)}"
        )

    return kernel


# --- fake kernels (shapes, dtypes and strides of the outputs, for tracing) --------------------


def _rstd_like(x, weight):
    return x.new_empty(lead_shape(x, weight), dtype=compute_dtype(x.dtype))


def _rms_norm_fake(x, weight, eps, offset=0.0, cast="end"):
    check_forward(x, weight, eps, cast)
    return x.new_empty(x.shape), _rstd_like(x, weight)


def _rms_norm_out_fake(x, weight, eps, offset=0.0, cast="end", *, out):
    check_forward(x, weight, eps, cast)
    _check_same_shape(out, "out", x, "x")
    return _rstd_like(x, weight)


def _rms_norm_backward_fake(dy, x, weight, rstd, offset=0.0):
    check_forward(x, weight, 0.0, "end")
    check_tensor(dy, "dy")
    _check_same_shape(dy, "dy", x, "x")
    if tuple(rstd.shape) != tuple(lead_shape(x, weight)):
        raise ValueError(
            f"rstd of shape {tuple(rstd.shape)} does not match x of shape {tuple(x.shape)}"
        )
    dweight = None if weight is None else weight.new_empty(weight.shape)
    return x.new_empty(x.shape), dweight


def _add_rms_norm_fake(x, residual, weight, eps, offset=0.0, cast="end"):
    check_forward(x, weight, eps, cast)
    check_tensor(residual, "residual")
    _check_same_shape(residual, "residual", x, "x")
    return x.new_empty(x.shape), _rstd_like(x, weight), x.new_empty(x.shape)


def _add_rms_norm_out_fake(x, residual, weight, eps, offset=0.0, cast="end", *, out, residual_out):
    _add_rms_norm_fake(x, residual, weight, eps, offset, cast)
    _check_same_shape(out, "out", x, "x")
    _check_same_shape(residual_out, "residual_out", x, "x")
    return _rstd_like(x, weight)


def _add_rms_norm_inplace_fake(x, residual, weight, eps, offset=0.0, cast="end"):
    _add_rms_norm_fake(x, residual, weight, eps, offset, cast)
    return _rstd_like(x, weight)


_KERNELS = {
    "rms_norm": (_rms_norm_cpu, _rms_norm_fake),
    "rms_norm.out": (_rms_norm_out_cpu, _rms_norm_out_fake),
    "rms_norm_backward": (_rms_norm_backward_cpu, _rms_norm_backward_fake),
    "add_rms_norm": (_add_rms_norm_cpu, _add_rms_norm_fake),
    "add_rms_norm.out": (_add_rms_norm_out_cpu, _add_rms_norm_out_fake),
    "add_rms_norm.inplace": (_add_rms_norm_inplace_cpu, _add_rms_norm_inplace_fake),
}


def _checking(name, kernel):
    """The CPU kernel behind a dtype check naming the argument: NumPy cannot view every torch
    dtype, and the C extension's message would name a NumPy dtype."""
    packet, _, overload = name.partition(".")
    names = [a.name for a in getattr(getattr(OPS, packet), overload or "default")._schema.arguments]

    def checked(*args, **kwargs):
        for arg_name, arg in (*zip(names, args), *kwargs.items()):
            if isinstance(arg, torch.Tensor):
                check_tensor(arg, arg_name)
        return kernel(*args, **kwargs)

    return checked


for _name, (_cpu, _fake) in _KERNELS.items():
    _LIB.impl(_name, _checking(_name, _cpu), "CPU")
    # Devices with no kernel of their own get a clear error instead of the dispatcher's.
    _LIB.impl(_name, _unsupported_device(_name.split(".")[0]), "CompositeExplicitAutograd")
    torch.library.register_fake("rmsnorm::" + _name, _fake, lib=_LIB)


# --- autograd ---------------------------------------------------------------------------------


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _, offset, _ = inputs
    ctx.offset = offset
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = OPS.rms_norm_backward(dy, x, weight, rstd, ctx.offset)
    return dx, dweight, None, None, None


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, _, offset, _ = inputs
    ctx.offset = offset
    ctx.save_for_backward(output[2], weight, output[1])


def _add_rms_norm_grad(ctx, dy, _drstd, dh):
    h, weight, rstd = ctx.saved_tensors
    dx, dweight = OPS.rms_norm_backward(dy, h, weight, rstd, ctx.offset)
    # x and residual both feed h: each receives the gradient reaching h.
    dsum = dx if dh is None else dx + dh
    return dsum, dsum, dweight, None, None, None


torch.library.register_autograd(
    "rmsnorm::rms_norm", _rms_norm_grad, setup_context=_rms_norm_setup, lib=_LIB
)
torch.library.register_autograd(
    "rmsnorm::add_rms_norm", _add_rms_norm_grad, setup_context=_add_rms_norm_setup, lib=_LIB
)


# --- eager autograd without the dispatcher ----------------------------------------------------


_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _keep_views(ctx, tensor, array, weight, weight_array):
    """Keeps the forward's NumPy views for the backward, sparing their conversion, unless saved
    tensor hooks are active (activation checkpointing or offloading): the views would keep the
    memory alive that the hooks mean to free, so the backward rebuilds them from the tensors."""
    if _saved_tensors_hooks(False):
        ctx.views = None
    else:
        ctx.views = (array, weight_array, tensor.data_ptr(), _data_ptr(weight))


def _data_ptr(tensor):
    return None if tensor is None else tensor.data_ptr()


def _backward(ctx, dy, x, weight, rstd):
    """dx, dweight from the saved tensors (reading ctx.saved_tensors checked their versions)."""
    views = ctx.views
    # A kept view is used only while its tensor still lies where it did: FSDP2 frees an
    # unsharded parameter's storage after the forward and gathers it again, maybe elsewhere.
    if views is not None and views[2] == x.data_ptr() and views[3] == _data_ptr(weight):
        xa, wa = views[0], views[1]
    else:
        xa, wa = to_numpy(x), to_numpy(weight)
    dx, dweight = _core.rms_norm_backward(to_numpy(dy), xa, wa, rstd, offset=ctx.offset)
    return from_numpy(dx), None if dweight is None else from_numpy(dweight)


class EagerRMSNorm(torch.autograd.Function):
    """The same forward and backward as the registered op's autograd, called directly: eager
    calls on plain CPU tensors skip the dispatcher's Python round trips (several times the
    kernels' own time on a small call). ``forward(x, weight, eps, offset, cast) -> y``."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, cast, wa=None):
        xa = to_numpy(x)
        if wa is None:
            wa = to_numpy(weight)
        y, rstd = _core.rms_norm(xa, wa, eps, offset=offset, cast=cast)
        ctx.offset = offset
        ctx.rstd = rstd  # the kernels' own array: no one else sees or modifies it
        ctx.save_for_backward(x, weight)
        _keep_views(ctx, x, xa, weight, wa)
        return from_numpy(y)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dweight = _backward(ctx, dy, x, weight, ctx.rstd)
        return dx, dweight, None, None, None, None


class EagerAddRMSNorm(torch.autograd.Function):
    """:class:`EagerRMSNorm` for the fused residual add: ``forward(...) -> (y, h)``."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, cast):
        wa = to_numpy(weight)
        y, rstd, h = _core.add_rms_norm(
            to_numpy(x), to_numpy(residual), wa, eps, offset=offset, cast=cast
        )
        ht = from_numpy(h)
        ctx.offset = offset
        ctx.rstd = rstd
        ctx.save_for_backward(ht, weight)
        _keep_views(ctx, ht, h, weight, wa)
        return from_numpy(y), ht

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight = ctx.saved_tensors
        dx, dweight = _backward(ctx, dy, h, weight, ctx.rstd)
        # x and residual both feed h: each receives the gradient reaching h.
        dsum = dx if dh is None else dx + dh
        return dsum, dsum, dweight, None, None, None


# Function.apply without its checks for functorch transforms and dead tensor wrappers, which
# the eager path has ruled out (rmsnorm.torch._plain): a third of a small call's cost.
eager_rms_norm = super(torch.autograd.Function, EagerRMSNorm).apply
eager_add_rms_norm = super(torch.autograd.Function, EagerAddRMSNorm).apply


# --- DTensor: leading-axis shards run locally -------------------------------------------------


def _register_sharding():
    """Shardings on the leading (row) axes need no communication: each shard's rows are
    normalized on their own, and dweight is a sum over rows, so it stays Partial."""
    if not torch.distributed.is_available():
        return
    try:
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # pragma: no cover - builds without DTensor
        return

    def rows(x, weight):
        return range(x.ndim - (1 if weight is None else weight.ndim))

    def opt(weight, placement):
        return None if weight is None else placement

    @register_sharding(OPS.rms_norm.default)
    def _(x, weight, eps, offset=0.0, cast="end"):
        r = Replicate()
        out = [([r, r], [r, opt(weight, r), None, None, None])]
        for d in rows(x, weight):
            out.append(([Shard(d), Shard(d)], [Shard(d), opt(weight, r), None, None, None]))
        return out

    @register_sharding(OPS.rms_norm_backward.default)
    def _(dy, x, weight, rstd, offset=0.0):
        r = Replicate()
        out = [([r, opt(weight, r)], [r, r, opt(weight, r), r, None])]
        for d in rows(x, weight):
            s = Shard(d)
            out.append(([s, opt(weight, Partial())], [s, s, opt(weight, r), s, None]))
        return out

    @register_sharding(OPS.add_rms_norm.default)
    def _(x, residual, weight, eps, offset=0.0, cast="end"):
        r = Replicate()
        out = [([r, r, r], [r, r, opt(weight, r), None, None, None])]
        for d in rows(x, weight):
            s = Shard(d)
            out.append(([s, s, s], [s, s, opt(weight, r), None, None, None]))
        return out


_register_sharding()
