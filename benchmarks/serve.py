#!/usr/bin/env python3
"""Serving benchmark: protocol overhead and micro-batching throughput of ``vla serve`` (one JSON line).

Model: the ``bench_smolvla`` config (``benchmarks/model.py``'s: SmolVLM-family backbone at 224 px, expert 0.75x8,
state 8, action 7, chunk 50, 10 flow steps), random init with synthetic stats, saved as a checkpoint folder.
Each request carries two 224x224 cameras, an 8-d state and a prompt.

* ``latency``: one client, requests back to back against ``vla serve`` (a subprocess on this machine): end-to-end
  p50/p99 from the client, the server's own ``infer_ms`` per request, and the protocol overhead per request
  (end-to-end minus the server's forward pass: msgpack, WebSocket, validation, preprocessing, queueing), next to
  ``Policy.infer`` timed in process (same checkpoint, same mode).
* ``throughput``: chunks/s with 1, 4 and 8 concurrent clients (each sends ``--per-client`` requests, the next when
  it has its answer)
  against a micro-batching server (``--max-batch 8``) and a one-at-a-time server (``--max-batch 1``, what openpi
  ships); ``speedup_8_clients`` is their ratio. ``--dtype auto`` leaves the mode (weights dtype x compiled graphs x
  attention kernel) to each server, as ``vla serve`` without ``--dtype``/``--compile``/``--attention`` runs: it times
  its candidates at warm-up and keeps the fastest within the accuracy bound (the micro-batching server measures;
  the one-at-a-time server then runs the same mode, so the speedup compares batching alone); ``serving_mode``
  records each server's mode and trials. With a fixed ``--dtype``, ``--attention`` fixes the kernel too (left out,
  the micro-batching server measures it and the one-at-a-time server runs its choice). ``--interleave R`` keeps
  both servers alive and measures them in R alternating rounds per client count, the server not being measured
  SIGSTOPped: this VM's speed drifts by 10-30 % within minutes, and one server measured after the other carries
  that drift into the ratio; interleaved, ``speedup_8_clients`` is the median of the rounds' ratios.

* ``batching_bound``: what micro-batching can gain on this CPU at all: the micro-batching server's per-chunk time
  at batch 1 and at batch 8 (inside the model, from its warm-up trials), and the ceiling a batch running at the
  matmul peak of that dtype would reach (FLOPs per chunk counted, the peak timed in this run).

* ``op_breakdown``: where batch 1's and batch 8's time goes inside the model, in the micro-batching server's mode
  (a child process: warmed up as the server is, then profiled with ``torch.profiler``, compiled kernels named):
  per chunk, the linear layers' time (oneDNN/MKL linears, ``mm``/``addmm``), the attention matmuls' (``bmm``,
  ``baddbmm``, fused SDPA) and the rest (softmax, norms, RoPE, copies, Python), each with its FLOPs (counted in
  fp32 eager) and its fraction of the matmul peak. ``gain_8_if_linears_at_peak``: batch 1's time over batch 8's with
  batch 8's linear layers at the peak and everything else as measured.

* ``peer_lerobot``: LeRobot 0.6.1's own policy server (``lerobot.async_inference.policy_server``, gRPC, pickle on
  the wire) at the peer's SmolVLA config, same cameras and state, timed the same way: one client's per-request
  latency next to the server's compute path timed in process (``benchmarks/peer_lerobot_grpc.py``, in the peer venv
  ``$PEER_VENV`` from ``../shared/peer``, which needs LeRobot's async extras: ``$PEER_VENV/bin/pip install
  "grpcio>=1.73.1,<2" "protobuf>=6.31.1,<8"``). Run after ours, on the same quiet machine; ``--skip-peer`` skips it.

    .venv/bin/python benchmarks/serve.py [--requests 60] [--per-client 4] [--dtype float32|bfloat16|auto] [--compile]
                                         [--attention sdpa|explicit] [--interleave R] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import REPO, cpu_model, emit, percentiles, run_in_peer_venv
from model import BENCH_SPEC, TASKS

IMAGE = 224


def progress(message: str) -> None:
    print(f"[serve bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_checkpoint(out: Path) -> Path:
    """The bench_smolvla model for BENCH_SPEC with stats of uniform [-1, 1] data, as a checkpoint folder."""
    import numpy as np
    import torch

    from vla.data.norm_stats import NormStats, StatsFile
    from vla.embodiments import EmbodimentSpec
    from vla.models.config import load_model_config
    from vla.models.hub import save_pretrained
    from vla.models.policies.flow_vla import FlowVLA

    torch.manual_seed(0)
    spec = EmbodimentSpec.from_dict(BENCH_SPEC)
    model = FlowVLA(load_model_config("bench_smolvla"), [spec])
    rng = np.random.default_rng(0)

    def stats(dim: int) -> NormStats:
        x = rng.uniform(-1, 1, (1000, dim))
        return NormStats(mean=x.mean(0), std=x.std(0), min=x.min(0), max=x.max(0),
                         q01=np.quantile(x, 0.01, 0), q99=np.quantile(x, 0.99, 0), count=len(x))  # fmt: skip

    model.norm_stats = StatsFile(
        stats={spec.name: {"state": stats(spec.state_dim), "action": stats(spec.action_dim)}}
    )
    return Path(save_pretrained(model, out))


def request(i: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(i)
    return {
        "images": {s: rng.integers(0, 256, (IMAGE, IMAGE, 3), dtype=np.uint8) for s in ("primary", "wrist")},
        "state": rng.uniform(-1, 1, 8).astype(np.float32),
        "prompt": TASKS[i % len(TASKS)],
        "embodiment": BENCH_SPEC["name"],
        "seed": i,
    }


def in_process(ckpt: Path, dtype: str, compile: bool, attention: str, n: int) -> dict:
    from vla.policy import Policy
    from vla.runtime import tune_allocator
    from vla.types import Observation

    tune_allocator()  # as `vla serve` does at start-up (VLA_MALLOC_TUNING)
    policy = Policy.from_checkpoint(ckpt, dtype=dtype, compile=compile, attention=attention)
    times = []
    for i in range(n + 2):
        r = request(i)
        obs = Observation(r["images"], r["state"], r["prompt"], r["embodiment"])
        t0 = time.perf_counter()
        policy.infer(obs, seed=i)
        if i >= 2:  # two warm-up calls
            times.append((time.perf_counter() - t0) * 1000)
        progress(f"in process {i}: {(time.perf_counter() - t0) * 1000:.0f} ms")
    return percentiles(times)


class Server:
    def __init__(
        self,
        ckpt: Path,
        max_batch: int,
        dtype: str,
        compile: bool,
        attention: str | None,
        window_ms: str | None = None,
    ) -> None:
        cmd = [sys.executable, "-m", "vla.cli", "serve", str(ckpt), "--port", "0", "--max-batch", str(max_batch)]  # fmt: skip
        if dtype != "auto":  # auto: the server times its candidate modes at warm-up and keeps the fastest
            cmd += ["--dtype", dtype, "--compile" if compile else "--no-compile"]
        if attention is not None:  # None: the server measures the kernel
            cmd += ["--attention", attention]
        if window_ms is not None:
            cmd += ["--batch-window-ms", window_ms]
        self.log = Path(tempfile.mkdtemp()) / "serve.log"
        with open(self.log, "w") as log:  # the child keeps its own descriptor
            # a session of its own: pause() stops its compile workers with it
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO, start_new_session=True
            )
        line = self.proc.stdout.readline()
        if "ready at" not in line:
            self.proc.kill()
            raise RuntimeError(f"vla serve did not start: {line!r}\n{self.log.read_text()[-3000:]}")
        self.url = line.split("ready at ")[1].split()[0]

    def pause(self) -> None:
        """SIGSTOP the server (its process group) while the other server is measured."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.resume()  # a paused server would not act on SIGTERM
        self.proc.terminate()
        return self.proc.wait(60)


