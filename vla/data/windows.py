"""Frame index -> training window: observation history + action chunk (+ pad mask) of one sample.

Per sample: reader -> ``standardize_episode`` (cached per process) -> normalize (per-embodiment
stats) -> images decoded for the T_obs history frames only -> resize (+ training augmentation, seeded per sample
so it does not depend on worker count or order) -> a dict that ``vla.data.collate`` turns into a ``Batch``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from vla.config import DataConfig
from vla.data.episode_index import NO_CACHE_ENV, kept_lengths
from vla.data.keymaps import KeyMapError
from vla.data.readers import DatasetFormatError, DatasetReader
from vla.data.standardize import (
    StandardizeOptions,
    StdEpisode,
    keymap_for,
    no_keymap_reason,
    standardize_episode,
)
from vla.data.transforms import augment_images, resize_images

log = logging.getLogger(__name__)

#: ``normalize(embodiment, dataset, which, array) -> array``; ``which`` is "state" or "action".
NormalizeFn = Callable[[str, str, str, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Source:
    """One dataset the loader reads: the reader, its key map and its kept-frame counts per episode (``index``:
    the episode index file they were read from, None when counted by standardizing every episode)."""

    reader: DatasetReader
    split: str
    keymap: Any
    lengths: np.ndarray  # int64 [num_episodes]: frames kept by standardization
    name: str
    options: StandardizeOptions | None = None
    index: Path | None = None
    unreadable: dict[int, str] = field(default_factory=dict)  # episode -> why it could not be read (0 frames)

    @property
    def num_samples(self) -> int:
        return int(self.lengths.sum())


def standardize_options(cfg: DataConfig) -> StandardizeOptions:
    """The ``StandardizeOptions`` a ``DataConfig`` asks for: every ``data.standardize`` field as it is, seeded by
    ``data.seed``."""
    return StandardizeOptions(**asdict(cfg.standardize), seed=cfg.seed)


def build_source(
    reader: DatasetReader,
    split: str,
    keymap: Any | None = None,
    options: StandardizeOptions | None = None,
    *,
    index_cache: bool = True,
    workers: int | None = None,
    on_bad_sample: str = "raise",
) -> Source:
    """The ``Source`` of one split: kept-frame counts from the dataset's episode index
    (``vla.data.episode_index``: built once by standardizing every episode of every split in ``workers``
    processes, then read back while the dataset files are unchanged). ``index_cache=False`` (or
    ``VLA_NO_INDEX_CACHE=1``) standardizes ``split`` every time instead, without reading or writing an
    index.

    An episode that cannot be read raises ``DatasetFormatError`` naming it; with ``on_bad_sample="skip"`` it is
    left out (0 frames) and listed in ``Source.unreadable`` (the loader bounds how many it accepts)."""
    km = keymap or keymap_for(reader)
    if km is None:
        raise KeyMapError(
            f"{reader.path}: dataset {reader.name!r} has no key map, so its frames cannot be mapped to the "
            f"canonical frame: {no_keymap_reason(reader)} Add one entry under vla/data/keymaps/ (or give the "
            "LeRobot dataset a registered robot_type whose spec matches its features)."
        )
    if split not in reader.splits():
        raise ValueError(f"{reader.path}: no split {split!r}; available: {reader.splits()}")
    lengths, index, unreadable = kept_lengths(reader, split, km, options, cache=index_cache, workers=workers)
    if unreadable and on_bad_sample != "skip":
        ep, why = next(iter(unreadable.items()))
        raise DatasetFormatError(
            f"{reader.path} split {split!r} episode {ep} cannot be read ({len(unreadable)} of {len(lengths)} "
            f"episodes cannot): {why}. Repair or re-export the dataset, or set data.on_bad_sample=skip to leave "
            "unreadable episodes out"
        )
    for ep, why in unreadable.items():
        log.warning("%s split %r: episode %d cannot be read and is skipped: %s", reader.path, split, ep, why)
    return Source(
        reader=reader, split=split, keymap=km, lengths=lengths, name=reader.name, options=options, index=index,
        unreadable=dict(unreadable),
    )  # fmt: skip


class WindowDataset(Dataset):
    """Map-style dataset over every kept frame of several sources; item ``i`` is one training sample.

    A sample is a dict of numpy/torch values for ``collate``: ``images[slot]`` uint8 ``[T_obs, h, w, 3]``,
    ``state`` float32 ``[S]`` with ``state_valid`` bool ``[S]`` (False on dims the dataset does not record),
    ``actions`` float32 ``[H, A]``, ``action_is_pad`` bool ``[H]``, ``prompt``,
    ``embodiment``, and bookkeeping (dataset, episode, frame).
    """

    def __init__(
        self,
        sources: Sequence[Source],
        cfg: DataConfig,
        *,
        normalize: NormalizeFn | None = None,
        train: bool = True,
        chunk_lengths: dict[str, int] | None = None,
        cache_episodes: int = 64,
    ) -> None:
        self.sources = list(sources)
        self.cfg = cfg
        self.normalize = normalize
        self.train = train
        self.chunk_lengths = chunk_lengths or {}  # embodiment -> default H when data.chunk_length is 0
        self.cache_episodes = cache_episodes
        # Flat index: sample i -> (source, episode, position within the episode's kept frames).
        self._src_offsets = np.cumsum([0] + [s.num_samples for s in self.sources])
        self._ep_offsets = [np.concatenate([[0], np.cumsum(s.lengths)]) for s in self.sources]
        self._cache: OrderedDict[tuple[int, int], StdEpisode] = OrderedDict()
        self.epoch = 0

    @property
    def source_offsets(self) -> np.ndarray:
        """int64 ``[num_sources]``: flat index of each source's first sample (sample ``i`` of source ``k`` is
        ``source_offsets[k] + i``)."""
        return self._src_offsets[:-1].astype(np.int64)

    def __len__(self) -> int:
        return int(self._src_offsets[-1])

    def locate(self, index: int) -> tuple[int, int, int]:
        """``(source index, episode, position)`` of flat sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range [0, {len(self)})")
        si = int(np.searchsorted(self._src_offsets, index, side="right") - 1)
        local = index - int(self._src_offsets[si])
        ep = int(np.searchsorted(self._ep_offsets[si], local, side="right") - 1)
        return si, ep, local - int(self._ep_offsets[si][ep])

    def episode(self, si: int, ep: int) -> StdEpisode:
        key = (si, ep)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        src = self.sources[si]
        std = standardize_episode(src.reader, src.split, ep, src.keymap, options=src.options)
        if len(std.frames) != src.lengths[ep]:  # the flat sample index was built from these counts
            where = f"its episode index {src.index}" if src.index else "the source's lengths"
            raise ValueError(
                f"{src.reader.path} ({src.name}) split {src.split!r} episode {ep}: standardization keeps "
                f"{len(std.frames)} frames but {where} says {int(src.lengths[ep])}. Delete the index file to "
                f"rebuild it (or set {NO_CACHE_ENV}=1 to count without one)."
            )
        if self.normalize is not None:
            std.state = self.normalize(std.embodiment, std.dataset, "state", std.state)
            std.action = self.normalize(std.embodiment, std.dataset, "action", std.action)
        self._cache[key] = std
        if len(self._cache) > self.cache_episodes:
            self._cache.popitem(last=False)
        return std

    def __getitem__(self, index: int | tuple[int, int]) -> dict[str, Any] | None:
        """Sample ``index``, or ``(epoch, index)`` as the loader's sampler gives it (the epoch seeds the sample's
        augmentation; a plain index uses ``self.epoch``)."""
        epoch = self.epoch
        if isinstance(index, tuple):
            epoch, index = index
        si, ep, pos = self.locate(index)
        try:
            return self._sample(si, ep, pos, index, epoch)
        except Exception as e:
            src = self.sources[si]
            where = f"{src.reader.path} ({src.name}) split {src.split!r} episode {ep} position {pos}"
            if self.cfg.on_bad_sample == "skip":  # the loader counts and logs it in the main process
                return {"__skipped__": f"sample {index}: {where}: {e}"}
            msg = f"{e} [while loading sample {index}: {where}; set data.on_bad_sample=skip to skip bad samples]"
            if isinstance(e, UnicodeError | OSError) or type(e).__module__.startswith(
                ("pyarrow", "PIL", "av")
            ):
                # a library's own error about the data (ArrowInvalid, UnicodeDecodeError, ...): the project's type
                raise DatasetFormatError(msg) from e
            try:
                wrapped = type(e)(
                    msg
                )  # keep the type callers may catch (ValueError, DatasetFormatError, ...)
            except Exception:
                wrapped = RuntimeError(msg)
            raise wrapped from e

    def _sample(self, si: int, ep: int, pos: int, index: int, epoch: int) -> dict[str, Any]:
        src, cfg = self.sources[si], self.cfg
        std = self.episode(si, ep)
        n = len(std.frames)
        horizon = cfg.chunk_length or self.chunk_lengths.get(std.embodiment, 1)
        # Action chunk [H, A]: the kept frames that follow `pos` contiguously in raw time. Steps past the episode
        # end -- or past a gap a filter left (the DROID idle filter drops frames mid-episode) -- repeat the last
        # real action and are flagged as padding: a chunk never splices actions from both sides of a gap.
        steps = np.arange(pos, pos + horizon)
        gap = std.frames[np.minimum(steps, n - 1)] - std.frames[pos] != steps - pos
        is_pad = np.logical_or.accumulate((steps >= n) | gap)  # once padded, every later step is padding
        last_real = pos + int((~is_pad).sum()) - 1
        actions = std.action[np.where(is_pad, last_real, steps)]
        # Never let NaN/inf reach the model silently: it would poison every weight through one step.
        if not np.isfinite(std.state[pos]).all():
            raise ValueError(f"non-finite state at frame {int(std.frames[pos])}: {std.state[pos].tolist()}")
        bad = ~np.isfinite(actions[~is_pad]).all(axis=-1)
        if bad.any():
            frame = int(std.frames[pos + int(np.flatnonzero(bad)[0])])
            raise ValueError(
                f"non-finite action at frame {frame} (in the chunk of frame {int(std.frames[pos])})"
            )
        # Observation history: T_obs frames ending at `pos`, repeating the first frame of its contiguous run before
        # the episode start (or before a gap, as for the action chunk).
        hist = np.maximum(np.arange(pos - cfg.obs_history + 1, pos + 1), 0)
        contiguous = std.frames[pos] - std.frames[hist] == pos - hist  # a suffix of the window
        hist = np.where(contiguous, hist, hist[contiguous][0])
        raw_frames = std.frames[hist].tolist()
        keys = list(std.cameras.values())
        decoded = src.reader.read_images(src.split, ep, raw_frames, keys) if keys else {}
        gen = None
        if self.train and cfg.augment.enabled:
            seed = int(np.random.SeedSequence([cfg.seed, epoch, index]).generate_state(1)[0])
            gen = torch.Generator().manual_seed(seed)
        images = {}
        for slot, key in std.cameras.items():
            img = decoded[key]
            if img.shape[-1] == 1:  # grayscale camera (some RLDS exports): the Batch contract is RGB
                img = np.repeat(img, 3, axis=-1)
            if cfg.image_size:
                img = resize_images(img, cfg.image_size)
            img = torch.as_tensor(img)
            if gen is not None:
                img = augment_images(img, cfg.augment, gen)
            images[slot] = img
        # state dims the key map pads with a constant (the dataset does not record them) are not real state:
        # zero them (as batch padding is) and let collate mask them out
        state_valid = np.asarray(std.metadata.get("state_valid", [True] * std.state.shape[1]), dtype=bool)
        return {
            "images": images,
            "state": np.where(state_valid, std.state[pos], 0.0).astype(np.float32),
            "state_valid": state_valid,
            "actions": np.ascontiguousarray(actions, dtype=np.float32),
            "action_is_pad": is_pad,
            "prompt": std.prompt[pos],
            "embodiment": std.embodiment,
            "dataset": std.dataset,
            "episode": ep,
            "frame": int(std.frames[pos]),
        }
