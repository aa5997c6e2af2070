"""Checks of what a dataset *declares* against what it holds, for ``vla data validate``.

A reader reads what it can and raises on what it cannot; these checks find the disagreements that would
otherwise pass silently: episode indices with gaps, ``meta/info.json`` totals that differ from the episode
metadata, tasks without text, a ``meta/stats.json`` that is not JSON (or not numbers), a registered robot whose features the generic key map
cannot use (e.g. no ``observation.state``), and timestamps that do not match ``frame_index / fps``.
Each finding is a ``vla.data.validate.Problem`` with its file and a fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from vla.data.readers import DatasetFormatError, DatasetReader

if TYPE_CHECKING:
    from pathlib import Path

    from vla.data.validate import Problem

MAX_LISTED = 5
#: Timestamps may differ from ``frame_index / fps`` by this much (seconds) plus float32 rounding: LeRobot's
#: own ``check_timestamps_sync`` default tolerance (lerobot/datasets/utils.py, ``tolerance_s=1e-4``).
TIMESTAMP_TOLERANCE_S = 1e-4


def _listed(values: list[int]) -> str:
    return f"{values[:MAX_LISTED]}{' ...' if len(values) > MAX_LISTED else ''}"


def metadata_problems(reader: DatasetReader) -> list[Problem]:
    """Dataset-level disagreements between the metadata and the data (LeRobot; none for other formats except the
    key map check)."""
    from vla.data.readers.lerobot import LeRobotReader

    problems: list[Problem] = []
    if isinstance(reader, LeRobotReader):
        problems += _episode_problems(reader)
        problems += _video_fps_problems(reader)
        problems += _stats_json_problems(reader)
    problems += _keymap_problems(reader)
    return problems


def _episode_problems(reader: DatasetReader) -> list[Problem]:
    from vla.data.validate import Problem

    meta, info_path = reader.meta, reader.path / "meta" / "info.json"  # type: ignore[attr-defined]
    out: list[Problem] = []
    if missing := meta.missing_episode_indices():
        out.append(
            Problem(
                "episode_gap",
                f"{reader.path / 'meta'} episode_index",
                f"the episode metadata lists {len(meta.episodes)} episodes with indices up to "
                f"{max(meta.episodes)}; {len(missing)} index(es) are absent: {_listed(missing)}. Every listed "
                "episode is read; absent ones are lost data if they were not removed on purpose.",
                "restore the missing episodes, or re-number the episodes (vla data convert) if they were "
                "removed on purpose",
            )
        )
    if empty := sorted(i for i, t in meta.tasks.items() if not t.strip()):
        out.append(
            Problem(
                "empty_task",
                f"{reader.path / 'meta'} tasks",
                f"task_index {_listed(empty)} has no text, so its frames train with an empty prompt",
                "write each episode's instruction into meta/tasks",
            )
        )
    if empty := sorted(i for i, ep in meta.episodes.items() if ep.length == 0):
        out.append(
            Problem(
                "empty_episode",
                f"{reader.path / 'meta'} episode_index",
                f"episode_index {_listed(empty)} has 0 frames: nothing of it can be trained on",
                "re-record or remove the episode",
            )
        )
    out += _split_problems(reader, info_path)
    frames = sum(ep.length for ep in meta.episodes.values())
    total = reader.lerobot_info().get("total_frames")  # type: ignore[attr-defined]
    if total is not None and int(total) != frames:
        out.append(
            Problem(
                "totals",
                f"{info_path} total_frames",
                f"info.json says total_frames={total} but the episode metadata lists {frames} frames",
                "re-create the dataset, or set total_frames to the episodes' total if they are complete",
            )
        )
    return out


def _split_problems(reader: DatasetReader, info_path: Path) -> list[Problem]:
    """A single split whose ``start:stop`` range spans another number of episodes than the metadata lists: the
    reader reads every listed episode as that split (LeRobot writes ``{"train": "0:N"}``, N the episode count),
    so the range disagrees with the data."""
    from vla.data.validate import Problem

    raw = reader.lerobot_info().get("splits")  # type: ignore[attr-defined]
    if not isinstance(raw, dict) or len(raw) != 1:
        return []
    (name, spec), listed = next(iter(raw.items())), len(reader.meta.episodes)  # type: ignore[attr-defined]
    try:
        lo, hi = (int(x) for x in str(spec).split(":"))
    except ValueError:
        return []
    if hi - lo == listed:
        return []
    return [
        Problem(
            "splits",
            f"{info_path} splits",
            f"split {name!r} = {spec!r} spans {hi - lo} episodes but the episode metadata lists {listed}; every "
            f"listed episode is read as {name!r}",
            f"set splits to {{{name!r}: '0:{listed}'}}, or remove the episodes that do not belong",
        )
    ]


def _video_fps_problems(reader: DatasetReader) -> list[Problem]:
    """A video feature whose ``info["video.fps"]`` differs from the dataset's fps: frames are looked up at
    ``frame_index / fps``, so a file encoded at another rate would give other frames than the metadata says."""
    from vla.data.validate import Problem

    info = reader.lerobot_info()  # type: ignore[attr-defined]
    out: list[Problem] = []
    for key, feature in (info.get("features") or {}).items():
        meta = feature.get("info") if isinstance(feature, dict) and feature.get("dtype") == "video" else None
        declared = meta.get("video.fps") if isinstance(meta, dict) else None
        if (
            isinstance(declared, int | float)
            and reader.fps
            and abs(float(declared) - float(reader.fps)) > 1e-6
        ):
            out.append(
                Problem(
                    "video_fps",
                    f"{reader.path / 'meta' / 'info.json'} features.{key}.info.video.fps",
                    f"video.fps {declared:g} differs from the dataset's fps {reader.fps:g}; frames are decoded at "
                    "frame_index / fps",
                    "set video.fps to the rate the videos were encoded at (ffprobe), or re-encode them at fps",
                )
            )
    return out


def flag_problems(where: str, steps: dict[str, np.ndarray]) -> list[Problem]:
    """RLDS episode-boundary flags that are not ``is_first`` on the first step only, or ``is_last`` on another
    step than the last (readers that split or join episodes by them would cut the episode elsewhere). An
    ``is_last`` set on no step is accepted: genuine Open X-Embodiment exports leave it so (the bridge_dataset
    debug copy Octo's tests use sets it on none of its 50 episodes)."""
    from vla.data.validate import Problem

    out: list[Problem] = []
    for key, at in (("is_first", 0), ("is_last", -1)):
        flags = steps.get(key)
        if flags is None or len(flags) == 0 or flags.dtype == object:
            continue
        flags = np.asarray(flags).reshape(len(flags), -1)[:, 0].astype(bool)
        expected = np.zeros(len(flags), bool)
        expected[at] = True
        if key == "is_last" and not flags.any():
            continue
        if (flags != expected).any():
            step = "first" if at == 0 else "last"
            out.append(
                Problem(
                    "episode_flags",
                    f"{where} field {key!r}",
                    f"{key} is set on step(s) {np.flatnonzero(flags)[:MAX_LISTED].tolist()}, expected the {step} "
                    f"step ({len(flags) - 1 if at else 0}) only",
                    "re-export the episode with its boundary flags set as RLDS defines them",
                )
            )
    return out


def _stats_json_problems(reader: DatasetReader) -> list[Problem]:
    from vla.data.validate import Problem

    path = reader.path / "meta" / "stats.json"
    try:
        stats = reader.lerobot_stats()  # type: ignore[attr-defined]
    except (DatasetFormatError, ValueError, TypeError, AttributeError) as e:
        return [
            Problem(
                "stats_json",
                str(path),
                f"unreadable LeRobot statistics: {e}",
                "delete it and recompute the statistics (LeRobot's compute_stats; vla reads its own from "
                "'vla data stats')",
            )
        ]
    bad = [
        f"{key}/{name}"
        for key, fields in (stats or {}).items()
        for name, value in fields.items()
        if value.dtype.kind not in "biuf"
    ]
    if bad:
        return [
            Problem(
                "stats_json",
                str(path),
                f"non-numeric statistics {bad[:MAX_LISTED]}",
                "delete it and recompute the statistics (LeRobot's compute_stats)",
            )
        ]
    nonfinite = [
        f"{key}/{name}"
        for key, fields in (stats or {}).items()
        for name, value in fields.items()
        if value.dtype.kind == "f" and not np.isfinite(value).all()
    ]
    if nonfinite:
        return [
            Problem(
                "stats_json",
                str(path),
                f"non-finite (NaN or inf) statistics {nonfinite[:MAX_LISTED]}",
                "delete it and recompute the statistics (LeRobot's compute_stats)",
            )
        ]
    return []


def _keymap_problems(reader: DatasetReader) -> list[Problem]:
    """A dataset naming a registered embodiment (LeRobot ``robot_type``) that still gets no key map: the
    features do not fit, so training, stats and ``show`` cannot standardize it."""
    from vla.data.standardize import keymap_for, no_keymap_reason
    from vla.data.validate import Problem
    from vla.embodiments import EMBODIMENTS

    robot = reader.robot_type
    if not robot or robot not in EMBODIMENTS or keymap_for(reader) is not None:
        return []
    return [
        Problem(
            "keymap",
            f"{reader.path / 'meta' / 'info.json'} features",
            f"robot_type {robot!r} is a registered embodiment but the dataset gets no key map: "
            f"{no_keymap_reason(reader)}",
            "add the missing feature (or fix its shape) in meta/info.json and the data, or add a key map entry "
            "under vla/data/keymaps/",
        )
    ]


def timestamp_problems(reader: DatasetReader, where: str, steps: dict[str, np.ndarray]) -> list[Problem]:
    """Timestamps that disagree with ``frame_index / fps`` (relative to the episode's first timestamp) by more
    than ``TIMESTAMP_TOLERANCE_S``: LeRobot decodes video frames at the stored timestamps, vla at
    ``frame_index / fps``, so the two would read different frames."""
    from vla.data.validate import Problem

    ts, fi = steps.get("timestamp"), steps.get("frame_index")
    if ts is None or fi is None or not reader.fps or len(ts) == 0:
        return []
    ts = np.asarray(ts, dtype=np.float64).reshape(-1)
    fi = np.asarray(fi, dtype=np.float64).reshape(-1)
    expected = ts[0] + (fi - fi[0]) / float(reader.fps)
    tolerance = TIMESTAMP_TOLERANCE_S + 4 * np.finfo(np.float32).eps * np.abs(expected)
    bad = np.flatnonzero(np.abs(ts - expected) > tolerance)
    if not len(bad):
        return []
    first = int(bad[0])
    return [
        Problem(
            "timestamp",
            f"{where} field 'timestamp'",
            f"{len(bad)} timestamp(s) disagree with frame_index / fps ({reader.fps:g} Hz), first at frame "
            f"{first}: {ts[first]:.6g} s, expected {expected[first]:.6g} s",
            "fix the fps in meta/info.json or re-convert the episode with consistent timestamps",
        )
    ]


__all__ = ["TIMESTAMP_TOLERANCE_S", "flag_problems", "metadata_problems", "timestamp_problems"]
