#!/usr/bin/env python3
"""Closed-loop evaluation speed (one JSON line): episodes/s of ``vla eval sim`` with an untrained tiny model and
with ``bench_smolvla`` (SmolVLA-sized: 224 px, 8+8 layers, chunk 50, 10 flow steps), on 1 and 2 workers, split into
policy time (inference) and sim time (physics + rendering), plus the scripted expert (sim time only), so users can
plan eval budgets. ``episodes_per_s`` counts the whole run (spawning workers, loading the model once per worker);
``episodes_per_s_steady`` only the time inside episodes (what long runs approach). Checkpoints come from ``vla model init`` with stats of a 2-episode generated dataset.

    .venv/bin/python benchmarks/eval.py [--embodiment widowx] [--task reach] [--episodes 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from harness import cpu_model, emit

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    from vla.cli import main as vla
    from vla.eval.rollout import EvalConfig, evaluate

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--embodiment", default="widowx")
    ap.add_argument("--task", default="reach")
    ap.add_argument("--episodes", type=int, default=6)
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--models", default="tiny_smolvlm,bench_smolvla")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="vla-bench-eval-"))
    ds = tmp / "ds"
    assert vla(["sim", "generate", "--embodiment", args.embodiment, "--task", args.task, "--episodes", "2",
                "--image-size", "32", "--out", str(ds)]) == 0  # fmt: skip
    assert vla(["data", "stats", str(ds)]) == 0
    spec = f"sim_{args.embodiment.removeprefix('sim_')}"
    res: dict = {"benchmark": "eval", "embodiment": spec, "task": args.task, "episodes": args.episodes,
                 "image_size": args.image_size, "cpu": cpu_model(), "cpu_count": os.cpu_count(), "runs": {}}  # fmt: skip
    policies = [("expert", "expert")]
    for model in args.models.split(","):
        ckpt = tmp / model
        assert (
            vla(["model", "init", model, "--out", str(ckpt), "--embodiment", spec, "--stats-from", str(ds)])
            == 0
        )
        policies.append((model, str(ckpt)))
    for name, policy in policies:
        for workers in [int(w) for w in args.workers.split(",")]:
            cfg = EvalConfig(policy=policy, embodiment=args.embodiment, task=args.task, episodes=args.episodes,
                             out=str(tmp / f"run_{name}_{workers}"), workers=workers, image_size=args.image_size)  # fmt: skip
            t0 = time.perf_counter()
            out = evaluate(cfg, progress_bar=False)
            wall = time.perf_counter() - t0
            t = out["timing"]
            busy = t["policy_time_s"] + t["sim_time_s"]
            res["runs"][f"{name}/workers_{workers}"] = {
                "episodes_per_s": args.episodes / wall,  # incl. spawning workers and loading the model
                "episodes_per_s_steady": args.episodes * workers / busy,  # policy + sim time only
                "wall_s": wall,
                "steps": t["steps"],
                "policy_ms_per_call": t["policy_ms_per_call"],
                "sim_ms_per_step": t["sim_ms_per_step"],
                "policy_share": t["policy_time_s"] / busy if busy else 0.0,
                "sim_share": t["sim_time_s"] / busy if busy else 0.0,
                "policy_calls": sum(e["policy_calls"] for e in out["episodes_detail"]),
                "success_rate": out["success_rate"],
            }
    emit(res, args.out)


if __name__ == "__main__":
    main()