def serving_mode(url: str) -> dict[str, object]:
    """The server's metadata ``serving_mode``: the mode it runs (``mode``: ``"<dtype> compiled|eager <attention>"``,
    and ``dtype``, ``compile``, ``attention``) and, where it measured, the trials it chose it from."""
    from vla.serving.client import WebsocketClient

    with WebsocketClient(url, timeout=300) as client:
        return client.metadata["serving_mode"]


def latency(url: str, n: int) -> dict:
    from vla.serving.client import WebsocketClient

    e2e, infer, overhead = [], [], []
    with WebsocketClient(url, timeout=300) as client:
        for i in range(n + 2):
            r = request(i)
            t0 = time.perf_counter()
            out = client.infer(r)
            ms = (time.perf_counter() - t0) * 1000
            if i >= 2:
                e2e.append(ms)
                infer.append(out["server_timing"]["infer_ms"])
                overhead.append(ms - out["server_timing"]["infer_ms"])
    return {
        "end_to_end": percentiles(e2e),
        "server_infer": percentiles(infer),
        "overhead": percentiles(overhead),
    }


def throughput(url: str, clients: int, per_client: int) -> dict:
    """``clients`` connections each send ``per_client`` requests back to back (after one warm-up request each);
    chunks/s = all requests / wall time from the common start to the last answer."""
    from vla.serving.client import WebsocketClient

    failures: list[str] = []
    batch_sizes: list[int] = []
    start = threading.Barrier(clients + 1)

    def run(c: int) -> None:
        try:
            with WebsocketClient(url, timeout=1800) as client:
                client.infer(request(1000 + c))  # warm
                start.wait()
                for i in range(per_client):
                    out = client.infer(request(c * 100_000 + i))
                    batch_sizes.append(out["server_timing"]["batch_size"])
        except Exception as e:
            failures.append(repr(e))
            start.abort()

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    return {
        "clients": clients,
        "chunks": len(batch_sizes),
        "seconds": elapsed,
        "chunks_per_s": len(batch_sizes) / elapsed,
        "mean_batch_size": statistics.fmean(batch_sizes) if batch_sizes else None,
        "failures": failures,
    }


