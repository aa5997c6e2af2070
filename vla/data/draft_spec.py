"""``vla embodiment draft``: an ``EmbodimentSpec`` YAML drafted from a dataset of a robot no config describes yet.

What the data tells: state/action widths and dimension names (LeRobot ``features[...].names``, else
``state_0..``), cameras and their sizes, the control rate (fps) and per-dimension limits (the data's min/max
widened by a margin; one pass over the low-dimensional data, never the images). What it only hints at is guessed
and marked ``TODO`` in the YAML with the evidence: field kinds from dimension names (``x y z`` -> ``eef_pos``,
three/four/six ``roll``/``qx``/``rot`` dims -> ``eef_rot``), units from the value ranges, the gripper (a dim named
``grip``/``finger``, else a last dim within [0, 1] or with two values), absolute vs delta actions (is ``a_t``
closer to ``s_{t+1}`` or to ``s_{t+1} - s_t`` on the dims state and action share), camera slots (by name:
``vla.data.keymaps.lerobot.camera_slot``, else the first free of primary/secondary).

For a LeRobot dataset the draft also writes ``extra.lerobot_cameras`` (slot -> image key), which the generic
LeRobot key map follows, and names the spec like ``--name``: the dataset maps onto it when that is its
``robot_type``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from vla.data.keymaps.lerobot import CAMERAS_EXTRA, IMAGE_PREFIX, camera_slot
from vla.data.readers import open_dataset
from vla.data.readers.base import DatasetReader, FeatureInfo
from vla.types import IMAGE_SLOTS

STATE_KEYS = ("observation.state", "observation/state", "observation/proprio", "observation/joint_pos")
ACTION_KEYS = ("action",)
MARGIN = 0.05  # limits = data range widened by 5 % of the range on each side
_GRIPPER = ("grip", "finger", "claw")
_ROT = {"roll", "pitch", "yaw", "rx", "ry", "rz", "qx", "qy", "qz", "qw", "quat", "rot", "rotation", "euler"}
_POS = {"x", "y", "z", "pos", "position", "tx", "ty", "tz"}
_ROT_FORMATS = {3: "euler_xyz", 4: "quat_xyzw", 6: "rot6d"}
_FREE_SLOTS = ("primary", "secondary")
FieldDraft = tuple[list[str], dict[str, Any]]  # (TODO comment lines, the field as written to the YAML)


@dataclass
class _Column:
    """Running per-dim min/max of one ``[T, D]`` feature and up to 3 distinct values of each dim."""

    lo: np.ndarray | None = None
    hi: np.ndarray | None = None
    values: list[set[float]] = field(default_factory=list)

    def add(self, x: np.ndarray) -> None:
        if not len(x):
            return
        self.lo = x.min(0) if self.lo is None else np.minimum(self.lo, x.min(0))
        self.hi = x.max(0) if self.hi is None else np.maximum(self.hi, x.max(0))
        if not self.values:
            self.values = [set() for _ in range(x.shape[1])]
        for d, seen in enumerate(self.values):
            if len(seen) <= 2:
                seen.update(np.unique(x[:, d])[:3].tolist())


@dataclass
class _Scan:
    """One pass over every episode's state and action: ranges, plus absolute-vs-delta evidence per paired dim:
    sums of ``|a_t - s_{t+1}|`` (absolute targets) and ``|a_t - (s_{t+1} - s_t)|`` (deltas)."""

    state: _Column
    action: _Column
    abs_err: np.ndarray
    delta_err: np.ndarray
    count: int = 0


def _pick(features: dict[str, FeatureInfo], keys: tuple[str, ...], what: str, path: Path) -> str:
    for key in keys:
        if key in features and features[key].kind == "tensor" and len(features[key].shape) == 1:
            return key
    present = {k: f"{f.kind}{list(f.shape)}" for k, f in sorted(features.items())}
    raise ValueError(
        f"{path}: no {what} feature (looked for {list(keys)}, a 1-d numeric feature); the dataset has {present}. "
        "Rename the feature, or write the spec by hand (configs/embodiments/README.md)"
    )


def _dim_names(path: Path, key: str, width: int) -> list[str]:
    """LeRobot's per-dimension names of ``key`` (``names`` as a list, or ``{"motors": [...]}``), else generic."""
    info = path / "meta" / "info.json"
    if info.is_file():
        names = json.loads(info.read_text()).get("features", {}).get(key, {}).get("names")
        if isinstance(names, dict) and len(names) == 1:
            names = next(iter(names.values()))
        if isinstance(names, list) and all(isinstance(n, str) for n in names) and len(set(names)) == width:
            return [n.replace(" ", "_") for n in names]
    return [f"{key.split('.')[-1].split('/')[-1]}_{i}" for i in range(width)]


