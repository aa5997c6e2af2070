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
sent once more (``retries``). ``timeout`` bounds a whole ``infer`` (sending, any reconnect and resend, the answer):
an answer never comes from an observation older than that. A server that stops reading cannot block a send
forever either: the sync client's send fails once no byte has moved for ``timeout`` (a few timeouts in all while
the socket buffers fill). ``connect_timeout`` bounds the first connection (the server may still be loading). Any
other failure of a request (a timeout, a cancelled ``await``, Ctrl-C, a malformed response) closes the connection
before it is raised, and the next ``infer`` reconnects: the late reply to the abandoned request must never be read
as the answer to the next one (a robot would act on an old chunk). ``close()`` ends a client for good: a request in
flight on another thread or task, or one waiting to reconnect, raises ``ClientClosedError`` instead, and so does
every later ``infer``. A server's refusal of the connection raises ``ConnectionRejectedError`` with the server's
message: at once for a wrong API key (401); a 502/503/504 (a proxy before a server still loading, a server at
``--max-connections``) is retried until the connect deadline first.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import websockets
import websockets.asyncio.client
import websockets.sync.client

from vla.serving.broker import ActionChunkBroker
from vla.serving.protocol import ProtocolError, pack, unpack

__all__ = [
    "ActionChunkBroker",
    "AsyncWebsocketClient",
    "ClientClosedError",
    "ConnectionRejectedError",
    "ServerError",
    "WebsocketClient",
]

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


#: handshake statuses that may pass (a proxy before a server that is still loading, a server at --max-connections or
#: restarting): retried until the connect deadline, then raised
_RETRIED_STATUSES = frozenset({502, 503, 504})


class ConnectionRejectedError(websockets.exceptions.InvalidStatus):
    """The server refused the WebSocket handshake with an HTTP status (401: no or a wrong API key, raised at once;
    503: its ``--max-connections`` reached or shutting down, raised once retrying until the connect deadline did not
    help); the message carries the server's own explanation. A subclass of websockets' ``InvalidStatus``:
    ``.response.status_code`` and ``.body`` as there."""

    def __init__(self, url: str, rejected: websockets.exceptions.InvalidStatus) -> None:
        super().__init__(rejected.response)
        self.url = url

    def __str__(self) -> str:
        body = (self.response.body or b"").decode("utf-8", "replace").strip()[:300]
        return f"{self.url} refused the connection: HTTP {self.response.status_code}" + (
            f": {body}" if body else ""
        )


def _closed_error(client: object) -> ClientClosedError:
    return ClientClosedError(
        f"{type(client).__name__} for {getattr(client, 'url', '?')} was closed; open a new client to go on"
    )


def _options(url: str, api_key: str | None, timeout: float, connect_timeout: float, retries: int) -> str:
    """Check a client's arguments (each mistake here would otherwise surface as a retried connect or a late,
    cryptic error); returns the URL with ``ws://`` added when it has no scheme."""
    if "://" in url and not url.startswith(("ws://", "wss://")):
        raise ValueError(
            f"url {url!r}: a WebSocket URL is ws://HOST:PORT (wss:// behind a TLS proxy); vla serve prints it "
            "in its ready line (the http:// one there is for REST)"
        )
    if api_key is not None and (
        not api_key or api_key != api_key.strip() or not all(" " <= c <= "~" for c in api_key)
    ):
        # the key itself is never printed
        raise ValueError(
            "api_key: must be printable ASCII without leading or trailing whitespace (a key read from a file "
            "keeps its newline: strip() it)"
        )
    for name, value, zero_ok in (("timeout", timeout, False), ("connect_timeout", connect_timeout, True)):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or value < 0 or (value == 0 and not zero_ok):
            bound = ">= 0" if zero_ok else "> 0"
            raise ValueError(f"{name} must be a number of seconds {bound}, got {value!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0 (resends after a dropped connection), got {retries!r}")
    return url if url.startswith(("ws://", "wss://")) else f"ws://{url}"


