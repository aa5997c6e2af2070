"""``vla embodiment draft``: an ``EmbodimentSpec`` YAML drafted from a dataset of a robot no config describes yet.

What the data tells: state/action widths and dimension names (LeRobot ``features[...].names``), cameras and their
sizes (mapped to our camera slots by name: ``vla.data.keymaps.lerobot.camera_slot``), the control rate (fps) and
per-dimension limits (the data's min/max widened by a margin; one pass over the low-dimensional data, never the
images). What it cannot tell is marked ``TODO`` in the YAML: units, joint vs end-effector kinds, absolute vs delta
actions, the gripper convention. Name the spec like the dataset's ``robot_type`` so a LeRobot dataset maps onto it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from vla.data.keymaps.lerobot import assign_camera_slots
from vla.data.readers import open_dataset
from vla.types import IMAGE_SLOTS

STATE_KEYS = ("observation.state", "observation/state", "observation/proprio")
ACTION_KEYS = ("action",)


def _pick(features: dict[str, Any], keys: tuple[str, ...], what: str, path: Path) -> str:
    for key in keys:
        if key in features and features[key].kind == "tensor" and len(features[key].shape) == 1:
            return key
    raise ValueError(
        f"{path}: no {what} feature (looked for {list(keys)}, 1-d numeric); the dataset has "
        f"{sorted(features)}. Rename it, or write the spec by hand (configs/embodiments/README.md)"
    )


def _dim_names(path: Path, key: str, width: int) -> list[str]:
    """LeRobot's per-dimension names of ``key`` (``names`` as a list, or ``{"motors": [...]}``), else generic."""
    info = path / "meta" / "info.json"
    if info.is_file():
        names = json.loads(info.read_text()).get("features", {}).get(key, {}).get("names")
        if isinstance(names, dict) and len(names) == 1:
            names = next(iter(names.values()))
        if isinstance(names, list) and len(names) == width and all(isinstance(n, str) for n in names):
            return [n.replace(" ", "_") for n in names]
    return [f"{key.split('.')[-1].split('/')[-1]}_{i}" for i in range(width)]