def interleaved(
    ckpt: Path, args: argparse.Namespace, clients: list[int], result: dict
) -> tuple[str, bool, str]:
    """Both servers alive at once, measured in alternating rounds (``--interleave R``): for each client count, R
    rounds of A B / B A (micro-batched, one at a time) with the server not measured SIGSTOPped, so a drifting VM
    slows both alike. Fills ``result``'s ``serving_mode``, ``latency`` (micro-batched), ``throughput`` (per server
    and client count the median over rounds, with every round's chunks/s), ``speedup_8_clients`` (the median of the
    rounds' ratios) and ``server_exit_codes``; returns the mode (dtype, compile, attention) both servers run."""
    servers: dict[str, Server] = {}
    dtype, compiled, attention = args.dtype, args.compile, args.attention
    try:
        for name, max_batch in (("micro_batched", 8), ("one_at_a_time", 1)):
            progress(f"starting vla serve --max-batch {max_batch} (the other server is paused)")
            servers[name] = Server(ckpt, max_batch, dtype, compiled, attention, args.batch_window_ms)
            chosen = result.setdefault("serving_mode", {})[name] = serving_mode(servers[name].url)
            progress(f"{name}: the server runs {chosen['mode']}")
            dtype, compiled, attention = chosen["dtype"], chosen["compile"], chosen["attention"]
            if name == "micro_batched":
                progress("latency: one client, requests back to back")
                result["latency"] = latency(servers[name].url, args.requests)
            servers[name].pause()
        rounds: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in clients} for name in servers}
        for c in clients:
            for r in range(args.interleave):
                for name in list(servers) if r % 2 == 0 else list(servers)[::-1]:
                    progress(f"throughput: {name}, {c} client(s), round {r + 1}/{args.interleave}")
                    servers[name].resume()
                    try:
                        rounds[name][c].append(throughput(servers[name].url, c, args.per_client))
                    finally:
                        servers[name].pause()
    finally:
        for name, server in servers.items():
            result.setdefault("server_exit_codes", {})[name] = server.stop()
    for name, by_clients in rounds.items():
        result.setdefault("throughput", {})[name] = [
            {
                "clients": c,
                "chunks_per_s": statistics.median(t["chunks_per_s"] for t in runs),
                "rounds_chunks_per_s": [t["chunks_per_s"] for t in runs],
                "mean_batch_size": statistics.fmean(
                    t["mean_batch_size"] for t in runs if t["mean_batch_size"]
                ),
                "failures": [f for t in runs for f in t["failures"]],
            }
            for c, runs in by_clients.items()
        ]
    if 8 in clients:
        ratios = [
            a["chunks_per_s"] / b["chunks_per_s"]
            for a, b in zip(rounds["micro_batched"][8], rounds["one_at_a_time"][8], strict=True)
        ]
        result["speedup_8_clients_rounds"] = ratios
        result["speedup_8_clients"] = statistics.median(ratios)
    return dtype, compiled, attention


