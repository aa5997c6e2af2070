"""Where checkpoints live in a training run, and which folder a user's path means.

A run directory written by ``vla train`` holds ``checkpoints/step-XXXXXXX/`` (7-digit optimizer step). A step
folder is a ``from_pretrained`` folder at its top level plus ``train_state/``; it counts only once its
``COMPLETE`` marker exists (written last), so a folder left by a killed write is never picked.

Every command that reads a checkpoint accepts a step folder, a run folder (= its newest complete step) or a plain
``from_pretrained`` folder (``vla model init``, an export): ``resolve_checkpoint(path)``.
"""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d{7})$")


def step_dir_name(step: int) -> str:
    """``step-0000042`` for step 42 (7 digits, so names sort like steps)."""
    if not 0 <= step < 10**7:
        raise ValueError(f"step {step} does not fit the 7-digit checkpoint name step-XXXXXXX")
    return f"step-{step:07d}"


def step_of(path: str | Path) -> int:
    """The optimizer step of a ``step-XXXXXXX`` folder."""
    m = STEP_DIR.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path}: not a checkpoint step folder (expected a name like step-0001000)")
    return int(m.group(1))


def is_complete(step_dir: str | Path) -> bool:
    return (Path(step_dir) / COMPLETE).is_file()


def complete_steps(run_dir: str | Path) -> list[Path]:
    """Complete step folders of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    steps = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and is_complete(p)]
    return sorted(steps, key=step_of)


def latest_complete(run_dir: str | Path) -> Path | None:
    """The newest complete step folder of a run, or None."""
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def resolve_checkpoint(path: str | Path) -> Path:
    """The ``from_pretrained`` folder ``path`` stands for: a step folder (must be complete), a run folder (its
    newest complete step) or a plain checkpoint folder. Hub ids and other strings are returned unchanged."""
    p = Path(path)
    if not p.exists():
        return p  # a hub id: from_pretrained looks it up in the local Hugging Face cache
    if STEP_DIR.match(p.name) and p.parent.name == CHECKPOINTS:
        if not is_complete(p):
            raise FileNotFoundError(
                f"{p}: checkpoint has no {COMPLETE} marker (its write was interrupted); use the run folder "
                f"{p.parent.parent} to pick its newest complete step"
            )
        return p
    if (p / CHECKPOINTS).is_dir():
        latest = latest_complete(p)
        if latest is None:
            raise FileNotFoundError(
                f"{p}: a training run folder with no complete checkpoint under {CHECKPOINTS}/ yet "
                "(train.save_every steps have not passed, or every write was interrupted)"
            )
        return latest
    return p


def display_name(path: str | Path) -> str:
    """A short name for a resolved checkpoint, fit to show to clients without the server's file layout:
    ``RUN/step-0000100`` for a training step folder, the folder's name for a plain checkpoint folder, a hub id
    unchanged."""
    p = Path(path)
    if not p.exists():
        return str(path)
    if STEP_DIR.match(p.name) and p.parent.name == CHECKPOINTS:
        return f"{p.parent.parent.name}/{p.name}"
    return p.resolve().name
