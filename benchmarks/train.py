#!/usr/bin/env python3
"""End-to-end training throughput (files -> loader -> model -> optimizer step), side by side with LeRobot 0.6.1's
own training script on the same dataset (one JSON line).

Setting (both sides): the LeRobot v3.0 dataset LeRobot's own writer produces for the data benchmark (``../shared/
peer/peer_lerobot_bench.py make-dataset``: 6 episodes x 40 frames, two 96x128 AV1 cameras, 8-d state, 7-d action,
two tasks), batch 8, 2 loader workers, action chunk 50, the ``configs/model/bench_smolvla.yaml`` architecture
(= the peer's SmolVLA: tiny-but-real-shaped SmolVLM, 224 px, 8 VLM layers, 0.75-wide expert x 8 layers) with the
backbone frozen, the same number of steps, the first ``--warmup`` steps not counted.

* ours: ``vla train debug --run-dir DIR --set model=bench_smolvla --set data.datasets=[PATH] ...`` as a user runs
  it (a subprocess), per-step ``step_time_s`` / ``data_wait_s`` read from ``DIR/metrics.jsonl``; fp32 and bf16
  autocast. The dataset's ``robot_type`` (``synthetic_7dof``) gets an embodiment spec (the model benchmark's
  ``BENCH_SPEC``: state 8, action 7, chunk 50, primary + wrist cameras) in a config folder of its own
  (``VLA_CONFIG_DIR``; everything else there links to ``configs/``), so LeRobot's generic key map applies.
  Each precision eager (``train.compile=never``, result key ``fp32``/``bf16``) and with the frozen backbone compiled
  (``always``, key ``fp32_compiled``/``bf16_compiled``; the compile falls in the warm-up steps, its seconds are
  reported from the checkpoint's ``trainer.json``).
* LeRobot: ``lerobot-train`` with SmolVLA on CPU (``benchmarks/peer_lerobot_train.py`` in the peer venv), timed from
  its own per-step ``updt_s`` + ``data_s`` log fields; fp32 and bf16 (``policy.use_amp``).

With ``--rounds N`` (default 1) every run of both sides is repeated N times; within a round each precision's runs
of both sides go back to back (ours, eager and compiled, next to LeRobot's at that precision), who goes first
alternating between rounds, and each speed-up is the median over rounds of the ratio within a round: runs minutes
apart on a shared VM drift by 10-20 %, runs side by side much less. Each side's reported run is its median
round's. With ``--time-slice S`` each precision's runs of both sides (ours eager and compiled, LeRobot's) are started
together and take turns of S seconds, one at a time (SIGSTOP/SIGCONT of each run's process group, loader workers
included; ``harness.time_sliced``): a run that reaches its first step waits, stopped, until the others have too,
and only the steps taken while all of them were training count (the common window ends when the first run exits),
less those a pause fell into (longer than S/2) and the one after each; so drift over minutes hits both sides alike.
Per side and precision: samples/s over all timed steps and at the median step (a shared machine's bursts hit
single steps of either side; the median is robust to them), data-wait fraction of step time (ours: waiting for the
batch; LeRobot's ``data_s`` also holds its preprocessor, which runs in the main process), MFU (the FLOPs of one
training step counted by the model benchmark, over the step time, against the same dtype's matmul peak measured by
the model benchmark's ``peak`` child at the start and the end of this run, the higher kept), peak RSS of the main
process and of the largest process (loader workers included). On CPUs without native bf16 matmuls (no
AVX512-BF16/AMX) bf16 autocast is far slower than fp32 on both sides; its MFU against that dtype's tiny matmul peak
exceeds 1 because autocast keeps much of the step in fp32.

    .venv/bin/python benchmarks/train.py [--steps 30] [--warmup 5] [--rounds 1] [--time-slice S] [--skip-peer]
                                         [--out FILE.json]

The peer runs only where its venv exists (``../shared/peer/setup_lerobot_venv.sh``; ``$PEER_VENV``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from harness import (
    REPO,
    Child,
    cpu_model,
    emit,
    kept_steps,
    paused_step_s,
    peer_missing,
    run_child,
    run_in_peer_venv,
    start_child,
    start_in_peer_venv,
    stats3,
    time_sliced,
    window_rates,
)

BENCH_DIR = Path(__file__).resolve().parent
OWN_CACHE = Path(os.environ.get("VLA_BENCH_CACHE", "/tmp/vla_bench_data"))
CHUNK = 50  # bench_smolvla's chunk and SmolVLA's chunk_size in the peer settings


# ---- setup -------------------------------------------------------------------------------------------------------
def bench_config_dir(robot_type: str) -> Path:
    """A ``VLA_CONFIG_DIR`` with every file of ``configs/`` plus an embodiment named after the dataset's robot_type."""
    from model import BENCH_SPEC

    from vla.embodiments import EmbodimentSpec

    root = OWN_CACHE / "train_bench_configs"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for sub in (REPO / "configs").iterdir():
        if sub.name != "embodiments":
            (root / sub.name).symlink_to(sub)
    emb = root / "embodiments"
    emb.mkdir()
    for f in (REPO / "configs" / "embodiments").glob("*.yaml"):
        (emb / f.name).symlink_to(f)
    EmbodimentSpec.from_dict({**BENCH_SPEC, "name": robot_type}).to_yaml(emb / f"{robot_type}.yaml")
    return root


