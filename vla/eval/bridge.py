"""Replay of real WidowX logs — Open X-Embodiment Bridge (RLDS ``bridge_dataset``) — on the sim WidowX through IK,
and the real-vs-sim end-effector divergence.

Bridge logs the end-effector pose ``observation/state`` = [x, y, z (m, robot base frame), roll, pitch, yaw (rad,
extrinsic xyz), gripper] at 5 Hz and the teleoperator's command ``action`` = [dx, dy, dz, droll, dpitch, dyaw,
gripper (1 = open)]: the pose change asked for the next step (in the fixture the action at t correlates with
``state[t+1] - state[t]`` at r ≈ 0.85–0.9 per axis, with ``state[t+2] - state[t+1]`` at ≈ 0.6).

Replay, open loop: the sim WidowX (``vla.sim`` ``widowx``: the wx250s kinematics) starts at the logged initial pose
(solved by IK); each step the commanded pose moves by the logged delta (pose chain from the logged initial pose)
and is solved by ``vla.sim.ik.ArmIK`` to joint targets for the PD servos, run for one 5 Hz control period. The divergence at step t
is ``|p_sim(t) - p_log(t)|`` (m) and the angle between the two orientations (rad). For scale, the report also
gives ``command_chain_*``: the divergence of the commanded pose chain itself from the log (what a perfect tracker
would show: how far the real robot was from its own commands) and ``log_travel_m`` (how far the real end effector
moved).

Frames: positions are taken relative to the sim arm's base body. Orientation: at roll = pitch = yaw = 0 the
WidowX gripper points along the base's +x (Bridge's convention; the sim's home pose points the same way); the sim's
``ee`` site has the approach axis as +z, so ``R_site = R_base · R_log · M`` with ``M`` taking site axes to the
logged frame's (site x = -z, y = y, z = x).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vla.eval.replay import check_log

CONTROL_HZ = 5.0  # BridgeData V2's control rate
SITE_IN_LOG_FRAME = np.array([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])  # columns: site x, y, z


def read_bridge_episodes(path: str | Path, split: str = "train", episodes: list[int] | None = None
                         ) -> list[dict[str, Any]]:  # fmt: skip
    """``[{"states" [T, 7], "actions" [T, 7], "instruction", "name"}]`` of a Bridge RLDS export."""
    from vla.data.readers import open_dataset

    reader = open_dataset(path)
    if split not in reader.splits():
        raise ValueError(f"{path}: no split {split!r}; it has {reader.splits()}")
    indices = episodes if episodes is not None else list(range(reader.num_episodes(split)))
    out = []
    for e in indices:
        ep = reader.read_episode(split, e)
        if "observation/state" not in ep.steps or ep.steps["action"].shape[-1] != 7:
            raise ValueError(
                f"{path}: episode {e} is not Bridge-shaped (7-d observation/state EEF pose and 7-d delta action)"
            )
        instr = ep.steps.get("language_instruction")
        out.append({
            "states": np.asarray(ep.steps["observation/state"], np.float64),
            "actions": np.asarray(ep.steps["action"], np.float64),
            "instruction": str(instr[0]) if instr is not None and len(instr) else "",
            "name": f"{split}/{e}",
        })  # fmt: skip
    return out


class BridgeReplayer:
    """The sim WidowX (5 Hz, no rendering) with IK for poses given in the Bridge base frame."""

    def __init__(self) -> None:
        from vla.eval.state_env import StateOnlyEnv
        from vla.sim.ik import ArmIK

        self.env = StateOnlyEnv("widowx", "reach", control_hz=CONTROL_HZ, max_steps=10_000)
        self.env.reset(seed=0)
        world = self.env.world
        self.arm = world.robot.arms[0]
        self.ik = ArmIK(world.model, self.arm)
        self.site = world.model.site(self.arm.ee_site).id
        base = world.model.body(self.arm.base_body).id
        self.base_pos = world.data.xpos[base].copy()
        self.base_rot = world.data.xmat[base].reshape(3, 3).copy()

    def pose(self) -> tuple[np.ndarray, np.ndarray]:
        """The sim end effector in the logged frame: position (m) and rotation matrix."""
        d = self.env.world.data
        pos = self.base_rot.T @ (d.site_xpos[self.site] - self.base_pos)
        rot = self.base_rot.T @ d.site_xmat[self.site].reshape(3, 3) @ SITE_IN_LOG_FRAME.T
        return pos, rot

    def solve(self, pos: np.ndarray, rot: np.ndarray, q0: np.ndarray, rounds: int = 1) -> np.ndarray:
        """Joint targets putting the end effector at ``pos``/``rot`` (logged frame), warm-started at ``q0``."""
        world_pos = self.base_pos + self.base_rot @ pos
        world_rot = self.base_rot @ rot @ SITE_IN_LOG_FRAME
        q = q0
        for _ in range(rounds):
            q = self.ik.solve(q, world_pos, world_rot)
        return q

    def replay(self, states: np.ndarray, actions: np.ndarray, name: str = "") -> dict[str, Any]:
        """Replay one episode (``name`` for errors); per-step position (m) and orientation (rad) divergence from the
        log. NaN/inf in the log is a ValueError naming the first bad step (``vla.eval.replay.check_log``)."""
        import mujoco
        from scipy.spatial.transform import Rotation

        check_log(states, actions, name)

        env = self.env
        env.reset(seed=0)
        world, bound = env.world, env.world.bound
        matrix = lambda e: Rotation.from_euler("xyz", e).as_matrix()  # noqa: E731
        # the logged initial pose, held by the servos
        q = self.solve(states[0, :3], matrix(states[0, 3:6]), bound.joint_positions(world.data), rounds=8)
        world.data.qpos[bound.arm_qpos] = q
        world.data.qvel[:] = 0
        bound.apply_action(world.data, np.concatenate([q, [float(np.clip(states[0, 6], 0, 1))]]))
        mujoco.mj_forward(world.model, world.data)
        pos, rot = self.pose()
        start_error = float(np.linalg.norm(pos - states[0, :3]))
        pos_div, rot_div = [start_error], [_angle(rot, matrix(states[0, 3:6]))]
        target_pos, target_euler = states[0, :3].copy(), states[0, 3:6].copy()
        for t in range(len(states) - 1):
            a = actions[t]
            # the commanded pose chain (not the sim's measured pose + delta, which would compound the servos'
            # steady-state sag under gravity every step)
            target_pos, target_euler = target_pos + a[:3], target_euler + a[3:6]
            q = self.solve(target_pos, matrix(target_euler), bound.joint_positions(world.data))
            env.step(np.concatenate([q, [float(np.clip(a[6], 0, 1))]]))
            pos, rot = self.pose()
            pos_div.append(float(np.linalg.norm(pos - states[t + 1, :3])))
            rot_div.append(_angle(rot, matrix(states[t + 1, 3:6])))
        travel = np.linalg.norm(states[:, :3] - states[0, :3], axis=1)
        # reference: a perfect tracker of the commands (the pose chain itself) against the log
        chain = states[0, :3] + np.concatenate([np.zeros((1, 3)), np.cumsum(actions[:-1, :3], axis=0)])
        ideal = np.linalg.norm(chain - states[:, :3], axis=1)
        return {
            "steps": len(states),
            "start_error_m": start_error,
            "mean_m": float(np.mean(pos_div)),
            "final_m": pos_div[-1],
            "max_m": float(np.max(pos_div)),
            "rot_mean_rad": float(np.mean(rot_div)),
            "log_travel_m": float(travel.max()),
            "command_chain_mean_m": float(ideal.mean()),
            "command_chain_final_m": float(ideal[-1]),
            "per_step_m": pos_div,
            "per_step_rad": rot_div,
        }

    def close(self) -> None:
        self.env.close()


def _angle(a: np.ndarray, b: np.ndarray) -> float:
    """Angle (rad) of the rotation between two rotation matrices."""
    c = (np.trace(a.T @ b) - 1.0) / 2.0
    return float(np.arccos(np.clip(c, -1.0, 1.0)))


def replay_bridge(
    path: str | Path, *, split: str = "train", episodes: list[int] | None = None
) -> dict[str, Any]:
    """Replay Bridge episodes on the sim WidowX; per-episode divergences and their means (``summary``)."""
    eps = read_bridge_episodes(path, split, episodes)
    for ep in eps:  # every episode checked before any is replayed (no replay's work thrown away)
        check_log(ep["states"], ep["actions"], ep["name"])
    replayer = BridgeReplayer()
    rows = []
    try:
        for ep in eps:
            rows.append({"episode": ep["name"], "instruction": ep["instruction"],
                         **replayer.replay(ep["states"], ep["actions"], ep["name"])})  # fmt: skip
    finally:
        replayer.close()
    keys = (
        "start_error_m",
        "mean_m",
        "final_m",
        "max_m",
        "rot_mean_rad",
        "log_travel_m",
        "command_chain_mean_m",
        "command_chain_final_m",
    )
    return {
        "kind": "bridge_replay",
        "source": str(path),
        "robot": "sim widowx (wx250s kinematics), IK on the end-effector deltas, 5 Hz",
        "summary": {"episodes": len(rows), **{k: float(np.mean([r[k] for r in rows])) for k in keys}},
        "episodes": rows,
    }


__all__ = ["BridgeReplayer", "read_bridge_episodes", "replay_bridge"]