def _pairs(state_names: list[str], action_names: list[str]) -> tuple[list[int], list[int], str]:
    """State/action dims that measure the same quantity: equal names, else equal widths index by index."""
    common = [n for n in action_names if n in state_names]
    if common and not all(re.fullmatch(r"(state|action)_\d+", n) for n in common):
        return [state_names.index(n) for n in common], [action_names.index(n) for n in common], "by name"
    if len(state_names) == len(action_names):
        return list(range(len(state_names))), list(range(len(action_names))), "index by index (a guess)"
    return [], [], "no dims in common"


def _scan(
    reader: DatasetReader, state_key: str, action_key: str, pairs: tuple[list[int], list[int]]
) -> _Scan:
    si, ai = pairs
    scan = _Scan(_Column(), _Column(), np.zeros(len(ai)), np.zeros(len(ai)))
    for split in reader.splits():
        for e in range(reader.num_episodes(split)):
            steps = reader.read_episode(split, e).steps  # low-dim fields only: images stay on disk
            s = np.asarray(steps[state_key], np.float64)
            a = np.asarray(steps[action_key], np.float64)
            scan.state.add(s)
            scan.action.add(a)
            if ai and len(s) > 1:
                now, nxt, act = s[:-1, si], s[1:, si], a[:-1, ai]
                scan.abs_err += np.abs(act - nxt).sum(0)
                scan.delta_err += np.abs(act - (nxt - now)).sum(0)
                scan.count += len(act)
    if scan.state.lo is None or scan.action.lo is None:
        raise ValueError(f"{reader.path}: the dataset has no frames to draft a spec from")
    return scan


def _gripper_dims(names: list[str], col: _Column) -> tuple[list[int], str]:
    named = [i for i, n in enumerate(names) if any(g in n.lower() for g in _GRIPPER)]
    if named:
        return named, "named like a gripper"
    last = len(names) - 1
    lo, hi = float(col.lo[last]), float(col.hi[last])  # type: ignore[index]
    binary = len(col.values[last]) == 2
    if last > 0 and ((lo >= 0 and hi <= 1) or binary):
        return [last], f"GUESS: last dim, values {'binary' if binary else 'within [0, 1]'}"
    return [], "none found"


def _dim_kind(name: str) -> str:
    tokens = set(re.findall(r"[a-z]+", name.lower()))
    if tokens & _ROT and "joint" not in tokens:
        return "eef_rot"
    if tokens & _POS and "joint" not in tokens:
        return "eef_pos"
    return "joint_pos"


def _runs(names: list[str], grip: list[int]) -> list[tuple[str, list[int]]]:
    """Contiguous ``(kind, dims)`` runs; an ``eef_pos`` run must have 2-3 dims and an ``eef_rot`` run 3/4/6,
    else its dims are joints (``wrist_roll`` alone is a joint)."""
    kinds = ["gripper" if i in grip else _dim_kind(n) for i, n in enumerate(names)]
    runs: list[tuple[str, list[int]]] = []
    for i, k in enumerate(kinds):
        if runs and runs[-1][0] == k:
            runs[-1][1].append(i)
        else:
            runs.append((k, [i]))
    fixed: list[tuple[str, list[int]]] = []
    for k, idx in runs:
        ok = (k == "eef_pos" and len(idx) in (2, 3)) or (k == "eef_rot" and len(idx) in _ROT_FORMATS)
        k = k if ok or k in ("joint_pos", "gripper") else "joint_pos"
        if fixed and fixed[-1][0] == k == "joint_pos":
            fixed[-1][1].extend(idx)
        else:
            fixed.append((k, list(idx)))
    return fixed


def _units(kind: str, lo: np.ndarray, hi: np.ndarray, fmt: str | None) -> str:
    big = float(max(np.abs(lo).max(), np.abs(hi).max()))
    if kind in ("joint_pos", "eef_rot"):
        if fmt in ("quat_xyzw", "quat_wxyz", "rot6d"):
            return ""
        return "rad" if big <= 2 * math.pi * 1.05 else "deg"
    if kind == "eef_pos":
        return "m" if big <= 3 else "mm"
    return ""


