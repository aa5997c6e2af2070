"""numpy arrays in JSON, in the json-numpy convention OpenVLA's REST deploy script uses (``json_numpy.patch()``).

An array is ``{"__numpy__": <base64 of the raw C-order bytes>, "dtype": <dtype.str, e.g. "|u1">, "shape": [...]}``;
an empty ``shape`` is a scalar. As with msgpack, only bool/int/uint/float dtypes are accepted and the byte count
must match the shape. Plain nested lists are accepted by the server as well (no marker needed).
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np

_MAX_NDIM = 8  # as vla.serving.protocol's msgpack decoding allows
_ALLOWED_KINDS = frozenset("biuf")


class JsonNumpyError(ValueError):
    """A ``__numpy__`` object is malformed; the message says which part."""


def encode_json_numpy(obj: Any) -> Any:
    """``json.dumps(..., default=encode_json_numpy)``: numpy arrays and scalars to marker objects."""
    if isinstance(obj, np.ndarray | np.generic):
        arr = np.ascontiguousarray(obj)
        return {"__numpy__": base64.b64encode(arr.tobytes()).decode("ascii"), "dtype": arr.dtype.str,
                "shape": list(np.shape(obj))}  # fmt: skip
    raise TypeError(f"cannot serialize {type(obj).__name__} to JSON")


def decode_json_numpy(d: dict[str, Any]) -> Any:
    """``json.loads(..., object_hook=decode_json_numpy)``: marker objects back to numpy arrays/scalars."""
    if "__numpy__" not in d:
        return d
    if not isinstance(d.get("dtype"), str):  # np.dtype(None) would read the bytes as float64
        raise JsonNumpyError(
            f"numpy 'dtype' must be a dtype string such as '<f4' or '|u1', got {d.get('dtype')!r}"
        )
    try:
        dtype = np.dtype(d["dtype"])
    except (TypeError, ValueError):
        raise JsonNumpyError(f"unknown numpy dtype {d.get('dtype')!r}") from None
    if dtype.kind not in _ALLOWED_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise JsonNumpyError(f"numpy dtype {d.get('dtype')!r} is not allowed: only bool, int, uint and float")
    shape = d.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_NDIM
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
    ):
        raise JsonNumpyError(f"numpy 'shape' must be a list of at most {_MAX_NDIM} ints >= 0, got {shape!r}")
    try:
        data = base64.b64decode(d["__numpy__"], validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise JsonNumpyError("'__numpy__' is not valid base64") from None
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise JsonNumpyError(
            f"numpy array of shape {shape} and dtype {dtype.str!r} needs {math.prod(shape) * dtype.itemsize} "
            f"bytes, got {len(data)}"
        )
    arr = np.frombuffer(data, dtype=dtype).reshape(shape)
    return arr if shape else arr[()]