def _unless_retried(client: Any, e: Exception, deadline: float, budget: str) -> None:
    """After a failed connection attempt of ``client`` (sync or asyncio): return when another attempt is due, else
    raise what ends them. A handshake refused with 401/403 and friends is final at once
    (``ConnectionRejectedError``); 502/503/504 may pass and are retried until ``deadline``, as are refused or
    timed-out connections, which then raise an error naming the URL and the time budget spent (``connect_timeout``
    or ``timeout``); ``ClientClosedError`` when ``close()`` ended the client meanwhile."""
    if client._closed:
        raise _closed_error(client) from e
    late = time.monotonic() >= deadline
    if isinstance(e, websockets.exceptions.InvalidStatus):
        if late or e.response.status_code not in _RETRIED_STATUSES:
            raise ConnectionRejectedError(client.url, e) from None
        return
    if late:
        raise ConnectionError(
            f"could not connect to {client.url} within {budget}={getattr(client, budget):g} s: {type(e).__name__}: "
            f"{e} (is vla serve running there, and ready? it refuses connections while loading)"
        ) from e


def _late(client: Any) -> TimeoutError:
    return TimeoutError(
        f"no answer from {client.url} within timeout={client.timeout:g} s; the connection was closed so that "
        "a late answer is never read as the next request's, and the next infer reconnects"
    )


def _after_failed_exchange(client: Any, e: Exception, drop: Callable[[], None], last_attempt: bool) -> None:
    """What a failed send/recv of ``client`` (sync or asyncio) leads to: ``ClientClosedError`` when ``close()``
    ended the client meanwhile (never a reconnect); otherwise the connection is dropped (a late reply must not
    answer the next request) and the error raised, except a dropped connection with attempts left: then the caller
    reconnects and sends again."""
    if client._closed:
        raise _closed_error(client) from e
    drop()
    if isinstance(e, TimeoutError):
        raise _late(client) from e
    if last_attempt or not isinstance(e, websockets.exceptions.ConnectionClosed):
        raise e


def _check_frame_size(client: Any, frame: bytes) -> None:
    """Refuse a request over the frame limit the server announced in its metadata (``max_frame_bytes``), before a
    byte of it is uploaded: the server would refuse it anyway, and one over twice its limit it cuts off mid-upload
    (close 1009), which can reach the client as a reset connection that looks like a dropped one."""
    limit = client.metadata.get("max_frame_bytes")
    if isinstance(limit, int) and not isinstance(limit, bool) and len(frame) > limit:
        raise ValueError(
            f"the request is {len(frame)} bytes, over {client.url}'s frame limit of {limit} bytes (its "
            "--max-frame-mb): send smaller images, or start the server with a larger --max-frame-mb"
        )


