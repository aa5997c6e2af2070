"""Generic key maps for LeRobot datasets: no entry needed when ``info.json`` says which registered body it is.

A LeRobot dataset gets a map when its ``robot_type`` names a registered embodiment (``configs/embodiments``) and
its ``observation.state`` / ``action`` widths equal that spec's ``state_dim`` / ``action_dim`` (both stored in
the spec's field order, as our own LeRobot writer and e.g. LeRobot's ALOHA datasets do). Prompt: ``task``.

Cameras ``observation.images.<name>`` map to slots by name (``camera_slot``): an exact slot name wins; else a
name with wrist/hand/gripper is ``left_wrist``/``right_wrist`` when it also says left/right, otherwise ``wrist``;
front/top/high/agentview/exterior/overhead/main/static/scene -> ``primary``; side/low -> ``secondary``. Names are
matched as whole alphabetic tokens (``cam_low`` -> low, ``wrist45_image`` -> wrist). A second camera for an
occupied ``primary`` spills to ``secondary``; cameras left without a slot the spec has are not used (listed in the
map's ``notes``). A spec whose ``extra.lerobot_cameras`` maps slots to image keys (``primary:
observation.images.phone``) uses exactly that mapping instead, for camera names no heuristic knows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from vla.data.keymaps import KeyMap, raw
from vla.data.readers.base import DatasetReader
from vla.embodiments import EMBODIMENTS, EmbodimentSpec
from vla.types import IMAGE_SLOTS

IMAGE_PREFIX = "observation.images."
STATE_KEY = "observation.state"
ACTION_KEY = "action"
TASK_KEY = "task"
#: ``extra`` key of an embodiment spec mapping camera slots to LeRobot image keys, overriding the name heuristics
CAMERAS_EXTRA = "lerobot_cameras"

_WRIST = {"wrist", "hand", "gripper"}
_PRIMARY = {"front", "top", "high", "agentview", "exterior", "overhead", "main", "static", "scene"}
_SECONDARY = {"side", "low"}


def camera_slot(name: str) -> str | None:
    """The camera slot a camera called ``name`` most likely fills (see the module docstring), or None."""
    n = name.lower()
    if n in IMAGE_SLOTS:
        return n
    tokens = set(re.findall(r"[a-z]+", n))
    if tokens & _WRIST:
        if "left" in tokens:
            return "left_wrist"
        if "right" in tokens:
            return "right_wrist"
        return "wrist"
    if tokens & _PRIMARY:
        return "primary"
    if tokens & _SECONDARY:
        return "secondary"
    return None


def assign_camera_slots(names: Sequence[str], allowed: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``(slot -> camera name, unused names)`` for cameras ``names`` (in order), using only ``allowed`` slots."""
    slots: dict[str, str] = {}
    unused: list[str] = []
    for name in names:
        slot = camera_slot(name)
        if slot == "primary" and "primary" in slots:
            slot = "secondary"
        if slot is None or slot not in allowed or slot in slots:
            unused.append(name)
            continue
        slots[slot] = name
    return slots, unused


def action_space_of(spec: EmbodimentSpec) -> str:
    """Coarse action space from the spec's non-gripper action fields (``joint_pos``, ``eef_delta``, ...)."""
    kinds = {(f.kind, f.absolute) for f in spec.action if f.kind != "gripper"}
    if any(k == "joint_vel" for k, _ in kinds):
        return "joint_vel"
    if any(k == "joint_pos" for k, _ in kinds):
        return "joint_pos" if all(a for _, a in kinds) else "joint_delta"
    return "eef_abs" if kinds and all(a for _, a in kinds) else "eef_delta"


def _camera_slots(spec: EmbodimentSpec, cams: list[str]) -> tuple[dict[str, str], list[str]]:
    """``(slot -> camera name, unused names)``: the spec's own ``extra.lerobot_cameras`` when it has one (camera
    names no heuristic knows, e.g. a drafted spec's ``phone``), else ``assign_camera_slots`` by name."""
    fixed = spec.extra.get(CAMERAS_EXTRA)
    if not isinstance(fixed, dict):
        return assign_camera_slots(cams, list(spec.cameras))
    named = {slot: str(key).removeprefix(IMAGE_PREFIX) for slot, key in fixed.items() if slot in spec.cameras}
    slots = {slot: name for slot, name in named.items() if name in cams}
    return slots, [c for c in cams if c not in slots.values()]


def _build(reader: DatasetReader) -> tuple[KeyMap | None, str]:
    robot = reader.robot_type
    if not robot:
        return None, "the dataset stores no robot_type"
    if robot not in EMBODIMENTS:
        return (
            None,
            f"robot_type {robot!r} is not a registered embodiment (known: {', '.join(EMBODIMENTS.names())})",
        )
    spec = EMBODIMENTS.get(robot)
    feats = reader.features()
    widths = {k: (f.shape[0] if len(f.shape) == 1 else (1 if not f.shape else -1)) for k, f in feats.items()}
    if ACTION_KEY not in feats or widths[ACTION_KEY] != spec.action_dim:
        got = f"width {widths[ACTION_KEY]}" if ACTION_KEY in feats else "no such feature"
        return None, f"{ACTION_KEY!r} must have width {spec.action_dim} for embodiment {robot!r}, found {got}"
    if spec.state_dim and (STATE_KEY not in feats or widths[STATE_KEY] != spec.state_dim):
        got = f"width {widths[STATE_KEY]}" if STATE_KEY in feats else "no such feature"
        return None, f"{STATE_KEY!r} must have width {spec.state_dim} for embodiment {robot!r}, found {got}"
    cams = [k[len(IMAGE_PREFIX) :] for k in reader.image_keys() if k.startswith(IMAGE_PREFIX)]
    slots, unused = _camera_slots(spec, cams)
    features = {ACTION_KEY: f"float32[{spec.action_dim}]", TASK_KEY: "string"}
    state = ()
    if spec.state_dim:
        features[STATE_KEY] = f"float32[{spec.state_dim}]"
        state = (raw(STATE_KEY),)
    km = KeyMap(
        dataset=reader.name,
        embodiment=spec.name,
        cameras={slot: IMAGE_PREFIX + name for slot, name in slots.items()},
        language=TASK_KEY,
        control_hz=float(reader.fps or spec.control_hz),
        action_space=action_space_of(spec),
        state=state,
        action=(raw(ACTION_KEY),),
        features=features,
        notes=f"generic LeRobot map from robot_type {robot!r}"
        + (f"; cameras without a slot: {unused}" if unused else ""),
    )
    return km, "applies"


def generic_keymap(reader: DatasetReader) -> KeyMap | None:
    """A generic map for a LeRobot dataset whose ``robot_type`` is a registered embodiment with matching widths."""
    return _build(reader)[0]


def generic_keymap_reason(reader: DatasetReader) -> str:
    """Why ``generic_keymap`` does (``"applies"``) or does not apply to ``reader`` (for error messages)."""
    return _build(reader)[1]


__all__ = [
    "CAMERAS_EXTRA",
    "action_space_of",
    "assign_camera_slots",
    "camera_slot",
    "generic_keymap",
    "generic_keymap_reason",
]
