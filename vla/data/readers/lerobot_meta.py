"""LeRobot dataset metadata: ``meta/info.json`` features, tasks, episode records and splits (v2.x and v3.0).

v2.x: ``meta/episodes.jsonl`` + ``meta/tasks.jsonl``, one parquet and one MP4 per episode (path templates with
``episode_chunk``/``episode_index``). v3.0: ``meta/episodes/chunk-XXX/file-XXX.parquet`` (chunk/file indices of
each episode's data and videos, video ``from_timestamp``; ``stats/*`` columns are not loaded) + ``meta/tasks.parquet``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vla.data.readers.base import DatasetFormatError, FeatureInfo

SUPPORTED_VERSIONS = ("v2.0", "v2.1", "v3.0")
STAGING_DIR = ".vla_staging"  # written by vla.data.writers.lerobot; a COMMIT file there = interrupted write
_EPISODE_COLUMNS = ("episode_index", "tasks", "length", "dataset_from_index", "dataset_to_index")
_STRUCTURAL_PREFIXES = ("data/", "videos/", "meta/", "stats/")


@dataclass
class EpisodeRecord:
    """Where one episode's rows and videos are, and its metadata (tasks, length, extra columns)."""

    index: int  # LeRobot episode_index
    length: int
    data_file: Path
    videos: dict[str, tuple[Path, float]]  # key -> (mp4, from_timestamp)
    metadata: dict[str, Any] = field(default_factory=dict)


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise DatasetFormatError(
            f"{path}: missing {what}; is this a LeRobot dataset root (meta/, data/)?"
        ) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetFormatError(f"{path}: {what} is not valid JSON ({e}); restore or re-download it") from e


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError as e:
        raise DatasetFormatError(
            f"{path}: missing (LeRobot v2.x metadata); restore or re-download meta/"
        ) from e
    except json.JSONDecodeError as e:
        raise DatasetFormatError(f"{path}: invalid JSON line ({e}); restore or re-download it") from e


def read_parquet(path: Path, what: str, columns: list[str] | None = None) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns, memory_map=True)
    except FileNotFoundError as e:
        raise DatasetFormatError(f"{path}: missing {what}; restore or re-download the dataset") from e
    except (pa.ArrowException, OSError) as e:
        raise DatasetFormatError(
            f"{path}: cannot read {what} ({e}); the file is truncated or corrupt, re-download it"
        ) from e


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b": 1}`` -> ``{"a": {"b": 1}}`` (the writer flattens nested episode metadata with ``/``)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


