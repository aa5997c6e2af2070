"""``ActionChunkBroker``: turns a chunk-predicting policy server into one action per control step.

The robot's loop calls ``broker.act(obs)`` once per control step. The broker executes ``execute`` (k) of the H
actions of each chunk, then queries the policy again with the current observation (openpi's
``ActionChunkBroker`` with ``action_horizon = k``). With ``prefetch = p`` (0 < p <= k) the next query is sent in a
background thread when p actions of the current chunk remain, so the robot need not stand still while the server
works; the new chunk was predicted from an observation p steps old, so its first p actions are skipped (they are
the steps the old chunk covered meanwhile), and the next ``blend`` steps (default p) are a linear blend from the
old chunk's actions (where it still has any) to the new chunk's, which avoids a jump at the switch::

    step after switch j = 0 .. blend-1:  a = w_j * new[p + j] + (1 - w_j) * old[k + j],  w_j = (j + 1) / (blend + 1)

Works with any policy object whose ``infer(obs)`` returns ``{"actions": [H, A], ...}`` (``vla.serving.client``'s
clients, openpi's ``WebsocketClientPolicy``). Imports only numpy.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Protocol

import numpy as np


class ChunkPolicy(Protocol):
    def infer(self, obs: dict[str, Any]) -> dict[str, Any]: ...


class ActionChunkBroker:
    """One action ``[A]`` per ``act(obs)`` call from chunks ``[H, A]`` of ``policy.infer``.

    ``execute``: actions used from each chunk before re-querying (1 <= k <= H, and k + p <= H with prefetch,
    checked at the first chunk, before the robot moves).
    ``prefetch``: query p steps before the chunk runs out, in a background thread (0 = off); the observation's
    arrays are copied at the ``act`` call, so the robot loop may refill its buffers right after it.
    ``blend``: steps of linear blend after a prefetched switch (default ``prefetch``; 0 = switch hard).
    ``last_response`` holds the newest full response (timings, safety counts).
    """

    def __init__(
        self, policy: ChunkPolicy, execute: int, *, prefetch: int = 0, blend: int | None = None
    ) -> None:
        for name, value in (("execute", execute), ("prefetch", prefetch), ("blend", blend)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | np.integer)):
                raise ValueError(
                    f"ActionChunkBroker: {name} is a number of control steps (an int), got {value!r}"
                )
        if execute < 1:
            raise ValueError(f"ActionChunkBroker: execute must be >= 1, got {execute}")
        if not 0 <= prefetch <= execute:
            raise ValueError(f"ActionChunkBroker: prefetch must be in 0..execute ({execute}), got {prefetch}")
        if inspect.iscoroutinefunction(getattr(policy, "infer", None)):
            raise TypeError(
                "ActionChunkBroker runs in the robot's synchronous control loop (a prefetch on a thread): give it a "
                "WebsocketClient (or openpi's WebsocketClientPolicy), not an AsyncWebsocketClient"
            )
        self.policy, self.execute, self.prefetch = policy, int(execute), int(prefetch)
        self.blend = self.prefetch if blend is None else int(blend)
        if self.blend < 0:
            raise ValueError(f"ActionChunkBroker: blend must be >= 0, got {self.blend}")
        self.last_response: dict[str, Any] | None = None
        self.queries = 0
        self.reset()

    def reset(self) -> None:
        """Forget the current chunk (call at an episode start); waits for a prefetch in flight."""
        self._join()
        self._chunk: np.ndarray | None = None  # [H, A] actions being executed (blend already applied)
        self._step = 0
        self._thread: threading.Thread | None = None
        self._pending: dict[str, Any] | BaseException | None = None

    def act(self, obs: dict[str, Any]) -> np.ndarray:
        """The action ``[A]`` for this control step (queries the policy when the chunk is used up)."""
        if self._chunk is None:
            self._chunk = self._query(obs)
        elif self._step >= self.execute:
            self._chunk = self._switch(obs)
        # not an elif: with prefetch == execute the next query goes out at the new chunk's first step
        if self.prefetch and self._step == self.execute - self.prefetch and self._thread is None:
            self._start_prefetch(obs)
        action = self._chunk[self._step]
        self._step += 1
        return action

    # ---- steps ----------------------------------------------------------------------------------------------
    def _query(self, obs: dict[str, Any]) -> np.ndarray:
        response = self.policy.infer(obs)
        self.queries += 1
        self.last_response = response
        chunk = np.asarray(response["actions"], dtype=np.float32)
        # with prefetch, the later chunks are entered p actions in: the first chunk is checked for that already
        need = self.execute + self.prefetch
        if chunk.ndim != 2 or chunk.shape[0] < need:
            what = f"execute={self.execute}" + (f" + prefetch={self.prefetch}" if self.prefetch else "")
            raise ValueError(
                f"ActionChunkBroker: the policy returned actions of shape {list(chunk.shape)}, but {what} needs "
                f"[H >= {need}, A]; lower them to fit the chunk length"
            )
        self._step = 0
        return chunk

    def _start_prefetch(self, obs: dict[str, Any]) -> None:
        # copied now, on the caller's thread: a robot loop refills its camera and state buffers in place while the
        # background thread would still be packing them
        obs = _snapshot(obs)

        def run() -> None:
            try:
                self._pending = self.policy.infer(obs)
            except BaseException as e:  # handed to the control loop's thread at the switch
                self._pending = e

        self._thread = threading.Thread(target=run, name="vla-broker-prefetch", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join()

    def _switch(self, obs: dict[str, Any]) -> np.ndarray:
        if self._thread is None:  # no prefetch: query now with the current observation
            return self._query(obs)
        self._join()
        self._thread, pending, self._pending = None, self._pending, None
        if isinstance(pending, BaseException):
            raise pending
        self.queries += 1
        self.last_response = pending
        new = np.asarray(pending["actions"], dtype=np.float32)
        old = self._chunk
        skip = self.prefetch  # the new chunk starts at the observation taken `prefetch` steps ago
        if new.ndim != 2 or new.shape[0] < skip + self.execute:
            raise ValueError(
                f"ActionChunkBroker: prefetch={skip} + execute={self.execute} needs chunks of >= "
                f"{skip + self.execute} actions, got {list(new.shape)}"
            )
        chunk = new[skip:].copy()
        overlap = min(self.blend, len(chunk), len(old) - self.execute)
        for j in range(max(overlap, 0)):
            w = (j + 1) / (self.blend + 1)
            chunk[j] = w * chunk[j] + (1 - w) * old[self.execute + j]
        self._step = 0
        return chunk


def _snapshot(value: Any) -> Any:
    """A copy of an observation's numpy arrays, dicts, lists and tuples (other values are immutable or shared)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_snapshot(v) for v in value)
    return value