def _fields(
    role: str, names: list[str], col: _Column, gripper: tuple[list[int], str], absolute: bool, source: str
) -> list[FieldDraft]:
    """``[(TODO comment lines, field dict)]`` for one of state/action; ``gripper`` = (its dims, why those)."""
    grip, grip_note = gripper
    lo, hi = col.lo, col.hi
    assert lo is not None and hi is not None
    span = np.where(hi > lo, hi - lo, np.maximum(np.abs(hi), 1.0))
    low, high = np.floor((lo - MARGIN * span) * 1e5) / 1e5, np.ceil((hi + MARGIN * span) * 1e5) / 1e5
    out: list[FieldDraft] = []
    used: set[str] = set()
    for kind, idx in _runs(names, grip):
        dims = [names[i] for i in idx]
        side = {re.split(r"[_.\-]", d.lower())[0] for d in dims}
        base = f"{side.pop()}_{kind}" if side in ({"left"}, {"right"}) else kind
        fname = base if base not in used else f"{base}_{sum(n.startswith(base) for n in used) + 1}"
        used.add(fname)
        fmt = None
        if kind == "eef_rot":
            fmt = _ROT_FORMATS[len(idx)]
            if fmt == "quat_xyzw" and dims[0].lower().endswith("w"):
                fmt = "quat_wxyz"
        units = _units(kind, lo[idx], hi[idx], fmt)
        bounded = bool(lo[idx].min() >= -1 and hi[idx].max() <= 1)
        todo = [f"TODO {role}.{fname}: kind {kind} is guessed from the dim names ({source})"]
        if units:
            todo.append(f"TODO units {units!r}: guessed from the value range; rad or deg, m or mm?")
        if fmt:
            todo.append(
                f"TODO rotation_format {fmt}: guessed from {len(idx)} dims; check the order and convention"
            )
        if kind == "gripper":
            todo = [
                f"TODO {role}.{fname}: gripper {grip_note}; set units to what 1 means (e.g. '1 = open, 0 = closed')"
            ]
        elif role == "action":
            todo.append("TODO absolute: see the absolute-vs-delta evidence at the top of the file")
        f: dict[str, Any] = {"name": fname, "kind": kind, "dims": dims, "units": units, "absolute": absolute}
        if fmt:
            f["rotation_format"] = fmt
        f["low"] = low[idx].tolist()
        f["high"] = high[idx].tolist()
        # Action grippers in [0, 1] stay unnormalized, as the OXE specs here do (configs/embodiments/README.md).
        f["normalization"] = "identity" if kind == "gripper" and role == "action" and bounded else "quantile"
        f["description"] = f"drafted from {source}"
        out.append((todo, f))
    return out


def _cameras(
    reader: DatasetReader, feats: dict[str, FeatureInfo], km: Any
) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """``(slot -> (image key, how it was chosen), unused keys)``: a registered key map's own cameras when the
    dataset has one, else by camera name, then the remaining cameras to the free primary/secondary slots."""
    keys = list(reader.image_keys())
    if km is not None and km.cameras:
        slots = {slot: (key, "the registered key map") for slot, key in km.cameras.items() if key in feats}
    else:
        slots = {}
        for key in keys:
            slot = camera_slot(key.split(".")[-1].split("/")[-1])
            if slot == "primary" and "primary" in slots:
                slot = "secondary"
            if slot is not None and slot in IMAGE_SLOTS and slot not in slots:
                slots[slot] = (key, "by its name")
        for key in [k for k in keys if k not in {v[0] for v in slots.values()}]:
            free = [s for s in _FREE_SLOTS if s not in slots]
            if free:
                slots[free[0]] = (key, "GUESS: first free slot")
    return slots, [k for k in keys if k not in {v[0] for v in slots.values()}]


