#!/usr/bin/env python3
"""LeRobot 0.6.1's own policy server (``lerobot.async_inference.policy_server``, gRPC) at the peer's SmolVLA config,
timed the way ``benchmarks/serve.py`` times ``vla serve``: per-request latency from a client next to the same
computation timed in process, so the difference is the server's protocol overhead.

Runs in the peer venv (``../shared/peer``; the async extras ``grpcio`` and ``protobuf`` must be installed there —
``benchmarks/serve.py`` says how when they are missing) and prints ``RESULT <json>`` like the peer's children:

    $PEER_VENV/bin/python benchmarks/peer_lerobot_grpc.py PEER_DIR '{"requests": 12, "warmup": 2, "threads": 2}'

What it does, with LeRobot's code only:

1. builds the peer's SmolVLA (``peer_lerobot_bench.build_smolvla``: SmolVLM-family backbone at 224 px, chunk 50,
   10 flow steps, random init) and saves it with LeRobot's ``save_pretrained`` together with its pre/post
   processors (mean/std stats), so the server loads it the way it loads any checkpoint;
2. starts ``python -m lerobot.async_inference.policy_server`` as a subprocess (``inference_latency=0``, so the
   server never sleeps to pace a robot) and connects as LeRobot's ``RobotClient`` does: ``Ready``,
   ``SendPolicyInstructions`` (a pickled ``RemotePolicyConfig``), then per request ``SendObservations`` (a pickled
   ``TimedObservation`` with two 224x224 uint8 cameras, an 8-d state and the task, sent in chunks by
   ``send_bytes_in_chunks``, ``must_go=True`` so none is filtered) followed by ``GetActions`` (a pickled list of
   50 ``TimedAction``);
3. times the server's own compute path in process: ``PolicyServer._predict_action_chunk`` on the same observation
   (raw-observation mapping, resize, preprocessor, ``predict_action_chunk``, postprocessor).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from harness import percentiles  # stdlib only: importable in the peer venv (this folder is sys.path[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_checkpoint(peer, out: Path) -> Path:
    """The peer's SmolVLA with mean/std processors, saved with LeRobot's own ``save_pretrained``."""
    import torch
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    vlm_dir = peer.make_local_smolvlm(peer.DEFAULT_CACHE / "tiny_smolvlm")
    pol, cfg, _ = peer.build_smolvla(vlm_dir)
    stats = {
        "observation.state": {"mean": torch.zeros(peer.STATE_DIM), "std": torch.ones(peer.STATE_DIM)},
        "action": {"mean": torch.zeros(peer.ACTION_DIM), "std": torch.ones(peer.ACTION_DIM)},
    }
    pre, post = make_smolvla_pre_post_processors(cfg, dataset_stats=stats)
    pol.save_pretrained(out)
    pre.save_pretrained(out)
    post.save_pretrained(out)
    return out


def robot_features(peer, side: int) -> tuple[dict, dict]:
    """LeRobot dataset features of a robot with an 8-joint state and the peer's two cameras at ``side`` px, and
    one raw observation of it (what ``Robot.get_observation`` returns: joint floats, HWC uint8 images, task)."""
    import numpy as np

    joints = [f"joint_{i}.pos" for i in range(peer.STATE_DIM)]
    cams = [k.removeprefix("observation.images.") for k in peer.CAMS]
    feats = {"observation.state": {"dtype": "float32", "shape": (len(joints),), "names": joints}}
    for cam in cams:
        feats[f"observation.images.{cam}"] = {"dtype": "image", "shape": (side, side, 3),
                                              "names": ["height", "width", "channels"]}  # fmt: skip
    rng = np.random.default_rng(0)
    raw = {j: float(v) for j, v in zip(joints, rng.uniform(-1, 1, len(joints)), strict=True)}
    raw |= {cam: rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for cam in cams}
    raw["task"] = peer.TASKS[0]
    return feats, raw


def main() -> None:
    peer_dir, job = Path(sys.argv[1]).resolve(), json.loads(sys.argv[2])
    sys.path.insert(0, str(peer_dir))
    work = Path(tempfile.mkdtemp(prefix="peer_grpc_"))
    os.chdir(work)  # LeRobot's loggers write logs/ into the working directory, from import time on
    import grpc
    import peer_lerobot_bench as peer
    import torch
    from lerobot.async_inference.configs import PolicyServerConfig
    from lerobot.async_inference.helpers import RemotePolicyConfig, TimedObservation
    from lerobot.async_inference.policy_server import PolicyServer
    from lerobot.transport import services_pb2, services_pb2_grpc
    from lerobot.transport.utils import grpc_channel_options, send_bytes_in_chunks

    threads, n, warmup, side = (
        job.get("threads", 2),
        job.get("requests", 12),
        job.get("warmup", 2),
        job.get("image", 224),
    )
    torch.set_num_threads(threads)
    ckpt = save_checkpoint(peer, work / "smolvla")
    feats, raw = robot_features(peer, side)
    spec = RemotePolicyConfig(policy_type="smolvla", pretrained_name_or_path=str(ckpt), lerobot_features=feats,
                              actions_per_chunk=peer.CHUNK, device="cpu")  # fmt: skip

    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    server = subprocess.Popen(
        [sys.executable, "-m", "lerobot.async_inference.policy_server", "--host=127.0.0.1", f"--port={port}",
         "--fps=30", "--inference_latency=0", "--obs_queue_timeout=60"],
        cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    result: dict = {"server": "lerobot.async_inference.policy_server (gRPC)", "requests": n, "warmup": warmup}
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", grpc_channel_options())
        grpc.channel_ready_future(channel).result(timeout=120)
        stub = services_pb2_grpc.AsyncInferenceStub(channel)
        stub.Ready(services_pb2.Empty())
        stub.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(spec)))
        e2e, shapes = [], set()
        for i in range(warmup + n):
            obs = TimedObservation(timestamp=time.time(), timestep=i, observation=raw, must_go=True)
            t0 = time.perf_counter()
            stub.SendObservations(
                send_bytes_in_chunks(pickle.dumps(obs), services_pb2.Observation, silent=True)
            )
            reply = stub.GetActions(services_pb2.Empty())
            chunk = pickle.loads(reply.data)  # LeRobot's wire format, from the server started above
            dt = time.perf_counter() - t0
            shapes.add((len(chunk), *chunk[0].get_action().shape))
            if i >= warmup:
                e2e.append(dt * 1e3)
        channel.close()
    finally:
        server.terminate()
        server.wait(timeout=60)
    result["chunk_shape"] = [list(s) for s in shapes]
    result["end_to_end_ms"] = percentiles(e2e, suffix="")
    # The server's own time per request (its log line "Observation N | Total time: X ms": raw-observation mapping,
    # preprocessing, the chunk, postprocessing), paired with the client's time of the same request.
    served = {}
    for log in sorted((work / "logs").glob("policy_server_*.log")):
        for m in re.finditer(r"Observation (\d+) \| Total time: ([\d.]+)ms", log.read_text()):
            served[int(m.group(1))] = float(m.group(2))
    logged = [i for i in range(warmup, warmup + n) if i in served]  # measured requests the server logged
    if logged:
        result["server_compute_ms"] = percentiles([served[i] for i in logged], suffix="")
        paired = [e2e[i - warmup] - served[i] for i in logged]
        result["overhead_per_request_ms"] = percentiles(paired, suffix="") | {
            "definition": "end-to-end minus the server's own logged compute time of the same request"
        }

    # The same compute path in this process: the server's _predict_action_chunk on the same observation.
    local = PolicyServer(PolicyServerConfig(host="127.0.0.1", port=port, inference_latency=0.0))
    local.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(spec)),
                                 SimpleNamespace(peer=lambda: "in-process"))  # fmt: skip
    inproc = []
    for i in range(warmup + n):
        obs = TimedObservation(timestamp=time.time(), timestep=i, observation=raw, must_go=True)
        t0 = time.perf_counter()
        local._predict_action_chunk(obs)
        if i >= warmup:
            inproc.append((time.perf_counter() - t0) * 1e3)
    result["in_process_ms"] = percentiles(inproc, suffix="")
    med = result["in_process_ms"]["p50"]
    result["overhead_ms"] = {"p50": result["end_to_end_ms"]["p50"] - med, "p99": result["end_to_end_ms"]["p99"] - med,
                             "definition": "end-to-end minus the in-process median of the same compute path"}  # fmt: skip
    result["wire"] = (
        "pickle over gRPC (observation in 2 MiB chunks, actions as a pickled list of TimedAction)"
    )
    result["observation_bytes"] = len(pickle.dumps(TimedObservation(time.time(), 0, raw, True)))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
