"""The dtypes that travel, and how each is read and rebuilt.

* :data:`TORCH_BY_NAME` / :data:`TORCH_BY_DTYPE` — every torch dtype the codec carries,
  keyed by wire name (``str(dtype)`` without ``torch.``) and by ``torch.dtype``. Dtypes
  numpy understands are read with ``Tensor.numpy()``; the others (bfloat16, float8…,
  complex32, bits…) through a same-size integer view, so even a strided tensor is
  copied in one ``np.copyto``.
* :func:`numpy_name` / :func:`numpy_dtype` — numpy dtypes by ``dtype.str`` (``"<f4"``):
  bool, integer, float and complex only; names from the wire are parsed only when they
  have that shape, so untrusted text never reaches numpy's full dtype parser.
"""

from __future__ import annotations

import re
from typing import Any, Final, NamedTuple

import numpy as np
import torch

__all__ = ["TORCH_BY_DTYPE", "TORCH_BY_NAME", "TorchDtype", "numpy_dtype", "numpy_name"]


class TorchDtype(NamedTuple):
    """How one torch dtype travels."""

    name: str
    dtype: torch.dtype
    itemsize: int
    #: numpy dtype when ``Tensor.numpy()`` understands this dtype, else None.
    np_dtype: np.dtype[Any] | None
    #: Same-size integer dtype to view the tensor as when numpy has no equivalent.
    int_view: torch.dtype | None


_NUMPY_NATIVE = {
    "bool": np.bool_,
    "uint8": np.uint8,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "complex64": np.complex64,
    "complex128": np.complex128,
}
_OPAQUE_TORCH = (
    "bfloat16",
    "complex32",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bits8",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _torch_dtypes() -> dict[str, TorchDtype]:
    table: dict[str, TorchDtype] = {}
    for name, np_type in _NUMPY_NATIVE.items():
        dt = getattr(torch, name)
        table[name] = TorchDtype(name, dt, dt.itemsize, np.dtype(np_type), None)
    for name in _OPAQUE_TORCH:
        dt = getattr(torch, name, None)  # newer float formats exist only in newer torch
        if dt is not None and dt.itemsize in _INT_VIEW:
            table[name] = TorchDtype(name, dt, dt.itemsize, None, _INT_VIEW[dt.itemsize])
    return table


TORCH_BY_NAME: Final = _torch_dtypes()
TORCH_BY_DTYPE: Final = {d.dtype: d for d in TORCH_BY_NAME.values()}

_NP_NAME_RE = re.compile(r"[<>|=]?[biufc][0-9]{1,2}")
_NP_BY_NAME: dict[str, np.dtype[Any]] = {}  # only valid names are cached: a bounded set
_NP_NAME_BY_DTYPE: dict[np.dtype[Any], str] = {}


def numpy_name(dt: np.dtype[Any]) -> str | None:
    name = _NP_NAME_BY_DTYPE.get(dt)
    if name is None and dt.kind in "biufc" and dt.fields is None and dt.subdtype is None:
        name = _NP_NAME_BY_DTYPE[dt] = dt.str
    return name


def numpy_dtype(name: str) -> np.dtype[Any] | None:
    dt = _NP_BY_NAME.get(name)
    if dt is None and _NP_NAME_RE.fullmatch(name):
        try:
            dt = np.dtype(name)
        except TypeError:  # a well-formed name of a size that does not exist, e.g. "<i3"
            return None
        if dt.kind not in "biufc" or dt.str.lstrip("<>|=") != name.lstrip("<>|="):
            return None
        _NP_BY_NAME[name] = dt
    return dt
