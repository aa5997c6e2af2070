"""Scripted experts: per-task waypoint sequences followed with damped-least-squares IK (``vla.sim.ik``).

``ScriptedExpert(world, task, setup, control_hz)`` is stateful: each ``act()`` call returns the next absolute
action (joint targets in rad + gripper command in [0, 1], 1 = open) for the current MuJoCo state. A phase is a
target TCP position (frozen from the state when the phase starts), a gripper command and an exit rule (TCP
within ``tol`` of the target after ``min_steps``, or ``max_steps`` elapsed). The commanded TCP moves toward the
target at a bounded speed; the joint targets add the servos' gravity sag (τ_gravity / kp) and an integral term
takes out what is left. The gripper points down (top-down grasps) with its finger axis turned to the object's
faces. With several arms (ALOHA) the arm whose base is nearest the objects it must reach works, the others hold
their home pose.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mujoco
import numpy as np

from vla.sim.ik import ArmIK, finger_yaw, nearest_equivalent, top_down_rotation, wrap_to_nearest
from vla.sim.tasks import TASKS, Reach, TaskSetup, body_pos
from vla.sim.world import World

OPEN, CLOSED = 1.0, 0.0
LIFT = np.array([0.0, 0.0, 0.08])  # m, "above" / retreat offset
PAD_HALF_WIDTH = 0.01  # m, finger pads' half-width across the finger axis (``vla.sim.robots``)
READY_TILT = 0.7  # a home pose whose gripper axis points down less than this (-z component) gets a ready pose
READY_HEIGHT = 0.2  # m above the table: the ready pose's TCP, over the middle of the workspace
READY_SPEED = 2.5  # rad/s of each joint on the way to the ready pose
READY_TOL = 0.5  # rad: close enough to start the phases (the servos catch up while the TCP heads on)
READY_MAX_STEPS = 25  # at 10 Hz


def turn_toward(rot: np.ndarray, target: np.ndarray, max_angle: float) -> np.ndarray:
    """Rotation matrix ``rot`` turned toward ``target`` about their relative axis by at most ``max_angle`` rad."""
    q, q_target, rel = np.zeros(4), np.zeros(4), np.zeros(3)
    mujoco.mju_mat2Quat(q, rot.reshape(-1))
    mujoco.mju_mat2Quat(q_target, target.reshape(-1))
    mujoco.mju_subQuat(rel, q_target, q)  # rotation vector (rot's frame) taking q to q_target
    angle = float(np.linalg.norm(rel))
    if angle > max_angle:
        rel *= max_angle / angle
    mujoco.mju_quatIntegrate(q, rel, 1.0)
    out = np.zeros(9)
    mujoco.mju_quat2Mat(out, q)
    return out.reshape(3, 3)


@dataclass
class Phase:
    """One waypoint: ``target()`` is evaluated once when the phase starts."""

    name: str
    target: Callable[[], np.ndarray]
    gripper: float
    tol: float = 0.015
    min_steps: int = 0
    max_steps: int = 40
    speed: float = 0.3  # m/s of the commanded TCP


class ScriptedExpert:
    """Waypoint expert for one episode of ``setup`` in ``world``; call ``act()`` once per control step."""

    def __init__(self, world: World, setup: TaskSetup, control_hz: float) -> None:
        self.world = world
        self.setup = setup
        self.dt = 1.0 / control_hz
        self.scale = control_hz / 10.0  # phase step counts are written for 10 Hz
        bound = world.bound
        self.arm_index = self._pick_arm([setup.goal.get("target"), setup.goal.get("place")])
        arm = world.robot.arms[self.arm_index]
        self.arm = arm
        self.ik = ArmIK(world.model, arm)
        self.site = world.model.site(arm.ee_site).id
        sizes = [a.dof for a in world.robot.arms]
        start = int(sum(sizes[: self.arm_index]))
        self.qidx = bound.arm_qpos[start : start + arm.dof]
        self.act_joint_dims = bound.joint_dims[start : start + arm.dof]
        self.act_grip_dim = int(bound.gripper_dims[self.arm_index])
        # Servo stiffness per joint (N·m/rad): a position servo sags by τ_gravity / kp, so the expert adds that.
        self.dofs = bound.arm_qvel[start : start + arm.dof]
        self.kp = world.model.actuator_gainprm[bound.arm_ctrl[start : start + arm.dof], 0].copy()
        self.base_action = world.robot.home_action()
        self.q_cmd = world.data.qpos[self.qidx].copy()
        self.pos_cmd = self.ee_pos()
        self.offset = np.zeros(3)
        # A home pose with the gripper pointing sideways (Kinova Gen3's) is first turned into a ready pose pointing
        # down, along the same joint path in every episode: asked for the whole turn at once, the IK takes either
        # wrist branch (joint 5 at +2.9 or -2.9 rad, or joint 6 through 0) depending on the scene, and the
        # demonstrations would mix joint solutions for like scenes (a policy learns their average).
        self.ready = self._ready_pose()
        self.ready_steps = 0
        self.rot = top_down_rotation(self._yaw())
        self.phases = self._phases(setup)
        self.index = 0
        self.steps_in_phase = 0
        self.goal: np.ndarray | None = None

    # ---- helpers -------------------------------------------------------------------------------------------
    def ee_pos(self) -> np.ndarray:
        return self.world.data.site_xpos[self.site].copy()

    def _ready_pose(self) -> np.ndarray | None:
        """Joint positions with the gripper pointing down ``READY_HEIGHT`` over the middle of the workspace (None
        when home already points down), reached from the exact home by the IK in small steps: the same path, so
        the same joint solution, in every episode; and on the way to every task's first waypoint."""
        q = np.asarray(self.arm.home, float)  # the exact home, not this episode's perturbed start: one path
        pos, rot = self.ik.forward(q)
        if rot[2, 2] < -READY_TILT:
            return None
        base = self.world.data.body(self.arm.base_body).xpos
        center = np.asarray(self.world.params["workspace_center"], float)[:2]
        if len(self.world.robot.arms) > 1:  # the working arm's half of a shared workspace
            center = (center + base[:2]) / 2
        goal = np.array([*center, READY_HEIGHT])
        target = top_down_rotation(nearest_equivalent(0.0, finger_yaw(rot), math.pi / 2))
        for _ in range(60):
            rot = turn_toward(rot, target, 0.05)
            step = goal - pos
            pos = pos + step * min(1.0, 0.02 / max(float(np.linalg.norm(step)), 1e-9))
            q = self.ik.solve(q, pos, rot)
        for _ in range(20):  # settle on the goal
            q = self.ik.solve(q, goal, target)
        return q

    def _ready_action(self) -> np.ndarray | None:
        """The next joint-space step toward the ready pose, or None once it is reached (the phases start)."""
        if self.ready is None:
            return None
        q_now = self.world.data.qpos[self.qidx]
        self.ready_steps += 1
        # the commanded joints reached it: the phases start from it (the IK seeds from the command, so the branch
        # is fixed) while the servos still catch up
        reached = np.array_equal(self.q_cmd, self.ready) and np.abs(self.ready - q_now).max() < READY_TOL
        if reached or self.ready_steps > READY_MAX_STEPS * self.scale:
            self.ready = None
            self.q_cmd = q_now.copy()
            self.pos_cmd = self.ee_pos()
            self.rot = top_down_rotation(self._yaw())
            return None
        step = READY_SPEED * self.dt
        left = self.ready - self.q_cmd
        # exactly the ready pose once within a step (q + (r - q) need not round to r), so `reached` can hold
        self.q_cmd = np.where(np.abs(left) <= step, self.ready, self.q_cmd + np.clip(left, -step, step))
        action = self.base_action.copy()
        action[self.act_joint_dims] = self.q_cmd + self.world.data.qfrc_bias[self.dofs] / self.kp
        action[self.act_grip_dim] = self.phases[0].gripper
        return action

    def _pick_arm(self, names: list[str | None]) -> int:
        """The arm whose base is nearest the farthest of the objects it must reach (target, place)."""
        arms = self.world.robot.arms
        names = [n for n in names if n is not None]
        if len(arms) == 1 or not names:
            return len(arms) - 1
        d = self.world.data
        points = [d.site("drawer_handle").xpos if n == "drawer" else body_pos(self.world, n) for n in names]
        far = [max(np.linalg.norm(d.body(a.base_body).xpos[:2] - p[:2]) for p in points) for a in arms]
        return int(np.argmin(far))

    def _yaw(self) -> float:
        """Finger-axis yaw: across the target's faces (cubes: period π/2), nearest the gripper's current yaw."""
        current = finger_yaw(self.world.data.site_xmat[self.site].reshape(3, 3))
        g = self.setup.goal
        if self.setup.task == "push":
            u = self._push_direction()
            yaw = math.atan2(-u[1], -u[0])  # finger axis across the push direction
            return nearest_equivalent(yaw, current, math.pi)
        if self.setup.task == "drawer":
            return nearest_equivalent(0.0, current, math.pi)  # fingers along the handle bar
        target = g.get("target")
        if target in self.world.objects and self.world.objects[target].kind == "cube":
            m = self.world.data.body(target).xmat.reshape(3, 3)
            return nearest_equivalent(math.atan2(m[1, 0], m[0, 0]), current, math.pi / 2)
        return nearest_equivalent(0.0, current, math.pi / 2)

    def _push_direction(self) -> np.ndarray:
        """Unit xy vector from the object to the push target marker."""
        v = self._xy(self.setup.goal["place"]) - self._xy(self.setup.goal["target"])
        return v / max(float(np.linalg.norm(v)), 1e-9)

    def _xy(self, name: str) -> np.ndarray:
        return body_pos(self.world, name)[:2]

    def _at(self, name: str, z: float) -> Callable[[], np.ndarray]:
        return lambda: np.array([*self._xy(name), z])

    # ---- task scripts --------------------------------------------------------------------------------------
    def _phases(self, s: TaskSetup) -> list[Phase]:
        g = s.goal
        if s.task == "drawer":
            return self._drawer_phases(s)
        target = g["target"]
        h = g["heights"][target]
        grasp_z = max(h / 2, 0.024)
        if isinstance(TASKS.get(s.task), Reach):
            return [Phase("above", self._at(target, h + 0.08), CLOSED, tol=0.02),
                    Phase("touch", self._at(target, h + 0.004), CLOSED, tol=0.005, max_steps=25, speed=0.15),
                    Phase("hold", self._at(target, h), CLOSED, tol=0.0, max_steps=10**6)]  # fmt: skip
        if s.task == "push":
            u = np.array([*self._push_direction(), 0.0])
            half = h / 2
            z = 0.025

            def start() -> np.ndarray:
                return np.array([*self._xy(target), z]) - u * (half + 0.05)

            def end() -> np.ndarray:
                # the pads' front face (PAD_HALF_WIDTH ahead of the TCP) pushes the object's back face, so the
                # object's centre ends on the marker's
                return np.array([*self._xy(g["place"]), z]) - u * (half + PAD_HALF_WIDTH)

            return [Phase("above", lambda: start() + LIFT, CLOSED, tol=0.02),
                    Phase("down", start, CLOSED, tol=0.01, max_steps=25, speed=0.15),
                    Phase("sweep", end, CLOSED, tol=0.01, max_steps=40, speed=0.12),
                    Phase("up", lambda: self.ee_pos() + LIFT, CLOSED, tol=0.02, max_steps=20),
                    Phase("hold", self.ee_pos, CLOSED, tol=0.0, max_steps=10**6)]  # fmt: skip
        place = g["place"]
        lift = h / 2 + 0.12
        if s.task == "pick_place":
            release = g["heights"][place] + h / 2 + 0.02
        else:  # stack
            release = g["heights"][place] + h / 2 + 0.008
        return [Phase("above", self._at(target, grasp_z + 0.1), OPEN, tol=0.02),
                Phase("descend", self._at(target, grasp_z), OPEN, tol=0.008, max_steps=30, speed=0.15),
                Phase("close", self.ee_pos, CLOSED, tol=np.inf, min_steps=6),
                Phase("lift", self._at(target, lift), CLOSED, tol=0.03),
                Phase("over", self._at(place, lift), CLOSED, tol=0.015, max_steps=60, speed=0.15),
                Phase("lower", self._at(place, release), CLOSED, tol=0.01, max_steps=30, speed=0.15),
                Phase("release", self.ee_pos, OPEN, tol=np.inf, min_steps=5),
                Phase("retreat", lambda: self.ee_pos() + LIFT, OPEN, tol=0.03, max_steps=20),
                Phase("hold", self.ee_pos, OPEN, tol=0.0, max_steps=10**6)]  # fmt: skip

    def _drawer_phases(self, s: TaskSetup) -> list[Phase]:
        def handle() -> np.ndarray:
            return self.world.data.site("drawer_handle").xpos.copy()

        depth = s.goal["depth"]
        if s.goal["action"] == "open":
            press = np.array([0.0, 0.0, 0.008 + 0.015 - 0.016])  # fingertips pressed 16 mm into the bar top
            pulled: list[np.ndarray] = []

            def pull() -> np.ndarray:
                pulled.append(handle() + press - [1.1 * depth, 0, 0])
                return pulled[-1]

            return [Phase("above", lambda: handle() + LIFT, CLOSED, tol=0.02),
                    Phase("press", lambda: handle() + press, CLOSED, tol=0.006, max_steps=25, speed=0.1),
                    Phase("pull", pull, CLOSED, tol=0.01, max_steps=40, speed=0.08),
                    Phase("up", lambda: self.ee_pos() + LIFT, OPEN, tol=0.02, max_steps=20),
                    Phase("hold", self.ee_pos, OPEN, tol=0.0, max_steps=10**6)]  # fmt: skip
        level = np.array([0.0, 0.0, 0.015])

        def start() -> np.ndarray:
            return handle() + level - [0.05, 0, 0]

        def end() -> np.ndarray:
            return handle() + level + [self.world.data.joint("drawer_slide").qpos[0] - 0.005, 0, 0]

        return [Phase("above", lambda: start() + LIFT, CLOSED, tol=0.02),
                Phase("down", start, CLOSED, tol=0.01, max_steps=25, speed=0.15),
                Phase("push", end, CLOSED, tol=0.01, max_steps=40, speed=0.1),
                Phase("back", lambda: self.ee_pos() - [0.05, 0, -0.05], CLOSED, tol=0.02, max_steps=20),
                Phase("hold", self.ee_pos, CLOSED, tol=0.0, max_steps=10**6)]  # fmt: skip

    # ---- control -------------------------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self.phases[self.index]

    def act(self) -> np.ndarray:
        """The next absolute action [action_dim] (float64)."""
        if (ready := self._ready_action()) is not None:
            return ready
        phase = self.phase
        if self.goal is None:
            self.goal = np.asarray(phase.target(), float)
            self.offset[:] = 0.0
        ee = self.ee_pos()
        err = self.goal - ee
        self.steps_in_phase += 1
        done = np.linalg.norm(err) < phase.tol and self.steps_in_phase >= phase.min_steps * self.scale
        if (done or self.steps_in_phase >= phase.max_steps * self.scale) and self.index < len(
            self.phases
        ) - 1:
            self.index += 1
            self.steps_in_phase = 0
            self.goal = None
            return self.act()
        # Commanded TCP: toward the goal at bounded speed; integral term for the servos' steady-state sag.
        step = self.goal - self.pos_cmd
        dist = np.linalg.norm(step)
        max_d = phase.speed * self.dt
        self.pos_cmd = self.goal.copy() if dist <= max_d else self.pos_cmd + step * (max_d / dist)
        if dist <= max_d and np.linalg.norm(err) > 0.002 and np.isfinite(phase.tol):
            self.offset = np.clip(self.offset + 0.3 * err, -0.03, 0.03)
        q = self.ik.solve(self.q_cmd, self.pos_cmd + self.offset, self.rot)
        q_now = self.world.data.qpos[self.qidx]
        self.q_cmd = wrap_to_nearest(q, q_now, self.ik.continuous)
        action = self.base_action.copy()
        # Gravity feedforward (qfrc_bias is gravity plus the small Coriolis terms); the integral term above
        # takes what is left (held objects, contacts).
        action[self.act_joint_dims] = self.q_cmd + self.world.data.qfrc_bias[self.dofs] / self.kp
        action[self.act_grip_dim] = phase.gripper
        return action


__all__ = ["Phase", "ScriptedExpert", "turn_toward"]
