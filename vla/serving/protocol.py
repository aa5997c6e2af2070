"""The wire format shared by the server and the robot-side client: msgpack with openpi's numpy encoding.

Byte-compatible with ``openpi_client.msgpack_numpy`` (openpi, ``packages/openpi-client/src/openpi_client/
msgpack_numpy.py``): a numpy array travels as the map ``{b"__ndarray__": True, b"data": <raw C-order bytes>,
b"dtype": dtype.str, b"shape": [...]}`` and a numpy scalar as ``{b"__npgeneric__": True, b"data": <python value>,
b"dtype": dtype.str}`` — marker keys as msgpack bin, no compression, no pickle. Unlike openpi's decoder, ``unpack``
is strict: only bool/int/uint/float dtypes (no object ``|O``, void ``V``, strings or complex), a shape of
non-negative ints whose size matches the data length exactly, and a frame-size limit (never unlimited). Anything
else raises ``ProtocolError`` with a one-line message fit to send back to the client.

This module imports only numpy and msgpack (the robot-side client depends on it).
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

#: Version of the request/response schema carried in the metadata frame; bumped on breaking changes only
#: (fields are only ever added within a version).
PROTOCOL_VERSION = 1
#: Default cap on one frame (a request); ``vla serve --max-frame-mb`` changes it.
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
#: dtype kinds accepted on the wire: bool, signed and unsigned int, float.
_ALLOWED_KINDS = frozenset("biuf")
_MAX_NDIM = 8


class ProtocolError(ValueError):
    """A frame is not valid msgpack in openpi's numpy encoding (or breaks a limit); the message says which part."""


def _encode(obj: Any) -> Any:
    """msgpack ``default`` hook: numpy arrays and scalars to openpi's marker maps."""
    if isinstance(obj, np.ndarray | np.generic):
        if obj.dtype.kind not in _ALLOWED_KINDS:
            raise ProtocolError(f"cannot send numpy dtype {obj.dtype.str!r}: only bool, int, uint and float")
        if isinstance(obj, np.ndarray):
            return {
                b"__ndarray__": True,
                b"data": np.ascontiguousarray(obj).tobytes(),
                b"dtype": obj.dtype.str,
                b"shape": list(obj.shape),
            }
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(
        f"cannot serialize {type(obj).__name__} (send numpy arrays, numbers, str, bytes, lists, dicts)"
    )


def _dtype(value: Any) -> np.dtype:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str):
        raise ProtocolError(f"numpy 'dtype' must be a dtype string like '<f4', got {type(value).__name__}")
    try:
        dtype = np.dtype(value)
    except (TypeError, ValueError):
        raise ProtocolError(f"unknown numpy dtype {value!r}") from None
    if dtype.kind not in _ALLOWED_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise ProtocolError(
            f"numpy dtype {value!r} is not allowed on the wire: only bool, int, uint and float arrays "
            "(object and void dtypes would need pickle)"
        )
    return dtype


def _decode(obj: dict[Any, Any]) -> Any:
    """msgpack ``object_hook``: openpi's marker maps back to numpy arrays (read-only views) and scalars."""
    if b"__ndarray__" in obj:
        dtype = _dtype(obj.get(b"dtype"))
        shape, data = obj.get(b"shape"), obj.get(b"data")
        if not isinstance(data, bytes):
            raise ProtocolError(f"numpy array 'data' must be msgpack bin, got {type(data).__name__}")
        if (
            not isinstance(shape, list | tuple)
            or len(shape) > _MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ProtocolError(
                f"numpy array 'shape' must be a list of at most {_MAX_NDIM} ints >= 0, got {shape!r}"
            )
        expected = math.prod(shape) * dtype.itemsize
        if expected != len(data):
            raise ProtocolError(
                f"numpy array of shape {list(shape)} and dtype {dtype.str!r} needs {expected} bytes, got {len(data)}"
            )
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    if b"__npgeneric__" in obj:
        dtype = _dtype(obj.get(b"dtype"))
        value = obj.get(b"data")
        if not isinstance(value, bool | int | float):
            raise ProtocolError(f"numpy scalar 'data' must be a number, got {type(value).__name__}")
        try:
            return dtype.type(value)
        except (OverflowError, ValueError):
            raise ProtocolError(f"numpy scalar {value!r} does not fit dtype {dtype.str!r}") from None
    return obj


def pack(obj: Any) -> bytes:
    """Serialize ``obj`` (dicts, lists, str, bytes, numbers, numpy arrays/scalars) to one binary frame."""
    return msgpack.packb(obj, default=_encode, use_bin_type=True)


def unpack(frame: bytes, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Any:
    """Parse one binary frame; raises ``ProtocolError`` (a one-line, client-safe message) on anything invalid."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise ProtocolError(f"expected a binary frame, got {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise ProtocolError(
            f"frame of {len(frame)} bytes exceeds the limit of {max_bytes} bytes "
            f"({max_bytes / 2**20:g} MiB); send smaller images or raise the server's --max-frame-mb"
        )
    try:
        # strict_map_key=False: openpi's marker keys are bin, not str; raw=False decodes str as str.
        return msgpack.unpackb(frame, object_hook=_decode, raw=False, strict_map_key=False)
    except ProtocolError:
        raise
    except (msgpack.UnpackException, ValueError, TypeError) as e:
        raise ProtocolError(f"malformed msgpack frame: {type(e).__name__}: {str(e)[:200]}") from None
    except RecursionError:
        raise ProtocolError("malformed msgpack frame: nested too deeply") from None
