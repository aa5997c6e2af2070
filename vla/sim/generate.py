"""``vla sim generate``: scripted-expert demonstrations at scale, written as a LeRobot v3.0 dataset.

Workers are spawned (not forked): a forked child inheriting the parent's EGL/OpenGL context can hang.
Each episode is a pure function of (seed, episode index): its RNG seed is ``SeedSequence([seed, index])``, so the
data does not depend on the worker count or order. Workers (processes) simulate, render and encode each kept
episode's camera streams (``encode_episode``: the MP4s and their stats, the costly part of writing); the main
process appends them in index order through ``LeRobotWriter.add_encoded_episode`` (stream-copy concatenation and
metadata, atomic per episode), so

* ``--workers W`` gives the same dataset for any W,
* ``--shard K --num-shards M`` writes the K-th contiguous block of episode indices (cluster array jobs), and
  ``vla data merge`` (``vla.data.merge``) joins the shards, copying their videos without re-encoding,
* re-running skips finished episodes (the ``sim_index`` of each written episode, plus a progress file for
  dropped ones), and Ctrl-C leaves a valid dataset of the finished episodes.

Recording goes on for ``settle_steps`` control steps after the success detector fires (default
``SETTLE_SECONDS`` of them): the detector fires the moment the task is done (for ``pick_place`` and ``stack``, as
soon as the opening fingers let go), so without them a demonstration would end with the object still between the
fingers and the gripper-open command on one frame only; the settle steps show the release and the retreat. An
episode counts as successful when the detector fired and still holds at its end (an object knocked out of the
bowl while retreating is a failure).

Unsuccessful demonstrations are dropped unless ``keep_failed`` (then kept and flagged ``success: false`` in the
episode metadata), never silently mixed in. Every episode's metadata holds its seed, index, instruction, success
(and ``success_step``: the frame at which the detector fired, ``settle_steps``) and the full randomization record.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vla.data.writers.progress import WriteProgress, begin, finish, read_progress, save_progress
from vla.workers import ordered_map

log = logging.getLogger(__name__)
#: Seconds of control steps recorded after the success detector fires (release and retreat), by default.
SETTLE_SECONDS = 1.0


@dataclass(frozen=True)
class GenerateConfig:
    """What to generate. ``episodes`` counts all shards together; this run writes shard ``shard`` of ``num_shards``."""

    embodiment: str
    task: str
    episodes: int
    out: str
    workers: int = 1
    seed: int = 0
    randomization: str = "none"
    image_size: int = 128
    shard: int = 0
    num_shards: int = 1
    keep_failed: bool = False
    vcodec: str = "av1"
    max_steps: int | None = None  # None = the task's default episode length
    settle_steps: int | None = None  # None = SETTLE_SECONDS of control steps

    def __post_init__(self) -> None:
        if self.episodes < 1:
            raise ValueError(f"--episodes must be >= 1, got {self.episodes}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(f"--shard must be in [0, --num-shards={self.num_shards}), got {self.shard}")
        if not 16 <= self.image_size <= 1024:
            raise ValueError(f"--image-size must be in [16, 1024], got {self.image_size}")
        if self.settle_steps is not None and self.settle_steps < 0:
            raise ValueError(f"--settle-steps must be >= 0, got {self.settle_steps}")

    def identity(self) -> dict[str, Any]:
        """The settings a resumed run must share with the run that started the dataset, and how the servos follow
        actions (``SERVO_MODEL``): episodes of two servo models must not share a dataset."""
        from vla.sim.world import SERVO_MODEL

        keep = {k: v for k, v in asdict(self).items() if k not in ("workers", "out")}
        return {**keep, "servo_model": SERVO_MODEL}


def shard_range(episodes: int, shard: int, num_shards: int) -> range:
    """Contiguous block of episode indices of ``shard`` (sizes differ by at most one)."""
    base, extra = divmod(episodes, num_shards)
    start = shard * base + min(shard, extra)
    return range(start, start + base + (1 if shard < extra else 0))


def episode_seed(seed: int, index: int) -> int:
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


# ---- one episode (runs in a worker) -------------------------------------------------------------------------
_ENV: tuple[tuple, Any] | None = None  # (settings, env): one env per process, rebuilt when settings change


def _env(cfg: GenerateConfig):
    global _ENV
    key = (cfg.embodiment, cfg.task, cfg.randomization, cfg.image_size, cfg.max_steps)
    if _ENV is None or _ENV[0] != key:
        os.environ.setdefault("MUJOCO_GL", "egl")
        from vla.sim.env import make

        _ENV = (
            key,
            make(
                cfg.embodiment,
                cfg.task,
                randomization=cfg.randomization,
                image_size=cfg.image_size,
                max_steps=cfg.max_steps,
            ),
        )
    return _ENV[1]


def settle_steps(settle: int | None, control_hz: float) -> int:
    """Control steps recorded after success: ``settle``, or ``SETTLE_SECONDS`` at ``control_hz`` when None."""
    return int(settle) if settle is not None else round(SETTLE_SECONDS * control_hz)


def expert_rollout(
    env: Any, seed: int, settle: int
) -> tuple[list[dict[str, Any]], list[np.ndarray], dict[str, Any]]:
    """One scripted-expert episode of ``env`` (a ``VLASimEnv``): the observations before each action, the actions
    (float32 ``[A]``) and ``{"instruction", "randomization", "robot_params", "success", "success_step",
    "final_obs"}``. Runs until the detector fires plus ``settle`` steps, or until the env truncates."""
    obs, info = env.reset(seed=seed)
    observations: list[dict[str, Any]] = []
    actions: list[np.ndarray] = []
    success_step: int | None = None
    while success_step is None or len(actions) < success_step + settle:
        action = np.asarray(env.expert_action(), dtype=np.float32)
        observations.append(obs)
        actions.append(action)
        obs, _, terminated, truncated, _ = env.step(action)
        if success_step is None and terminated:
            success_step = len(actions)  # the first frame recorded after the detector fired
        elif success_step is None and truncated:
            break
    success = success_step is not None and env.is_success()
    out = {k: info.get(k) for k in ("instruction", "randomization", "robot_params")}
    return observations, actions, out | {"success": success, "success_step": success_step, "final_obs": obs}


def run_episode(cfg: GenerateConfig, index: int) -> dict[str, Any]:
    """Simulate episode ``index`` with the scripted expert: frames ``{feature: [T, ...]}``, tasks and metadata."""
    from vla.sim.world import SERVO_MODEL

    env = _env(cfg)
    seed = episode_seed(cfg.seed, index)
    settle = settle_steps(cfg.settle_steps, env.control_hz)
    observations, actions, info = expert_rollout(env, seed, settle)
    frames = {f"observation.images.{slot}": np.stack([o["images"][slot] for o in observations])
              for slot in observations[0]["images"]}  # fmt: skip
    frames["observation.state"] = np.stack([np.asarray(o["state"], dtype=np.float32) for o in observations])
    frames["action"] = np.stack(actions)
    success = bool(info["success"])
    meta = {
        "sim_index": index,
        "sim_seed": seed,
        "success": success,
        "success_step": -1 if info["success_step"] is None else int(info["success_step"]),
        "settle_steps": settle,
        "instruction": info["instruction"],
        "task_name": cfg.task,
        "embodiment": cfg.embodiment,
        "steps": len(actions),
        "randomization": info.get("randomization") or {},
        "servo_model": SERVO_MODEL,
    }
    if info.get("robot_params"):  # the procedural robot's arm of this episode (its spec covers every arm)
        meta["robot_params"] = info["robot_params"]
    return {
        "index": index,
        "frames": frames,
        "task": info["instruction"],
        "metadata": meta,
        "success": success,
    }


def produce_episode(cfg: GenerateConfig, index: int) -> dict[str, Any]:
    """``run_episode``, then for a kept episode its ``EncodedEpisode`` (``episode``) instead of raw ``frames``,
    plus what the writer is created with (``features``, ``fps``, ``robot_type``)."""
    from vla.data.writers.lerobot_episode import encode_episode

    res = run_episode(cfg, index)
    frames = res.pop("frames")
    if res["success"] or cfg.keep_failed:
        spec = _env(cfg).embodiment_spec
        res |= {"features": _features(frames), "fps": round(spec.control_hz), "robot_type": spec.name}
        videos = [k for k, f in res["features"].items() if f["dtype"] == "video"]
        res["episode"] = encode_episode(frames, videos, res["fps"], vcodec=cfg.vcodec)
    return res


def _worker(args: tuple[GenerateConfig, int]) -> dict[str, Any]:
    return produce_episode(*args)


# ---- the run ----------------------------------------------------------------------------------------------
#: the progress file of datasets generated before every writing command shared ``vla.data.writers.progress``
LEGACY_PROGRESS_FILE = "vla_sim_progress.json"
_FLAGS = {"workers": "--workers", "seed": "--seed", "randomization": "--randomization", "image_size": "--image-size",
          "shard": "--shard", "num_shards": "--num-shards", "settle_steps": "--settle-steps", "vcodec": "--vcodec",
          "max_steps": "--max-steps"}  # fmt: skip


def resume_command(cfg: GenerateConfig) -> str:
    """The ``vla sim generate`` command line that runs (or resumes) ``cfg`` from any folder."""
    args = ["vla", "sim", "generate", "--embodiment", cfg.embodiment, "--task", cfg.task,
            "--episodes", str(cfg.episodes), "--out", str(Path(cfg.out).resolve())]  # fmt: skip
    defaults = GenerateConfig(cfg.embodiment, cfg.task, cfg.episodes, cfg.out)
    for name, flag in _FLAGS.items():
        if (value := getattr(cfg, name)) != getattr(defaults, name):
            args += [flag, str(value)]
    return shlex.join([*args, *(["--keep-failed"] if cfg.keep_failed else [])])


def _begin(out: Path, cfg: GenerateConfig) -> WriteProgress:
    """``progress.begin`` for this run; a dataset an older vla started keeps its record of dropped episodes."""
    legacy = out / "meta" / LEGACY_PROGRESS_FILE
    if legacy.is_file() and read_progress(out) is None:
        old = json.loads(legacy.read_text())
        if old.get("config") != cfg.identity():
            raise ValueError(
                f"{out} was generated with {old.get('config')}; these settings differ ({cfg.identity()}). "
                "Use a new --out, or the same settings to resume."
            )
        save_progress(
            out, WriteProgress(resume_command(cfg), cfg.identity(), state={"dropped": old["dropped"]})
        )
        legacy.unlink()
    progress = begin(out, resume_command(cfg), cfg.identity())
    progress.state.setdefault("dropped", [])
    return progress


def _written_indices(out: Path) -> set[int]:
    """The ``sim_index`` of every episode already in the dataset (read after ``_begin`` recovered it)."""
    if not (out / "meta" / "info.json").is_file():
        return set()
    from vla.data.readers.lerobot import LeRobotReader

    reader = LeRobotReader(out)
    return {
        int(reader.episode_metadata("train", e)["sim_index"]) for e in range(reader.num_episodes("train"))
    }


def _features(frames: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    feats: dict[str, dict[str, Any]] = {}
    for key, arr in frames.items():
        if key.startswith("observation.images."):
            feats[key] = {"dtype": "video", "shape": list(arr.shape[1:])}
        else:
            feats[key] = {"dtype": "float32", "shape": list(arr.shape[1:])}
    return feats


def generate(cfg: GenerateConfig, *, progress_bar: bool = True) -> dict[str, Any]:
    """Run (or resume) a generation; returns counts ``{"written", "dropped", "skipped", "out"}``."""
    from tqdm import tqdm

    from vla.data.writers.lerobot import LeRobotWriter

    out = Path(cfg.out)
    progress = _begin(out, cfg)
    done = _written_indices(out) | set(progress.state["dropped"])
    todo = [i for i in shard_range(cfg.episodes, cfg.shard, cfg.num_shards) if i not in done]
    counts = {
        "written": 0,
        "dropped": 0,
        "skipped": len(shard_range(cfg.episodes, cfg.shard, cfg.num_shards)) - len(todo),
        "out": str(out),
    }
    if not todo:
        finish(out, progress)
        return counts
    # workers > 1: spawned processes (SIGKILLed if this one dies); a dead worker raises WorkerDied naming its episode
    results = ordered_map(_worker, [(cfg, i) for i in todo], workers=cfg.workers, kill_name="sim.worker",
                          describe=lambda job: f"episode {job[1]}", what="episode")  # fmt: skip
    writer = None
    # on a terminal only (tqdm checks stderr) unless progress_bar=False
    bar = tqdm(
        total=len(todo),
        desc=f"{cfg.embodiment}/{cfg.task}",
        disable=None if progress_bar else True,
        unit="ep",
    )
    try:
        for res in results:
            if "episode" in res:
                if writer is None:
                    writer = LeRobotWriter(
                        out,
                        fps=res["fps"],
                        features=res["features"],
                        robot_type=res["robot_type"],
                        vcodec=cfg.vcodec,
                        mode="append",
                    )
                    writer.progress = progress  # committed with each episode
                writer.add_encoded_episode(res["episode"], res["task"], res["metadata"])
                counts["written"] += 1
            else:
                progress.state["dropped"].append(res["index"])
                save_progress(out, progress)
                counts["dropped"] += 1
            bar.update(1)
            bar.set_postfix(kept=counts["written"], dropped=counts["dropped"])
    except KeyboardInterrupt:
        log.warning(
            "interrupted: %s holds the %d episodes finished so far; re-run to continue",
            out,
            counts["written"],
        )
        raise
    finally:
        bar.close()
        results.close()  # stops the workers
        if writer is not None:
            writer.finalize()
    finish(out, progress)
    return counts
