#!/usr/bin/env python3
"""Simulation speed (one JSON line): raw ``mj_step`` rate of the scene, env control steps/s with two 128-px
cameras (and its parts: physics, rendering, expert + control), and ``vla sim generate`` episodes/s on 1 and 2
workers. Target: physics + control overhead <= 2x raw stepping, so rendering is the only real cost.

    .venv/bin/python benchmarks/sim_generation.py [--embodiment panda] [--task pick_place] [--episodes 24]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from harness import cpu_model, emit

os.environ.setdefault("MUJOCO_GL", "egl")


def main() -> None:
    import mujoco

    from vla.sim.env import make
    from vla.sim.generate import GenerateConfig, generate

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--embodiment", default="panda")
    ap.add_argument("--task", default="pick_place")
    ap.add_argument("--episodes", type=int, default=24)  # enough that the pool's start-up is not the story
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    env = make(args.embodiment, args.task, image_size=args.image_size)
    env.reset(seed=0)
    world = env.world
    m, d = world.model, world.data
    # raw physics of the very same scene
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        mujoco.mj_step(m, d)
    raw_rate = n / (time.perf_counter() - t0)
    # env steps, split into parts by timing the same work separately
    steps, t_phys, t_render, t_total = 0, 0.0, 0.0, 0.0
    for seed in range(3):
        env.reset(seed=seed)
        done = False
        while not done:
            t0 = time.perf_counter()
            action = env.expert_action()
            t1 = time.perf_counter()
            env.world.act(action, env.substeps)
            t2 = time.perf_counter()
            for slot in env.slots:
                env.world.render(slot)
            t3 = time.perf_counter()
            done = env.is_success() or env.step_index >= env.max_steps
            env.step_index += 1
            t4 = time.perf_counter()
            steps += 1
            t_phys += t2 - t1
            t_render += t3 - t2
            t_total += t4 - t0
    physics_control = t_total - t_render
    raw_equivalent = steps * env.substeps / raw_rate
    res = {
        "benchmark": "sim_generation",
        "cpu_model": cpu_model(),
        "embodiment": args.embodiment,
        "task": args.task,
        "image_size": args.image_size,
        "cameras": env.slots,
        "substeps_per_control_step": env.substeps,
        "raw_mj_step_per_s": raw_rate,
        "env_steps_per_s": steps / t_total,
        "env_steps_per_s_without_rendering": steps / physics_control,
        "ms_per_step": {
            "physics": 1e3 * t_phys / steps,
            "render_all_cameras": 1e3 * t_render / steps,
            "expert_control_and_checks": 1e3 * (physics_control - t_phys) / steps,
        },
        "physics_plus_control_over_raw_stepping": physics_control / raw_equivalent,
        "generate": {},
    }
    for workers in (1, 2):
        tmp = Path(tempfile.mkdtemp(prefix="vla-simbench-"))
        cfg = GenerateConfig(
            embodiment=args.embodiment,
            task=args.task,
            episodes=args.episodes,
            out=str(tmp / "ds"),
            workers=workers,
            image_size=args.image_size,
            keep_failed=True,
        )
        t0 = time.perf_counter()
        counts = generate(cfg, progress_bar=False)
        dt = time.perf_counter() - t0
        frames = int(json.loads((tmp / "ds" / "meta" / "info.json").read_text())["total_frames"])
        res["generate"][f"workers_{workers}"] = {
            "episodes": counts["written"],
            "seconds": dt,
            "episodes_per_s": counts["written"] / dt,
            "frames_per_s": frames / dt,
        }
        shutil.rmtree(tmp, ignore_errors=True)
    res["cpu_count"] = os.cpu_count()
    emit(res, args.out)


if __name__ == "__main__":
    main()
