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
#: what ``vla train`` writes in a run folder before its first checkpoint (the run lock, the resolved config, metrics)
RUN_FILES = (".vla-train.lock", "config.yaml", "metrics.jsonl")
#: hidden folders a killed checkpoint write or deletion leaves in ``checkpoints/``: the step being written
#: (``.step-X.partial``) or deleted (``.step-X.deleting``), and ``save_pretrained``'s staging copies of the model
#: written into the partial folder (``..step-X.partial.tmp-*`` / ``.old-*``: ``tempfile.mkdtemp`` names next to it,
#: see ``vla.models.hub``)
LEFTOVER = re.compile(r"\.step-\d{7}\.(?:partial|deleting)|\.\.step-\d{7}\.partial\.(?:tmp|old)-[a-z0-9_]{8}")
#: ``save_pretrained``'s hidden staging copy (``.<name>.tmp-*``) or set-aside old copy (``.<name>.old-*``) of any
#: checkpoint folder
STAGING = re.compile(r"\..+\.(?:tmp|old)-[a-z0-9_]{8}")


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
    newest complete step) or a plain checkpoint folder, resolved to an absolute path. Refused, naming the fix: a
    step folder without its ``COMPLETE`` marker (however the path is written), a hidden leftover of an interrupted
    write, a run folder with no checkpoint yet, a file (except a model YAML), a missing absolute or ``./`` path.
    Hub ids (and preset names) are returned unchanged."""
    p = Path(path).expanduser()
    if not p.exists():
        if p.is_absolute() or str(path).startswith((".", "~")):  # a hub id is never written so
            raise FileNotFoundError(f"{path}: no such checkpoint folder")
        return p  # a hub id: from_pretrained looks it up in the local Hugging Face cache
    if p.is_file() and p.suffix not in (".yaml", ".yml"):  # a YAML file is a model config (vla model info)
        raise FileNotFoundError(
            f"{p}: a file, not a checkpoint folder; pass the folder that holds it ({p.resolve().parent})"
        )
    p = p.resolve()  # "step-0000004" typed inside checkpoints/ is a step folder too: its marker is checked
    if LEFTOVER.fullmatch(p.name) or STAGING.fullmatch(p.name):
        run = p.parent.parent if p.parent.name == CHECKPOINTS else p.parent
        raise FileNotFoundError(
            f"{p}: a hidden folder left by an interrupted checkpoint write or deletion, not a checkpoint; use the "
            f"run folder {run} (its newest complete step) or a complete step-XXXXXXX folder"
        )
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
    if not (p / "config.json").exists() and any((p / f).exists() for f in RUN_FILES):
        raise FileNotFoundError(
            f"{p}: a training run folder with no checkpoint yet (train.save_every steps have not passed); "
            "wait for its first checkpoint"
        )
    return p


def check_run_dir_target(path: str | Path) -> None:
    """Refuse a ``--run-dir`` that is something else: a checkpoint step folder (resuming is re-running with the run
    folder that holds ``checkpoints/``), a model folder or a dataset. A run started there would write its own
    ``checkpoints/``, ``config.yaml`` and metrics into it, from step 0. A missing or empty folder, or a run
    folder, passes."""
    p = Path(path).expanduser()
    if not p.is_dir():
        if p.exists():
            raise ValueError(f"--run-dir {path}: a file, not a folder")
        return
    p = p.resolve()
    if p.name == CHECKPOINTS and any(STEP_DIR.match(c.name) for c in p.iterdir()):
        raise ValueError(
            f"--run-dir {path}: the checkpoints folder of a run, not a run folder; to resume that run, pass "
            f"--run-dir {p.parent}"
        )
    if p.parent.name == CHECKPOINTS and (STEP_DIR.match(p.name) or LEFTOVER.fullmatch(p.name)):
        raise ValueError(
            f"--run-dir {path}: a checkpoint folder inside a run, not a run folder; to resume that run, pass its "
            f"run folder: --run-dir {p.parent.parent} (it continues from the newest complete checkpoint)"
        )
    if (p / CHECKPOINTS).is_dir() or any((p / f).exists() for f in RUN_FILES):
        return  # a run folder
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        raise ValueError(
            f"--run-dir {path}: a model folder (config.json + weights), not a run folder; train into a new "
            f"folder (to start from this model: vla finetune {p} --embodiment NAME --run-dir NEW_FOLDER)"
        )
    if (p / "meta" / "info.json").is_file() or (p / "dataset_info.json").is_file():
        raise ValueError(
            f"--run-dir {path}: a dataset folder, not a run folder; give the dataset as data.datasets=[{p}] and "
            "--run-dir a new folder"
        )


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
