"""``vla serve`` end to end: a real server subprocess, openpi's own client from PyPI, our client and broker, REST.

One tiny two-embodiment checkpoint (``sim_panda`` + ``widowx_bridge``, stats written here) is served once per
module with an API key, a 1 MiB frame limit and 2 flow steps; actions are checked against the same checkpoint
run in process through ``Policy`` with the same seeds (the server adds nothing to the numbers). The last test
stops the server with SIGTERM while a request is in flight.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import websockets.sync.client
from websockets.exceptions import ConnectionClosed, InvalidStatus

from vla.cli import main
from vla.policy import Policy
from vla.serving.client import ActionChunkBroker, ServerError, WebsocketClient
from vla.serving.json_numpy import encode_json_numpy
from vla.serving.protocol import pack, unpack

API_KEY = "test-key-0123456789abcdef"
AUTH = {"Authorization": f"Api-Key {API_KEY}"}
NUM_STEPS = 2
TOL = 1e-4


def _stats(spec: Any, field: str, rng: np.random.Generator) -> Any:
    """Stats of data spread over the spec's limits (±1 where unbounded)."""
    from vla.data.norm_stats import NormStats

    lo, hi = spec.limits(field)
    x = rng.uniform(np.where(np.isfinite(lo), lo, -1.0), np.where(np.isfinite(hi), hi, 1.0), (200, len(lo)))
    return NormStats(mean=x.mean(0), std=x.std(0), min=x.min(0), max=x.max(0),
                     q01=np.quantile(x, 0.01, 0), q99=np.quantile(x, 0.99, 0), count=len(x))  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random ``sim_panda`` + ``widowx_bridge`` checkpoint with stats for both."""
    from vla.data.norm_stats import StatsFile
    from vla.models.hub import save_pretrained
    from vla.models.testing import tiny_model

    model = tiny_model(embodiments=("sim_panda", "widowx_bridge"), seed=0)
    rng = np.random.default_rng(0)
    model.norm_stats = StatsFile(
        stats={
            n: {f: _stats(model.spec(n), f, rng) for f in ("state", "action")} for n in model.embodiment_ids
        }
    )
    return Path(save_pretrained(model, tmp_path_factory.mktemp("serve") / "tiny"))


@pytest.fixture(scope="module")
def policy(checkpoint: Path) -> Policy:
    return Policy.from_checkpoint(checkpoint, num_steps=NUM_STEPS)


class Server:
    """A ``vla serve`` subprocess on a free port."""

    def __init__(self, proc: subprocess.Popen[str], url: str, ready_line: str, log: Path) -> None:
        self.proc, self.url, self.ready_line, self.log = proc, url, ready_line, log
        self.http = url.replace("ws://", "http://")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("server")
    key_file = tmp / "key.txt"
    key_file.write_text(API_KEY + "\n")
    log = tmp / "stderr.txt"
    cmd = [sys.executable, "-m", "vla.cli", "serve", str(checkpoint), "--port", "0", "--api-key-file", str(key_file),
           "--dtype", "float32", "--no-compile", "--num-steps", str(NUM_STEPS), "--max-frame-mb", "1",
           # the attention kernel left open: the server measures both, so every client below (openpi's included)
           # reads a metadata frame that carries trials
           "--max-batch", "8", "--batch-window-ms", "5"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    line = _read_ready(proc, log)
    url = line.split("ready at ")[1].split()[0]
    yield Server(proc, url, line, log)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _read_ready(proc: subprocess.Popen[str], log: Path, timeout: float = 300) -> str:
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not lines or "ready at" not in lines[0]:
        proc.kill()
        raise AssertionError(
            f"vla serve did not get ready; stdout {lines}, stderr:\n{log.read_text()[-3000:]}"
        )
    return lines[0]


def _free_port() -> int:
    """A port free now (the OS picks it), for a server that must be given its port before it listens."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def observation(i: int, embodiment: str = "sim_panda", size: int = 48) -> dict[str, Any]:
    """Request ``i`` in the canonical layout: seeded pixels, a state inside the spec's limits, a prompt."""
    from vla.embodiments import get_embodiment

    spec = get_embodiment(embodiment)
    rng = np.random.default_rng(i)
    lo, hi = spec.limits("state")
    state = np.where(np.isfinite(lo) & np.isfinite(hi), (np.nan_to_num(lo) + np.nan_to_num(hi)) / 2, 0.0)
    return {
        "images": {s: rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for s in spec.cameras},
        "state": (state + rng.normal(0, 0.01, spec.state_dim)).astype(np.float32),
        "prompt": f"task {i}: pick up the red cube",
        "embodiment": embodiment,
    }


