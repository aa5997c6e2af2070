"""``vla data info`` and ``vla data show``: what a dataset holds, and one step of it exactly as stored.

``show_frame`` implements the CLI's JSON contract (other tools parse it): ``path``, ``format``, ``split``, ``episode``,
``frame``, ``num_frames``, ``episode_metadata``, ``raw`` (every field of the step under its stored name; images
summarized as ``{"shape": [H, W, C], "mean": ...}``) and ``standardized`` (the canonical frame; absent when the
dataset has no registered key map, with ``standardized_note`` saying why; ``null`` plus ``standardized_note`` saying
why when the key map drops the frame).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vla.data.readers import DatasetReader, open_dataset
from vla.types import image_summary


def to_jsonable(value: Any) -> Any:
    """Numbers -> JSON numbers/lists, bytes/str -> str, numpy scalars -> Python scalars (recursively)."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, bytes):  # binary data stays recognisable as such, never a silently altered string
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return f"<{len(value)} bytes, not UTF-8: {value[:32].hex()}{'...' if len(value) > 32 else ''}>"
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return [to_jsonable(v) for v in value.tolist()]
        if value.dtype.kind in "Sf":  # bytes -> str; floats one by one so NaN/inf become strings
            return to_jsonable(value.tolist())
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


def _is_image(value: Any) -> bool:
    return (
        isinstance(value, np.ndarray)
        and value.dtype == np.uint8
        and value.ndim == 3
        and value.shape[-1] in (1, 3, 4)
    )


def dataset_info(path: str | Path) -> dict[str, Any]:
    """Format, splits, episodes, frames, features, (when a key map exists) embodiment of a dataset, else
    ``key_map_problem`` (why none applies: an unknown name or robot_type, a missing or mis-sized feature),
    ``data_problem`` (``data_rows_problem``) and ``incomplete``: the command that finishes it when the command writing it was interrupted (else None)."""
    from vla.data.standardize import keymap_for, no_keymap_reason

    reader = open_dataset(path)
    info = reader.info()
    km = keymap_for(reader)
    info["key_map"] = km.dataset if km is not None else None
    info["embodiment"] = km.embodiment if km is not None else None
    info["key_map_problem"] = no_keymap_reason(reader) if km is None else None  # why no key map applies
    info["data_problem"] = data_rows_problem(reader)
    info["incomplete"] = reader.incomplete  # the command to re-run when its writing was interrupted
    return info


#: ``data_rows_problem`` reads one parquet footer per data file up to this many files (LeRobot v3 packs many
#: episodes per file; a v2.1 dataset of more episodes is left to ``vla data validate``, which reads every file)
MAX_CHECKED_DATA_FILES = 1000


