"""Gymnasium environment over the sim worlds and tasks: ``make(embodiment, task, ...) -> VLASimEnv``.

Observation: ``{"images": {slot: uint8 [H, W, 3]}, "state": float32 [S]}`` with the embodiment spec's camera
slots and state layout (``vla.sim.embodiment.embodiment_for``); action: float32 [A], absolute joint targets (rad)
then a gripper command in [0, 1] (1 = open) per arm, bounded by the spec's limits. One ``step`` = one control
period = ``round(1 / (control_hz · timestep))`` physics steps (10 Hz → 50 steps of 2 ms; ALOHA 20 Hz → 25), during
which each joint's servo setpoint moves toward its target no faster than the joint's published speed limit
(``World.act``), so a far target takes several steps, as on a real arm.
``reset(seed=s)`` rebuilds the world for ``s`` (same seed, same robot/objects/instruction) and restarts the
scripted expert (``expert_action()``).

The procedural robot draws a new arm per seed, but its DoF is fixed per env so the spaces never change:
``procedural_<N>dof`` (or ``robot_options={"dof": N}``) picks N in 4..7; plain ``procedural`` takes the DoF of
the arm of the env's first seed (``seed``, default 0). Its spec is ``sim_procedural_<N>dof`` (limits = the
envelope over all arms of that DoF); the episode's own arm is ``info["robot_params"]``.

A ``randomizer`` (``vla.sim.randomization``) is any object with ``sample(rng, world) -> record``,
``apply(world, record)``, ``act(action, step_index, rng) -> action`` and ``observe(images, rng) -> images``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import mujoco
import numpy as np

from vla.sim.embodiment import embodiment_for
from vla.sim.expert import ScriptedExpert
from vla.sim.tasks import TASKS, Task, TaskSetup, Workspace
from vla.sim.world import World, build_world

_PROCEDURAL_DOF = re.compile(r"procedural_(\d+)dof")


class VLASimEnv(gym.Env):
    """One robot, one task family; a fresh world per ``reset``. See the module docstring for the spaces."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, embodiment: str, task: str, *, randomization: Any = None, seed: int | None = None,
                 image_size: int = 128, control_hz: float | None = None, max_steps: int | None = None,
                 render_mode: str | None = None, robot_options: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.robot_name = embodiment.removeprefix("sim_")
        self.robot_options = dict(robot_options or {})
        if m := _PROCEDURAL_DOF.fullmatch(self.robot_name):
            self.robot_name, dof = "procedural", int(m.group(1))
            if self.robot_options.setdefault("dof", dof) != dof:
                raise ValueError(
                    f"{embodiment!r} has dof {dof} but robot_options say {self.robot_options['dof']}"
                )
        self.task: Task = TASKS.get(task)
        if isinstance(randomization, str | Path):  # a level name or a YAML file
            from vla.sim.randomization import Randomizer

            randomization = Randomizer.from_level(str(randomization))
        self.randomizer = randomization
        self.image_size = image_size
        self.render_mode = render_mode
        first_seed = 0 if seed is None else int(seed)
        if self.robot_name == "procedural" and "dof" not in self.robot_options:
            # Fix the joint count so the spaces stay the same across resets (link lengths still vary).
            probe = build_world("procedural", seed=first_seed, image_size=image_size)
            self.robot_options["dof"] = probe.robot.dof
        probe = build_world(self.robot_name, seed=first_seed, image_size=image_size, **self.robot_options)
        self.embodiment_spec = embodiment_for(probe.robot)
        self.control_hz = float(control_hz or self.embodiment_spec.control_hz)
        self.substeps = max(1, round(1.0 / (self.control_hz * probe.model.opt.timestep)))
        self.max_steps = int(max_steps or round(self.task.max_steps * self.control_hz / 10.0))
        self.metadata = {**self.metadata, "render_fps": self.control_hz}
        self.slots = list(self.embodiment_spec.cameras)
        # The spec's limits: each fixed robot's own, the envelope of all arms for procedural ones.
        a_low, a_high = (x.astype(np.float32) for x in self.embodiment_spec.limits("action"))
        joint_dims = probe.bound.joint_dims
        s_low, s_high = a_low.copy(), a_high.copy()
        s_low[joint_dims] -= 0.1  # joints may sit a little past a limit (soft constraints)
        s_high[joint_dims] += 0.1
        self.action_space = gym.spaces.Box(a_low, a_high, dtype=np.float32)
        img = gym.spaces.Box(0, 255, (image_size, image_size, 3), np.uint8)
        self.observation_space = gym.spaces.Dict({
            "images": gym.spaces.Dict({slot: img for slot in self.slots}),
            "state": gym.spaces.Box(s_low, s_high, dtype=np.float32),
        })  # fmt: skip
        # A task draws its objects inside the robot's workspace, which only the procedural robot changes per seed;
        # for the others the probe's workspace serves every reset (one world build per reset, not two).
        self._workspace = Workspace.of(probe) if self.robot_name != "procedural" else None
        probe.close()
        self._seed = seed
        self.world: World | None = None
        self.setup: TaskSetup | None = None
        self.expert: ScriptedExpert | None = None
        self.instruction = ""
        self.record: dict[str, Any] = {}
        self.step_index = 0
        self._rng = np.random.default_rng(seed)

    # ---- gymnasium API -------------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
        super().reset(seed=seed)
        if seed is None and self._seed is not None and self.world is None:
            seed = self._seed
        episode_seed = int(seed) if seed is not None else int(self.np_random.integers(2**31))
        if self.world is not None:
            self.world.close()
        workspace = self._workspace
        if workspace is None:  # procedural: this seed's arm sets the workspace
            probe = build_world(self.robot_name, seed=episode_seed, image_size=self.image_size,
                                **self.robot_options)  # fmt: skip
            workspace = Workspace.of(probe)
            probe.close()
        task_rng = np.random.default_rng([episode_seed, 1])
        self.setup = self.task.setup(task_rng, workspace)
        self.world = build_world(self.robot_name, seed=episode_seed, image_size=self.image_size,
                                 objects=self.setup.objects, **self.robot_options)  # fmt: skip
        self.instruction = self.task.instruction(self.setup, task_rng)
        self._rng = np.random.default_rng([episode_seed, 2])
        self.record = {}
        self._period_scale, self._jitter_std = 1.0, 0.0
        if self.randomizer is not None:
            if hasattr(self.randomizer, "reset"):
                self.randomizer.reset()
            self.record = dict(self.randomizer.sample(self._rng, self.world))
            self.randomizer.apply(self.world, self.record)
        self.task.initialize(self.world, self.setup)
        system = self.record.get("system", {}) if isinstance(self.record, dict) else {}
        if system:
            # system randomization the world cannot hold: reset-pose noise and the control period
            offset = np.asarray(system.get("reset_joint_offset", []), np.float64)
            if offset.size == len(self.world.bound.arm_qpos):
                self.world.data.qpos[self.world.bound.arm_qpos] += offset
                self.world.data.ctrl[self.world.bound.arm_ctrl] = self.world.data.qpos[
                    self.world.bound.arm_qpos
                ]
            self._period_scale = float(system.get("control_period_scale", 1.0))
            self._jitter_std = float(system.get("control_jitter_std", 0.0))
        mujoco.mj_forward(self.world.model, self.world.data)
        self.expert = ScriptedExpert(self.world, self.setup, self.control_hz)
        self.step_index = 0
        info = {"instruction": self.instruction, "task": self.task.name, "randomization": self.record,
                "seed": episode_seed, "success": False, "robot_params": self.world.params["robot_params"]}  # fmt: skip
        return self._obs(), info

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        assert self.world is not None and self.setup is not None, "call reset() first"
        action = np.asarray(action, np.float64)
        if action.shape != self.action_space.shape:  # a caller's bug, before any judgement of the values
            raise ValueError(
                f"{self.embodiment_spec.name}: action has shape {action.shape}, expected {self.action_space.shape} "
                "(the embodiment's action dims)"
            )
        if not np.isfinite(action).all():
            # a policy that outputs NaN or inf has failed: the servos cannot follow it, and one broken episode
            # must not end a whole evaluation. End the episode here as a failure, flagged, nothing simulated (so
            # step_index stays: no control step was taken).
            info = {"instruction": self.instruction, "task": self.task.name, "success": False,
                    "physics_diverged": False, "non_finite_action": True, "target_distance_m": None,
                    "nearest_object": None}  # fmt: skip
            return self._obs(), 0.0, False, True, info
        if self.randomizer is not None:
            action = np.asarray(self.randomizer.act(action, self.step_index, self._rng), np.float64)
        substeps = self.substeps * self._period_scale
        if self._jitter_std > 0:
            substeps *= 1.0 + self._rng.normal(0.0, self._jitter_std)
        warnings_before = self.world.instability_warnings()
        self.world.act(action, max(1, round(substeps)))  # joint setpoints ramp at the joints' speed limits
        self.step_index += 1
        # MuJoCo resets the state to the model's home pose when the simulation blows up (non-finite or huge
        # positions, velocities or accelerations) and only counts a warning: the episode cannot go on from there,
        # and a success detected on the reset state would be false. End it as a failure, flagged.
        diverged = self.world.instability_warnings() > warnings_before
        success = not diverged and bool(self.task.success(self.world, self.setup))
        truncated = diverged or (self.step_index >= self.max_steps and not success)
        nearest = None if diverged else self.task.nearest_object(self.world, self.setup)
        info = {"instruction": self.instruction, "task": self.task.name, "success": success,
                "physics_diverged": diverged, "non_finite_action": False,
                "target_distance_m": None if diverged else self.task.target_distance(self.world, self.setup),
                # (object the TCP is nearest over, horizontal distance m, whether it is the named one)
                "nearest_object": None if nearest is None else
                (nearest[0], nearest[1], nearest[0] == self.setup.goal["target"])}  # fmt: skip
        return self._obs(), float(success), success, truncated, info

    def render(self) -> np.ndarray | None:
        if self.render_mode == "rgb_array" and self.world is not None:
            return self.world.render("primary")
        return None

    def close(self) -> None:
        if self.world is not None:
            self.world.close()

    # ---- extras --------------------------------------------------------------------------------------------
    def expert_action(self) -> np.ndarray:
        """The scripted expert's next action for the current state, float32 [A] (advances the expert)."""
        assert self.expert is not None, "call reset() first"
        return self.expert.act().astype(np.float32)

    def is_success(self) -> bool:
        assert self.world is not None and self.setup is not None
        return bool(self.task.success(self.world, self.setup))

    def _obs(self) -> dict[str, Any]:
        assert self.world is not None
        images = {slot: self.world.render(slot) for slot in self.slots}
        if self.randomizer is not None:
            images = self.randomizer.observe(images, self._rng)
        state = self.world.bound.state(self.world.data).astype(np.float32)
        return {"images": images, "state": state}


def make(embodiment: str, task: str, *, randomization: Any = None, seed: int | None = None, image_size: int = 128,
         control_hz: float | None = None, max_steps: int | None = None, **kwargs: Any) -> VLASimEnv:  # fmt: skip
    """A ``VLASimEnv`` for robot ``embodiment`` (``panda`` or ``sim_panda``, …) and task ``task``."""
    return VLASimEnv(embodiment, task, randomization=randomization, seed=seed, image_size=image_size,
                     control_hz=control_hz, max_steps=max_steps, **kwargs)  # fmt: skip


__all__ = ["VLASimEnv", "make"]
