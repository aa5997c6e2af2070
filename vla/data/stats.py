"""Computing normalization stats of datasets in ONE streaming pass (``vla data stats``), and where they are kept.

``compute_stats`` runs ``standardize_episode`` over every episode of every split (optionally in ``workers``
forked processes, merged exactly) and accumulates each field in a ``RunningStats`` (``vla.data.running_stats``:
exact mean/std/min/max, histogram q01/q99 that merges exactly across shards). It returns a ``StatsFile`` with a
``"<embodiment>"`` key (all datasets given) and a ``"<embodiment>@<dataset>"`` key per dataset. ``write_stats``
saves it next to the dataset or in the cache; ``find_stats`` looks it up again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from vla.data.norm_stats import StatsFile
from vla.data.readers.base import DatasetReader
from vla.data.running_stats import DEFAULT_BINS, RunningStats
from vla.workers import ordered_map

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BINS",
    "RunningStats",
    "compute_stats",
    "default_stats_paths",
    "find_stats",
    "stats_cache_dir",
    "write_stats",
]


# ---- over datasets --------------------------------------------------------------------------------------------
#: ``episode_fn(reader, split, episode) -> StdEpisode`` (anything with .embodiment, .state [T,S], .action [T,A]).
EpisodeFn = Callable[[DatasetReader, str, int], Any]
_Accs = dict[tuple[str, str], dict[str, RunningStats]]  # (embodiment, dataset) -> field -> accumulator

_WORKER: dict[str, Any] = {}  # set before forking so workers inherit readers without pickling them


def _standardizer(readers: Sequence[DatasetReader]) -> EpisodeFn:
    """``standardize_episode`` with each reader's key map looked up once (an error names a reader without one)."""
    from vla.data.keymaps import KeyMapError
    from vla.data.standardize import keymap_for, no_keymap_reason, standardize_episode
    from vla.embodiments import EMBODIMENTS

    keymaps = {}
    for r in readers:
        keymaps[id(r)] = keymap_for(r)
        if keymaps[id(r)] is None:
            robot = getattr(r, "robot_type", None)
            hint = (
                f" Draft a spec for its robot with `vla embodiment draft {r.path} --name {robot} --out "
                f"{robot}.yaml` and pass --embodiment {robot}.yaml."
                if robot and robot not in EMBODIMENTS
                else ""
            )
            raise KeyMapError(
                f"{r.path}: dataset {r.name!r} has no key map, so its state/action cannot be standardized: "
                f"{no_keymap_reason(r)} Add one under vla/data/keymaps/.{hint}"
            )
    return lambda reader, split, episode: standardize_episode(reader, split, episode, keymaps[id(reader)])


def _accumulate(
    readers: Sequence[DatasetReader],
    tasks: Sequence[tuple[int, str, int]],
    episode_fn: EpisodeFn,
    num_bins: int,
    accs: _Accs | None = None,
) -> tuple[_Accs, dict[int, list[int]]]:
    """Fold the episodes ``tasks`` = [(reader index, split, episode)] into ``accs``; also count per-reader
    ``[episodes, frames]``."""
    accs = {} if accs is None else accs
    counts: dict[int, list[int]] = {}
    for ri, split, ep in tasks:
        reader = readers[ri]
        std = episode_fn(reader, split, ep)
        key = (std.embodiment, reader.name)
        if key not in accs:
            accs[key] = {f: RunningStats(np.shape(getattr(std, f))[1], num_bins) for f in ("state", "action")}
        for f in ("state", "action"):
            arr = np.asarray(getattr(std, f))
            if len(arr):
                accs[key][f].update(arr.reshape(len(arr), -1))
        c = counts.setdefault(ri, [0, 0])
        c[0], c[1] = c[0] + 1, c[1] + len(np.asarray(std.action))
    return accs, counts


def _add_counts(total: dict[int, list[int]], part: dict[int, list[int]]) -> None:
    """Add per-reader ``[episodes, frames]`` counts ``part`` into ``total``."""
    for ri, (episodes, frames) in part.items():
        t = total.setdefault(ri, [0, 0])
        t[0], t[1] = t[0] + episodes, t[1] + frames


