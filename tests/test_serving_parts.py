"""The serving parts on their own: wire format vs openpi's encoder, JSON arrays, request layouts, API keys, the
torch-free client import, the action-chunk broker, the micro-batcher with a real ``Policy`` and mode selection."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from vla.serving.broker import ActionChunkBroker
from vla.serving.json_numpy import JsonNumpyError, decode_json_numpy, encode_json_numpy
from vla.serving.protocol import ProtocolError, pack, unpack
from vla.serving.requests import Limits, RequestError, to_observation
from vla.serving.security import authorized, load_api_key

SERVED = ["sim_panda", "widowx_bridge"]


# ---- wire format -----------------------------------------------------------------------------------------------------
def _sample() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "observation/image": rng.integers(0, 256, (4, 5, 3), dtype=np.uint8),
        "observation/state": rng.normal(size=8).astype(np.float32),
        "f64": rng.normal(size=(2, 3)),
        "flags": np.array([True, False]),
        "i16": np.arange(6, dtype=">i2").reshape(3, 2),  # big-endian survives: dtype.str keeps the byte order
        "scalar": np.float32(1.5),
        "count": np.int64(-3),
        "prompt": "pick up the cube",
        "nested": {"a": [1, 2.5, None, b"raw"]},
    }


def test_pack_is_byte_identical_to_openpis_encoder_and_round_trips() -> None:
    msgpack_numpy = pytest.importorskip(
        "openpi_client.msgpack_numpy", reason="openpi-client not installed: `make install` adds it"
    )
    obj = _sample()
    assert pack(obj) == msgpack_numpy.packb(obj)
    for decoded in (unpack(msgpack_numpy.packb(obj)), msgpack_numpy.unpackb(pack(obj))):
        for key in ("observation/image", "observation/state", "f64", "flags", "i16"):
            assert decoded[key].dtype == obj[key].dtype and np.array_equal(decoded[key], obj[key]), key
        assert decoded["scalar"] == np.float32(1.5) and decoded["scalar"].dtype == np.float32
        assert (
            decoded["count"] == -3
            and decoded["prompt"] == obj["prompt"]
            and decoded["nested"] == obj["nested"]
        )
    assert not unpack(pack(obj))["f64"].flags.writeable  # a view of the frame, no copy


def _array(dtype: Any = "<f4", shape: Any = (2,), data: Any = b"\0" * 8) -> bytes:
    return msgpack.packb({"x": {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}})


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (_array(dtype="|O"), "'|O' is not allowed"),
        (_array(dtype="|V8", shape=(1,)), "'|V8' is not allowed"),
        (_array(dtype="<c8", shape=(1,)), "'<c8' is not allowed"),
        (_array(dtype="<U2", shape=(1,)), "'<U2' is not allowed"),
        (_array(dtype="bogus"), "unknown numpy dtype"),
        (_array(shape=(3,)), "needs 12 bytes, got 8"),
        (_array(shape=(-1,)), "list of at most 8 ints >= 0"),
        (_array(shape="2"), "list of at most 8 ints >= 0"),
        (_array(data="text"), "must be msgpack bin"),
        (msgpack.packb({b"__npgeneric__": True, b"data": "x", b"dtype": "<f4"}), "must be a number"),
        (b"\xc1", "malformed msgpack"),
        (msgpack.packb({"a": 1}) + b"\x01", "malformed msgpack"),
        (b"\x91" * 200_000, "malformed msgpack"),
    ],
)  # fmt: skip
def test_unpack_refuses_what_openpis_decoder_would_accept_or_crash_on(frame: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(message)):
        unpack(frame)


def test_frame_limit_and_unsendable_dtypes() -> None:
    frame = pack({"x": np.zeros(100, np.uint8)})
    assert unpack(frame, max_bytes=len(frame))["x"].shape == (100,)
    with pytest.raises(
        ProtocolError, match=f"frame of {len(frame)} bytes exceeds the limit of {len(frame) - 1}"
    ):
        unpack(frame, max_bytes=len(frame) - 1)
    with pytest.raises(ProtocolError, match="only bool, int, uint and float"):
        pack({"x": np.array(["a"], dtype=object)})


def test_json_numpy_round_trip_and_refusals() -> None:
    obj = {"image": np.arange(24, dtype=np.uint8).reshape(2, 4, 3), "state": np.float32(0.5), "list": [1, 2]}
    back = json.loads(json.dumps(obj, default=encode_json_numpy), object_hook=decode_json_numpy)
    assert back["image"].dtype == np.uint8 and np.array_equal(back["image"], obj["image"])
    assert back["state"] == np.float32(0.5) and back["list"] == [1, 2]
    # The json-numpy package's layout: base64 of the raw bytes, dtype.str, shape.
    assert json.loads(json.dumps(obj, default=encode_json_numpy))["image"] == {
        "__numpy__": base64.b64encode(obj["image"].tobytes()).decode(), "dtype": "|u1", "shape": [2, 4, 3]
    }  # fmt: skip
    for bad, message in (
        ({"__numpy__": "AAAA", "dtype": "|O", "shape": [3]}, "not allowed"),
        ({"__numpy__": "AAAA", "dtype": "|u1", "shape": [4]}, "needs 4 bytes, got 3"),
        ({"__numpy__": "!!", "dtype": "|u1", "shape": [1]}, "not valid base64"),
        ({"__numpy__": "AA==", "dtype": "|u1", "shape": [True]}, "list of at most 8 ints"),  # was a 500
        ({"__numpy__": "AA==", "dtype": "|u1", "shape": [1] * 9}, "list of at most 8 ints"),
        (
            {"__numpy__": "AAAAAAAAAAA=", "shape": [1]},
            "'dtype' must be a dtype string",
        ),  # was read as float64
    ):
        with pytest.raises(JsonNumpyError, match=message):
            decode_json_numpy(bad)


# ---- request layouts ---------------------------------------------------------------------------------------------------
def _images(n: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, 256, (6, 8, 3), dtype=np.uint8) for _ in range(n)]


def test_a_state_list_may_hold_numpy_numbers() -> None:
    """Joints as floats next to a 0-d numpy gripper value (as a robot loop builds it) is a number list."""
    obs, _ = to_observation(
        {"images": {"primary": np.zeros((2, 2, 3), np.uint8)}, "state": [0.5] * 7 + [np.array(1.0)],
         "prompt": "x"}, SERVED, Limits(), default="sim_panda",
    )  # fmt: skip
    np.testing.assert_allclose(obs.state, [0.5] * 7 + [1.0])


def test_request_layouts_map_to_the_same_observation() -> None:
    (a, b), state = _images(), np.linspace(-1, 1, 8).astype(np.float32)
    limits = Limits()
    layouts = [
        {"images": {"primary": a, "wrist": b}, "state": state},
        {"observation/image": a, "observation/wrist_image": b, "observation/state": state},
        {"observation/exterior_image_1_left": a, "observation/wrist_image_left": b,
         "observation/joint_position": state[:7], "observation/gripper_position": state[7]},
        {"images": {"primary": a.transpose(2, 0, 1), "wrist": b.transpose(2, 0, 1)}, "state": state.tolist()},
    ]  # fmt: skip
    for msg in layouts:
        obs, seed = to_observation(
            {**msg, "prompt": b"go", "embodiment": "sim_panda", "seed": 4}, SERVED, limits
        )
        assert seed == 4 and obs.prompt == "go" and obs.embodiment == "sim_panda"
        assert set(obs.images) == {"primary", "wrist"}
        assert np.array_equal(obs.images["primary"], a) and np.array_equal(obs.images["wrist"], b)
        np.testing.assert_allclose(obs.state, state, rtol=1e-6)
    aloha, _ = to_observation(
        {"images": {"cam_high": a.transpose(2, 0, 1), "cam_left_wrist": b}, "state": np.zeros(14), "prompt": "x"},
        SERVED, limits, default="sim_panda",
    )  # fmt: skip
    assert set(aloha.images) == {"primary", "left_wrist"} and np.array_equal(aloha.images["primary"], a)
    openvla, _ = to_observation(
        {"image": a, "instruction": "do", "state": state}, SERVED, limits, default="sim_panda"
    )
    assert openvla.prompt == "do" and np.array_equal(openvla.images["primary"], a)


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        ({"images": {"primary": 0}, "state": [0.0]}, "missing key 'embodiment'"),
        ({"embodiment": "r2d2"}, "unknown embodiment 'r2d2'"),
        ({"embodiment": "sim_panda", "state": [0.0]}, "missing key 'prompt'"),
        ({"embodiment": "sim_panda", "prompt": "x" * 11}, "11 characters, over the limit of 10"),
        ({"embodiment": "sim_panda", "prompt": b"\xff"}, "not valid UTF-8"),
        ({"embodiment": "sim_panda", "prompt": "x", "state": [0.0]}, "missing key 'images'"),
        ({"embodiment": "sim_panda", "prompt": "x", "images": {"front": np.zeros((2, 2, 3), np.uint8)},
          "state": [0.0]}, "unknown camera(s) ['front']"),
        ({"embodiment": "sim_panda", "prompt": "x", "images": {"primary": np.zeros((2, 20, 3), np.uint8)},
          "state": [0.0]}, "over the limit of 16 per side"),
        ({"embodiment": "sim_panda", "prompt": "x", "observation/image": np.zeros((2, 2, 3), np.uint8),
          "observation/state": [0.0], "extra": 1}, "unexpected key(s) ['extra'] in a LIBERO-style request"),
        ({"embodiment": "sim_panda", "prompt": "x", "seed": -1}, "'seed' must be an int"),
        ({"embodiment": "sim_panda", "prompt": "x", "images": {"primary": [[[300, 0, 0]]]}, "state": [0.0]},
         "ints in 0..255"),
        ({"embodiment": "sim_panda", "prompt": "x", "images": {"primary": np.zeros((1, 1, 3), np.uint8)},
          "state": "abc"}, "'state' must be a float array"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_key(msg: dict[str, Any], message: str) -> None:
    limits = Limits(max_prompt_chars=10, max_image_side=16)
    with pytest.raises(RequestError, match=re.escape(message)):
        to_observation(msg, SERVED, limits)


def _nested(depth: int) -> list[Any]:
    """``[[[...[0.0]...]]]``, ``depth`` lists deep."""
    value: Any = 0.0
    for _ in range(depth):
        value = [value]
    return value


def test_openvlas_deploy_payload_with_its_unnorm_key_is_taken() -> None:
    """OpenVLA's deploy script sends ``unnorm_key`` with the image; it was refused as an unexpected key."""
    msg = {
        "image": np.zeros((4, 4, 3), np.uint8),
        "state": np.zeros(8),
        "instruction": "x",
        "unnorm_key": "bridge",
    }
    obs, _ = to_observation(msg, SERVED, Limits(), default="sim_panda")
    assert set(obs.images) == {"primary"} and obs.prompt == "x"


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        ({"images": {"primary": np.zeros((2, 2, 3), np.uint8)}, "state": ["a", 1]}, "'state' must be a flat list"),
        ({"images": {"primary": np.zeros((2, 2, 3), np.uint8)}, "state": [[1, 2], [3]]}, "'state' must be a flat list"),
        ({"images": {"primary": np.zeros((2, 2, 3), np.uint8)}, "state": [{}]}, "'state' must be a flat list"),
        ({"observation/exterior_image_1_left": np.zeros((2, 2, 3), np.uint8),
          "observation/joint_position": np.zeros(7), "observation/gripper_position": np.zeros((1, 1))},
         "'observation/gripper_position' must be a 1-D float array"),
        ({"observation/exterior_image_1_left": np.zeros((2, 2, 3), np.uint8),
          "observation/joint_position": [[0.0] * 7], "observation/gripper_position": 0.5},
         "'observation/joint_position' must be a 1-D float array"),
        ({1: 2, "other": 3, "observation/state": np.zeros(8)}, "unexpected key(s) [1, 'other']"),
        # a float64 conversion took these as numbers: strings parsed ("1_0" = 10), bools and bytes as 0/1
        ({"images": {"primary": np.zeros((2, 2, 3), np.uint8)}, "state": ["0"] * 8}, "'state' must be a flat list"),
        ({"images": {"primary": np.zeros((2, 2, 3), np.uint8)}, "state": [" 1_0 ", 0]}, "'state' must be a flat list"),
        ({"images": {"primary": np.zeros((2, 2, 3), np.uint8)}, "state": [False] * 7 + [True]},
         "'state' must be a flat list"),
        ({"images": {"primary": np.zeros((2, 2, 3), np.uint8)}, "state": [True, 1.0]}, "'state' must be a flat list"),
        ({"images": {"primary": np.zeros((2, 2, 3), np.uint8)}, "state": [b"0"] * 8}, "'state' must be a flat list"),
        ({"observation/state": np.zeros(8)}, "a LIBERO-style request needs at least one image"),
        ({"observation/joint_position": np.zeros(7), "observation/gripper_position": 0.5},
         "a DROID-style request needs at least one image"),
        # nested far deeper than a state is (before: a RecursionError, an internal error and a 2,000-line traceback)
        ({"images": {"primary": np.zeros((2, 2, 3), np.uint8)}, "state": _nested(330)}, "nested over 4 deep"),
        ({"observation/exterior_image_1_left": np.zeros((2, 2, 3), np.uint8),
          "observation/joint_position": np.zeros(7), "observation/gripper_position": _nested(500)},
         "'observation/gripper_position' must be a flat list"),
    ],
)  # fmt: skip
def test_malformed_state_values_are_client_errors_naming_the_key(msg: dict[Any, Any], message: str) -> None:
    """Strings, ragged lists or a DROID part of the wrong rank in the state, and int keys beside str ones, are the
    client's error (a ``RequestError`` naming the key: REST 400, text error + 1011), not an internal one."""
    from vla.serving.server import _client_message, _error_kind

    with pytest.raises(RequestError, match=re.escape(message)) as e:
        to_observation({**msg, "prompt": "x"}, SERVED, Limits(), default="sim_panda")
    assert _error_kind(e.value) == "observation" and message in _client_message(e.value)


