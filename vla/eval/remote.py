"""A policy behind a ``vla serve`` (or any openpi-compatible) server, evaluated through the light robot-side
client ``vla.serving.client.WebsocketClient``: the same bytes a robot would send, so the run measures the served
model, its preprocessing and the round trip."""

from __future__ import annotations

from typing import Any

import numpy as np

from vla.eval.policies import _ChunkPolicy, call_seed


class ServerPolicy(_ChunkPolicy):
    """Asks the server at ``url`` for each chunk (the request carries a per-call ``seed`` for servers that honour
    it; the embodiment is named so multi-embodiment servers pick the right head)."""

    def __init__(
        self, url: str, *, name: str, execute_steps: int | None = None, api_key: str | None = None
    ) -> None:
        from vla.serving.client import WebsocketClient

        super().__init__(name, execute_steps)
        self.client = WebsocketClient(url, api_key=api_key)
        self.history = int(self.client.metadata.get("obs_history", 1))

    def act(self, obs: dict[str, Any], env: Any, step: int) -> np.ndarray:
        request = {
            "images": self.observation(obs, env).images,
            "state": np.asarray(obs["state"], np.float32),
            "prompt": env.instruction,
            "embodiment": env.embodiment_spec.name,
            "seed": call_seed(self._episode_seed, step),
        }
        out = self.client.infer(request)
        clamped = out.get("safety", {}).get("clamped")
        if clamped is not None:
            self.clamped += int(np.sum(clamped))
        return self._keep(np.asarray(out["actions"], np.float32))


__all__ = ["ServerPolicy"]
