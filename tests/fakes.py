"""Test doubles shared by several test modules (imported as ``from fakes import ...``; pytest puts tests/ on the
path). They implement contracts of the real code, never the code under test."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from vla.data.readers.base import DatasetReader, FeatureInfo, RawEpisode


class FakeReader(DatasetReader):
    """In-memory implementation of the ``DatasetReader`` contract: ``episodes[split]`` lists ``RawEpisode``s;
    images are constant 8x8 frames (value ``7 + i`` for the ``i``-th requested key)."""

    def __init__(
        self,
        name: str,
        episodes: dict[str, list[RawEpisode]],
        features: dict[str, FeatureInfo],
        *,
        path: str | Path | None = None,
        robot_type: str | None = None,
        fps: float | None = None,
        fmt: str = "fake",
    ) -> None:
        super().__init__(path if path is not None else f"/fake/{name}")
        self._name, self.episodes, self._features = name, episodes, features
        self._robot_type, self._fps, self.format = robot_type, fps, fmt

    @property
    def name(self) -> str:
        return self._name

    @property
    def robot_type(self) -> str | None:
        return self._robot_type

    @property
    def fps(self) -> float | None:
        return self._fps

    def splits(self) -> list[str]:
        return list(self.episodes)

    def num_episodes(self, split: str) -> int:
        return len(self.episodes[split])

    def episode_length(self, split: str, episode: int) -> int:
        return self.episodes[split][episode].length

    def features(self) -> dict[str, FeatureInfo]:
        return self._features

    def read_episode(self, split: str, episode: int) -> RawEpisode:
        return self.episodes[split][episode]

    def read_images(
        self, split: str, episode: int, frames: Sequence[int], keys: Sequence[str]
    ) -> dict[str, np.ndarray]:
        return {k: np.full((len(frames), 8, 8, 3), 7 + i, dtype=np.uint8) for i, k in enumerate(keys)}
