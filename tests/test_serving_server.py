"""``ServingApp`` on uvicorn in a thread of the test process, with the model held back where a test needs a request
in flight: connection limits counting REST, JSON decoded off the event loop, keepalive pings, the SIGTERM drain,
frames over twice the limit, the ready line's URL."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import websockets.sync.client
from test_serving_parts import _policy
from websockets.exceptions import ConnectionClosed, InvalidStatus

from vla.serving import server as server_mod
from vla.serving.client import ClientClosedError, ConnectionRejectedError, WebsocketClient
from vla.serving.json_numpy import encode_json_numpy
from vla.serving.modes import synthetic_observations
from vla.serving.protocol import pack, unpack
from vla.serving.requests import Limits
from vla.serving.server import ServeOptions, ServingApp, _DrainingServer, server_config, ws_url


@pytest.fixture(scope="module")
def policy() -> Any:
    return _policy()


def _request(policy: Any, seed: int = 0) -> dict[str, Any]:
    (obs,) = synthetic_observations(policy, 1)
    return {
        "images": obs.images,
        "state": obs.state,
        "prompt": obs.prompt,
        "embodiment": obs.embodiment,
        "seed": seed,
    }


class Running:
    """A ``ServingApp`` served by ``_DrainingServer`` (what ``vla serve`` runs) on a free loopback port."""

    def __init__(self, serving: ServingApp) -> None:
        self.serving = serving
        self.server = _DrainingServer(server_config(serving), serving)

        async def main() -> None:
            self.server.loop = asyncio.get_running_loop()
            await self.server.serve()

        self.thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        self.url = ws_url(*self.server.servers[0].sockets[0].getsockname()[:2])
        self.http = self.url.replace("ws://", "http://")

    def post(self, body: str) -> tuple[int, dict[str, Any]]:
        """``POST /act``: (status, JSON body), errors included."""
        req = urllib.request.Request(
            self.http + "/act",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.serving.batcher.close(timeout=30)


@contextmanager
def running(policy: Any, **options: Any) -> Iterator[Running]:
    run = Running(ServingApp(policy, ServeOptions(port=0, **options)))
    try:
        yield run
    finally:
        run.stop()


def _wait(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


@contextmanager
def blocked_json_decode(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Every ``POST /act`` body decode waits for ``release`` (``started`` is set once one is waiting): a large
    body's seconds of ``json.loads``, made as long as the test needs."""
    started, release = threading.Event(), threading.Event()
    real = server_mod.decode_json_numpy

    def slow(obj: dict[str, Any]) -> Any:
        started.set()
        assert release.wait(60), "never released"
        return real(obj)

    monkeypatch.setattr(server_mod, "decode_json_numpy", slow)
    try:
        yield started, release
    finally:
        release.set()


