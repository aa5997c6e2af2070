"""``StateOnlyEnv``: the sim env without cameras, for replay and system identification, where only the robot's
state matters and rendering would cost several times the physics. Stepping is ``VLASimEnv.step`` itself (same
actuation randomization, control period and jitter); only the observation differs (``{"state": float64 [S]}``,
no images, so ``Randomizer.observe`` draws nothing from the episode rng).

``snapshot``/``restore`` rewind the env's own per-episode state (step counter, episode rng, latency FIFO) so one
built world can be replayed many times; the caller restores the MuJoCo data (``mujoco.mj_copyData``).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from vla.sim.env import VLASimEnv
from vla.sim.randomization import RandomizationConfig, Randomizer


class _RecordedRandomizer(Randomizer):
    """A randomizer that re-applies one stored record instead of sampling a new one."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(RandomizationConfig(name=str(record.get("level", "recorded"))))
        self._stored = record

    def sample(self, rng: np.random.Generator, world: Any) -> dict[str, Any]:
        return copy.deepcopy(self._stored)


def _drop_missing(value: Any) -> Any:
    """The record without ``None`` entries (recursively)."""
    if isinstance(value, dict):
        return {k: _drop_missing(v) for k, v in value.items() if v is not None}
    return value


def recorded_randomizer(record: dict[str, Any]) -> Randomizer:
    """The randomizer that rebuilds an episode's world from its ``record`` (``info["randomization"]``).

    Entries stored as ``None`` are dropped, so those elements keep their built values: a LeRobot dataset stores
    episode metadata as flattened columns fixed by its first episode, so per-object entries (keyed by object
    name) of an episode with other objects come back as ``None`` for the first episode's names and are missing
    for its own. Robot-side values (joints, actuators, timing) are stored exactly."""
    return _RecordedRandomizer(_drop_missing(record))


class StateOnlyEnv(VLASimEnv):
    """``VLASimEnv`` whose observations hold only the robot state (see the module docstring)."""

    def __init__(self, embodiment: str, task: str, **kwargs: Any) -> None:
        super().__init__(embodiment, task, image_size=16, **kwargs)

    def _obs(self) -> dict[str, Any]:
        assert self.world is not None
        return {"state": self.world.bound.state(self.world.data).astype(np.float64)}

    def snapshot(self) -> dict[str, Any]:
        """The env's per-episode bookkeeping right now (call after ``reset``)."""
        return {"step_index": self.step_index, "rng": copy.deepcopy(self._rng)}

    def restore(self, snap: dict[str, Any]) -> None:
        self.step_index = snap["step_index"]
        self._rng = copy.deepcopy(snap["rng"])
        if self.randomizer is not None:
            self.randomizer.reset()


__all__ = ["StateOnlyEnv", "recorded_randomizer"]
