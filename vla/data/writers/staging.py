"""Atomic multi-file commits for dataset writers: stage new file versions, write a manifest, rename into place.

A writer stages every file an update touches under ``<root>/.vla_staging/`` and calls :func:`commit`. Renaming the
manifest to ``COMMIT`` is the commit point: a crash (or Ctrl-C) before it leaves the previous files untouched and
the staged ones are discarded by :func:`recover`; after it, :func:`recover` finishes the renames. Readers treat a
``COMMIT`` manifest as "write in progress". Ctrl-C is held back while the renames run (main thread).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from vla.data.readers.lerobot_meta import STAGING_DIR
from vla.faults import kill_point


def _apply(root: Path) -> None:
    staging = root / STAGING_DIR
    for src, dst in json.loads((staging / "COMMIT").read_text()):
        if (root / src).exists():
            (root / dst).parent.mkdir(parents=True, exist_ok=True)
            os.replace(root / src, root / dst)
            kill_point("lerobot.renaming")
    (staging / "COMMIT").unlink()
    shutil.rmtree(staging, ignore_errors=True)


def recover(root: str | Path) -> None:
    """Finish a commit interrupted after its manifest was written, and drop staged files of unfinished updates."""
    root = Path(root)
    if (root / STAGING_DIR / "COMMIT").exists():
        _apply(root)
    shutil.rmtree(root / STAGING_DIR, ignore_errors=True)


def staging_committed(root: str | Path) -> bool:
    """Whether a commit manifest is in place (the update is decided but its renames may be unfinished)."""
    return (Path(root) / STAGING_DIR / "COMMIT").exists()


def stage_dir(root: str | Path, name: str) -> Path:
    """A fresh, empty staging folder for one update (same filesystem as ``root``, so renames are atomic)."""
    stage = Path(root) / STAGING_DIR / name
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    return stage


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda sig, frame: received.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            raise KeyboardInterrupt


def commit(root: str | Path, staged: dict[str, Path]) -> None:
    """Move staged files (``{final path relative to root: staged file}``) into place, all or nothing."""
    root = Path(root)
    staging = root / STAGING_DIR
    plan = [[str(src.relative_to(root)), dst] for dst, src in staged.items()]
    (staging / "COMMIT.tmp").write_text(json.dumps(plan))
    kill_point("lerobot.staged")
    with _sigint_deferred():
        os.replace(staging / "COMMIT.tmp", staging / "COMMIT")  # the commit point
        kill_point("lerobot.committed")
        _apply(root)
