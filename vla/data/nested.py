"""Nested dicts from flat ``/``-joined keys: LeRobot's flattened episode metadata, TFDS feature trees."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a/b": 1, "a/c": 2}`` -> ``{"a": {"b": 1, "c": 2}}`` (values kept as they are, in key order)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