def write_stats(dataset: Path, env: dict[str, str]) -> Path:
    """``vla data stats`` of the dataset, written to our cache (the peer's dataset folder is left as LeRobot wrote it)."""
    out = OWN_CACHE / "train_bench_stats.json"
    vla_cli = [sys.executable, "-m", "vla.cli"]
    subprocess.run([*vla_cli, "data", "stats", str(dataset), "--out", str(out)], check=True, env=env)
    return out


# ---- our side (child process) ------------------------------------------------------------------------------------
def train_command(job: dict, run_dir: Path) -> list[str]:
    """The ``vla train`` invocation (``python -m vla.cli train`` is the ``vla train`` console script)."""
    sets = {
        "model": "bench_smolvla",
        "data.datasets": f"[{job['dataset']}]",
        "data.stats_path": job["stats"],
        "data.batch_size": job["batch"],
        "data.num_workers": job["workers"],
        "data.image_size": job["image_size"],
        "data.chunk_length": CHUNK,
        "train.steps": job["steps"],
        "train.save_every": job["steps"],
        "train.seed": 0,
        "train.precision": job["precision"],
        "train.compile": job.get("compile", "never"),
        "logging.every": 1,
    }
    args = [arg for k, v in sets.items() for arg in ("--set", f"{k}={v}")]
    return [sys.executable, "-m", "vla.cli", "train", "debug", "--run-dir", str(run_dir), *args]


def summarize_metrics(rows: list[dict], job: dict) -> dict:
    """Throughput and data wait over the logged steps after ``warmup`` (``metrics.jsonl`` rows, events skipped)."""
    steps = sorted((r for r in rows if "event" not in r and "step_time_s" in r), key=lambda r: r["step"])
    if len(steps) != job["steps"]:
        raise RuntimeError(f"expected {job['steps']} step rows in metrics.jsonl, found {len(steps)}")
    timed = steps[job["warmup"] :]
    longest = job.get("paused_step_s")  # a time-sliced run: steps a pause fell into are not counted
    # none left (every step held a pause): all kept here, and the common window reports the error
    keep = kept_steps([r["step_time_s"] for r in timed], longest) or list(range(len(timed)))
    dropped = len(timed) - len(keep)
    timed = [timed[i] for i in keep]
    step = [r["step_time_s"] for r in timed]
    wait = [r["data_wait_s"] for r in timed]
    n = len(timed) * job["batch"]
    out = {
        "timed_steps": len(timed),
        "s_per_step": stats3(step),
        "data_wait_s": stats3(wait),
        "samples_per_s": n / sum(step),
        "samples_per_s_median_step": job["batch"] / statistics.median(step),
        "data_wait_frac": sum(wait) / sum(step),
        "loss_first_last": [steps[0]["loss"], steps[-1]["loss"]],
        "peak_rss_main_mb": max(r["peak_rss_mb"] for r in steps),
    }
    if longest is not None:
        out["dropped_paused_steps"] = dropped
        out["step_s"] = [r["step_time_s"] for r in steps]  # every step, for the controller's common window
    elif job["warmup"] and "time" in steps[0]:  # wall clock between logged steps, as a cross-check
        wall = [b["time"] - a["time"] for a, b in zip(steps[job["warmup"] - 1 :], timed)]
        out["wall_s_per_step"] = stats3(wall)
        out["samples_per_s_wall"] = n / sum(wall)
    return out


