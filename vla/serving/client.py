"""Robot-side clients for ``vla serve`` (and any openpi-compatible policy server). No torch import.

Needs only numpy, msgpack and websockets (``pip install numpy msgpack websockets`` plus this package with
``--no-deps``; see the README's "Client-only install")::

    from vla.serving.client import WebsocketClient, ActionChunkBroker

    with WebsocketClient("ws://127.0.0.1:8000", api_key=None) as client:
        client.metadata                       # the server's metadata frame: protocol, model, embodiments, keys
        out = client.infer({                  # one request -> one response dict
            "images": {"primary": rgb_uint8_hw3, "wrist": wrist_uint8_hw3},
            "state": state_float_s,           # the embodiment spec's state order and units
            "prompt": "pick up the red cube",
            "embodiment": "sim_panda",        # needed when the server serves several
        })
        out["actions"]                        # float32 [H, A] in the robot's units
        out["safety"]["clamped"]              # list of A ints: values clamped to the spec's limits per dim
        out["server_timing"]["infer_ms"]

        broker = ActionChunkBroker(client, execute=8)   # run 8 of the H actions, then re-query
        action = broker.act(obs)                        # float32 [A] for this control step

``AsyncWebsocketClient`` is the same for asyncio (``async with`` / ``await client.infer(obs)``). A server error
(bad request, unsafe actions) raises ``ServerError`` with the server's one-line message; the server closes the
connection after an error and the next ``infer`` reconnects. A dropped connection is re-opened and the request
sent once more (``retries``), with ``timeout`` seconds for each response. Any other failure of a request (a
timeout, a cancelled ``await``, Ctrl-C, a malformed response) closes the connection before it is raised, and the
next ``infer`` reconnects: the late reply to the abandoned request must never be read as the answer to the next one
(a robot would act on an old chunk). ``close()`` ends a client for good: a request in flight on another thread
or task raises ``ClientClosedError`` instead of reconnecting, and so does every later ``infer``.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import websockets
import websockets.asyncio.client
import websockets.sync.client

from vla.serving.broker import ActionChunkBroker
from vla.serving.protocol import ProtocolError, pack, unpack

__all__ = ["ActionChunkBroker", "AsyncWebsocketClient", "ClientClosedError", "ServerError", "WebsocketClient"]

# websockets >= 17 warns unless a long-lived sync connection opts in with legacy=True; older versions lack the flag.
_SYNC_LEGACY = (
    {"legacy": True} if "legacy" in inspect.signature(websockets.sync.client.connect).parameters else {}
)
# Responses are small ([H, A] floats); this only bounds a misbehaving server.
_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# Seconds a close handshake may take: a connection dropped after a timeout may lead to a hung server.
_CLOSE_TIMEOUT = 2.0


class ServerError(RuntimeError):
    """The server answered a request with an error (its one-line text message) instead of actions."""


class ClientClosedError(RuntimeError):
    """``infer`` on a client that ``close()`` ended (before or during the request); open a new client."""


def _closed_error(client: object) -> ClientClosedError:
    return ClientClosedError(
        f"{type(client).__name__} for {getattr(client, 'url', '?')} was closed; open a new client to go on"
    )


def _after_failed_exchange(client: Any, e: Exception, drop: Callable[[], None], last_attempt: bool) -> None:
    """What a failed send/recv of ``client`` (sync or asyncio) leads to: ``ClientClosedError`` when ``close()``
    ended the client meanwhile (never a reconnect); otherwise the connection is dropped (a late reply must not
    answer the next request) and the error raised, except a dropped connection with attempts left: then the caller
    reconnects and sends again."""
    if client._closed:
        raise _closed_error(client) from e
    drop()
    if last_attempt or not isinstance(e, websockets.exceptions.ConnectionClosed):
        raise e


def _headers(api_key: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Api-Key {api_key}"} if api_key else None


def _response(frame: str | bytes) -> dict[str, Any]:
    if isinstance(frame, str):  # openpi's convention: a text frame is an error message
        raise ServerError(frame)
    out = unpack(frame, max_bytes=_MAX_RESPONSE_BYTES)
    if not isinstance(out, dict):
        raise ProtocolError(f"expected a msgpack map from the server, got {type(out).__name__}")
    return out


def _decoded(reply: str | bytes, drop: Callable[[], None]) -> dict[str, Any]:
    """``_response(reply)``; a malformed response first ``drop``s the connection (its state is unknown), a server
    error (already closed by the caller) is raised as it is."""
    try:
        return _response(reply)
    except ServerError:
        raise
    except BaseException:
        drop()
        raise


class WebsocketClient:
    """Blocking client: ``infer(obs) -> response``. One request is in flight at a time: calls from several threads
    take turns on the one connection (a client per thread runs them concurrently, and the server batches them)."""

    def __init__(
        self,
        url: str = "ws://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 30.0,
        retries: int = 1,
    ) -> None:
        self.url = url if url.startswith(("ws://", "wss://")) else f"ws://{url}"
        self.api_key, self.timeout, self.connect_timeout, self.retries = (
            api_key,
            timeout,
            connect_timeout,
            retries,
        )
        self._ws: websockets.sync.client.ClientConnection | None = None
        self.metadata: dict[str, Any] = {}
        self._lock = threading.Lock()  # one request/response exchange on the connection at a time
        self._closed = False  # close() was called: never reconnect
        self._connect()

    def _connect(self) -> None:
        """Open the connection, retrying until ``connect_timeout`` (the server may still be loading)."""
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                self._ws = websockets.sync.client.connect(
                    self.url,
                    compression=None,
                    max_size=_MAX_RESPONSE_BYTES,
                    additional_headers=_headers(self.api_key),
                    open_timeout=max(1.0, deadline - time.monotonic()),
                    close_timeout=_CLOSE_TIMEOUT,
                    **_SYNC_LEGACY,
                )
                break
            except websockets.exceptions.InvalidStatus:  # 401 and friends: retrying will not help
                raise
            except (OSError, TimeoutError, websockets.exceptions.WebSocketException):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
        try:
            self.metadata = _response(self._ws.recv(timeout=self.timeout))
        except BaseException:
            self._drop()
            raise

    def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
        """Send one observation, return the server's response (``actions`` float32 [H, A], ``server_timing``, ...)."""
        frame = pack(obs)
        with self._lock:
            return self._exchange(frame)

    def _exchange(self, frame: bytes) -> dict[str, Any]:
        for attempt in range(self.retries + 1):
            if self._closed:
                raise _closed_error(self)
            if self._ws is None:
                self._connect()
                if self._closed:  # closed while connecting
                    self._drop()
                    raise _closed_error(self)
            ws = self._ws  # close() from another thread may set self._ws to None at any moment
            if ws is None:  # only close() empties it while a call holds the turn
                raise _closed_error(self)
            try:
                ws.send(frame)
                reply = ws.recv(timeout=self.timeout)
            except Exception as e:
                _after_failed_exchange(self, e, self._drop, attempt == self.retries)
                continue
            except BaseException:  # a timeout or Ctrl-C: the late reply must not answer the next request
                self._drop()
                raise
            if isinstance(reply, str):
                self._drop()  # the server closes after an error; the next call reconnects
            return _decoded(reply, self._drop)
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        """Close the connection after a failed request (errors closing it are ignored); the next call reconnects."""
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.close()
            except Exception:  # already broken: nothing left to close cleanly
                ws.socket.close()

    def close(self) -> None:
        """End the client: a request in flight (another thread's) and every later one raise ``ClientClosedError``."""
        self._closed = True
        ws, self._ws = self._ws, None
        if ws is not None:
            ws.close()

    def __enter__(self) -> WebsocketClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncWebsocketClient:
    """asyncio client: ``await AsyncWebsocketClient.open(url)`` or ``async with AsyncWebsocketClient(url)``.
    Concurrent ``infer`` calls on one client take turns on its connection (a client per task runs them
    concurrently, and the server batches them)."""

    def __init__(
        self,
        url: str = "ws://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 30.0,
        retries: int = 1,
    ) -> None:
        self.url = url if url.startswith(("ws://", "wss://")) else f"ws://{url}"
        self.api_key, self.timeout, self.connect_timeout, self.retries = (
            api_key,
            timeout,
            connect_timeout,
            retries,
        )
        self._ws: websockets.asyncio.client.ClientConnection | None = None
        self.metadata: dict[str, Any] = {}
        # one request/response exchange on the connection at a time: a second concurrent recv() is an error in
        # websockets, and its clean-up would drop the first call's connection
        self._lock = asyncio.Lock()
        self._closed = False  # close() was called: never reconnect

    @classmethod
    async def open(cls, url: str = "ws://127.0.0.1:8000", **kwargs: Any) -> AsyncWebsocketClient:
        client = cls(url, **kwargs)
        await client.connect()
        return client

    async def connect(self) -> None:
        """Open the connection, retrying until ``connect_timeout`` (the server may still be loading)."""
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                self._ws = await websockets.asyncio.client.connect(
                    self.url,
                    compression=None,
                    max_size=_MAX_RESPONSE_BYTES,
                    additional_headers=_headers(self.api_key),
                    open_timeout=max(1.0, deadline - time.monotonic()),
                    close_timeout=_CLOSE_TIMEOUT,
                )
                break
            except websockets.exceptions.InvalidStatus:
                raise
            except (OSError, TimeoutError, websockets.exceptions.WebSocketException):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)
        try:
            self.metadata = _response(await asyncio.wait_for(self._ws.recv(), self.timeout))
        except BaseException:
            self._abort()
            raise

    async def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
        """Send one observation and await the server's response."""
        frame = pack(obs)
        async with self._lock:
            return await self._exchange(frame)

    async def _exchange(self, frame: bytes) -> dict[str, Any]:
        for attempt in range(self.retries + 1):
            if self._closed:
                raise _closed_error(self)
            if self._ws is None:
                await self.connect()
                if self._closed:  # closed while connecting
                    self._abort()
                    raise _closed_error(self)
            ws = self._ws  # another task's close() may set self._ws to None while this one awaits
            if ws is None:  # only close() empties it while a call holds the turn
                raise _closed_error(self)
            try:
                await ws.send(frame)
                reply = await asyncio.wait_for(ws.recv(), self.timeout)
            except Exception as e:
                _after_failed_exchange(self, e, self._abort, attempt == self.retries)
                continue
            except BaseException:
                # a timeout or a cancelled await: the late reply must not answer the next request
                self._abort()
                raise
            if isinstance(reply, str):
                await self._close_connection()  # the server closes after an error; the next call reconnects
            return _decoded(reply, self._abort)
        raise AssertionError("unreachable")

    def _abort(self) -> None:
        """Drop the connection after a failed request at once (no awaiting: the task may be cancelled); the next
        call reconnects."""
        ws, self._ws = self._ws, None
        if ws is not None:
            ws.transport.abort()

    async def _close_connection(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()

    async def close(self) -> None:
        """End the client: a request in flight (another task's) and every later one raise ``ClientClosedError``."""
        self._closed = True
        await self._close_connection()

    async def __aenter__(self) -> AsyncWebsocketClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
