"""A policy behind a ``vla serve`` (or any openpi-compatible) server, evaluated through the light robot-side
client ``vla.serving.client.WebsocketClient``: the same bytes a robot would send, so the run measures the served
model, its preprocessing and the round trip."""

from __future__ import annotations

from typing import Any

import numpy as np

from vla.eval.policies import _ChunkPolicy, call_seed


class ServerPolicy(_ChunkPolicy):
    """Asks the server at ``url`` for chunks through the robot-side ``ActionChunkBroker``, as a robot's control loop
    does: one action per control step, a new chunk every ``execute_steps`` steps (default: the whole chunk). Each
    request carries a per-call ``seed`` for servers that honour it, and the embodiment, so multi-embodiment
    servers pick the right head."""

    def __init__(
        self, url: str, *, name: str, execute_steps: int | None = None, api_key: str | None = None
    ) -> None:
        from vla.serving.client import WebsocketClient

        super().__init__(name, execute_steps)
        self.client = WebsocketClient(url, api_key=api_key)
        self.history = int(self.client.metadata.get("obs_history", 1))
        self.broker: Any = None
        self.queries = 0  # chunks asked for in the current episode

    def reset(self, env: Any, episode_seed: int) -> None:
        from vla.serving.broker import ActionChunkBroker

        super().reset(env, episode_seed)
        name = env.embodiment_spec.name
        served = self.client.metadata.get("embodiments", {})
        if name not in served:
            raise ValueError(f"the server does not serve {name!r}; it serves {sorted(served)}")
        execute = self.execute_steps or int(served[name]["chunk_length"])
        self.broker = ActionChunkBroker(self.client, execute=execute)
        self.queries = 0

    def act(self, obs: dict[str, Any], env: Any, step: int) -> np.ndarray:
        request = {
            "images": self.observation(obs, env).images,
            "state": np.asarray(obs["state"], np.float32),
            "prompt": env.instruction,
            "embodiment": env.embodiment_spec.name,
            "seed": call_seed(self._episode_seed, step),  # used when the broker asks for a chunk at this step
        }
        before = self.broker.queries
        action = self.broker.act(request)
        if self.broker.queries != before:
            self.queries += 1
            clamped = (self.broker.last_response or {}).get("safety", {}).get("clamped")
            if clamped is not None:
                self.clamped += int(np.sum(clamped))
        return np.asarray(action, np.float32)[None]


__all__ = ["ServerPolicy"]
