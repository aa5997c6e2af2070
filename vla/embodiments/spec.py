"""``EmbodimentSpec``: what a robot body looks like to the model. Specs are data (YAML).

A spec lists the state and action vectors as ordered *fields* (e.g. 7 joint positions then 1 gripper), each with
its kind, units, absolute/delta, per-dim limits and normalization mode; the camera slots with their native
resolution; the control rate; and the default action-chunk length. It is stored inside every checkpoint and sent
in the server's handshake, so it must round-trip through ``to_dict``/``from_dict`` exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from vla.types import IMAGE_SLOTS

SPEC_FORMAT_VERSION = 1
FIELD_KINDS = ("joint_pos", "joint_vel", "eef_pos", "eef_rot", "eef_pose", "gripper", "base_vel", "other")
ROTATION_FORMATS = ("euler_xyz", "quat_xyzw", "quat_wxyz", "axis_angle", "rot6d")
NORM_MODES = ("quantile", "mean_std", "min_max", "binary", "identity")


class SpecError(ValueError):
    """An embodiment spec is malformed; the message names the file, the field and the allowed values."""


@dataclass(frozen=True)
class FieldSpec:
    """One contiguous segment of a state or action vector.

    ``dims`` names each dimension (its length is the segment width); ``low``/``high`` are per-dim safety limits
    (``None`` = unbounded); ``absolute`` is False for deltas/velocities relative to the current state.
    """

    name: str
    kind: str
    dims: tuple[str, ...]
    units: str = ""
    absolute: bool = True
    rotation_format: str | None = None
    low: tuple[float, ...] | None = None
    high: tuple[float, ...] | None = None
    normalization: str = "quantile"
    description: str = ""

    @property
    def width(self) -> int:
        return len(self.dims)

    def validate(self, where: str) -> None:
        if not self.name:
            raise SpecError(f"{where}: field without a name")
        if self.kind not in FIELD_KINDS:
            raise SpecError(f"{where}.{self.name}.kind must be one of {FIELD_KINDS}, got {self.kind!r}")
        if not self.dims:
            raise SpecError(f"{where}.{self.name}.dims must list at least one dimension name")
        if self.kind == "eef_rot" and self.rotation_format not in ROTATION_FORMATS:
            raise SpecError(
                f"{where}.{self.name}.rotation_format must be one of {ROTATION_FORMATS} for kind eef_rot, "
                f"got {self.rotation_format!r}"
            )
        if self.normalization not in NORM_MODES:
            raise SpecError(
                f"{where}.{self.name}.normalization must be one of {NORM_MODES}, got {self.normalization!r}"
            )
        for lim_name, lim in (("low", self.low), ("high", self.high)):
            if lim is not None and len(lim) != self.width:
                raise SpecError(
                    f"{where}.{self.name}.{lim_name} has {len(lim)} values but dims has {self.width}"
                )
        if self.low is not None and self.high is not None:
            for d, lo, hi in zip(self.dims, self.low, self.high):
                if not lo <= hi:
                    raise SpecError(f"{where}.{self.name}: limit low {lo} > high {hi} for dim {d!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> FieldSpec:
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise SpecError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(known)}")
        kw = dict(d)
        kw["dims"] = tuple(str(x) for x in kw.get("dims", ()))
        for lim in ("low", "high"):
            if kw.get(lim) is not None:
                kw[lim] = tuple(
                    math.inf if v is None and lim == "high" else -math.inf if v is None else float(v)
                    for v in kw[lim]
                )
        f = cls(**kw)
        f.validate(where)
        return f

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "dims": list(self.dims),
            "units": self.units,
        }
        d["absolute"] = self.absolute
        if self.rotation_format:
            d["rotation_format"] = self.rotation_format
        if self.low is not None:
            d["low"] = [None if math.isinf(v) else v for v in self.low]
        if self.high is not None:
            d["high"] = [None if math.isinf(v) else v for v in self.high]
        d["normalization"] = self.normalization
        if self.description:
            d["description"] = self.description
        return d


@dataclass(frozen=True)
class CameraSpec:
    """A camera slot's native resolution (the loader resizes to the model's resolution)."""

    height: int
    width: int
    description: str = ""


@dataclass(frozen=True)
class EmbodimentSpec:
    """A robot body and its state/action conventions. ``state_dim``/``action_dim`` are the summed field widths."""

    name: str
    state: tuple[FieldSpec, ...]
    action: tuple[FieldSpec, ...]
    cameras: dict[str, CameraSpec]
    control_hz: float
    chunk_length: int
    description: str = ""
    robot: str = ""
    sources: tuple[str, ...] = ()
    format_version: int = SPEC_FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def state_dim(self) -> int:
        return sum(f.width for f in self.state)

    @property
    def action_dim(self) -> int:
        return sum(f.width for f in self.action)

    def state_names(self) -> list[str]:
        return [f"{f.name}.{d}" for f in self.state for d in f.dims]

    def action_names(self) -> list[str]:
        return [f"{f.name}.{d}" for f in self.action for d in f.dims]

    def limits(self, which: str) -> tuple[np.ndarray, np.ndarray]:
        """Per-dim ``(low, high)`` float64 arrays for ``which`` in {"state", "action"}; unbounded dims are ±inf."""
        fields = self.state if which == "state" else self.action
        if not fields:
            return np.zeros(0, np.float64), np.zeros(0, np.float64)
        lo = np.concatenate(
            [np.asarray(f.low if f.low is not None else [-math.inf] * f.width) for f in fields]
        )
        hi = np.concatenate(
            [np.asarray(f.high if f.high is not None else [math.inf] * f.width) for f in fields]
        )
        return lo.astype(np.float64), hi.astype(np.float64)

    def norm_modes(self, which: str) -> list[str]:
        """Normalization mode of each dim of ``which`` ("state" or "action")."""
        fields = self.state if which == "state" else self.action
        return [f.normalization for f in fields for _ in f.dims]

    def validate(self, where: str = "") -> None:
        where = where or f"embodiment {self.name!r}"
        if not self.name:
            raise SpecError(f"{where}: 'name' is required")
        if self.format_version > SPEC_FORMAT_VERSION:
            raise SpecError(
                f"{where}: format_version {self.format_version} is newer than this vla ({SPEC_FORMAT_VERSION}); upgrade vla"
            )
        if not self.action:
            raise SpecError(f"{where}: 'action' must list at least one field")
        for which, fields in (("state", self.state), ("action", self.action)):
            names = [f.name for f in fields]
            if len(set(names)) != len(names):
                raise SpecError(f"{where}.{which}: duplicate field names {names}")
            for f in fields:
                f.validate(f"{where}.{which}")
        for slot in self.cameras:
            if slot not in IMAGE_SLOTS:
                raise SpecError(f"{where}.cameras: unknown slot {slot!r}; allowed: {IMAGE_SLOTS}")
        if not self.control_hz > 0:
            raise SpecError(f"{where}.control_hz must be > 0, got {self.control_hz}")
        if not self.chunk_length > 0:
            raise SpecError(f"{where}.chunk_length must be > 0, got {self.chunk_length}")

    # ---- (de)serialization --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "") -> EmbodimentSpec:
        where = where or f"embodiment {d.get('name', '?')!r}"
        if not isinstance(d, dict):
            raise SpecError(f"{where}: expected a mapping, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise SpecError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(known)}")
        for req in ("name", "action", "control_hz", "chunk_length"):
            if req not in d:
                raise SpecError(f"{where}: missing required key {req!r}")
        try:
            spec = cls(
                name=str(d["name"]),
                state=tuple(FieldSpec.from_dict(f, f"{where}.state") for f in d.get("state") or ()),
                action=tuple(FieldSpec.from_dict(f, f"{where}.action") for f in d["action"]),
                cameras={k: CameraSpec(**v) for k, v in (d.get("cameras") or {}).items()},
                control_hz=float(d["control_hz"]),
                chunk_length=int(d["chunk_length"]),
                description=str(d.get("description", "")),
                robot=str(d.get("robot", "")),
                sources=tuple(d.get("sources") or ()),
                format_version=int(d.get("format_version", SPEC_FORMAT_VERSION)),
                extra=dict(d.get("extra") or {}),
            )
        except TypeError as e:  # bad keys inside cameras etc.
            raise SpecError(f"{where}: {e}") from e
        spec.validate(where)
        return spec

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format_version": self.format_version, "name": self.name}
        if self.robot:
            d["robot"] = self.robot
        if self.description:
            d["description"] = self.description
        d["control_hz"] = self.control_hz
        d["chunk_length"] = self.chunk_length
        d["cameras"] = {
            k: {
                "height": c.height,
                "width": c.width,
                **({"description": c.description} if c.description else {}),
            }
            for k, c in self.cameras.items()
        }
        d["state"] = [f.to_dict() for f in self.state]
        d["action"] = [f.to_dict() for f in self.action]
        if self.sources:
            d["sources"] = list(self.sources)
        if self.extra:
            d["extra"] = self.extra
        return d

    @classmethod
    def from_yaml(cls, path: str | Path) -> EmbodimentSpec:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise SpecError(f"{path}: not valid YAML: {e}") from e
        except UnicodeDecodeError as e:
            raise SpecError(f"{path}: not UTF-8 text ({e}); restore the file") from None
        return cls.from_dict(data, where=str(path))

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