def reference(policy: Policy, request: dict[str, Any], seed: int) -> np.ndarray:
    from vla.types import Observation

    obs = Observation(dict(request["images"]), request["state"], request["prompt"], request["embodiment"])
    return policy.infer(obs, seed=seed).actions


# ---- the contract --------------------------------------------------------------------------------------------------
def test_ready_line_healthz_and_metadata(server: Server, policy: Policy, checkpoint: Path) -> None:
    assert "embodiments sim_panda, widowx_bridge" in server.ready_line and "protocol 1" in server.ready_line
    assert server.url.startswith("ws://127.0.0.1:")  # binds loopback unless told otherwise
    with urllib.request.urlopen(server.http + "/healthz") as r:
        assert r.status == 200 and r.read() == b"OK"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server.http + "/metadata")
    assert e.value.code == 401
    meta = _get_json(server.http + "/metadata")
    assert meta["protocol_version"] == 1 and set(meta["embodiments"]) == {"sim_panda", "widowx_bridge"}
    # the model's name, not the server's file layout
    assert meta["model"] == "tiny" and str(checkpoint.parent) not in json.dumps(meta), meta["model"]
    assert (
        meta["max_frame_bytes"] == 2**20
        and meta["max_prompt_chars"] == 2000
        and meta["max_image_side"] == 4096
    )
    panda = meta["embodiments"]["sim_panda"]
    assert panda["chunk_length"] == policy.chunk_length("sim_panda") and panda["control_hz"] == 10.0
    assert panda["cameras"] == ["primary", "wrist"] and len(panda["action_names"]) == 8
    assert "observation/image" in panda["observation_keys"]["libero"]
    # the mode: dtype and compile as asked, the attention kernel measured (both timed eager), named everywhere
    mode = meta["serving_mode"]
    assert (
        mode["dtype"] == "float32" and mode["compile"] is False and mode["attention"] in ("sdpa", "explicit")
    )
    assert (
        mode["mode"] == f"float32 eager {mode['attention']}" and f"| mode {mode['mode']}" in server.ready_line
    )
    trials = {t["mode"]: t for t in mode["trials"]}
    assert set(trials) == {"float32 eager sdpa", "float32 eager explicit"}, trials
    for t in trials.values():  # same dtype as the reference: the kernels differ by float32 rounding only
        assert t["accepted"] and t["rel_error"] < 1e-5 and set(t["ms_per_chunk"]) == {"1", "8"}, t


