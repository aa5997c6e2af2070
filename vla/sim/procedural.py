"""Procedurally generated arms: DoF 4–7, random link lengths, joint limits and gripper, all from one RNG.

The layouts follow the published arms' axis patterns (at q = 0 the upper arm points up along +z, the forearm and
wrist along +x, as WidowX/ViperX do, fact sheet §4.1/§7.2):

| DoF | axes (yaw z, pitch y, roll along the link) | like |
|---|---|---|
| 4 | z y y y | a planar arm on a turntable |
| 5 | z y y y x | + wrist roll |
| 6 | z y y x y x | WidowX 250 / ViperX 300 |
| 7 | z y z y x y x | Panda-like (upper-arm roll) |

Every sampled value is recorded in ``ArmSpec.params`` (and from there ``RobotHandles.params``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from vla.sim.arms import RY_POS90, ArmSpec, GripperSpec, LinkSpec, X, Y, Z

AXIS_PATTERNS: dict[int, str] = {4: "zyyy", 5: "zyyyx", 6: "zyyxyx", 7: "zyzyxyx"}
_AXES = {"x": X, "y": Y, "z": Z}
# Sampling ranges (m, rad); chosen to bracket the published arms (WidowX 0.25/0.175 … Panda 0.316/0.384).
UPPER_ARM = (0.18, 0.4)
FOREARM = (0.15, 0.4)
WRIST = (0.05, 0.12)
BASE_HEIGHT = (0.06, 0.2)
FINGER_OPEN = (0.02, 0.05)  # per-finger travel → 40…100 mm jaw opening
TCP_OFFSET = (0.08, 0.14)
HOME_TCP_HEIGHT = 0.15  # m above the mount at the home pose
# Joint limits (rad): a pitch joint (y) gets (-u1, u2), u1 ~ PITCH_LOW, u2 ~ PITCH_HIGH (>= 2: the home wrist
# fits); a yaw/roll joint gets ±u, u ~ TURN_LIMIT. ``vla.sim.embodiment.procedural_family_spec`` takes the
# envelope of these ranges as the safety limits of every arm of one DoF.
PITCH_LOW = (1.6, 2.4)
PITCH_HIGH = (2.0, 2.4)
TURN_LIMIT = (2.6, math.pi)
JOINT_VELOCITY = (1.2, math.pi)  # rad/s, one per arm: the published arms span Gen3's 1.22 to WidowX's π


def _u(rng: np.random.Generator, bounds: tuple[float, float]) -> float:
    return float(rng.uniform(*bounds))


def procedural_arm(rng: np.random.Generator, *, dof: int | None = None) -> ArmSpec:
    """Sample an arm; ``dof`` in 4..7 fixes the joint count (otherwise sampled uniformly)."""
    if dof is None:
        dof = int(rng.integers(4, 8))
    if dof not in AXIS_PATTERNS:
        raise ValueError(f"procedural robot: dof must be one of {sorted(AXIS_PATTERNS)}, got {dof}")
    pattern = AXIS_PATTERNS[dof]
    base_h, shoulder_h = _u(rng, BASE_HEIGHT), float(rng.uniform(0.03, 0.06))
    upper, fore, wrist = _u(rng, UPPER_ARM), _u(rng, FOREARM), _u(rng, WRIST)
    elbow_offset = float(rng.uniform(0.0, 0.06))  # WidowX-style forward offset of the elbow
    radius = float(np.interp(upper + fore, [0.35, 0.8], [0.025, 0.055]))
    mass_per_m = float(rng.uniform(3.0, 8.0))  # kg per m of link (WidowX ≈ 3, Panda ≈ 20 incl. motors)

    # Body offsets: walk the pattern; a roll joint splits its link in two halves.
    offsets: list[tuple[float, float, float]] = [(0.0, 0.0, base_h), (0.0, 0.0, shoulder_h)]
    pitch_seen = 1
    for axis in pattern[2:]:
        if axis == "z":  # upper-arm roll at mid upper arm
            offsets.append((0.0, 0.0, upper / 2))
        elif axis == "y":
            pitch_seen += 1
            if pitch_seen == 2:  # elbow
                up = upper / 2 if "z" in pattern[2:3] else upper
                offsets.append((elbow_offset, 0.0, up))
            else:  # wrist pitch after the forearm (split if a forearm roll came before it)
                split = "x" in pattern[2 : len(offsets)]  # a forearm roll came before: second half
                offsets.append((fore / 2 if split else fore, 0.0, 0.0))
        else:  # x: forearm roll (mid forearm) or wrist roll (after the wrist)
            offsets.append((fore / 2 if pitch_seen == 2 else wrist, 0.0, 0.0))
    gripper_mount = (wrist if pattern[-1] != "x" else 0.03, 0.0, 0.0)

    links, lengths = [], []
    for i, (axis, pos) in enumerate(zip(pattern, offsets)):
        child = offsets[i + 1] if i + 1 < dof else gripper_mount
        length = math.hypot(*child)
        lengths.append(length)
        if axis == "y":
            lo, hi = -_u(rng, PITCH_LOW), _u(rng, PITCH_HIGH)
        else:
            lim = _u(rng, TURN_LIMIT)
            lo, hi = -lim, lim
        # Servo stiffness scales with the load the joint carries (proximal joints stiffer).
        load = max(0.2, 1.0 - i / dof)
        links.append(LinkSpec(f"link{i + 1}", pos, _AXES[axis], (lo, hi), kp=400.0 * load + 50.0,
                              dampratio=1.0, force=60.0 * load + 10.0, armature=0.05, damping=0.5,
                              mass=max(0.1, mass_per_m * max(length, 0.05)),
                              com=tuple(0.5 * c for c in child), radius=radius))  # fmt: skip

    finger_open = _u(rng, FINGER_OPEN)
    tcp = _u(rng, TCP_OFFSET)
    gripper = GripperSpec(mount_pos=gripper_mount, mount_quat=RY_POS90, finger_range=(0.0, finger_open),
                          finger_z=0.45 * tcp, tcp_offset=tcp, kp=300.0, kv=10.0, force=60.0,
                          damping=5.0, armature=0.05, palm_mass=0.3, finger_mass=0.03,
                          palm_half=(0.02, finger_open + 0.015, 0.02))  # fmt: skip

    # Home: upper arm leaning forward by 0.25 rad, forearm pitched (angle a below horizontal) so the TCP sits
    # HOME_TCP_HEIGHT above the shoulder base, wrist pitched so the approach axis points straight down (the pitch
    # angles sum to π/2, turning the gripper's +z from +x onto −z).
    lean = 0.25
    drop = base_h + shoulder_h + upper * math.cos(lean) - elbow_offset * math.sin(lean) - wrist - tcp
    a = math.asin(float(np.clip((drop - HOME_TCP_HEIGHT) / fore, -0.35, 0.9)))
    pitches = [lean, a - lean, math.pi / 2 - a]
    home, k = [], 0
    for axis, link in zip(pattern, links):
        q = 0.0
        if axis == "y":
            q, k = pitches[k], k + 1
        lo, hi = link.range
        home.append(float(np.clip(q, lo, hi)))
    reach = float(upper + elbow_offset + fore + wrist + tcp)
    home_tcp_x = upper * math.sin(lean) + elbow_offset * math.cos(lean) + fore * math.cos(a)
    params: dict[str, Any] = {
        "dof": dof,
        "axes": pattern,
        "base_height": base_h,
        "shoulder_height": shoulder_h,
        "upper_arm": upper,
        "forearm": fore,
        "wrist": wrist,
        "elbow_offset": elbow_offset,
        "link_lengths": lengths,
        "link_radius": radius,
        "mass_per_m": mass_per_m,
        "joint_limits": [list(link.range) for link in links],
        "finger_open": finger_open,
        "gripper_width": 2 * finger_open,
        "tcp_offset": tcp,
        "reach": reach,
        "home": home,
        "home_tcp_x": home_tcp_x,
    }
    rgba = (*rng.uniform(0.3, 0.9, 3).tolist(), 1.0)
    # Drawn last, so every earlier draw (and so each seed's arm) is what it was before arms had speed limits.
    params["joint_velocity_limit"] = velocity = _u(rng, JOINT_VELOCITY)
    links = [replace(link, velocity=velocity) for link in links]
    return ArmSpec(name=f"procedural_{dof}dof", links=tuple(links), gripper=gripper, home=tuple(home),
                   base_mass=1.0, base_radius=radius * 1.2, rgba=rgba,
                   sources=("procedural (vla.sim.procedural)",), params=params)  # fmt: skip