def test_api_key_file_and_header_check(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text("  0123456789abcdefXYZ  \n# comment\n")
    key = load_api_key(f)
    assert key == "0123456789abcdefXYZ"
    assert authorized(f"Api-Key {key}", key) and authorized(None, None)
    assert not authorized(None, key) and not authorized(key, key) and not authorized(f"Api-Key {key}x", key)
    assert not authorized(f"Bearer {key}", key)
    assert authorized(f"Api-Key  {key}", key)  # RFC 9110: 1*SP after the scheme
    assert authorized(f"api-key {key}", key) and authorized(
        f"API-KEY {key}", key
    )  # schemes are case-insensitive
    assert not authorized(f"Api-Key {key.lower()}", key)  # keys are not
    f.write_text("short")
    with pytest.raises(ValueError, match=r"at least 16 characters.*secrets\.token_urlsafe"):
        load_api_key(f)
    with pytest.raises(ValueError, match="cannot read it"):
        load_api_key(tmp_path / "missing")
    # a byte-order mark (PowerShell's Out-File -Encoding utf8) is not part of the key; before, the server started
    # and no request ever matched
    f.write_bytes(b"\xef\xbb\xbf0123456789abcdefXYZ\r\n")
    assert load_api_key(f) == "0123456789abcdefXYZ"
    f.write_text("0123456789abcdef\u00e9XYZ", encoding="utf-8")  # not sendable as is in a header: refused
    with pytest.raises(ValueError, match="an HTTP header cannot carry"):
        load_api_key(f)
    f.write_bytes(b"\xff0123456789abcdefXYZ")
    with pytest.raises(ValueError, match=f"--api-key-file {f}: not UTF-8"):
        load_api_key(f)


def test_client_imports_no_torch() -> None:
    code = (
        "import sys; import vla.serving.client as c; from vla.serving.broker import ActionChunkBroker; "
        "bad = [m for m in ('torch', 'transformers', 'vla.types', 'vla.policy') if m in sys.modules]; "
        "assert not bad, bad; print('ok', c.WebsocketClient.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok WebsocketClient"), out.stderr


# ---- clients: a reply that comes too late ------------------------------------------------------------------------------
class _SlowEchoServer:
    """A tiny websockets server: a metadata frame on connect, then ``{"echo": i}`` per request ``{"i": i}``;
    request 0 is answered only once ``release`` is set (``late_sent`` is set after that answer was tried)."""

    def __init__(self) -> None:
        import threading

        self.release, self.late_sent, self.connections = threading.Event(), threading.Event(), 0
        self._ready, self._stop = threading.Event(), None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        assert self._ready.wait(30)

    async def _handler(self, ws: Any) -> None:
        import websockets.exceptions

        self.connections += 1
        await ws.send(pack({"protocol_version": 1}))
        async for frame in ws:
            i = unpack(frame)["i"]
            if i == 0:
                while not self.release.is_set():
                    await asyncio.sleep(0.01)
            try:
                await ws.send(pack({"echo": i}))
            except websockets.exceptions.ConnectionClosed:  # the client dropped the connection: the fix
                return
            finally:
                if i == 0:
                    self.late_sent.set()

    async def _main(self) -> None:
        import websockets.asyncio.server

        self._stop = asyncio.get_running_loop().create_future()
        async with websockets.asyncio.server.serve(self._handler, "127.0.0.1", 0, compression=None) as srv:
            self.url = f"ws://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
            self._ready.set()
            await self._stop

    def close(self) -> None:
        loop = self._stop.get_loop()
        loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(30)


def test_sync_client_never_reads_a_late_reply_as_the_next_answer() -> None:
    """A request that timed out closes the connection: its late reply (request 0's) must not be read as the answer
    to the next request, which would leave every later answer one request behind."""
    from vla.serving.client import WebsocketClient

    server = _SlowEchoServer()
    try:
        client = WebsocketClient(server.url, timeout=0.2)
        with pytest.raises(TimeoutError, match=r"no answer from ws://.* within timeout=0\.2 s"):
            client.infer({"i": 0})
        server.release.set()
        assert server.late_sent.wait(30)  # the late reply went out (or found the connection closed)
        assert client.infer({"i": 1})["echo"] == 1
        assert client.infer({"i": 2})["echo"] == 2
        assert server.connections == 2  # the timed-out connection was replaced by a new one
        client.close()
    finally:
        server.close()


def test_async_client_never_reads_a_late_reply_as_the_next_answer() -> None:
    """The asyncio client, after a timeout and after a cancelled ``infer``: the next call reconnects and gets its
    own answer."""
    from vla.serving.client import AsyncWebsocketClient

    server = _SlowEchoServer()

    async def run() -> list[int]:
        client = await AsyncWebsocketClient.open(server.url, timeout=0.2)
        with pytest.raises(TimeoutError, match=r"within timeout=0\.2 s"):  # before: TimeoutError('')
            await client.infer({"i": 0})
        server.release.set()
        while not server.late_sent.is_set():
            await asyncio.sleep(0.01)
        answers = [(await client.infer({"i": 1}))["echo"]]
        server.release.clear()
        server.late_sent.clear()
        task = asyncio.ensure_future(client.infer({"i": 0}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        server.release.set()
        while not server.late_sent.is_set():
            await asyncio.sleep(0.01)
        answers.append((await client.infer({"i": 2}))["echo"])
        await client.close()
        return answers

    try:
        assert asyncio.run(run()) == [1, 2]
        assert server.connections == 3
    finally:
        server.close()


def test_close_from_another_thread_ends_the_client_instead_of_reconnecting() -> None:
    """``close()`` while another thread waits for an answer: that call raises ``ClientClosedError`` and so does
    every later one; the client never opens a new connection behind the closer's back (before: the in-flight call
    took the close for a dropped connection, reconnected and sent its request again)."""
    import threading

    from vla.serving.client import ClientClosedError, WebsocketClient

    server = _SlowEchoServer()
    try:
        client = WebsocketClient(server.url, timeout=30)
        errors: list[BaseException] = []

        def call() -> None:
            try:
                client.infer({"i": 0})  # held by the server until released
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.3)
        client.close()
        thread.join(30)
        server.release.set()
        assert len(errors) == 1 and isinstance(errors[0], ClientClosedError), errors
        with pytest.raises(ClientClosedError, match="was closed; open a new client"):
            client.infer({"i": 1})
        assert server.connections == 1
    finally:
        server.release.set()
        server.close()


def test_async_close_from_another_task_ends_the_client_instead_of_reconnecting() -> None:
    from vla.serving.client import AsyncWebsocketClient, ClientClosedError

    server = _SlowEchoServer()

    async def run() -> None:
        client = await AsyncWebsocketClient.open(server.url, timeout=30)
        task = asyncio.ensure_future(client.infer({"i": 0}))
        await asyncio.sleep(0.3)
        await client.close()
        with pytest.raises(ClientClosedError):
            await task
        with pytest.raises(ClientClosedError):
            await client.infer({"i": 1})

    try:
        asyncio.run(run())
        assert server.connections == 1
    finally:
        server.release.set()
        server.close()


# ---- broker -----------------------------------------------------------------------------------------------------------
class CountingPolicy:
    """Chunk ``q`` (the q-th query, from 0) has actions ``[[100 q + t]]`` for t in 0..H-1; records the observations."""

    def __init__(self, horizon: int) -> None:
        self.horizon, self.seen = horizon, []

    def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
        q = len(self.seen)
        self.seen.append(obs["t"])
        return {"actions": (100.0 * q + np.arange(self.horizon, dtype=np.float32))[:, None]}


def test_broker_executes_k_of_h_then_requeries() -> None:
    policy = CountingPolicy(horizon=5)
    broker = ActionChunkBroker(policy, execute=3)
    got = [float(broker.act({"t": t})[0]) for t in range(7)]
    assert got == [0, 1, 2, 100, 101, 102, 200]
    assert policy.seen == [0, 3, 6]  # each query sees the observation of the step it starts at
    broker.reset()
    assert float(broker.act({"t": 99})[0]) == 300
    with pytest.raises(ValueError, match="execute=6 needs"):
        ActionChunkBroker(CountingPolicy(horizon=5), execute=6).act({"t": 0})


def test_broker_prefetch_skips_the_stale_steps_and_blends_the_overlap() -> None:
    policy = CountingPolicy(horizon=8)
    broker = ActionChunkBroker(policy, execute=4, prefetch=2, blend=2)
    got = [float(broker.act({"t": t})[0]) for t in range(6)]
    assert policy.seen == [0, 2]  # the second query went out 2 steps before the first chunk's 4 ran out
    # Switch at step 4: the new chunk (queried at t=2) starts at its index 2; blended with the old chunk's 4, 5.
    w1, w2 = 1 / 3, 2 / 3
    assert got[:4] == [0, 1, 2, 3]
    assert got[4] == pytest.approx(w1 * 102 + (1 - w1) * 4) and got[5] == pytest.approx(
        w2 * 103 + (1 - w2) * 5
    )
    with pytest.raises(ValueError, match=r"prefetch must be in 0\.\.execute"):
        ActionChunkBroker(policy, execute=2, prefetch=3)


def test_broker_checks_its_settings_before_the_robot_moves() -> None:
    """H < execute + prefetch is refused at the first chunk. Before, the first chunk was checked against execute
    alone: the robot ran execute - 1 actions and the control loop failed mid-motion at the first switch."""
    from vla.serving.client import AsyncWebsocketClient

    broker = ActionChunkBroker(CountingPolicy(horizon=6), execute=5, prefetch=2)
    with pytest.raises(ValueError, match=r"execute=5 \+ prefetch=2 needs \[H >= 7, A\]"):
        broker.act({"t": 0})
    with pytest.raises(ValueError, match="prefetch is a number of control steps"):
        ActionChunkBroker(CountingPolicy(horizon=6), execute=3, prefetch=1.5)  # before: prefetch silently off
    with pytest.raises(
        TypeError, match="not an AsyncWebsocketClient"
    ):  # before: 'coroutine' not subscriptable
        ActionChunkBroker(AsyncWebsocketClient("ws://127.0.0.1:1"), execute=3)


def test_broker_prefetch_equal_to_execute_queries_at_each_chunks_first_step() -> None:
    """``prefetch == execute`` (allowed): the next query goes out in the background at the step a chunk starts,
    and each switch skips ``prefetch`` actions of the new chunk (before: it never prefetched at all)."""
    policy = CountingPolicy(horizon=6)
    broker = ActionChunkBroker(policy, execute=2, prefetch=2, blend=0)
    got = [float(broker.act({"t": t})[0]) for t in range(6)]
    assert policy.seen == [0, 0, 2, 4]  # chunk 0 at t=0 and its prefetch at once; then one at each switch
    assert got == [0, 1, 102, 103, 202, 203]
    broker.reset()


def test_broker_prefetch_sends_the_observation_as_it_was_at_the_call() -> None:
    """A robot loop refills its camera and state buffers in place right after ``act``: the prefetch thread, which
    sends later, must send the values of the call (before: it packed whatever the buffers held by then)."""
    import threading

    release, seen = threading.Event(), []

    class Slow:
        def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
            if seen:  # the prefetch: reads the observation only after the loop changed its buffers
                assert release.wait(30)
            seen.append((obs["state"].copy(), obs["images"]["primary"].copy(), list(obs["extra"])))
            return {"actions": np.zeros((4, 1), np.float32)}

    state, image, extra = np.zeros(3), np.zeros((2, 2, 3), np.uint8), [0]
    broker = ActionChunkBroker(Slow(), execute=3, prefetch=1)
    for t in range(3):  # step 2 starts the prefetch with state == 2
        state[:], image[:], extra[0] = t, t, t
        broker.act({"state": state, "images": {"primary": image}, "extra": extra})
    state[:], image[:], extra[0] = 99, 99, 99  # the loop reuses its buffers before the prefetch ran
    release.set()
    broker.act(
        {"state": state, "images": {"primary": image}, "extra": extra}
    )  # the switch: joins the prefetch
    sent_state, sent_image, sent_extra = seen[1]
    assert np.all(sent_state == 2) and np.all(sent_image == 2) and sent_extra == [2]


# ---- micro-batcher and modes on a real Policy --------------------------------------------------------------------------
def _policy(family: str = "smolvlm") -> Any:
    from vla.data.norm_stats import NormStats, StatsFile
    from vla.models.testing import tiny_model
    from vla.policy import Policy

    model = tiny_model(family, embodiments=tuple(SERVED), seed=3)
    rng = np.random.default_rng(0)

    def stats(dim: int) -> NormStats:
        x = rng.uniform(-1, 1, (100, dim))
        return NormStats(mean=x.mean(0), std=x.std(0), min=x.min(0), max=x.max(0),
                         q01=np.quantile(x, 0.01, 0), q99=np.quantile(x, 0.99, 0), count=100)  # fmt: skip

    model.norm_stats = StatsFile(
        stats={
            n: {"state": stats(model.spec(n).state_dim), "action": stats(model.spec(n).action_dim)}
            for n in SERVED
        }
    )
    return Policy(model, num_steps=2)


def _per_dataset_checkpoint(folder: Path) -> Path:
    """A tiny ``sim_panda`` + ``widowx_bridge`` checkpoint whose ``sim_panda`` was trained on datasets ``a`` and
    ``b``, each normalized with its own ``sim_panda@<dataset>`` stats (``widowx_bridge``: the embodiment's)."""
    from vla.data.norm_stats import NormStats, StatsFile
    from vla.models.hub import save_pretrained
    from vla.models.testing import tiny_model

    model = tiny_model(embodiments=tuple(SERVED), seed=3)
    rng = np.random.default_rng(0)

    def stats(dim: int) -> NormStats:
        x = rng.uniform(-1, 1, (100, dim))
        return NormStats(mean=x.mean(0), std=x.std(0), min=x.min(0), max=x.max(0),
                         q01=np.quantile(x, 0.01, 0), q99=np.quantile(x, 0.99, 0), count=100)  # fmt: skip

    keys = {"sim_panda@a": "sim_panda", "sim_panda@b": "sim_panda", "widowx_bridge": "widowx_bridge"}
    model.norm_stats = StatsFile(
        stats={
            k: {f: stats(len(model.spec(e).limits(f)[0])) for f in ("state", "action")}
            for k, e in keys.items()
        }
    )
    model.preprocessing = {
        "stats_keys": {
            "a": {"state": "sim_panda@a", "action": "sim_panda@a"},
            "b": {"state": "sim_panda@b", "action": "sim_panda@b"},
            "w": {"state": "widowx_bridge", "action": "widowx_bridge"},
        }
    }
    return Path(save_pretrained(model, folder / "per_dataset"))


def test_stats_dataset_flag_serves_an_embodiment_with_several_datasets_stats(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: Any,
    request: pytest.FixtureRequest,
) -> None:
    """An embodiment trained on several datasets, each with its own stats, is served with ``vla serve
    --stats-dataset EMB=DATASET``; without ``--embodiment`` (and no choice) it is left out with a warning naming the
    flag while the others are served; named with ``--embodiment`` it is refused, naming the flag."""
    import logging

    from vla.cli import main
    from vla.policy import AmbiguousStatsError, Policy
    from vla.serving import server

    ckpt = _per_dataset_checkpoint(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vla.policy"):
        assert Policy.from_checkpoint(ckpt).embodiments == ["widowx_bridge"]
    assert "--stats-dataset sim_panda=a" in caplog.text and "'sim_panda' is not served" in caplog.text
    with pytest.raises(AmbiguousStatsError, match="--stats-dataset sim_panda=a"):
        Policy.from_checkpoint(ckpt, embodiments=["sim_panda"])
    served: list[Any] = []
    frozen: list[int] = []
    request.addfinalizer(gc.unfreeze)  # `vla serve` freezes the heap of this test process too

    def fake_run_server(
        serving: Any, *, on_ready: Any = None, sock: Any = None
    ) -> int:  # what would be served, without serving
        assert sock is not None and sock.getsockname()[1] > 0  # bound before loading
        served.append(serving.policy)
        frozen.append(gc.get_freeze_count())  # start-up's objects are out of the collector's scans by now
        serving.batcher.close(timeout=30)
        serving.batcher.model_thread.close()
        return 0

    monkeypatch.setattr(server, "run_server", fake_run_server)
    flags = ["--port", "0", "--dtype", "float32", "--no-compile", "--attention", "sdpa", "--num-steps", "1"]
    assert main(["serve", str(ckpt), "--stats-dataset", "sim_panda=b", *flags]) == 0
    policy = served[-1]
    assert policy.embodiments == ["sim_panda", "widowx_bridge"]
    assert policy._transforms["sim_panda"].state.name == "sim_panda@b/state"
    assert policy._transforms["sim_panda"].action.name == "sim_panda@b/action"
    assert frozen[-1] > 0
    assert main(["serve", str(ckpt), *flags]) == 0 and served[-1].embodiments == ["widowx_bridge"]
    capsys.readouterr()
    for bad, message in (
        (["--stats-dataset", "sim_panda=zzz"], "no stats of dataset 'zzz' for 'sim_panda'"),
        (["--stats-dataset", "r2d2=a"], "stats dataset chosen for ['r2d2']"),
        (
            ["--stats-dataset", "sim_panda=a", "--stats-dataset", "sim_panda=b"],
            "two datasets for 'sim_panda'",
        ),
        (["--embodiment", "sim_panda"], "--stats-dataset sim_panda=a"),
    ):
        assert main(["serve", str(ckpt), *bad, *flags]) == 2, bad
        assert message in capsys.readouterr().err, bad
    with pytest.raises(SystemExit):
        main(["serve", str(ckpt), "--stats-dataset", "sim_panda", *flags])
    assert "expected EMBODIMENT=DATASET" in capsys.readouterr().err
    # `vla model info` still reports the choice serving needs, and evaluating that embodiment says why it cannot
    assert main(["model", "info", str(ckpt), "--json"]) == 0
    assert "--stats-dataset sim_panda=a" in json.loads(capsys.readouterr().out)["serving_problem"]
    from vla.eval.policies import CheckpointPolicy

    with pytest.raises(AmbiguousStatsError, match="--stats-dataset sim_panda=a"):
        CheckpointPolicy(ckpt, "sim_panda")


def test_modes_are_timed_after_every_batch_size_is_warm_and_round_by_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_time`` warms every batch size up (a compiled mode compiles each) before timing any, then goes round the
    batch sizes: no timing right after a compile, and drift hits every size alike."""
    import types

    from vla.serving import modes

    policy = _policy()
    calls: list[int] = []
    clock = iter(range(100))
    monkeypatch.setattr(modes, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    monkeypatch.setattr(policy, "infer_batch", lambda obs, seeds: calls.append(len(obs)))
    assert modes._time(policy, [1, 4], repeats=2) == {1: 1.0, 4: 0.25}
    assert calls == [1, 4, 1, 4, 1, 4]
    calls.clear()
    assert modes._time(policy, [1, 4], repeats=0) == {} and calls == [1, 4]


def test_the_model_loads_and_runs_on_one_thread() -> None:
    """``vla serve`` loads and warms the policy on a ``ModelThread`` that then runs every batch: a second thread
    doing torch work makes GNU OpenMP stop spinning between parallel regions (280 vs 180 ms a chunk measured on a
    2-core Xeon). Exceptions come back to the caller."""
    import threading

    from vla.serving.batching import MicroBatcher, ModelThread
    from vla.serving.modes import synthetic_observations

    model_thread = ModelThread()
    policy = model_thread.call(_policy)
    loaded_on = model_thread.call(threading.get_ident)
    assert loaded_on != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        model_thread.call(lambda: 1 / 0)
    ran_on: list[int] = []

    def infer_batch(obs: Any, seeds: Any) -> Any:
        ran_on.append(threading.get_ident())
        return policy.infer_batch(obs, seeds=seeds)

    batcher = MicroBatcher(infer_batch, max_batch=2, window_s=0.0, model_thread=model_thread)
    with pytest.raises(RuntimeError, match="micro-batcher's loop until it is closed"):
        model_thread.call(threading.get_ident)  # the loop holds the thread: a call would wait forever
    (obs,) = synthetic_observations(policy, 1)
    result = asyncio.run(batcher.submit(obs, 0))
    batcher.close(timeout=30)
    assert ran_on == [loaded_on] and result.chunk.actions.shape[0] > 0
    assert model_thread.call(threading.get_ident) == loaded_on  # free again once the batcher is closed
    model_thread.close()
    model_thread._thread.join(timeout=30)
    assert not model_thread._thread.is_alive()


def test_a_dead_batcher_loop_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """If the batcher's loop itself fails (not a request: those get their error), every later request would wait
    forever; the failure is logged as an error instead of vanishing into a future nobody reads."""
    import logging

    from vla.serving.batching import MicroBatcher

    def broken() -> bool:
        raise RuntimeError("expect_more broke")

    batcher = MicroBatcher(lambda obs, seeds: [], max_batch=2, window_s=1.0, expect_more=broken)
    with caplog.at_level(logging.ERROR, logger="vla.serving.batching"):
        batcher._queue.put(object())  # any job makes the loop ask expect_more()
        batcher.close(timeout=30)
        batcher.model_thread._thread.join(timeout=30)  # the done-callback runs on that thread, before it ends
    assert not batcher.model_thread._thread.is_alive()  # the batcher made that thread, and closing it ends it
    assert "loop died" in caplog.text and "expect_more broke" in caplog.text


def test_micro_batcher_batches_concurrent_requests_and_isolates_a_failing_one() -> None:
    from vla.policy import ActionSafetyError
    from vla.serving.batching import MicroBatcher
    from vla.serving.modes import synthetic_observations

    policy = _policy()
    observations = synthetic_observations(policy, 4)  # panda, widowx, panda, widowx
    alone = [policy.infer(o, seed=i).actions for i, o in enumerate(observations)]
    calls: list[int] = []

    def infer_batch(obs: Any, seeds: Any) -> Any:
        calls.append(len(obs))
        return policy.infer_batch(obs, seeds=seeds)

    batcher = MicroBatcher(infer_batch, max_batch=8, window_s=0.5)

    async def submit_all() -> list[Any]:
        jobs = [batcher.submit(o, i) for i, o in enumerate(observations)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    results = asyncio.run(submit_all())
    assert calls == [4] and all(r.batch_size == 4 for r in results)
    # When no other client can send (expect_more() is False), a lone request does not wait out the window.
    lone = MicroBatcher(infer_batch, max_batch=8, window_s=120.0, expect_more=lambda: False)
    start = time.perf_counter()
    one = asyncio.run(lone.submit(observations[0], 0))
    lone.close(timeout=30)
    assert time.perf_counter() - start < 60 and one.batch_size == 1
    np.testing.assert_allclose(one.chunk.actions, alone[0], atol=1e-5)
    for r, want in zip(results, alone):
        np.testing.assert_allclose(r.chunk.actions, want, atol=1e-5)
    # widowx's decoder rows produce NaN: its requests fail alone, panda's are still answered.
    slot = policy.model.embodiment_ids["widowx_bridge"]
    with torch.no_grad():
        policy.model.heads.action_out.weight[slot].fill_(float("nan"))
    results = asyncio.run(submit_all())
    batcher.close(timeout=30)
    for i, r in enumerate(results):
        if observations[i].embodiment == "widowx_bridge":
            assert isinstance(r, ActionSafetyError) and "non-finite" in str(r)
        else:
            np.testing.assert_allclose(r.chunk.actions, alone[i], atol=1e-5)
    # The server's infer_batch returns a sample's error in its place: the same answers from one pass, no re-runs.
    calls.clear()
    per_sample = MicroBatcher(
        lambda obs, seeds: (
            calls.append(len(obs)) or policy.infer_batch(obs, seeds=seeds, return_exceptions=True)
        ),
        max_batch=8,
        window_s=0.5,
    )

    async def submit_per_sample() -> list[Any]:
        jobs = [per_sample.submit(o, i) for i, o in enumerate(observations)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    again = asyncio.run(submit_per_sample())
    per_sample.close(timeout=30)
    assert calls == [4]
    for r, before in zip(again, results):
        if isinstance(before, ActionSafetyError):
            assert isinstance(r, ActionSafetyError) and str(r) == str(before)
        else:
            np.testing.assert_allclose(r.chunk.actions, before.chunk.actions, atol=1e-5)


def test_adaptive_batch_window_is_a_tenth_of_the_measured_forward_pass() -> None:
    """``--batch-window-ms auto``: the window follows a moving average of the batches' forward time (seeded by the
    warm-up measurement), a tenth of it, at most 50 ms; a request arriving inside it joins the batch; the window
    is exported as a metric."""
    from vla.serving.batching import AUTO_WINDOW_MAX_S, MicroBatcher
    from vla.serving.metrics import ServerMetrics

    pass_s = 0.2
    sizes: list[int] = []

    def infer_batch(obs: Any, seeds: Any) -> Any:
        sizes.append(len(obs))
        time.sleep(pass_s)
        return [f"chunk {o}" for o in obs]

    metrics = ServerMetrics(8)
    batcher = MicroBatcher(infer_batch, max_batch=8, window_s=None, forward_s=0.3, metrics=metrics)
    assert batcher.adaptive and batcher.window_s == pytest.approx(0.03)
    batcher.forward_s = 0.6  # a tenth would be 60 ms: capped at 50
    fixed = MicroBatcher(infer_batch, max_batch=8, window_s=0.002, forward_s=0.3)
    assert not fixed.adaptive and fixed.window_s == 0.002
    fixed.close(timeout=5)

    async def two_requests(gap_s: float) -> list[Any]:
        first = asyncio.ensure_future(batcher.submit("a", 0))  # type: ignore[arg-type]
        await asyncio.sleep(gap_s)
        second = asyncio.ensure_future(batcher.submit("b", 1))  # type: ignore[arg-type]
        return await asyncio.gather(first, second, return_exceptions=True)

    assert batcher.window_s == AUTO_WINDOW_MAX_S
    # 5 ms apart: inside the 50 ms window, so one batch of two
    results = asyncio.run(two_requests(0.005))
    assert [r.chunk for r in results] == ["chunk a", "chunk b"] and sizes == [2]
    forward = batcher.forward_s
    assert forward is not None and pass_s <= forward < 0.6  # 0.2 * measured + 0.8 * 0.6
    assert batcher.window_s == pytest.approx(min(AUTO_WINDOW_MAX_S, 0.1 * forward))
    assert f"vla_serve_batch_window_seconds {batcher.window_s}" in metrics.render().decode()
    batcher.close(timeout=5)
    with pytest.raises(ValueError, match="'auto'"):
        MicroBatcher(infer_batch, max_batch=8, window_s=-1.0)


def test_batch_window_flag_takes_milliseconds_or_auto() -> None:
    import argparse

    from vla.serving.serve import _window_ms

    assert _window_ms("auto") is None and _window_ms(" AUTO ") is None and _window_ms("20") == 20.0
    for bad in ("-1", "nan", "inf", "5000", "fast"):
        with pytest.raises(argparse.ArgumentTypeError, match="auto"):
            _window_ms(bad)


def test_select_mode_times_candidates_and_keeps_an_accurate_one() -> None:
    from vla.serving.modes import REFERENCE, Mode, candidates, select_mode

    native = 0.4  # a bf16 matmul 0.4x the time of fp32 (AMX / AVX-512 BF16)
    open_ = lambda d, c: Mode(d, c, None)  # noqa: E731 - the attention kernel left to select_mode
    assert candidates(None, None, "cpu", bf16_slowdown=native) == [
        open_("float32", False), open_("float32", True), open_("bfloat16", False), open_("bfloat16", True)]  # fmt: skip
    assert candidates("bfloat16", False, "cpu", bf16_slowdown=native, attention="explicit") == [
        Mode("bfloat16", False, "explicit")
    ]
    # a CPU that emulates bf16 (80x measured on an AVX2-only EPYC): bf16 is not tried unless asked for
    assert candidates(None, None, "cpu", bf16_slowdown=80.0, attention="sdpa") == [
        Mode("float32", False),
        Mode("float32", True),
    ]
    assert candidates(None, False, "cpu", bf16_slowdown=80.0) == [open_("float32", False)]
    assert candidates("bfloat16", None, "cpu", bf16_slowdown=80.0) == [
        open_("bfloat16", False),
        open_("bfloat16", True),
    ]
    assert candidates(None, None, "cuda", bf16_slowdown=80.0)[2:] == [
        open_("bfloat16", False),
        open_("bfloat16", True),
    ]
    with pytest.raises(ValueError, match="attention must be one of"):
        candidates(None, None, "cpu", bf16_slowdown=native, attention="flash")
    policy = _policy()
    mode, trials = select_mode(policy, [REFERENCE, Mode("bfloat16", False)], [1, 2], repeats=1)
    by_mode = {t.mode: t for t in trials}
    assert by_mode[REFERENCE].rel_error == 0.0 and by_mode[REFERENCE].accepted
    assert set(by_mode[REFERENCE].seconds_per_chunk) == {1, 2}
    assert by_mode[mode].accepted
    fastest = min((t for t in trials if t.accepted), key=lambda t: sum(t.seconds_per_chunk.values()))
    assert mode == fastest.mode
    want = torch.bfloat16 if mode.dtype == "bfloat16" else torch.float32
    assert policy.model.embodiment_tokens.weight.dtype == want  # left prepared in the chosen mode
    assert policy.model.inference_attention == mode.attention == "sdpa"


def test_an_open_attention_kernel_is_timed_eager_and_compiled_modes_take_the_eager_winner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Attention left open: both kernels are timed in eager modes; a compiled mode takes its dtype's eager winner
    (no second compile), or is timed with both where no eager trial of its dtype ran. Compiling is replaced by an
    eager run here (the selection logic is under test, not Inductor)."""
    from dataclasses import replace

    from vla.serving import modes
    from vla.serving.modes import Mode, select_mode

    real = modes._prepare
    prepared: list[Mode] = []
    monkeypatch.setattr(
        modes, "_prepare", lambda p, m: prepared.append(m) or real(p, replace(m, compile=False))
    )
    policy = _policy()
    _, trials = select_mode(
        policy, [Mode("float32", False, None), Mode("float32", True, None)], [1], repeats=1
    )
    eager = min(trials[:2], key=lambda t: t.seconds_per_chunk[1])
    assert [t.mode for t in trials] == [
        Mode("float32", False, "sdpa"), Mode("float32", False, "explicit"), Mode("float32", True, eager.mode.attention)
    ]  # fmt: skip
    assert all(t.accepted and t.rel_error < 1e-5 for t in trials), trials
    _, trials = select_mode(policy, [Mode("float32", True, None)], [1], repeats=1)
    assert [t.mode for t in trials] == [Mode("float32", True, "sdpa"), Mode("float32", True, "explicit")]
    prepared.clear()
    mode, trials = select_mode(
        policy, [Mode("float32", True, "explicit")], [1]
    )  # all set: prepared, not timed
    assert trials == [] and prepared == [mode] == [Mode("float32", True, "explicit")]


def test_eager_attention_kernels_are_timed_interleaved_call_by_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager mode's two kernels are timed alternating call by call (ABBA after a warm-up of each), not one
    after the other, so drift of a shared machine cannot decide between them; each trial reports its own kernel's
    median per chunk, and the last trial's kernel is the one left set."""
    import types

    from vla.serving import modes
    from vla.serving.modes import Mode, select_mode

    policy = _policy()
    kernels: list[str] = []
    real = policy.infer_batch

    def recording(observations: list, **kw: object) -> list:  # a pass-through spy
        kernels.append(policy.model.inference_attention)
        return real(observations, **kw)

    monkeypatch.setattr(policy, "infer_batch", recording)
    now, cost = [0.0], {"sdpa": 3.0, "explicit": 1.0}

    def clock() -> float:
        # each reading advances by the running kernel's cost: a timed call takes that many seconds
        now[0] += cost[policy.model.inference_attention]
        return now[0]

    monkeypatch.setattr(modes, "time", types.SimpleNamespace(perf_counter=clock))
    _, trials = select_mode(policy, [Mode("float32", False, None)], [1, 2], repeats=4)
    assert [t.mode for t in trials] == [Mode("float32", False, "sdpa"), Mode("float32", False, "explicit")]
    assert trials[0].seconds_per_chunk == {1: 3.0, 2: 1.5} and trials[1].seconds_per_chunk == {1: 1.0, 2: 0.5}
    abba = ["sdpa", "explicit", "explicit", "sdpa"]
    assert kernels[-20:] == (abba * 2 + abba[:2]) * 2, kernels  # per batch size: warm-up + 4 rounds
    assert policy.model.inference_attention == "explicit"  # the last trial's mode stays prepared
    # SDPA faster: the model ends prepared in SDPA's mode; 3 repeats run 4 rounds (each kernel first twice)
    cost.update(sdpa=1.0, explicit=3.0)
    kernels.clear()
    mode, trials = select_mode(policy, [Mode("float32", False, None)], [1], repeats=3)
    assert mode == Mode("float32", False, "sdpa") and policy.model.inference_attention == "sdpa"
    assert trials[0].seconds_per_chunk == {1: 1.0} and trials[1].seconds_per_chunk == {1: 3.0}
    assert kernels[-10:] == abba * 2 + abba[:2], kernels


def test_soft_capped_models_measure_the_vision_towers_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A soft-capped (Gemma2) model's language layers run the explicit form whatever the kernel (only it has the
    capping), so the kernel measured and set is its vision tower's: both are timed, as for any model."""
    from train_helpers import count_attention_kernels

    from vla.models.attention import SharedKVLayer
    from vla.serving.modes import Mode, select_mode, synthetic_observations

    policy = _policy("paligemma2")
    capped = [m for m in policy.model.modules() if isinstance(m, SharedKVLayer) and m.softcap]
    assert capped and all(m.softcap for m in policy.model.modules() if isinstance(m, SharedKVLayer))
    vision = [m for m in policy.model.backbone.vision.modules() if getattr(m, "vla_vision_attention", False)]
    calls = count_attention_kernels(monkeypatch)
    mode, trials = select_mode(policy, [Mode("float32", False, None)], [1], repeats=1)
    assert [t.mode.attention for t in trials] == ["sdpa", "explicit"] and mode in [t.mode for t in trials]
    assert trials[0].rel_error == 0.0 and trials[1].rel_error < 1e-5
    calls.update(dict.fromkeys(calls, 0))
    policy.model.set_inference_attention("sdpa")
    policy.infer_batch(synthetic_observations(policy, 1), seeds=[0])
    # per chunk: the vision tower once (every camera in one batch), in SDPA; every language layer explicit (capped)
    assert calls["sdpa"] == len(vision), calls
    assert calls["explicit"] > 0 and calls["sdpa_fp32"] == 0, calls


def test_a_mode_with_a_non_finite_warm_up_chunk_is_refused_unless_it_is_the_only_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A candidate whose warm-up chunk is non-finite (a bf16 overflow, say) is logged and left out instead of
    stopping ``vla serve`` from starting; the model ends prepared in a mode that was kept, even when the refused one
    ran last. Only when no candidate is left is the error raised."""
    import logging

    from vla.policy import ActionSafetyError
    from vla.serving.modes import Mode, select_mode

    policy = _policy()
    real = policy.infer_batch

    def nan_in_bf16(observations: list, **kw: Any) -> list:
        if policy.model.embodiment_tokens.weight.dtype == torch.bfloat16:
            raise ActionSafetyError("policy: non-finite action chunk for 'sim_panda' (dims ['x'])")
        return real(observations, **kw)

    monkeypatch.setattr(policy, "infer_batch", nan_in_bf16)
    for candidates in (
        [Mode("float32", False, "sdpa"), Mode("bfloat16", False, "sdpa")],
        [Mode("float32", False, None), Mode("bfloat16", False, None)],  # both kernels of bf16 refused
    ):
        with caplog.at_level(logging.WARNING, logger="vla.serving.modes"):
            mode, trials = select_mode(policy, candidates, [1, 2], repeats=1)
        assert mode.dtype == "float32" and {t.mode.dtype for t in trials} == {"float32"}
        assert policy.model.embodiment_tokens.weight.dtype == torch.float32  # not left in the refused mode
        assert "serving mode bfloat16 eager" in caplog.text and "refused" in caplog.text
        caplog.clear()
    with pytest.raises(ActionSafetyError, match="non-finite"):
        select_mode(policy, [Mode("bfloat16", False, None)], [1], repeats=1)


def test_compiled_warm_up_covers_every_embodiment_two_prompt_lengths_and_both_batch_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compiled graph specializes on the first prompt token count it sees and recompiles once (as dynamic) at the
    second; the kept compiled mode is warmed up at batch 1 and ``--max-batch`` with every served embodiment and two
    prompt lengths (and a mixed batch), so the first real request does not pay that recompile after ``/healthz``;
    and with one camera of several (a vision batch of 1, always specialized: a 13 s stall of every client when a
    real request first brought it, on this tiny model).
    (Measured with Inductor on this tiny model: after this warm-up, requests with new prompt lengths, batch sizes
    and embodiment mixes compiled no new graph.) Compiling is replaced by an eager run: the plan is under test."""
    from dataclasses import replace

    from vla.serving import modes
    from vla.serving.modes import Mode, select_mode

    real_prepare = modes._prepare
    monkeypatch.setattr(modes, "_prepare", lambda p, m: real_prepare(p, replace(m, compile=False)))
    policy = _policy()
    real = policy.infer_batch
    calls: list[tuple[int, frozenset[str], frozenset[str]]] = []
    images: list[tuple[int, str, int]] = []  # (batch size, embodiment, images in the batch)

    def recording(observations: list, **kw: Any) -> list:
        calls.append(
            (
                len(observations),
                frozenset(o.embodiment for o in observations),
                frozenset(o.prompt for o in observations),
            )
        )
        images.append(
            (len(observations), observations[0].embodiment, sum(len(o.images) for o in observations))
        )
        return real(observations, **kw)

    monkeypatch.setattr(policy, "infer_batch", recording)
    for candidate in (Mode("float32", True, "sdpa"), Mode("float32", True, None)):  # warmed only / timed
        calls.clear()
        images.clear()
        mode, _ = select_mode(policy, [candidate], [1, 4], repeats=1)
        assert mode.compile
        for batch in (1, 4):
            for embodiment in SERVED:
                prompts = {p for b, e, ps in calls if b == batch and e == {embodiment} for p in ps}
                tokens = {
                    policy.model.backbone.tokenize([p], torch.device("cpu"))[0].shape[1] for p in prompts
                }
                assert len(tokens) >= 2, (batch, embodiment, prompts)  # two prompt token counts
        assert any(b == 4 and len(e) == 2 and len(ps) == 2 for b, e, ps in calls)  # a mixed batch
        # a request with one of several cameras is a vision batch of 1 (always specialized): warmed up too
        multi = [e for e in SERVED if len(policy.spec(e).cameras) > 1]
        assert multi and all((1, e, 1) in images for e in multi), images


def test_every_trial_starts_from_the_weights_as_loaded() -> None:
    """prepare_inference casts in place: a float32 trial after a bf16 one must run (and keep) the weights as loaded,
    not bf16-rounded ones; parameters and every floating buffer (non-persistent ones too) come back bitwise."""
    from vla.serving.modes import Mode, _LoadedWeights, select_mode

    policy = _policy()
    model = policy.model
    before = {n: t.clone() for n, t in (*model.named_parameters(), *model.named_buffers())}
    assert any(n.endswith("pixel_mean") for n in before)  # a non-persistent buffer is among them
    loaded = _LoadedWeights(model)
    loaded.prepare(policy, Mode("bfloat16", False))
    assert model.embodiment_tokens.weight.dtype == torch.bfloat16
    loaded.prepare(policy, Mode("float32", False))
    after = dict((*model.named_parameters(), *model.named_buffers()))
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
    _, trials = select_mode(
        policy, [Mode("bfloat16", False, "sdpa"), Mode("float32", False, "explicit")], [1], repeats=1
    )
    fp32 = next(t for t in trials if t.mode.dtype == "float32")
    assert fp32.rel_error < 1e-5, fp32  # 1e-3 when it ran bf16-rounded weights


def test_connection_limit_refuses_the_extra_client_with_a_message_and_frees_its_slot() -> None:
    """`--max-connections`: a handshake past the limit gets HTTP 503 naming the limit and the flag, before any model
    work; the connected client keeps its connection, and a slot freed by a client leaving is usable again."""
    from starlette.testclient import TestClient, WebSocketDenialResponse

    from vla.serving.server import ServeOptions, ServingApp

    serving = ServingApp(_policy(), ServeOptions(max_connections=1))
    with TestClient(serving.app) as client:
        with client.websocket_connect("/") as first:
            assert first.receive_bytes()  # the metadata frame
            with pytest.raises(WebSocketDenialResponse) as refused, client.websocket_connect("/"):
                pass
            assert refused.value.status_code == 503
            assert "too many connections (limit 1, --max-connections" in refused.value.text
            assert serving.connections == 1
        with client.websocket_connect("/") as again:
            assert again.receive_bytes()
    assert 'vla_serve_errors_total{kind="limit"} 1.0' in serving.metrics.render().decode()
    serving.batcher.close(timeout=30)
