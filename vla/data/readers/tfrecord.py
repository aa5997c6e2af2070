"""Reading TFRecord files and ``tf.train.Example`` protos with numpy only (no TensorFlow, no protobuf).

A TFRecord file is a sequence of records, each framed as::

    uint64 length (LE) | uint32 masked_crc32c(length bytes) | data[length] | uint32 masked_crc32c(data)

An ``Example`` is ``Features{map<string, Feature> feature = 1}`` wrapped in field 1; a ``Feature`` holds one
of ``bytes_list`` (1), ``float_list`` (2, packed float32) or ``int64_list`` (3, packed varints). Decoded
feature values are ``np.ndarray`` float32 / int64 (flat) or a ``list`` of zero-copy ``memoryview`` slices.

CRC32C comes from ``google-crc32c`` (a dependency; hardware CRC in its C extension).
The encoders (records, Examples) live with the writer, ``vla.data.writers.rlds``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection, Iterator
from pathlib import Path

import google_crc32c
import numpy as np

from vla.data.readers.base import DatasetFormatError

FeatureValue = np.ndarray | list[memoryview]
"""A decoded ``Feature``: flat float32 / int64 array, or a list of byte strings (zero-copy views)."""

_HEADER = struct.Struct("<QI")  # length, masked crc of the 8 length bytes
_U32 = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8

# ---- CRC32C (Castagnoli, reflected polynomial 0x82F63B78) --------------------------------------------------


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli) checksum of ``data`` as an unsigned 32-bit int."""
    return int(google_crc32c.value(bytes(data)))


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 and add a constant (so CRCs of CRCs stay distinct)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


# ---- TFRecord framing --------------------------------------------------------------------------------------


def scan_tfrecord(path: str | Path, fd: int | None = None) -> np.ndarray:
    """Index a TFRecord file by reading only the 12-byte headers and seeking over payloads.

    Returns int64 ``[num_records, 2]``: byte offset of each record's header and its payload length. The length
    CRC of every header is verified; a record cut short by the end of the file is an error.
    """
    path = Path(path)
    own = fd is None
    if own:
        fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        rows: list[tuple[int, int]] = []
        off = 0
        while off < size:
            head = os.pread(fd, 12, off)
            if len(head) < 12:
                raise DatasetFormatError(
                    f"{path}: truncated TFRecord: record {len(rows)} at byte {off} has a {len(head)}-byte "
                    f"header (need 12); the file was cut short — re-download or re-export this shard."
                )
            length, length_crc = _HEADER.unpack(head)
            if masked_crc32c(head[:8]) != length_crc:
                raise DatasetFormatError(
                    f"{path}: CRC mismatch in the length header of record {len(rows)} at byte {off}; the "
                    f"shard is corrupt (or not a TFRecord file) — re-download or re-export it."
                )
            end = off + 12 + length + 4
            if end > size:
                raise DatasetFormatError(
                    f"{path}: truncated TFRecord: record {len(rows)} at byte {off} needs {length + 16} bytes "
                    f"but the file ends after {size - off}; re-download or re-export this shard."
                )
            rows.append((off, length))
            off = end
        return np.asarray(rows, dtype=np.int64).reshape(-1, 2)
    finally:
        if own:
            os.close(fd)


def read_record(
    fd: int, path: str | Path, offset: int, length: int, index: int, verify: bool = True
) -> bytes:
    """Payload of the record whose header starts at ``offset`` (from ``scan_tfrecord``); data CRC checked."""
    blob = os.pread(fd, length + 4, offset + 12)
    if len(blob) < length + 4:
        raise DatasetFormatError(
            f"{path}: truncated TFRecord: record {index} at byte {offset} is cut short (file changed after "
            f"indexing?); re-download or re-export this shard."
        )
    data = blob[:length]
    if verify and masked_crc32c(data) != _U32.unpack_from(blob, length)[0]:
        raise DatasetFormatError(
            f"{path}: CRC mismatch in the payload of record {index} at byte {offset}; the shard is corrupt — "
            f"re-download or re-export it."
        )
    return data