def _our_steps(run_dir: Path) -> Callable[[Child], int]:
    """Steps a ``vla train`` run has logged in ``run_dir/metrics.jsonl`` (its step rows)."""

    def count(child: Child) -> int:
        try:
            return (run_dir / "metrics.jsonl").read_text().count('"step_time_s"')
        except FileNotFoundError:
            return 0

    return count


def _peer_steps(child: Child) -> int:
    """Steps ``lerobot-train`` has logged (its ``updt_s`` lines, in the child's stderr)."""
    return (child.dir / "err").read_text(errors="replace").count("updt_s:")


def child_ours(job: dict) -> dict:
    # a time-sliced run's folder is chosen by the controller, which counts the steps logged there
    run_dir = Path(job.get("run_dir") or Path(tempfile.mkdtemp(prefix="vla-train-bench-")) / "run")
    cmd = train_command(job, run_dir)
    env = {**os.environ, "VLA_CONFIG_DIR": job["config_dir"], "WANDB_MODE": "offline"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-3000:], "command": " ".join(cmd[1:])}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    res = summarize_metrics(rows, job)
    (meta_file,) = run_dir.glob("checkpoints/step-*/train_state/trainer.json")
    meta = json.loads(meta_file.read_text())
    res["compile_frozen"] = meta.get("compile_frozen")  # parts, compile seconds
    # the attention kernel bf16 training measured fastest, per head layout
    res["cpu_bf16_attention"] = meta.get("cpu_bf16_attention")
    res |= {
        "wall_s_total": wall,
        "command": "vla " + " ".join(cmd[3:]),
        # the largest single process of the run (main or a loader worker): RUSAGE_CHILDREN reports the maximum
        "peak_rss_any_process_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        **{k: job[k] for k in ("steps", "warmup", "batch", "workers", "precision", "compile", "image_size")},
    }
    shutil.rmtree(run_dir.parent, ignore_errors=True)
    return res


# ---- comparison --------------------------------------------------------------------------------------------------
#: Throughput two ways: over all timed steps (what a run delivers, stalls included) and at the median step (robust
#: to the stalls another job on a shared machine causes; both sides see such spikes).
RATES = ("samples_per_s", "samples_per_s_median_step")


def mfu(side: dict, flops: float | None, peak: dict, dtype: str, batch: int) -> dict:
    """Achieved TFLOP/s (training FLOPs per step x steps/s) and its fraction of the dtype's matmul peak, per rate."""
    key = f"{dtype}_tflops"
    if not flops or key not in peak:
        return {}
    out: dict = {"against": key}
    for rate in RATES:
        if side.get(rate):
            tflops = flops * side[rate] / batch / 1e12
            out[rate] = {"tflops": tflops, "mfu": tflops / peak[key]}
    return out


def median_round(runs: list[dict]) -> dict:
    """The run of the median round by samples/s (the lower middle one of an even count), with every round's rates."""
    ranked = sorted(runs, key=lambda r: r.get("samples_per_s") or 0.0)
    out = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        out["rounds"] = {rate: [r.get(rate) for r in runs] for rate in RATES}
    return out


def schedule(rounds: int, ours: list[str], peer: list[str]) -> list[tuple[str, str]]:
    """The order of the runs, ``(side, precision)``: the runs a ratio compares sit next to each other (per round
    and precision, ours and LeRobot's back to back), who goes first alternating between rounds, so drift over a
    round hits both sides of each ratio alike."""
    order = []
    for i in range(rounds):
        for precision in dict.fromkeys([*ours, *peer]):
            for side, have in (
                (("ours", ours), ("peer", peer)) if i % 2 == 0 else (("peer", peer), ("ours", ours))
            ):
                if precision in have:
                    order.append((side, precision))
    return order