def test_openpi_client_gets_the_policys_actions(server: Server, policy: Policy) -> None:
    """openpi's own ``WebsocketClientPolicy`` (PyPI) in its LIBERO, DROID and ALOHA layouts."""
    websocket_client_policy = pytest.importorskip(
        "openpi_client.websocket_client_policy",
        reason="openpi-client not installed: `make install` adds it (pip install --no-deps openpi-client)",
    )
    client = websocket_client_policy.WebsocketClientPolicy(server.url, api_key=API_KEY)
    meta = client.get_server_metadata()  # unpacked with strict_map_key: every map key must be a string
    assert meta["protocol_version"] == 1 and "sim_panda" in meta["embodiments"]
    assert len(meta["serving_mode"]["trials"]) == 2
    canonical = observation(1)
    primary, wrist, state = canonical["images"]["primary"], canonical["images"]["wrist"], canonical["state"]
    layouts = {
        "libero": {"observation/image": primary, "observation/wrist_image": wrist, "observation/state": state},
        "droid": {"observation/exterior_image_1_left": primary, "observation/wrist_image_left": wrist,
                  "observation/joint_position": state[:7].astype(np.float64),
                  "observation/gripper_position": state[7:].astype(np.float64)},
        "aloha": {"images": {"cam_high": np.ascontiguousarray(primary.transpose(2, 0, 1))}, "state": state},
    }  # fmt: skip
    expected = reference(policy, canonical, seed=7)
    expected_primary_only = reference(policy, {**canonical, "images": {"primary": primary}}, seed=7)
    for i, (name, keys) in enumerate(layouts.items()):
        out = client.infer(
            {**keys, "prompt": canonical["prompt"].encode(), "embodiment": "sim_panda", "seed": 7}
        )
        want = expected_primary_only if name == "aloha" else expected
        assert out["actions"].dtype == np.float32 and out["actions"].shape == want.shape, name
        np.testing.assert_allclose(out["actions"], want, atol=TOL, err_msg=name)
        assert out["server_timing"]["infer_ms"] > 0 and ("prev_total_ms" in out["server_timing"]) == (i > 0)
        assert isinstance(out["safety"]["clamped"], list) and len(out["safety"]["clamped"]) == 8
    assert not np.allclose(
        expected, expected_primary_only
    )  # the wrist camera mattered: the mapping is checked


def _bad_requests() -> dict[str, Any]:
    good = observation(2)
    raw = {"__ndarray__": True, "data": b"\0" * 8, "shape": [1]}
    wrong_shape = {**good, "state": good["state"][:3]}
    float_image = {**good, "images": {"primary": good["images"]["primary"].astype(np.float32)}}
    return {
        "text frame": "hello",
        "malformed msgpack": b"\xc1\xc1\xc1",
        "pickle dtype |O": msgpack.packb({**good, "state": {**{k.encode(): v for k, v in raw.items()}, b"dtype": "|O"}},
                                         default=lambda o: o.tolist() if isinstance(o, np.ndarray) else o),
        "void dtype V8": msgpack.packb({"state": {**{k.encode(): v for k, v in raw.items()}, b"dtype": "|V8"}}),
        "wrong keys": pack({"joint_state": good["state"], "prompt": "x", "embodiment": "sim_panda"}),
        "wrong shape": pack(wrong_shape),
        "wrong dtype": pack(float_image),
        "nan state": pack({**good, "state": np.full(8, np.nan, np.float32)}),
        "string state": pack({**good, "state": ["a", 1]}),
        "ragged state": pack({**good, "state": [[1.0, 2.0], [3.0]]}),
        "droid gripper [1, 1]": pack({"observation/exterior_image_1_left": good["images"]["primary"],
                                      "observation/joint_position": np.zeros(7),
                                      "observation/gripper_position": np.zeros((1, 1)), "prompt": "x",
                                      "embodiment": "sim_panda"}),
        "unknown embodiment": pack({**good, "embodiment": "r2d2"}),
        "oversize frame": pack({**good, "images": {"primary": np.zeros((640, 640, 3), np.uint8)}}),
    }  # fmt: skip


EXPECTED_ERRORS = {
    "text frame": "text frames are not accepted",
    "malformed msgpack": "malformed msgpack",
    "pickle dtype |O": "'|O' is not allowed",
    "void dtype V8": "'|V8' is not allowed",
    "wrong keys": "unexpected key(s) ['joint_state']",
    "wrong shape": "state in observation for 'sim_panda': expected [8]",
    "wrong dtype": "expected dtype uint8",
    "nan state": "non-finite value(s)",
    "string state": "'state' must be a flat list of numbers",
    "ragged state": "'state' must be a flat list of numbers",
    "droid gripper [1, 1]": "'observation/gripper_position' must be a 1-D float array",
    "unknown embodiment": "unknown embodiment 'r2d2'",
    "oversize frame": "exceeds the limit of 1048576 bytes",
}


