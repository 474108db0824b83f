# PyTorch adapter: an autograd Function, a functional and a drop-in nn.RMSNorm that run the
# rmsnorm C kernels on CPU tensors, sharing memory with them through NumPy views (no copies).
"""PyTorch bindings for rmsnorm (CPU tensors only).

``import rmsnorm.torch`` is opt-in: the core package never imports it.

* :class:`RMSNormFunction` -- ``torch.autograd.Function``; forward saves ``x``, ``weight`` and
  ``rstd`` so backward never recomputes the statistics.
* :func:`rms_norm` -- mirrors :func:`torch.nn.functional.rms_norm`, plus ``offset``.
* :class:`RMSNorm` -- drop-in :class:`torch.nn.RMSNorm` (same constructor and state_dict keys),
  plus ``offset``.

float16, bfloat16, float32 and float64 tensors with any strides are supported; ``weight`` may
have a different dtype from ``x`` (the result has ``x``'s dtype, as in torch).
"""

import numbers
from typing import ClassVar

import ml_dtypes
import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised by simulating a missing torch
    raise ImportError(
        "rmsnorm.torch needs PyTorch, which is not installed: pip install rmsnorm[torch]"
    ) from exc

from torch.autograd.function import once_differentiable

import rmsnorm as _rmsnorm

__all__ = ["RMSNorm", "RMSNormFunction", "rms_norm"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(tensor, name):
    """Reject tensors the CPU kernels cannot read in place (other devices, other dtypes)."""
    if not tensor.is_cpu:
        raise ValueError(
            f"rmsnorm.torch runs on CPU tensors only; {name} is on device '{tensor.device}'"
        )
    if tensor.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"rmsnorm.torch supports float16, bfloat16, float32 and float64; "
            f"{name} has dtype {tensor.dtype}"
        )


def _to_numpy(tensor):
    """Zero-copy NumPy view of a CPU tensor (None passes through)."""
    if tensor is None:
        return None
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        # NumPy has no native bfloat16: reinterpret the same bytes as ml_dtypes.bfloat16.
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _from_numpy(array):
    """Zero-copy tensor over a NumPy array returned by the kernels (None passes through)."""
    if array is None:
        return None
    array = np.asarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _forward(x, weight, eps, offset):
    """(y, rstd) as NumPy arrays, after the device and dtype checks."""
    _check_tensor(x, "x")
    if weight is not None:
        _check_tensor(weight, "weight")
    return _rmsnorm.rms_norm(_to_numpy(x), _to_numpy(weight), eps, offset=offset)


def _apply(x, weight, eps, offset):
    """RMSNormFunction.apply, or the kernel alone when no gradient can flow (inference, no_grad):
    the autograd machinery costs several times a small call (1 x 4096) of the kernel itself."""
    grad = x.requires_grad or (weight is not None and weight.requires_grad)
    if grad and torch.is_grad_enabled():
        return RMSNormFunction.apply(x, weight, eps, offset)
    return _from_numpy(_forward(x, weight, eps, offset)[0])


class RMSNormFunction(torch.autograd.Function):
    """Autograd Function for ``y = x * rstd * (offset + weight)`` over weight's trailing axes.

    ``forward(ctx, x, weight, eps, offset)``: ``weight`` is a tensor whose shape equals the
    trailing axes of ``x`` (the normalized axes), or None to normalize the last axis with no
    scale. ``eps`` and ``offset`` are Python floats. Returns ``y`` (``x``'s shape and dtype).
    """

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        """Run the kernel; save x, weight and the per-row rstd for backward."""
        y, rstd = _forward(x, weight, eps, offset)
        ctx.save_for_backward(x, weight, _from_numpy(rstd))
        ctx.offset = offset
        return _from_numpy(y)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        """Gradients for x and weight from the saved rstd (no recomputation)."""
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = _rmsnorm.rms_norm_backward(
            _to_numpy(dy), _to_numpy(x), _to_numpy(weight), _to_numpy(rstd), offset=ctx.offset
        )
        return _from_numpy(dx), _from_numpy(dweight), None, None


def _as_shape(normalized_shape):
    """normalized_shape as a tuple of ints (an int means a single trailing axis)."""
    if type(normalized_shape) is int or isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(n) for n in normalized_shape)


def _default_eps(dtype):
    """torch's eps=None rule: machine epsilon of the compute type (float32 below float64)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _check_shapes(x, shape, weight):
    """normalized_shape must be non-empty, match x's trailing axes and weight's shape."""
    if not shape:
        raise ValueError("rmsnorm.torch needs a non-empty normalized_shape, got ()")
    if x.dim() < len(shape) or x.shape[-len(shape) :] != shape:
        raise ValueError(
            f"normalized_shape {shape} does not match the trailing axes of x of shape "
            f"{tuple(x.shape)}"
        )
    if weight is not None and weight.shape != shape:
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} does not match normalized_shape {shape}"
        )


def rms_norm(x, normalized_shape, weight=None, eps=None, offset=0.0):
    """RMSNorm of ``x`` over its trailing ``normalized_shape`` axes; differentiable.

    Mirrors :func:`torch.nn.functional.rms_norm` (``eps=None`` uses the machine epsilon of the
    compute type, as torch does) and adds ``offset``: the scale is ``offset + weight``
    (``offset=1.0`` with zero-initialised weights is the Gemma convention). ``offset`` is
    ignored when ``weight`` is None.
    """
    shape = _as_shape(normalized_shape)
    _check_shapes(x, shape, weight)
    eps = _default_eps(x.dtype) if eps is None else float(eps)
    offset = float(offset)
    if weight is None and len(shape) > 1:
        # The kernels normalize only the last axis when there is no weight: merge the
        # normalized axes (a view whenever the strides allow it).
        flat = x.flatten(start_dim=-len(shape))
        return _apply(flat, None, eps, offset).reshape(x.shape)
    return _apply(x, weight, eps, offset)


class RMSNorm(torch.nn.Module):
    """Drop-in :class:`torch.nn.RMSNorm` running the rmsnorm kernels, with an extra ``offset``.

    Same constructor as torch's (plus ``offset``) and the same state_dict keys: ``"weight"``
    when ``elementwise_affine``, no parameters otherwise. ``weight`` starts at ones, or zeros
    when ``offset == 1.0`` so that the initial scale is one either way. ``eps=None`` uses the
    machine epsilon of the compute type, as torch does.
    """

    __constants__: ClassVar[list[str]] = ["normalized_shape", "eps", "elementwise_affine", "offset"]

    def __init__(
        self,
        normalized_shape,
        eps=1e-6,
        elementwise_affine=True,
        offset=0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = float(offset)
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
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, self.offset)

    def extra_repr(self):
        """Like torch.nn.RMSNorm's, with the offset when it is not zero."""
        text = (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        )
        return f"{text}, offset={self.offset}" if self.offset else text