def _ranges(reader: Any, keys: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    lo: dict[str, np.ndarray] = {}
    hi: dict[str, np.ndarray] = {}
    for split in reader.splits():
        for e in range(reader.num_episodes(split)):
            steps = reader.read_episode(split, e).steps
            for k in keys:
                x = np.asarray(steps[k], dtype=np.float64)
                lo[k] = np.minimum(lo[k], x.min(0)) if k in lo else x.min(0)
                hi[k] = np.maximum(hi[k], x.max(0)) if k in hi else x.max(0)
    return {k: (lo[k], hi[k]) for k in keys}


def _fields(names: list[str], lo: np.ndarray, hi: np.ndarray, margin: float, role: str) -> list[dict]:
    """One ``joint_pos`` field for the arm dims and a ``gripper`` field for dims named like a gripper (or, for
    actions, a last dim whose values stay within [0, 1]: a guess, marked so)."""
    span = np.maximum(hi - lo, 1e-6)
    low, high = (lo - margin * span).round(5).tolist(), (hi + margin * span).round(5).tolist()
    grip = [i for i, n in enumerate(names) if "grip" in n.lower()]
    if not grip and role == "action" and len(names) > 1 and lo[-1] >= 0 and hi[-1] <= 1:
        grip = [len(names) - 1]
    arm = [i for i in range(len(names)) if i not in grip]
    out = []
    for kind, idx in (("joint_pos", arm), ("gripper", grip)):
        if not idx:
            continue
        if idx != list(range(idx[0], idx[-1] + 1)):
            raise ValueError(f"{role}: gripper dims {grip} sit between arm dims; write this spec by hand")
        out.append(
            {
                "name": "arm" if kind == "joint_pos" else "gripper",
                "kind": kind,
                "dims": [names[i] for i in idx],
                "units": "TODO",
                "absolute": True,
                "low": [low[i] for i in idx],
                "high": [high[i] for i in idx],
                "normalization": "quantile",
                "description": f"TODO: drafted from the data ({'guessed gripper' if kind == 'gripper' else 'kind guessed'})",
            }
        )
    return out


def _cameras(reader: Any, feats: dict[str, Any], km: Any) -> tuple[dict[str, dict], list[str]]:
    """Camera slot -> {height, width, description}: a registered key map's own mapping when the dataset has one,
    else by camera name (``wrist`` -> wrist, ...), remaining cameras to the free slots in order (marked guesses)."""
    keys = list(reader.image_keys())
    if km is not None and km.cameras:
        slots = {slot: key for slot, key in km.cameras.items() if key in feats}
    else:
        short = {k.split(".")[-1].split("/")[-1]: k for k in keys}
        named, _ = assign_camera_slots(list(short), list(IMAGE_SLOTS))
        slots = {slot: short[name] for slot, name in named.items()}
        free = [s for s in ("primary", "secondary") if s not in slots]
        for key in [k for k in keys if k not in slots.values()]:
            if free:
                slots[free.pop(0)] = key
    cameras = {}
    for slot, key in slots.items():
        h, w = feats[key].shape[:2]
        cameras[slot] = {"height": int(h), "width": int(w), "description": f"{key} (TODO: check the slot)"}
    return cameras, [k for k in keys if k not in slots.values()]


def draft_spec(dataset: str | Path, name: str, *, margin: float = 0.05) -> tuple[str, dict[str, Any]]:
    """(YAML text of the drafted spec, summary of what was found and guessed)."""
    reader = open_dataset(dataset)
    path = Path(dataset)
    feats = reader.features()
    state_key, action_key = _pick(feats, STATE_KEYS, "state", path), _pick(feats, ACTION_KEYS, "action", path)
    ranges = _ranges(reader, [state_key, action_key])
    from vla.data.standardize import keymap_for

    km = keymap_for(reader)  # RLDS stores no fps; a registered key map knows the control rate
    hz = reader.fps or (km.control_hz if km is not None else None)
    cameras, unused = _cameras(reader, feats, km)
    spec = {
        "format_version": 1,
        "name": name,
        "robot": name,
        "description": f"TODO: drafted by `vla embodiment draft` from {path.name}",
        "control_hz": float(hz or 10.0),
        "chunk_length": max(1, round(float(hz or 10.0))),
        "cameras": cameras,
        "state": _fields(
            _dim_names(path, state_key, feats[state_key].shape[0]), *ranges[state_key], margin, "state"
        ),
        "action": _fields(
            _dim_names(path, action_key, feats[action_key].shape[0]), *ranges[action_key], margin, "action"
        ),
        "sources": [f"drafted from {path}"],
    }
    header = (
        f"# Drafted by `vla embodiment draft` from {path} — check every TODO before training:\n"
        "#  - units and kinds of each field (joint_pos here is a guess: eef_pos / eef_rot / joint_vel?)\n"
        "#  - absolute vs delta actions (absolute: true is a guess)\n"
        "#  - the gripper dimension and its convention (1 = open?)\n"
        f"#  - camera slots (guessed from names; unused cameras: {unused or 'none'})\n"
        f"#  - limits are the data's min/max widened by {margin:.0%}: replace with the robot's real limits\n"
        + ("" if hz else "#  - control_hz: the dataset stores no rate; 10 Hz is a placeholder\n")
    )
    summary = {
        "name": name,
        "robot_type": reader.robot_type,
        "state_dim": feats[state_key].shape[0],
        "action_dim": feats[action_key].shape[0],
        "cameras": {slot: cam["description"].split(" ")[0] for slot, cam in cameras.items()},
        "unused_cameras": unused,
        "control_hz": spec["control_hz"],
    }
    return header + yaml.safe_dump(spec, sort_keys=False), summary


def write_draft(
    dataset: str | Path, name: str, out: str | Path, *, overwrite: bool = False
) -> dict[str, Any]:
    """Draft, check that the spec loads, write ``out``; returns the summary."""
    from vla.embodiments import EmbodimentSpec

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    text, summary = draft_spec(dataset, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    EmbodimentSpec.from_yaml(tmp)  # the draft must pass the spec's own validation
    tmp.replace(out)
    return summary
