"""Training loader: frame index -> window (observation history + action chunk) -> collated ``Batch``.

Data flow per sample (DESIGN §2): reader -> ``standardize_episode`` (cached per process) -> normalize (per
embodiment stats) -> images decoded for the T_obs history frames only -> resize (+ training augmentation) ->
``collate`` pads state/action widths to the batch maximum and builds the masks of a mixed-embodiment ``Batch``.

Order and resume: ``SampleOrder`` yields sample indices from a permutation seeded by (seed, epoch) and sliced by
rank, so ranks see disjoint samples; ``VLALoader.state_dict()`` records how many batches the *consumer* has
taken (not how many workers prefetched), so a restored loader yields exactly the batches the original would have.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from vla.config import DataConfig
from vla.data.mixture_sampler import MixtureSampler
from vla.data.readers import DatasetReader, open_dataset
from vla.data.standardize import StandardizeOptions, StdEpisode, keymap_for, standardize_episode
from vla.data.transforms import augment_images, resize_images
from vla.types import Batch

if TYPE_CHECKING:
    from vla.data.normalize import StatsFile

log = logging.getLogger(__name__)

#: ``normalize(embodiment, dataset, which, array) -> array``; ``which`` is "state" or "action".
NormalizeFn = Callable[[str, str, str, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Source:
    """One dataset the loader reads: the reader, its key map and its kept-frame counts per episode."""

    reader: DatasetReader
    split: str
    keymap: Any
    lengths: np.ndarray  # int64 [num_episodes]: frames kept by standardization
    name: str
    options: StandardizeOptions | None = None

    @property
    def num_samples(self) -> int:
        return int(self.lengths.sum())


def standardize_options(cfg: DataConfig) -> StandardizeOptions:
    """The ``StandardizeOptions`` a ``DataConfig`` asks for (seeded by ``data.seed``)."""
    st = cfg.standardize
    return StandardizeOptions(
        drop_first=st.drop_first,
        drop_last=st.drop_last,
        language_choice=st.language_choice,
        seed=cfg.seed,
        idle_filter=st.idle_filter,
        success_only=st.success_only,
    )


def build_source(
    reader: DatasetReader, split: str, keymap: Any | None = None, options: StandardizeOptions | None = None
) -> Source:
    """Standardize every episode once to learn how many frames each keeps (drop rules, idle filters)."""
    km = keymap or keymap_for(reader)
    if km is None:
        raise ValueError(
            f"{reader.path}: dataset {reader.name!r} has no registered key map, so its frames cannot be mapped to "
            "the canonical frame. Add one entry under vla/data/keymaps/ (or give the LeRobot dataset a registered "
            "robot_type whose spec matches its features)."
        )
    if split not in reader.splits():
        raise ValueError(f"{reader.path}: no split {split!r}; available: {reader.splits()}")
    lengths = np.array(
        [
            len(standardize_episode(reader, split, e, km, options=options).frames)
            for e in range(reader.num_episodes(split))
        ],
        dtype=np.int64,
    )
    return Source(reader=reader, split=split, keymap=km, lengths=lengths, name=reader.name, options=options)


class WindowDataset(Dataset):
    """Map-style dataset over every kept frame of several sources; item ``i`` is one training sample.

    A sample is a dict of numpy/torch values for ``collate``: ``images[slot]`` uint8 ``[T_obs, h, w, 3]``,
    ``state`` float32 ``[S]``, ``actions`` float32 ``[H, A]``, ``action_is_pad`` bool ``[H]``, ``prompt``,
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
        if self.normalize is not None:
            std.state = self.normalize(std.embodiment, std.dataset, "state", std.state)
            std.action = self.normalize(std.embodiment, std.dataset, "action", std.action)
        self._cache[key] = std
        if len(self._cache) > self.cache_episodes:
            self._cache.popitem(last=False)
        return std

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        si, ep, pos = self.locate(index)
        try:
            return self._sample(si, ep, pos, index)
        except Exception as e:
            src = self.sources[si]
            where = f"{src.reader.path} ({src.name}) split {src.split!r} episode {ep} position {pos}"
            if self.cfg.on_bad_sample == "skip":
                log.warning("skipping bad sample %d: %s: %s", index, where, e)
                return {"__skipped__": f"{where}: {e}"}
            raise type(e)(
                f"{e} [while loading sample {index}: {where}; set data.on_bad_sample=skip to skip bad samples]"
            ) from e

    def _sample(self, si: int, ep: int, pos: int, index: int) -> dict[str, Any]:
        src, cfg = self.sources[si], self.cfg
        std = self.episode(si, ep)
        n = len(std.frames)
        horizon = cfg.chunk_length or self.chunk_lengths.get(std.embodiment, 1)
        # Action chunk [H, A]: steps past the episode end repeat the last action and are flagged as padding.
        steps = np.arange(pos, pos + horizon)
        is_pad = steps >= n
        actions = std.action[np.minimum(steps, n - 1)]
        # Never let NaN/inf reach the model silently: it would poison every weight through one step.
        if not np.isfinite(std.state[pos]).all():
            raise ValueError(f"non-finite state at frame {int(std.frames[pos])}: {std.state[pos].tolist()}")
        bad = ~np.isfinite(actions[~is_pad]).all(axis=-1)
        if bad.any():
            frame = int(std.frames[pos + int(np.flatnonzero(bad)[0])])
            raise ValueError(
                f"non-finite action at frame {frame} (in the chunk of frame {int(std.frames[pos])})"
            )
        # Observation history: T_obs frames ending at `pos`, repeating the first frame before the episode start.
        hist = np.maximum(np.arange(pos - cfg.obs_history + 1, pos + 1), 0)
        raw_frames = std.frames[hist].tolist()
        keys = list(std.cameras.values())
        decoded = src.reader.read_images(src.split, ep, raw_frames, keys) if keys else {}
        gen = None
        if self.train and cfg.augment.enabled:
            seed = int(np.random.SeedSequence([cfg.seed, self.epoch, index]).generate_state(1)[0])
            gen = torch.Generator().manual_seed(seed)
        images = {}
        for slot, key in std.cameras.items():
            img = decoded[key]
            if cfg.image_size:
                img = resize_images(img, cfg.image_size)
            img = torch.as_tensor(img)
            if gen is not None:
                img = augment_images(img, cfg.augment, gen)
            images[slot] = img
        return {
            "images": images,
            "state": np.ascontiguousarray(std.state[pos], dtype=np.float32),
            "actions": np.ascontiguousarray(actions, dtype=np.float32),
            "action_is_pad": is_pad,
            "prompt": std.prompt[pos],
            "embodiment": std.embodiment,
            "dataset": std.dataset,
            "episode": ep,
            "frame": int(std.frames[pos]),
        }


