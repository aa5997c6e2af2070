"""The progress record of a dataset-writing command, so that re-running the same command resumes it.

``vla sim generate``, ``vla data convert`` and ``vla data merge`` keep ``meta/vla_progress.json`` in the dataset
they write::

    {"command": "vla data convert /data/droid /data/droid_lerobot --to lerobot",   # what finishes it
     "config": {...},      # the settings a re-run must share (a re-run with others is refused)
     "complete": false,    # true once every episode is written
     "state": {...}}       # the command's own bookkeeping (episodes done, dropped, counts for its summary)

It is written before the first episode (:func:`begin`) and is part of every episode's atomic commit
(``LeRobotWriter.progress``), so it always describes exactly the episodes on disk; work that adds no episode (a
dropped demonstration) saves it on its own (:func:`save_progress`, one atomic rename). Until ``complete``, readers
report the dataset as incomplete and name ``command`` (``vla data info`` / ``validate``), and the loader refuses it
unless ``data.allow_incomplete``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vla.data.readers.lerobot_meta import PROGRESS_FILE
from vla.data.writers.staging import recover
from vla.faults import kill_point


class OtherSettingsError(FileExistsError, ValueError):
    """The destination holds a dataset a writing command started with other settings (a ``FileExistsError``, as
    for any occupied destination, and a ``ValueError``: the settings are what is wrong)."""


@dataclass
class WriteProgress:
    """What a dataset-writing command has done so far (see the module docstring)."""

    command: str
    config: dict[str, Any]
    complete: bool = False
    state: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def progress_path(root: str | Path) -> Path:
    return Path(root) / "meta" / PROGRESS_FILE


def read_progress(root: str | Path) -> WriteProgress | None:
    """The dataset's progress record, or None when it has none (written by another tool, or by the Python API)."""
    path = progress_path(root)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        return WriteProgress(
            str(raw["command"]), dict(raw["config"]), bool(raw["complete"]), dict(raw["state"])
        )
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path}: not a valid progress record ({e}); delete the dataset folder and run the command again"
        ) from e


def unstarted(root: str | Path) -> bool:
    """Whether the folder ``root`` holds nothing but what a write killed before its first record left (the record's
    temporary file, empty folders): a destination to start afresh, not someone else's files."""
    leftovers = {progress_path(root).with_name(f".{PROGRESS_FILE}.tmp")}
    return all(p.is_dir() or p in leftovers for p in Path(root).rglob("*"))


def prepare_destination(dst: str | Path, overwrite: bool, *, option: str = "destination") -> None:
    """Check the folder a resumable command writes to (``option`` names it in errors, e.g. ``--out``): nothing
    there, or a write killed before its first record, starts afresh; a dataset this kind of command was writing
    resumes (``begin`` then checks it is the same command and settings); with ``overwrite`` a dataset there is
    deleted. Anything else is refused: another dataset without ``overwrite``, and never a folder of other files."""
    dst = Path(dst)
    if not dst.exists() or (dst.is_dir() and unstarted(dst)):
        return
    resumable = progress_path(dst).is_file()  # written by a resumable command: resume (or nothing to do)
    if resumable and not overwrite:
        return
    is_dataset = resumable or (dst / "meta" / "info.json").is_file()
    if overwrite and is_dataset:
        shutil.rmtree(dst)
        return
    what = "holds a dataset" if is_dataset else "exists and is not an empty folder"
    fix = (
        f"pass --overwrite to replace it, or choose a new {option}"
        if is_dataset
        else f"choose a new {option} (--overwrite only replaces a dataset)"
    )
    raise FileExistsError(f"{dst} {what}; {fix}")


def save_progress(root: str | Path, progress: WriteProgress) -> None:
    """Replace the record in one rename (a kill leaves the old or the new one)."""
    path = progress_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(progress.to_json())
    os.replace(tmp, path)
    kill_point("progress.saved")


def begin(root: str | Path, command: str, config: dict[str, Any], *, replace_hint: str = "") -> WriteProgress:
    """Open ``root`` for a write by ``command`` with ``config``: a new record for a new dataset, or the one a
    previous run of the same command left (to resume; to do nothing when it is complete). An interrupted commit is finished first (every writing
    command recovers the dataset before reading it). Refuses a dataset written with other settings; ``replace_hint``
    ends that error (e.g. `` (or pass --overwrite to replace it)``)."""
    root = Path(root)
    recover(root)
    progress = read_progress(root)
    if progress is None:
        progress = WriteProgress(command, config)
        save_progress(root, progress)
        return progress
    if progress.config != config:
        diff = sorted(k for k in {*config, *progress.config} if config.get(k) != progress.config.get(k))
        shown = ", ".join(f"{k}: {progress.config.get(k)!r} then, {config.get(k)!r} now" for k in diff)
        state = "holds the output of" if progress.complete else "was being written by"
        fix = "W" if progress.complete else "Re-run that command to finish it, or w"
        raise OtherSettingsError(
            f"{root} {state} `{progress.command}`; these settings differ ({shown}). "
            f"{fix}rite to a new destination{replace_hint}"
        )
    progress.command = command
    return progress


def finish(root: str | Path, progress: WriteProgress) -> None:
    """Mark the dataset complete (every episode the command asked for is written)."""
    progress.complete = True
    save_progress(root, progress)
