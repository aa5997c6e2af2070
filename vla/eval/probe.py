"""``vla eval probe``: does a checkpoint look at the scene and read the instruction, or replay an average motion
from its proprioception? A diagnosis for when offline loss is low but closed-loop success is not.

Behaviour cloning has a well-known shortcut: the expert's next action is close to the current joint positions,
so a policy can reach a low loss by copying its state forward and never learn where the named object is. Such a
policy plays the same first chunk in every episode and fails in closed loop, whatever its validation loss says.

The probe measures this at the first observation of ``episodes`` sim episodes (the arm at its start pose, the
target anywhere): the checkpoint's first chunk (mean over ``samples`` noise draws, the same draws for every input),
the scripted expert's first ``H`` actions from the same state, and the chunk again with one input changed. Over the
arm's joint dims (robot units), episode ``i`` paired with episode ``i + 1``:

* ``spread_ratio``: across episodes, the std of the policy's chunk over the std of the expert's (each averaged
  over steps and dims). 1: the policy varies its first motion as much as the target requires; ~0: one motion for all.
* ``image_sensitivity``: mean ``|chunk(episode i's images -> episode i+1's) - chunk|`` over the mean
  ``|expert(i+1) - expert(i)|``. What the scene alone moves, against what the target's place should move.
* ``instruction_sensitivity``: the same with episode ``i + 1``'s instruction (same scene): does the named object
  matter? (Counted over pairs whose instructions differ.)
* ``state_response``: mean ``|chunk(state + shift on every joint) - chunk|`` over ``shift``. ~1: the chunk moves
  one for one with the proprioception (copying it); a policy that aims at the target corrects towards it, below 1.
* ``first_chunk_error``: mean ``|chunk - expert|`` (robot units), next to the expert's own motion over the chunk;
  ``error_vs_mean_motion``: that error over the error of playing the expert's average first chunk in every episode.
  A policy that found the target is well below 1; at or above 1 its chunk is no better than the average motion,
  however much it reacts to the inputs (the sensitivities measure how much it reacts, not whether correctly).

    vla eval probe runs/pretrain --embodiment panda --task reach --episodes 20 --out runs/probe.json
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class ProbeInputs:
    """What the probe compares, per episode ``i`` ``[n, H, D]`` (D = the arm's joint dims, robot units).

    ``pred``: the chunk at episode ``i``'s first observation; ``expert``: the expert's first ``H`` actions from
    the same state; ``image_swap``/``instruction_swap``: the chunk with episode ``(i + 1) % n``'s images or
    instruction; ``state_shift``: with ``shift`` added to every joint of the state; ``instruction_differs`` [n]:
    whether episode ``i + 1``'s instruction differs from ``i``'s."""

    pred: np.ndarray
    expert: np.ndarray
    image_swap: np.ndarray
    instruction_swap: np.ndarray
    state_shift: np.ndarray
    shift: float
    instruction_differs: np.ndarray


def summarize(x: ProbeInputs) -> dict[str, float | None]:
    """The probe's numbers (module docstring) from its inputs; None where undefined (fewer than 2 episodes, or no
    pair of episodes with different instructions)."""
    n = len(x.pred)
    if n < 2:
        return {k: None for k in ("spread_ratio", "image_sensitivity", "instruction_sensitivity", "state_response",
                                  "first_chunk_error", "error_vs_mean_motion", "expert_motion")}  # fmt: skip
    nxt = np.roll(np.arange(n), -1)
    expert_change = float(np.abs(x.expert[nxt] - x.expert).mean())
    expert_spread = float(x.expert.std(0).mean())
    spread = float(x.pred.std(0).mean()) / expert_spread if expert_spread > 0 else None
    differs = np.asarray(x.instruction_differs, bool)
    instr = None
    if differs.any():  # against the expert's change over the same pairs
        change = float(np.abs(x.expert[nxt][differs] - x.expert[differs]).mean())
        instr = (
            float(np.abs(x.instruction_swap[differs] - x.pred[differs]).mean()) / change if change else None
        )
    error = float(np.abs(x.pred - x.expert).mean())
    mean_motion_error = float(np.abs(x.expert - x.expert.mean(0)).mean())
    return {
        "spread_ratio": spread,
        "image_sensitivity": float(np.abs(x.image_swap - x.pred).mean()) / expert_change
        if expert_change
        else None,
        "instruction_sensitivity": instr,
        "state_response": float(np.abs(x.state_shift - x.pred).mean()) / x.shift,
        "first_chunk_error": error,
        "error_vs_mean_motion": error / mean_motion_error if mean_motion_error > 0 else None,
        "expert_motion": float(np.abs(x.expert[:, -1] - x.expert[:, 0]).mean()),
    }


def verdict(s: dict[str, float | None]) -> list[str]:
    """Plain-language reading of ``summarize``'s numbers (the thresholds are rules of thumb, printed with them)."""
    out = []
    if s["spread_ratio"] is not None and s["spread_ratio"] < 0.25:
        out.append(f"the first chunk barely depends on the episode (spread ratio {s['spread_ratio']:.2f} < 0.25): "
                   "the policy plays about one motion for every target")  # fmt: skip
    if s["image_sensitivity"] is not None and s["image_sensitivity"] < 0.25:
        out.append(f"changing the scene hardly changes the chunk (image sensitivity {s['image_sensitivity']:.2f} "
                   "< 0.25): the policy does not use the camera to find the target")  # fmt: skip
    if s["instruction_sensitivity"] is not None and s["instruction_sensitivity"] < 0.25:
        out.append(f"naming another object hardly changes the chunk (instruction sensitivity "
                   f"{s['instruction_sensitivity']:.2f} < 0.25): the policy does not follow the instruction")  # fmt: skip
    if s["state_response"] is not None and s["state_response"] > 0.75:
        out.append(f"the chunk follows the state one for one (state response {s['state_response']:.2f} > 0.75): "
                   "the policy copies its proprioception forward")  # fmt: skip
    if s["error_vs_mean_motion"] is not None and s["error_vs_mean_motion"] > 0.8:
        out.append(f"the first chunk is hardly closer to the expert's than the average motion is (error ratio "
                   f"{s['error_vs_mean_motion']:.2f} > 0.8): the policy has not found the target")  # fmt: skip
    return out or ["no shortcut found at the first observation"]