def collate(samples: Sequence[dict[str, Any] | None], embodiment_ids: dict[str, int]) -> Batch | list[str]:
    """Pad a list of samples into one ``Batch`` (shapes in ``vla.types``); skipped samples are dropped and counted
    in ``meta["skipped"]`` (a batch of only bad samples collates to the list of their messages). Slots missing from a sample are zero images with ``image_mask`` False."""
    skipped = [s["__skipped__"] for s in samples if s is not None and "__skipped__" in s]
    good = [s for s in samples if s is not None and "__skipped__" not in s]
    if not good:
        return skipped  # the loader counts and logs these, and moves on to the next batch
    b = len(good)
    s_max = max(len(s["state"]) for s in good)
    h_max = max(s["actions"].shape[0] for s in good)
    a_max = max(s["actions"].shape[1] for s in good)
    state = torch.zeros(b, s_max)
    state_mask = torch.zeros(b, s_max, dtype=torch.bool)
    actions = torch.zeros(b, h_max, a_max)
    action_mask = torch.zeros(b, a_max, dtype=torch.bool)
    is_pad = torch.ones(b, h_max, dtype=torch.bool)
    slots = sorted({k for s in good for k in s["images"]})
    images: dict[str, torch.Tensor] = {}
    image_mask: dict[str, torch.Tensor] = {}
    for slot in slots:
        shapes = {tuple(s["images"][slot].shape) for s in good if slot in s["images"]}
        if len(shapes) > 1:
            raise ValueError(
                f"camera slot {slot!r} has different image shapes in one batch {sorted(shapes)}; set data.image_size "
                "to resize every camera to one size"
            )
        shape = shapes.pop()
        images[slot] = torch.zeros(b, *shape, dtype=torch.uint8)
        image_mask[slot] = torch.zeros(b, dtype=torch.bool)
    for i, s in enumerate(good):
        sd, (h, a) = len(s["state"]), s["actions"].shape
        state[i, :sd] = torch.from_numpy(s["state"])
        state_mask[i, :sd] = True
        actions[i, :h, :a] = torch.from_numpy(s["actions"])
        action_mask[i, :a] = True
        is_pad[i, :h] = torch.from_numpy(np.asarray(s["action_is_pad"]))
        for slot, img in s["images"].items():
            images[slot][i] = img
            image_mask[slot][i] = True
    unknown = sorted({s["embodiment"] for s in good} - set(embodiment_ids))
    if unknown:
        raise KeyError(
            f"embodiment(s) {unknown} are not in the loader's embodiment table {sorted(embodiment_ids)}"
        )
    return Batch(
        images=images,
        image_mask=image_mask,
        state=state,
        state_mask=state_mask,
        actions=actions,
        action_mask=action_mask,
        action_is_pad=is_pad,
        prompt=[s["prompt"] for s in good],
        embodiment_id=torch.tensor([embodiment_ids[s["embodiment"]] for s in good], dtype=torch.int64),
        meta={
            "embodiment": [s["embodiment"] for s in good],
            "dataset": [s["dataset"] for s in good],
            "episode": [s["episode"] for s in good],
            "frame": [s["frame"] for s in good],
            "skipped": skipped,
        },
    )