# ---- REST: off the event loop, and counted against --max-connections ---------------------------------------------
def test_a_websocket_client_is_answered_while_a_rest_body_is_being_decoded(
    policy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large JSON body takes seconds to decode; it is decoded on a worker thread, so a WebSocket client is
    answered meanwhile (before: on the event loop, every WebSocket client stalled behind it)."""
    body = json.dumps(_request(policy), default=encode_json_numpy)
    with (
        running(policy) as run,
        blocked_json_decode(monkeypatch) as (started, release),
        WebsocketClient(run.url, timeout=10) as client,
    ):
        rest, rest_out = _in_thread(lambda: run.post(body))
        assert started.wait(30)
        out = client.infer(_request(policy, seed=1))  # TimeoutError when the loop is blocked
        assert out["actions"].ndim == 2 and rest.is_alive()
        release.set()
        rest.join(60)
    status, answer = rest_out[0]
    assert status == 200 and np.asarray(answer["actions"]).shape == out["actions"].shape


def test_a_websocket_client_is_answered_while_another_ones_large_frame_is_being_decoded(
    policy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame over ``DECODE_OFF_LOOP_BYTES`` (tens of MiB of images) is decoded on a worker thread: a small
    request on another connection is answered meanwhile (before: the event loop decoded it, and stalled everyone)."""
    monkeypatch.setattr(server_mod, "DECODE_OFF_LOOP_BYTES", 200_000, raising=False)  # small frames: ~100 KB
    started, release = threading.Event(), threading.Event()
    real = server_mod.unpack

    def slow(frame: bytes, **kw: Any) -> Any:
        if len(frame) > 500_000:  # only the large frame waits
            started.set()
            assert release.wait(60), "never released"
        return real(frame, **kw)

    monkeypatch.setattr(server_mod, "unpack", slow)
    big = _request(policy)
    big["images"] = {slot: np.zeros((400, 400, 3), np.uint8) for slot in big["images"]}
    assert len(pack(big)) > 500_000 > 200_000 > len(pack(_request(policy)))
    try:
        with (
            running(policy) as run,
            WebsocketClient(run.url, timeout=60) as slow_client,
            WebsocketClient(run.url, timeout=10) as client,
        ):
            large, large_out = _in_thread(lambda: slow_client.infer(big))
            assert started.wait(30)
            assert run.serving.busy  # a drain now would wait for the request being decoded
            out = client.infer(_request(policy, seed=1))  # TimeoutError when the loop is blocked
            assert out["actions"].ndim == 2 and large.is_alive()
            release.set()
            large.join(60)
            assert large_out and large_out[0]["actions"].shape == out["actions"].shape
    finally:
        release.set()


def test_rest_requests_in_progress_count_against_the_connection_limit(
    policy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--max-connections`` counts REST requests in progress with the WebSocket connections: past it a REST
    request and a handshake both get 503 naming the limit and the flag; the request in progress is answered."""
    body = json.dumps(_request(policy), default=encode_json_numpy)
    with running(policy, max_connections=1) as run, blocked_json_decode(monkeypatch) as (started, release):
        first, first_out = _in_thread(lambda: run.post(body))
        assert started.wait(30) and run.serving.rest_active == 1
        status, refused = run.post(body)
        assert status == 503 and refused["kind"] == "limit"
        assert "too many connections (limit 1, --max-connections" in refused["error"]
        with pytest.raises(InvalidStatus) as handshake:
            websockets.sync.client.connect(run.url)
        assert handshake.value.response.status_code == 503
        assert b"--max-connections" in handshake.value.response.body
        release.set()
        first.join(60)
        assert first_out[0][0] == 200
        with WebsocketClient(run.url) as client:  # the slot is free again
            status, refused = run.post(body)
            assert status == 503 and "too many connections" in refused["error"]
            assert client.infer(_request(policy))["actions"].ndim == 2
        assert run.post(body)[0] == 200


def _metric(run: Running, name: str) -> float:
    with urllib.request.urlopen(run.http + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return next(
        float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln[:1] != "#") if k == name
    )


def test_a_rest_body_that_stalls_is_answered_408_and_frees_its_slot(policy: Any) -> None:
    """A client that sends a POST's headers and one byte of its body, then nothing: after the body timeout it gets
    408 and its slot is free again. Before, it held a --max-connections slot forever (64 such sockets locked every
    robot out), and nothing in /metrics showed it."""
    body = json.dumps(_request(policy), default=encode_json_numpy)
    with running(policy, max_connections=1, body_timeout_s=8.0) as run:
        host, port = run.url.removeprefix("ws://").rsplit(":", 1)
        stalled = socket.create_connection((host, int(port)), timeout=30)
        stalled.sendall(
            f"POST /act HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{".encode()
        )
        _wait(lambda: run.serving.rest_active == 1, "the stalled request in progress")
        assert _metric(run, "vla_serve_rest_requests") == 1.0  # visible to an operator
        status, refused = run.post(body)
        assert status == 503 and "too many connections" in refused["error"]
        answer = b""
        while chunk := stalled.recv(4096):  # the server closes after its answer
            answer += chunk
        answer = answer.decode()
        assert answer.startswith("HTTP/1.1 408") and "no byte for 8 s" in answer, answer
        stalled.close()
        _wait(lambda: run.serving.rest_active == 0, "the slot freed")
        assert run.post(body)[0] == 200


def _raw_http(run: Running, request: str, timeout: float = 10) -> str:
    """Send ``request`` (headers, maybe part of a body) on a plain socket; the answer until the server closes or
    ``timeout`` passes."""
    host, port = run.url.removeprefix("ws://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request.encode())
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except TimeoutError:
            pass
    return answer.decode()


def test_a_rest_body_declared_over_the_limit_is_refused_before_it_is_read(policy: Any) -> None:
    """A ``Content-Length`` over ``--max-frame-mb`` gets 413 at once and the connection closes. Before, the server
    read up to the limit first, and a client that declared 1 GB and sent nothing held a slot until the 30 s body
    timeout (then a 408 that misnamed the problem)."""
    with running(policy, limits=Limits(max_frame_bytes=1000)) as run:
        start = time.monotonic()
        answer = _raw_http(
            run,
            "POST /act HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n",
        )
        assert (
            answer.startswith("HTTP/1.1 413") and "over the limit of 1000 bytes (--max-frame-mb)" in answer
        ), answer
        assert time.monotonic() - start < 5
        assert _metric(run, 'vla_serve_errors_total{kind="limit"}') == 1.0
        # a body over the limit without a length (chunked) is cut off once it passes it
        chunked = (
            "POST /act HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )
        answer = _raw_http(run, chunked + f"{1500:x}\r\n" + "x" * 1500 + "\r\n")
        assert answer.startswith("HTTP/1.1 413") and "--max-frame-mb" in answer, answer


def test_unknown_paths_and_methods_get_json_errors_naming_the_endpoints(policy: Any) -> None:
    """A robot's REST client parses every answer as JSON; Starlette's 404/405 were bare text."""
    with running(policy) as run:
        for method, path, status in [("GET", "/act", 405), ("POST", "/predict", 404), ("GET", "/", 404)]:
            req = urllib.request.Request(
                run.http + path, data=b"{}" if method == "POST" else None, method=method
            )
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            assert e.value.code == status
            body = json.loads(e.value.read())
            assert (
                body["kind"] == "protocol"
                and f"{method} {path}: " in body["error"]
                and "POST /act" in body["error"]
            )
            if status == 405:
                assert e.value.headers["Allow"] == "POST"


# ---- keepalive ---------------------------------------------------------------------------------------------------
def _raw_handshake(url: str) -> socket.socket:
    """A WebSocket handshake by hand on a plain socket, which then never reads again (a dead client)."""
    host, port = url.removeprefix("ws://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    assert sock.recv(4096).startswith(b"HTTP/1.1 101")
    return sock


def test_a_client_that_stops_answering_pings_is_disconnected(policy: Any) -> None:
    """Keepalive pings (default every 20 s, 20 s to answer; 0.2 s here): a client that stopped answering (a dead
    laptop, a cut cable) loses its connection and its slot; a live idle client answers the pings and stays."""
    assert ServeOptions().ping_interval_s == 20.0 and ServeOptions().ping_timeout_s == 20.0
    with running(policy, ping_interval_s=0.2, ping_timeout_s=0.2) as run:
        config = server_config(run.serving)
        assert config.ws_ping_interval == config.ws_ping_timeout == 0.2
        with WebsocketClient(run.url, timeout=30) as live:
            dead = _raw_handshake(run.url)
            try:
                _wait(lambda: run.serving.connections == 2, "both connections")
                _wait(lambda: run.serving.connections == 1, "the dead client's connection to be closed")
                time.sleep(1.0)  # five ping intervals: the live client answers them
                assert run.serving.connections == 1
                assert live.infer(_request(policy))["actions"].ndim == 2
            finally:
                dead.close()


# ---- SIGTERM drain -----------------------------------------------------------------------------------------------
def test_drain_refuses_new_requests_on_open_connections_and_finishes_the_one_in_flight(policy: Any) -> None:
    """After SIGTERM: the request in flight is answered; a request arriving on an already open connection gets
    "server is shutting down" and close 1001 (it would be lost when the sockets close); new handshakes and
    ``POST /act`` get 503; then the server stops."""
    with running(policy) as run:
        gate = threading.Event()
        real = run.serving.batcher.infer_batch

        def held(obs: Any, seeds: Any) -> Any:
            assert gate.wait(60)
            return real(obs, seeds)

        run.serving.batcher.infer_batch = held
        try:
            with (
                websockets.sync.client.connect(run.url, compression=None) as idle,
                WebsocketClient(run.url, timeout=60, retries=0) as busy,
            ):
                unpack(idle.recv(timeout=30))
                flight, answer = _in_thread(lambda: busy.infer(_request(policy)))
                _wait(lambda: run.serving.in_flight == 1, "the request in flight")
                run.server.handle_exit(signal.SIGTERM, None)
                assert run.serving.draining
                idle.send(pack(_request(policy)))
                assert idle.recv(timeout=30) == "server is shutting down"
                with pytest.raises(ConnectionClosed) as closed:
                    idle.recv(timeout=30)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
                with pytest.raises(InvalidStatus) as handshake:
                    websockets.sync.client.connect(run.url)
                assert handshake.value.response.status_code == 503
                assert run.post(json.dumps({}))[0] == 503
                assert flight.is_alive() and not run.server.should_exit  # the drain waits for it
                gate.set()
                flight.join(60)
                assert answer and answer[0]["actions"].ndim == 2
            run.thread.join(30)
            assert not run.thread.is_alive(), "the server did not stop after the drain"
        finally:
            gate.set()


# ---- frames over twice the limit ---------------------------------------------------------------------------------
def test_a_frame_over_twice_the_limit_is_closed_1009_naming_the_limit(policy: Any) -> None:
    """The one exception to "text error + 1011": a frame over 2x ``--max-frame-mb`` is cut off by the protocol
    layer as it arrives (never held in memory) with close code 1009 and a reason naming the size it may have;
    between 1x and 2x the app answers with the text error and 1011."""
    limit = 512 * 1024
    with running(policy, limits=Limits(max_frame_bytes=limit)) as run, WebsocketClient(run.url) as good:
        for size, code in ((3 * limit, 1009), (limit + limit // 2, 1011)):
            with websockets.sync.client.connect(run.url, compression=None, max_size=None) as ws:
                unpack(ws.recv(timeout=30))
                if code == 1009:
                    # the frame's header alone (binary, masked, its 64-bit length): the server refuses on reading
                    # it. A whole frame's upload races the server's close: the client may see a reset instead
                    ws.socket.sendall(bytes([0x82, 0xFF]) + size.to_bytes(8, "big") + bytes(4))
                else:
                    ws.send(pack({"images": {"primary": np.zeros(size, np.uint8)}}))
                if code == 1011:
                    assert f"exceeds the limit of {limit} bytes" in ws.recv(timeout=30)
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == code, size
            if code == 1009:
                assert f"exceeds limit of {2 * limit} bytes" in closed.value.rcvd.reason
        assert good.infer(_request(policy))["actions"].ndim == 2  # the others keep being served


# ---- the ready line ----------------------------------------------------------------------------------------------
def test_a_port_in_use_is_refused_naming_the_flag_and_who_may_hold_it() -> None:
    """Two only-bound sockets with SO_REUSEADDR can share a port, so ``bind_socket`` listens at once: a port some
    server listens on fails at the bind. ``vla serve`` tries once before loading and again when ready; the second
    failure says the port was taken while the model loaded."""
    from vla.serving.server import bind_socket

    first = bind_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"--port {port}: cannot listen there .*another server may hold it"):
            bind_socket("127.0.0.1", port)
        with pytest.raises(
            OSError, match="another process took it while the model loaded: pick another --port"
        ):
            bind_socket("127.0.0.1", port, taken_meanwhile=True)
    finally:
        first.close()
    bind_socket("127.0.0.1", port).close()  # free again once the first is closed


def test_ready_url_brackets_ipv6_hosts() -> None:
    assert ws_url("127.0.0.1", 8000) == "ws://127.0.0.1:8000"
    assert ws_url("::", 8000) == "ws://[::]:8000" and ws_url("::1", 9) == "ws://[::1]:9"
    assert ws_url("localhost", 1) == "ws://localhost:1"


# ---- the client against servers that fail ------------------------------------------------------------------------
class _FrozenServer:
    """Completes one WebSocket handshake by hand, sends a metadata frame, then never reads again (a frozen server
    process): a client's send of a frame larger than the socket buffers blocks."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"ws://127.0.0.1:{self.listener.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        import hashlib

        conn, _ = self.listener.accept()
        self.conns.append(conn)
        request = b""
        while b"\r\n\r\n" not in request:
            request += conn.recv(4096)
        key = next(
            line.split(b":", 1)[1].strip()
            for line in request.split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-key")
        )
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        conn.sendall(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )
        meta = pack({"protocol_version": 1})
        conn.sendall(bytes([0x82, len(meta)]) + meta)  # one unmasked binary frame (< 126 bytes)

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.listener.close()


def test_client_timeout_bounds_a_send_to_a_server_that_stopped_reading() -> None:
    """Before, ``send`` had no timeout: a 32 MB request to a frozen server blocked ``infer`` forever (seen with 6 MB
    on loopback; smaller on a slow link). The kernel's send timeout ends a send that moves no byte for ``timeout``;
    while the socket's buffers fill, the sends before that one move some, so the whole takes a few timeouts."""
    server = _FrozenServer()
    try:
        client = WebsocketClient(server.url, timeout=1.0)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"within timeout=1 s"):
            client.infer({"images": {"primary": np.zeros(32 * 2**20, np.uint8)}})
        assert time.monotonic() - start < 15
        client.close()
    finally:
        server.close()


def test_client_timeout_bounds_the_resend_after_a_dropped_connection(policy: Any) -> None:
    """A request whose connection dropped is resent only within its ``timeout``: before, the reconnect could take
    all of ``connect_timeout`` (30 s) and the robot got actions for an observation that old, with no error."""
    run = Running(ServingApp(policy, ServeOptions(port=0)))
    client = WebsocketClient(run.url, timeout=2.0, connect_timeout=60)
    patient = WebsocketClient(run.url, timeout=60)
    assert client.infer(_request(policy))["actions"].ndim == 2
    run.stop()  # the server goes away between requests; nothing listens on its port any more
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=r"could not connect to ws://.* within timeout=2 s"):
        client.infer(_request(policy))
    assert time.monotonic() - start < 6
    client.close()

    # close() from another thread ends a call that is waiting to reconnect (before: it went on for its budget)
    def waiting() -> BaseException | None:
        try:
            patient.infer(_request(policy))
        except BaseException as e:
            return e
        return None

    thread, out = _in_thread(waiting)
    time.sleep(1.0)
    patient.close()
    thread.join(5)
    assert not thread.is_alive() and isinstance(out[0], ClientClosedError), out


