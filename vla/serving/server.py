"""``vla serve``: one event loop (uvicorn + Starlette) serving a ``Policy`` over WebSocket and REST.

Routes (all on one port):

* ``ws://HOST:PORT/`` (any path)  openpi's protocol: on connect one metadata frame (msgpack map: ``protocol_version``,
  ``server``, ``model``, ``embodiments`` with their specs, chunk length, control rate, state/action names, cameras
  and accepted ``observation_keys``), then one binary response per binary request (``vla.serving.protocol``).
  Response: ``actions`` float32 ``[H, A]`` (robot units, clamped to the spec's limits), ``embodiment``,
  ``safety: {clamped: [A] ints (a list), clamped_total}``, ``server_timing: {infer_ms, batch_size, queue_ms,
  prev_total_ms (from the 2nd request)}``. A bad request gets a short text frame, then close 1011 (openpi's
  behaviour); other connections are unaffected. The one exception: a frame over twice ``--max-frame-mb`` is cut
  off by the protocol layer as it arrives (close 1009, the reason naming that size), so that it never has to be
  held in memory; a frame between one and two times the limit gets the text error and 1011. The server pings every
  connection (``ping_interval_s``) and closes one whose client does not answer within ``ping_timeout_s``.
* ``POST /act``      the same request as JSON (json-numpy ``{"__numpy__": b64, "dtype", "shape"}`` arrays as OpenVLA's
  deploy script sends them, or plain nested lists) -> JSON response with lists; errors as ``{"error", "kind"}``.
  The body is decoded and turned into an observation on a worker thread (a large JSON body takes seconds; the
  event loop keeps serving the WebSocket clients meanwhile). A request in progress counts against
  ``max_connections`` like a WebSocket connection; past it, 503.
* ``GET /healthz``   ``OK`` (200) when serving; 503 while shutting down.
* ``GET /metadata``  the metadata frame as JSON.  ``GET /metrics``  Prometheus text (``vla.serving.metrics``).

With an API key every WebSocket handshake and REST request needs ``Authorization: Api-Key <key>`` (else HTTP 401,
before any model work). The model runs on the ``MicroBatcher``'s thread, never on the event loop. SIGINT/SIGTERM:
stop accepting (new handshakes and ``/act`` get 503; a request arriving on an open connection gets the text error
"server is shutting down" and close 1001), let in-flight requests finish (``drain_s`` at most), exit 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from vla.policy import ActionSafetyError, Policy
from vla.serving.batching import MicroBatcher, ModelThread, OverloadedError, Result
from vla.serving.json_numpy import JsonNumpyError, decode_json_numpy
from vla.serving.metrics import ServerMetrics
from vla.serving.protocol import PROTOCOL_VERSION, ProtocolError, pack, unpack
from vla.serving.requests import Limits, RequestError, expected_keys, to_observation
from vla.serving.security import authorized
from vla.types import Observation, ObservationError

log = logging.getLogger(__name__)

#: A WebSocket frame larger than this is decoded and validated on a worker thread, not on the event loop.
DECODE_OFF_LOOP_BYTES = 4 * 2**20


@dataclass(frozen=True)
class ServeOptions:
    """Network-facing settings of a server (the ``vla serve`` flags other than the model's)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch: int = 8
    batch_window_ms: float | None = None  # None: adaptive (vla.serving.batching)
    max_connections: int = 64  # WebSocket connections plus REST requests in progress
    limits: Limits = field(default_factory=Limits)
    drain_s: float = 30.0
    # keepalive: a connection whose client does not answer a ping within the timeout is closed (a dead robot
    # laptop or a cut cable would otherwise hold its connection slot forever); None: no pings
    ping_interval_s: float | None = 20.0
    ping_timeout_s: float | None = 20.0
    # a REST body of which no byte arrives for this many seconds is answered 408 and its connection slot freed (a
    # client that stalls mid-body, or many of them, would otherwise hold --max-connections slots forever); an idle
    # timeout, so a large body on a slow link takes as long as it needs while bytes keep coming
    body_timeout_s: float = 30.0


def _error_kind(e: BaseException) -> str:
    if isinstance(e, ProtocolError):
        return "limit" if "exceeds the limit" in str(e) else "protocol"
    if isinstance(e, RequestError):
        return "limit" if "over the limit" in str(e) else "observation"
    if isinstance(e, ObservationError):
        return "observation"
    if isinstance(e, ActionSafetyError):
        return "unsafe_actions"
    if isinstance(e, OverloadedError):
        return "overloaded"
    return "internal"


def _client_message(e: BaseException) -> str:
    """A short, traceback-free message for the client (internal errors stay in the server log)."""
    if _error_kind(e) == "internal":
        return "internal server error (see the server log)"
    return str(e).splitlines()[0][:500]


class ServingApp:
    """The ASGI app around one ``Policy``: routes, auth, limits, micro-batching, metrics."""

    def __init__(
        self,
        policy: Policy,
        options: ServeOptions,
        *,
        serving_mode: dict[str, Any] | None = None,
        model_thread: ModelThread | None = None,
        forward_s: float | None = None,
    ) -> None:
        """``model_thread``: the thread ``policy`` was loaded and warmed up on, which then runs every batch
        (``vla.serving.batching.ModelThread``); by default a new one. ``forward_s``: the measured seconds of one
        forward pass, which sizes the adaptive batch window before the first batch has run."""
        self.policy, self.options = policy, options
        self.metrics = ServerMetrics(options.max_batch)
        self.batcher = MicroBatcher(
            lambda obs, seeds: policy.infer_batch(obs, seeds=seeds, return_exceptions=True),
            max_batch=options.max_batch,
            window_s=None if options.batch_window_ms is None else options.batch_window_ms / 1000,
            metrics=self.metrics,
            max_queue=max(64, 4 * options.max_connections),
            # A WebSocket client has at most one request in flight; REST callers are unknown, so wait for them.
            expect_more=lambda: self.in_flight < self.connections or self.rest_active > 0,
            model_thread=model_thread,
            forward_s=forward_s,
        )
        self.default = policy.embodiments[0] if len(policy.embodiments) == 1 else None
        self.metadata = self._metadata(serving_mode or {})
        self._metadata_frame = pack(self.metadata)
        self.connections = 0
        self.in_flight = 0
        self.rest_active = 0
        self.decoding = 0  # WebSocket frames being decoded on a worker thread (DECODE_OFF_LOOP_BYTES)
        self.draining = False
        self.app = Starlette(
            routes=[
                Route("/healthz", self.healthz, methods=["GET"]),
                Route("/metadata", self.get_metadata, methods=["GET"]),
                Route("/metrics", self.get_metrics, methods=["GET"]),
                Route("/act", self.act, methods=["POST"]),
                WebSocketRoute("/{path:path}", self.websocket),
            ],
            exception_handlers={HTTPException: _http_error},
        )

    def _metadata(self, serving_mode: dict[str, Any]) -> dict[str, Any]:
        meta = self.policy.metadata()
        for entry in meta["embodiments"].values():
            entry["observation_keys"] = expected_keys(entry["cameras"], entry["state_dim"])
        return {
            "protocol_version": PROTOCOL_VERSION,
            "server": "vla",
            **meta,
            "default_embodiment": self.default,
            "max_frame_bytes": self.options.limits.max_frame_bytes,
            # the other request limits, so a client can check before sending (additive fields)
            "max_prompt_chars": self.options.limits.max_prompt_chars,
            "max_image_side": self.options.limits.max_image_side,
            "serving_mode": serving_mode,
            "max_batch": self.options.max_batch,
            "batch_window_ms": "auto" if self.batcher.adaptive else self.options.batch_window_ms,
        }

    # ---- one request, shared by both transports ---------------------------------------------------------------
    def _decode(self, frame: bytes) -> tuple[Observation, int | None]:
        """A WebSocket request frame's validated observation and seed."""
        return self._observation(unpack(frame, max_bytes=self.options.limits.max_frame_bytes))

    def _observation(self, msg: Any) -> tuple[Observation, int | None]:
        """A decoded request's validated observation and seed (bad input is refused here, never inside a batch)."""
        obs, seed = to_observation(msg, self.policy.embodiments, self.options.limits, default=self.default)
        self.policy.check(obs)
        return obs, seed

    async def _answer(
        self, obs: Observation, seed: int | None, transport: str, received: float
    ) -> dict[str, Any]:
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            queued = time.perf_counter()
            result: Result = await self.batcher.submit(obs, seed)
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
        chunk = result.chunk
        self.metrics.add_clamped(
            chunk.embodiment, self.policy.spec(chunk.embodiment).action_names(), chunk.clamped
        )
        self.metrics.answered(transport, chunk.embodiment, time.perf_counter() - received)
        return {
            "actions": chunk.actions,
            "embodiment": chunk.embodiment,
            # a list, not an array: openpi's ActionChunkBroker indexes every array of a response by the step
            "safety": {"clamped": chunk.clamped.tolist(), "clamped_total": int(chunk.clamped.sum())},
            "server_timing": {
                "infer_ms": result.infer_ms,
                "batch_size": result.batch_size,
                "queue_ms": max(0.0, (time.perf_counter() - queued) * 1000 - result.infer_ms),
            },
        }

    # ---- WebSocket ---------------------------------------------------------------------------------------------
    async def websocket(self, ws: WebSocket) -> None:
        if not authorized(ws.headers.get("authorization"), self.options.api_key):
            self.metrics.error("auth")
            await ws.send_denial_response(_unauthorized())
            return
        if self.draining or self._full():
            self.metrics.error("limit" if not self.draining else "overloaded")
            reason = "server is shutting down" if self.draining else self._too_many()
            await ws.send_denial_response(PlainTextResponse(reason, status_code=503))
            return
        self.connections += 1  # before the first await: concurrent handshakes cannot all pass the check
        self.metrics.connections.inc()
        try:
            await ws.accept()
            await ws.send_bytes(self._metadata_frame)
            await self._serve_connection(ws)
        except WebSocketDisconnect:
            pass
        finally:
            self.connections -= 1
            self.metrics.connections.dec()

    @property
    def busy(self) -> bool:
        """Whether a request is being decoded (REST, or a large WebSocket frame), queued or run: what a drain waits
        for."""
        return bool(self.in_flight or self.batcher.pending or self.rest_active or self.decoding)

    def _full(self) -> bool:
        """Whether the connection limit is reached: WebSocket connections plus REST requests in progress."""
        return self.connections + self.rest_active >= self.options.max_connections

    def _too_many(self) -> str:
        return (
            f"too many connections (limit {self.options.max_connections}, --max-connections; WebSocket connections "
            "and REST requests in progress count)"
        )

    async def _serve_connection(self, ws: WebSocket) -> None:
        prev_total_ms: float | None = None
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            received = time.perf_counter()
            if self.draining:
                # not taken in: once the drain ends, the sockets close and its answer would be lost
                self.metrics.error("overloaded")
                await self._close(ws, "server is shutting down", code=1001)
                return
            try:
                frame = message.get("bytes")
                if frame is None:
                    raise ProtocolError("text frames are not accepted: send msgpack binary frames")
                if len(frame) > DECODE_OFF_LOOP_BYTES:  # tens of ms for tens of MiB: the other clients go on
                    self.decoding += 1  # counted, so a drain meanwhile waits for this request too
                    try:
                        obs, seed = await asyncio.to_thread(self._decode, frame)
                    finally:
                        self.decoding -= 1
                else:  # a thread hop would cost more than decoding the usual frame (2 cameras: ~0.3 MiB)
                    obs, seed = self._decode(frame)
                response = await self._answer(obs, seed, "websocket", received)
            except Exception as e:
                await self._fail(ws, e)
                return
            if prev_total_ms is not None:
                response["server_timing"]["prev_total_ms"] = prev_total_ms
            await ws.send_bytes(pack(response))
            prev_total_ms = (time.perf_counter() - received) * 1000

    async def _fail(self, ws: WebSocket, e: BaseException) -> None:
        kind = _error_kind(e)
        self.metrics.error(kind)
        if kind == "internal":
            log.error("request failed", exc_info=e)
        await self._close(ws, _client_message(e), code=1011)

    async def _close(self, ws: WebSocket, text: str, *, code: int) -> None:
        """Send ``text`` as a text frame (openpi's error convention), then close with ``code``."""
        try:
            await ws.send_text(text)
            await ws.close(code=code, reason=text[:120].encode()[:120].decode("utf-8", "ignore"))
        except (WebSocketDisconnect, RuntimeError):  # the client is already gone
            pass

    # ---- HTTP --------------------------------------------------------------------------------------------------
    async def healthz(self, request: Request) -> Response:
        if self.draining:
            return PlainTextResponse("shutting down", status_code=503)
        return PlainTextResponse("OK")

    async def get_metadata(self, request: Request) -> Response:
        if not authorized(request.headers.get("authorization"), self.options.api_key):
            self.metrics.error("auth")
            return _unauthorized(as_json=True)
        return JSONResponse(_jsonable(self.metadata))

    async def get_metrics(self, request: Request) -> Response:
        if not authorized(request.headers.get("authorization"), self.options.api_key):
            self.metrics.error("auth")
            return _unauthorized()
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def act(self, request: Request) -> Response:
        received = time.perf_counter()
        if not authorized(request.headers.get("authorization"), self.options.api_key):
            self.metrics.error("auth")
            return _unauthorized(as_json=True)
        if self.draining:
            self.metrics.error("overloaded")
            return JSONResponse({"error": "server is shutting down", "kind": "overloaded"}, status_code=503)
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            # a web page can send text/plain or form bodies to 127.0.0.1 without asking (no CORS preflight), and
            # would burn the model's time; application/json it cannot send cross-origin without one
            self.metrics.error("protocol")
            return JSONResponse(
                {"error": "POST /act takes a JSON body: send the header 'Content-Type: application/json'",
                 "kind": "protocol"},
                status_code=415,
            )  # fmt: skip
        if self._full():
            self.metrics.error("limit")
            return JSONResponse({"error": self._too_many(), "kind": "limit"}, status_code=503)
        self.rest_active += 1
        self.metrics.rest_requests.set(self.rest_active)
        try:
            return await self._act(request, received)
        finally:
            self.rest_active -= 1
            self.metrics.rest_requests.set(self.rest_active)

    async def _act(self, request: Request, received: float) -> Response:
        limit = self.options.limits.max_frame_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:  # refused before a byte of it is read
            self.metrics.error("limit")
            return _too_large(limit)
        body = bytearray()
        parts = request.stream()
        try:
            while True:
                try:
                    part = await asyncio.wait_for(anext(parts), self.options.body_timeout_s)
                except StopAsyncIteration:
                    break
                body += part
                if len(body) > limit:  # no Content-Length (chunked upload) or a false one
                    self.metrics.error("limit")
                    return _too_large(limit)
        except TimeoutError:
            self.metrics.error("limit")
            return JSONResponse(
                {
                    "error": f"request body stalled: no byte for {self.options.body_timeout_s:g} s "
                    f"({len(body)} bytes arrived)",
                    "kind": "limit",
                },
                status_code=408,
                headers={"Connection": "close"},
            )
        except ClientDisconnect:  # the client went away mid-body: nobody to answer, nothing to log
            return Response(status_code=400)
        try:
            # seconds for a large body: on a worker thread, so the WebSocket clients keep being served meanwhile
            obs, seed = await asyncio.to_thread(lambda: self._observation(_decode_json(body)))
            response = await self._answer(obs, seed, "rest", received)
        except Exception as e:
            kind = _error_kind(e)
            self.metrics.error(kind)
            if kind == "internal":
                log.error("request failed", exc_info=e)
            status = {"internal": 500, "unsafe_actions": 500, "overloaded": 503}.get(kind, 400)
            return JSONResponse({"error": _client_message(e), "kind": kind}, status_code=status)
        return JSONResponse(_jsonable(response))


def _decode_json(body: bytes | bytearray) -> Any:
    """A REST body -> the request map (json-numpy arrays decoded); malformed JSON is a ``ProtocolError``."""
    try:
        return json.loads(body, object_hook=decode_json_numpy)
    except (ValueError, RecursionError, JsonNumpyError) as e:
        # ValueError: malformed JSON (JSONDecodeError), bad UTF-8, an integer past Python's digit limit;
        # RecursionError: arrays nested too deep
        raise ProtocolError(f"malformed JSON body: {type(e).__name__}: {str(e)[:200]}") from None


def _too_large(limit: int) -> Response:
    """413 for a REST body over ``--max-frame-mb``; the connection is closed, as the rest of the body is unread."""
    return JSONResponse(
        {"error": f"request body over the limit of {limit} bytes (--max-frame-mb)", "kind": "limit"},
        status_code=413,
        headers={"Connection": "close"},
    )


_ENDPOINTS = "POST /act, GET /metadata, GET /metrics, GET /healthz, or a WebSocket on any path"


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (404 for an unknown path, 405 for a method a path does not take) as JSON naming
    the endpoints, like every other error of this API, instead of a bare "Not Found" text."""
    assert isinstance(exc, HTTPException)
    what = {404: "no such endpoint", 405: "method not allowed"}.get(exc.status_code, exc.detail)
    return JSONResponse(
        {
            "error": f"{request.method} {request.url.path}: {what}; this server answers {_ENDPOINTS}",
            "kind": "protocol",
        },
        status_code=exc.status_code,
        headers=exc.headers,
    )


_UNAUTHORIZED = "unauthorized: send the header 'Authorization: Api-Key <key>'"


def _unauthorized(as_json: bool = False) -> Response:
    """401 with the scheme to use; JSON (``{"error", "kind": "auth"}``) where the endpoint answers JSON."""
    headers = {"WWW-Authenticate": "Api-Key"}
    if as_json:
        return JSONResponse({"error": _UNAUTHORIZED, "kind": "auth"}, status_code=401, headers=headers)
    return PlainTextResponse(_UNAUTHORIZED, status_code=401, headers=headers)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray | np.generic):
        return obj.tolist()
    return obj


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, but the first SIGINT/SIGTERM drains in-flight requests before stopping (exit 0); a second
    one stops at once."""

    def __init__(self, config: uvicorn.Config, serving: ServingApp) -> None:
        super().__init__(config)
        self.serving = serving
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.serving.draining or self.loop is None:
            self.should_exit = True
            self.force_exit = self.serving.draining
            return
        log.info("signal %s: draining in-flight requests", signal.Signals(sig).name)
        self.serving.draining = True
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.serving.options.drain_s
        while self.serving.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.should_exit = True


def server_config(serving: ServingApp) -> uvicorn.Config:
    """uvicorn's settings for ``serving`` (also used by tests that run the server in a thread)."""
    opts = serving.options
    return uvicorn.Config(
        serving.app,
        host=opts.host,
        port=opts.port,
        ws="websockets-sansio",
        # Frames up to twice the limit reach the app, which refuses them with a text error and 1011; larger ones
        # are cut off by the protocol layer as they arrive (close 1009, "frame with N bytes exceeds limit of M
        # bytes"), bounding memory.
        ws_max_size=2 * opts.limits.max_frame_bytes,
        ws_per_message_deflate=False,  # openpi's client sends uncompressed frames
        ws_ping_interval=opts.ping_interval_s,  # websockets-sansio sends keepalive pings from uvicorn 0.44 on
        ws_ping_timeout=opts.ping_timeout_s,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=5,
        limit_concurrency=None,  # ServingApp counts WebSocket connections and REST requests (max_connections)
    )


def ws_url(host: str, port: int) -> str:
    """The ``ws://`` URL of a listening socket; an IPv6 address in brackets (``ws://[::1]:8000``)."""
    return f"ws://[{host}]:{port}" if ":" in host else f"ws://{host}:{port}"


def bind_socket(host: str, port: int, *, taken_meanwhile: bool = False) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0: any free one); a port in use is an ``OSError`` whose
    message names the flags and the fix. ``vla serve`` opens one and closes it at once before loading the model
    (a port in use is a one-line error then, not after minutes of loading and warm-up), and listens for good only
    when ready: until then connections are refused, as openpi's own server refuses them while it loads, which is
    what openpi's client waits out (it retries on ``ConnectionRefusedError``; a connection left waiting in a backlog
    it abandons after websockets' 10 s handshake timeout). ``taken_meanwhile``: the port was free at the first try,
    so the message says another process took it during loading."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # listening at once: with SO_REUSEADDR two sockets that are only bound can share a port, so a second
        # server started meanwhile would pass bind() and fail only after its own loading
        sock.listen(2048)
    except OSError as e:
        sock.close()
        holder = (
            "another process took it while the model loaded"
            if taken_meanwhile
            else "another server may hold it"
        )
        raise OSError(
            e.errno,
            f"--host {host} --port {port}: cannot listen there ({e.strerror}); {holder}: "
            "pick another --port (0 takes any free one)",
        ) from None
    return sock


def run_server(serving: ServingApp, *, on_ready: Any = None, sock: socket.socket | None = None) -> int:
    """Serve until SIGINT/SIGTERM; ``on_ready(url)`` is called once the socket listens (port 0 = any free port).
    ``sock``: a socket from ``bind_socket`` to listen on (else uvicorn binds ``options.host``/``port`` itself)."""
    opts = serving.options
    server = _DrainingServer(server_config(serving), serving)

    async def main() -> None:
        server.loop = asyncio.get_running_loop()
        task = asyncio.create_task(server.serve(sockets=[sock] if sock is not None else None))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started and on_ready is not None:
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            on_ready(ws_url(host, port))
        await task

    try:
        asyncio.run(main())
    finally:
        serving.batcher.close(timeout=opts.drain_s)
    return 0 if server.started else 1