def batching_bound(result: dict, threads: int) -> dict:
    """How much micro-batching can gain on this machine, from the same run: the FLOPs of one chunk (counted by
    ``benchmarks/model.py``'s infer child, fp32 eager, the same ``bench_smolvla`` model), the matmul peak of the
    serving mode's dtype (its peak child), and the time of one chunk at batch 1 and per chunk at batch 8 in the
    micro-batching server's mode (its warm-up trials, the kept mode's; with a fixed ``--dtype`` and ``--attention``
    the server runs none, and the in-process p50 and the 8-client throughput stand in).

    ``inside_model_gain_8``: batch-1 time over per-chunk time at batch 8. ``ceiling``: the gain if a batch ran at
    the matmul peak (peak FLOP/s over batch 1's), an upper bound no batching exceeds on this CPU.
    """
    from harness import run_child

    mode = result["serving_mode"]["micro_batched"]["mode"]
    dtype = "bf16" if mode.startswith("bfloat16") else "fp32"
    trial = next(
        (t for t in result["serving_mode"]["micro_batched"].get("trials", []) if t["mode"] == mode), None
    )
    if trial is not None:  # string keys (msgpack and JSON alike)
        ms = {int(k): v for k, v in trial["ms_per_chunk"].items()}
        ms1, ms8, source = ms[1], ms[8], "the server's warm-up trials"
    else:
        eight = {t["clients"]: t["chunks_per_s"] for t in result["throughput"]["micro_batched"]}.get(8)
        if not eight:
            return {"skipped": "no warm-up trials and no 8-client throughput to bound"}
        ms1, ms8 = result["in_process"]["p50_ms"], 1000 / eight
        source = "in-process p50 (batch 1) and 8-client throughput through the server (batch 8)"
    model_py = str(Path(__file__).with_name("model.py"))
    infer = run_child(model_py, {"kind": "infer", "amp": "fp32", "threads": threads, "iters": 1, "warmup": 0})
    peak = run_child(model_py, {"kind": "peak", "threads": threads, "dtypes": [dtype]})
    flops, peak_tflops = infer.get("flops_per_chunk"), peak.get(f"{dtype}_tflops")
    if not flops or not peak_tflops:
        return {"error": f"no FLOP count or peak: {infer.get('error') or peak.get('error')}"}
    batch1_tflops = flops / (ms1 / 1000) / 1e12
    return {
        "mode": mode,
        "flops_per_chunk": flops,
        "peak_tflops": peak_tflops,
        "ms_per_chunk_batch1": ms1,
        "ms_per_chunk_batch8": ms8,
        "source": source,
        "batch1_tflops": batch1_tflops,
        "batch1_fraction_of_peak": batch1_tflops / peak_tflops,
        "batch8_fraction_of_peak": flops / (ms8 / 1000) / 1e12 / peak_tflops,
        "inside_model_gain_8": ms1 / ms8,
        "ceiling": peak_tflops / batch1_tflops,
    }


#: Profiler events (self time) that are the model's linear layers, and its attention matmuls; everything else is
#: "other". FLOPs are counted in fp32 eager, where linears are ``mm``/``addmm`` and the explicit attention's
#: matmuls ``bmm``/``baddbmm``.
LINEAR_EVENTS = frozenset(
    {"mkldnn::_linear_pointwise", "mkl::_mkl_linear", "aten::mm", "aten::addmm", "aten::linear"}
)
ATTENTION_EVENTS = frozenset(
    {"aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention_for_cpu"}
)
LINEAR_FLOPS, ATTENTION_FLOPS = frozenset({"mm", "addmm"}), frozenset({"bmm", "baddbmm"})