def _action_mode(
    scan: _Scan, pairs: tuple[list[int], list[int], str], grip: tuple[set, set]
) -> tuple[bool, str]:
    """(absolute?, evidence): over paired non-gripper dims, is ``a_t`` nearer ``s_{t+1}`` or ``s_{t+1} - s_t``?"""
    si, ai, how = pairs
    keep = [j for j, (s, a) in enumerate(zip(si, ai)) if s not in grip[0] and a not in grip[1]]
    if not keep or not scan.count:
        return (
            True,
            "NO EVIDENCE: state and action share no non-gripper dims; absolute: true is a placeholder",
        )
    n = scan.count * len(keep)
    e_abs, e_delta = scan.abs_err[keep].sum() / n, scan.delta_err[keep].sum() / n
    numbers = (
        f"{len(keep)} state/action dims paired {how}: mean |a_t - s_(t+1)| = {e_abs:.3g}, "
        f"mean |a_t - (s_(t+1) - s_t)| = {e_delta:.3g}"
    )
    if e_abs < 0.5 * e_delta:
        return True, f"looks ABSOLUTE (targets near the next state); {numbers}"
    if e_delta < 0.5 * e_abs:
        return False, f"looks DELTA (near the change of state); {numbers}"
    return True, f"UNCLEAR (absolute: true is a placeholder); {numbers}"


def _dump(value: Any) -> str:
    """YAML of ``value`` with leaf lists/mappings inline (``dims: [a, b]``), as the configs are written."""
    scalars = isinstance(value, dict) and not any(isinstance(v, (dict, list)) for v in value.values())
    return yaml.safe_dump(value, sort_keys=False, default_flow_style=False if scalars else None, width=110)


def _comment(lines: list[str]) -> str:
    return "".join(f"# {line}\n" for line in lines)


def _rate(reader: DatasetReader, km: Any) -> tuple[float, str]:
    if reader.fps:
        return float(reader.fps), "the dataset's fps"
    if km is not None and km.control_hz:  # RLDS stores no rate; a registered key map knows it
        return float(km.control_hz), "the registered key map (the dataset stores no rate)"
    return 10.0, "TODO: a placeholder, the dataset stores no rate"


@dataclass(frozen=True)
class Draft:
    """A drafted spec and how each part was found: ``yaml_text()`` is the file, ``summary()`` what to print."""

    name: str
    dataset: Path
    robot_type: str | None
    state: list[FieldDraft]
    action: list[FieldDraft]
    control_hz: float
    rate_from: str
    cameras: dict[str, tuple[str, int, int, str]]  # slot -> (image key, height, width, how it was chosen)
    unused_cameras: list[str]
    action_evidence: str

    def notes(self) -> list[str]:
        if self.robot_type == self.name:
            return []
        if self.robot_type is None:
            return [
                "the dataset stores no robot_type: a LeRobot dataset maps onto this spec once its meta/info.json "
                f"says robot_type: {self.name}; other formats need a key map under vla/data/keymaps/"
            ]
        return [
            f"the dataset's robot_type is {self.robot_type!r}: a LeRobot dataset maps onto the spec whose name "
            f"equals its robot_type, so name the spec {self.robot_type!r} to train on it"
        ]

    def yaml_text(self) -> str:
        lines = [
            f"Drafted by `vla embodiment draft` from {self.dataset}. Check every TODO before training.",
            f"absolute vs delta actions: {self.action_evidence}.",
            f"limits: the data's min/max widened by {MARGIN:.0%} of the range; replace them with the robot's limits.",
            *self.notes(),
        ]
        text = _comment(lines) + _dump(
            {
                "format_version": 1,
                "name": self.name,
                "robot": self.name,
                "description": f"drafted by `vla embodiment draft` from {self.dataset.name}",
            }
        )
        text += _comment([f"control rate from {self.rate_from}"]) + _dump({"control_hz": self.control_hz})
        text += _comment(["TODO: default action-chunk length (one second of actions)"])
        text += _dump({"chunk_length": max(1, round(self.control_hz))})
        text += _comment([f"TODO camera slot: {s} <- {c[0]} ({c[3]})" for s, c in self.cameras.items()])
        if self.unused_cameras:
            text += _comment([f"cameras without a slot (unused): {self.unused_cameras}"])
        text += "cameras:\n" if self.cameras else "cameras: {}\n"
        for slot, (key, h, w, _) in self.cameras.items():
            text += "  " + _dump({slot: {"height": h, "width": w, "description": key}})
        for role, fields in (("state", self.state), ("action", self.action)):
            text += f"{role}:\n" + "".join(_comment(todo) + _dump([f]) for todo, f in fields)
        text += _dump({"sources": [f"drafted from {self.dataset}"]})
        lerobot = {slot: c[0] for slot, c in self.cameras.items() if c[0].startswith(IMAGE_PREFIX)}
        if lerobot:
            text += _comment(["slot -> LeRobot image key: the generic LeRobot key map follows this mapping"])
            text += _dump({"extra": {CAMERAS_EXTRA: lerobot}})
        return text

    def summary(self) -> list[str]:
        def layout(fields: list[FieldDraft]) -> str:
            width = sum(len(f["dims"]) for _, f in fields)
            return f"{width}: " + ", ".join(f"{f['name']}[{len(f['dims'])}] ({f['kind']})" for _, f in fields)

        cams = ", ".join(f"{s} <- {c[0]} {c[1]}x{c[2]} ({c[3]})" for s, c in self.cameras.items())
        lines = [
            f"embodiment {self.name!r} drafted from {self.dataset} (robot_type {self.robot_type!r})",
            f"  state  {layout(self.state)}",
            f"  action {layout(self.action)}",
            f"  control {self.control_hz:g} Hz from {self.rate_from}",
            f"  cameras: {cams or 'none'}",
            *([f"  cameras without a slot: {self.unused_cameras}"] if self.unused_cameras else []),
            f"  actions: {self.action_evidence}",
            *[f"note: {n}" for n in self.notes()],
            "check every TODO in the file: kinds and units, rotation formats, absolute vs delta, the gripper (and "
            "what 1 means), camera slots, limits",
        ]
        return lines


