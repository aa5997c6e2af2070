"""Handles to a robot inside a compiled MuJoCo model: element names, limits, home pose and the state/action map.

``build_robot`` returns ``RobotHandles`` (names only, valid for any model compiled from the spec);
``RobotHandles.bind(model)`` resolves them to index arrays (``BoundRobot``) for fast per-step reads and writes.
The state/action layout is the one every ``sim_*`` embodiment spec declares: per arm, its joint positions (rad)
then its gripper opening normalized to [0, 1] (1 = open); arms in order (ALOHA: left then right).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mujoco
import numpy as np


@dataclass(frozen=True)
class ArmHandles:
    """Names of one arm's elements (already prefixed) and its joint data.

    ``joint_limits`` is ``((low, high), ...)`` in rad, ±inf for continuous joints; ``home`` in rad;
    ``velocity_limits`` the joints' speed limits in rad/s (``World.act`` ramps the servo setpoints no faster).
    ``gripper_range`` is each finger joint's travel from the centre plane, (closed, open) in m;
    ``pad_inset`` is how far the finger pads' inner faces sit inward of the joints (``jaw_range``: the gap
    between the pads, (closed, open) in m). ``gripper_actuator`` takes a finger position in m (see ``gripper_ctrl``).
    """

    name: str
    joints: tuple[str, ...]
    actuators: tuple[str, ...]
    joint_limits: tuple[tuple[float, float], ...]
    home: tuple[float, ...]
    gripper_joints: tuple[str, str]
    gripper_actuator: str
    gripper_range: tuple[float, float]
    ee_site: str
    flange_site: str
    wrist_camera: str
    base_body: str
    gripper_body: str
    pad_inset: float = 0.0  # m, finger pads' inner faces inward of the joint positions
    velocity_limits: tuple[float, ...] = ()  # rad/s per joint (the servo setpoint's top speed); () = none

    def __post_init__(self) -> None:
        n = len(self.joints)
        for field_name in ("actuators", "joint_limits", "home"):
            if len(getattr(self, field_name)) != n:
                raise ValueError(
                    f"arm {self.name!r}: {len(getattr(self, field_name))} {field_name} for {n} joints {self.joints}"
                )
        if self.velocity_limits and len(self.velocity_limits) != n:
            raise ValueError(
                f"arm {self.name!r}: {len(self.velocity_limits)} velocity_limits for {n} joints {self.joints} "
                "(one per joint in rad/s, or () for none)"
            )
        if any(not v > 0 for v in self.velocity_limits):
            raise ValueError(
                f"arm {self.name!r}: velocity_limits {self.velocity_limits} must all be > 0 rad/s"
            )

    @property
    def jaw_range(self) -> tuple[float, float]:
        """Gap between the finger pads (m), (closed, open)."""
        lo, hi = self.gripper_range
        return 2 * (lo - self.pad_inset), 2 * (hi - self.pad_inset)

    @property
    def dof(self) -> int:
        return len(self.joints)

    def gripper_ctrl(self, command: float) -> float:
        """Finger target in m for a gripper command in [0, 1] (1 = open, 0 = closed); clipped to [0, 1]."""
        lo, hi = self.gripper_range
        return lo + float(np.clip(command, 0.0, 1.0)) * (hi - lo)


@dataclass(frozen=True)
class RobotHandles:
    """Everything later code needs to drive one robot (one or more arms) by name.

    ``workspace_center`` (m) and ``workspace_half`` (m, x/y half-extents) are in the robot's root frame (the
    frame the fact sheet's world positions use) and bound where tasks may place objects. ``params`` records how
    the robot was made (for ``procedural``: every sampled value; episodes store it verbatim).
    """

    robot: str
    prefix: str
    arms: tuple[ArmHandles, ...]
    root_body: str
    workspace_center: tuple[float, float, float]
    workspace_half: tuple[float, float]
    reach: float
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def joint_names(self) -> tuple[str, ...]:
        """All arm joints (grippers excluded), arm after arm."""
        return tuple(j for arm in self.arms for j in arm.joints)

    @property
    def actuator_names(self) -> tuple[str, ...]:
        """Arm joint servos then each arm's gripper servo, in state/action order."""
        return tuple(a for arm in self.arms for a in (*arm.actuators, arm.gripper_actuator))

    @property
    def dof(self) -> int:
        """Number of arm joints over all arms."""
        return sum(arm.dof for arm in self.arms)

    @property
    def state_dim(self) -> int:
        """Joint positions plus one gripper opening per arm (== action_dim)."""
        return self.dof + len(self.arms)

    @property
    def wrist_cameras(self) -> tuple[str, ...]:
        return tuple(arm.wrist_camera for arm in self.arms)

    def home_action(self) -> np.ndarray:
        """Action holding the home pose with open grippers, float64 [state_dim]."""
        return np.concatenate([np.append(arm.home, 1.0) for arm in self.arms])

    def bind(self, model: mujoco.MjModel) -> BoundRobot:
        """Resolve the names against a compiled model (raises ``KeyError`` naming a missing element)."""
        return BoundRobot(self, model)


