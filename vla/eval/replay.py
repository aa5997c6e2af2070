"""Offline replay: a logged action sequence run open loop in the simulator from the logged initial state, and the
state divergence per step between the replay and the log.

Sources are ``LoggedEpisode``s: our own sim datasets (``read_sim_episodes``: the episode's seed rebuilds its world
and its randomization record is re-applied, so with the same parameters the replay reproduces the log and the
error is ~0), or any logs of a robot that has a sim model (``vla.eval.bridge`` for the real WidowX of Bridge).

``SimParams`` perturbs the replayed world, relative to the world as rebuilt (1 = unchanged): contact friction
(sliding coefficient of every geom), joint damping and armature of every dof, servo stiffness kp of every
actuator (``gainprm[0]`` and ``-biasprm[1]`` together, as the actuation randomization scales them), and a latency
of whole control steps (the action applied at step t is the one logged at t - latency). These are the knobs
``vla.eval.sysid`` fits and the same quantities the randomization presets scale.

Alignment: ``states[t]`` is the observation before ``actions[t]`` was applied, so the replay's state after t
steps is compared with ``states[t]``; the divergence at step t is the L2 norm of the joint-position difference
(rad; the gripper opening is reported apart).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PARAM_NAMES = ("friction", "damping", "armature", "kp", "latency")
log = logging.getLogger(__name__)


def check_servo_model(meta: dict[str, Any], name: str) -> bool:
    """Whether a sim episode was recorded with today's servo model (``vla.sim.world.SERVO_MODEL``); warns if not.

    Data generated before the arms had joint speed limits has no ``servo_model``: its servos jumped to each target
    at once, so a replay (which ramps them at the limits) no longer reproduces it exactly, and a system
    identification on it would fit the missing ramp into kp and armature."""
    from vla.sim.world import SERVO_MODEL

    got = meta.get("servo_model")
    if got == SERVO_MODEL:
        return True
    log.warning(
        "%s was recorded with servo model %r, not %r (before the sim arms had joint speed limits, if none): its "
        "replay will not reproduce it exactly (Panda pick-and-place: joint error ~0.005 rad mean, 0.02 rad max) and sysid "
        "on it is biased; regenerate it with `vla sim generate` to replay it exactly",
        name, got, SERVO_MODEL,
    )  # fmt: skip
    return False


def check_log(states: np.ndarray, actions: np.ndarray, name: str) -> None:
    """A logged trajectory must be replayable: ``states`` [T, S] and ``actions`` [T, A] with the same T >= 1, every
    value finite. A NaN or inf is a ValueError naming the episode, the array, the first bad step and its dims (a
    replay would otherwise stop at that step as a flagged failure and keep going on a frozen world)."""
    states, actions = np.asarray(states), np.asarray(actions)
    if states.ndim != 2 or actions.ndim != 2 or len(states) != len(actions) or len(states) == 0:
        raise ValueError(
            f"logged episode {name or '?'}: states {states.shape} and actions {actions.shape} must be [T, S] and "
            "[T, A] with the same T >= 1"
        )
    for what, x in (("states", states), ("actions", actions)):
        bad = ~np.isfinite(x)
        if bad.any():
            t = int(np.argmax(bad.any(axis=1)))
            raise ValueError(
                f"logged episode {name or '?'}: {what} hold NaN or inf ({int(bad.sum())} values), first at step "
                f"{t}, dims {np.flatnonzero(bad[t]).tolist()}; drop or repair this episode before replaying it "
                "(`vla data validate` lists such frames)"
            )


@dataclass
class LoggedEpisode:
    """One logged trajectory in robot units: ``states`` [T, S] and ``actions`` [T, A] (spec order), and what the
    replay needs to rebuild its world (``seed`` and randomization ``record`` for sim logs)."""

    embodiment: str
    task: str
    states: np.ndarray
    actions: np.ndarray
    seed: int | None = None
    record: dict[str, Any] | None = None
    name: str = ""

    def __post_init__(self) -> None:
        check_log(self.states, self.actions, self.name)


@dataclass(frozen=True)
class SimParams:
    """Sim parameters relative to the replayed world (scales; ``latency`` in control steps)."""

    friction: float = 1.0
    damping: float = 1.0
    armature: float = 1.0
    kp: float = 1.0
    latency: int = 0

    def __post_init__(self) -> None:
        for name in PARAM_NAMES[:4]:
            if not getattr(self, name) > 0:
                raise ValueError(f"sim parameter {name} must be a positive scale, got {getattr(self, name)}")
        if self.latency < 0:
            raise ValueError(f"sim parameter latency must be >= 0 control steps, got {self.latency}")

    @classmethod
    def parse(cls, text: str) -> SimParams:
        """``"damping=1.2,kp=0.9,latency=1"`` -> ``SimParams`` (unknown names get the list of known ones)."""
        values: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in PARAM_NAMES:
                raise ValueError(
                    f"--params: {item!r} is not NAME=VALUE with NAME in {', '.join(PARAM_NAMES)}"
                )
            values[name] = int(value) if name == "latency" else float(value)
        return cls(**values)


def nominal_params(model: Any) -> dict[str, np.ndarray]:
    """Copies of the model arrays ``apply_params`` scales (the reference the scales are relative to)."""
    keys = ("geom_friction", "dof_damping", "dof_armature", "actuator_gainprm", "actuator_biasprm")
    return {k: getattr(model, k).copy() for k in keys}


def apply_params(model: Any, nominal: dict[str, np.ndarray], actuators: list[int], p: SimParams) -> None:
    """Write ``nominal`` scaled by ``p`` into ``model`` (idempotent: always from the nominal values)."""
    model.geom_friction[:] = nominal["geom_friction"]
    model.geom_friction[:, 0] *= p.friction
    model.dof_damping[:] = nominal["dof_damping"] * p.damping
    model.dof_armature[:] = nominal["dof_armature"] * p.armature
    model.actuator_gainprm[:] = nominal["actuator_gainprm"]
    model.actuator_biasprm[:] = nominal["actuator_biasprm"]
    model.actuator_gainprm[actuators, 0] *= p.kp
    model.actuator_biasprm[actuators, 1] *= p.kp


def read_sim_episodes(path: str | Path, episodes: list[int] | None = None, split: str | None = None
                      ) -> list[LoggedEpisode]:  # fmt: skip
    """Episodes of a ``vla sim generate`` dataset (LeRobot v3) with their seeds and randomization records."""
    from vla.data.readers.lerobot import LeRobotReader

    reader = LeRobotReader(path)
    split = split or reader.splits()[0]
    indices = episodes if episodes is not None else list(range(reader.num_episodes(split)))
    out, servo_models_seen = [], set()
    for e in indices:
        if not 0 <= e < reader.num_episodes(split):
            raise ValueError(
                f"{path}: no episode {e} in split {split!r} ({reader.num_episodes(split)} episodes)"
            )
        ep = reader.read_episode(split, e)
        meta = ep.metadata
        if "sim_seed" not in meta:
            raise ValueError(
                f"{path} episode {e} has no sim_seed in its metadata: not written by `vla sim generate`, so its "
                "world cannot be rebuilt; replay real logs with a robot-specific replayer (e.g. vla.eval.bridge)"
            )
        if meta.get("servo_model") not in servo_models_seen:  # one warning per servo model, not per episode
            servo_models_seen.add(meta.get("servo_model"))
            check_servo_model(meta, f"{path} episode {e} (and every other episode with the same record)")
        out.append(LoggedEpisode(
            embodiment=meta["embodiment"], task=meta["task_name"],
            states=np.asarray(ep.steps["observation.state"], np.float64),
            actions=np.asarray(ep.steps["action"], np.float64),
            seed=int(meta["sim_seed"]), record=meta.get("randomization") or None, name=f"{Path(path).name}/{e}",
        ))  # fmt: skip
    reader.close()
    return out


class Replayer:
    """Replays one ``LoggedEpisode`` as often as asked with different ``SimParams`` (the world is built once; each
    run restores its initial state), without rendering."""

    def __init__(
        self, episode: LoggedEpisode, *, use_record: bool = True, control_hz: float | None = None
    ) -> None:
        from vla.eval.state_env import StateOnlyEnv, recorded_randomizer

        self.episode = episode
        randomizer = recorded_randomizer(episode.record) if use_record and episode.record else None
        self.env = StateOnlyEnv(episode.embodiment, episode.task, randomization=randomizer, control_hz=control_hz,
                                max_steps=len(episode.actions) + 1)  # fmt: skip
        self.env.reset(seed=episode.seed)
        world = self.env.world
        m = world.model
        self.joint_dims = np.asarray(world.bound.joint_dims)
        self._arm_qpos = np.asarray(world.bound.arm_qpos)
        if episode.seed is None:  # no world seed: start from the logged joint positions
            world.data.qpos[self._arm_qpos] = episode.states[0][self.joint_dims]
            world.data.ctrl[world.bound.arm_ctrl] = episode.states[0][self.joint_dims]
        import mujoco

        mujoco.mj_forward(m, world.data)
        self._actuators = [m.actuator(a).id for a in world.robot.actuator_names]
        self._nominal = nominal_params(m)
        self._data0 = copy.copy(world.data)
        self._env_state = self.env.snapshot()

    def _apply(self, p: SimParams) -> None:
        apply_params(self.env.world.model, self._nominal, self._actuators, p)

    def run(self, params: SimParams | None = None) -> np.ndarray:
        """The replayed states ``[T, S]`` (row t: after t logged actions; row 0 = the initial state)."""
        import mujoco

        p = params or SimParams()
        self._apply(p)
        world, env = self.env.world, self.env
        mujoco.mj_copyData(world.data, world.model, self._data0)
        env.restore(self._env_state)
        acts = self.episode.actions
        states = [world.bound.state(world.data)]
        for t in range(len(acts) - 1):
            obs, *_ = env.step(acts[max(0, t - p.latency)])
            states.append(obs["state"])
        return np.asarray(states, np.float64)

    def divergence(self, params: SimParams | None = None) -> dict[str, Any]:
        """Per-step joint divergence (rad, L2 over joints) and gripper divergence, with their summary."""
        sim = self.run(params)
        log = self.episode.states[: len(sim)]
        joints = np.linalg.norm(sim[:, self.joint_dims] - log[:, self.joint_dims], axis=1)
        other = np.setdiff1d(np.arange(log.shape[1]), self.joint_dims)
        grip = np.abs(sim[:, other] - log[:, other]).max(axis=1) if other.size else np.zeros(len(sim))
        return {"episode": self.episode.name, "steps": len(sim), **summarize_divergence(joints),
                "gripper_mean": float(grip.mean()), "per_step": joints.tolist()}  # fmt: skip

    def close(self) -> None:
        self.env.close()


def summarize_divergence(per_step: np.ndarray) -> dict[str, float]:
    return {"mean": float(np.mean(per_step)), "final": float(per_step[-1]), "max": float(np.max(per_step))}


@dataclass
class ReplayReport:
    """Divergence of every replayed episode under ``params`` plus the mean over episodes of each summary."""

    params: dict[str, Any]
    episodes: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {k: float(np.mean([e[k] for e in self.episodes])) for k in ("mean", "final", "max")}

    def to_json(self) -> dict[str, Any]:
        return {"kind": "replay", "units": "rad (L2 over joint positions)", "params": self.params,
                "summary": self.summary(), "episodes": self.episodes}  # fmt: skip


def replay(episodes: list[LoggedEpisode], params: SimParams | None = None, *, use_record: bool = True
           ) -> ReplayReport:  # fmt: skip
    """Replay every episode under ``params``; the report of their divergences."""
    report = ReplayReport(params=asdict(params or SimParams()))
    for ep in episodes:
        r = Replayer(ep, use_record=use_record)
        report.episodes.append(r.divergence(params))
        r.close()
    return report


def write_report(report: dict[str, Any], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, allow_nan=False))
    return out


__all__ = [
    "PARAM_NAMES",
    "LoggedEpisode",
    "ReplayReport",
    "Replayer",
    "SimParams",
    "read_sim_episodes",
    "replay",
]
