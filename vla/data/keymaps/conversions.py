"""Named operations a key map refers to: gripper/rotation conversions, episode-level steps, the DROID idle filter.

Conversions follow OpenVLA's and Octo's OXE transforms exactly (rel2abs, binarize with its backward scan, invert,
clip: openvla/openvla@c8f03f4 prismatic/vla/datasets/rlds/utils/data_utils.py and oxe/transforms.py); the idle
filter is openpi's DROID rule (Physical-Intelligence/openpi examples/droid/compute_droid_nonidle_ranges.py). ``vla.data.standardize`` applies them; a ``KeyMap`` names
them (``Part.convert``, ``KeyMap.steps``, ``KeyMap.idle_key``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vla.data.keymaps import KeyMap, KeyMapError
from vla.data.readers.base import RawEpisode

# ---- gripper and rotation conversions (OpenVLA / Octo OXE transforms) ------------------------------------------


def rel2abs_gripper(x: np.ndarray) -> np.ndarray:
    """Relative gripper commands ``[L]`` (+ = close, - = open) -> absolute ``[L]`` (1 = open, 0 = closed).

    Values < -0.1 are "open" events, > +0.1 "close" events, others no event; the output holds the last event.
    Before the first event it holds the opposite of that event (open if the episode has no event).
    """
    events = np.where(x < -0.1, 1.0, np.where(x > 0.1, -1.0, 0.0))  # +1 open, -1 close
    nonzero = np.flatnonzero(events)
    state = -events[nonzero[0]] if len(nonzero) else 1.0
    out = np.empty(len(x))
    for t, e in enumerate(events):
        if e != 0:
            state = e
        out[t] = state
    return out / 2 + 0.5


def binarize_gripper(x: np.ndarray) -> np.ndarray:
    """Continuous absolute gripper ``[L]`` (1 = open) -> {0, 1}: > 0.95 -> 1, < 0.05 -> 0; an in-between value takes
    the next settled value (backward scan); in-between values at the end carry the last raw value."""
    out = np.empty(len(x))
    carry = float(x[-1]) if len(x) else 0.0
    for t in range(len(x) - 1, -1, -1):
        if x[t] > 0.95:
            carry = 1.0
        elif x[t] < 0.05:
            carry = 0.0
        out[t] = carry
    return out


GRIPPER_FNS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "none": lambda x: x,
    "rel2abs": rel2abs_gripper,
    "invert": lambda x: 1.0 - x,
    "clip": lambda x: np.clip(x, 0.0, 1.0),
    "clip_invert": lambda x: 1.0 - np.clip(x, 0.0, 1.0),
    "binarize": binarize_gripper,
}


def quat_to_euler(q: np.ndarray) -> np.ndarray:
    """Unit quaternions ``[L, 4]`` (x, y, z, w) -> Euler angles ``[L, 3]`` (roll, pitch, yaw; R = Rz(yaw) Ry(pitch)
    Rx(roll)), the convention of tensorflow_graphics ``euler.from_quaternion`` that OpenVLA/Octo use."""
    q = q / np.linalg.norm(q, axis=-1, keepdims=True).clip(1e-12)
    x, y, z, w = q[:, 0], q[:, 1], q[:, 2], q[:, 3]
    roll = np.arctan2(2 * (w * x + y * z), 1 - 2 * (x * x + y * y))
    pitch = np.arcsin(np.clip(2 * (w * y - z * x), -1.0, 1.0))
    yaw = np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))
    return np.stack([roll, pitch, yaw], axis=-1)


# ---- DROID idle-frame filter (openpi's compute_droid_nonidle_ranges.py) ------------------------------------

IDLE_THRESHOLD = (
    1e-3  # a frame is idle if no joint-velocity command changed by this much since the previous frame
)
MIN_IDLE_RUN = 7  # idle runs at least this long are removed
MIN_KEEP_RUN = 16  # of what remains, only contiguous runs at least this long are kept
TRIM_RUN_END = 10  # and each kept run loses this many frames at its end


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of every run of True in a bool ``[L]`` mask."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def openpi_idle_keep_mask(joint_velocity: np.ndarray) -> np.ndarray:
    """bool ``[L]``: frames openpi keeps when training on DROID, from the joint-velocity commands ``[L, 7]``.

    Frame t >= 1 is idle if every joint of ``jv[t] - jv[t-1]`` has ``|.| < 1e-3`` (frame 0 never is); idle runs of
    >= 7 frames are removed; of the rest only contiguous runs of >= 16 frames are kept, each minus its last 10.
    """
    n = len(joint_velocity)
    idle = np.zeros(n, dtype=bool)
    if n > 1:
        idle[1:] = np.all(np.abs(np.diff(joint_velocity, axis=0)) < IDLE_THRESHOLD, axis=1)
    candidate = np.ones(n, dtype=bool)
    for s, e in _runs(idle):
        if e - s >= MIN_IDLE_RUN:
            candidate[s:e] = False
    keep = np.zeros(n, dtype=bool)
    for s, e in _runs(candidate):
        if e - s >= MIN_KEEP_RUN:
            keep[s : e - TRIM_RUN_END] = True
    return keep


# ---- episode-level steps ----------------------------------------------------------------------------------------


@dataclass
class EpisodeWork:
    """Scratch state of one episode while a key map is applied (float64 ``state [L, S]``, ``action [L, A]``)."""

    keymap: KeyMap
    raw: RawEpisode
    state: np.ndarray
    action: np.ndarray
    reasons: list[str]  # per raw frame: "" = kept, else why it is dropped

    def drop(self, frames: slice | np.ndarray | list[int], reason: str) -> None:
        for t in np.arange(len(self.reasons))[frames]:
            if not self.reasons[t]:
                self.reasons[t] = reason


def state_delta_relabel(work: EpisodeWork) -> None:
    """Bridge: movement action dims 0:6 := state[t+1, 0:6] - state[t, 0:6] (plain difference, no angle wrapping);
    the last frame has no next state and is dropped. The gripper dim keeps its own (converted) value."""
    if work.state.shape[1] < 6 or work.action.shape[1] < 6:
        raise KeyMapError(
            f"key map {work.keymap.dataset!r}: state_delta_relabel needs >= 6 state and action dims"
        )
    work.action[:-1, 0:6] = work.state[1:, 0:6] - work.state[:-1, 0:6]
    work.drop(slice(len(work.reasons) - 1, None), "last frame: no next state for the state-delta relabel")


#: Named episode-level steps a key map may list in ``steps`` (each mutates an ``EpisodeWork``).
EPISODE_STEPS: dict[str, Callable[[EpisodeWork], None]] = {"state_delta_relabel": state_delta_relabel}