def test_openpi_action_chunk_broker_steps_through_a_served_chunk(server: Server, policy: Policy) -> None:
    """openpi's own ``ActionChunkBroker`` indexes every numpy array of a response by the step, so no field but
    ``actions`` may be an array: ``safety.clamped`` is a list. (As an int array ``[A]`` it broke the broker at step A
    of a chunk longer than A, e.g. openpi's usual H = 50, A = 7.)"""
    chunk_broker = pytest.importorskip(
        "openpi_client.action_chunk_broker",
        reason="openpi-client (and dm-tree, which its broker imports) not installed: `make install` adds them",
    )
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    request = {**observation(5), "seed": 3}
    want = reference(policy, request, seed=3)
    horizon, width = want.shape
    response = WebsocketClientPolicy(server.url, api_key=API_KEY).infer(request)
    arrays = [k for k, v in _leaves(response) if isinstance(v, np.ndarray)]
    assert arrays == ["actions"], arrays  # what the broker slices per step
    broker = chunk_broker.ActionChunkBroker(WebsocketClientPolicy(server.url, api_key=API_KEY), horizon)
    for step in range(horizon):
        out = broker.infer(request)
        np.testing.assert_allclose(out["actions"], want[step], atol=TOL)
        assert len(out["safety"]["clamped"]) == width and out["server_timing"]["infer_ms"] > 0


def _leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every non-dict value of nested dicts."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    else:
        yield path, tree


def test_every_malformed_request_gets_its_error_while_others_are_served(
    server: Server, policy: Policy
) -> None:
    good = observation(3)
    answers, failures, stop = [], [], threading.Event()

    def well_behaved() -> None:
        with WebsocketClient(server.url, api_key=API_KEY) as client:
            while not stop.is_set():
                try:
                    answers.append(client.infer({**good, "seed": 1})["actions"])
                except Exception as e:  # counted: there must be none
                    failures.append(e)

    thread = threading.Thread(target=well_behaved)
    thread.start()
    try:
        for name, frame in _bad_requests().items():
            with websockets.sync.client.connect(server.url, additional_headers=AUTH, compression=None) as ws:
                unpack(ws.recv(timeout=30))  # metadata
                ws.send(frame)
                reply = ws.recv(timeout=60)
                assert isinstance(reply, str) and EXPECTED_ERRORS[name] in reply, (name, reply)
                assert "Traceback" not in reply and len(reply) < 600
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=30)
                assert closed.value.rcvd.code == 1011, name
        # A client that never reads and one that leaves with its request in flight block no one.
        with websockets.sync.client.connect(server.url, additional_headers=AUTH, compression=None) as silent:
            silent.send(pack({**good, "seed": 2}))
            with websockets.sync.client.connect(
                server.url, additional_headers=AUTH, compression=None
            ) as gone:
                gone.send(pack({**good, "seed": 3}))
            before = len(answers)
            deadline = time.monotonic() + 120
            while len(answers) < before + 2 and time.monotonic() < deadline and not failures:
                time.sleep(0.01)
            assert len(answers) >= before + 2, (
                "the well-behaved client stalled behind a silent or departed one"
            )
        for headers in (None, {"Authorization": "Api-Key wrong-key-0123456789"}, {"Authorization": API_KEY}):
            with pytest.raises(InvalidStatus) as refused:
                websockets.sync.client.connect(server.url, additional_headers=headers)
            assert refused.value.response.status_code == 401
        with WebsocketClient(server.url, api_key=API_KEY) as ours, pytest.raises(ServerError, match="r2d2"):
            ours.infer({**good, "embodiment": "r2d2"})
    finally:
        stop.set()
        thread.join(60)
    assert not failures and len(answers) >= 1
    want = reference(policy, good, seed=1)
    for a in answers:
        np.testing.assert_allclose(a, want, atol=TOL)
    errors = _metrics(server)
    assert errors['vla_serve_errors_total{kind="auth"}'] >= 3
    assert errors['vla_serve_errors_total{kind="protocol"}'] >= 4
    assert errors['vla_serve_errors_total{kind="limit"}'] >= 1


