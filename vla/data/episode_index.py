"""Per-dataset episode index: the kept-frame count of every episode of every split after standardization,
built once in one parallel pass and cached, so that building a loader reads a dataset's metadata, not its
data.

The loader's flat sample index needs each episode's *kept* frames, and drop rules, openpi's DROID idle filter
and the success filter make that differ from the stored length (which LeRobot keeps in ``meta/episodes``, and
RLDS does not keep at all), so it takes standardizing every episode — for RLDS, parsing every record, images
included. The index keeps those counts in ``<dataset>/meta/vla_episode_index-<key>.json``, next to
``vla_stats.json`` (in the user cache when the dataset folder is read-only, as ``vla.data.stats`` does for
stats). It is

* keyed (``index_key``) by all the counts depend on: the key map's name and a digest of its content, the
  effective ``drop_first``/``drop_last``/``idle_filter``/``success_only`` and ``INDEX_FORMAT_VERSION``.
  ``language_choice`` and ``seed`` pick prompts, never frames, so they are not part of it (a new ``data.seed``
  must not rebuild the index of a 1.7 TB dataset);
* valid only while the files episodes are read from keep their size and mtime (``file_identity``): a changed,
  added or removed file, or a corrupt index file, means a rebuild, with a log line that says why. Like rsync's
  quick check, a file rewritten in place to the same size whose mtime is then set back (``touch -r``) is not
  noticed; a count that disagrees with standardization is an error naming the index when that episode is read
  (unless ``data.on_bad_sample=skip``). Inode and ctime are left out on purpose: they change on every copy of a
  dataset (``cp -a``, ``rsync -a`` to a node's local disk), and each would rescan a 1.7 TB corpus;
* written atomically (temp file + rename) under a per-host lock file, so concurrent ranks and launches never
  read half a file and, where the filesystem supports ``flock``, only one of them builds.

``VLA_NO_INDEX_CACHE=1`` (or ``kept_lengths(..., cache=False)``) counts by standardizing, without the cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import vla
from vla.data.keymaps import KeyMap, KeyMapError
from vla.data.keymaps.conversions import IDLE_THRESHOLD, MIN_IDLE_RUN, MIN_KEEP_RUN, TRIM_RUN_END
from vla.data.readers.base import DatasetFormatError, DatasetReader
from vla.data.standardize import StandardizeOptions, standardize_episode
from vla.data.stats import _writable, default_stats_paths
from vla.workers import ordered_map

log = logging.getLogger(__name__)

INDEX_FORMAT_VERSION = 2  # 2: the episodes that could not be read are recorded
NO_CACHE_ENV = "VLA_NO_INDEX_CACHE"
MAX_WORKERS = 8
_AUTO_POOL_EPISODES = 64  # below this a forked pool costs more than it saves

#: One dataset file's identity: (path relative to the dataset folder, size in bytes, mtime in ns).
FileStat = tuple[str, int, int]


class IndexCorruptError(ValueError):
    """An index file is truncated, not JSON, or fails its checksum; it is rebuilt."""


def cache_disabled() -> bool:
    """Whether ``VLA_NO_INDEX_CACHE`` turns the cache off (any value but empty, ``0``, ``false``, ``no``)."""
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() not in ("", "0", "false", "no")


# ---- what an index depends on ------------------------------------------------------------------------------
def index_key(keymap: KeyMap, options: StandardizeOptions | None) -> dict[str, Any]:
    """Everything the kept-frame counts depend on, with each option at its effective value."""
    opts = options or StandardizeOptions()
    idle = bool(opts.idle_filter and keymap.idle_key is not None)
    return {
        "format_version": INDEX_FORMAT_VERSION,
        "keymap": keymap.dataset,
        "keymap_digest": hashlib.sha256(repr(keymap).encode()).hexdigest()[:16],
        "drop_first": keymap.drop_first if opts.drop_first is None else opts.drop_first,
        "drop_last": keymap.drop_last if opts.drop_last is None else opts.drop_last,
        # the idle rule's constants, so retuning them rebuilds the indexes that used it
        "idle_filter": [IDLE_THRESHOLD, MIN_IDLE_RUN, MIN_KEEP_RUN, TRIM_RUN_END] if idle else False,
        "success_only": bool(opts.success_only and keymap.success_key is not None),
    }


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _scan(root: Path, rel: str, recursive: bool, out: list[FileStat]) -> None:
    """Append (relative path, size, mtime_ns) of the files under ``root/rel``, skipping hidden names and vla's
    own ``vla_*`` files (stats, this index and its lock change without the data changing)."""
    try:
        with os.scandir(root / rel if rel else root) as it:
            entries = sorted(
                it, key=lambda e: e.name
            )  # canonical order, without sorting all paths at the end
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name.startswith((".", "vla_")):
            continue
        name = f"{rel}/{entry.name}" if rel else entry.name
        if entry.is_dir(follow_symlinks=True):
            if recursive:
                _scan(root, name, recursive, out)
        elif entry.is_file(follow_symlinks=True):
            st = entry.stat(follow_symlinks=True)
            out.append((name, int(st.st_size), int(st.st_mtime_ns)))


def indexable(fmt: str) -> bool:
    """Whether datasets of reader format ``fmt`` have a known file layout, so their index can be cached."""
    return fmt == "rlds" or fmt.startswith("lerobot")


def file_identity(path: str | Path, fmt: str) -> list[FileStat] | None:
    """Identities of the files a dataset's episodes and their metadata are read from, in a canonical order.

    RLDS (a TFDS version folder): its top-level files (``dataset_info.json``, ``features.json``, the shards).
    LeRobot: every file under ``data/`` and ``meta/`` (videos hold no frame counts). None for other formats,
    whose files are unknown: their index is not cached.
    """
    root = Path(path)
    out: list[FileStat] = []
    if fmt == "rlds":
        _scan(root, "", False, out)
    elif fmt.startswith("lerobot"):
        _scan(root, "data", True, out)
        _scan(root, "meta", True, out)
    else:
        return None
    return out


def index_paths(dataset_path: str | Path, digest: str) -> list[Path]:
    """Where the index of key ``digest`` is looked for, in order: next to the stats, then the cache."""
    local, cached = default_stats_paths(dataset_path)
    return [
        local.parent / f"vla_episode_index-{digest}.json",
        cached.with_name(f"{cached.stem}.episode_index-{digest}.json"),
    ]


def _stale_reason(old: Sequence[FileStat], new: Sequence[FileStat]) -> str | None:
    """Why ``new`` file identities differ from ``old`` (first example of each kind), or None when equal."""
    if list(old) == list(new):
        return None
    before, after = {f[0]: f[1:] for f in old}, {f[0]: f[1:] for f in new}
    changed = [n for n in after if n in before and before[n] != after[n]]
    added, removed = sorted(set(after) - set(before)), sorted(set(before) - set(after))
    parts = []
    if changed:
        (s0, m0), (s1, m1) = before[changed[0]], after[changed[0]]
        parts.append(
            f"{len(changed)} file(s) changed, e.g. {changed[0]} (size {s0} -> {s1}, mtime_ns {m0} -> {m1})"
        )
    if added:
        parts.append(f"{len(added)} file(s) added, e.g. {added[0]}")
    if removed:
        parts.append(f"{len(removed)} file(s) removed, e.g. {removed[0]}")
    return "; ".join(parts) or "file list differs"


# ---- the file ----------------------------------------------------------------------------------------------
def files_digest(files: Sequence[FileStat]) -> str:
    """sha256 of file identities: what a warm start compares, instead of 100k parsed entries."""
    text = "\n".join(f"{n}\0{s}\0{m}" for n, s, m in files)
    # a file name that is not UTF-8 (os.scandir decodes it with surrogate escapes) hashes as its raw bytes
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass
class EpisodeIndex:
    """Kept-frame counts ``lengths[split]`` (int64 ``[num_episodes]``) of one dataset under one ``key``, and
    the identities of the files they were counted from (``files``; parsed on demand, ``files_sha256`` always).

    ``unreadable[split][episode]``: why an episode could not be standardized (its count is 0); the loader refuses
    such a dataset unless ``data.on_bad_sample=skip``.

    On disk, four lines: a JSON header (format version, key, ``files_sha256``, sha256 ``checksum`` of the
    other lines), the counts, the file identities (which a warm start never parses) and ``unreadable``.
    """

    key: dict[str, Any]
    files: list[FileStat] | None
    lengths: dict[str, np.ndarray]
    dataset: str = ""
    path: Path | None = None
    files_sha256: str = ""
    _files_json: bytes = b""
    unreadable: dict[str, dict[int, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.files is not None and not self.files_sha256:
            self.files_sha256 = files_digest(self.files)

    def recorded_files(self) -> list[FileStat]:
        if self.files is None:
            self.files = [(str(n), int(s), int(m)) for n, s, m in json.loads(self._files_json)]
        return self.files

    def save(self, path: str | Path) -> Path:
        """Write atomically: a temp file in the same folder renamed over ``path`` (readers see old or new)."""
        path = Path(path)
        lengths = {s: [int(x) for x in v] for s, v in self.lengths.items()}
        files = [list(f) for f in self.recorded_files()]
        unreadable = {s: {str(e): m for e, m in bad.items()} for s, bad in self.unreadable.items() if bad}
        body = "\n".join(json.dumps(x, separators=(",", ":")) for x in (lengths, files, unreadable)).encode()
        header = {
            "format_version": INDEX_FORMAT_VERSION,
            "created_by": f"vla {vla.__version__}",
            "dataset": self.dataset,
            "key": self.key,
            "files_sha256": self.files_sha256,
            "checksum": hashlib.sha256(body).hexdigest(),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")  # unique across hosts
        try:
            tmp.write_bytes(json.dumps(header).encode() + b"\n" + body + b"\n")
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | Path) -> EpisodeIndex:
        """Read and verify an index file; ``IndexCorruptError`` when it cannot be trusted."""
        path = Path(path)
        try:
            head, _, body = path.read_bytes().partition(b"\n")
            header = json.loads(head)
            if header.get("format_version") != INDEX_FORMAT_VERSION:
                raise IndexCorruptError(
                    f"format_version {header.get('format_version')}, this vla reads {INDEX_FORMAT_VERSION}"
                )
            body = body.removesuffix(b"\n")
            if hashlib.sha256(body).hexdigest() != header["checksum"]:
                raise IndexCorruptError("checksum mismatch (truncated or edited)")
            lengths_json, files_json, unreadable_json = body.split(b"\n")
            lengths = {str(s): np.asarray(v, dtype=np.int64) for s, v in json.loads(lengths_json).items()}
            unreadable = {
                str(s): {int(e): str(m) for e, m in bad.items()}
                for s, bad in json.loads(unreadable_json).items()
            }
            return cls(
                key=header["key"],
                files=None,
                lengths=lengths,
                dataset=str(header.get("dataset")),
                path=path,
                files_sha256=str(header["files_sha256"]),
                _files_json=files_json,
                unreadable=unreadable,
            )
        except IndexCorruptError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError: ValueError
            raise IndexCorruptError(f"{type(e).__name__}: {e}") from None


def find_index(
    candidates: Sequence[Path], key: dict[str, Any], files: Sequence[FileStat], splits: Sequence[str]
) -> tuple[EpisodeIndex | None, list[str]]:
    """The first candidate file that holds a valid index for ``key``, ``files`` and ``splits``, and why each
    existing candidate before it was rejected."""
    rejected, digest = [], files_digest(files)
    for path in candidates:
        if not path.is_file():
            continue
        try:
            index = EpisodeIndex.load(path)
            stale = index.files_sha256 != digest and _stale_reason(index.recorded_files(), files)
        except IndexCorruptError as e:
            rejected.append(f"{path} is corrupt ({e})")
            continue
        except (ValueError, TypeError) as e:
            rejected.append(f"{path} is corrupt (file list: {type(e).__name__}: {e})")
            continue
        if index.key != key:
            rejected.append(f"{path} was built for {index.key}, not {key}")
        elif stale:
            rejected.append(f"{path} is stale: {stale}")
        elif sorted(index.lengths) != sorted(splits):
            rejected.append(f"{path} has splits {sorted(index.lengths)}, the dataset {sorted(splits)}")
        else:
            return index, rejected
    return None, rejected


# ---- counting ----------------------------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}  # set before forking so workers inherit the reader without pickling it


#: what reading a damaged episode raises: the readers and standardization turn missing, truncated or corrupt files,
#: text that is not UTF-8 and features that do not fit the key map into these, naming the file. Only these are
#: recorded as an unreadable episode; anything else (a TypeError in our own code, an error of the machine) propagates,
#: never hidden as bad data.
_DATA_ERRORS = (DatasetFormatError, KeyMapError)
# errors of the machine, not of the data, even when a reader wraps them in a DatasetFormatError that names the file:
# never recorded (the index would keep the episode out after the machine is fixed, since the files did not change)
_NOT_DATA_ERRORS = (
    PermissionError,
    TimeoutError,
    ConnectionError,
    InterruptedError,
    BlockingIOError,
    MemoryError,
)


def _caused_by_the_machine(error: BaseException) -> bool:
    """Whether ``error`` or an exception it was raised from (``__cause__``, or ``__context__`` under ``from
    None``) is an error of the machine."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, _NOT_DATA_ERRORS):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _count_one(
    reader: DatasetReader, keymap: KeyMap, options: StandardizeOptions | None, split: str, episode: int
) -> int | str:
    """Kept frames of one episode, or why its data cannot be read (its error, as a message)."""
    try:
        return len(standardize_episode(reader, split, episode, keymap, options=options).frames)
    except _DATA_ERRORS as e:
        if _caused_by_the_machine(e):
            raise
        return f"{type(e).__name__}: {e}"


