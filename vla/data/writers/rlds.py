"""A small writer of TFDS/RLDS directories, without TensorFlow, for tests, benchmarks and converters.

It writes what ``tfds.builder_from_directory`` reads: ``dataset_info.json``, ``features.json`` (TFDS
``FeaturesDict`` JSON layout) and shards ``NAME-SPLIT.tfrecord-XXXXX-of-YYYYY`` of framed ``tf.train.Example``
records with masked CRC32C. One record per episode, encoded as TFDS does: per-step features under
``steps/<path>`` with all steps concatenated (float64 stored as float32, bool/ints as int64, text/images as
bytes), per-episode features under ``episode_metadata/<path>``.

An episode to write is ``{"steps": {name: [T, ...] array | list of T str/bytes}, "episode_metadata": {...}}``
with raw names such as ``observation/state`` (images: uint8 ``[T, H, W, C]``, or already-encoded bytes).
``droid_features`` / ``synthetic_droid_episode`` build DROID-shaped data (the published RLDS feature spec:
droid-dataset/droid docs/the-droid-dataset.md).
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vla.data.nested import unflatten
from vla.data.readers.tfds_spec import DEFAULT_TEMPLATE, shard_name
from vla.data.readers.tfrecord import masked_crc32c

_TFDS = "tensorflow_datasets.core.features."
_CLASS_PATH = {
    "FeaturesDict": "features_dict.FeaturesDict",
    "Dataset": "dataset_feature.Dataset",
    "Tensor": "tensor_feature.Tensor",
    "Scalar": "scalar.Scalar",
    "Image": "image_feature.Image",
    "Text": "text_feature.Text",
}


@dataclass(frozen=True)
class Feature:
    """A leaf of the spec: ``cls`` is ``Tensor``/``Scalar``/``Image``/``Text``; ``dtype`` a numpy name
    (``"string"`` for text); ``shape`` per step (per episode for metadata); ``encoding`` ``jpeg``/``png``
    for images."""

    cls: str
    dtype: str = "float32"
    shape: tuple[int, ...] = ()
    encoding: str = "none"
    description: str = ""


def tensor(shape: Sequence[int], dtype: str = "float32", description: str = "") -> Feature:
    return Feature("Tensor", dtype, tuple(shape), "none", description)


def scalar(dtype: str = "float32", description: str = "") -> Feature:
    return Feature("Scalar", dtype, (), "none", description)


def image(shape: Sequence[int], encoding: str = "jpeg", description: str = "") -> Feature:
    return Feature("Image", "uint8", tuple(shape), encoding, description)


def text(description: str = "") -> Feature:
    return Feature("Text", "string", (), "none", description)


# ---- features.json / dataset_info.json ---------------------------------------------------------------------


def _leaf_json(f: Feature) -> dict[str, Any]:
    node: dict[str, Any] = {"pythonClassName": _TFDS + _CLASS_PATH[f.cls]}
    dims = {"dimensions": [str(d) for d in f.shape]} if f.shape else {}
    if f.cls in ("Tensor", "Scalar"):
        node["tensor"] = {"shape": dims, "dtype": f.dtype, "encoding": "none"}
    elif f.cls == "Image":
        node["image"] = {"shape": dims, "dtype": "uint8", "encodingFormat": f.encoding}
    else:
        node["text"] = {}
    if f.description:
        node["description"] = f.description
    return node


def _dict_json(leaves: Mapping[str, Feature]) -> dict[str, Any]:
    """Nested ``FeaturesDict`` JSON from ``{"a/b/c": Feature}``."""
    return _tree_json(unflatten(leaves))


def _tree_json(tree: dict[str, Any]) -> dict[str, Any]:
    features = {k: _leaf_json(v) if isinstance(v, Feature) else _tree_json(v) for k, v in tree.items()}
    return {"pythonClassName": _TFDS + _CLASS_PATH["FeaturesDict"], "featuresDict": {"features": features}}


def features_json(steps: Mapping[str, Feature], metadata: Mapping[str, Feature]) -> dict[str, Any]:
    """``features.json`` of an RLDS dataset: ``{"steps": Dataset(FeaturesDict), "episode_metadata": ...}``."""
    sequence = {"feature": _dict_json(steps), "length": "-1"}
    top: dict[str, Any] = {"steps": {"pythonClassName": _TFDS + _CLASS_PATH["Dataset"], "sequence": sequence}}
    if metadata:
        top["episode_metadata"] = _dict_json(metadata)
    return {"pythonClassName": _TFDS + _CLASS_PATH["FeaturesDict"], "featuresDict": {"features": top}}


# ---- wire format: varints, Examples, framed records --------------------------------------------------------


def encode_varints(values: np.ndarray) -> bytes:
    """int64 array -> concatenated varints (two's complement, so negatives take 10 bytes), vectorized."""
    v = np.ascontiguousarray(values, dtype=np.int64).view(np.uint64).ravel()
    if v.size == 0 or int(v.max()) < 0x80:
        return v.astype(np.uint8).tobytes()
    nbytes = np.ones(v.size, dtype=np.int64)
    for k in range(1, 10):
        nbytes += v >= np.uint64(1 << (7 * k))
    starts = np.concatenate([[0], np.cumsum(nbytes)[:-1]])
    out = np.zeros(int(nbytes.sum()), dtype=np.uint8)
    for k in range(10):
        m = nbytes > k
        byte = ((v[m] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        out[starts[m] + k] = byte | np.where(nbytes[m] > k + 1, 0x80, 0).astype(np.uint8)
    return out.tobytes()


def _len(n: int) -> bytes:
    """The varint after a length-delimited field's tag: the field's byte length ``n``."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_example(features: Mapping[str, Any]) -> bytes:
    """Serialize ``{key: value}`` as a ``tf.train.Example``: float arrays -> float_list (float32, as TF stores
    them), int/bool arrays -> int64_list (packed varints), sequences of ``bytes``/``str`` -> bytes_list."""
    entries = []
    for name, value in features.items():
        if isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
            if value.dtype.kind == "f":
                payload, kind = np.ascontiguousarray(value, dtype="<f4").tobytes(), 0x12
            else:
                payload, kind = encode_varints(value.astype(np.int64)), 0x1A
            body = (b"\x0a" + _len(len(payload)) + payload) if payload else b""
        else:
            items = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in value]
            body, kind = b"".join(b"\x0a" + _len(len(v)) + v for v in items), 0x0A
        feature = bytes([kind]) + _len(len(body)) + body
        key = name.encode("utf-8")
        entry = b"\x0a" + _len(len(key)) + key + b"\x12" + _len(len(feature)) + feature
        entries.append(b"\x0a" + _len(len(entry)) + entry)
    body = b"".join(entries)
    return b"\x0a" + _len(len(body)) + body


def encode_record(data: bytes) -> bytes:
    """One framed TFRecord: uint64 length, masked CRC32C of it, payload, masked CRC32C of the payload."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def write_tfrecord(path: str | Path, records: Iterable[bytes]) -> list[int]:
    """Write serialized protos to a TFRecord file; returns each payload's size in bytes."""
    sizes = []
    with open(path, "wb") as f:
        for data in records:
            f.write(encode_record(data))
            sizes.append(len(data))
    return sizes


# ---- episodes -> Examples -> shards ------------------------------------------------------------------------


def _encode_image(frame: Any, encoding: str, quality: int) -> bytes:
    if isinstance(frame, bytes | bytearray | memoryview):
        return bytes(frame)
    arr = np.asarray(frame, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr[:, :, 0] if arr.shape[-1] == 1 else arr).save(
        buf, format="JPEG" if encoding == "jpeg" else "PNG", quality=quality
    )
    return buf.getvalue()


def _flat_value(value: Any, f: Feature, name: str, length: int | None, quality: int) -> Any:
    """One feature as an Example value, shape checked against the spec (``length`` steps, or per episode)."""
    lead = () if length is None else (length,)
    if f.cls == "Image":
        frames = list(value) if length is not None else [value]
        if len(frames) != (length or 1):
            raise ValueError(f"'{name}': {len(frames)} frames for {length} steps")
        return [_encode_image(x, f.encoding, quality) for x in frames]
    if f.dtype == "string":
        items = list(np.asarray(value, dtype=object).ravel())
        if len(items) != int(np.prod(lead + f.shape)):
            raise ValueError(f"'{name}': {len(items)} strings, spec shape {lead + f.shape}")
        return items
    arr = np.asarray(value)
    if arr.shape != lead + f.shape:
        raise ValueError(f"'{name}': shape {arr.shape}, spec shape {lead + f.shape}")
    return arr.astype(f.dtype).ravel()


def episode_example(
    episode: Mapping[str, Any],
    steps: Mapping[str, Feature],
    metadata: Mapping[str, Feature],
    quality: int = 95,
) -> bytes:
    """One episode as a serialized ``tf.train.Example`` laid out as TFDS writes RLDS episodes."""
    step_values = episode["steps"]
    length = len(next(iter(step_values.values())))
    values: dict[str, Any] = {}
    for name, f in steps.items():
        values["steps/" + name] = _flat_value(step_values[name], f, name, length, quality)
    for name, f in metadata.items():
        values["episode_metadata/" + name] = _flat_value(
            episode["episode_metadata"][name], f, name, None, quality
        )
    return encode_example(values)


def write_rlds(
    path: str | Path,
    name: str,
    splits: Mapping[str, Sequence[Mapping[str, Any]]],
    steps: Mapping[str, Feature],
    metadata: Mapping[str, Feature] | None = None,
    num_shards: int | Mapping[str, int] = 1,
    shuffle_seed: int | None = None,
    version: str = "1.0.0",
    jpeg_quality: int = 95,
) -> dict[str, list[int]]:
    """Write a TFDS/RLDS version directory at ``path`` (e.g. ``.../droid_100/1.0.0``).

    ``splits`` maps a split name to its episodes; with ``shuffle_seed`` the episode order on disk is permuted
    as TFDS does. Returns, per split, the input index of each episode in file order (reader episode ``i`` is
    input episode ``order[split][i]``).
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    metadata = metadata or {}
    rng = np.random.default_rng(shuffle_seed)
    order: dict[str, list[int]] = {}
    split_infos = []
    for split, episodes in splits.items():
        perm = rng.permutation(len(episodes)) if shuffle_seed is not None else np.arange(len(episodes))
        n = num_shards if isinstance(num_shards, int) else num_shards[split]
        groups = np.array_split(perm, n)
        num_bytes = 0
        for i, group in enumerate(groups):
            records = (episode_example(episodes[j], steps, metadata, jpeg_quality) for j in group)
            file = root / shard_name(DEFAULT_TEMPLATE, name, split, "tfrecord", i, n)
            num_bytes += sum(write_tfrecord(file, records))
        order[split] = [int(j) for j in perm]
        split_infos.append(
            {
                "filepathTemplate": DEFAULT_TEMPLATE,
                "name": split,
                "numBytes": str(num_bytes),
                "shardLengths": [str(len(g)) for g in groups],
            }
        )
    info = {
        "citation": "",
        "description": f"{name}, written by vla.data.writers.rlds.",
        "fileFormat": "tfrecord",
        "moduleName": f"{name}.{name}_dataset_builder",
        "name": name,
        "releaseNotes": {version: "Written by vla."},
        "splits": split_infos,
        "version": version,
    }
    (root / "dataset_info.json").write_text(json.dumps(info, indent=2))
    (root / "features.json").write_text(json.dumps(features_json(steps, metadata), indent=4))
    return order


# ---- DROID-shaped data -------------------------------------------------------------------------------------


def droid_features(
    image_shape: Sequence[int] = (180, 320, 3),
) -> tuple[dict[str, Feature], dict[str, Feature]]:
    """(step features, episode_metadata features) of DROID's published RLDS release (float64 robot fields)."""
    cams = ("exterior_image_1_left", "exterior_image_2_left", "wrist_image_left")
    steps: dict[str, Feature] = {f"observation/{c}": image(image_shape) for c in cams}
    steps |= {
        "observation/cartesian_position": tensor([6], "float64", "EE pose xyz (m) + Euler (rad), base frame"),
        "observation/joint_position": tensor([7], "float64", "Joint angles (rad)"),
        "observation/gripper_position": tensor([1], "float64", "Gripper 0 = open .. 1 = closed"),
        "action_dict/cartesian_velocity": tensor([6], "float64"),
        "action_dict/cartesian_position": tensor([6], "float64"),
        "action_dict/joint_velocity": tensor([7], "float64"),
        "action_dict/joint_position": tensor([7], "float64"),
        "action_dict/gripper_position": tensor([1], "float64"),
        "action_dict/gripper_velocity": tensor([1], "float64"),
        "action": tensor([7], "float64", "cartesian_position + gripper_position"),
        "discount": scalar("float32"),
        "reward": scalar("float32"),
        "is_first": scalar("bool"),
        "is_last": scalar("bool"),
        "is_terminal": scalar("bool"),
        "language_instruction": text(),
        "language_instruction_2": text(),
        "language_instruction_3": text(),
    }
    metadata = {"file_path": text(), "recording_folderpath": text()}
    return steps, metadata


def synthetic_droid_episode(
    rng: np.random.Generator, length: int, image_shape: Sequence[int] = (180, 320, 3)
) -> dict[str, Any]:
    """A random DROID-shaped episode (smooth images so JPEG stays close; float64 values exact in float32)."""
    steps, _ = droid_features(image_shape)
    out: dict[str, Any] = {}
    h, w, c = image_shape
    ramp = np.linspace(0, 160, w, dtype=np.float32)[None, :, None] + np.linspace(0, 60, h)[:, None, None]
    for name, f in steps.items():
        if f.cls == "Image":
            shift = rng.uniform(0, 30, size=(length, 1, 1, c)).astype(np.float32)
            out[name] = np.clip(ramp[None] + shift + np.arange(length)[:, None, None, None], 0, 255).astype(
                np.uint8
            )
        elif f.cls == "Text":
            out[name] = [f"pick up the block {int(rng.integers(100))}"] * length
        elif f.dtype == "bool":
            out[name] = np.zeros(length, dtype=bool)
        else:
            out[name] = rng.normal(size=(length, *f.shape)).astype(np.float32).astype(f.dtype)
    out["is_first"][0] = True
    out["is_last"][-1] = out["is_terminal"][-1] = True
    lab = f"LAB{int(rng.integers(10))}"
    meta = {
        "file_path": f"{lab}/success/2023-07-0{length % 9 + 1}/trajectory.h5",
        "recording_folderpath": lab,
    }
    return {"steps": out, "episode_metadata": meta}
