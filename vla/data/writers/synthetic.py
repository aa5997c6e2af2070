"""Small deterministic LeRobot datasets for tests and benchmarks (v3.0 through :class:`LeRobotWriter`, v2.1 here).

State and action vary smoothly with time; every camera frame shows its (episode, frame, camera) as binary
stripes coarse enough to survive lossy AV1/H.264, so :func:`decode_frame_code` tells exactly which frame a
reader returned.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from vla.data import video
from vla.data.writers.lerobot import DEFAULT_FEATURES, LeRobotWriter
from vla.data.writers.lerobot_episode import data_table, episode_stats, write_parquet

TASKS = ("pick up the red cube", "open the top drawer", "push the blue block to the left")
_BITS = 10  # stripes per row: frame and episode indices below 1024
_LOW, _HIGH = 48, 208


def frame_code_image(episode: int, frame: int, camera: int, height: int, width: int) -> np.ndarray:
    """uint8 ``[H, W, 3]``: rows of 10 stripes coding frame, episode and camera bits (MSB left), tinted per camera."""
    image = np.empty((height, width, 3), dtype=np.uint8)
    for row, value in enumerate((frame, episode, camera)):
        y0, y1 = row * height // 3, (row + 1) * height // 3
        for bit in range(_BITS):
            x0, x1 = bit * width // _BITS, (bit + 1) * width // _BITS
            image[y0:y1, x0:x1] = _HIGH if (value >> (_BITS - 1 - bit)) & 1 else _LOW
    image[..., 2] = image[..., 2] // 2 + 40 * (camera % 3)
    return image


def decode_frame_code(image: np.ndarray) -> tuple[int, int, int]:
    """``(episode, frame, camera)`` from a (decoded) :func:`frame_code_image`; robust to codec noise."""
    height, width = image.shape[:2]
    values = []
    for row in range(3):
        y0, y1 = row * height // 3, (row + 1) * height // 3
        value = 0
        for bit in range(_BITS):
            x0, x1 = bit * width // _BITS, (bit + 1) * width // _BITS
            dy, dx = max((y1 - y0) // 4, 0), max((x1 - x0) // 4, 0)
            center = image[y0 + dy : y1 - dy, x0 + dx : x1 - dx, :2].astype(np.float32)
            value = value << 1 | int(center.mean() > (_LOW + _HIGH) / 2)
        values.append(value)
    frame, episode, camera = values
    return episode, frame, camera


def synthetic_episode(
    episode: int, length: int, cameras: dict[str, tuple[int, int]], state_dim: int, action_dim: int, seed: int
) -> dict[str, np.ndarray]:
    """One episode's arrays keyed by LeRobot feature name: state ``[T, S]``, action ``[T, A]``, images ``[T, H, W, 3]``."""
    rng = np.random.default_rng([seed, episode])
    t = np.arange(length, dtype=np.float64)[:, None]
    freq_s, phase_s = rng.uniform(0.05, 0.2, state_dim), rng.uniform(0, 2 * np.pi, state_dim)
    freq_a, phase_a = rng.uniform(0.05, 0.2, action_dim), rng.uniform(0, 2 * np.pi, action_dim)
    out = {
        "observation.state": (0.5 * np.sin(freq_s * t + phase_s)).astype(np.float32),
        "action": (0.8 * np.cos(freq_a * (t + 1) + phase_a)).astype(np.float32),
    }
    for camera, (name, (h, w)) in enumerate(cameras.items()):
        out[f"observation.images.{name}"] = np.stack(
            [frame_code_image(episode, i, camera, h, w) for i in range(length)]
        )
    return out


def _features(
    cameras: dict[str, tuple[int, int]], state_dim: int, action_dim: int, video: bool
) -> dict[str, dict]:
    features: dict[str, dict] = {
        "observation.state": {
            "dtype": "float32",
            "shape": [state_dim],
            "names": [f"s{i}" for i in range(state_dim)],
        },
        "action": {"dtype": "float32", "shape": [action_dim], "names": [f"a{i}" for i in range(action_dim)]},
    }
    for name, (h, w) in cameras.items():
        features[f"observation.images.{name}"] = {"dtype": "video" if video else "image", "shape": [h, w, 3]}
    return features


