"""``vla sim preview``: one scripted-expert episode rendered so a person can look at it (cameras side by side,
the instruction and success in the file name's log line)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def preview_expert(
    embodiment: str,
    task: str,
    out: str | Path,
    *,
    seed: int = 0,
    randomization: str = "none",
    image_size: int = 192,
) -> Path:
    """Write ``out`` (.mp4 or .gif) of the expert solving ``task`` on ``embodiment`` for episode seed ``seed``."""
    from vla.data.preview import preview_path, write_preview
    from vla.sim.env import make

    out = preview_path(out)
    env = make(embodiment, task, randomization=randomization, image_size=image_size)
    obs, info = env.reset(seed=seed)
    frames = []
    while True:
        frames.append(np.concatenate([obs["images"][k] for k in obs["images"]], axis=1))
        obs, _, terminated, truncated, step_info = env.step(env.expert_action())
        if terminated or truncated:
            frames.append(np.concatenate([obs["images"][k] for k in obs["images"]], axis=1))
            break
    write_preview(out, frames, env.control_hz)
    print(
        f"{embodiment}/{task} seed {seed}: {info['instruction']!r}, success={bool(step_info.get('success'))}, "
        f"{len(frames) - 1} steps"
    )
    return out