class _Collate:
    """Picklable collate function bound to an embodiment table (DataLoader workers need to pickle it)."""

    def __init__(self, embodiment_ids: dict[str, int]) -> None:
        self.embodiment_ids = embodiment_ids

    def __call__(self, samples: Sequence[dict[str, Any] | None]) -> Batch | list[str]:
        return collate(samples, self.embodiment_ids)


class SampleOrder:
    """Per-epoch sample order, batched and resumable.

    Without a ``stream``: a permutation seeded by (seed, epoch), sliced by rank so ranks see disjoint samples.
    With a ``stream`` (a ``MixtureSampler`` already sharded by rank): each epoch draws ``epoch_samples`` flat
    indices from it; the stream's state at the start of the epoch is kept so the epoch can be regenerated on resume.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        stream: MixtureSampler | None = None,
        offsets: np.ndarray | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.seed, self.rank, self.world_size, self.drop_last = (
            shuffle,
            seed,
            rank,
            world_size,
            drop_last,
        )
        self.stream, self.offsets = stream, offsets
        self.epoch = 0
        self.start_batch = 0  # batches of this epoch already consumed (set on resume)
        self.epoch_start_state: dict[str, Any] | None = stream.state_dict() if stream is not None else None
        self._drawn: tuple[int, np.ndarray] | None = None

    @property
    def per_rank(self) -> int:
        return self.num_samples // self.world_size  # equal shares so every rank runs the same number of steps

    def _indices(self, epoch: int) -> np.ndarray:
        if self.stream is not None:
            if self._drawn is None or self._drawn[0] != epoch:
                self.epoch_start_state = self.stream.state_dict()
                pairs = self.stream.take(self.per_rank)  # [n, 2] (dataset, sample within dataset)
                self._drawn = (epoch, self.offsets[pairs[:, 0]] + pairs[:, 1])
            return self._drawn[1]
        order = (
            np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            if self.shuffle
            else np.arange(self.num_samples)
        )
        return order[self.rank :: self.world_size][: self.per_rank]

    def __len__(self) -> int:
        return self.per_rank // self.batch_size if self.drop_last else -(-self.per_rank // self.batch_size)

    def batches(self, epoch: int) -> list[list[int]]:
        mine = self._indices(epoch)
        return [mine[i * self.batch_size : (i + 1) * self.batch_size].tolist() for i in range(len(self))]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches(self.epoch)[self.start_batch :]

    def stream_state_at(self, epoch: int) -> dict[str, Any] | None:
        """The stream's state at the start of ``epoch`` (drawn already, or about to be drawn)."""
        if self.stream is None:
            return None
        if self._drawn is not None and self._drawn[0] == epoch:
            return self.epoch_start_state
        return self.stream.state_dict()

    def restore_stream(self, epoch: int, state: dict[str, Any]) -> None:
        """Rewind the stream to the start of ``epoch`` (its saved state) so that epoch is drawn again exactly."""
        assert self.stream is not None
        self.stream.load_state_dict(state)
        self._drawn = None
        self.epoch_start_state = state