def test_client_errors_name_the_problem_and_never_the_key(policy: Any) -> None:
    """A refused handshake carries the server's explanation (before: ``HTTP 401`` alone) and is not retried; an
    http:// URL and a key with its file's newline are refused at once (before: retried for ``connect_timeout``,
    then a traceback printing the key)."""
    key = "k" * 24
    with running(policy, api_key=key) as run:
        start = time.monotonic()
        with pytest.raises(ConnectionRejectedError) as rejected:
            WebsocketClient(run.url, api_key="wrong" * 5, connect_timeout=30)
        assert time.monotonic() - start < 5
        assert isinstance(rejected.value, InvalidStatus) and rejected.value.response.status_code == 401
        assert "HTTP 401: unauthorized: send the header 'Authorization: Api-Key <key>'" in str(rejected.value)
        with WebsocketClient(run.url, api_key=key) as ok:
            assert ok.infer(_request(policy))["actions"].ndim == 2
    with pytest.raises(ValueError, match="a WebSocket URL is ws://HOST:PORT"):
        WebsocketClient(run.http)
    with pytest.raises(ValueError, match=r"keeps its newline: strip\(\) it") as bad_key:
        WebsocketClient(run.url, api_key=key + "\n")
    assert key not in str(bad_key.value)
    for kwargs in ({"retries": -1}, {"timeout": 0}, {"connect_timeout": -1}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            WebsocketClient(run.url, **kwargs)


def test_a_frame_over_the_servers_limit_is_never_uploaded(
    policy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client checks a request against the limit in the server's metadata. Before, it uploaded it; one over
    twice the limit the server cut off (1009), which the client took for a dropped connection: it reconnected and
    uploaded the whole frame once more."""
    real, connects = websockets.sync.client.connect, []
    monkeypatch.setattr(
        websockets.sync.client, "connect", lambda *a, **k: connects.append(1) or real(*a, **k)
    )
    limit = 256 * 1024
    with running(policy, limits=Limits(max_frame_bytes=limit)) as run, WebsocketClient(run.url) as client:
        big = {**_request(policy), "images": {"primary": np.zeros((1024, 1024, 3), np.uint8)}}
        assert client.metadata["max_frame_bytes"] == limit
        for image in (np.zeros((1024, 1024, 3), np.uint8), np.zeros((300, 300, 3), np.uint8)):  # 12x, ~1.03x
            with pytest.raises(
                ValueError, match=rf"over ws://.*'s frame limit of {limit} bytes .*--max-frame-mb"
            ):
                client.infer({**big, "images": {"primary": image}})
        assert len(connects) == 1  # no second connection for a resend
        assert _metric(run, 'vla_serve_errors_total{kind="limit"}') == 0.0  # nothing reached the server
        assert client.infer(_request(policy))["actions"].ndim == 2


def test_a_full_server_is_retried_until_the_connect_deadline(policy: Any) -> None:
    """503 at the handshake (``--max-connections`` reached; a proxy before a server still loading answers 502) may
    pass: the client retries until ``connect_timeout``, then raises the server's message. A 401 is final at once
    (test_client_errors_name_the_problem_and_never_the_key)."""
    with running(policy, max_connections=1) as run:
        first = WebsocketClient(run.url)
        start = time.monotonic()
        with pytest.raises(ConnectionRejectedError, match=r"HTTP 503: .*--max-connections"):
            WebsocketClient(run.url, connect_timeout=1.0)
        assert time.monotonic() - start >= 1.0  # retried, not refused at once
        threading.Timer(1.0, first.close).start()  # a slot frees up while the second one waits
        with WebsocketClient(run.url, connect_timeout=30) as second:
            assert second.infer(_request(policy))["actions"].ndim == 2
