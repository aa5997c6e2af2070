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
    from vla.data.video_encode import VideoEncoder
    from vla.sim.env import make

    out = Path(out)
    if out.suffix.lower() not in (".mp4", ".gif"):
        raise ValueError(f"--out {out}: the preview must be a .mp4 or .gif file")
    env = make(embodiment, task, randomization=randomization, image_size=image_size)
    obs, info = env.reset(seed=seed)
    frames = []
    while True:
        frames.append(np.concatenate([obs["images"][k] for k in obs["images"]], axis=1))
        obs, _, terminated, truncated, step_info = env.step(env.expert_action())
        if terminated or truncated:
            frames.append(np.concatenate([obs["images"][k] for k in obs["images"]], axis=1))
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    fps = 10
    if out.suffix.lower() == ".gif":
        from PIL import Image

        ims = [Image.fromarray(f) for f in frames]
        ims[0].save(out, save_all=True, append_images=ims[1:], duration=int(1000 / fps), loop=0)
    else:
        h, w = frames[0].shape[:2]
        enc = VideoEncoder(out, fps, h - h % 2, w - w % 2, vcodec="h264")
        for f in frames:
            enc.write(np.ascontiguousarray(f[: h - h % 2, : w - w % 2]))
        enc.close()
    print(
        f"{embodiment}/{task} seed {seed}: {info['instruction']!r}, success={bool(step_info.get('success'))}, "
        f"{len(frames) - 1} steps"
    )
    return out