def test_eight_clients_fifty_requests_batched_equals_one_by_one(server: Server, policy: Policy) -> None:
    """8 concurrent clients x 50 requests, mixed embodiments: zero failures, and every chunk equals the one-by-one
    chunk of the same seed although the server ran them in batches."""
    requests = [observation(10 + c, "sim_panda" if c % 2 else "widowx_bridge", size=32) for c in range(8)]
    seeds = 3
    want = {(c, s): reference(policy, requests[c], seed=s) for c in range(8) for s in range(seeds)}
    results: dict[int, list[tuple[int, dict[str, Any]]]] = {c: [] for c in range(8)}
    failures: list[BaseException] = []
    barrier = threading.Barrier(8)

    def run(c: int) -> None:
        try:
            with WebsocketClient(server.url, api_key=API_KEY, timeout=120) as client:
                barrier.wait(timeout=120)
                for r in range(50):
                    results[c].append((r % seeds, client.infer({**requests[c], "seed": r % seeds})))
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not failures, failures[:3]
    assert all(len(results[c]) == 50 for c in range(8))
    batch_sizes = [out["server_timing"]["batch_size"] for c in range(8) for _, out in results[c]]
    assert max(batch_sizes) > 1, "no request was micro-batched"
    for c in range(8):
        for seed, out in results[c]:
            np.testing.assert_allclose(out["actions"], want[(c, seed)], atol=TOL)


def test_rest_act_json_numpy_and_lists(server: Server, policy: Policy) -> None:
    req = observation(4, "widowx_bridge", size=16)
    want = reference(policy, req, seed=5)
    as_numpy = json.dumps({**req, "seed": 5}, default=encode_json_numpy)
    as_lists = json.dumps({**req, "images": {k: v.tolist() for k, v in req["images"].items()},
                           "state": req["state"].tolist(), "seed": 5})  # fmt: skip
    for body in (as_numpy, as_lists):
        out = _post(server.http + "/act", body)
        np.testing.assert_allclose(np.asarray(out["actions"]), want, atol=TOL)
        assert out["embodiment"] == "widowx_bridge" and len(out["safety"]["clamped"]) == want.shape[1]
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(server.http + "/act", as_numpy, headers={})
    # JSON like /act's other errors
    assert e.value.code == 401 and json.loads(e.value.read())["kind"] == "auth"
    for content_type in ("text/plain", "application/x-www-form-urlencoded", ""):
        # what a web page may send to 127.0.0.1 without a CORS preflight (or curl -d without -H): refused unread
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(server.http + "/act", as_numpy, headers={**AUTH, "Content-Type": content_type})
        assert e.value.code == 415 and "Content-Type: application/json" in json.loads(e.value.read())["error"]
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(
            server.http + "/act", json.dumps({**req, "state": [float("nan")] * 7}, default=encode_json_numpy)
        )
    assert e.value.code == 400 and "non-finite" in json.loads(e.value.read())["error"]
    with pytest.raises(urllib.error.HTTPError) as e:  # a client error, not an internal 500
        _post(server.http + "/act", json.dumps({**req, "state": ["a", 1]}, default=encode_json_numpy))
    assert e.value.code == 400 and "'state' must be a flat list" in json.loads(e.value.read())["error"]
    # an integer past float64's range, one past Python's digit limit, arrays nested too deep: client errors too
    body = as_lists.replace(f'"state": {json.dumps(req["state"].tolist())}', '"state": [' + "9" * 400 + "]")
    assert body != as_lists
    for bad, message in (
        (body, "'state' must be a flat list"),
        (as_lists.replace('"seed": 5', '"seed": ' + "9" * 5000), "malformed JSON body"),
        (as_lists.replace('"seed": 5', '"seed": ' + "[" * 100_000 + "]" * 100_000), "malformed JSON body"),
    ):
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(server.http + "/act", bad)
        assert e.value.code == 400 and message in json.loads(e.value.read())["error"], message
    assert _metrics(server)['vla_serve_requests_total{embodiment="widowx_bridge",transport="rest"}'] >= 2