def make_lerobot_dataset(
    root: str | Path,
    *,
    num_episodes: int = 3,
    episode_length: int | list[int] = 20,
    cameras: dict[str, tuple[int, int]] | None = None,
    state_dim: int = 6,
    action_dim: int = 4,
    fps: int = 10,
    video: bool = True,
    vcodec: str = "av1",
    version: str = "v3.0",
    seed: int = 0,
    robot_type: str = "synthetic_arm",
    episode_metadata: bool = False,
    **writer_kwargs: object,
) -> Path:
    """Write a deterministic dataset to ``root`` (replacing it) and return ``root``.

    Episode ``e`` has task ``TASKS[e % 3]`` and length ``episode_length`` (or ``episode_length[e]``); cameras map
    a name to ``(H, W)`` (default one 64x80 ``front`` camera). With ``episode_metadata`` each episode carries a
    nested ``randomization`` record (as the simulator stores it).
    """
    root = Path(root)
    cameras = {"front": (64, 80)} if cameras is None else cameras
    lengths = [episode_length] * num_episodes if isinstance(episode_length, int) else list(episode_length)
    shutil.rmtree(root, ignore_errors=True)
    if version == "v2.1":
        _write_v21(root, lengths, cameras, state_dim, action_dim, fps, video, vcodec, seed, robot_type)
        return root
    if version != "v3.0":
        raise ValueError(f"version must be 'v3.0' or 'v2.1', got {version!r}")
    features = _features(cameras, state_dim, action_dim, video)
    writer = LeRobotWriter(
        root, fps, features, robot_type=robot_type, video=video, vcodec=vcodec, mode="create", **writer_kwargs
    )  # type: ignore[arg-type]
    with writer:
        for e, length in enumerate(lengths):
            meta = {"randomization": {"friction": 0.5 + 0.1 * e, "light": {"level": e % 3}}, "seed": seed + e}
            frames = synthetic_episode(e, length, cameras, state_dim, action_dim, seed)
            writer.add_episode(frames, TASKS[e % len(TASKS)], meta if episode_metadata else None)
    return root


def _write_v21(
    root: Path,
    lengths: list[int],
    cameras: dict[str, tuple[int, int]],
    state_dim: int,
    action_dim: int,
    fps: int,
    use_video: bool,
    vcodec: str,
    seed: int,
    robot_type: str,
) -> None:
    """LeRobot v2.1 layout: one parquet and one MP4 per episode, jsonl metadata (test fixture writer)."""
    features = _features(cameras, state_dim, action_dim, use_video) | DEFAULT_FEATURES
    (root / "meta").mkdir(parents=True)
    episodes, stats_lines, tasks, start = [], [], {}, 0
    for e, length in enumerate(lengths):
        task = TASKS[e % len(TASKS)]
        tasks.setdefault(task, len(tasks))
        columns = synthetic_episode(e, length, cameras, state_dim, action_dim, seed)
        columns |= {
            "timestamp": (np.arange(length) / fps).astype(np.float32),
            "frame_index": np.arange(length),
            "episode_index": np.full(length, e),
            "index": np.arange(start, start + length),
            "task_index": np.full(length, tasks[task]),
        }
        path = root / f"data/chunk-000/episode_{e:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_parquet([data_table(columns, features)], path)
        for key, ft in features.items():
            if ft["dtype"] == "video":
                video.encode_video(
                    columns[key], root / f"videos/chunk-000/{key}/episode_{e:06d}.mp4", fps, vcodec=vcodec
                )
        ep_stats = {
            k: {s: v.tolist() for s, v in d.items()} for k, d in episode_stats(columns, features).items()
        }
        stats_lines.append(json.dumps({"episode_index": e, "stats": ep_stats}) + "\n")
        episodes.append({"episode_index": e, "tasks": [task], "length": length})
        start += length
    for key, ft in features.items():
        if ft["dtype"] == "video":
            probe = video.probe_video(root / f"videos/chunk-000/{key}/episode_000000.mp4")
            ft["info"] = {k: v for k, v in probe.items() if k.startswith(("video.", "has_"))} | {
                "video.is_depth_map": False
            }
    info = {
        "codebase_version": "v2.1", "robot_type": robot_type, "total_episodes": len(lengths), "total_frames": start,
        "total_tasks": len(tasks), "total_videos": len(lengths) * len(cameras) if use_video else 0,
        "total_chunks": 1, "chunks_size": 1000, "fps": fps, "splits": {"train": f"0:{len(lengths)}"},
        "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
        "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4" if use_video else None,
        "features": features,
    }  # fmt: skip
    (root / "meta/info.json").write_text(json.dumps(info, indent=4))
    (root / "meta/episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in episodes))
    (root / "meta/tasks.jsonl").write_text(
        "".join(json.dumps({"task_index": i, "task": t}) + "\n" for t, i in tasks.items())
    )
    (root / "meta/episodes_stats.jsonl").write_text("".join(stats_lines))
