"""Dataset readers. ``open_dataset(path)`` detects the on-disk format and returns the matching reader."""

from __future__ import annotations

from pathlib import Path

from vla.data.readers.base import DatasetFormatError, DatasetReader, FeatureInfo, RawEpisode


def detect_format(path: str | Path) -> str:
    """``"lerobot"`` for a directory with ``meta/info.json``; ``"rlds"`` for a TFDS directory (``dataset_info.json``
    directly inside, or inside a single version sub-folder such as ``1.0.0/``)."""
    p = Path(path)
    if not p.exists():
        raise DatasetFormatError(f"{p}: no such file or directory. Pass the dataset's root folder.")
    if (p / "meta" / "info.json").is_file() or _being_written(p):
        return "lerobot"
    if (p / "dataset_info.json").is_file() or rlds_version_dir(p) is not None:
        return "rlds"
    raise DatasetFormatError(
        f"{p}: not a recognised dataset. Expected a LeRobot dataset (meta/info.json) or an RLDS/TFDS directory "
        f"(dataset_info.json + features.json + *.tfrecord-*), possibly in a version folder like {p}/1.0.0."
    )


def _being_written(p: Path) -> bool:
    """A LeRobot dataset whose first episode is not committed yet (its writer's progress record or commit exists)."""
    from vla.data.readers.lerobot_meta import PROGRESS_FILE, STAGING_DIR

    return (p / "meta" / PROGRESS_FILE).is_file() or (p / STAGING_DIR / "COMMIT").is_file()


def version_key(name: str) -> tuple:
    """Sort key of a version folder name: numeric parts numerically ("1.10.0" > "1.9.0"), others after them."""
    return tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in name.split("."))


def rlds_version_dir(p: Path) -> Path | None:
    """The newest version folder ``<p>/<x.y.z>/`` holding a ``dataset_info.json``, if any."""
    if not p.is_dir():
        return None
    versions = [d for d in p.iterdir() if d.is_dir() and (d / "dataset_info.json").is_file()]
    return max(versions, key=lambda d: version_key(d.name)) if versions else None


def open_dataset(path: str | Path) -> DatasetReader:
    """Open a dataset folder of any supported format (LeRobot v2.1/v3.0, RLDS)."""
    p = Path(path)
    fmt = detect_format(p)
    if fmt == "lerobot":
        from vla.data.readers.lerobot import LeRobotReader

        return LeRobotReader(p)
    from vla.data.readers.rlds import RLDSReader

    if not (p / "dataset_info.json").is_file():
        p = rlds_version_dir(p) or p
    return RLDSReader(p)


__all__ = [
    "DatasetFormatError",
    "DatasetReader",
    "FeatureInfo",
    "RawEpisode",
    "detect_format",
    "open_dataset",
    "rlds_version_dir",
    "version_key",
]
