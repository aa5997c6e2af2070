#!/usr/bin/env python3
"""Fine-tuning cost per mode at the ``bench_smolvla`` config (one JSON line): step time, samples/s, peak memory,
trainable parameters and the size of the checkpoint each mode writes, beside LeRobot 0.6.1's own SmolVLA training
at the same batch (its defaults: vision encoder frozen, expert trained).

Setting: the dataset and robot spec of ``benchmarks/train.py`` (LeRobot's writer, two 96x128 AV1 cameras, 8-d
state, 7-d action; a spec named after its ``robot_type`` in a config folder of its own), batch 8, action chunk 50.
The base is ``vla model init bench_smolvla --embodiment widowx_bridge`` (an untrained checkpoint of the benchmark
architecture: cost does not depend on the weights); each mode is ``vla finetune BASE --embodiment ROBOT --preset
P`` as a user runs it (a subprocess), timed from ``metrics.jsonl`` after ``--warmup`` steps:

* ``finetune_lora`` (r=16) and ``finetune_lora_r32``: peft LoRA on the language layers and the expert + the new slot
* ``finetune_frozen_backbone``: the expert + the new slot
* ``finetune_full``: everything the model config leaves trainable

Reported, not asserted: the target that a LoRA r=16 adapter file is at most 10 % of the full model file is listed
in ``targets``.

    .venv/bin/python benchmarks/finetune.py [--steps 12] [--warmup 3] [--modes ...] [--skip-peer] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import emit, run_child, run_in_peer_venv
from train import CHUNK, OWN_CACHE, bench_config_dir, cpu_model, summarize_metrics, write_stats

BENCH_DIR = Path(__file__).resolve().parent
MODES = ("finetune_lora", "finetune_lora_r32", "finetune_frozen_backbone", "finetune_full")
BASE_EMBODIMENT = "widowx_bridge"


def base_checkpoint(env: dict[str, str]) -> Path:
    """An untrained ``bench_smolvla`` checkpoint of another robot (written once into the cache)."""
    out = OWN_CACHE / "finetune_bench_base"
    if not (out / "config.json").is_file():
        cmd = [sys.executable, "-m", "vla.cli", "model", "init", "bench_smolvla", "--out", str(out),
               "--embodiment", BASE_EMBODIMENT, "--overwrite"]  # fmt: skip
        subprocess.run(cmd, check=True, env=env, capture_output=True)
    return out


def finetune_command(job: dict, run_dir: Path) -> list[str]:
    sets = {
        "data.datasets": f"[{job['dataset']}]",
        "data.stats_path": job["stats"],
        "data.batch_size": job["batch"],
        "data.num_workers": job["workers"],
        "data.chunk_length": CHUNK,
        "train.steps": job["steps"],
        "train.save_every": job["steps"],
        "train.seed": 0,
        "logging.every": 1,
        "logging.progress": "false",
    }
    args = [arg for k, v in sets.items() for arg in ("--set", f"{k}={v}")]
    return [sys.executable, "-m", "vla.cli", "finetune", job["base"], "--embodiment", job["robot"],
            "--run-dir", str(run_dir), "--preset", job["preset"], *args]  # fmt: skip


def child_finetune(job: dict) -> dict:
    """One mode: run it, then read its step times, memory, trainable count and checkpoint size."""
    run_dir = Path(tempfile.mkdtemp(prefix="vla-ft-bench-")) / "run"
    cmd = finetune_command(job, run_dir)
    env = {**os.environ, "VLA_CONFIG_DIR": job["config_dir"], "WANDB_MODE": "offline"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-3000:], "command": " ".join(cmd[1:])}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    start = next(r for r in rows if r.get("event") == "start")
    res = summarize_metrics(rows, job)
    step = max((run_dir / "checkpoints").glob("step-*"))
    weights = {f.name: f.stat().st_size for f in step.glob("*.safetensors")}
    res |= {
        "wall_s_total": wall,
        "command": "vla " + " ".join(cmd[3:]),
        "parameters": start.get("parameters"),
        "trainable": start.get("trainable"),
        "checkpoint_weight_files_bytes": weights,
        "peak_rss_any_process_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        **{k: job[k] for k in ("steps", "warmup", "batch", "workers", "preset")},
    }
    shutil.rmtree(run_dir.parent, ignore_errors=True)
    return res


def summarize(res: dict) -> None:
    """Adapter size against the full model file, and each mode's speed relative to LoRA r=16 and to LeRobot."""
    full = res["base"]["model_safetensors_bytes"]
    targets = {}
    for side in res["ours"].values():
        files = side.get("checkpoint_weight_files_bytes") or {}
        if "adapter.safetensors" in files:
            side["adapter_fraction_of_full_model"] = files["adapter.safetensors"] / full
    lora = res["ours"].get("finetune_lora", {})
    if "adapter_fraction_of_full_model" in lora:
        targets["lora_r16_adapter_le_10pct_of_model"] = lora["adapter_fraction_of_full_model"] <= 0.10
    peer = res.get("peer_lerobot", {}).get("fp32", {})
    for side in res["ours"].values():
        if side.get("samples_per_s_median_step") and peer.get("samples_per_s_median_step"):
            side["speedup_vs_lerobot_smolvla_median_step"] = (
                side["samples_per_s_median_step"] / peer["samples_per_s_median_step"]
            )
    res["targets"] = targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", nargs="?", default="bench", choices=["bench", "_child"])
    ap.add_argument("job", nargs="?")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.cmd == "_child":
        print("RESULT " + json.dumps(child_finetune(json.loads(args.job))), flush=True)
        return
    if args.warmup < 1 or args.steps <= args.warmup:
        ap.error(f"need 1 <= --warmup < --steps, got warmup {args.warmup}, steps {args.steps}")
    from data_loader import ensure_lerobot_dataset

    from vla.data.readers import open_dataset
    from vla.models.tiny import tiny_backbone_path

    OWN_CACHE.mkdir(parents=True, exist_ok=True)
    dataset, provenance = ensure_lerobot_dataset()
    robot = open_dataset(dataset).robot_type
    config_dir = bench_config_dir(robot)
    env = {**os.environ, "VLA_CONFIG_DIR": str(config_dir)}
    stats = write_stats(dataset, env)
    tiny_backbone_path("smolvlm", "bench")  # built once, outside the timed runs
    base = base_checkpoint(env)
    common = {"steps": args.steps, "warmup": args.warmup, "batch": args.batch, "workers": args.workers}
    res: dict = {
        "benchmark": "finetune",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "setting": {**common, "threads": args.threads, "action_chunk": CHUNK, "model": "bench_smolvla"},
        "dataset": {"path": str(dataset), "provenance": provenance, "robot_type": robot},
        "base": {"path": str(base), "model_safetensors_bytes": (base / "model.safetensors").stat().st_size},
        "ours": {},
    }
    for preset in args.modes.split(","):
        job = {**common, "preset": preset, "dataset": str(dataset), "stats": str(stats), "robot": robot,
               "base": str(base), "config_dir": str(config_dir)}  # fmt: skip
        res["ours"][preset] = run_child(__file__, job, env_extra={"OMP_NUM_THREADS": str(args.threads)})
    if not args.skip_peer:
        job = {**common, "amp": "fp32", "threads": args.threads, "root": str(dataset)}
        res["peer_lerobot"] = {"fp32": run_in_peer_venv(str(BENCH_DIR / "peer_lerobot_train.py"), job)}
    summarize(res)
    res["load_average_at_end"] = os.getloadavg()
    emit(res, args.out)


if __name__ == "__main__":
    main()
