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
    settle_steps: int | None = None,
) -> Path:
    """Write ``out`` (.mp4 or .gif) of the expert solving ``task`` on ``embodiment`` for episode seed ``seed``, with
    the settle steps ``vla sim generate`` records after success (``vla.sim.generate.settle_steps``)."""
    from vla.data.preview import preview_path, write_preview
    from vla.sim.env import make
    from vla.sim.generate import expert_rollout
    from vla.sim.generate import settle_steps as settle_for

    out = preview_path(out)
    env = make(embodiment, task, randomization=randomization, image_size=image_size)
    observations, actions, info = expert_rollout(env, seed, settle_for(settle_steps, env.control_hz))
    frames = [np.concatenate(list(o["images"].values()), axis=1) for o in [*observations, info["final_obs"]]]
    write_preview(out, frames, env.control_hz)
    fired = info["success_step"]
    print(
        f"{embodiment}/{task} seed {seed}: {info['instruction']!r}, success={info['success']}, {len(actions)} steps"
        + (f" (success detected at step {fired}, then {len(actions) - fired} settle steps)" if fired else "")
    )
    return out
