"""LeRobot v3.0 dataset writer (used by simulation data generation and ``vla data convert``).

Writes exactly what LeRobot 0.6's own writer does, so ``LeRobotDataset(repo_id, root=...)`` loads it::

    data/chunk-XXX/file-XXX.parquet                 low-dim features (+ PNG images when video=False), 1 row group/episode
    videos/<key>/chunk-XXX/file-XXX.mp4             episodes concatenated; from/to timestamps in meta/episodes
    meta/info.json, meta/tasks.parquet, meta/stats.json, meta/episodes/chunk-XXX/file-XXX.parquet

Camera frames are encoded per episode (``lerobot_episode.encode_episode``, in the caller's process or already
done elsewhere: ``add_encoded_episode``) and stream-copied onto the camera's current file.
Every saved episode is committed atomically (:mod:`vla.data.writers.staging`): a crash, Ctrl-C or SIGKILL
mid-episode leaves the finished episodes, and opening a writer on the dataset again finishes a commit a kill
interrupted and resumes (appends). A writing command's progress record (``progress``) goes in the same commit.
Files are rewritten per episode, so besides LeRobot's size limits a file also rolls over at
``max_frames_per_file`` frames to bound the cost of an episode commit. A camera's file also rolls over when an
episode's stream differs from the file's in ``video.stream_signature`` (codec headers, size, ...; e.g. an
episode encoded by another encoder build or with other settings): one MP4 stream has one set of codec headers,
and packets appended under foreign headers would decode to wrong pixels.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vla.data import video
from vla.data.readers.lerobot_meta import METADATA_JSON_COLUMN, PROGRESS_FILE
from vla.data.writers.lerobot_episode import (
    EncodedEpisode,
    aggregate_stats,
    encode_episode,
)
from vla.data.writers.lerobot_stage import (
    DATA_PATH,
    VIDEO_PATH,
    EpisodeStaging,
)
from vla.data.writers.progress import WriteProgress
from vla.data.writers.staging import commit, recover, stage_dir, staging_committed

CODEBASE_VERSION = "v3.0"
DEFAULT_FEATURES: dict[str, dict[str, Any]] = {
    k: {"dtype": d, "shape": [1], "names": None}
    for k, d in [("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"),
                 ("index", "int64"), ("task_index", "int64")]
}  # fmt: skip
# episode metadata keys that would collide with LeRobot's own meta/episodes columns
_RESERVED = ("episode_index", "tasks", "length", "dataset_from_index", "dataset_to_index",
             "data/", "videos/", "meta/", "stats/")  # fmt: skip


def _plain(v: Any) -> Any:
    """A metadata value as JSON/parquet take it (numpy arrays and scalars as Python values, paths as text)."""
    return v.tolist() if isinstance(v, np.ndarray | np.generic) else str(v) if isinstance(v, Path) else v


def _metadata_columns(metadata: dict[str, Any]) -> dict[str, Any]:
    """An episode's ``meta/episodes`` columns for the caller's ``metadata``: the whole record as JSON (exact, and
    what vla reads back), plus each top-level value that is not a mapping as a column of its own (``success``,
    ``sim_seed``, ``instruction``: what LeRobot users filter on). Nested records are only in the JSON: their keys
    differ between episodes (per-object randomization), and flat columns would need the first episode's keys."""

    def default(v: Any) -> Any:
        if isinstance(v, np.ndarray | np.generic | Path):
            return _plain(v)
        raise TypeError(f"{type(v).__name__} is not JSON-serializable")

    try:
        text = json.dumps(metadata, sort_keys=True, default=default)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"episode metadata {sorted(metadata)} cannot be stored: {e}; use numbers, strings, lists and dicts"
        ) from None
    flat = {k: _plain(v) for k, v in metadata.items() if not isinstance(v, dict)}
    return flat | {METADATA_JSON_COLUMN: text}


