"""TFDS directory metadata read without TensorFlow: ``features.json`` leaves and shard file names.

``features.json`` is the nested ``FeaturesDict`` spec of a TFDS builder; ``parse_features_json`` flattens it into
``RLDSFeature`` leaves (per-step under ``steps``, per-episode elsewhere) in file order. Shard files are named by
``dataset_info.json``'s ``filepathTemplate`` (default ``NAME-SPLIT.tfrecord-XXXXX-of-YYYYY``).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

from vla.data.readers.base import FeatureInfo

DEFAULT_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"  # TFDS default shard file name
SHARD_RE = re.compile(r"^(?P<name>.+)-(?P<split>[^-]+)\.(?P<fmt>[a-z_]+)-(?P<i>\d{5})-of-(?P<n>\d{5})$")


@dataclass(frozen=True)
class RLDSFeature:
    """One leaf of ``features.json``: ``key`` as stored in the Example (``steps/observation/state``),
    ``name`` as exposed (``observation/state``), ``cls`` the TFDS class (Tensor, Scalar, Image, Text,
    ClassLabel), numpy ``dtype`` (``"str"`` for text), per-step (or per-episode) ``shape`` with -1 for unknown
    dims, ``encoding`` (``none``/``bytes``/``zlib`` for tensors, ``jpeg``/``png`` for images)."""

    key: str
    name: str
    cls: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str
    in_steps: bool
    description: str = ""

    @property
    def kind(self) -> str:
        if self.cls == "Image":
            return "image"
        return "string" if self.dtype == "str" else "tensor"

    def info(self) -> FeatureInfo:
        return FeatureInfo(self.name, self.kind, self.dtype, self.shape, self.description)


def parse_features_json(spec: dict[str, Any], path: str = "features.json") -> list[RLDSFeature]:
    """Flatten a TFDS ``FeaturesDict`` JSON into leaves, in file order; unsupported classes are warned about
    and skipped."""
    leaves: list[RLDSFeature] = []

    def walk(node: dict[str, Any], parts: list[str], in_steps: bool) -> None:
        cls = node.get("pythonClassName", "").rsplit(".", 1)[-1]
        key = "/".join(parts)
        name = "/".join(parts[1:]) if parts and parts[0] in ("steps", "episode_metadata") else key
        desc = node.get("description", "")
        if cls == "FeaturesDict":
            for k, child in node["featuresDict"]["features"].items():
                walk(child, [*parts, k], in_steps)
        elif cls in ("Dataset", "Sequence") and parts == ["steps"]:
            walk(node["sequence"]["feature"], parts, True)
        elif cls in ("Tensor", "Scalar"):
            t = node["tensor"]
            dims = tuple(int(d) for d in t.get("shape", {}).get("dimensions", []))
            dtype = "str" if t["dtype"] == "string" else t["dtype"]
            leaves.append(RLDSFeature(key, name, cls, dtype, dims, t.get("encoding", "none"), in_steps, desc))
        elif cls == "Image":
            im = node["image"]
            dims = tuple(int(d) for d in im["shape"]["dimensions"])
            fmt = im.get("encodingFormat") or "png"
            leaves.append(RLDSFeature(key, name, cls, im.get("dtype", "uint8"), dims, fmt, in_steps, desc))
        elif cls == "Text":
            leaves.append(RLDSFeature(key, name, cls, "str", (), "none", in_steps, desc))
        elif cls == "ClassLabel":
            leaves.append(RLDSFeature(key, name, cls, "int64", (), "none", in_steps, desc))
        else:
            warnings.warn(
                f"{path}: feature '{key}' has unsupported TFDS class {cls!r}; it is skipped", stacklevel=3
            )

    walk(spec, [], False)
    return leaves


def shard_name(template: str, dataset: str, split: str, fmt: str, i: int, n: int) -> str:
    """A shard's file name from dataset_info.json's ``filepathTemplate`` (TFDS placeholders)."""
    values = {"DATASET": dataset, "SPLIT": split, "FILEFORMAT": fmt, "SHARD_X_OF_Y": f"{i:05d}-of-{n:05d}"}
    values |= {"SHARD_INDEX": f"{i:05d}", "NUM_SHARDS": f"{n:05d}"}
    for k, v in values.items():
        template = template.replace("{" + k + "}", v)
    return template
