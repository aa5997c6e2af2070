"""What closed-loop evaluation runs: a checkpoint (``vla.policy.Policy``), a policy behind a ``vla serve`` server,
the scripted ``expert`` or a uniform ``random`` baseline — all behind one small interface, so baselines and
checkpoints go through the same rollout code and the same seeds.

An ``EvalPolicy`` is asked for actions at a control step and answers with a chunk ``[h, A]`` (robot units) that
the rollout executes in full before asking again: the expert and random answer one action (``h = 1``), a
checkpoint answers the first ``execute_steps`` of its ``H``-step chunk (receding horizon; all ``H`` by default).
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any, Protocol

import numpy as np

BASELINES = ("expert", "random")


def call_seed(episode_seed: int, step: int) -> int:
    """The seed of the policy's noise for the chunk asked at ``step`` of an episode (deterministic, distinct)."""
    return int(np.random.SeedSequence([int(episode_seed), int(step), 7]).generate_state(1)[0])


class EvalPolicy(Protocol):
    """A policy under evaluation: ``reset`` once per episode, then ``act`` whenever the previous chunk is spent."""

    name: str
    needs_images: bool

    def reset(self, env: Any, episode_seed: int) -> None: ...

    def act(self, obs: dict[str, Any], env: Any, step: int) -> np.ndarray:
        """Actions ``[h, A]`` float32 to execute from ``step`` on (``obs`` is the env's observation)."""
        ...


class ExpertPolicy:
    """The env's scripted expert (``VLASimEnv.expert_action``): the task's reference success rate."""

    name = "expert"
    needs_images = False

    def reset(self, env: Any, episode_seed: int) -> None:
        pass  # the env restarts its expert on reset

    def act(self, obs: dict[str, Any], env: Any, step: int) -> np.ndarray:
        return env.expert_action()[None]


class RandomPolicy:
    """Uniform actions within the env's action limits (joint limits, gripper 0..1), seeded per episode."""

    name = "random"
    needs_images = False

    def __init__(self) -> None:
        self._rng = np.random.default_rng(0)

    def reset(self, env: Any, episode_seed: int) -> None:
        self._rng = np.random.default_rng([int(episode_seed), 3])

    def act(self, obs: dict[str, Any], env: Any, step: int) -> np.ndarray:
        low, high = env.action_space.low, env.action_space.high
        # a continuous revolute joint (e.g. Kinova Gen3's joints 1, 3, 5, 7) has no limits: one turn covers it
        low, high = np.where(np.isfinite(low), low, -np.pi), np.where(np.isfinite(high), high, np.pi)
        return self._rng.uniform(low, high).astype(np.float32)[None]


class _ChunkPolicy:
    """Shared by checkpoint and server policies: builds the ``Observation`` and keeps ``execute_steps``.

    A model trained with an observation history of ``T`` frames gets the last ``T`` frames of every camera (one per
    control step, oldest first; fewer at the episode start, which ``Policy`` pads like the loader), so the rollout
    shows it every frame through ``observe``, not only those at which it is asked for a chunk."""

    needs_images = True

    def __init__(self, name: str, execute_steps: int | None) -> None:
        if execute_steps is not None and execute_steps < 1:
            raise ValueError(f"--execute-steps must be >= 1, got {execute_steps}")
        self.name = name
        self.execute_steps = execute_steps
        self.history = 1  # frames per camera the model takes (its obs_history)
        self._frames: dict[str, deque[np.ndarray]] = {}
        self._episode_seed = 0
        self.clamped = 0  # action values clamped to the spec's limits, summed over the run

    def reset(self, env: Any, episode_seed: int) -> None:
        self._episode_seed = int(episode_seed)
        self._frames = {}

    def observe(self, obs: dict[str, Any]) -> None:
        """Record this control step's frames (called by the rollout at every step)."""
        if self.history <= 1:
            return
        for slot, img in obs["images"].items():  # copies: a renderer may reuse its buffer
            self._frames.setdefault(slot, deque(maxlen=self.history)).append(np.array(img))

    def observation(self, obs: dict[str, Any], env: Any) -> Any:
        from vla.types import Observation

        images = obs["images"]
        if self.history > 1 and self._frames:
            images = {slot: np.stack(list(frames)) for slot, frames in self._frames.items()}  # [T', h, w, 3]
        return Observation(images=images, state=obs["state"], prompt=env.instruction,
                           embodiment=env.embodiment_spec.name)  # fmt: skip

    def _keep(self, actions: np.ndarray) -> np.ndarray:
        k = self.execute_steps or len(actions)
        return np.asarray(actions[:k], dtype=np.float32)


class CheckpointPolicy(_ChunkPolicy):
    """A checkpoint through ``vla.policy.Policy`` (the checkpoint's own preprocessing and stats), in process."""

    def __init__(self, path: str | Path, embodiment: str, *, execute_steps: int | None = None,
                 device: str = "cpu", dtype: str = "float32", num_steps: int | None = None) -> None:  # fmt: skip
        from vla.policy import Policy

        super().__init__(str(path), execute_steps)
        self.policy = Policy.from_checkpoint(path, device=device, dtype=dtype, num_steps=num_steps)
        self.history = int(self.policy.metadata()["obs_history"])
        if embodiment not in self.policy.embodiments:
            # in the checkpoint but not served: naming it raises the reason (e.g. its stats need a choice)
            if embodiment in self.policy.model.embodiment_ids:
                Policy(self.policy.model, embodiments=[embodiment], num_steps=num_steps, name=str(path))
            raise ValueError(
                f"checkpoint {path} does not serve embodiment {embodiment!r} (it serves {self.policy.embodiments}); "
                f"evaluate it on one of those, or fine-tune it on {embodiment!r} first"
            )

    def act(self, obs: dict[str, Any], env: Any, step: int) -> np.ndarray:
        chunk = self.policy.infer(self.observation(obs, env), seed=call_seed(self._episode_seed, step))
        self.clamped += int(chunk.clamped.sum())
        return self._keep(chunk.actions)


def make_policy(policy: str, embodiment: str, *, execute_steps: int | None = None, via_server: str | None = None,
                device: str = "cpu", dtype: str = "float32", num_steps: int | None = None) -> EvalPolicy:  # fmt: skip
    """``expert``, ``random``, or a checkpoint path (step dir, run dir or export); with ``via_server`` the
    checkpoint is the one that server serves (``policy`` then only names it in the results)."""
    if via_server:
        from vla.eval.remote import ServerPolicy

        return ServerPolicy(via_server, name=policy, execute_steps=execute_steps)
    if policy == "expert":
        return ExpertPolicy()
    if policy == "random":
        return RandomPolicy()
    if not Path(policy).exists():
        raise ValueError(
            f"POLICY {policy!r} is neither 'expert', 'random' nor an existing checkpoint folder "
            "(a `vla train` run or step folder, or a `vla export` / `vla model init` folder)"
        )
    return CheckpointPolicy(policy, embodiment, execute_steps=execute_steps, device=device, dtype=dtype,
                            num_steps=num_steps)  # fmt: skip


__all__ = [
    "BASELINES",
    "CheckpointPolicy",
    "EvalPolicy",
    "ExpertPolicy",
    "RandomPolicy",
    "call_seed",
    "make_policy",
]
