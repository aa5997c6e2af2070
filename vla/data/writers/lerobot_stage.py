"""Staging one episode's files for the LeRobot v3.0 writer (``lerobot.LeRobotWriter``): the data file, each
camera's video file, the ``meta/episodes`` row, the tasks and JSON metadata, each written under the episode's
staging folder and recorded in ``staged`` (final path relative to the root -> staged file) for
``staging.commit`` to move into place together.

``EpisodeStaging`` is a mixin: it reads the writer's state (``root``, ``info``, ``features``, the current data,
video and episode-metadata files and their contents) and never changes it; the writer adopts what a commit
returns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vla.data import video
from vla.data.writers.lerobot_episode import EncodedEpisode, data_table, episode_stats, write_parquet

DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EPISODES_PER_META_FILE = 1000


def next_file(chunk: int, file: int, chunks_size: int) -> tuple[int, int]:
    return (chunk + 1, 0) if file + 1 >= chunks_size else (chunk, file + 1)


class EpisodeStaging:
    """The staging steps of ``LeRobotWriter._write_episode`` (see the module docstring)."""

    root: Path
    info: dict[str, Any]
    features: dict[str, dict[str, Any]]
    video_keys: list[str]
    _data_tables: list[pa.Table]
    _data_file: tuple[int, int]
    _videos: dict[str, tuple[int, int, int]]
    _meta_rows: list[dict[str, Any]]
    _meta_file: tuple[int, int]
    _tasks: dict[str, int]
    _max_frames: int
    _encode: dict[str, Any]
    _vcodec: str

    def _columns(
        self, episode: EncodedEpisode, tasks: list[str], task_ids: dict[str, int], ep: int
    ) -> dict[str, np.ndarray]:
        """Every parquet column of episode ``ep``: its non-video features plus LeRobot's index columns, ``[T]``."""
        length, fps, start = len(tasks), self.info["fps"], int(self.info["total_frames"])
        columns = dict(episode.frames)
        columns |= {
            "timestamp": (np.arange(length) / fps).astype(np.float32), "frame_index": np.arange(length),
            "episode_index": np.full(length, ep), "index": np.arange(start, start + length),
            "task_index": np.array([task_ids[t] for t in tasks]),
        }  # fmt: skip
        return columns

    def _episode_stats(
        self, episode: EncodedEpisode, columns: dict[str, np.ndarray]
    ) -> dict[str, dict[str, np.ndarray]]:
        """Per-feature stats of the episode (cameras: the stats its encoder computed), in feature order."""
        low_dim = episode_stats(
            columns, {k: ft for k, ft in self.features.items() if k not in episode.videos}
        )
        return {k: episode.video_stats[k] if k in episode.videos else low_dim[k]
                for k in self.features if k in episode.videos or k in low_dim}  # fmt: skip

    def _stage_data(
        self,
        columns: dict[str, np.ndarray],
        length: int,
        stage: Path,
        staged: dict[str, Path],
        row: dict[str, Any],
    ) -> tuple[list[pa.Table], tuple[int, int]]:
        """Stage the data file the episode's rows go to (the current one rewritten with them appended, or a new
        one when the current is full); returns the tables of that file and its (chunk, file) index."""
        table = data_table(columns, self.features)
        tables, (dc, df) = [*self._data_tables, table], self._data_file
        old = self.root / DATA_PATH.format(chunk_index=dc, file_index=df)
        rows_in_file = sum(t.num_rows for t in self._data_tables)
        if self._data_tables and (rows_in_file + length > self._max_frames or old.stat().st_size / 2**20
                                  + table.nbytes / 2**20 >= self.info["data_files_size_in_mb"]):  # fmt: skip
            tables, (dc, df) = [table], next_file(dc, df, self.info["chunks_size"])
        staged[DATA_PATH.format(chunk_index=dc, file_index=df)] = stage / "data.parquet"
        write_parquet(tables, stage / "data.parquet")
        start = int(self.info["total_frames"])
        row |= {"data/chunk_index": dc, "data/file_index": df, "dataset_from_index": start,
                "dataset_to_index": start + length}  # fmt: skip
        return tables, (dc, df)

    def _stage_videos(
        self, episode: EncodedEpisode, length: int, stage: Path, staged: dict[str, Path], row: dict[str, Any]
    ) -> dict[str, tuple[int, int, int]]:
        """Stage each camera's file with the episode's stream appended (or a new file, see the module docstring);
        returns the cameras' (chunk, file, frames in file) once committed."""
        fps = self.info["fps"]
        video_state = dict(self._videos)
        for i, key in enumerate(self.video_keys):
            episode_mp4, merged = stage / f"video-{i}.mp4", stage / f"video-{i}-file.mp4"
            episode_mp4.write_bytes(episode.videos[key])
            self._check_video(key, episode_mp4, length)
            vc, vf, frames_in_file = self._videos.get(key, (0, -1, 0))
            old = self.root / VIDEO_PATH.format(video_key=key, chunk_index=vc, file_index=max(vf, 0))
            if (
                vf >= 0
                and frames_in_file + length <= self._max_frames
                and (old.stat().st_size + episode_mp4.stat().st_size) / 2**20
                < self.info["video_files_size_in_mb"]
                and video.stream_signature(old) == video.stream_signature(episode_mp4)
            ):
                from_ts = video.concat_videos([old, episode_mp4], merged)[1]
            else:  # start a new file with this episode
                vc, vf = next_file(vc, vf, self.info["chunks_size"]) if vf >= 0 else (0, 0)
                frames_in_file, from_ts, merged = 0, 0.0, episode_mp4
            staged[VIDEO_PATH.format(video_key=key, chunk_index=vc, file_index=vf)] = merged
            video_state[key] = (vc, vf, frames_in_file + length)
            row |= {f"videos/{key}/chunk_index": vc, f"videos/{key}/file_index": vf,
                    f"videos/{key}/from_timestamp": from_ts, f"videos/{key}/to_timestamp": from_ts + length / fps}  # fmt: skip
            if "info" not in self.features[key]:
                self.features[key]["info"] = self._video_info(episode_mp4)
        return video_state

    def _check_video(self, key: str, path: Path, length: int) -> None:
        """An episode's stream must have the feature's size and the episode's frame count (0: not probed)."""
        got = video.probe_video(path)
        size_ok = [got["video.height"], got["video.width"]] == self.features[key]["shape"][:2]
        if not size_ok or got["frames"] not in (0, length):
            raise ValueError(
                f"{self.root}: {key!r} video is {got['video.height']}x{got['video.width']}, {got['frames']} "
                f"frames; the feature needs {self.features[key]['shape'][:2]} and {length} frames"
            )

    def _stage_episode_row(
        self,
        row: dict[str, Any],
        ep_stats: dict[str, dict[str, np.ndarray]],
        extra: dict[str, Any],
        stage: Path,
        staged: dict[str, Path],
    ) -> tuple[list[dict[str, Any]], tuple[int, int]]:
        """Stage the ``meta/episodes`` file with the episode's row (where its data and videos are, its stats and the
        caller's metadata); returns that file's rows and its (chunk, file) index."""
        row |= {f"stats/{k}/{s}": v.tolist() for k, d in ep_stats.items() for s, v in d.items()}
        meta_rows, (mc, mf) = [*self._meta_rows, row], self._meta_file
        if len(self._meta_rows) >= EPISODES_PER_META_FILE:
            meta_rows, (mc, mf) = [row], next_file(mc, mf, self.info["chunks_size"])
        row |= {"meta/episodes/chunk_index": mc, "meta/episodes/file_index": mf, **extra}
        # every row gets every column (None where an episode lacks one): from_pylist would keep only the first
        # row's keys and silently drop the rest
        columns = list(dict.fromkeys(k for r in meta_rows for k in r))
        try:
            table = pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in meta_rows])
            pq.write_table(table, stage / "episodes.parquet")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise ValueError(
                f"episode metadata {extra} does not fit the columns of earlier episodes: {e}"
            ) from e
        staged[EPISODES_PATH.format(chunk_index=mc, file_index=mf)] = stage / "episodes.parquet"
        return meta_rows, (mc, mf)

    def _stage_tasks(self, tasks: dict[str, int], stage: Path, staged: dict[str, Path]) -> None:
        """Stage ``meta/tasks.parquet`` when the episode brings new task strings."""
        if len(tasks) == len(self._tasks):
            return
        import pandas as pd  # LeRobot reads tasks with pandas and needs the task string as the index

        frame = pd.DataFrame({"task_index": list(tasks.values())}, index=pd.Index(list(tasks), name="task"))
        frame.to_parquet(stage / "tasks.parquet")
        staged["meta/tasks.parquet"] = stage / "tasks.parquet"

    @staticmethod
    def _stage_json(path: str, value: Any, stage: Path, staged: dict[str, Path]) -> None:
        """Stage ``value`` as the JSON file ``path`` (relative to the root; LeRobot's 4-space indent)."""
        file = stage / Path(path).name
        file.write_text(json.dumps(value, indent=4))
        staged[path] = file

    def _video_info(self, path: Path) -> dict[str, Any]:
        probe = video.probe_video(path)
        info = {k: v for k, v in probe.items() if k.startswith(("video.", "has_"))}
        info["video.fps"] = self.info["fps"]
        preset = self._encode["preset"]
        if preset is None and video.available_encoder(self._vcodec) == "libsvtav1":
            preset = 12
        info |= {"video.g": self._encode["gop"], "video.crf": self._encode["crf"], "video.preset": preset,
                 "video.fast_decode": 0, "video.video_backend": "pyav", "video.extra_options": {}, "is_depth_map": False}  # fmt: skip
        return info


__all__ = [
    "DATA_PATH",
    "EPISODES_PATH",
    "EPISODES_PER_META_FILE",
    "VIDEO_PATH",
    "EpisodeStaging",
    "next_file",
]