class LeRobotMetadata:
    """Everything under ``meta/`` of a LeRobot dataset at ``path``, validated."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if (self.path / STAGING_DIR / "COMMIT").exists():
            raise DatasetFormatError(
                f"{self.path}: a LeRobotWriter commit was interrupted; open the dataset once with "
                "vla.data.writers.lerobot.LeRobotWriter(path) to finish it"
            )
        self.info: dict[str, Any] = read_json(self.path / "meta" / "info.json", "meta/info.json")
        self.version = str(self.info.get("codebase_version", "<missing>"))
        if self.version not in SUPPORTED_VERSIONS:
            raise DatasetFormatError(
                f"{self.path / 'meta/info.json'}: unsupported codebase_version {self.version!r} "
                f"(supported: {', '.join(SUPPORTED_VERSIONS)}); convert it with LeRobot's conversion scripts"
            )
        try:
            self.fps = float(self.info["fps"])
            raw_features: dict[str, dict[str, Any]] = self.info["features"]
        except (KeyError, TypeError, ValueError) as e:
            raise DatasetFormatError(
                f"{self.path / 'meta/info.json'}: missing or invalid field {e}; fix meta/info.json"
            ) from e
        self.features = self._parse_features(raw_features)
        if self.version == "v3.0":
            self.tasks = self._load_tasks_v3()
            self.episodes = self._load_episodes_v3()
        else:
            rows = read_jsonl(self.path / "meta" / "tasks.jsonl")
            self.tasks = {int(t["task_index"]): str(t["task"]) for t in rows}
            self.episodes = self._load_episodes_v2()
        total = self.info.get("total_episodes")
        if total is not None and int(total) != len(self.episodes):
            raise DatasetFormatError(
                f"{self.path / 'meta'}: info.json says total_episodes={total} but the episode metadata lists "
                f"{len(self.episodes)}; the dataset was not finalized or is incomplete, re-create or re-download it"
            )
        self.splits = self._parse_splits()

    def _parse_features(self, raw: dict[str, dict[str, Any]]) -> dict[str, FeatureInfo]:
        features: dict[str, FeatureInfo] = {}
        for key, ft in raw.items():
            dtype, shape, names = ft.get("dtype"), tuple(int(s) for s in ft.get("shape", ())), ft.get("names")
            if dtype in ("video", "image"):
                if names and list(names)[:3] == [
                    "channels",
                    "height",
                    "width",
                ]:  # some v2.x datasets store CHW
                    shape = (shape[1], shape[2], shape[0])
                features[key] = FeatureInfo(key, dtype, "uint8", shape)
            elif dtype in ("string", "language"):
                features[key] = FeatureInfo(key, "string", "str", ())
            else:
                try:
                    np_dtype = np.dtype(dtype).name
                except TypeError as e:
                    raise DatasetFormatError(
                        f"{self.path / 'meta/info.json'}: feature {key!r} has unknown dtype {dtype!r}"
                    ) from e
                features[key] = FeatureInfo(key, "tensor", np_dtype, () if shape == (1,) else shape)
        features["task"] = FeatureInfo("task", "string", "str", (), "task string resolved through task_index")
        return features

    def _load_tasks_v3(self) -> dict[int, str]:
        path = self.path / "meta" / "tasks.parquet"
        table = read_parquet(path, "meta/tasks.parquet")
        text = "task" if "task" in table.column_names else "__index_level_0__"
        if text not in table.column_names or "task_index" not in table.column_names:
            raise DatasetFormatError(
                f"{path}: needs columns 'task' and 'task_index', has {table.column_names}"
            )
        return {int(i): str(t) for i, t in zip(table["task_index"].to_pylist(), table[text].to_pylist())}

    def _load_episodes_v3(self) -> dict[int, EpisodeRecord]:
        files = sorted((self.path / "meta" / "episodes").glob("*/*.parquet"))
        if not files:
            raise DatasetFormatError(
                f"{self.path / 'meta/episodes'}: no episode metadata parquet files; restore meta/episodes/"
            )
        video_keys = [k for k, f in self.features.items() if f.kind == "video"]
        needed = ["episode_index", "length", "data/chunk_index", "data/file_index"]
        needed += [
            f"videos/{k}/{c}" for k in video_keys for c in ("chunk_index", "file_index", "from_timestamp")
        ]
        episodes: dict[int, EpisodeRecord] = {}
        for path in files:
            names = pq.read_schema(path).names if path.stat().st_size else []
            if missing := [c for c in needed if c not in names]:
                raise DatasetFormatError(
                    f"{path}: missing column(s) {missing}; the episode metadata is incomplete or truncated"
                )
            keep = [c for c in names if not c.startswith("stats/")]
            for row in read_parquet(path, "episode metadata", keep).to_pylist():
                ep = int(row["episode_index"])
                data_file = self.path / self.info["data_path"].format(
                    chunk_index=row["data/chunk_index"], file_index=row["data/file_index"]
                )
                videos = {
                    k: (
                        self.path
                        / self.info["video_path"].format(
                            video_key=k,
                            chunk_index=row[f"videos/{k}/chunk_index"],
                            file_index=row[f"videos/{k}/file_index"],
                        ),
                        float(row[f"videos/{k}/from_timestamp"]),
                    )
                    for k in video_keys
                }
                extra = {
                    k: v
                    for k, v in row.items()
                    if k not in _EPISODE_COLUMNS and not k.startswith(_STRUCTURAL_PREFIXES)
                }
                metadata = {
                    "tasks": list(row.get("tasks") or []),
                    "length": int(row["length"]),
                    **unflatten(extra),
                }
                episodes[ep] = EpisodeRecord(ep, int(row["length"]), data_file, videos, metadata)
        return dict(sorted(episodes.items()))

    def _load_episodes_v2(self) -> dict[int, EpisodeRecord]:
        chunks = int(self.info.get("chunks_size", 1000))
        video_keys = [k for k, f in self.features.items() if f.kind == "video"]
        episodes: dict[int, EpisodeRecord] = {}
        for row in read_jsonl(self.path / "meta" / "episodes.jsonl"):
            ep, chunk = int(row["episode_index"]), int(row["episode_index"]) // chunks
            data_file = self.path / self.info["data_path"].format(episode_chunk=chunk, episode_index=ep)
            videos = {
                k: (
                    self.path
                    / self.info["video_path"].format(episode_chunk=chunk, video_key=k, episode_index=ep),
                    0.0,
                )
                for k in video_keys
            }
            metadata = {k: v for k, v in row.items() if k != "episode_index"}
            episodes[ep] = EpisodeRecord(ep, int(row["length"]), data_file, videos, metadata)
        return dict(sorted(episodes.items()))

    def _parse_splits(self) -> dict[str, list[int]]:
        raw = self.info.get("splits") or {"train": f"0:{max(self.episodes, default=-1) + 1}"}
        splits: dict[str, list[int]] = {}
        for name, spec in raw.items():
            try:
                if isinstance(spec, str):
                    lo, hi = (int(x) for x in spec.split(":"))
                    splits[name] = [e for e in self.episodes if lo <= e < hi]
                else:
                    splits[name] = sorted(int(e) for e in spec if int(e) in self.episodes)
            except (ValueError, TypeError) as e:
                raise DatasetFormatError(
                    f"{self.path / 'meta/info.json'}: split {name!r} = {spec!r} is not 'start:stop'"
                ) from e
        return splits