def test_async_client_concurrent_requests(server: Server, policy: Policy) -> None:
    import asyncio

    from vla.serving.client import AsyncWebsocketClient

    reqs = [{**observation(20 + i), "seed": i} for i in range(3)]

    async def run() -> list[dict[str, Any]]:
        async with (
            AsyncWebsocketClient(server.url, api_key=API_KEY) as a,
            AsyncWebsocketClient(server.url, api_key=API_KEY) as b,
        ):
            assert a.metadata["protocol_version"] == 1
            both = await asyncio.gather(a.infer(reqs[0]), b.infer(reqs[1]))
            # concurrent calls on one client take turns (before: the second recv() failed and dropped the first)
            shared = await asyncio.gather(*(a.infer(r) for r in reqs))
            return [*both, await a.infer(reqs[2]), *shared]

    async def refused() -> None:
        async with AsyncWebsocketClient(server.url, api_key="wrong-key-0123456789", connect_timeout=5):
            pass

    outs = asyncio.run(run())
    assert len(outs) == 6
    for out, req in zip(outs, [*reqs, *reqs]):
        np.testing.assert_allclose(out["actions"], reference(policy, req, seed=req["seed"]), atol=TOL)
    with pytest.raises(InvalidStatus):
        asyncio.run(refused())


def test_sync_client_shared_by_threads_takes_turns(server: Server, policy: Policy) -> None:
    """Threads calling one ``WebsocketClient`` at once each get their own chunk (before: two threads in one
    connection's recv() at a time raised, or read each other's answers)."""
    reqs = [{**observation(30 + i), "seed": i} for i in range(4)]
    outs: dict[int, Any] = {}
    with WebsocketClient(server.url, api_key=API_KEY) as client:
        threads = [
            threading.Thread(target=lambda i=i: outs.update({i: client.infer(reqs[i])})) for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert sorted(outs) == [0, 1, 2, 3]
    for i, req in enumerate(reqs):
        np.testing.assert_allclose(outs[i]["actions"], reference(policy, req, seed=i), atol=TOL)


def test_served_sim_episode_through_client_and_broker(server: Server) -> None:
    import vla.sim

    env = vla.sim.make("sim_panda", "reach", seed=0, image_size=48, max_steps=16)
    obs, info = env.reset(seed=0)
    low, high = (np.asarray(b) for b in (env.action_space.low, env.action_space.high))
    steps, done = 0, False
    with WebsocketClient(server.url, api_key=API_KEY) as client:
        broker = ActionChunkBroker(client, execute=3, prefetch=1)
        while not done:
            request = {"images": obs["images"], "state": obs["state"], "prompt": info["instruction"],
                       "embodiment": "sim_panda"}  # fmt: skip
            action = broker.act(request)
            assert (
                action.shape == env.action_space.shape
                and np.all(action >= low - 1e-6)
                and np.all(action <= high + 1e-6)
            )
            obs, _, terminated, truncated, info = env.step(action)
            steps, done = steps + 1, terminated or truncated
    assert steps == 16 or info.get("success")
    assert broker.queries >= steps // 3


def test_start_refuses_an_embodiment_without_stats(checkpoint: Path, tmp_path: Path, capsys: Any) -> None:
    bare = shutil.copytree(checkpoint, tmp_path / "bare")
    stats = json.loads((bare / "norm_stats.json").read_text())
    del stats["stats"]["widowx_bridge"]
    (bare / "norm_stats.json").write_text(json.dumps(stats))
    assert main(["serve", str(bare), "--embodiment", "widowx_bridge", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "widowx_bridge" in err and "stats" in err


def test_start_without_embodiment_names_the_ones_left_out_for_lack_of_stats(
    checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bare = shutil.copytree(checkpoint, tmp_path / "bare")
    stats = json.loads((bare / "norm_stats.json").read_text())
    del stats["stats"]["widowx_bridge"]
    (bare / "norm_stats.json").write_text(json.dumps(stats))
    with caplog.at_level("WARNING"):
        assert Policy.from_checkpoint(bare).embodiments == ["sim_panda"]
    assert "not serving ['widowx_bridge']" in caplog.text and "stats" in caplog.text


def test_a_device_this_machine_lacks_is_named_not_blamed_on_the_checkpoint(
    checkpoint: Path, capsys: Any
) -> None:
    """Before: ``--device cuda`` on a machine without CUDA, or a misspelt device, said the weights file was
    "truncated or corrupt" (a user would throw a good checkpoint away)."""
    import torch

    bad = ["foo"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in bad:
        assert main(["serve", str(checkpoint), "--port", "0", "--device", device]) == 2
        err = capsys.readouterr().err
        assert f"--device: device '{device}'" in err and "corrupt" not in err, err
    with pytest.raises(ValueError, match="not a torch device"):
        Policy.from_checkpoint(checkpoint, device="foo")


def test_a_port_in_use_is_a_one_line_error_before_the_model_loads(
    server: Server, tmp_path: Path, capsys: Any
) -> None:
    """The port is bound first: a missing checkpoint is not even looked at (before: a traceback and exit 3 once
    loading and the mode trials had run, minutes on a compiled model)."""
    port = server.url.rsplit(":", 1)[1]
    assert main(["serve", str(tmp_path / "no-such-checkpoint"), "--port", port]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}: cannot listen there" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("sig", "rc", "said"), [(signal.SIGTERM, 0, "SIGTERM"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_stop_while_warming_up_exits_at_once_and_cleanly(
    checkpoint: Path, tmp_path: Path, sig: int, rc: int, said: str
) -> None:
    """A supervisor's SIGTERM (or Ctrl-C) while the compiled modes are timed: the stop line and exit 0 (130), within
    seconds. Before: SIGTERM killed it with 143; a Ctrl-C, and a handled SIGTERM, aborted the interpreter in C++
    (exit 134) because its shutdown met the model thread inside a compile.

    Meanwhile a client is refused, as openpi's own server refuses it while loading (openpi's client retries on
    ``ConnectionRefusedError``). Before, the port listened from the start and the connection waited in the backlog;
    openpi's client abandoned it after websockets' 10 s handshake timeout with a ``TimeoutError`` it does not
    retry, so a robot started beside a server that warms up longer than that crashed."""
    err = tmp_path / "stderr.txt"
    port = _free_port()
    cmd = [sys.executable, "-m", "vla.cli", "serve", str(checkpoint), "--port", str(port), "--compile",
           "--dtype", "float32", "--num-steps", str(NUM_STEPS)]  # fmt: skip
    with open(err, "w") as f:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while "timing the serving modes" not in err.read_text():  # compiling: tens of seconds for this model
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(1)
        with pytest.raises(ConnectionRefusedError):
            websockets.sync.client.connect(f"ws://127.0.0.1:{port}", open_timeout=5).close()
        start = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(30) == rc, err.read_text()[-2000:]
        assert time.monotonic() - start < 10
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert f"vla serve: {said} before ready" in text and "terminate called" not in text, text[-2000:]
    assert proc.stdout.read() == ""  # never announced ready


def test_sigterm_finishes_the_request_in_flight_then_exits_0(server: Server) -> None:
    """Runs last: stops the module's server."""
    with WebsocketClient(server.url, api_key=API_KEY, retries=0) as client:
        for _attempt in range(20):  # until the signal lands while a request is inside the server
            got: list[dict[str, Any]] = []
            thread = threading.Thread(
                target=lambda out=got: out.append(client.infer({**observation(5), "seed": 0}))
            )
            thread.start()
            while thread.is_alive() and _metrics(server)["vla_serve_in_flight"] < 1:
                pass
            if thread.is_alive():
                server.proc.send_signal(signal.SIGTERM)
                thread.join(120)
                break
            thread.join()
        else:
            pytest.fail("never caught a request in flight")
    assert got and got[0]["actions"].shape[1] == 8, "the request in flight was not answered"
    assert server.proc.wait(120) == 0, server.log.read_text()[-2000:]


# ---- helpers ---------------------------------------------------------------------------------------------------------
def _get_json(url: str) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, headers=AUTH)) as r:
        return json.loads(r.read())


def _post(url: str, body: str, headers: dict[str, str] | None = None) -> Any:
    h = {"Content-Type": "application/json", **(AUTH if headers is None else headers)}
    with urllib.request.urlopen(
        urllib.request.Request(url, data=body.encode(), headers=h, method="POST")
    ) as r:
        return json.loads(r.read())


def _metrics(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(urllib.request.Request(server.http + "/metrics", headers=AUTH)) as r:
        text = r.read().decode()
    return {
        k: float(v)
        for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))
    }