def _worker_run(tasks: list[tuple[int, str, int]]) -> tuple[_Accs, dict[int, list[int]]]:
    return _accumulate(_WORKER["readers"], tasks, _WORKER["episode_fn"], _WORKER["num_bins"])


def _select(n: int, max_episodes: int | None) -> list[int]:
    """All episodes, or ``max_episodes`` evenly spread ones (datasets are often ordered by time or task)."""
    if max_episodes is None or max_episodes >= n:
        return list(range(n))
    return sorted(set(np.linspace(0, n - 1, max_episodes).round().astype(int).tolist()))


def compute_stats(
    source: DatasetReader | str | Path | Sequence[DatasetReader | str | Path],
    *,
    splits: Sequence[str] | None = None,
    max_episodes: int | None = None,
    workers: int = 0,
    progress: bool | None = None,
    num_bins: int = DEFAULT_BINS,
    episode_fn: EpisodeFn | None = None,
) -> StatsFile:
    """One streaming pass over every episode of every split (or ``splits``) of one or more datasets.

    ``max_episodes`` caps the episodes per dataset (evenly spread); ``workers > 1`` forks that many processes and
    merges their partial stats exactly (0 or 1: in this process). ``episode_fn`` replaces ``standardize_episode``
    (tests, custom maps). ``progress``: a progress bar on stderr (``None``: only when stderr is a terminal).
    """
    from vla.data.readers import open_dataset

    items = [source] if isinstance(source, DatasetReader | str | Path) else list(source)
    readers = [s if isinstance(s, DatasetReader) else open_dataset(s) for s in items]
    episode_fn = episode_fn or _standardizer(readers)
    tasks: list[tuple[int, str, int]] = []
    totals: dict[int, dict[str, int]] = {}
    for ri, r in enumerate(readers):
        pairs = [(s, e) for s in (splits or r.splits()) for e in range(r.num_episodes(s))]
        totals[ri] = {"episodes": len(pairs)}
        tasks += [(ri, *pairs[i]) for i in _select(len(pairs), max_episodes)]
    if not tasks:
        raise ValueError(
            f"no episodes to compute stats over in {[str(r.path) for r in readers]} (splits {splits})"
        )
    # None: a bar on stderr only when it is a terminal (tqdm's own check)
    bar = tqdm(total=len(tasks), desc="stats", unit="ep", disable=None if progress is None else not progress)
    accs: _Accs = {}
    counts: dict[int, list[int]] = {}
    if workers > 0:
        chunk = max(1, len(tasks) // (workers * 8))
        chunks = [tasks[i : i + chunk] for i in range(0, len(tasks), chunk)]
        _WORKER.update(readers=readers, episode_fn=episode_fn, num_bins=num_bins)
        try:
            # ordered: the merge is deterministic
            for part, c in ordered_map(
                _worker_run, chunks, workers=workers, start_method="fork", what="chunk"
            ):
                for key, fields in part.items():
                    mine = accs.setdefault(key, fields)
                    if mine is not fields:
                        for f in fields:
                            mine[f].merge(fields[f])
                _add_counts(counts, c)
                bar.update(sum(v[0] for v in c.values()))
        finally:
            _WORKER.clear()
    else:
        for t in tasks:
            _add_counts(counts, _accumulate(readers, [t], episode_fn, num_bins, accs)[1])
            bar.update(1)
    bar.close()
    return _to_stats_file(readers, accs, counts, totals, splits, max_episodes)


def _to_stats_file(
    readers: Sequence[DatasetReader],
    accs: _Accs,
    counts: dict[int, list[int]],
    totals: dict[int, dict[str, int]],
    splits: Sequence[str] | None,
    max_episodes: int | None,
) -> StatsFile:
    out = StatsFile()
    per_emb: dict[str, dict[str, RunningStats]] = {}
    for (emb, ds), fields in sorted(accs.items()):
        out.stats[StatsFile.key(emb, ds)] = {f: a.finalize() for f, a in fields.items()}
        merged = per_emb.setdefault(emb, {f: RunningStats(a.dim, a.num_bins) for f, a in fields.items()})
        for f, a in fields.items():
            if merged[f].dim != a.dim:
                raise ValueError(
                    f"embodiment {emb!r}: dataset {ds!r} gives {f} width {a.dim}, others {merged[f].dim}; "
                    "their key maps disagree with the embodiment spec"
                )
            merged[f].merge(a)
    for emb, fields in per_emb.items():
        out.stats[emb] = {f: a.finalize() for f, a in fields.items()}
    for ri, r in enumerate(readers):
        e, n = counts.get(ri, [0, 0])
        out.sources.append(
            {
                "dataset": r.name,
                "path": str(r.path),
                "format": r.format,
                "splits": list(splits or r.splits()),
                "episodes": e,
                "frames": n,
                "total_episodes": totals[ri]["episodes"],
                "max_episodes": max_episodes,
            }
        )
    return out


def stats_cache_dir() -> Path:
    """``$VLA_CACHE_DIR/stats`` (default ``~/.cache/vla/stats``): where stats of read-only datasets go."""
    return Path(os.environ.get("VLA_CACHE_DIR", Path.home() / ".cache" / "vla")).expanduser() / "stats"


def _dataset_dir(path: str | Path) -> Path:
    """The folder a dataset's files live in: an RLDS root resolves to its newest ``<version>/`` folder."""
    p = Path(path).resolve()
    if p.is_dir() and not (p / "dataset_info.json").is_file() and not (p / "meta" / "info.json").is_file():
        from vla.data.readers import rlds_version_dir

        p = rlds_version_dir(p) or p
    return p


def default_stats_paths(dataset_path: str | Path) -> list[Path]:
    """Where stats of a dataset are looked for, in order: ``<dataset>/meta/vla_stats.json``, then
    ``<cache>/<name>-<sha256(path)[:12]>.json``."""
    p = _dataset_dir(dataset_path)
    digest = hashlib.sha256(str(p).encode()).hexdigest()[:12]
    name = p.parent.name if (p / "dataset_info.json").is_file() and p.name[:1].isdigit() else p.name
    return [p / "meta" / "vla_stats.json", stats_cache_dir() / f"{name}-{digest}.json"]


def find_stats(dataset_path: str | Path) -> Path | None:
    """The first existing file of ``default_stats_paths``, or None."""
    return next((p for p in default_stats_paths(dataset_path) if p.is_file()), None)


def _writable(folder: Path) -> bool:
    """Whether we may write under ``folder``: its nearest existing ancestor must grant write permission AND
    carry a write bit (root passes ``os.access`` everywhere; a ``chmod a-w`` fixture must still be left alone)."""
    p = folder
    while not p.exists() and p != p.parent:
        p = p.parent
    return os.access(p, os.W_OK) and bool(p.stat().st_mode & stat.S_IWUSR)


def nonfinite_report(stats: StatsFile) -> list[str]:
    """One line per dataset field whose data holds NaN/inf values (``NormStats.num_nonfinite``): they are left out
    of the statistics, and normalizing with these stats refuses the field, so the user must hear of them now."""
    lines = []
    for key, fields in stats.stats.items():
        if "@" not in key:  # the per-embodiment entries repeat the per-dataset ones
            continue
        for name, st in fields.items():
            if st.num_nonfinite is not None and (bad := np.flatnonzero(st.num_nonfinite)).size:
                source = next(
                    (s.get("path") for s in stats.sources if s.get("dataset") == key.split("@", 1)[1]), key
                )
                lines.append(
                    f"{source}: {int(st.num_nonfinite.sum())} non-finite (NaN/inf) value(s) in the standardized "
                    f"{name} of {key} (dims {bad.tolist()[:8]}), left out of these statistics; training refuses "
                    f"the field until they are fixed. `vla data validate {source}` names the episodes and frames."
                )
    return lines


def write_stats(dataset_path: str | Path, out: str | Path | None = None, **kwargs: Any) -> Path:
    """Compute stats of one dataset (``compute_stats`` keyword arguments) and save them to ``out``, else to
    ``<dataset>/meta/vla_stats.json``, else (read-only dataset folder) to the cache. Returns the path written."""
    stats = compute_stats(dataset_path, **kwargs)
    if out is not None:
        return stats.save(out)
    local, cached = default_stats_paths(dataset_path)
    if _writable(local.parent):
        try:
            return stats.save(local)
        except OSError as e:
            log.warning("could not write %s (%s)", local, e)
    path = stats.save(cached)
    log.warning("%s is read-only; wrote the stats to the cache instead: %s", local.parent.parent, path)
    return path