class LeRobotWriter(EpisodeStaging):
    """Append episodes to a LeRobot v3.0 dataset at ``root`` (created, resumed or overwritten, see ``mode``).

    ``features`` maps user feature names to LeRobot specs ``{"dtype", "shape", "names"}``: numeric dtypes with a
    per-step shape, or ``"video"``/``"image"`` cameras with shape ``(H, W, 3)`` stored as MP4 when ``video`` else as
    PNG in the parquet. ``timestamp``/``frame_index``/``episode_index``/``index``/``task_index`` are added.
    ``mode``: ``"append"`` (create, or resume an existing dataset with the same features), ``"create"`` (fail if it
    exists) or ``"overwrite"``.
    """

    def __init__(
        self,
        root: str | Path,
        fps: int | None = None,
        features: dict[str, dict[str, Any]] | None = None,
        *,
        robot_type: str | None = None,
        video: bool = True,  # shadows the module inside __init__ only (LeRobot's name for the flag)
        vcodec: str = "av1",
        crf: int = video.DEFAULT_CRF,
        gop: int = video.DEFAULT_GOP,
        preset: int | str | None = None,
        mode: str = "append",
        chunks_size: int = 1000,
        data_files_size_in_mb: int = 100,
        video_files_size_in_mb: int = 200,
        max_frames_per_file: int = 10_000,
    ) -> None:
        if mode not in ("append", "create", "overwrite"):
            raise ValueError(f"mode must be 'append', 'create' or 'overwrite', got {mode!r}")
        self.root = Path(root)
        if mode == "overwrite":
            shutil.rmtree(self.root, ignore_errors=True)
        recover(self.root)
        self._vcodec, self._encode = vcodec, {"crf": crf, "gop": gop, "preset": preset}
        self._max_frames = max_frames_per_file
        self._buffer: list[dict[str, Any]] = []
        self._closed = False
        #: the writing command's progress record, committed with every episode (``vla.data.writers.progress``)
        self.progress: WriteProgress | None = None
        if (self.root / "meta" / "info.json").exists():
            if mode == "create":
                raise FileExistsError(
                    f"{self.root}: a dataset already exists; use mode='append' or 'overwrite'"
                )
            self._resume(fps, features, video)
            return
        if fps is None or features is None:
            raise ValueError(f"{self.root}: fps and features are required to create a new dataset")
        normalized = self._normalize(features, video)
        has_video = any(ft["dtype"] == "video" for ft in normalized.values())
        self.info: dict[str, Any] = {
            "codebase_version": CODEBASE_VERSION, "fps": fps, "features": normalized,
            "total_episodes": 0, "total_frames": 0, "total_tasks": 0, "chunks_size": chunks_size,
            "data_files_size_in_mb": data_files_size_in_mb, "video_files_size_in_mb": video_files_size_in_mb,
            "data_path": DATA_PATH, "video_path": VIDEO_PATH if has_video else None,
            "robot_type": robot_type, "splits": {},
        }  # fmt: skip
        self._tasks: dict[str, int] = {}
        self._stats: dict[str, dict[str, np.ndarray]] | None = None
        self._meta_rows: list[dict[str, Any]] = []
        self._meta_file = (0, 0)
        self._data_tables: list[pa.Table] = []
        self._data_file = (0, 0)
        self._videos: dict[str, tuple[int, int, int]] = {}  # key -> (chunk, file, frames in file)
        self.root.mkdir(parents=True, exist_ok=True)

    # ---- public API -----------------------------------------------------------------------------------------
    @property
    def features(self) -> dict[str, dict[str, Any]]:
        return self.info["features"]

    @property
    def video_keys(self) -> list[str]:
        return [k for k, ft in self.info["features"].items() if ft["dtype"] == "video"]

    @property
    def num_episodes(self) -> int:
        return int(self.info["total_episodes"])

    def add_frame(self, frame: dict[str, Any]) -> None:
        """Buffer one step: every user feature (``[*shape]``, images uint8 ``[H, W, 3]``) and optionally ``task``."""
        user = [k for k in self.features if k not in DEFAULT_FEATURES]
        if unknown := sorted(set(frame) - set(user) - {"task"}):
            raise KeyError(f"unknown feature(s) {unknown}; this dataset has {user} (+ 'task')")
        if missing := [k for k in user if k not in frame]:
            raise KeyError(f"frame {len(self._buffer)} is missing feature(s) {missing}")
        # copies: simulators often reuse their observation buffers between steps
        self._buffer.append({k: self._check(k, np.array(v), (), f"frame {len(self._buffer)}") if k != "task" else str(v)
                             for k, v in frame.items()})  # fmt: skip

    def save_episode(
        self, task: str | None = None, metadata: dict[str, Any] | None = None, *, split: str = "train"
    ) -> int:
        """Commit the buffered frames as one episode of ``split``; ``task`` applies to frames without their own.
        Returns its index."""
        if not self._buffer:
            raise ValueError("save_episode() with no frames; call add_frame() first")
        tasks = [f.get("task", task) for f in self._buffer]
        if any(t is None for t in tasks):
            raise ValueError(
                "every frame needs a task: pass save_episode(task=...) or a 'task' key in add_frame()"
            )
        arrays = {k: np.stack([f[k] for f in self._buffer]) for k in self._buffer[0] if k != "task"}
        index = self._write_episode(
            self._encode_frames(arrays), [str(t) for t in tasks], metadata or {}, split
        )
        self._buffer = []
        return index

    def add_episode(
        self,
        frames: dict[str, np.ndarray],
        tasks: str | Sequence[str],
        episode_metadata: dict[str, Any] | None = None,
        *,
        split: str = "train",
    ) -> int:
        """Commit a whole episode: ``frames[key]`` is ``[T, *shape]`` for every user feature; ``tasks`` one or T strings.
        ``split``: the ``info.json`` split it belongs to (a split's episodes are written one after another)."""
        user = [k for k in self.features if k not in DEFAULT_FEATURES]
        if sorted(frames) != sorted(user):
            raise KeyError(f"add_episode needs exactly the features {user}, got {sorted(frames)}")
        length = len(next(iter(frames.values())))
        arrays = {k: self._check(k, np.asarray(v), (length,), "episode") for k, v in frames.items()}
        tasks = self._tasks_of(tasks, length)
        return self._write_episode(self._encode_frames(arrays), tasks, episode_metadata or {}, split)

    def add_encoded_episode(
        self,
        episode: EncodedEpisode,
        tasks: str | Sequence[str],
        episode_metadata: dict[str, Any] | None = None,
        *,
        split: str = "train",
    ) -> int:
        """``add_episode`` for an episode encoded elsewhere (``encode_episode`` with this writer's ``encode_settings``)."""
        want = [k for k in self.features if k not in DEFAULT_FEATURES and k not in self.video_keys]
        if sorted(episode.frames) != sorted(want) or sorted(episode.videos) != sorted(self.video_keys):
            raise KeyError(
                f"add_encoded_episode needs features {want} and videos {self.video_keys}, "
                f"got {sorted(episode.frames)} and {sorted(episode.videos)}"
            )
        if episode.encoder != video.available_encoder(self._vcodec) or episode.fps != self.info["fps"]:
            raise ValueError(
                f"{self.root}: episode encoded with {episode.encoder} at {episode.fps} fps, but this dataset's videos "
                f"are {video.available_encoder(self._vcodec)} at {self.info['fps']} fps; encode with "
                "writer.encode_settings"
            )
        frames = {k: self._check(k, v, (episode.length,), "episode") for k, v in episode.frames.items()}
        tasks = self._tasks_of(tasks, episode.length)
        return self._write_episode(
            dataclasses.replace(episode, frames=frames), tasks, episode_metadata or {}, split
        )

    @property
    def encode_settings(self) -> dict[str, Any]:
        """``encode_episode`` keyword arguments that make episodes this writer can append."""
        return {"vcodec": self._vcodec, **self._encode}

    def clear_episode(self) -> None:
        """Drop the frames buffered since the last ``save_episode``."""
        self._buffer = []

    def finalize(self) -> None:
        """Close the writer. Saved episodes are already on disk; unsaved buffered frames are dropped."""
        self._buffer, self._closed = [], True

    def __enter__(self) -> LeRobotWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finalize()

    # ---- validation -----------------------------------------------------------------------------------------
    @staticmethod
    def _tasks_of(tasks: str | Sequence[str], length: int) -> list[str]:
        tasks = [tasks] * length if isinstance(tasks, str) else [str(t) for t in tasks]
        if len(tasks) != length or length == 0:
            raise ValueError(
                f"episode has {length} frames but {len(tasks)} tasks; pass one task or one per frame"
            )
        return tasks

    def _encode_frames(self, arrays: dict[str, np.ndarray]) -> EncodedEpisode:
        return encode_episode(arrays, self.video_keys, self.info["fps"], **self.encode_settings)

    @staticmethod
    def _normalize(features: dict[str, dict[str, Any]], use_video: bool) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for key, ft in features.items():
            if key in DEFAULT_FEATURES or key == "task":
                raise ValueError(f"feature name {key!r} is reserved (added by the writer)")
            dtype, shape = ft.get("dtype"), [int(s) for s in ft.get("shape", ())]
            if dtype in ("video", "image"):
                if len(shape) != 3 or shape[2] != 3:
                    raise ValueError(f"camera feature {key!r} needs shape (H, W, 3), got {shape}")
                out[key] = {
                    "dtype": "video" if use_video else "image",
                    "shape": shape,
                    "names": ["height", "width", "channels"],
                }
                continue
            try:
                kind = np.dtype(dtype).kind
            except TypeError:
                kind = "?"
            if kind not in "biuf" or not shape:
                raise ValueError(
                    f"feature {key!r}: dtype must be numeric/bool with a shape, got {dtype!r} {shape}"
                )
            out[key] = {"dtype": np.dtype(dtype).name, "shape": shape, "names": ft.get("names")}
        return out | DEFAULT_FEATURES

    def _check(self, key: str, value: np.ndarray, lead: tuple[int, ...], where: str) -> np.ndarray:
        ft = self.features[key]
        camera = ft["dtype"] in ("video", "image")
        shape = (*lead, *ft["shape"]) if not (ft["shape"] == [1] and value.shape == lead) else lead
        if value.shape != shape or (camera and value.dtype != np.uint8):
            raise ValueError(
                f"{where}: {key!r} must be {'uint8 ' if camera else ''}{shape}, got {value.dtype} {value.shape}"
            )
        if not camera and not np.can_cast(value.dtype, ft["dtype"], "same_kind"):
            raise ValueError(f"{where}: {key!r} has dtype {value.dtype}, cannot store as {ft['dtype']}")
        return value if camera else value.astype(ft["dtype"], copy=False)

    # ---- resume -----------------------------------------------------------------------------------------------
    def _resume(self, fps: int | None, features: dict[str, dict[str, Any]] | None, use_video: bool) -> None:
        self.info = json.loads((self.root / "meta" / "info.json").read_text())
        if self.info.get("codebase_version") != CODEBASE_VERSION:
            raise ValueError(
                f"{self.root}: can only append to {CODEBASE_VERSION} datasets, found {self.info.get('codebase_version')}"
            )
        if fps is not None and fps != self.info["fps"]:
            raise ValueError(f"{self.root}: dataset has fps={self.info['fps']}, not {fps}")
        if features is not None:
            want = self._normalize(features, use_video)
            have = {k: {f: v for f, v in ft.items() if f != "info"} for k, ft in self.features.items()}
            if want != have:
                raise ValueError(
                    f"{self.root}: existing features {have} differ from {want}; use mode='overwrite' or a new root"
                )
        for key in self.video_keys:
            codec = self.features[key].get("info", {}).get("video.codec")
            if codec and codec != self._vcodec and video.available_encoder(self._vcodec) != codec:
                self._vcodec = codec  # keep the file's codec: stream-copy concatenation needs it unchanged
        self._tasks = {}
        if (self.root / "meta" / "tasks.parquet").exists():
            tasks = pq.read_table(self.root / "meta" / "tasks.parquet")
            self._tasks = {
                t: int(i) for t, i in zip(tasks["task"].to_pylist(), tasks["task_index"].to_pylist())
            }
        stats_path = self.root / "meta" / "stats.json"
        self._stats = ({k: {s: np.asarray(v) for s, v in d.items()} for k, d in json.loads(stats_path.read_text()).items()}
                       if stats_path.exists() else None)  # fmt: skip
        self._meta_rows, self._meta_file, self._data_tables, self._data_file = [], (0, 0), [], (0, 0)
        self._videos = {}
        meta_files = sorted((self.root / "meta" / "episodes").glob("*/*.parquet"))
        if not meta_files:
            return
        self._meta_rows = pq.read_table(meta_files[-1]).to_pylist()
        last = self._meta_rows[-1]
        self._meta_file = (last["meta/episodes/chunk_index"], last["meta/episodes/file_index"])
        self._data_file = (last["data/chunk_index"], last["data/file_index"])
        table = pq.read_table(
            self.root / DATA_PATH.format(chunk_index=self._data_file[0], file_index=self._data_file[1])
        )
        ep_col = table["episode_index"].to_numpy()
        cuts = [0, *(np.flatnonzero(np.diff(ep_col)) + 1).tolist(), len(ep_col)]
        self._data_tables = [table.slice(a, b - a) for a, b in itertools.pairwise(cuts)]
        for key in self.video_keys:
            c, f = last[f"videos/{key}/chunk_index"], last[f"videos/{key}/file_index"]
            path = self.root / VIDEO_PATH.format(video_key=key, chunk_index=c, file_index=f)
            self._videos[key] = (c, f, video.get_decoder(path).num_frames)
            video.close_decoder(path)

    # ---- one episode, committed atomically ------------------------------------------------------------------
    def _splits_with(self, split: str, ep: int) -> dict[str, str]:
        """``info["splits"]`` once episode ``ep`` is added to ``split``: LeRobot's ``"start:stop"`` ranges, so a
        split's episodes must be contiguous (the last split grows; a new one starts at ``ep``)."""
        splits = dict(self.info.get("splits") or {})
        if splits and split == list(splits)[-1]:
            start = int(splits[split].split(":")[0])
            return splits | {split: f"{start}:{ep + 1}"}
        if split in splits:
            raise ValueError(
                f"{self.root}: split {split!r} ({splits[split]}) is not the last one written ({list(splits)[-1]!r}); "
                "LeRobot splits are episode ranges, so write each split's episodes one after another"
            )
        return splits | {split: f"{ep}:{ep + 1}"}

    def _write_episode(
        self, episode: EncodedEpisode, tasks: list[str], metadata: dict[str, Any], split: str = "train"
    ) -> int:
        """Commit one episode: stage every file it changes (data, videos, episode row, tasks, stats, info and the
        writing command's progress record), then move them into place together (``staging.commit``)."""
        if self._closed:
            raise RuntimeError(f"{self.root}: writer already finalized")
        extra = _metadata_columns(metadata)
        if clash := [
            k for k in metadata if k.startswith(_RESERVED) or k in _RESERVED or k == METADATA_JSON_COLUMN
        ]:
            raise ValueError(
                f"episode metadata key(s) {clash} collide with LeRobot's episode columns; rename them"
            )
        ep, length = self.num_episodes, len(tasks)
        splits = self._splits_with(split, ep)
        stage = stage_dir(self.root, f"episode-{ep:06d}")
        staged: dict[str, Path] = {}  # final path (relative to root) -> staged file
        try:
            new_tasks = dict(self._tasks)
            for t in tasks:
                new_tasks.setdefault(t, len(new_tasks))
            columns = self._columns(episode, tasks, new_tasks, ep)
            row: dict[str, Any] = {"episode_index": ep, "tasks": list(dict.fromkeys(tasks)), "length": length}
            tables, data_file = self._stage_data(columns, length, stage, staged, row)
            video_state = self._stage_videos(episode, length, stage, staged, row)
            ep_stats = self._episode_stats(episode, columns)
            meta_rows, meta_file = self._stage_episode_row(row, ep_stats, extra, stage, staged)
            self._stage_tasks(new_tasks, stage, staged)
            stats = aggregate_stats([self._stats, ep_stats] if self._stats else [ep_stats])
            self._stage_json("meta/stats.json", {k: {s: v.tolist() for s, v in d.items()} for k, d in stats.items()},
                             stage, staged)  # fmt: skip
            info = {**self.info, "total_episodes": ep + 1, "total_frames": int(self.info["total_frames"]) + length,
                    "total_tasks": len(new_tasks), "splits": splits}  # fmt: skip
            self._stage_json("meta/info.json", info, stage, staged)
            if self.progress is not None:
                (stage / PROGRESS_FILE).write_text(self.progress.to_json())
                staged[f"meta/{PROGRESS_FILE}"] = stage / PROGRESS_FILE
            commit(self.root, staged)
        except BaseException:
            self._discard(stage)
            raise
        self.info, self._tasks, self._stats = info, new_tasks, stats
        self._meta_rows, self._meta_file = meta_rows, meta_file
        self._data_tables, self._data_file, self._videos = tables, data_file, video_state
        return ep

    def _discard(self, stage: Path) -> None:
        """After a failed ``_write_episode``: drop its staged files, unless it failed past the commit point (then a
        new writer on the dataset finishes the commit, and this one is closed)."""
        if staging_committed(self.root):
            self._closed = True
            return
        shutil.rmtree(stage, ignore_errors=True)
        for key in self.video_keys:  # video info probed from an episode that never landed
            if self.info["total_episodes"] == 0:
                self.features[key].pop("info", None)
