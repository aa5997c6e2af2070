"""LeRobot dataset metadata: ``meta/info.json`` features, tasks, episode records and splits (v2.x and v3.0).

v2.x: ``meta/episodes.jsonl`` + ``meta/tasks.jsonl``, one parquet and one MP4 per episode (path templates with
``episode_chunk``/``episode_index``). v3.0: ``meta/episodes/chunk-XXX/file-XXX.parquet`` (chunk/file indices of
each episode's data and videos, video ``from_timestamp``; ``stats/*`` columns are not loaded) + ``meta/tasks.parquet``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vla.data.nested import unflatten
from vla.data.readers.base import DatasetFormatError, FeatureInfo

SUPPORTED_VERSIONS = ("v2.0", "v2.1", "v3.0")
STAGING_DIR = ".vla_staging"  # written by vla.data.writers.lerobot; a COMMIT file there = interrupted write
# meta/: the record of the command writing the dataset (vla.data.writers.progress)
PROGRESS_FILE = "vla_progress.json"
_EPISODE_COLUMNS = ("episode_index", "tasks", "length", "dataset_from_index", "dataset_to_index")
_STRUCTURAL_PREFIXES = ("data/", "videos/", "meta/", "stats/")
# meta/episodes column with an episode's whole metadata record as JSON (vla.data.writers.lerobot): exact for nested
# records whose keys differ between episodes (e.g. per-object randomization), which flat parquet columns cannot hold
METADATA_JSON_COLUMN = "vla_episode_metadata_json"


@dataclass
class EpisodeRecord:
    """Where one episode's rows and videos are, and its metadata (tasks, length, extra columns)."""

    index: int  # LeRobot episode_index
    length: int
    data_file: Path
    videos: dict[str, tuple[Path, float]]  # key -> (mp4, from_timestamp)
    metadata: dict[str, Any] = field(default_factory=dict)


def read_json(path: Path, what: str) -> Any:
    """``path`` parsed as JSON; a missing, unreadable or invalid file is a ``DatasetFormatError`` naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise DatasetFormatError(
            f"{path}: missing {what}; is this a LeRobot dataset root (meta/, data/)?"
        ) from e
    except PermissionError as e:
        raise permission_error(path, what) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetFormatError(f"{path}: {what} is not valid JSON ({e}); restore or re-download it") from e


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON object on each non-empty line of ``path`` (LeRobot v2.x ``meta/*.jsonl``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise DatasetFormatError(
            f"{path}: missing (LeRobot v2.x metadata); restore or re-download meta/"
        ) from e
    except PermissionError as e:
        raise permission_error(path, "LeRobot v2.x metadata") from e
    except UnicodeDecodeError as e:
        raise DatasetFormatError(f"{path}: not UTF-8 text ({e}); restore or re-download it") from e
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetFormatError(
                f"{path}: line {number} is not valid JSON ({e}); restore or re-download it"
            ) from e
        if not isinstance(row, dict):
            raise DatasetFormatError(f"{path}: line {number} is not a JSON object; restore or re-download it")
        rows.append(row)
    return rows


def permission_error(path: Path, what: str) -> DatasetFormatError:
    """The error for a dataset file or folder this process may not read (not a missing or corrupt one)."""
    return DatasetFormatError(
        f"{path}: permission denied reading {what}; the file exists but this user may not read it. "
        f"Fix its permissions (e.g. chmod -R a+rX {path.parent})"
    )


@contextmanager
def _parquet_errors(path: Path, what: str) -> Iterator[None]:
    """A missing, unreadable, truncated or corrupt parquet file ``path`` (holding ``what``) as a
    ``DatasetFormatError`` naming it."""
    try:
        yield
    except FileNotFoundError as e:
        raise DatasetFormatError(f"{path}: missing {what}; restore or re-download the dataset") from e
    except PermissionError as e:
        raise permission_error(path, what) from e
    except (pa.ArrowException, OSError) as e:
        raise DatasetFormatError(
            f"{path}: cannot read {what} ({e}); the file is truncated or corrupt, re-download it"
        ) from e


def _not_empty(path: Path, what: str) -> None:
    # pyarrow reads a 0-byte file as a table without columns, which would be reported as missing columns
    if path.stat().st_size == 0:
        raise DatasetFormatError(
            f"{path}: empty file (0 bytes) instead of {what}; restore or re-download the dataset"
        )


def read_parquet(path: Path, what: str, columns: list[str] | None = None) -> pa.Table:
    """``path`` as an Arrow table; a missing, empty, unreadable, truncated or corrupt file is a
    ``DatasetFormatError``."""
    with _parquet_errors(path, what):
        _not_empty(path, what)
        return pq.read_table(path, columns=columns, memory_map=True)


def read_parquet_schema(path: Path, what: str) -> list[str]:
    """Column names of the parquet file ``path`` (errors as in ``read_parquet``)."""
    with _parquet_errors(path, what):
        _not_empty(path, what)
        return pq.read_schema(path).names


def text_values(column: pa.ChunkedArray | pa.Array, path: Path, key: str) -> list[str | None]:
    """A string or binary column as Python ``str`` (None for nulls), decoded as strict UTF-8.

    Binary columns holding UTF-8 text are accepted (some exporters store text as bytes); a value that is not
    UTF-8 is a ``DatasetFormatError`` naming the file, the column and the row, never a mojibake or
    ``"b'...'"`` string.
    """
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
            or pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):  # fmt: skip
        return [None if v is None else str(v) for v in column.to_pylist()]
    large = pa.types.is_large_string(column.type) or pa.types.is_large_binary(column.type)
    raw = column.cast(pa.large_binary() if large else pa.binary()).to_pylist()  # no UTF-8 check in Arrow
    out: list[str | None] = []
    for row, value in enumerate(raw):
        if value is None:
            out.append(None)
            continue
        try:
            out.append(value.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DatasetFormatError(
                f"{path}: column {key!r} row {row} is not UTF-8 text ({e.reason} at byte {e.start}: "
                f"{value[max(0, e.start - 8) : e.start + 8]!r}); rewrite the column as UTF-8 strings"
            ) from None
    return out


def table_rows(table: pa.Table, path: Path, what: str) -> list[dict[str, Any]]:
    """``table.to_pylist()``, with a text column that is not UTF-8 reported by file, column and row."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError:
        for name in table.column_names:
            column = table[name]
            while pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
                column = pa.chunked_array([c.flatten() for c in column.chunks], column.type.value_type)
            text_values(column, path, name)
        raise DatasetFormatError(f"{path}: {what} holds text that is not UTF-8; rewrite it") from None


