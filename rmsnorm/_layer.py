"""The thin autograd-style layer: keeps what the backward needs and accumulates the weight's
gradient, like a framework module but on plain NumPy arrays."""

import numpy as np

from ._core import rms_norm, rms_norm_backward


class RMSNorm:
    """RMSNorm over the trailing ``normalized_shape`` axes, with a learnable ``weight``.

    ``y = x / sqrt(mean(x**2) + eps) * (offset + weight)``. With ``offset=1.0`` (Gemma's
    zero-centred gamma) the weight starts at zeros, otherwise at ones.

    >>> layer = RMSNorm(4096)
    >>> y = layer(x)              # keeps x and rstd
    >>> dx = layer.backward(dy)   # accumulates layer.weight_grad
    """

    def __init__(self, normalized_shape, eps=1e-6, *, offset=0.0, cast="end", dtype=np.float32):
        if isinstance(normalized_shape, (int, np.integer)):
            normalized_shape = (int(normalized_shape),)
        self.normalized_shape = tuple(int(n) for n in normalized_shape)
        if not self.normalized_shape or min(self.normalized_shape) < 1:
            raise ValueError(
                f"normalized_shape must be non-empty and positive, got {normalized_shape!r}"
            )
        self.eps = float(eps)
        self.offset = float(offset)
        self.cast = cast
        init = np.zeros if self.offset == 1.0 else np.ones
        self.weight = init(self.normalized_shape, dtype=dtype)
        self.weight_grad = np.zeros_like(self.weight)
        self._saved = None

    def forward(self, x):
        """Normalize x; keeps x and rstd for :meth:`backward`."""
        y, rstd = rms_norm(x, self.weight, self.eps, offset=self.offset, cast=self.cast)
        self._saved = (x, rstd)
        return y

    __call__ = forward

    def backward(self, dy):
        """Return dx for the last forward and add dgamma into ``weight_grad``."""
        if self._saved is None:
            raise RuntimeError("RMSNorm.backward() called before forward()")
        x, rstd = self._saved
        dx, dgamma = rms_norm_backward(dy, x, self.weight, rstd, offset=self.offset)
        self.weight_grad += dgamma
        return dx

    def zero_grad(self):
        """Reset ``weight_grad`` to zeros."""
        self.weight_grad[...] = 0

    def __repr__(self):
        return (
            f"RMSNorm({self.normalized_shape}, eps={self.eps}, offset={self.offset}, "
            f"dtype={self.weight.dtype})"
        )