def _send_within(ws: websockets.sync.client.ClientConnection, frame: bytes, seconds: float) -> None:
    """``ws.send(frame)``, failing with ``TimeoutError`` when the socket takes no byte for ``seconds``: a server that
    stops reading (frozen, or a congested link once the socket's buffer is full) would block it forever. The
    kernel's send timeout (``SO_SNDTIMEO``) does it, set for this send only (websockets' own frames, pongs and the
    close, must not inherit it); the connection is dropped after a timeout anyway. A helper thread per request
    would do it too, but cost ~2 ms of end-to-end latency here (GIL hand-offs)."""
    sock = ws.socket
    timed = _set_send_timeout(sock, max(seconds, 0.001))
    try:
        ws.send(frame)
    except Exception as e:
        cause: BaseException | None = e
        # the timeout: EAGAIN from send(), or OpenSSL's "want write" on a wss:// socket
        while cause is not None and not isinstance(cause, BlockingIOError | ssl.SSLWantWriteError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise TimeoutError("sending the request timed out") from e
        raise
    finally:
        if timed:
            _set_send_timeout(sock, 0.0)


def _set_send_timeout(sock: socket.socket, seconds: float) -> bool:
    """Set the socket's kernel send timeout (0 = none); False where the platform refuses it (no send timeout)."""
    if sys.platform == "win32":
        value = struct.pack("L", int(seconds * 1000))  # a DWORD of milliseconds
    else:
        whole = int(seconds)
        value = struct.pack("ll", whole, int((seconds - whole) * 1e6))  # struct timeval
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    except OSError:
        return False
    return True


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
        self.url = _options(url, api_key, timeout, connect_timeout, retries)
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
        self._sending = False  # a request frame is being sent (close() must unblock it)
        self._connect()

    def _connect(self, deadline: float | None = None) -> None:
        """Open the connection and read the metadata frame, retrying failed attempts until ``deadline`` (default:
        ``connect_timeout`` from now; the server may still be loading; inside ``infer``: the request's own)."""
        budget = "connect_timeout" if deadline is None else "timeout"
        if deadline is None:
            deadline = time.monotonic() + self.connect_timeout
        while True:
            if self._closed:
                raise _closed_error(self)
            try:
                self._ws = websockets.sync.client.connect(
                    self.url,
                    compression=None,
                    max_size=_MAX_RESPONSE_BYTES,
                    additional_headers=_headers(self.api_key),
                    open_timeout=max(0.1, deadline - time.monotonic()),
                    close_timeout=_CLOSE_TIMEOUT,
                    **_SYNC_LEGACY,
                )
                break
            except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as e:
                _unless_retried(self, e, deadline, budget)
                time.sleep(0.2)
        try:
            self.metadata = _response(self._ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        except BaseException:
            self._drop()
            raise

    def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
        """Send one observation, return the server's response (``actions`` float32 [H, A], ``server_timing``, ...)."""
        frame = pack(obs)
        with self._lock:
            return self._exchange(frame)

    def _exchange(self, frame: bytes) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout  # the whole request, reconnects and resends included
        for attempt in range(self.retries + 1):
            if self._closed:
                raise _closed_error(self)
            if attempt and time.monotonic() >= deadline:  # no resend past the deadline: nobody would read it
                raise _late(self)
            if self._ws is None:
                self._connect(deadline)
                if self._closed:  # closed while connecting
                    self._drop()
                    raise _closed_error(self)
            ws = self._ws  # close() from another thread may set self._ws to None at any moment
            if ws is None:  # only close() empties it while a call holds the turn
                raise _closed_error(self)
            _check_frame_size(self, frame)
            try:
                self._sending = True
                try:
                    _send_within(ws, frame, deadline - time.monotonic())
                finally:
                    self._sending = False
                reply = ws.recv(timeout=max(0.0, deadline - time.monotonic()))
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
            if self._sending:  # a send blocked on a server that stopped reading holds the lock close() needs
                with contextlib.suppress(OSError):
                    ws.socket.shutdown(socket.SHUT_RDWR)
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
        self.url = _options(url, api_key, timeout, connect_timeout, retries)
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

    async def connect(self, deadline: float | None = None) -> None:
        """Open the connection and read the metadata frame, retrying failed attempts until ``deadline`` (default:
        ``connect_timeout`` from now; the server may still be loading; inside ``infer``: the request's own)."""
        budget = "connect_timeout" if deadline is None else "timeout"
        if deadline is None:
            deadline = time.monotonic() + self.connect_timeout
        while True:
            if self._closed:
                raise _closed_error(self)
            try:
                self._ws = await websockets.asyncio.client.connect(
                    self.url,
                    compression=None,
                    max_size=_MAX_RESPONSE_BYTES,
                    additional_headers=_headers(self.api_key),
                    open_timeout=max(0.1, deadline - time.monotonic()),
                    close_timeout=_CLOSE_TIMEOUT,
                )
                break
            except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as e:
                _unless_retried(self, e, deadline, budget)
                await asyncio.sleep(0.2)
        try:
            self.metadata = _response(
                await asyncio.wait_for(self._ws.recv(), max(0.1, deadline - time.monotonic()))
            )
        except BaseException:
            self._abort()
            raise

    async def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
        """Send one observation and await the server's response."""
        frame = pack(obs)
        async with self._lock:
            return await self._exchange(frame)

    async def _exchange(self, frame: bytes) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout  # the whole request, reconnects and resends included
        for attempt in range(self.retries + 1):
            if self._closed:
                raise _closed_error(self)
            if attempt and time.monotonic() >= deadline:  # no resend past the deadline: nobody would read it
                raise _late(self)
            if self._ws is None:
                await self.connect(deadline)
                if self._closed:  # closed while connecting
                    self._abort()
                    raise _closed_error(self)
            ws = self._ws  # another task's close() may set self._ws to None while this one awaits
            if ws is None:  # only close() empties it while a call holds the turn
                raise _closed_error(self)
            _check_frame_size(self, frame)
            try:
                await asyncio.wait_for(ws.send(frame), max(0.0, deadline - time.monotonic()))
                reply = await asyncio.wait_for(ws.recv(), max(0.0, deadline - time.monotonic()))
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
