"""The reader contract every on-disk format implements (LeRobot v2.1/v3.0, RLDS, ...).

Readers know nothing about models or embodiments: they expose raw episodes and frames exactly as stored, keyed
by the format's own feature names (LeRobot: ``observation.state``, ``observation.images.<cam>``; RLDS: step
feature paths joined by ``/`` without the ``steps/`` prefix, e.g. ``observation/state``).

Access is two-level so that training can be fast: ``read_episode`` returns every *low-dimensional* per-step field
of an episode at once (state, action, flags, text; cheap), while images are decoded on demand for just the frames
a sample needs (``read_images``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


class DatasetFormatError(ValueError):
    """A dataset file is missing, truncated, corrupt or inconsistent; the message names file/episode/field and a fix."""


@dataclass(frozen=True)
class FeatureInfo:
    """One per-step feature as stored.

    ``kind`` is ``"image"`` (stored per frame, e.g. JPEG/PNG), ``"video"`` (frames in a video file),
    ``"tensor"`` (numeric, ``shape`` per step, ``dtype`` numpy name) or ``"string"``.
    """

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "description": self.description,
        }


@dataclass
class RawEpisode:
    """All low-dimensional per-step fields of one episode.

    ``steps[key]`` is an array with leading dimension ``length`` (numbers with their stored dtype, strings as
    ``dtype=object`` arrays of ``str``); image/video features are *not* included (see ``read_images``).
    """

    split: str
    index: int
    length: int
    steps: dict[str, np.ndarray]
    metadata: dict[str, Any] = field(default_factory=dict)


class DatasetReader(ABC):
    """Random access to a dataset's episodes and frames. Subclasses set ``format`` and implement the methods."""

    format: str = ""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    # ---- identity ---------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def name(self) -> str:
        """Dataset name used to look up its key map (RLDS: builder name; LeRobot: directory/repo name)."""

    @property
    def fps(self) -> float | None:
        """Control/recording rate in Hz when the format stores it."""
        return None

    @property
    def robot_type(self) -> str | None:
        """Robot/embodiment name when the format stores it (LeRobot ``robot_type``)."""
        return None

    @property
    def incomplete(self) -> str | None:
        """The command that finishes this dataset when the command writing it was interrupted (it holds only the
        episodes written so far); None for a complete dataset."""
        return None

    # ---- structure ------------------------------------------------------------------------------------
    @abstractmethod
    def splits(self) -> list[str]: ...

    @abstractmethod
    def num_episodes(self, split: str) -> int: ...

    @abstractmethod
    def episode_length(self, split: str, episode: int) -> int: ...

    @abstractmethod
    def features(self) -> dict[str, FeatureInfo]:
        """Per-step features keyed by raw name, in a stable order."""

    def image_keys(self) -> list[str]:
        return [k for k, f in self.features().items() if f.kind in ("image", "video")]

    def num_frames(self, split: str) -> int:
        return sum(self.episode_length(split, e) for e in range(self.num_episodes(split)))

    # ---- data -----------------------------------------------------------------------------------------
    @abstractmethod
    def read_episode(self, split: str, episode: int) -> RawEpisode:
        """Low-dimensional fields of one episode (``episode`` counts from 0 in the format's natural order)."""

    @abstractmethod
    def read_images(
        self, split: str, episode: int, frames: Sequence[int], keys: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Decoded images: ``{key: uint8 [len(frames), H, W, 3]}`` for the requested frame indices."""

    def episode_metadata(self, split: str, episode: int) -> dict[str, Any]:
        return self.read_episode(split, episode).metadata

    def read_frame(self, split: str, episode: int, frame: int) -> dict[str, Any]:
        """Every field of one step as stored: numbers as arrays/scalars, strings as ``str``, images uint8 HWC."""
        ep = self.read_episode(split, episode)
        if not 0 <= frame < ep.length:
            raise IndexError(
                f"{self.path}: frame {frame} out of range for {split} episode {episode} ({ep.length} frames)"
            )
        out: dict[str, Any] = {k: v[frame] for k, v in ep.steps.items()}
        imgs = self.read_images(split, episode, [frame], self.image_keys())
        out.update({k: v[0] for k, v in imgs.items()})
        return out

    def info(self) -> dict[str, Any]:
        """Summary for ``vla data info``."""
        return {
            "path": str(self.path),
            "format": self.format,
            "name": self.name,
            "fps": self.fps,
            "robot_type": self.robot_type,
            "splits": {
                s: {"episodes": self.num_episodes(s), "frames": self.num_frames(s)} for s in self.splits()
            },
            "features": {k: f.to_json() for k, f in self.features().items()},
        }

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for readers holding nothing open
        """Release open files/decoders (readers reopen lazily, e.g. after a DataLoader worker fork)."""
