# PyTorch adapter: the functional API, a drop-in nn.RMSNorm and the model patcher, on top of the
# torch.library ops registered in rmsnorm._torch_ops (which torch.compile, torch.export, opcheck
# and DTensor see), with a direct path for plain eager calls.
"""PyTorch bindings for rmsnorm (CPU tensors).

``import rmsnorm.torch`` is opt-in: the core package never imports it. Importing it registers
the ops ``torch.ops.rmsnorm.rms_norm``, ``rms_norm_backward`` and ``add_rms_norm``.

* :func:`rms_norm` -- :func:`torch.nn.functional.rms_norm` plus ``offset`` and ``cast``.
* :func:`add_rms_norm` -- ``h = x + residual`` and ``rms_norm(h)`` in one pass.
* :class:`RMSNorm` -- drop-in :class:`torch.nn.RMSNorm` (same state_dict keys).
* :func:`patch` -- swaps ``torch.nn.RMSNorm`` and known Hugging Face RMSNorm modules of a model
  for :class:`RMSNorm`, in place.

float16, bfloat16, float32 and float64 tensors with any strides; ``weight`` may have a different
dtype from ``x`` (the result has ``x``'s dtype, as in torch). Math as :func:`rmsnorm.rms_norm`.
"""

import numbers
from typing import ClassVar

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised by simulating a missing torch
    raise ImportError(
        "rmsnorm.torch needs PyTorch, which is not installed: pip install rmsnorm[torch]"
    ) from exc

from . import _core, _torch_ops
from ._torch_ops import (
    OPS,
    check_tensor,
    eager_add_rms_norm,
    eager_rms_norm,
    from_numpy,
    to_numpy,
    weight_view,
)

__all__ = ["RMSNorm", "add_rms_norm", "patch", "rms_norm"]

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_DTYPES = _torch_ops.SUPPORTED_DTYPES
_PYTHON_KEY = torch._C.DispatchKey.Python


_is_compiling = torch.compiler.is_compiling
_key_included = torch._C._dispatch_tls_is_dispatch_key_included
_function_mode = torch._C._is_torch_function_mode_enabled
_functorch_level = torch._C._functorch.maybe_current_level


def _plain(*tensors):
    """True for an eager call on ordinary CPU tensors: no compile, export, tracing, dispatch or
    function mode, functorch transform or tensor subclass, all of which must see the ops."""
    if _is_compiling():
        return False
    for t in tensors:
        if t is not None and (
            type(t) not in _PLAIN_TYPES or not t.is_cpu or t.dtype not in _DTYPES
        ):
            return False
    return not (_key_included(_PYTHON_KEY) or _function_mode() or _functorch_level() is not None)


_grad_enabled = torch.is_grad_enabled


def _grad_needed(*tensors):
    return _grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_devices(**tensors):
    """Device and dtype of each tensor (CPU, or meta for shapes only), all on one device."""
    given = {name: t for name, t in tensors.items() if t is not None}
    for name, t in given.items():
        check_tensor(t, name)
    if len({t.device for t in given.values()}) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in given.items())
        raise ValueError(f"rmsnorm.torch needs all tensors on one device; got {where}")


def _norm(x, weight, eps, offset, cast, owner=None):
    """y over weight's axes (the last one without weight), through the fastest valid route;
    owner: the module whose weight this is (its NumPy view is kept there)."""
    if _plain(x, weight):
        wa = to_numpy(weight) if owner is None else weight_view(owner, weight)
        if _grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
            return eager_rms_norm(x, weight, eps, offset, cast, wa)
        return from_numpy(_core.rms_norm(to_numpy(x), wa, eps, offset=offset, cast=cast)[0])
    _check_devices(x=x, weight=weight)
    return OPS.rms_norm.default(x, weight, eps, offset, cast)[0]


def _add_norm(x, residual, weight, eps, offset, cast):
    if _plain(x, residual, weight):
        if _grad_needed(x, residual, weight):
            return eager_add_rms_norm(x, residual, weight, eps, offset, cast)
        y, _, h = _core.add_rms_norm(
            to_numpy(x), to_numpy(residual), to_numpy(weight), eps, offset=offset, cast=cast
        )
        return from_numpy(y), from_numpy(h)
    _check_devices(x=x, residual=residual, weight=weight)
    y, _, h = OPS.add_rms_norm.default(x, residual, weight, eps, offset, cast)
    return y, h


def _as_shape(normalized_shape):
    """normalized_shape as a tuple of ints (an int means a single trailing axis)."""
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(n) for n in normalized_shape)


def _eps(eps, dtype):
    """eps=None is torch's rule: the machine epsilon of the compute type (float32 for 16-bit
    inputs, as torch.nn.functional.rms_norm computes them in float32)."""
    if eps is None:
        return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    return float(eps)


def _check_shapes(x, shape, weight):
    """normalized_shape must be non-empty, match x's trailing axes and weight's shape."""
    if not shape:
        raise ValueError("rmsnorm.torch needs a non-empty normalized_shape, got ()")
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(
            f"normalized_shape {shape} does not match the trailing axes of x of shape "
            f"{tuple(x.shape)}"
        )
    if weight is not None and tuple(weight.shape) != shape:
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} does not match normalized_shape {shape}"
        )