def split_ops(
    self_ms: dict[str, float], flops: dict[str, float], wall_ms: float, batch: int
) -> dict[str, float]:
    """One batch's time and FLOPs per chunk by kind: ``self_ms`` profiler event name -> self time (ms) of the whole
    batch, ``flops`` op name (``mm``, ``bmm``, ...) -> FLOPs of the whole batch, ``wall_ms`` the batch's unprofiled
    time. "other" is the wall time the linears and attention matmuls leave (the profiler's per-op cost stays out of
    it)."""
    linear = sum(ms for name, ms in self_ms.items() if name in LINEAR_EVENTS)
    attention = sum(ms for name, ms in self_ms.items() if name in ATTENTION_EVENTS)
    lin_f = sum(f for name, f in flops.items() if name in LINEAR_FLOPS)
    att_f = sum(f for name, f in flops.items() if name in ATTENTION_FLOPS)
    return {
        "wall_ms_per_chunk": wall_ms / batch,
        "linear_ms_per_chunk": linear / batch,
        "attention_matmul_ms_per_chunk": attention / batch,
        "other_ms_per_chunk": max(0.0, wall_ms - linear - attention) / batch,
        "linear_gflop_per_chunk": lin_f / batch / 1e9,
        "attention_gflop_per_chunk": att_f / batch / 1e9,
        "other_gflop_per_chunk": (sum(flops.values()) - lin_f - att_f) / batch / 1e9,
    }


def child_ops(job: dict) -> dict:
    """``op_breakdown``'s child: ``split_ops`` at each of ``job["batches"]`` for the checkpoint ``job["ckpt"]`` in
    the mode ``job["dtype"]``/``["compile"]``/``["attention"]``, warmed up as ``vla serve`` warms up."""
    import torch
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    from vla.policy import Policy
    from vla.runtime import tune_allocator
    from vla.serving.modes import synthetic_observations, warm_up

    torch.set_num_threads(job["threads"])
    inductor_config.cpp.enable_kernel_profile = True  # compiled kernels as events of their own ("other")
    tune_allocator()
    batches = job["batches"]
    counter = Policy.from_checkpoint(Path(job["ckpt"]), dtype="float32", compile=False, attention="explicit")
    flops = {}
    for b in batches:
        with FlopCounterMode(display=False) as fc:
            counter.infer_batch(synthetic_observations(counter, b, seed=b), seeds=list(range(b)))
        flops[b] = {str(op).split(".")[-1]: n for op, n in fc.get_flop_counts()["Global"].items()}
    del counter
    policy = Policy.from_checkpoint(
        Path(job["ckpt"]), dtype=job["dtype"], compile=job["compile"], attention=job["attention"]
    )
    warm_up(policy, batches)
    out = {}
    for b in batches:
        obs, seeds = synthetic_observations(policy, b, seed=b), list(range(b))
        walls = []
        for _ in range(4):
            t0 = time.perf_counter()
            policy.infer_batch(obs, seeds=seeds)
            walls.append((time.perf_counter() - t0) * 1000)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            policy.infer_batch(obs, seeds=seeds)
        self_ms = {e.key: e.self_cpu_time_total / 1000 for e in prof.key_averages()}
        out[str(b)] = split_ops(self_ms, flops[b], statistics.median(walls[1:]), b)
    return out