class VLALoader:
    """Iterable of ``Batch`` over epochs with exact resume (``state_dict``/``load_state_dict``)."""

    def __init__(
        self,
        dataset: WindowDataset,
        cfg: DataConfig,
        embodiment_ids: dict[str, int],
        *,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        stream: MixtureSampler | None = None,
    ) -> None:
        self.dataset, self.cfg = dataset, cfg
        self.embodiment_ids = dict(embodiment_ids)
        self.order = SampleOrder(
            len(dataset),
            cfg.batch_size,
            shuffle=cfg.shuffle,
            seed=cfg.seed,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            stream=stream,
            offsets=dataset._src_offsets[:-1].astype(np.int64),
        )
        if len(self.order) == 0:
            raise ValueError(
                f"{len(dataset)} samples give no full batch of {cfg.batch_size} on {world_size} rank(s); lower data.batch_size"
            )
        self.epoch = 0
        self.batches_done = 0  # consumed in the current epoch
        self.num_skipped = 0

    def __len__(self) -> int:
        return len(self.order)

    def _loader(self) -> DataLoader:
        self.dataset.epoch = self.epoch
        self.order.epoch, self.order.start_batch = self.epoch, self.batches_done
        return DataLoader(
            self.dataset,
            batch_sampler=self.order,
            num_workers=self.cfg.num_workers,
            collate_fn=_Collate(self.embodiment_ids),
            persistent_workers=False,
            prefetch_factor=4 if self.cfg.num_workers else None,
        )

    def __iter__(self) -> Iterator[Batch]:
        """One epoch (the rest of it after a resume); the next ``iter`` starts the next epoch."""
        for batch in self._loader():
            self.batches_done += 1
            skipped = batch if isinstance(batch, list) else batch.meta.get("skipped", [])
            for msg in skipped:
                self.num_skipped += 1
                log.warning("skipped bad sample (%d so far): %s", self.num_skipped, msg)
            if isinstance(batch, Batch):
                yield batch
        self.epoch += 1
        self.batches_done = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "seed": self.cfg.seed,
            "num_samples": len(self.dataset),
            "world_size": self.order.world_size,
            "rank": self.order.rank,
            "num_skipped": self.num_skipped,
            "stream_epoch_start": self.order.stream_state_at(self.epoch),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (
            ("seed", self.cfg.seed),
            ("num_samples", len(self.dataset)),
            ("world_size", self.order.world_size),
            ("rank", self.order.rank),
        ):
            if state.get(key) != mine:
                raise ValueError(
                    f"loader state was saved with {key}={state.get(key)} but this loader has {key}={mine}; "
                    "resuming would not reproduce the same batches"
                )
        self.epoch, self.batches_done = int(state["epoch"]), int(state["batches_done"])
        self.num_skipped = int(state.get("num_skipped", 0))
        if self.order.stream is not None:
            if state.get("stream_epoch_start") is None:
                raise ValueError(
                    "loader state has no mixture stream state; it was saved by a loader without a mixture"
                )
            self.order.restore_stream(self.epoch, state["stream_epoch_start"])


