"""rmsnorm: RMSNorm for NumPy arrays on CPUs.

Forward, backward and fused residual-add RMSNorm as C kernels (scalar, AVX2, AVX-512; chosen at
run time), threaded with OpenMP, for float16, bfloat16 (ml_dtypes), float32 and float64.

    y, rstd = rmsnorm.rms_norm(x, gamma, eps=1e-6)
    dx, dgamma = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
    y, rstd, h = rmsnorm.add_rms_norm(x, residual, gamma)
"""

import os as _os
import warnings as _warnings

from . import _core  # noqa: F401  (rmsnorm._core: copy/triad references, have_openmp)
from ._core import (
    add_rms_norm,
    available_isas,
    get_num_threads,
    isa,
    rms_norm,
    rms_norm_backward,
    set_isa,
    set_num_threads,
)
from ._layer import RMSNorm

__version__ = "0.1.0"
__all__ = [
    "RMSNorm",
    "add_rms_norm",
    "available_isas",
    "get_num_threads",
    "isa",
    "rms_norm",
    "rms_norm_backward",
    "set_isa",
    "set_num_threads",
]


def _isa_from_env():
    name = _os.environ.get("RMSNORM_ISA", "").strip().lower()
    if not name:
        return
    try:
        set_isa(name)
    except ValueError as e:
        _warnings.warn(f"RMSNORM_ISA ignored: {e}", RuntimeWarning, stacklevel=3)


_isa_from_env()
