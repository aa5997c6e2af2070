"""Training loader: resumable, rank-sharded iteration over windows (``vla.data.windows``) collated into
``Batch`` es (``vla.data.collate``); ``build_loader`` turns a ``DataConfig`` into one.

Order and resume: ``SampleOrder`` yields sample indices from a permutation seeded by (seed, epoch) — or from a
name-seeded mixture stream — sliced by rank, so ranks see disjoint samples; ``VLALoader.state_dict()`` records how
many batches the *consumer* has taken (not how many workers prefetched), so a restored loader yields exactly the
batches the original would have.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import signal
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from vla.config import DataConfig
from vla.data.collate import _Collate, collate
from vla.data.mixture_sampler import MixtureSampler
from vla.data.readers import DatasetFormatError, open_dataset
from vla.data.windows import NormalizeFn, Source, WindowDataset, build_source, standardize_options
from vla.types import Batch

if TYPE_CHECKING:
    from vla.data.normalize import StatsFile

__all__ = [
    "NormalizeFn",
    "SampleOrder",
    "SkippedSamplesError",
    "Source",
    "VLALoader",
    "WindowDataset",
    "build_loader",
    "build_source",
    "collate",
    "standardize_options",
]

log = logging.getLogger(__name__)


class SkippedSamplesError(DatasetFormatError):
    """With ``data.on_bad_sample=skip``, more samples of an epoch were bad than ``data.max_skipped_fraction``
    allows; the message names the first causes."""


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
        # int32 where it fits: shuffling an int32 arange draws the same permutation as ``permutation(n)`` (same
        # Fisher-Yates draws) at half the memory; at 1e8 samples every rank shuffles all of them each epoch
        order = np.arange(self.num_samples, dtype=np.int32 if self.num_samples < 2**31 else np.int64)
        if self.shuffle:
            np.random.default_rng([self.seed, epoch]).shuffle(order)
        return order[self.rank :: self.world_size][: self.per_rank].copy()  # frees the other ranks' share

    def __len__(self) -> int:
        return self.per_rank // self.batch_size if self.drop_last else -(-self.per_rank // self.batch_size)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        """The rest of the current epoch's batches, each sample as ``(epoch, index)``: the epoch travels with the
        index to the dataset (it seeds the sample's augmentation), since persistent workers hold a copy of the
        dataset made before this epoch began. Batches are made as they are asked for: an epoch's indices stay one
        numpy array, not millions of Python ints (~40 B each) held for the whole epoch."""
        epoch, size = self.epoch, self.batch_size
        mine = self._indices(epoch)
        for i in range(self.start_batch, len(self)):
            yield [(epoch, j) for j in mine[i * size : (i + 1) * size].tolist()]

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
    """Iterable of ``Batch`` over epochs with exact resume (``state_dict``/``load_state_dict``).

    What it normalizes with, for the checkpoint: ``stats`` is the ``StatsFile`` used (None when
    ``data.normalize=false``) and ``stats_keys`` maps each dataset name to the key of ``stats`` its state and
    action are normalized with (``{"bridge": {"state": "widowx_bridge@bridge", "action": ...}}``; empty
    without normalization).
    """

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
        stats: StatsFile | None = None,
        stats_keys: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.dataset, self.cfg = dataset, cfg
        # batches in page-locked memory (set by a CUDA trainer): host-to-device copies run async, at full speed
        self.pin_memory = False
        # keep the worker processes from one epoch to the next (with data.num_workers > 0): fresh workers at every
        # epoch start cost a stall (their start-up competes with the step for the cores) and re-decode every
        # episode their cache held; ``close`` ends them. A loader read once (validation) sets it False.
        self.persistent_workers = True
        self._kept: tuple[tuple[Any, ...], DataLoader] | None = None
        self.stats, self.stats_keys = stats, dict(stats_keys or {})
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
            offsets=dataset.source_offsets,
        )
        if len(self.order) == 0:
            raise ValueError(
                f"{len(dataset)} samples give no full batch of {cfg.batch_size} on {world_size} rank(s); lower data.batch_size"
            )
        self.epoch = 0
        self.batches_done = 0  # consumed in the current epoch
        self.num_skipped = 0
        self.epoch_skipped: list[str] = []  # why each sample of the current epoch was skipped

    def __len__(self) -> int:
        return len(self.order)

    def use_stats(self, stats: StatsFile, stats_keys: dict[str, dict[str, str]]) -> list[str]:
        """Normalize with ``stats`` instead of the stats the loader was built with, each dataset under the keys
        ``stats_keys`` names for it (``{dataset: {"state": key, "action": key}}``; a dataset it does not name
        keeps the key it was built with). For a resumed run: its checkpoint's stats and keys, so it goes on with the
        normalization it started with even if the datasets' stats files changed since. Returns the ``key/field``
        entries whose stats in the data now differ from those (empty when they agree or ``data.normalize`` is
        off, which leaves the loader as it is)."""
        from vla.data.normalize import FIELDS, StatsFile, make_normalize_fn
        from vla.embodiments import get_embodiment

        if self.dataset.normalize is None or self.stats is None:
            return []
        sources = self.dataset.sources
        keys = {
            s.name: {f: (stats_keys.get(s.name) or {}).get(f) or self.stats_keys[s.name][f] for f in FIELDS}
            for s in sources
        }
        own = {s.name for s in sources if StatsFile.key(s.keymap.embodiment, s.name) in keys[s.name].values()}
        changed = []
        for src in sources:
            emb = src.keymap.embodiment
            for f, key in keys[src.name].items():
                # the key make_normalize_fn will read must be the one named
                read = stats.resolve_key(emb, f, src.name if src.name in own else None)
                if read != key or f not in stats.stats.get(key, {}):
                    raise ValueError(
                        f"dataset {src.name!r} ({emb}) is to be normalized with '{key}/{f}', which the given stats "
                        f"do not hold as such (they have {sorted(stats.stats)})"
                    )
                now = self.stats_keys[src.name][f]
                if now != key or not _same_stats({f: self.stats.stats[now][f]}, {f: stats.stats[key][f]}):
                    changed.append(f"{key}/{f}")
        specs = {e: get_embodiment(e) for e in {s.keymap.embodiment for s in sources}}
        self.dataset.normalize = make_normalize_fn(stats, specs, per_dataset=own)
        # episodes cached so far were normalized with the stats replaced
        self.dataset._cache.clear()
        self.close()  # workers hold copies of the dataset made with the old normalization
        self.stats, self.stats_keys = stats, keys
        return sorted(set(changed))

    def _generator(self) -> torch.Generator:
        """The DataLoader's own RNG, seeded by (data seed, rank, epoch): a DataLoader draws its workers' base seed
        from it when it starts them, not from the global torch RNG, so iterating never moves the training process's
        RNG (a resumed run, which starts its workers mid-epoch, keeps the exact RNG stream of the run it continues).
        Samples do not depend on it (each is seeded by (seed, epoch, index)); persistent workers keep the base seed
        of the epoch they started in, and batch k of a resumed iterator goes to worker k mod W, so what a worker
        draws from its own global RNG (none of vla's transforms do) is not reproduced across a resume."""
        entropy = [self.cfg.seed, self.order.rank, self.epoch]
        seed = np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]
        return torch.Generator().manual_seed(int(seed))

    def _loader(self) -> DataLoader:
        """The DataLoader for the current epoch: the kept one while its workers' copies (embodiment table,
        pinning) still hold, else a new one (kept when ``persistent_workers``). Its sampler reads the epoch and
        position when each epoch's iteration starts."""
        self.dataset.epoch = self.epoch
        self.order.epoch, self.order.start_batch = self.epoch, self.batches_done
        keep = self.persistent_workers and self.cfg.num_workers > 0
        held = (self.pin_memory, tuple(sorted(self.embodiment_ids.items())))
        if keep and self._kept is not None and self._kept[0] == held:
            return self._kept[1]
        self.close()
        loader = DataLoader(
            self.dataset,
            batch_sampler=self.order,
            num_workers=self.cfg.num_workers,
            # a copy: workers pickle the table when they start, so a later change must start new ones
            collate_fn=_Collate(dict(self.embodiment_ids)),
            pin_memory=self.pin_memory,
            persistent_workers=keep,
            prefetch_factor=4 if self.cfg.num_workers else None,
            generator=self._generator(),
            # a scheduler's SIGTERM reaches every process: the training process stops the run (vla.train.stop)
            worker_init_fn=_ignore_sigterm,
        )
        if keep:
            self._kept = (held, loader)
            _close_at_exit(self)
        return loader

    def close(self) -> None:
        """End the kept worker processes (if any); iterating again starts new ones. (A DataLoader has no public
        close: its iterator's ``_shutdown_workers`` is what the iterator's own ``__del__`` calls.)"""
        kept, self._kept = self._kept, None
        if kept is not None:
            it = getattr(kept[1], "_iterator", None)
            kept[1]._iterator = None
            if it is not None and hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()

    def __iter__(self) -> Iterator[Batch]:
        """One epoch (the rest of it after a resume); the next ``iter`` starts the next epoch."""
        self.epoch_skipped = []
        yielded = 0
        for batch in self._loader():
            self.batches_done += 1
            skipped = batch if isinstance(batch, list) else batch.meta.get("skipped", [])
            for msg in skipped:
                self.num_skipped += 1
                self.epoch_skipped.append(msg)
                log.warning("skipped bad sample (%d so far): %s", self.num_skipped, msg)
            self._check_skipped(final=False)
            if isinstance(batch, Batch):
                yielded += 1
                yield batch
        self._check_skipped(final=not yielded)
        self.epoch += 1
        self.batches_done = 0

    def _check_skipped(self, final: bool) -> None:
        """Fail once this epoch's skipped samples pass ``data.max_skipped_fraction`` of its samples (or when
        ``final``: the epoch yielded no batch at all), naming the first causes: ``on_bad_sample=skip`` is for
        a few damaged samples, not for a dataset that cannot be read."""
        epoch_samples = len(self.order) * self.order.batch_size
        limit = self.cfg.max_skipped_fraction * epoch_samples
        if not self.epoch_skipped or (len(self.epoch_skipped) <= limit and not final):
            return
        causes = "; ".join(self.epoch_skipped[:3])
        raise SkippedSamplesError(
            f"{len(self.epoch_skipped)} of this epoch's {epoch_samples} samples were skipped as bad "
            f"(data.max_skipped_fraction={self.cfg.max_skipped_fraction:g} allows {int(limit)}"
            f"{'; no batch was left' if final else ''}). First causes: {causes}. Repair the data, or raise "
            "data.max_skipped_fraction if losing these samples is acceptable"
        )

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
            "batch_size": self.cfg.batch_size,
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
        done, saved_batch = int(state["batches_done"]), int(state.get("batch_size", self.cfg.batch_size))
        if saved_batch != self.cfg.batch_size:
            # the same samples in another batch size (a resumed run that trades data.batch_size for
            # train.grad_accum): this rank's samples of an epoch are one contiguous run, so the position converts
            # exactly where it falls on a batch boundary
            if done * saved_batch % self.cfg.batch_size:
                raise LoaderPositionError(
                    f"loader state is {done} batches of {saved_batch} into epoch {state['epoch']}: "
                    f"{done * saved_batch} samples is not a whole number of batches of {self.cfg.batch_size}"
                )
            done = done * saved_batch // self.cfg.batch_size
        self.epoch, self.batches_done = int(state["epoch"]), done
        self.num_skipped = int(state.get("num_skipped", 0))
        if self.order.stream is not None:
            if state.get("stream_epoch_start") is None:
                raise ValueError(
                    "loader state has no mixture stream state; it was saved by a loader without a mixture"
                )
            self.order.restore_stream(self.epoch, state["stream_epoch_start"])


class LoaderPositionError(ValueError):
    """A saved loader position that this loader's batch size cannot continue from exactly."""


def _load_stats(cfg: DataConfig, sources: Sequence[Source]) -> tuple[StatsFile, bool]:
    """The stats the loader normalizes ``sources`` with, and whether it reads them per dataset.

    ``data.stats_path`` set: that file, per embodiment (``"<embodiment>"`` keys, e.g. a joint file from
    ``vla data stats A B``). Else each dataset's own file (``vla data stats <dataset>``): one dataset uses its
    file as is, per embodiment; several are merged by ``_merge_dataset_stats``, per dataset.
    """
    from vla.data.normalize import StatsFile
    from vla.data.stats import default_stats_paths, find_stats

    if cfg.stats_path:
        return StatsFile.load(cfg.stats_path), False
    files = []
    for src in sources:
        found = find_stats(src.reader.path)
        if found is None:
            looked = ", ".join(str(p) for p in default_stats_paths(src.reader.path))
            raise FileNotFoundError(
                f"No normalization stats for dataset {src.name!r} (looked at {looked}). "
                f"Run 'vla data stats {src.reader.path}' (or set data.stats_path, or data.normalize=false)."
            )
        files.append(found)
    if len(sources) == 1:
        return StatsFile.load(files[0]), False
    return _merge_dataset_stats(sources, files), True


def _merge_dataset_stats(sources: Sequence[Source], files: Sequence[Path]) -> StatsFile:
    """One ``StatsFile`` from each dataset's own stats file, exact per dataset.

    Each dataset ``D`` of embodiment ``E`` gets ``"E@D"``: its file's ``"E@D"`` entry, else its file's ``"E"``
    entry (the file describes that one dataset, e.g. after the dataset folder was renamed), and is normalized
    with it. The embodiment-wide ``"E"`` key is kept only when every dataset of ``E`` got identical stats.

    Otherwise ``"E"`` is dropped, with a warning, rather than raising: per-dataset stats are exact for each
    dataset and are what per-dataset normalization is for, whereas an ``"E"`` taken from one file would
    misnormalize the other datasets, and a joint one cannot be merged exactly from finished stats (quantiles
    do not combine). What needs one normalization per embodiment (serving an ``E`` checkpoint, which knows no
    dataset name) takes joint stats: ``vla data stats A B --out joint.json`` and
    ``data.stats_path=joint.json``. Two datasets with the same name but different stats are an error: the
    normalizer tells datasets apart by name only.
    """
    from vla.data.normalize import FIELDS, StatsFile

    loaded = {p: StatsFile.load(p) for p in dict.fromkeys(files)}
    paths = " ".join(str(s.reader.path) for s in sources)
    fix = f"'vla data stats {paths} --out joint.json' then data.stats_path=joint.json"
    merged = StatsFile()
    owner: dict[str, Path] = {}  # "E@D" -> the file it came from
    by_embodiment: dict[str, list[tuple[str, Path]]] = {}
    for src, path in zip(sources, files):
        stats, emb = loaded[path].stats, src.keymap.embodiment
        key = StatsFile.key(emb, src.name)
        entry = {f: (stats.get(key) or {}).get(f) or (stats.get(emb) or {}).get(f) for f in FIELDS}
        if missing := [f for f, v in entry.items() if v is None]:
            raise ValueError(
                f"{path}: no {missing} stats for dataset {src.name!r} (neither '{key}' nor '{emb}'; it has "
                f"{sorted(stats)}). Run 'vla data stats {src.reader.path}'."
            )
        if key in merged.stats and not _same_stats(merged.stats[key], entry):
            raise ValueError(
                f"datasets {src.name!r} from {owner[key]} and {path} share the name {src.name!r} but have "
                f"different stats, so the loader cannot normalize each with its own. Use joint stats: {fix}."
            )
        merged.stats[key], owner[key] = entry, path
        by_embodiment.setdefault(emb, []).append((key, path))
    for emb, used in by_embodiment.items():
        first = merged.stats[used[0][0]]
        if all(_same_stats(merged.stats[k], first) for k, _ in used):
            merged.stats[emb] = first
        else:
            log.warning(
                "datasets of embodiment %r have different stats (%s): each is normalized with its own "
                "'%s@<dataset>' stats and there is no embodiment-wide '%s' entry. For one normalization per "
                "embodiment use joint stats: %s.",
                emb,
                ", ".join(str(p) for _, p in used),
                emb,
                emb,
                fix,
            )
    merged.sources = [s for sf in loaded.values() for s in sf.sources]
    return merged


def _same_stats(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ``{field: NormStats}`` entries are identical (NaN equal to NaN)."""
    return a.keys() == b.keys() and all(
        json.dumps(a[f].to_dict(), sort_keys=True) == json.dumps(b[f].to_dict(), sort_keys=True) for f in a
    )


def _stats_keys(stats: StatsFile, sources: Sequence[Source], per_dataset: bool) -> dict[str, dict[str, str]]:
    """Dataset name -> ``{"state": key, "action": key}``: the stats key each dataset is normalized with."""
    return {
        src.name: {
            f: stats.resolve_key(src.keymap.embodiment, f, src.name if per_dataset else None)
            for f in ("state", "action")
        }
        for src in sources
    }


def _split_source(
    path: str | Path,
    split: str,
    opts: Any,
    val_episodes: int,
    held_out: bool,
    allow_incomplete: bool,
    on_bad_sample: str = "raise",
) -> Source:
    """``build_source`` of one dataset split, without its last ``val_episodes`` episodes (``held_out``: only
    them). Episodes are dropped by zeroing their kept-frame counts, so sample indices never reach them. A dataset
    whose writing command was interrupted is refused unless ``allow_incomplete``."""
    reader = open_dataset(path)
    if reader.incomplete and not allow_incomplete:
        raise ValueError(
            f"{reader.path} is incomplete: `{reader.incomplete}` was interrupted, so it holds only the episodes "
            "written so far. Re-run that command to finish it, or set data.allow_incomplete=true to train on them"
        )
    src = build_source(reader, split, options=opts, on_bad_sample=on_bad_sample)
    if not val_episodes and not held_out:
        return src
    n = len(src.lengths)
    if val_episodes >= n:
        raise ValueError(
            f"{src.reader.path}: data.val_episodes={val_episodes} would hold out every episode of split "
            f"{split!r} ({n}); lower it (at most {n - 1})"
        )
    keep = np.arange(n) >= n - val_episodes if held_out else np.arange(n) < n - val_episodes
    return dataclasses.replace(src, lengths=np.where(keep, src.lengths, 0))


def _check_unreadable(sources: Sequence[Source], max_fraction: float) -> None:
    """With ``data.on_bad_sample=skip``: fail when the episodes that cannot be read pass ``max_fraction`` of all
    the sources' episodes, naming the first (the same bound as skipped samples: skipping is for a few damaged
    episodes, not for data that cannot be read)."""
    bad = [
        f"{s.reader.path} split {s.split!r} episode {e}: {why}"
        for s in sources
        for e, why in s.unreadable.items()
    ]
    total = sum(len(s.lengths) for s in sources)
    if bad and len(bad) > max_fraction * total:
        raise SkippedSamplesError(
            f"{len(bad)} of {total} episodes cannot be read (data.max_skipped_fraction={max_fraction:g} allows "
            f"{int(max_fraction * total)}). First causes: {'; '.join(bad[:3])}. Repair the data, or raise "
            "data.max_skipped_fraction if losing these episodes is acceptable"
        )


def _rehearsal_loader(
    cfg: DataConfig,
    rehearsal: Any,
    base: tuple[StatsFile | None, dict[str, dict[str, str]]],
    rank: int | None,
    world_size: int | None,
    embodiment_ids: dict[str, int] | None,
    train: bool,
    held_out: bool,
) -> VLALoader:
    """``build_loader`` with a rehearsal mixture (see there)."""
    from vla.data.mixture import ResolvedDataset, resolve_mixture, with_rehearsal
    from vla.data.normalize import StatsFile, make_normalize_fn
    from vla.embodiments import get_embodiment

    if cfg.mixture or not cfg.datasets:
        raise ValueError(
            "finetune.rehearsal.mixture replays a mixture next to the fine-tuning data: set data.datasets (the "
            "new robot's data), not data.mixture"
        )
    rank, world_size = _rank_world(rank, world_size)
    opts = standardize_options(cfg)
    new = [
        _split_source(p, cfg.split, opts, cfg.val_episodes, held_out, cfg.allow_incomplete, cfg.on_bad_sample)
        for p in cfg.datasets
    ]
    old_mix = resolve_mixture(rehearsal.mixture, rehearsal.data_root or cfg.data_root)
    old = [
        _split_source(d.path, d.split or cfg.split, opts, cfg.val_episodes, held_out, cfg.allow_incomplete,
                      cfg.on_bad_sample)
        for d in old_mix.datasets
    ]  # fmt: skip
    sources = [*new, *old]
    _check_unreadable(sources, cfg.max_skipped_fraction)
    for src in sources:
        # every episode skipped: say why, not only that no frame is left
        if src.num_samples == 0 and src.unreadable:
            raise SkippedSamplesError(
                f"{src.reader.path}: split {src.split!r} has no usable frames: {len(src.unreadable)} of its "
                f"{len(src.lengths)} episodes cannot be read (first: {next(iter(src.unreadable.values()))}) and "
                "the others have none after standardization. Repair the data"
            )
        if src.num_samples == 0:
            raise ValueError(
                f"{src.reader.path}: split {src.split!r} has no usable frames after standardization"
            )
    resolved = with_rehearsal(
        [ResolvedDataset(s.name, s.reader.path, "", 1.0) for s in new], old_mix, float(rehearsal.fraction)
    )
    stream = resolved.sampler(
        [s.num_samples for s in sources],
        balance_by_size=cfg.balance_by_size,
        seed=cfg.seed,
        rank=rank,
        world_size=world_size,
    )
    embodiments = sorted({src.keymap.embodiment for src in sources})
    specs = {e: get_embodiment(e) for e in embodiments}
    normalize, stats, stats_keys = None, None, {}
    if cfg.normalize:
        stats, own_keys = _rehearsal_stats(cfg, new, old, base, rehearsal.mixture)
        normalize = make_normalize_fn(stats, specs, per_dataset=own_keys)
        stats_keys = {s.name: {f: stats.resolve_key(s.keymap.embodiment, f, s.name if s.name in own_keys else None)
                               for f in ("state", "action")} for s in sources}  # fmt: skip
    assert stats is None or isinstance(stats, StatsFile)
    dataset = WindowDataset(
        sources,
        cfg,
        normalize=normalize,
        train=train,
        chunk_lengths={e: s.chunk_length for e, s in specs.items()},
    )
    ids = embodiment_ids or {e: i for i, e in enumerate(embodiments)}
    return VLALoader(
        dataset, cfg, ids, rank=rank, world_size=world_size, stream=stream, stats=stats, stats_keys=stats_keys
    )


def _rehearsal_stats(
    cfg: DataConfig,
    new: Sequence[Source],
    old: Sequence[Source],
    base: tuple[StatsFile | None, dict[str, dict[str, str]]],
    mixture: str,
) -> tuple[StatsFile, set[str]]:
    """The fine-tuning datasets' own stats on top of the base checkpoint's, and the names of the datasets read
    with their own ``"E@D"`` key: a rehearsal dataset exactly as pretraining read it (the base's ``stats_keys``;
    when the base does not say, its ``"E@D"`` where the file has one), a fine-tuning dataset as ``_load_stats``
    would read it alone."""
    from vla.data.normalize import StatsFile

    base_stats, base_keys = base
    if base_stats is None:
        raise ValueError(
            f"finetune.rehearsal.mixture={mixture!r}: the base checkpoint has no norm_stats.json, so its "
            "embodiments cannot be normalized as in pretraining; fine-tune from a `vla train` checkpoint"
        )
    own_keys: set[str] = set()
    for src in old:
        emb, own = src.keymap.embodiment, StatsFile.key(src.keymap.embodiment, src.name)
        used = (base_keys.get(src.name) or {}).get("action")
        key = used if used in (emb, own) else (own if own in base_stats.stats else emb)
        for f in ("state", "action"):
            if f not in base_stats.stats.get(key, {}):
                raise ValueError(
                    f"rehearsal dataset {src.name!r} ({src.reader.path}) is embodiment {emb!r}, but the base "
                    f"checkpoint's stats have no '{key}/{f}' (they cover {sorted(base_stats.stats)}); rehearse "
                    "with the pretraining mixture of that checkpoint"
                )
        if key == own:
            own_keys.add(src.name)
    stats, per_dataset = _load_stats(cfg, new)
    if per_dataset:
        own_keys.update(s.name for s in new)
    merged = StatsFile(stats=dict(base_stats.stats), sources=[*base_stats.sources])
    merged.stats.update({k: dict(v) for k, v in stats.stats.items()})
    merged.sources += [s for s in stats.sources if s not in merged.sources]
    return merged, own_keys


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
    rehearsal: Any = None,
    base_stats: StatsFile | None = None,
    base_stats_keys: dict[str, dict[str, str]] | None = None,
    held_out: bool = False,
) -> VLALoader:
    """The loader a ``DataConfig`` describes: datasets or a resolved mixture, normalized with their stats.

    ``rank``/``world_size`` default to the initialized ``torch.distributed`` group (else ``RANK``/``WORLD_SIZE``
    from torchrun's environment, else 0/1). ``embodiment_ids`` is the model's embodiment table (name -> index);
    by default the sorted embodiments found.

    ``rehearsal`` (fine-tuning; an object with ``mixture``, ``fraction`` and ``data_root``, e.g. the train
    config's ``finetune.rehearsal``) replays that mixture's datasets at ``fraction`` of the samples next to
    ``data.datasets``; they are normalized with ``base_stats`` (the base checkpoint's stats) under the keys
    ``base_stats_keys`` (its ``preprocessing.json`` ``stats_keys``) says pretraining used, while the fine-tuning
    datasets use their own.

    ``data.val_episodes=N`` holds the last N episodes of each dataset's split out of this loader; ``held_out``
    builds the loader of only those episodes instead (the validation set).
    """
    if rehearsal is not None and getattr(rehearsal, "mixture", None):
        base = (base_stats, base_stats_keys or {})
        return _rehearsal_loader(cfg, rehearsal, base, rank, world_size, embodiment_ids, train, held_out)
    rank, world_size = _rank_world(rank, world_size)
    from vla.data.normalize import make_normalize_fn
    from vla.embodiments import get_embodiment

    stream = None
    opts = standardize_options(cfg)
    if cfg.mixture:
        from vla.data.mixture import resolve_mixture

        resolved = resolve_mixture(
            cfg.mixture, cfg.data_root, allow_missing=cfg.allow_missing, sim_fraction=cfg.sim_fraction
        )
        if resolved.message:
            log.warning("%s", resolved.message)
        sources = [
            _split_source(
                d.path,
                d.split or cfg.split,
                opts,
                cfg.val_episodes,
                held_out,
                cfg.allow_incomplete,
                cfg.on_bad_sample,
            )
            for d in resolved.datasets
        ]
        stream = resolved.sampler(
            [s.num_samples for s in sources],
            balance_by_size=cfg.balance_by_size,
            seed=cfg.seed,
            rank=rank,
            world_size=world_size,
        )
    else:
        sources = [
            _split_source(
                p, cfg.split, opts, cfg.val_episodes, held_out, cfg.allow_incomplete, cfg.on_bad_sample
            )
            for p in cfg.datasets
        ]
    _check_unreadable(sources, cfg.max_skipped_fraction)
    for src in sources:
        # every episode skipped: say why, not only that no frame is left
        if src.num_samples == 0 and src.unreadable:
            raise SkippedSamplesError(
                f"{src.reader.path}: split {src.split!r} has no usable frames: {len(src.unreadable)} of its "
                f"{len(src.lengths)} episodes cannot be read (first: {next(iter(src.unreadable.values()))}) and "
                "the others have none after standardization. Repair the data"
            )
        if src.num_samples == 0:
            raise ValueError(
                f"{src.reader.path}: split {src.split!r} has no usable frames after standardization"
            )
    embodiments = sorted({src.keymap.embodiment for src in sources})
    specs = {e: get_embodiment(e) for e in embodiments}
    normalize, stats, stats_keys = None, None, {}
    if cfg.normalize:
        stats, per_dataset = _load_stats(cfg, sources)
        normalize = make_normalize_fn(stats, specs, per_dataset=per_dataset)
        stats_keys = _stats_keys(stats, sources, per_dataset)
    ids = embodiment_ids or {e: i for i, e in enumerate(embodiments)}
    dataset = WindowDataset(
        sources,
        cfg,
        normalize=normalize,
        train=train,
        chunk_lengths={e: s.chunk_length for e, s in specs.items()},
    )
    return VLALoader(
        dataset,
        cfg,
        ids,
        rank=rank,
        world_size=world_size,
        stream=stream,
        stats=stats,
        stats_keys=stats_keys,
    )


_KEEPING: weakref.WeakSet[VLALoader] = weakref.WeakSet()


def _close_at_exit(loader: VLALoader) -> None:
    """Have ``loader``'s kept workers ended when the interpreter exits. Without it a process that still holds a
    loader after an epoch hangs at exit: multiprocessing's exit hook SIGTERMs its daemon children (ours ignore
    SIGTERM, ``_ignore_sigterm``) and joins them without a timeout, while the idle workers wait for work from
    the parent that waits for them; torch's own exit hook has by then turned ``_shutdown_workers`` into a no-op.
    Registered at the first kept loader, after torch's and multiprocessing's hooks, so it runs before them."""
    if not _KEEPING:
        atexit.unregister(_close_kept)
        atexit.register(_close_kept)
    _KEEPING.add(loader)


def _close_kept() -> None:
    for loader in list(_KEEPING):
        try:
            loader.close()
        except Exception:  # exiting: a worker that cannot be joined cleanly must not hide the others
            log.debug("closing a loader's workers at exit failed", exc_info=True)


def _ignore_sigterm(_worker_id: int) -> None:
    """``worker_init_fn`` of the loader's workers: a scheduler's SIGTERM reaches every process of a job, and a
    worker killed by it would fail the training process (the DataLoader's SIGCHLD check) before it could write its
    stop checkpoint (``vla.train.stop``); the workers end with the training process."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