def compare(res: dict, batch: int) -> None:
    """Speed-ups (ours over LeRobot's samples/s; with several rounds the median of the within-round ratios), MFU and
    the targets: ours >= 1.5x LeRobot, data wait < 5 %."""
    flops = res["flops"].get("flops_per_step")
    peak = res["matmul_peak"]
    peer = res.get("peer_lerobot", {})
    for name, side in (*res["ours"].items(), *peer.items()):
        side["mfu"] = mfu(side, flops, peak, "bf16" if name.startswith("bf16") else "fp32", batch)
    ratios: dict = {rate: {} for rate in RATES}
    targets = {}
    for rate in RATES:
        for ours, o in res["ours"].items():
            for theirs, p in peer.items():
                if "rounds" in o and "rounds" in p:  # side by side within each round
                    pairs = [a / b for a, b in zip(o["rounds"][rate], p["rounds"][rate]) if a and b]
                    if pairs:
                        ratios[rate][f"ours_{ours}_vs_lerobot_{theirs}"] = statistics.median(pairs)
                elif o.get(rate) and p.get(rate):
                    ratios[rate][f"ours_{ours}_vs_lerobot_{theirs}"] = o[rate] / p[rate]
        for ours in res["ours"]:  # against LeRobot at the same precision
            ratio = ratios[rate].get(f"ours_{ours}_vs_lerobot_{ours.split('_')[0]}")
            if ratio is not None:
                targets[f"{ours}_speedup_ge_1.5x_by_{rate}"] = ratio >= 1.5
    for prec, o in res["ours"].items():
        if "data_wait_frac" in o:
            targets[f"{prec}_data_wait_lt_5pct"] = o["data_wait_frac"] < 0.05
    res["speedup"], res["targets"] = ratios, targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", nargs="?", default="bench", choices=["bench", "_child"])
    ap.add_argument("job", nargs="?")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--image-size", type=int, default=0, help="data.image_size (default: the model's backbone.image_size)"
    )
    ap.add_argument("--precisions", default="fp32,bf16", help="our side")
    ap.add_argument("--compile", default="never,always",
                    help="our side's train.compile modes (never: eager; always: the frozen backbone compiled)")  # fmt: skip
    ap.add_argument("--peer-precisions", default="fp32,bf16")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument(
        "--rounds", type=int, default=1, help="repeat every run; speed-ups = median within-round ratio"
    )
    ap.add_argument(
        "--time-slice", type=float, default=0.0, metavar="S",
        help="run each precision's runs of both sides at once, one at a time in turns of S seconds (SIGSTOP/"
             "SIGCONT): drift hits them alike; steps a pause fell into are not counted (give more --steps)",
    )  # fmt: skip
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.cmd == "_child":
        print("RESULT " + json.dumps(child_ours(json.loads(args.job))), flush=True)
        return
    if args.warmup < 1 or args.steps <= args.warmup:
        ap.error(f"need 1 <= --warmup < --steps, got warmup {args.warmup}, steps {args.steps}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.time_slice < 0:
        ap.error(
            f"--time-slice must be > 0 seconds (or 0: runs one after the other), got {args.time_slice:g}"
        )
    from data_loader import ensure_lerobot_dataset

    from vla.data.readers import open_dataset
    from vla.models.tiny import tiny_backbone_path

    if not args.image_size:  # the loader resizes once, to what the vision tower reads (vla train requires it)
        from vla.models.config import load_model_config

        args.image_size = load_model_config("bench_smolvla").backbone.image_size
    OWN_CACHE.mkdir(parents=True, exist_ok=True)
    dataset, provenance = ensure_lerobot_dataset()
    robot_type = open_dataset(dataset).robot_type
    config_dir = bench_config_dir(robot_type)
    stats = write_stats(dataset, {**os.environ, "VLA_CONFIG_DIR": str(config_dir)})
    tiny_backbone_path("smolvlm", "bench")  # built once, outside the timed runs
    common = {"steps": args.steps, "warmup": args.warmup, "batch": args.batch, "workers": args.workers}
    res: dict = {
        "benchmark": "train",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "setting": {
            **common,
            "threads": args.threads,
            "action_chunk": CHUNK,
            "model": "configs/model/bench_smolvla.yaml",
            "image_size": args.image_size,
            "frozen_backbone": True,
            "rounds": args.rounds,
            "time_slice_s": args.time_slice or None,
        },
        "dataset": {"path": str(dataset), "provenance": provenance, "robot_type": robot_type},
        "ours": {},
    }
    model_py = str(BENCH_DIR / "model.py")
    # 1024: on CPUs without native bf16 matmuls (no AVX512-BF16/AMX) one 2048 bf16 matmul takes ~20 s
    peak_job = {"kind": "peak", "threads": args.threads, "n": 1024}
    peaks = [run_child(model_py, peak_job)]
    # the model benchmark's count of one step's forward + backward FLOPs: same architecture, batch, cameras,
    # chunk and prompts (the dataset's two tasks) as these runs; one extra timed step comes with it
    flops_job = {"kind": "train", "batch": args.batch, "amp": "fp32", "threads": args.threads, "iters": 1}
    counted = run_child(model_py, {**flops_job, "warmup": 0})
    res["flops"] = {
        "flops_per_step": counted.get("flops_per_step"),
        "counted_by": "benchmarks/model.py child_train",
    }
    ours: dict[str, list[dict]] = {}
    theirs: dict[str, list[dict]] = {}

    our_precisions, peer_precisions = args.precisions.split(","), args.peer_precisions.split(",")
    if args.skip_peer:
        peer_precisions = []

    sliced = {"paused_step_s": paused_step_s(args.time_slice)} if args.time_slice else {}
    peer_script = str(BENCH_DIR / "peer_lerobot_train.py")

    def our_jobs(precision: str) -> list[tuple[str, dict]]:
        """``(result name, job)`` of each of our runs at ``precision`` (one per train.compile mode)."""
        out = []
        for compile_mode in args.compile.split(",") if precision in our_precisions else ():
            job = {**common, **sliced, "precision": precision, "compile": compile_mode, "image_size": args.image_size,
                   "dataset": str(dataset), "stats": str(stats), "config_dir": str(config_dir)}  # fmt: skip
            out.append((precision if compile_mode == "never" else f"{precision}_compiled", job))
        return out

    def peer_job(precision: str) -> dict:
        return {**common, **sliced, "amp": precision, "threads": args.threads, "root": str(dataset)}

    if args.time_slice:  # each precision's runs of both sides at once, taking turns
        for i in range(args.rounds):
            for precision in dict.fromkeys([*our_precisions, *peer_precisions]):
                runs: list[tuple[dict, str, Child]] = []
                for name, job in our_jobs(precision):
                    job["run_dir"] = str(Path(tempfile.mkdtemp(prefix="vla-train-bench-")) / "run")
                    child = start_child(__file__, job, f"ours {name}", _our_steps(Path(job["run_dir"])))
                    runs.append((ours, name, child))
                if precision in peer_precisions:
                    child = start_in_peer_venv(
                        peer_script, peer_job(precision), f"lerobot {precision}", _peer_steps
                    )
                    if child is None:  # no peer venv
                        theirs.setdefault(precision, []).append(peer_missing())
                    else:
                        runs.append((theirs, precision, child))
                if i % 2:  # who takes the first turn alternates between rounds
                    runs.reverse()
                try:
                    turns = time_sliced([child for _, _, child in runs], args.time_slice)
                except TimeoutError as e:  # the runs were killed; the other rounds' results are kept
                    turns = {"error": str(e)}
                for results, name, child in runs:
                    run = {**child.result(), "time_slicing": turns}
                    if "step_s" in run and "children" in turns:  # the rates over the steps all ran together
                        window = turns["children"][child.name]["window_steps"]
                        w = window_rates(run.pop("step_s"), window, args.warmup, args.batch, sliced["paused_step_s"])  # fmt: skip
                        run["whole_run"] = {k: run.get(k) for k in RATES}
                        run |= {k: w.get(k) for k in RATES}  # None where the window had no step: no ratio
                        run["common_window"] = w
                    results.setdefault(name, []).append(run)
    else:
        for side, precision in schedule(args.rounds, our_precisions, peer_precisions):
            if side == "ours":
                for name, job in our_jobs(precision):
                    ours.setdefault(name, []).append(run_child(__file__, job))
            else:
                theirs.setdefault(precision, []).append(run_in_peer_venv(peer_script, peer_job(precision)))
    res["ours"] = {name: median_round(runs) for name, runs in ours.items()}
    if not args.skip_peer:
        res["peer_lerobot"] = {amp: median_round(runs) for amp, runs in theirs.items()}
    # measured again at the end: on a shared machine one measurement can land in another job's burst
    peaks.append(run_child(model_py, peak_job))
    res["matmul_peak"] = {
        **{k: max(p.get(k, 0.0) for p in peaks) for k in ("fp32_tflops", "bf16_tflops")},
        "n": 1024,
        "measurements": peaks,
    }
    compare(res, args.batch)
    res["load_average_at_end"] = os.getloadavg()
    emit(res, args.out)


if __name__ == "__main__":
    main()