def data_rows_problem(reader: DatasetReader) -> str | None:
    """Why the frame counts ``info`` prints (from the episode metadata) are not what the LeRobot data files hold --
    a data file missing, unreadable, or with another row count than its episodes' lengths add up to -- or None.
    Only parquet footers are read; None for other formats and for more than ``MAX_CHECKED_DATA_FILES`` files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = getattr(reader, "meta", None)
    if not reader.format.startswith("lerobot") or meta is None:
        return None
    frames: dict[Path, int] = {}
    for ep in meta.episodes.values():
        frames[ep.data_file] = frames.get(ep.data_file, 0) + ep.length
    if len(frames) > MAX_CHECKED_DATA_FILES:
        return None
    for path, listed in sorted(frames.items()):
        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except FileNotFoundError:
            return f"{path}: missing; the episode metadata lists {listed} frames in it. Restore the dataset"
        except (OSError, pa.ArrowException) as e:
            return f"{path}: cannot read it ({e}); the file is truncated or corrupt, re-download it"
        if rows != listed:
            return (
                f"{path}: holds {rows} rows but the episode metadata lists {listed} frames in it; the frame counts "
                "above come from the metadata. `vla data validate` names the episodes"
            )
    return None


def _check_split_episode(reader: DatasetReader, split: str | None, episode: int) -> str:
    splits = reader.splits()
    split = split or ("train" if "train" in splits else splits[0])
    if split not in splits:
        raise ValueError(f"{reader.path}: no split {split!r}; available: {splits}")
    n = reader.num_episodes(split)
    if not 0 <= episode < n:
        raise IndexError(
            f"{reader.path}: --episode {episode} out of range; split {split!r} has {n} episodes (0..{n - 1})"
        )
    return split


def show_frame(path: str | Path, split: str | None, episode: int, frame: int) -> dict[str, Any]:
    """One step as a JSON-able dict following the ``vla data show --json`` contract."""
    from vla.data.standardize import keymap_for, no_keymap_reason, standardize_frame

    reader = open_dataset(path)
    split = _check_split_episode(reader, split, episode)
    length = reader.episode_length(split, episode)
    if not 0 <= frame < length:
        raise IndexError(
            f"{reader.path}: --frame {frame} out of range; {split} episode {episode} has {length} frames (0..{length - 1})"
        )
    raw = reader.read_frame(split, episode, frame)
    out: dict[str, Any] = {
        "path": str(reader.path),
        "format": reader.format,
        "split": split,
        "episode": episode,
        "frame": frame,
        "num_frames": length,
        "episode_metadata": to_jsonable(reader.episode_metadata(split, episode)),
        "raw": {k: image_summary(v) if _is_image(v) else to_jsonable(v) for k, v in raw.items()},
    }
    if keymap_for(reader) is not None:
        try:
            out["standardized"] = to_jsonable(standardize_frame(reader, split, episode, frame).summary())
        except LookupError as e:  # the key map drops this frame (e.g. Bridge's all-zero first step)
            out["standardized"] = None
            out["standardized_note"] = str(e)
    else:  # no standardized section, but said why: a missing or mis-sized feature must not go unnoticed
        out["standardized_note"] = f"no key map applies: {no_keymap_reason(reader)}"
    return out


#: Arrays longer than this print as their shape and first ``SHOWN_VALUES`` values in ``format_frame``.
SHOWN_VALUES = 8


def _shape(value: list[Any]) -> list[int]:
    shape = [len(value)]
    while value and isinstance(value[0], list):
        value = value[0]
        shape.append(len(value))
    return shape


def _number(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _brief(value: Any) -> str:
    """One line for one JSON value of ``show_frame``: numbers with 4 digits, long arrays by shape + first values,
    images as shape + mean, long strings cut."""
    if isinstance(value, dict) and set(value) == {"shape", "mean"}:
        return f"image {value['shape']}, mean {_number(value['mean'])}"
    if isinstance(value, list):
        shape = _shape(value)
        flat = np.asarray(value, dtype=object).reshape(-1).tolist() if len(shape) > 1 else value
        if len(flat) <= SHOWN_VALUES:
            return "[" + ", ".join(_number(v) for v in flat) + "]"
        head = ", ".join(_number(v) for v in flat[:SHOWN_VALUES])
        return f"{shape} {head}, ... (first {SHOWN_VALUES} of {len(flat)}; --json for all)"
    if isinstance(value, str):
        return repr(value if len(value) <= 120 else value[:117] + "...")
    return _number(value)


def format_frame(out: dict[str, Any]) -> str:
    """``show_frame``'s dict as a readable summary (``vla data show`` without ``--json``): one line per field."""
    lines = [
        f"{out['path']} ({out['format']}): split {out['split']!r}, episode {out['episode']}, frame {out['frame']} "
        f"of {out['num_frames']}"
    ]
    for section in ("episode_metadata", "raw", "standardized"):
        if section not in out:
            if section == "standardized" and out.get("standardized_note"):
                lines.append(f"standardized: none ({out['standardized_note']})")
            continue
        value = out[section]
        if value is None:
            lines.append(f"{section}: none ({out.get('standardized_note', '')})")
            continue
        lines.append(f"{section}:")
        rows: list[tuple[str, str]] = []
        for key, v in value.items():
            if isinstance(v, dict) and set(v) != {"shape", "mean"}:  # e.g. standardized images by slot
                rows += [(f"{key}.{sub}", _brief(w)) for sub, w in v.items()]
            else:
                rows.append((key, _brief(v)))
        width = max(len(name) for name, _ in rows) if rows else 0
        lines += [f"  {name.ljust(width)}  {text}" for name, text in rows]
    return "\n".join(lines)