def op_breakdown(ckpt: Path, result: dict, threads: int) -> dict:
    """``split_ops`` at batch 1 and 8 in the micro-batching server's mode (a child process), with each kind's
    TFLOP/s and fraction of the matmul peak ``batching_bound`` timed."""
    from harness import run_child

    mode = result["serving_mode"]["micro_batched"]
    job = {"kind": "ops", "ckpt": str(ckpt), "threads": threads, "batches": [1, 8], "dtype": mode["dtype"],
           "compile": mode["compile"], "attention": mode["attention"]}  # fmt: skip
    out = run_child(__file__, job)
    if "error" in out:
        return out
    peak = result.get("batching_bound", {}).get("peak_tflops")
    for row in out.values():
        for kind, ms in (("linear", "linear_ms_per_chunk"), ("attention", "attention_matmul_ms_per_chunk")):
            gflop = row[f"{kind}_gflop_per_chunk"]
            row[f"{kind}_tflops"] = gflop / row[ms] if row[ms] else None
            if peak and row[f"{kind}_tflops"]:
                row[f"{kind}_fraction_of_peak"] = row[f"{kind}_tflops"] / peak
    one, eight = out["1"], out["8"]
    if peak and any(row.get("linear_fraction_of_peak", 0) > 1.1 for row in (one, eight)):
        # faster than the peak: the profiler missed the linears (kernels called from Inductor's C++ wrapper)
        out["error"] = "linear layers timed above the matmul peak: the profiler did not see their kernels"
    elif peak:
        best8 = (
            eight["linear_gflop_per_chunk"] / peak
            + eight["attention_matmul_ms_per_chunk"]
            + eight["other_ms_per_chunk"]
        )
        out["gain_8_if_linears_at_peak"] = one["wall_ms_per_chunk"] / best8
    out["mode"] = mode["mode"]
    return out