class BoundRobot:
    """``RobotHandles`` resolved to qpos/qvel/ctrl indices of one compiled model; all arrays are float64."""

    def __init__(self, handles: RobotHandles, model: mujoco.MjModel) -> None:
        self.handles = handles
        arm_q, grip_q, grip_q2, arm_v, arm_u, grip_u, grip_v = [], [], [], [], [], [], []
        for arm in handles.arms:
            arm_q += [model.joint(j).qposadr[0] for j in arm.joints]
            arm_v += [model.joint(j).dofadr[0] for j in arm.joints]
            arm_u += [model.actuator(a).id for a in arm.actuators]
            grip_q.append(model.joint(arm.gripper_joints[0]).qposadr[0])
            grip_q2.append(model.joint(arm.gripper_joints[1]).qposadr[0])
            grip_v += [model.joint(j).dofadr[0] for j in arm.gripper_joints]
            grip_u.append(model.actuator(arm.gripper_actuator).id)
        self.arm_qpos = np.asarray(arm_q, np.int64)
        self.arm_qvel = np.asarray(arm_v, np.int64)
        self.arm_ctrl = np.asarray(arm_u, np.int64)
        self.finger_qpos = np.asarray(grip_q, np.int64)  # the actuated (left) finger of each arm
        self.finger2_qpos = np.asarray(grip_q2, np.int64)
        self.finger_qvel = np.asarray(grip_v, np.int64)  # both fingers of every arm
        self.gripper_ctrl_idx = np.asarray(grip_u, np.int64)
        lims = np.asarray([lim for arm in handles.arms for lim in arm.joint_limits], np.float64)
        self.joint_low, self.joint_high = lims[:, 0], lims[:, 1]
        self.joint_vmax = np.asarray([v for arm in handles.arms for v in (arm.velocity_limits or
                                      (np.inf,) * arm.dof)], np.float64)  # fmt: skip
        ranges = np.asarray([arm.gripper_range for arm in handles.arms], np.float64)
        self.finger_closed, self.finger_open = ranges[:, 0], ranges[:, 1]
        sizes = [arm.dof for arm in handles.arms]
        # arm i's joints are arm_ctrl[s[i]:s[i + 1]] (and joint_vmax's)
        self.arm_joint_slices = np.cumsum([0, *sizes])
        # positions of each arm's joints and gripper inside the state/action vector
        self.joint_dims = np.concatenate([np.arange(s, s + n) + i for i, (s, n) in enumerate(zip(
            self.arm_joint_slices[:-1], sizes))])  # fmt: skip
        self.gripper_dims = self.arm_joint_slices[1:] + np.arange(len(sizes))

    def joint_positions(self, data: mujoco.MjData) -> np.ndarray:
        """Arm joint positions in rad, [dof]."""
        return data.qpos[self.arm_qpos].copy()

    def gripper_opening(self, data: mujoco.MjData) -> np.ndarray:
        """Per-arm gripper opening normalized to [0, 1] (1 = open), [n_arms]; from the actuated finger."""
        q = data.qpos[self.finger_qpos]
        return np.clip((q - self.finger_closed) / (self.finger_open - self.finger_closed), 0.0, 1.0)

    def state(self, data: mujoco.MjData) -> np.ndarray:
        """State vector [state_dim]: per arm, joint positions (rad) then gripper opening (1 = open)."""
        out = np.empty(len(self.joint_dims) + len(self.gripper_dims))
        out[self.joint_dims] = data.qpos[self.arm_qpos]
        out[self.gripper_dims] = self.gripper_opening(data)
        return out

    def apply_action(self, data: mujoco.MjData, action: np.ndarray) -> None:
        """Write an absolute action [state_dim] (joint targets rad, gripper command 1 = open) to ``data.ctrl``.

        Joint targets are clipped to the joint limits, gripper commands to [0, 1].
        """
        action = np.asarray(action, np.float64)
        if action.shape != (len(self.joint_dims) + len(self.gripper_dims),):
            raise ValueError(
                f"{self.handles.robot}: action has shape {action.shape}, expected "
                f"({len(self.joint_dims) + len(self.gripper_dims)},) = joints + one gripper per arm"
            )
        bad = np.flatnonzero(~np.isfinite(action))
        if bad.size:
            raise ValueError(
                f"{self.handles.robot}: action has non-finite values at dims {bad.tolist()} "
                f"({action[bad].tolist()}); a servo cannot follow NaN or inf targets (check the policy's output)"
            )
        data.ctrl[self.arm_ctrl] = np.clip(action[self.joint_dims], self.joint_low, self.joint_high)
        grip = np.clip(action[self.gripper_dims], 0.0, 1.0)
        data.ctrl[self.gripper_ctrl_idx] = self.finger_closed + grip * (self.finger_open - self.finger_closed)

    def reset(self, data: mujoco.MjData, gripper: float = 1.0) -> None:
        """Put the robot at its home pose at rest, servos holding it; gripper in [0, 1] (1 = open).

        Call ``mujoco.mj_forward`` afterwards (``World.reset`` does) to refresh positions.
        """
        home = np.asarray([q for arm in self.handles.arms for q in arm.home], np.float64)
        data.qpos[self.arm_qpos] = home
        data.qvel[self.arm_qvel] = 0.0
        finger = self.finger_closed + float(np.clip(gripper, 0.0, 1.0)) * (
            self.finger_open - self.finger_closed
        )
        data.qpos[self.finger_qpos] = finger
        data.qpos[self.finger2_qpos] = finger
        data.qvel[self.finger_qvel] = 0.0
        action = self.handles.home_action()
        action[self.gripper_dims] = gripper
        self.apply_action(data, action)