def list_parquet_files(folder: Path, what: str) -> list[Path]:
    """``folder/*/*.parquet`` in name order. Unlike ``Path.glob``, an unreadable folder is an error that says
    so, not an empty list (which would read as missing metadata)."""

    def entries(p: Path) -> list[os.DirEntry]:
        try:
            with os.scandir(p) as it:
                return sorted(it, key=lambda e: e.name)
        except FileNotFoundError:
            return []
        except PermissionError as e:
            raise permission_error(p, what) from e

    return [
        Path(f.path)
        for d in entries(folder)
        if d.is_dir()
        for f in entries(Path(d.path))
        if f.name.endswith(".parquet") and f.is_file()
    ]


def writing_command(path: Path) -> str | None:
    """The command recorded in ``meta/vla_progress.json`` while it has not finished writing the dataset at ``path``
    (None: no record, or the write completed)."""
    record = path / "meta" / PROGRESS_FILE
    if not record.is_file():
        return None
    try:
        progress = json.loads(record.read_text())
        return None if progress["complete"] else str(progress["command"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise DatasetFormatError(
            f"{record}: not a valid progress record ({e}); re-create the dataset with the command that wrote it"
        ) from e


class LeRobotMetadata:
    """Everything under ``meta/`` of a LeRobot dataset at ``path``, validated."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        #: the command that finishes this dataset when its writing was interrupted, else None
        self.incomplete: str | None = writing_command(self.path)
        if (self.path / STAGING_DIR / "COMMIT").exists():
            fix = (
                f"re-run `{self.incomplete}` to finish it"
                if self.incomplete
                else "re-run the vla command that was writing it, with the same arguments, to finish it"
            )
            raise DatasetFormatError(
                f"{self.path}: a write was interrupted while committing an episode; {fix}"
            )
        if self.incomplete and not (self.path / "meta" / "info.json").is_file():
            raise DatasetFormatError(
                f"{self.path}: no episode written yet (the command writing it was interrupted); re-run "
                f"`{self.incomplete}` to write the dataset"
            )
        self.info: dict[str, Any] = read_json(self.path / "meta" / "info.json", "meta/info.json")
        if not isinstance(self.info, dict):
            raise DatasetFormatError(
                f"{self.path / 'meta/info.json'}: not a JSON object (got {type(self.info).__name__}); restore it"
            )
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
        if not np.isfinite(self.fps) or self.fps <= 0:  # timestamps and video frames are placed by it
            raise DatasetFormatError(
                f"{self.path / 'meta/info.json'}: fps must be a positive number, got {self.info['fps']!r}; "
                "set it to the recording rate"
            )
        if not isinstance(raw_features, dict) or not all(isinstance(f, dict) for f in raw_features.values()):
            raise DatasetFormatError(
                f"{self.path / 'meta/info.json'}: 'features' must map each feature name to its "
                "{'dtype', 'shape'} record; fix meta/info.json"
            )
        self.features = self._parse_features(raw_features)
        if self.version == "v3.0":
            self.tasks = self._load_tasks_v3()
            self.episodes = self._load_episodes_v3()
        else:
            rows = read_jsonl(self.path / "meta" / "tasks.jsonl")
            self.tasks = {}
            for t in rows:
                if not isinstance(t.get("task"), str) or not isinstance(t.get("task_index"), int):
                    raise DatasetFormatError(
                        f"{self.path / 'meta/tasks.jsonl'}: line {t} needs an integer 'task_index' and a text "
                        "'task'; rewrite meta/tasks.jsonl"
                    )
                self.tasks[t["task_index"]] = t["task"]
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
        texts = text_values(table[text], path, text)
        tasks: dict[int, str] = {}
        for i, t in zip(table["task_index"].to_pylist(), texts):
            if i is None or t is None:
                raise DatasetFormatError(
                    f"{path}: a row has no task or task_index; rewrite meta/tasks.parquet"
                )
            tasks[int(i)] = t
        return tasks

    def _load_episodes_v3(self) -> dict[int, EpisodeRecord]:
        files = list_parquet_files(self.path / "meta" / "episodes", "the episode metadata (meta/episodes/)")
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
        known = {t: t for t in self.tasks.values()}
        for path in files:
            names = read_parquet_schema(path, "episode metadata")
            if missing := [c for c in needed if c not in names]:
                raise DatasetFormatError(
                    f"{path}: missing column(s) {missing}; the episode metadata is incomplete or truncated"
                )
            keep = [c for c in names if not c.startswith("stats/")]
            for row in table_rows(read_parquet(path, "episode metadata", keep), path, "episode metadata"):
                ep = int(row["episode_index"])
                if ep in episodes:
                    raise DatasetFormatError(
                        f"{path}: episode_index {ep} is listed more than once in the episode metadata; "
                        "re-create the dataset (the copies may disagree on where its frames are)"
                    )
                data_file = self._file(
                    "data_path", chunk_index=row["data/chunk_index"], file_index=row["data/file_index"]
                )
                videos = {
                    k: (
                        self._file(
                            "video_path",
                            video_key=k,
                            chunk_index=row[f"videos/{k}/chunk_index"],
                            file_index=row[f"videos/{k}/file_index"],
                        ),
                        float(row[f"videos/{k}/from_timestamp"]),
                    )
                    for k in video_keys
                }
                metadata = {
                    # the task objects of meta/tasks: a long task is held once, not once per episode
                    "tasks": [known.get(t, t) for t in row.get("tasks") or []],
                    "length": int(row["length"]),
                    **self._episode_record(path, ep, row),
                }
                episodes[ep] = EpisodeRecord(ep, int(row["length"]), data_file, videos, metadata)
        return dict(sorted(episodes.items()))

    @staticmethod
    def _episode_record(path: Path, ep: int, row: dict[str, Any]) -> dict[str, Any]:
        """The writer's metadata of episode ``ep``: its JSON column when present (exact), else the flat columns of
        datasets written without it (``a/b`` -> nested; other tools' extra columns)."""
        if (text := row.get(METADATA_JSON_COLUMN)) is not None:
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise DatasetFormatError(
                    f"{path}: episode {ep}'s {METADATA_JSON_COLUMN} is not valid JSON ({e}); the file is damaged, "
                    "re-create the dataset"
                ) from None
            if not isinstance(record, dict):
                raise DatasetFormatError(
                    f"{path}: episode {ep}'s {METADATA_JSON_COLUMN} is not a JSON object"
                )
            return record
        extra = {
            k: v
            for k, v in row.items()
            if k not in _EPISODE_COLUMNS
            and not k.startswith(_STRUCTURAL_PREFIXES)
            and k != METADATA_JSON_COLUMN
        }
        return unflatten(extra)

    def _file(self, template: str, **fields: Any) -> Path:
        """The file info.json's path ``template`` (``data_path``/``video_path``) names for ``fields``."""
        pattern = self.info.get(template)
        if not isinstance(pattern, str):
            raise DatasetFormatError(
                f"{self.path / 'meta/info.json'}: {template} is {pattern!r}, not a path template; fix meta/info.json"
            )
        try:
            return self.path / str(pattern).format(**fields)
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise DatasetFormatError(
                f"{self.path / 'meta/info.json'}: {template} {pattern!r} cannot be filled with {sorted(fields)} "
                f"({type(e).__name__}: {e}); fix it to LeRobot's template for codebase_version {self.version}"
            ) from None

    def _load_episodes_v2(self) -> dict[int, EpisodeRecord]:
        chunks = int(self.info.get("chunks_size", 1000))
        video_keys = [k for k, f in self.features.items() if f.kind == "video"]
        episodes: dict[int, EpisodeRecord] = {}
        for row in read_jsonl(self.path / "meta" / "episodes.jsonl"):
            ep, chunk = int(row["episode_index"]), int(row["episode_index"]) // chunks
            if ep in episodes:
                raise DatasetFormatError(
                    f"{self.path / 'meta/episodes.jsonl'}: episode_index {ep} is listed more than once; "
                    "re-create the dataset"
                )
            data_file = self._file("data_path", episode_chunk=chunk, episode_index=ep)
            videos = {
                k: (
                    self._file("video_path", episode_chunk=chunk, video_key=k, episode_index=ep),
                    0.0,
                )
                for k in video_keys
            }
            metadata = {k: v for k, v in row.items() if k != "episode_index"}
            episodes[ep] = EpisodeRecord(ep, int(row["length"]), data_file, videos, metadata)
        return dict(sorted(episodes.items()))

    def _parse_splits(self) -> dict[str, list[int]]:
        """Episode indices of each split. Episode indices need not be contiguous (a dataset whose episode 3 was
        deleted lists 0, 1, 2, 4): every episode the metadata lists is read. A single split (LeRobot writes
        ``{"train": "0:N"}`` with N the episode count) holds every episode; with several, an episode in none of
        them is an error rather than an episode silently left out."""
        info_path = self.path / "meta/info.json"
        raw = self.info.get("splits") or {"train": f"0:{max(self.episodes, default=-1) + 1}"}
        if not isinstance(raw, dict):
            raise DatasetFormatError(
                f"{info_path}: 'splits' must be an object like {{'train': '0:N'}}, got {raw!r}"
            )
        splits: dict[str, list[int]] = {}
        for name, spec in raw.items():
            try:
                if isinstance(spec, str):
                    lo, hi = (int(x) for x in spec.split(":"))
                    splits[name] = [e for e in self.episodes if lo <= e < hi]
                else:
                    splits[name] = sorted(int(e) for e in spec if int(e) in self.episodes)
            except (ValueError, TypeError) as e:
                raise DatasetFormatError(f"{info_path}: split {name!r} = {spec!r} is not 'start:stop'") from e
        covered = {e for eps in splits.values() for e in eps}
        if outside := [e for e in self.episodes if e not in covered]:
            if len(splits) == 1:
                only = next(iter(splits))
                splits[only] = list(self.episodes)
            else:
                raise DatasetFormatError(
                    f"{info_path}: {len(outside)} episode(s) listed in the episode metadata are in no split "
                    f"(episode_index {outside[:8]}{' ...' if len(outside) > 8 else ''}; splits {raw}); add them "
                    "to a split in meta/info.json so that no episode is left out silently"
                )
        return splits

    def missing_episode_indices(self) -> list[int]:
        """Episode indices below the largest one that the metadata does not list (a gap: 0, 1, 2, 5 -> 3, 4)."""
        top = max(self.episodes, default=-1)
        return [e for e in range(top + 1) if e not in self.episodes]