def _load_stats(cfg: DataConfig, sources: Sequence[Source]) -> tuple[StatsFile, bool]:
    """The stats file(s) for ``sources``: ``data.stats_path`` if set, else each dataset's own (``vla data stats``).

    Returns (stats, per_dataset): with per-dataset files merged, ``embodiment@dataset`` keys are used.
    """
    from vla.data.normalize import StatsFile
    from vla.data.stats import default_stats_paths, find_stats

    if cfg.stats_path:
        return StatsFile.load(cfg.stats_path), False
    merged: dict[str, Any] = {}
    for src in sources:
        found = find_stats(src.reader.path)
        if found is None:
            looked = ", ".join(str(p) for p in default_stats_paths(src.reader.path))
            raise FileNotFoundError(
                f"No normalization stats for dataset {src.name!r} (looked at {looked}). "
                f"Run 'vla data stats {src.reader.path}' (or set data.stats_path, or data.normalize=false)."
            )
        merged.update(StatsFile.load(found).stats)
    return StatsFile(stats=merged), len(sources) > 1


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        default_rank, default_world = dist.get_rank(), dist.get_world_size()
    else:
        default_rank, default_world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return (default_rank if rank is None else rank), (default_world if world_size is None else world_size)


def build_loader(
    cfg: DataConfig,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    embodiment_ids: dict[str, int] | None = None,
    train: bool = True,
) -> VLALoader:
    """The loader a ``DataConfig`` describes: datasets or a resolved mixture, normalized with their stats.

    ``rank``/``world_size`` default to the initialized ``torch.distributed`` group (else ``RANK``/``WORLD_SIZE``
    from torchrun's environment, else 0/1). ``embodiment_ids`` is the model's embodiment table (name -> index);
    by default the sorted embodiments found.
    """
    rank, world_size = _rank_world(rank, world_size)
    from vla.data.normalize import make_normalize_fn
    from vla.embodiments import get_embodiment

    stream = None
    opts = standardize_options(cfg)
    if cfg.mixture:
        from vla.data.mixture import resolve_mixture

        resolved = resolve_mixture(cfg.mixture, cfg.data_root, allow_missing=cfg.allow_missing)
        if resolved.message:
            log.warning("%s", resolved.message)
        sources = [
            build_source(open_dataset(d.path), d.split or cfg.split, options=opts) for d in resolved.datasets
        ]
        stream = resolved.sampler(
            [s.num_samples for s in sources],
            balance_by_size=cfg.balance_by_size,
            seed=cfg.seed,
            rank=rank,
            world_size=world_size,
        )
    else:
        sources = [build_source(open_dataset(p), cfg.split, options=opts) for p in cfg.datasets]
    for src in sources:
        if src.num_samples == 0:
            raise ValueError(
                f"{src.reader.path}: split {src.split!r} has no usable frames after standardization"
            )
    embodiments = sorted({src.keymap.embodiment for src in sources})
    specs = {e: get_embodiment(e) for e in embodiments}
    normalize = None
    if cfg.normalize:
        stats, per_dataset = _load_stats(cfg, sources)
        normalize = make_normalize_fn(stats, specs, per_dataset=per_dataset)
    ids = embodiment_ids or {e: i for i, e in enumerate(embodiments)}
    dataset = WindowDataset(
        sources,
        cfg,
        normalize=normalize,
        train=train,
        chunk_lengths={e: s.chunk_length for e, s in specs.items()},
    )
    return VLALoader(dataset, cfg, ids, rank=rank, world_size=world_size, stream=stream)
