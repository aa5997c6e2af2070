"""LeRobot dataset reader: format v2.1 (one parquet and one MP4 per episode) and v3.0 (episodes concatenated into
chunked files, located through ``meta/episodes``).

Raw keys are LeRobot's feature names (``observation.state``, ``action``, ``observation.images.<cam>``,
``timestamp``, ``frame_index``, ``episode_index``, ``index``, ``task_index``) plus ``task`` (the task string).
LeRobot stores shape-``(1,)`` features as parquet scalars; they are reported and returned with shape ``()``.
Parquet files are read once per process into read-only numpy columns; video frames are decoded on demand at
``from_timestamp + frame_index / fps`` (nearest frame within ``1 / (2 fps)``) by :mod:`vla.data.video`.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from vla.data import video
from vla.data.readers.base import DatasetFormatError, DatasetReader, FeatureInfo, RawEpisode
from vla.data.readers.lerobot_meta import (
    EpisodeRecord,
    LeRobotMetadata,
    read_json,
    read_parquet,
    text_values,
)


class FrameIndexError(DatasetFormatError, IndexError):
    """An episode or frame index outside the dataset (an ``IndexError`` and a ``DatasetFormatError``)."""


@dataclass
class _DataFile:
    columns: dict[str, np.ndarray]  # low-dim features + "task", rows of the whole file, read-only
    images: dict[str, pa.StructArray]  # image features: {bytes, path} per row
    rows: dict[int, tuple[int, int]]  # episode_index -> [start, stop) rows


def _column_to_numpy(column: pa.ChunkedArray, path: Path, key: str) -> np.ndarray:
    """A numeric (possibly nested-list) column as ``[rows, *shape]``; lists must all have one length."""
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    shape: list[int] = []
    while (
        pa.types.is_list(arr.type)
        or pa.types.is_large_list(arr.type)
        or pa.types.is_fixed_size_list(arr.type)
    ):
        if arr.null_count:
            raise DatasetFormatError(f"{path}: column '{key}' has null rows; rewrite the file")
        lengths = np.diff(np.asarray(arr.offsets)) if not pa.types.is_fixed_size_list(arr.type) else None
        size = arr.type.list_size if lengths is None else (int(lengths[0]) if len(lengths) else 0)
        if lengths is not None and (lengths != size).any():
            raise DatasetFormatError(
                f"{path}: column '{key}' has rows of different lengths; rewrite the file"
            )
        shape.append(size)
        arr = arr.flatten()
    if arr.null_count:
        raise DatasetFormatError(f"{path}: column '{key}' has null values; rewrite the file")
    values = arr.to_numpy(zero_copy_only=False)
    return values.reshape(len(column), *shape)


class LeRobotReader(DatasetReader):
    """Reads a LeRobot dataset directory (``meta/info.json`` ``codebase_version`` v2.0, v2.1 or v3.0)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.meta = LeRobotMetadata(self.path)
        self.version = self.meta.version
        self.format = "lerobot_v2.1" if self.version == "v2.0" else f"lerobot_{self.version}"
        self._info, self._fps, self._features = self.meta.info, self.meta.fps, self.meta.features
        self._episodes, self._splits = self.meta.episodes, self.meta.splits
        max_task = max(self.meta.tasks, default=-1)
        self._task_table = np.array([self.meta.tasks.get(i, "") for i in range(max_task + 1)], dtype=object)
        self._episodes_by_file: dict[Path, list[EpisodeRecord]] = {}
        for ep in self._episodes.values():
            self._episodes_by_file.setdefault(ep.data_file, []).append(ep)
        self._files: dict[Path, _DataFile] = {}
        self._checked_videos: set[Path] = set()

    # ---- identity ---------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return str(self._info.get("repo_id") or self.path.resolve().name)

    @property
    def fps(self) -> float:
        return self._fps

    @property
    def robot_type(self) -> str | None:
        return self._info.get("robot_type")

    @property
    def incomplete(self) -> str | None:
        return self.meta.incomplete

    def lerobot_info(self) -> dict[str, Any]:
        """``meta/info.json`` as stored."""
        return self._info

    def lerobot_stats(self) -> dict[str, dict[str, np.ndarray]] | None:
        """``meta/stats.json`` as numpy arrays (``None`` when absent)."""
        path = self.path / "meta" / "stats.json"
        if not path.exists():
            return None
        return {
            k: {s: np.asarray(v) for s, v in d.items()} for k, d in read_json(path, "meta/stats.json").items()
        }

    # ---- structure --------------------------------------------------------------------------------------
    def splits(self) -> list[str]:
        return list(self._splits)

    def num_episodes(self, split: str) -> int:
        return len(self._split(split))

    def episode_length(self, split: str, episode: int) -> int:
        return self._episode(split, episode).length

    def features(self) -> dict[str, FeatureInfo]:
        return dict(self._features)

    # ---- data -------------------------------------------------------------------------------------------
    def read_episode(self, split: str, episode: int) -> RawEpisode:
        """Low-dim fields of one episode; ``steps`` are read-only views into this process's per-file cache."""
        ep = self._episode(split, episode)
        data = self._data_file(ep.data_file)
        start, stop = data.rows[ep.index]
        steps = {k: v[start:stop] for k, v in data.columns.items()}
        return RawEpisode(
            split=split, index=episode, length=ep.length, steps=steps, metadata=dict(ep.metadata)
        )

    def read_images(
        self, split: str, episode: int, frames: Sequence[int], keys: Sequence[str]
    ) -> dict[str, np.ndarray]:
        ep = self._episode(split, episode)
        frames = [int(f) for f in frames]
        for f in frames:
            if not 0 <= f < ep.length:
                raise FrameIndexError(
                    f"{self.path}: frame {f} out of range for {split} episode {episode} "
                    f"(LeRobot episode_index {ep.index}, {ep.length} frames: 0..{ep.length - 1})"
                )
        out: dict[str, np.ndarray] = {}
        for key in keys:
            feature = self._features.get(key)
            if feature is None or feature.kind not in ("image", "video"):
                raise KeyError(
                    f"{self.path}: {key!r} is not an image/video feature; image keys: {self.image_keys()}"
                )
            shown = f"{frames[:6]}"[:-1] + (", ...]" if len(frames) > 6 else "]")
            context = f" ({key}, {split} episode {episode} = episode_index {ep.index}, frames {shown})"
            if feature.kind == "video":
                path, start = ep.videos[key]
                out[key] = video.decode_frames(
                    path, [start + f / self._fps for f in frames], 0.5 / self._fps, context
                )
                if path not in self._checked_videos:
                    self._check_shape(out[key].shape[1:], feature, path, context)
                    self._checked_videos.add(path)
            else:
                out[key] = self._decode_images(ep, key, frames, context)
        return out

    def read_frame(self, split: str, episode: int, frame: int) -> dict[str, Any]:
        ep = self.read_episode(split, episode)
        if not 0 <= frame < ep.length:
            raise FrameIndexError(
                f"{self.path}: frame {frame} out of range for {split} episode {episode} ({ep.length} frames)"
            )
        return super().read_frame(split, episode, frame)

    def episode_metadata(self, split: str, episode: int) -> dict[str, Any]:
        return dict(self._episode(split, episode).metadata)

    def close(self) -> None:
        for ep in self._episodes.values():
            for path, _ in ep.videos.values():
                video.close_decoder(path)
        self._files.clear()

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers re-read parquet files lazily
        return {**self.__dict__, "_files": {}}

    # ---- lookups ------------------------------------------------------------------------------------------
    def _split(self, split: str) -> list[int]:
        try:
            return self._splits[split]
        except KeyError:
            raise KeyError(f"{self.path}: no split {split!r}; splits: {list(self._splits)}") from None

    def _episode(self, split: str, episode: int) -> EpisodeRecord:
        episodes = self._split(split)
        if not 0 <= episode < len(episodes):
            raise FrameIndexError(
                f"{self.path}: episode {episode} out of range for split {split!r} ({len(episodes)} episodes)"
            )
        return self._episodes[episodes[episode]]

    def _check_shape(self, shape: tuple[int, ...], feature: FeatureInfo, path: Path, context: str) -> None:
        if tuple(shape) != tuple(feature.shape):
            raise DatasetFormatError(
                f"{path}{context}: frames are {tuple(shape)} but meta/info.json declares {feature.shape}; "
                "fix meta/info.json or re-encode the video"
            )

    def _decode_images(self, ep: EpisodeRecord, key: str, frames: list[int], context: str) -> np.ndarray:
        from PIL import Image

        data = self._data_file(ep.data_file)
        start = data.rows[ep.index][0]
        out = []
        for f in frames:
            cell = data.images[key][start + f].as_py() or {}
            try:
                if cell.get("bytes") is not None:
                    image = Image.open(io.BytesIO(cell["bytes"]))
                else:
                    image = Image.open(self.path / str(cell.get("path")))
                out.append(np.asarray(image.convert("RGB")))
            except (OSError, ValueError) as e:
                raise DatasetFormatError(
                    f"{ep.data_file}{context}: frame {f} image cannot be decoded ({e}); rewrite the file"
                ) from e
            self._check_shape(out[-1].shape, self._features[key], ep.data_file, context)
        h, w = self._features[key].shape[:2]
        return np.stack(out) if out else np.empty((0, h, w, 3), np.uint8)

    def _data_file(self, path: Path) -> _DataFile:
        data = self._files.get(path)
        if data is None:
            data = self._files[path] = self._load_data_file(path)
        return data

    def _load_data_file(self, path: Path) -> _DataFile:
        table = read_parquet(path, "episode data parquet")
        columns: dict[str, np.ndarray] = {}
        images: dict[str, pa.StructArray] = {}
        for key, feature in self._features.items():
            if feature.kind == "video" or key == "task":
                continue
            if key not in table.column_names:
                raise DatasetFormatError(
                    f"{path}: column {key!r} declared in meta/info.json is missing (has {table.column_names}); "
                    "fix meta/info.json or rewrite the file"
                )
            if feature.kind == "image":
                images[key] = table[key].combine_chunks()
            elif feature.kind == "string":
                columns[key] = np.array(text_values(table[key], path, key), dtype=object)
            else:
                values = _column_to_numpy(table[key], path, key)
                if values.ndim == 2 and values.shape[1] == 1 and feature.shape == ():
                    values = values[:, 0]
                if values.dtype != np.dtype(feature.dtype) or values.shape[1:] != feature.shape:
                    raise DatasetFormatError(
                        f"{path}: column {key!r} is {values.dtype} with per-step shape {values.shape[1:]} but "
                        f"meta/info.json declares {feature.dtype} {feature.shape or '(1,)'}; rewrite the file or fix meta/info.json"
                    )
                columns[key] = values
        for key in ("episode_index", "frame_index", "task_index"):
            if key not in columns:
                raise DatasetFormatError(f"{path}: required column {key!r} missing; rewrite the file")
        task_index = columns["task_index"]
        if len(task_index) and (task_index.min() < 0 or task_index.max() >= len(self._task_table)):
            raise DatasetFormatError(
                f"{path}: task_index outside meta/tasks ({len(self._task_table)} tasks); fix meta/tasks"
            )
        columns["task"] = self._task_table[task_index]
        for values in columns.values():
            values.flags.writeable = False
        return _DataFile(columns, images, self._episode_rows(path, columns))

    def _episode_rows(self, path: Path, columns: dict[str, np.ndarray]) -> dict[int, tuple[int, int]]:
        """Row range of every episode of this file, checked against the metadata (row counts)."""
        ep_col = columns["episode_index"]
        cuts = np.flatnonzero(np.diff(ep_col)) + 1
        starts, stops = np.concatenate([[0], cuts]), np.concatenate([cuts, [len(ep_col)]])
        rows: dict[int, tuple[int, int]] = {}
        for start, stop in zip(starts.tolist(), stops.tolist()):
            ep = int(ep_col[start])
            if ep in rows:
                raise DatasetFormatError(f"{path}: rows of episode {ep} are not contiguous; rewrite the file")
            rows[ep] = (start, stop)
        for ep in self._episodes_by_file.get(path, []):
            start, stop = rows.setdefault(ep.index, (0, 0))  # a listed episode of 0 frames has no rows
            if stop - start != ep.length:
                raise DatasetFormatError(
                    f"{path}: episode {ep.index} has {stop - start} rows but the episode metadata says {ep.length}; "
                    "the data file is truncated or stale, re-create or re-download it"
                )
            # A frame_index gap is reported by `vla data validate` (missing_frames); rows are still addressed by
            # position, so it must not make every other episode of this file unreadable.
        return rows