def rms_norm(x, normalized_shape, weight=None, eps=None, *, offset=0.0, cast="end"):
    """RMSNorm of ``x`` over its trailing ``normalized_shape`` axes; differentiable.

    Mirrors :func:`torch.nn.functional.rms_norm` (``eps=None`` is torch's default) and adds
    ``offset`` (the scale is ``offset + weight``; ``offset=1.0`` with zero-initialised weights
    is the Gemma convention) and ``cast``: ``"end"`` rounds once at the end, ``"before_weight"``
    rounds ``x * rstd`` to x's dtype before the weight (the Hugging Face Llama convention).
    ``offset`` is ignored when ``weight`` is None.
    """
    shape = _as_shape(normalized_shape)
    _check_shapes(x, shape, weight)
    eps = _eps(eps, x.dtype)
    offset = float(offset)
    if weight is None and len(shape) > 1:
        # Without a weight the kernels normalize the last axis: merge the normalized axes.
        return _norm(x.flatten(x.dim() - len(shape)), None, eps, offset, cast).view(x.shape)
    return _norm(x, weight, eps, offset, cast)


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None, *, offset=0.0, cast="end"):
    """``h = x + residual`` (rounded to x's dtype) and ``y = rms_norm(h, ...)`` in one pass over
    memory; returns ``(y, h)``, both differentiable. Arguments as :func:`rms_norm`."""
    shape = _as_shape(normalized_shape)
    _check_shapes(x, shape, weight)
    if residual.shape != x.shape:
        raise ValueError(
            f"residual of shape {tuple(residual.shape)} does not match x of shape {tuple(x.shape)}"
        )
    eps = _eps(eps, x.dtype)
    offset = float(offset)
    if weight is None and len(shape) > 1:
        start = x.dim() - len(shape)
        y, h = _add_norm(x.flatten(start), residual.flatten(start), None, eps, offset, cast)
        return y.view(x.shape), h.view(x.shape)
    return _add_norm(x, residual, weight, eps, offset, cast)


class RMSNorm(torch.nn.Module):
    """Drop-in :class:`torch.nn.RMSNorm` running the rmsnorm kernels, plus ``offset``/``cast``.

    Same constructor as torch's (plus ``offset`` and ``cast``) and the same state_dict keys:
    ``"weight"`` when ``elementwise_affine``, no parameters otherwise. ``weight`` starts at
    ones, or zeros when ``offset == 1.0`` so that the initial scale is one either way.
    ``eps=None`` is torch's default.
    """

    __constants__: ClassVar[list[str]] = [
        "normalized_shape",
        "eps",
        "elementwise_affine",
        "offset",
        "cast",
    ]

    def __init__(
        self,
        normalized_shape,
        eps=1e-6,
        elementwise_affine=True,
        *,
        offset=0.0,
        cast="end",
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        if not self.normalized_shape or min(self.normalized_shape) < 0:
            raise ValueError(f"invalid normalized_shape {normalized_shape!r}")
        if cast not in _torch_ops.CASTS:
            raise ValueError(f"cast must be 'end' or 'before_weight', got {cast!r}")
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = float(offset)
        self.cast = cast
        if elementwise_affine:
            factory = {"device": device, "dtype": dtype}
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self):
        """Weight back to ones (zeros when offset == 1.0)."""
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 0.0 if self.offset == 1.0 else 1.0)

    def forward(self, x):
        """Normalize ``x`` over its trailing ``normalized_shape`` axes."""
        weight, eps = self.weight, self.eps
        if weight is not None and weight.shape == self.normalized_shape:
            # weight's shape names the normalized axes; the kernels check x against it.
            eps = eps if type(eps) is float else _eps(eps, x.dtype)
            return _norm(x, weight, eps, self.offset, self.cast, self)
        return rms_norm(
            x, self.normalized_shape, weight, self.eps, offset=self.offset, cast=self.cast
        )

    def extra_repr(self):
        """Like torch.nn.RMSNorm's, with offset and cast when they are not the defaults."""
        text = (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        )
        if self.offset:
            text += f", offset={self.offset}"
        if self.cast != "end":
            text += f", cast={self.cast!r}"
        return text


def patch(model):
    """Replace, in place, every ``torch.nn.RMSNorm`` in ``model`` and every Hugging Face
    ``transformers`` RMSNorm module of a known convention (Llama, Mistral, Qwen2, Qwen3 and
    the like: float32 statistics, cast to the input dtype, then times weight; Gemma, Gemma2,
    Gemma3: times ``1 + weight``, cast at the end) by an equivalent :class:`RMSNorm` that keeps
    the same weight Parameter (same tensor, same state_dict key). Other modules are left alone;
    ``model`` itself is never replaced, only its submodules. Returns how many were replaced."""
    from ._torch_patch import patch_modules

    return patch_modules(model)