def main() -> None:
    if sys.argv[1:2] == ["_child"]:  # op_breakdown's child (harness.run_child: ``serve.py _child JOB``)
        print("RESULT " + json.dumps(child_ops(json.loads(sys.argv[2]))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 60: a p99 of 12 requests is their maximum (one outlier of 6.6 ms on the EPYC did not recur in 60: 2.5 ms)
    ap.add_argument("--requests", type=int, default=60, help="latency: sequential requests measured")
    ap.add_argument("--per-client", type=int, default=4, help="throughput: requests each client sends")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                    help="auto: the servers' defaults (each times its candidate modes at warm-up and keeps the "
                         "fastest); in process then runs the micro-batching server's choice")  # fmt: skip
    ap.add_argument("--compile", action="store_true", help="(with --dtype float32|bfloat16)")
    ap.add_argument("--attention", default=None, choices=["sdpa", "explicit"],
                    help="(with --dtype float32|bfloat16) the attention kernel; default: measured by the server")  # fmt: skip
    ap.add_argument("--batch-window-ms", default=None, metavar="MS|auto",
                    help="vla serve --batch-window-ms of both servers (default: the server's, auto)")  # fmt: skip
    ap.add_argument("--out", default="")
    ap.add_argument("--skip-peer", action="store_true", help="skip LeRobot's gRPC policy server")
    ap.add_argument("--interleave", type=int, default=0, metavar="R",
                    help="run both servers at once and measure throughput in R alternating rounds per client "
                         "count (the idle one SIGSTOPped): drift-free ratios; 0 (default): one server after the "
                         "other, one round")  # fmt: skip
    args = ap.parse_args()
    if args.interleave < 0:
        ap.error(f"--interleave must be >= 0 (0: one server after the other), got {args.interleave}")
    if args.dtype == "auto" and args.compile:
        ap.error("--compile goes with --dtype float32|bfloat16; with --dtype auto the server chooses it")
    if args.dtype == "auto" and args.attention:
        ap.error("--attention goes with --dtype float32|bfloat16; with --dtype auto the server chooses it")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "bench_smolvla")
        progress("checkpoint written")
        result: dict = {
            "benchmark": "serve",
            "started": started,
            "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(),
            "config": {
                "model": "bench_smolvla",
                "cameras": f"2 x {IMAGE}x{IMAGE}",
                "state": 8,
                "action": 7,
                "chunk": 50,
                "flow_steps": 10,
                "dtype": args.dtype,
                "compile": None if args.dtype == "auto" else args.compile,
                "attention": args.attention or "measured by the server",
                "batch_window_ms": args.batch_window_ms or "auto (the server's default)",
                "torch_threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or None,
                # vla.runtime's allocator tuning, on for the server and in process unless "0"
                "allocator_tuning": os.environ.get("VLA_MALLOC_TUNING", "1"),
            },
        }
        clients = [int(c) for c in args.clients.split(",")]
        dtype, compiled, attention = args.dtype, args.compile, args.attention
        result["config"]["interleave_rounds"] = args.interleave or None
        if args.interleave:
            dtype, compiled, attention = interleaved(ckpt, args, clients, result)
        for name, max_batch in () if args.interleave else (("micro_batched", 8), ("one_at_a_time", 1)):
            progress(f"starting vla serve --max-batch {max_batch}")
            server = Server(ckpt, max_batch, dtype, compiled, attention, args.batch_window_ms)
            try:
                result.setdefault("serving_mode", {})[name] = serving_mode(server.url)
                progress(f"{name}: the server runs {result['serving_mode'][name]['mode']}")
                # the one-at-a-time server runs the same mode: the speedup compares batching alone
                chosen = result["serving_mode"][name]
                dtype, compiled, attention = chosen["dtype"], chosen["compile"], chosen["attention"]
                if name == "micro_batched":
                    progress("latency: one client, requests back to back")
                    result["latency"] = latency(server.url, args.requests)
                for c in clients:
                    progress(f"throughput: {name}, {c} client(s)")
                    result.setdefault("throughput", {}).setdefault(name, []).append(
                        throughput(server.url, c, args.per_client)
                    )
            finally:
                result.setdefault("server_exit_codes", {})[name] = server.stop()
        # in process: the micro-batching server's mode (set above)
        progress(f"timing Policy.infer in process ({result['serving_mode']['micro_batched']['mode']})")
        result["in_process"] = in_process(ckpt, dtype, compiled, attention, args.requests)
        threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
        progress("batching bound: FLOPs per chunk and the matmul peak of the serving mode's dtype")
        try:  # an add-on: its failure must not lose the measurements above
            result["batching_bound"] = batching_bound(result, threads)
        except Exception as e:
            result["batching_bound"] = {"error": repr(e)}
        progress("op breakdown: batch 1 and batch 8 profiled in the micro-batching server's mode")
        try:
            result["op_breakdown"] = op_breakdown(ckpt, result, threads)
        except Exception as e:
            result["op_breakdown"] = {"error": repr(e)}
    lat = result["latency"]
    result["protocol_overhead_ms"] = {
        "p50": lat["overhead"]["p50_ms"],
        "p99": lat["overhead"]["p99_ms"],
        "end_to_end_minus_in_process_p50": lat["end_to_end"]["p50_ms"] - result["in_process"]["p50_ms"],
        "target_p99": 5.0,
    }
    by = {n: {t["clients"]: t["chunks_per_s"] for t in ts} for n, ts in result["throughput"].items()}
    if (
        8 in by["micro_batched"] and "speedup_8_clients" not in result
    ):  # interleaved: the median of its rounds
        result["speedup_8_clients"] = by["micro_batched"][8] / by["one_at_a_time"][8]
    if args.skip_peer:
        result["peer_lerobot"] = {"skipped": "--skip-peer"}
    else:
        progress("LeRobot 0.6.1's gRPC policy server at the peer's SmolVLA config")
        job = {"requests": args.requests, "warmup": 2, "threads": int(os.environ.get("OMP_NUM_THREADS", "2"))}
        result["peer_lerobot"] = run_in_peer_venv(str(Path(__file__).with_name("peer_lerobot_grpc.py")), job)
        peer = result["peer_lerobot"]
        if "end_to_end_ms" in peer:
            result["vs_peer"] = {
                "end_to_end_p50_ms": {
                    "ours": lat["end_to_end"]["p50_ms"],
                    "lerobot_grpc": peer["end_to_end_ms"]["p50"],
                },
                "overhead_p50_ms": {
                    "ours": lat["overhead"]["p50_ms"],
                    "lerobot_grpc": peer.get("overhead_per_request_ms", {}).get("p50"),
                },
                "overhead_p99_ms": {
                    "ours": lat["overhead"]["p99_ms"],
                    "lerobot_grpc": peer.get("overhead_per_request_ms", {}).get("p99"),
                },
                "in_process_p50_ms": {
                    "ours": result["in_process"]["p50_ms"],
                    "lerobot": peer["in_process_ms"]["p50"],
                },
                "definition": "overhead: end-to-end minus the server's own compute time of the same request",
            }
    emit(result, args.out)


if __name__ == "__main__":
    main()
