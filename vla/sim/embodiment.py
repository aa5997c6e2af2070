"""Embodiment specs of the simulated robots, derived from their ``RobotHandles``.

The fixed robots' specs are data (``configs/embodiments/sim_<robot>.yaml``, registered like every other spec);
``sim_embodiment_spec`` is the function that wrote them and that the tests compare them against. The procedural
robot changes shape per seed, but its state/action layout depends only on its DoF: one registered spec per DoF,
``sim_procedural_<dof>dof`` (``configs/embodiments/sim_procedural_{4,5,6,7}dof.yaml``, written by
``procedural_family_spec``), whose limits are the envelope of every arm of that DoF. Datasets, loaders and
policies use that spec; each episode's sampled arm (link lengths, limits, gripper) is episode metadata
(``robot_params``), and ``procedural_embodiment_spec`` gives one arm's exact spec (its limits, ``extra``).

Conventions (``vla.sim.handles``): state = per arm, joint positions (rad) then gripper opening in [0, 1] (1 = open);
action = per arm, absolute joint-position targets (rad) then a gripper command in [0, 1] (1 = open); the servo
setpoints move toward the targets no faster than the joints' published speed limits (``World.act``), which the action
fields' descriptions list.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from vla.embodiments import CameraSpec, EmbodimentSpec, FieldSpec, get_embodiment
from vla.sim.handles import ArmHandles, RobotHandles

SIM_CONTROL_HZ = {"aloha": 20.0}  # default 10 Hz = 50 physics steps of 2 ms per action
SIM_CHUNK_LENGTH = {"aloha": 20}  # default 10 (one second of actions)


# How the sim follows a joint action (``vla.sim.world.World.act``); the joints' speed limits are appended.
ACTION_JOINT_DESC = (
    "absolute joint-position targets (PD servos); the servo setpoints move toward them along a straight line in "
    "joint space, no joint faster than its speed limit"
)


def _speed_text(limits: tuple[float, ...]) -> str:
    """The speed limits part of an action field's description, e.g. ``" (pi rad/s each)"``; ``""`` if none."""
    if not limits or not all(math.isfinite(v) for v in limits):
        return ""
    if len(set(limits)) == 1:
        return f" ({limits[0]:.4g} rad/s each)"
    return f" ({', '.join(f'{v:.4g}' for v in limits)} rad/s)"


def _fields(arm: ArmHandles, which: str) -> list[FieldSpec]:
    prefix = f"{arm.name}_" if arm.name else ""
    dims = tuple(f"joint{i + 1}" for i in range(arm.dof))
    low = tuple(lo for lo, _ in arm.joint_limits)
    high = tuple(hi for _, hi in arm.joint_limits)
    joint_name = f"{arm.name}_arm" if arm.name else "joint_pos"
    joint_desc = (
        "joint positions" if which == "state" else ACTION_JOINT_DESC + _speed_text(arm.velocity_limits)
    )
    gripper_units = (
        "normalized opening (1 = open, 0 = closed)" if which == "state" else "command (1 = open, 0 = closed)"
    )
    return [
        FieldSpec(joint_name, "joint_pos", dims, units="rad", absolute=True, low=low, high=high,
                  normalization="quantile", description=joint_desc),
        FieldSpec(f"{prefix}gripper", "gripper", ("open",), units=gripper_units, absolute=True, low=(0.0,),
                  high=(1.0,), normalization="quantile" if which == "state" else "identity",
                  description=f"gap between the finger pads {arm.jaw_range[0]:.4f}..{arm.jaw_range[1]:.4f} m"),
    ]  # fmt: skip


def sim_embodiment_spec(
    handles: RobotHandles,
    *,
    name: str | None = None,
    control_hz: float | None = None,
    chunk_length: int | None = None,
    image_size: int = 128,
    extra: dict[str, Any] | None = None,
) -> EmbodimentSpec:
    """The embodiment spec of a simulated robot: state/action fields from its arms, cameras primary + wrist(s)."""
    robot = handles.robot
    cameras = {"primary": CameraSpec(image_size, image_size, "third-person camera 'primary' (vla.sim.world)")}
    for arm in handles.arms:
        slot = f"{arm.name}_wrist" if arm.name else "wrist"
        cameras[slot] = CameraSpec(
            image_size, image_size, f"wrist camera '{slot}' looking along the approach axis"
        )
    spec = EmbodimentSpec(
        name=name or f"sim_{robot}",
        state=tuple(f for arm in handles.arms for f in _fields(arm, "state")),
        action=tuple(f for arm in handles.arms for f in _fields(arm, "action")),
        cameras=cameras,
        control_hz=control_hz or SIM_CONTROL_HZ.get(robot, 10.0),
        chunk_length=chunk_length or SIM_CHUNK_LENGTH.get(robot, 10),
        description=f"MuJoCo {robot} (vla.sim): absolute joint-position targets + gripper (1 = open).",
        robot=f"sim_{robot}",
        sources=(
            "vla/sim/arms.py (joint limits from the published robot models)",
            "vla/sim/embodiment.py (layout)",
        ),
        extra=dict(extra or {}),
    )
    spec.validate()
    return spec