def probe(policy: str | Path, embodiment: str, task: str, *, episodes: int = 20, seed: int = 0,
          image_size: int = 128, randomization: Any = "low", samples: int = 4, shift: float = 0.05,
          device: str = "cpu", dtype: str = "float32") -> dict[str, Any]:  # fmt: skip
    """Run the probe on ``episodes`` sim episodes (episode ``i`` from seed ``(seed, i)``, as ``vla eval sim``)."""
    if episodes < 2:
        raise ValueError(f"--episodes must be at least 2 (the probe compares episodes), got {episodes}")
    if samples < 1 or shift <= 0:
        raise ValueError(f"--samples must be >= 1 and --shift > 0, got {samples} and {shift}")
    os.environ.setdefault("MUJOCO_GL", "egl")
    from vla.eval.policies import CheckpointPolicy
    from vla.sim.env import make
    from vla.sim.generate import episode_seed
    from vla.types import Observation

    env = make(embodiment, task, randomization=randomization, image_size=image_size)
    try:
        cp = CheckpointPolicy(policy, env.embodiment_spec.name, device=device, dtype=dtype)
        horizon = int(cp.policy.metadata()["embodiments"][env.embodiment_spec.name]["chunk_length"])
        firsts: list[tuple[Observation, np.ndarray]] = []
        for i in range(episodes):
            s = episode_seed(seed, i)
            obs, _ = env.reset(seed=s)
            cp.reset(env, s)
            cp.observe(obs)
            o = cp.observation(obs, env)
            expert = []
            for _ in range(horizon):
                a = env.expert_action()
                expert.append(a)
                env.step(a)
            firsts.append((o, np.asarray(expert, np.float64)))
        dims = np.asarray(env.world.bound.joint_dims)  # the arm's joints in the state/action vector
    finally:
        env.close()

    def chunk(o: Observation) -> np.ndarray:
        draws = [np.asarray(cp.policy.infer(o, seed=k).actions, np.float64) for k in range(samples)]
        return np.mean(draws, 0)[:, dims]

    rows, pred, exp, img, ins, sta, differs = [], [], [], [], [], [], []
    for i, (o, expert) in enumerate(firsts):
        other = firsts[(i + 1) % episodes][0]
        state = np.array(o.state, np.float32)
        state[dims] += shift
        p = chunk(o)
        pred.append(p)
        exp.append(expert[: len(p), dims])
        img.append(chunk(Observation(other.images, o.state, o.prompt, o.embodiment)))
        ins.append(chunk(Observation(o.images, o.state, other.prompt, o.embodiment)))
        sta.append(chunk(Observation(o.images, state, o.prompt, o.embodiment)))
        differs.append(other.prompt != o.prompt)
        rows.append({"episode": i, "seed": episode_seed(seed, i), "instruction": o.prompt,
                     "first_chunk_error": float(np.abs(p - exp[-1]).mean())})  # fmt: skip
    inputs = ProbeInputs(np.stack(pred), np.stack(exp), np.stack(img), np.stack(ins), np.stack(sta), shift,
                         np.asarray(differs))  # fmt: skip
    summary = summarize(inputs)
    return {
        "policy": str(policy),
        "embodiment": env.embodiment_spec.name,
        "task": task,
        "randomization": randomization if isinstance(randomization, str) else str(randomization),
        "episodes": episodes,
        "seed": seed,
        "samples": samples,
        "shift": shift,
        "summary": summary,
        "verdict": verdict(summary),
        "episodes_detail": rows,
    }


def write_probe(result: dict[str, Any], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    return out


__all__ = ["ProbeInputs", "probe", "summarize", "verdict", "write_probe"]
