"""Damped-least-squares inverse kinematics on MuJoCo site Jacobians (``mujoco.mj_jacSite``).

``ArmIK`` solves for the joint positions of one arm that put its ``ee`` site at a target position and
orientation. It works on a private ``MjData`` (the world's state is never touched) and warm-starts from the
previous solution, so successive targets give smooth joint trajectories. Arms with fewer than 6 joints only
track the approach axis (gripper +z), not the yaw about it. Continuous joints (±inf limits) are returned
unwrapped; ``wrap_to_nearest`` brings a target next to the measured angle so a servo never turns the long way.
"""

from __future__ import annotations

import math

import mujoco
import numpy as np

from vla.sim.handles import ArmHandles


def top_down_rotation(yaw: float) -> np.ndarray:
    """Rotation (columns = gripper x, y, z in world) with the approach axis (+z) pointing down and the finger
    axis (+y) at angle ``yaw`` (rad) from world +y about world +z."""
    c, s = math.cos(yaw), math.sin(yaw)
    y = np.array([-s, c, 0.0])
    z = np.array([0.0, 0.0, -1.0])
    return np.stack([np.cross(y, z), y, z], axis=1)


def finger_yaw(rot: np.ndarray) -> float:
    """Yaw (rad) of the finger axis (+y column of ``rot``) projected on the table, as in ``top_down_rotation``."""
    y = rot[:, 1]
    return math.atan2(-y[0], y[1])


def nearest_equivalent(angle: float, reference: float, period: float) -> float:
    """``angle + k·period`` closest to ``reference``."""
    return angle + period * round((reference - angle) / period)


def wrap_to_nearest(target: np.ndarray, current: np.ndarray, continuous: np.ndarray) -> np.ndarray:
    """For continuous joints, the angle equal to ``target`` mod 2π that is closest to ``current``."""
    out = np.array(target, float)
    d = (out - current + math.pi) % (2 * math.pi) - math.pi
    out[continuous] = current[continuous] + d[continuous]
    return out


def _cross(a: list[float], b: list[float]) -> list[float]:
    """``a × b`` of two 3-vectors as Python floats: the same IEEE operations in the same order as ``np.cross``
    (so the same bits), without its ~40 µs of array handling per call (it dominated the scripted experts' IK)."""
    return [a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0]]


def orientation_error(rot: np.ndarray, rot_des: np.ndarray, approach_only: bool) -> np.ndarray:
    """Small-angle rotation vector (world frame) taking ``rot`` toward ``rot_des`` (both ``[3, 3]``, columns =
    gripper axes in world): ``z × z_des`` when only the approach axis counts, else ``½ Σᵢ colᵢ × col_desᵢ``."""
    cols, des = rot.T.tolist(), rot_des.T.tolist()
    if approach_only:
        return np.array(_cross(cols[2], des[2]))
    total = [0.0, 0.0, 0.0]  # added one by one as numpy did: sum() of floats is compensated from Python 3.12
    for c, d in zip(cols, des, strict=True):
        total = [t + x for t, x in zip(total, _cross(c, d), strict=True)]
    return 0.5 * np.array(total)


class ArmIK:
    """DLS IK for one arm of a compiled model: ``solve(q0, pos, rot) -> q`` (rad, limits respected)."""

    def __init__(self, model: mujoco.MjModel, arm: ArmHandles, *, damping: float = 0.05,
                 orientation_weight: float = 0.4, max_step: float = 0.25) -> None:  # fmt: skip
        self.model = model
        self.data = mujoco.MjData(model)
        self.site = model.site(arm.ee_site).id
        self.qpos = np.array([model.joint(j).qposadr[0] for j in arm.joints])
        self.dofs = np.array([model.joint(j).dofadr[0] for j in arm.joints])
        lims = np.asarray(arm.joint_limits, float)
        self.low, self.high = lims[:, 0], lims[:, 1]
        self.continuous = ~np.isfinite(self.low) | ~np.isfinite(self.high)
        self.approach_only = arm.dof < 6
        self.damping = damping
        self.w = orientation_weight
        self.max_step = max_step
        self._jacp = np.zeros((3, model.nv))
        self._jacr = np.zeros((3, model.nv))

    def forward(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``ee`` site position (m) and rotation matrix at joint positions ``q``."""
        self.data.qpos[self.qpos] = q
        mujoco.mj_kinematics(self.model, self.data)
        mujoco.mj_comPos(self.model, self.data)
        return self.data.site_xpos[self.site].copy(), self.data.site_xmat[self.site].reshape(3, 3).copy()

    def solve(self, q0: np.ndarray, pos: np.ndarray, rot: np.ndarray | None = None, iters: int = 30,
              tol: float = 5e-4) -> np.ndarray:  # fmt: skip
        """Joint positions near ``q0`` putting the ``ee`` site at ``pos`` (and ``rot`` if given)."""
        q = np.array(q0, float)
        for _ in range(iters):
            x, r = self.forward(q)
            err_p = np.asarray(pos, float) - x
            mujoco.mj_jacSite(self.model, self.data, self._jacp, self._jacr, self.site)
            jp = self._jacp[:, self.dofs]
            if rot is not None:
                err_r = orientation_error(r, rot, self.approach_only)
                jac = np.vstack([jp, self.w * self._jacr[:, self.dofs]])
                err = np.concatenate([err_p, self.w * err_r])
                if np.linalg.norm(err_p) < tol and np.linalg.norm(err_r) < 10 * tol:
                    break
            else:
                jac, err = jp, err_p
                if np.linalg.norm(err_p) < tol:
                    break
            dq = jac.T @ np.linalg.solve(jac @ jac.T + self.damping**2 * np.eye(len(err)), err)
            norm = np.linalg.norm(dq)
            if norm > self.max_step:
                dq *= self.max_step / norm
            q = np.clip(q + dq, self.low, self.high)
        return q


__all__ = [
    "ArmIK",
    "finger_yaw",
    "nearest_equivalent",
    "orientation_error",
    "top_down_rotation",
    "wrap_to_nearest",
]
