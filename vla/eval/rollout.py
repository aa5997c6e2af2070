"""``vla eval sim``: closed-loop episodes of one policy in the Gymnasium sim envs, in parallel, into ``results.json``.

Episode ``i`` of a run with ``--seed s`` starts from ``vla.sim.generate.episode_seed(s, i)``: the world, objects,
instruction and randomization record are a pure function of it, so every policy evaluated with the same
settings meets the same initial states (paired comparisons), and a run is reproducible episode by episode
whatever the worker count. Workers are spawned processes (a forked child inheriting an EGL context can hang),
each holding one env and one policy; results come back in episode order.

Per step the rollout asks the policy for a chunk only when the previous one is spent (``vla.eval.policies``),
and times the two halves separately: ``policy_time_s`` (inference, incl. the server round trip) and
``sim_time_s`` (physics + rendering + randomization).

Videos (``RUN_DIR/videos/episode_XXXX_<success|failure>.mp4``, the ``primary`` camera): every ``video_every``-th
episode, plus the first success and the first failure when none of those was sampled (re-simulated from its seed
afterwards: episodes are deterministic).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vla.eval.stats import grouped_summary, success_summary
from vla.workers import ordered_map

FORMAT_VERSION = 1
RESULTS_FILE = "results.json"


@dataclass(frozen=True)
class EvalConfig:
    """One ``vla eval sim`` run. ``execute_steps``: actions run per chunk (None = the whole chunk)."""

    policy: str
    embodiment: str
    task: str
    episodes: int
    out: str
    randomization: str = "none"
    workers: int = 1
    seed: int = 0
    execute_steps: int | None = None
    image_size: int = 128
    max_steps: int | None = None
    video_every: int = 0
    via_server: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    num_steps: int | None = None

    def __post_init__(self) -> None:
        if self.episodes < 1:
            raise ValueError(f"--episodes must be >= 1, got {self.episodes}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.video_every < 0:
            raise ValueError(f"--video-every must be >= 0 (0 = no sampled videos), got {self.video_every}")
        if not 16 <= self.image_size <= 1024:
            raise ValueError(f"--image-size must be in [16, 1024], got {self.image_size}")


# ---- one episode (runs in a worker) -------------------------------------------------------------------------
_CONTEXT: tuple[tuple, Any, Any] | None = None  # (settings, env, policy): one of each per process


def _context(cfg: EvalConfig) -> tuple[Any, Any]:
    global _CONTEXT
    key = (cfg.policy, cfg.embodiment, cfg.task, cfg.randomization, cfg.image_size, cfg.max_steps,
           cfg.execute_steps, cfg.via_server, cfg.device, cfg.dtype, cfg.num_steps)  # fmt: skip
    if _CONTEXT is None or _CONTEXT[0] != key:
        os.environ.setdefault("MUJOCO_GL", "egl")
        from vla.eval.policies import make_policy
        from vla.sim.env import make

        env = make(cfg.embodiment, cfg.task, randomization=cfg.randomization, image_size=cfg.image_size,
                   max_steps=cfg.max_steps)  # fmt: skip
        policy = make_policy(cfg.policy, env.embodiment_spec.name, execute_steps=cfg.execute_steps,
                             via_server=cfg.via_server, device=cfg.device, dtype=cfg.dtype,
                             num_steps=cfg.num_steps)  # fmt: skip
        if _CONTEXT is not None:
            _CONTEXT[1].close()
        _CONTEXT = (key, env, policy)
    return _CONTEXT[1], _CONTEXT[2]


def run_episode(cfg: EvalConfig, index: int, *, record: bool = False) -> dict[str, Any]:
    """Episode ``index``: its result row, and with ``record`` its ``primary`` frames (``"frames"`` [T+1, H, W, 3])."""
    from vla.sim.generate import episode_seed

    env, policy = _context(cfg)
    seed = episode_seed(cfg.seed, index)
    obs, info = env.reset(seed=seed)
    policy.reset(env, seed)
    observe = getattr(policy, "observe", None)  # policies with an observation history see every frame
    if observe is not None:
        observe(obs)
    frames = [obs["images"]["primary"]] if record else []
    queue: list[np.ndarray] = []
    policy_s = sim_s = 0.0
    steps, calls, success, diverged, non_finite = 0, 0, False, False, False
    distances: list[float] = []  # TCP to the named object's top, per step (tasks whose goal names an object)
    # the object the TCP is over (horizontally nearest) at the episode's last step that had one: where it went
    ended: tuple[str, float, bool] | None = None
    while True:
        if not queue:
            t0 = time.perf_counter()
            queue = list(policy.act(obs, env, steps))
            policy_s += time.perf_counter() - t0
            calls += 1
        t0 = time.perf_counter()
        obs, _, terminated, truncated, step_info = env.step(queue.pop(0))
        sim_s += time.perf_counter() - t0
        if step_info.get("non_finite_action"):  # nothing was simulated: not a step, no new frame
            non_finite = True
            break
        steps += 1
        if step_info.get("target_distance_m") is not None:
            distances.append(float(step_info["target_distance_m"]))
        if step_info.get("nearest_object") is not None:
            ended = step_info["nearest_object"]
        if observe is not None:
            observe(obs)
        if record:
            frames.append(obs["images"]["primary"])
        if terminated or truncated:
            success = bool(step_info["success"])
            diverged = bool(step_info.get("physics_diverged", False))
            break
    row = {
        "index": index,
        "seed": seed,
        "success": success,
        "steps": steps,  # control steps simulated (a NaN/inf action ends the episode before its step)
        "physics_diverged": diverged,  # the simulation blew up (a failure, ended there)
        "non_finite_action": non_finite,  # the policy output NaN or inf (a failure, ended there)
        # closest and last distance (m) of the TCP to the named object's top: graded progress next to success
        "min_target_distance_m": round(min(distances), 5) if distances else None,
        "final_target_distance_m": round(distances[-1], 5) if distances else None,
        # where the TCP ended: over which object (named or distractor; horizontally nearest), how far off (m,
        # horizontal) and whether it is the named one. Wrong object: a grounding failure; far from every object:
        # a localisation one
        "end_object": ended[0] if ended else None,
        "end_object_distance_m": round(ended[1], 5) if ended else None,
        "end_object_is_target": ended[2] if ended else None,
        "policy_calls": getattr(policy, "queries", calls),  # a broker-driven policy counts its chunk requests
        "instruction": info["instruction"],
        "task": cfg.task,
        "embodiment": env.embodiment_spec.name,
        "level": info["randomization"].get("level", "none") if info["randomization"] else "none",
        "randomization": info["randomization"],
        "final_state": [
            round(float(x), 6) for x in obs["state"]
        ],  # where the robot ended (a trajectory digest)
        "policy_time_s": policy_s,
        "sim_time_s": sim_s,
    }
    if record:
        row["frames"] = np.stack(frames)
    return row


def _init_worker(threads: int) -> None:
    """Give each spawned worker its share of the cores before torch is imported: W workers each starting one
    OpenMP thread per core oversubscribe the machine and spin against each other (measured here: 2 workers x 2
    threads on 2 cores made a tiny model's chunk 300x slower)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    # A spawned worker first re-imports the parent's main module; when that imports torch (a user's script, or one
    # that imports vla.sim), torch has already sized its pool by the cores, so the variables above come too late.
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def _worker(args: tuple[EvalConfig, int, bool]) -> dict[str, Any]:
    cfg, index, record = args
    row = run_episode(cfg, index, record=record)
    if record:  # encode here, in parallel, and send back only the path
        row["video"] = _write_video(cfg, row)
    return row


def _write_video(cfg: EvalConfig, row: dict[str, Any]) -> str:
    from vla.data.preview import write_preview

    frames = row.pop("frames")
    name = f"episode_{row['index']:04d}_{'success' if row['success'] else 'failure'}.mp4"
    out = Path(cfg.out) / "videos" / name
    fps = _context(cfg)[0].control_hz
    write_preview(out, list(frames), fps)
    return str(out.relative_to(cfg.out))


def count_diverged(rows: list[dict[str, Any]]) -> int:
    """Episodes among ``rows`` that the simulation ended by blowing up (``physics_diverged``; failures)."""
    return sum(bool(r.get("physics_diverged")) for r in rows)


def count_non_finite(rows: list[dict[str, Any]]) -> int:
    """Episodes among ``rows`` that ended because the policy output NaN or inf (``non_finite_action``; failures)."""
    return sum(bool(r.get("non_finite_action")) for r in rows)


def distance_summary(rows: list[dict[str, Any]]) -> dict[str, float | int | None] | None:
    """Mean closest and mean final TCP-to-target distance (m) and how often the object the TCP ended over was
    the named one (``end_object_is_target_rate``), or None when the task names no object. The final
    mean leaves out episodes whose physics diverged (an object launched by a contact blow-up can be metres away by
    the step the divergence is detected; None when every episode diverged, so results.json stays valid JSON);
    ``diverged`` counts them."""
    closest = [r["min_target_distance_m"] for r in rows if r.get("min_target_distance_m") is not None]
    chose = [bool(r["end_object_is_target"]) for r in rows if r.get("end_object_is_target") is not None]
    final = [r["final_target_distance_m"] for r in rows
             if r.get("final_target_distance_m") is not None and not r.get("physics_diverged")]  # fmt: skip
    if not closest:
        return None
    return {
        "episodes": len(closest),
        "min_mean": float(np.mean(closest)),
        "final_mean": float(np.mean(final)) if final else None,
        "diverged": count_diverged(rows),
        # share of episodes that ended over the named object (a policy that picks one of the candidate objects at
        # random: 1 / their number)
        "end_object_is_target_rate": float(np.mean(chose)) if chose else None,
    }


# ---- the run ----------------------------------------------------------------------------------------------
def summarize(cfg_fields: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``results.json`` object of a run from its configuration and its episode rows (index order)."""
    summary = success_summary([r["success"] for r in rows])
    policy_s = sum(r["policy_time_s"] for r in rows)
    sim_s = sum(r["sim_time_s"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    return {
        "format_version": FORMAT_VERSION,
        "policy": cfg_fields["policy"],
        "embodiment": rows[0]["embodiment"] if rows else cfg_fields["embodiment"],
        "task": cfg_fields["task"],
        "randomization": cfg_fields["randomization"],
        **summary,
        "physics_diverged": count_diverged(rows),
        "non_finite_actions": count_non_finite(rows),
        "seed": cfg_fields["seed"],
        "execute_steps": cfg_fields.get("execute_steps"),
        "breakdown": {key: grouped_summary(rows, key) for key in ("task", "embodiment", "level")},
        "target_distance_m": distance_summary(rows),
        "timing": {
            "policy_time_s": policy_s,
            "sim_time_s": sim_s,
            "steps": steps,
            "policy_ms_per_call": 1e3 * policy_s / max(1, sum(r["policy_calls"] for r in rows)),
            "sim_ms_per_step": 1e3 * sim_s / max(1, steps),
        },
        "config": cfg_fields,
        "episodes_detail": rows,
    }


def evaluate(cfg: EvalConfig, *, progress_bar: bool = True) -> dict[str, Any]:
    """Run every episode (``cfg.workers`` spawned processes), write ``RUN_DIR/results.json`` and the videos;
    returns the results object."""
    from tqdm import tqdm

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    jobs = [(cfg, i, cfg.video_every > 0 and i % cfg.video_every == 0) for i in range(cfg.episodes)]
    workers = min(cfg.workers, cfg.episodes)
    threads = max(1, (os.cpu_count() or 1) // workers)
    results = ordered_map(_worker, jobs, workers=cfg.workers, initializer=_init_worker, initargs=(threads,),
                          describe=lambda job: f"episode {job[1]}", kill_name="eval.worker", what="episode")  # fmt: skip
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=cfg.episodes, desc=f"eval {Path(cfg.policy).name} {cfg.embodiment}/{cfg.task}",
               disable=not progress_bar, unit="ep")  # fmt: skip
    try:
        for row in results:
            rows.append(row)
            bar.update(1)
            bar.set_postfix(success=f"{sum(r['success'] for r in rows)}/{len(rows)}")
    finally:
        bar.close()
        results.close()  # stops the workers (an error or Ctrl-C included)
    if cfg.video_every > 0:
        _add_outcome_videos(cfg, rows)
    results_obj = summarize(asdict(cfg), rows)
    results_obj["timing"]["wall_time_s"] = time.perf_counter() - started
    results_obj["timing"]["episodes_per_s"] = cfg.episodes / results_obj["timing"]["wall_time_s"]
    results_obj["videos"] = sorted(r["video"] for r in rows if "video" in r)
    write_results(out, results_obj)
    return results_obj


def _add_outcome_videos(cfg: EvalConfig, rows: list[dict[str, Any]]) -> None:
    """Record the first success and the first failure when the sample has no video of that outcome."""
    for outcome in (True, False):
        if any("video" in r and r["success"] == outcome for r in rows):
            continue
        first = next((r for r in rows if r["success"] == outcome), None)
        if first is not None:
            again = run_episode(cfg, first["index"], record=True)
            first["video"] = _write_video(cfg, again)


def write_results(out: str | Path, results: dict[str, Any]) -> Path:
    path = Path(out) / RESULTS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, allow_nan=False))
    os.replace(tmp, path)
    return path


def load_results(run: str | Path) -> dict[str, Any]:
    """A run's ``results.json`` (``run`` is the run folder or the file)."""
    path = Path(run)
    path = path / RESULTS_FILE if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no eval results here; write them with `vla eval sim ... --out {run}`"
        )
    return json.loads(path.read_text())


__all__ = [
    "RESULTS_FILE",
    "EvalConfig",
    "evaluate",
    "load_results",
    "run_episode",
    "summarize",
    "write_results",
]