def _rate(reader: DatasetReader, km: Any) -> tuple[float, str]:
    if reader.fps:
        return float(reader.fps), "the dataset's fps"
    if km is not None and km.control_hz:  # RLDS stores no rate; a registered key map knows it
        return float(km.control_hz), "the registered key map (the dataset stores no rate)"
    return 10.0, "TODO: a placeholder, the dataset stores no rate"


def draft_spec(dataset: str | Path, name: str) -> Draft:
    """Draft the spec of ``dataset``'s robot under ``name`` (see the module docstring); nothing is written."""
    from vla.data.standardize import keymap_for

    reader = open_dataset(dataset)
    path = Path(dataset)
    feats = reader.features()
    state_key, action_key = _pick(feats, STATE_KEYS, "state", path), _pick(feats, ACTION_KEYS, "action", path)
    s_names = _dim_names(path, state_key, feats[state_key].shape[0])
    a_names = _dim_names(path, action_key, feats[action_key].shape[0])
    pairs = _pairs(s_names, a_names)
    scan = _scan(reader, state_key, action_key, pairs[:2])
    s_grip, a_grip = _gripper_dims(s_names, scan.state), _gripper_dims(a_names, scan.action)
    absolute, evidence = _action_mode(scan, pairs, (set(s_grip[0]), set(a_grip[0])))
    named = (
        "names from meta/info.json"
        if s_names[0] != f"{state_key.split('.')[-1].split('/')[-1]}_0"
        else "no names stored"
    )
    state = _fields("state", s_names, scan.state, s_grip, True, f"{state_key}, {named}")
    action = _fields("action", a_names, scan.action, a_grip, absolute, action_key)
    for _, f in action:  # a gripper command is a position, whatever the arm's actions are
        f["absolute"] = True if f["kind"] == "gripper" else absolute
    km = keymap_for(reader)
    hz, rate_from = _rate(reader, km)
    slots, unused = _cameras(reader, feats, km)
    cameras = {
        s: (key, int(feats[key].shape[0]), int(feats[key].shape[1]), how) for s, (key, how) in slots.items()
    }
    return Draft(name, path, reader.robot_type, state, action, hz, rate_from, cameras, unused, evidence)


def write_draft(dataset: str | Path, name: str, out: str | Path, *, overwrite: bool = False) -> Draft:
    """Draft, check that the YAML loads as an ``EmbodimentSpec`` (its own validation), then write ``out``."""
    from vla.embodiments import EmbodimentSpec

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it, or choose another --out")
    if out.suffix not in (".yaml", ".yml"):
        raise ValueError(
            f"--out {out}: must end in .yaml or .yml (how --embodiment tells a spec file from a name)"
        )
    draft = draft_spec(dataset, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(draft.yaml_text())
    try:
        EmbodimentSpec.from_yaml(tmp)
    except Exception:
        tmp.unlink()
        raise
    tmp.replace(out)
    return draft