def iter_tfrecord(path: str | Path, verify: bool = True) -> Iterator[bytes]:
    """Every record payload of a TFRecord file, in file order."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for i, (offset, length) in enumerate(scan_tfrecord(path, fd).tolist()):
            yield read_record(fd, path, offset, length, i, verify)
    finally:
        os.close(fd)


# ---- protobuf wire format ----------------------------------------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    result, shift = b & 0x7F, 7
    while True:
        pos += 1
        b = buf[pos]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos + 1
        shift += 7
        if shift > 63:
            raise DatasetFormatError("malformed tf.train.Example: varint longer than 10 bytes")


def _skip(buf: bytes, pos: int, wire: int) -> int:
    if wire == 0:
        return _varint(buf, pos)[1]
    if wire == 1:
        return pos + 8
    if wire == 2:
        n, pos = _varint(buf, pos)
        return pos + n
    if wire == 5:
        return pos + 4
    raise DatasetFormatError(f"malformed tf.train.Example: unsupported wire type {wire}")


def decode_varints(raw: np.ndarray) -> np.ndarray:
    """Concatenated varints (uint8 array) -> int64 array, vectorized (negative int64 use 10-byte varints)."""
    if raw.size == 0:
        return np.zeros(0, dtype=np.int64)
    if raw.max() < 0x80:  # all single-byte: bools, small ints — the common case in RLDS
        return raw.astype(np.int64)
    term = raw < 0x80
    if not term[-1]:
        raise DatasetFormatError("malformed tf.train.Example: int64 list ends inside a varint")
    ends = np.flatnonzero(term)
    starts = np.concatenate([[0], ends[:-1] + 1])
    pos = np.arange(raw.size) - np.repeat(starts, ends - starts + 1)
    if pos.max() > 9:
        raise DatasetFormatError("malformed tf.train.Example: varint longer than 10 bytes")
    parts = (raw & 0x7F).astype(np.uint64) << (7 * pos).astype(np.uint64)
    return np.bitwise_or.reduceat(parts, starts).view(np.int64)


def _decode_list(buf: bytes, pos: int, end: int, kind: int) -> FeatureValue:
    """Body of a BytesList (1), FloatList (2) or Int64List (3) spanning ``buf[pos:end]``."""
    view = memoryview(buf)
    items: list[memoryview] = []
    chunks: list[np.ndarray] = []
    while pos < end:
        tag, pos = _varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if field != 1:
            pos = _skip(buf, pos, wire)
        elif wire == 2:
            n, pos = _varint(buf, pos)
            if pos + n > end:
                raise DatasetFormatError("malformed tf.train.Example: list value runs past its feature")
            if kind == 1:
                items.append(view[pos : pos + n])
            elif kind == 2:
                if n % 4:
                    raise DatasetFormatError(
                        "malformed tf.train.Example: packed float list not a multiple of 4 bytes"
                    )
                chunks.append(np.frombuffer(buf, dtype="<f4", count=n // 4, offset=pos))
            else:
                chunks.append(decode_varints(np.frombuffer(buf, dtype=np.uint8, count=n, offset=pos)))
            pos += n
        elif wire == 5 and kind == 2:  # unpacked float (legal, rare)
            chunks.append(np.frombuffer(buf, dtype="<f4", count=1, offset=pos))
            pos += 4
        elif wire == 0 and kind == 3:  # unpacked int64 (legal, rare)
            val, pos = _varint(buf, pos)
            chunks.append(np.asarray([val], dtype=np.uint64).view(np.int64))
        else:
            raise DatasetFormatError(f"malformed tf.train.Example: wire type {wire} in a list of kind {kind}")
    if kind == 1:
        return items
    dtype = np.float32 if kind == 2 else np.int64
    if not chunks:
        return np.zeros(0, dtype=dtype)
    return chunks[0].astype(dtype) if len(chunks) == 1 else np.concatenate(chunks).astype(dtype)


def parse_example(buf: bytes, keys: Collection[str] | None = None) -> dict[str, FeatureValue]:
    """Decode a serialized ``tf.train.Example`` into ``{feature key: value}`` (see ``FeatureValue``).

    ``keys`` restricts decoding to those features (others are skipped without touching their payload). A
    feature with no list set decodes to an empty list. Malformed input raises ``DatasetFormatError``.
    """
    out: dict[str, FeatureValue] = {}
    try:
        pos, end = 0, len(buf)
        while pos < end:
            tag, pos = _varint(buf, pos)
            if tag != 0x0A:  # not Example.features
                pos = _skip(buf, pos, tag & 7)
                continue
            n, pos = _varint(buf, pos)
            fend = pos + n
            while pos < fend:  # Features: repeated map entry (field 1)
                tag, pos = _varint(buf, pos)
                n, pos = _varint(buf, pos)
                eend = pos + n
                if tag != 0x0A:
                    pos = eend
                    continue
                name, value = None, None
                while pos < eend:  # map entry: key (1), value Feature (2)
                    tag, pos = _varint(buf, pos)
                    n, pos = _varint(buf, pos)
                    if tag == 0x0A:
                        name = buf[pos : pos + n].decode("utf-8")
                    elif tag == 0x12:
                        value = (pos, pos + n)
                    pos += n
                if name is None or (keys is not None and name not in keys):
                    continue
                out[name] = _decode_feature(buf, *value) if value else []
        if pos != end:
            raise DatasetFormatError(
                "malformed tf.train.Example: a length field runs past the end of the record"
            )
    except (IndexError, UnicodeDecodeError) as e:
        raise DatasetFormatError(f"malformed tf.train.Example ({type(e).__name__}: {e})") from None
    return out


def _decode_feature(buf: bytes, pos: int, end: int) -> FeatureValue:
    value: FeatureValue = []
    while pos < end:  # a Feature holds one of bytes_list (1), float_list (2), int64_list (3)
        tag, pos = _varint(buf, pos)
        n, pos = _varint(buf, pos)
        if pos + n > end:
            raise DatasetFormatError("malformed tf.train.Example: feature list runs past its entry")
        if tag in (0x0A, 0x12, 0x1A):
            value = _decode_list(buf, pos, pos + n, tag >> 3)
        pos += n
    return value


def read_feature(fd: int, offset: int, length: int, key: str) -> FeatureValue | None:
    """One feature of the Example in the record at ``offset`` (from ``scan_tfrecord``), reading only the map
    entries' small headers and that feature's bytes — e.g. an episode's ``steps/is_first`` without its images.

    No data-CRC check (the payload is not read). ``None`` when the key is absent or the layout is unusual (an
    entry whose value precedes its key); callers then fall back to ``parse_example`` on the whole record.
    """
    want = key.encode("utf-8")
    pos, end = offset + 12, offset + 12 + length
    try:
        while pos < end:  # Example fields: Features (1) holds the map entries
            head = os.pread(fd, 16, pos)
            tag, p = _varint(head, 0)
            if tag != 0x0A:
                return None
            n, p = _varint(head, p)
            pos, fend = pos + p, pos + p + n
            while pos < fend:  # each entry: 0x0a len | 0x0a keylen key | 0x12 featlen feature
                head = os.pread(fd, 32 + len(want), pos)
                tag, p = _varint(head, 0)
                n, p = _varint(head, p)
                entry_end = pos + p + n
                ktag, q = _varint(head, p)
                klen, q = _varint(head, q)
                if tag != 0x0A or ktag != 0x0A:
                    return None
                if head[q : q + klen] == want:
                    entry = os.pread(fd, entry_end - pos - q - klen, pos + q + klen)
                    vtag, r = _varint(entry, 0)
                    vlen, r = _varint(entry, r)
                    return _decode_feature(entry, r, r + vlen) if vtag == 0x12 else None
                pos = entry_end
    except IndexError:  # a header cut short: let the full parse report it with context
        return None
    return None