def _jsonable(value: Any) -> Any:
    """Plain Python numbers/lists/dicts (YAML- and JSON-safe), infinities as None."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return None
    if hasattr(value, "item"):  # numpy scalar
        return value.item()
    return value


def procedural_embodiment_spec(handles: RobotHandles, **kwargs: Any) -> EmbodimentSpec:
    """Spec of a procedural robot, named ``sim_procedural_<dof>dof``; ``extra.robot_params`` = sampled values."""
    if handles.robot != "procedural":
        raise ValueError(f"procedural_embodiment_spec needs a procedural robot, got {handles.robot!r}")
    return sim_embodiment_spec(handles, name=f"sim_procedural_{handles.dof}dof",
                               extra={"robot_params": _jsonable(handles.params)}, **kwargs)  # fmt: skip


def procedural_family_spec(dof: int) -> EmbodimentSpec:
    """The registered spec ``sim_procedural_<dof>dof`` of every procedural arm with ``dof`` joints.

    Same layout as each arm's own spec; limits are the envelope of the sampling ranges (``vla.sim.procedural``:
    pitch joints ``(-PITCH_LOW[1], PITCH_HIGH[1])``, yaw/roll joints ``±TURN_LIMIT[1]``, jaw up to
    ``2 * FINGER_OPEN[1]``), so they bound every sampled arm. Wrote ``configs/embodiments/sim_procedural_*.yaml``.
    """
    import mujoco

    from vla.sim.procedural import (
        AXIS_PATTERNS,
        FINGER_OPEN,
        JOINT_VELOCITY,
        PITCH_HIGH,
        PITCH_LOW,
        TURN_LIMIT,
    )
    from vla.sim.robots import build_robot

    if dof not in AXIS_PATTERNS:
        raise ValueError(f"procedural robot: dof must be one of {sorted(AXIS_PATTERNS)}, got {dof}")
    handles = build_robot("procedural", mujoco.MjSpec(), seed=0, dof=dof)
    limits = tuple((-PITCH_LOW[1], PITCH_HIGH[1]) if axis == "y" else (-TURN_LIMIT[1], TURN_LIMIT[1])
                   for axis in AXIS_PATTERNS[dof])  # fmt: skip
    arm = dataclasses.replace(handles.arms[0], joint_limits=limits, gripper_range=(0.0, FINGER_OPEN[1]),
                              velocity_limits=())  # fmt: skip
    spec = sim_embodiment_spec(dataclasses.replace(handles, arms=(arm,), params={}),
                               name=f"sim_procedural_{dof}dof")  # fmt: skip
    speed = (f"{ACTION_JOINT_DESC} (one per arm, drawn in [{JOINT_VELOCITY[0]:.4g}, {JOINT_VELOCITY[1]:.4g}] rad/s: "
             "episode metadata robot_params.joint_velocity_limit)")  # fmt: skip
    action = tuple(
        dataclasses.replace(f, description=speed) if f.kind == "joint_pos" else f for f in spec.action
    )
    return dataclasses.replace(
        spec,
        action=action,
        description=f"MuJoCo procedural {dof}-DoF arms (vla.sim.procedural; links, limits and gripper vary per "
        "episode, recorded in episode metadata robot_params): absolute joint-position targets + gripper (1 = open).",
        sources=(
            "vla/sim/procedural.py (sampling ranges; limits = their envelope)",
            "vla/sim/embodiment.py (layout)",
        ),
    )


def embodiment_for(handles: RobotHandles) -> EmbodimentSpec:
    """The registered spec a dataset or policy should use for ``handles`` (procedural: ``sim_procedural_<dof>dof``)."""
    if handles.robot == "procedural":
        return get_embodiment(f"sim_procedural_{handles.dof}dof")
    return get_embodiment(f"sim_{handles.robot}")