def _count(
    reader: DatasetReader, keymap: KeyMap, options: StandardizeOptions | None, tasks: list
) -> list[int | str]:
    return [_count_one(reader, keymap, options, s, e) for s, e in tasks]


def _worker_count(tasks: list[tuple[str, int]]) -> list[int | str]:
    return _count(_WORKER["reader"], _WORKER["keymap"], _WORKER["options"], tasks)


def default_workers(num_episodes: int) -> int:
    """Processes an index build of ``num_episodes`` uses by default: none for a few episodes (forking costs
    more), else one per CPU core up to ``MAX_WORKERS``."""
    return min(MAX_WORKERS, os.cpu_count() or 1) if num_episodes >= _AUTO_POOL_EPISODES else 0


def count_kept(
    reader: DatasetReader,
    keymap: KeyMap,
    options: StandardizeOptions | None,
    splits: Sequence[str],
    workers: int | None = None,
    unreadable: dict[str, dict[int, str]] | None = None,
) -> dict[str, np.ndarray]:
    """Standardize every episode of ``splits`` once -> ``{split: int64 [num_episodes] kept frames}``.

    An episode whose data cannot be read (a ``DatasetFormatError`` or ``KeyMapError``: a damaged file, text that is
    not UTF-8, ...) counts 0 frames and its error goes to ``unreadable[split][episode]``; without ``unreadable`` the
    first such error is raised. Any other exception (a bug, a permission or memory error) propagates.

    ``workers`` forked processes (None: up to ``MAX_WORKERS``, none for small datasets) each take contiguous
    runs of episodes (sequential reads within a shard); results come back in order, so the result does not
    depend on the worker count.
    """
    tasks = [(s, e) for s in splits for e in range(reader.num_episodes(s))]
    workers = default_workers(len(tasks)) if workers is None else workers
    if workers <= 1 or len(tasks) < 2:
        counts = _count(reader, keymap, options, tasks)
    else:
        size = max(1, min(256, len(tasks) // (workers * 8)))
        chunks = [tasks[i : i + size] for i in range(0, len(tasks), size)]
        _WORKER.update(reader=reader, keymap=keymap, options=options)
        try:
            parts = ordered_map(_worker_count, chunks, workers=workers, start_method="fork", what="chunk")
            counts = [n for part in parts for n in part]
        finally:
            _WORKER.clear()
    out, start = {}, 0
    for s in splits:
        n = reader.num_episodes(s)
        part = counts[start : start + n]
        bad = {e: c for e, c in enumerate(part) if isinstance(c, str)}
        if bad and unreadable is None:
            e, why = next(iter(bad.items()))
            raise DatasetFormatError(f"{reader.path} split {s!r} episode {e} cannot be read: {why}")
        if unreadable is not None:
            unreadable[s] = bad
        out[s] = np.asarray([0 if isinstance(c, str) else c for c in part], dtype=np.int64)
        start += n
    return out


@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the dataset's index lock file next to ``target`` (one builder per host;
    the file is never deleted, since unlinking a lock others wait on breaks it). Without lock support the
    builders run side by side, which is still safe: each writes the same counts atomically."""
    fd = None
    lock = target.with_name(target.name.rsplit("-", 1)[0] + ".lock")  # one per dataset, whatever the key
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        log.debug("no lock for %s (%s); building without one", target, e)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _build(
    reader: DatasetReader,
    keymap: KeyMap,
    options: StandardizeOptions | None,
    key: dict[str, Any],
    files: list[FileStat],
    workers: int | None,
) -> EpisodeIndex:
    splits = reader.splits()
    t0 = time.perf_counter()
    unreadable: dict[str, dict[int, str]] = {}
    lengths = count_kept(reader, keymap, options, splits, workers, unreadable)
    log.info(
        "episode index of %s: %d episodes standardized in %.1f s",
        reader.path,
        sum(len(v) for v in lengths.values()),
        time.perf_counter() - t0,
    )
    return EpisodeIndex(key=key, files=files, lengths=lengths, dataset=reader.name, unreadable=unreadable)


def _save(index: EpisodeIndex, local: Path, cached: Path, target: Path) -> None:
    for path in dict.fromkeys([target, cached]):
        try:
            index.save(path)
            if path != local:
                log.warning("%s is read-only; the episode index went to the cache: %s", local.parent, path)
            return
        except OSError as e:
            log.warning("could not write the episode index %s (%s)", path, e)


def load_or_build(
    reader: DatasetReader,
    keymap: KeyMap,
    options: StandardizeOptions | None = None,
    *,
    workers: int | None = None,
) -> EpisodeIndex:
    """The valid cached index of ``reader`` under ``keymap``/``options``, built (and saved) when there is
    none.

    Raises ``ValueError`` for a reader whose files ``file_identity`` does not know (use ``count_kept``).
    """
    files = file_identity(reader.path, reader.format)
    if files is None:
        raise ValueError(f"{reader.path}: format {reader.format!r} has no known file layout to index")
    key = index_key(keymap, options)
    local, cached = candidates = index_paths(reader.path, key_digest(key))
    index, rejected = find_index(candidates, key, files, reader.splits())
    if index is not None:
        return index
    target = local if _writable(local.parent) else cached
    with _build_lock(target):
        # another rank or launch may have built it while this one waited for the lock
        index, rejected_now = find_index(candidates, key, files, reader.splits())
        if index is not None:
            return index
        if rejected_now or rejected:
            why = "; ".join(rejected_now or rejected)
            log.warning("rebuilding the episode index of %s: %s", reader.path, why)
        else:
            log.info(
                "building the episode index of %s (first use with these options): %s", reader.path, target
            )
        index = _build(reader, keymap, options, key, files, workers)
        now = file_identity(reader.path, reader.format) or []
        if (why := _stale_reason(files, now)) is not None:
            log.warning(
                "%s changed while it was indexed (%s); the index is used but not saved", reader.path, why
            )
            return index
        _save(index, local, cached, target)
    return index


def kept_lengths(
    reader: DatasetReader,
    split: str,
    keymap: KeyMap,
    options: StandardizeOptions | None = None,
    *,
    cache: bool = True,
    workers: int | None = None,
) -> tuple[np.ndarray, Path | None, dict[int, str]]:
    """int64 ``[num_episodes]`` kept frames of every episode of ``split``, the index file they came from (None
    when counted without the cache: ``cache=False``, ``VLA_NO_INDEX_CACHE=1`` or an unknown format) and the
    episodes that could not be read, with why (their counts are 0)."""
    if cache and not cache_disabled() and indexable(reader.format):
        index = load_or_build(reader, keymap, options, workers=workers)
        return index.lengths[split], index.path, index.unreadable.get(split, {})
    unreadable: dict[str, dict[int, str]] = {}
    lengths = count_kept(reader, keymap, options, [split], workers, unreadable)
    return lengths[split], None, unreadable[split]


__all__ = [
    "INDEX_FORMAT_VERSION",
    "NO_CACHE_ENV",
    "EpisodeIndex",
    "FileStat",
    "IndexCorruptError",
    "cache_disabled",
    "count_kept",
    "default_workers",
    "file_identity",
    "files_digest",
    "find_index",
    "index_key",
    "index_paths",
    "indexable",
    "kept_lengths",
    "key_digest",
    "load_or_build",
]
