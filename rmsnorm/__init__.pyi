from typing import Literal, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

_Cast = Literal["end", "before_weight"]
__version__: str

def rms_norm(
    x: ArrayLike,
    gamma: Optional[ArrayLike] = None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    cast: _Cast = "end",
    out: Optional[NDArray] = None,
) -> Tuple[NDArray, NDArray]: ...
def rms_norm_backward(
    dy: ArrayLike,
    x: ArrayLike,
    gamma: Optional[ArrayLike],
    rstd: ArrayLike,
    *,
    offset: float = 0.0,
    out: Optional[NDArray] = None,
) -> Tuple[NDArray, Optional[NDArray]]: ...
def add_rms_norm(
    x: ArrayLike,
    residual: ArrayLike,
    gamma: Optional[ArrayLike] = None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    cast: _Cast = "end",
    out: Optional[NDArray] = None,
    residual_out: Optional[NDArray] = None,
) -> Tuple[NDArray, NDArray, NDArray]: ...
def get_num_threads() -> int: ...
def set_num_threads(n: int) -> None: ...
def isa() -> str: ...
def available_isas() -> list[str]: ...
def set_isa(name: str) -> None: ...

class RMSNorm:
    normalized_shape: Tuple[int, ...]
    eps: float
    offset: float
    cast: _Cast
    weight: NDArray
    weight_grad: NDArray
    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        cast: _Cast = "end",
        dtype: DTypeLike = np.float32,
    ) -> None: ...
    def forward(self, x: ArrayLike) -> NDArray: ...
    def __call__(self, x: ArrayLike) -> NDArray: ...
    def backward(self, dy: ArrayLike) -> NDArray: ...
    def zero_grad(self) -> None: ...
