"""RLDS datasets (TFDS directories of ``tf.train.Example`` episodes) read without TensorFlow.

A TFDS version directory holds ``dataset_info.json`` (name, splits, shard lengths, file name template),
``features.json`` (the nested ``FeaturesDict`` spec) and shards ``NAME-SPLIT.tfrecord-XXXXX-of-YYYYY``.
Each record is one episode: per-step features are stored flattened under ``steps/<path>`` with all steps
concatenated (floats as float32 — float64 fields too —, ints and bools as int64, text and encoded images as
bytes), and per-episode features under ``episode_metadata/<path>``. Episode ``i`` of a split counts records
in file order: shards by name, then records in each shard.

The features.json spec and shard naming are parsed by ``vla.data.readers.tfds_spec``.
"""

from __future__ import annotations

import io
import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vla.data.readers.base import DatasetFormatError, DatasetReader, FeatureInfo, RawEpisode
from vla.data.readers.tfds_spec import (
    DEFAULT_TEMPLATE,
    SHARD_RE,
    RLDSFeature,
    parse_features_json,
    shard_name,
)
from vla.data.readers.tfrecord import FeatureValue, parse_example, read_feature, read_record, scan_tfrecord

_LENGTH_KEYS = ("is_first", "is_last", "is_terminal")  # per-step flags whose length is the step count


@dataclass
class _Split:
    """Shard files of one split, their episode counts and (lazily) their record byte offsets."""

    name: str
    shards: list[Path]
    counts: list[int] | None  # episodes per shard from dataset_info.json; None -> count by scanning
    # per shard: int64 [records, 2] (byte offset, payload length), scanned on first use
    index: list[np.ndarray | None] = field(default_factory=list)
    cum: np.ndarray | None = None  # [shards + 1] cumulative episode counts
    lengths: np.ndarray | None = None  # [episodes] steps per episode, -1 until known

    def __post_init__(self) -> None:
        self.index = [None] * len(self.shards)


class RLDSReader(DatasetReader):
    """Random access to the episodes of a TFDS/RLDS version directory (e.g. ``.../bridge_dataset/1.0.0``).

    ``verify_crc`` checks each record's payload CRC32C on read (length CRCs are always checked). Shards are
    indexed on first use by scanning record headers; file descriptors are opened lazily per process (safe in
    forked DataLoader workers, and the reader pickles); the last decoded episode is cached.
    """

    format = "rlds"

    def __init__(self, path: str | Path, verify_crc: bool = True) -> None:
        super().__init__(path)
        self.verify_crc = verify_crc
        self._info = self._load_json("dataset_info.json")
        try:
            self._leaves = parse_features_json(
                self._load_json("features.json"), str(self.path / "features.json")
            )
        except DatasetFormatError:
            raise
        except (
            KeyError,
            TypeError,
            AttributeError,
            ValueError,
            IndexError,
        ) as e:  # a damaged or foreign spec
            raise DatasetFormatError(
                f"{self.path / 'features.json'}: not a TFDS features spec ({type(e).__name__}: {e}); re-download "
                "or re-export the dataset"
            ) from None
        self._steps = [f for f in self._leaves if f.in_steps]
        self._meta = [f for f in self._leaves if not f.in_steps]
        if not self._steps:
            raise DatasetFormatError(f"{self.path}/features.json: no 'steps' features; not an RLDS dataset.")
        self._by_name = {f.name: f for f in self._steps}
        self._length_key = self._pick_length_key()
        self._splits = self._find_splits()
        self._fds: dict[Path, int] = {}
        self._pid = os.getpid()
        self._cache: tuple[str, int, dict[str, FeatureValue], RawEpisode] | None = None

    # ---- identity and structure -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return str(self._info.get("name") or self.path.parent.name)

    def splits(self) -> list[str]:
        return list(self._splits)

    def num_episodes(self, split: str) -> int:
        return int(self._cum(split)[-1])

    def episode_length(self, split: str, episode: int) -> int:
        s = self._split(split)
        self._locate(split, episode)
        if s.lengths is None:
            s.lengths = np.full(self.num_episodes(split), -1, dtype=np.int64)
        if s.lengths[episode] < 0:  # RLDS stores no step count: decode just the length field
            path, _, offset, length = self._locate(split, episode)
            value = read_feature(self._fd(path), offset, length, self._length_key.key)
            ex = self._parse(split, episode) if value is None else {self._length_key.key: value}
            s.lengths[episode] = self._num_steps(ex, split, episode)
        return int(s.lengths[episode])

    def episode_lengths(self, split: str) -> np.ndarray:
        """int64 ``[num_episodes]`` step counts, in file order (each episode's length field decoded once)."""
        return np.asarray([self.episode_length(split, e) for e in range(self.num_episodes(split))], np.int64)

    def num_frames(self, split: str) -> int:
        return int(self.episode_lengths(split).sum())

    def features(self) -> dict[str, FeatureInfo]:
        return {f.name: f.info() for f in self._steps}

    def metadata_features(self) -> dict[str, FeatureInfo]:
        """Per-episode features (``episode_metadata/...`` without the prefix; other top-level keys as is)."""
        return {f.name: f.info() for f in self._meta}

    def info(self) -> dict[str, Any]:
        return {
            **super().info(),
            "episode_metadata": {k: f.to_json() for k, f in self.metadata_features().items()},
        }

    # ---- data ---------------------------------------------------------------------------------------------
    def read_episode(self, split: str, episode: int) -> RawEpisode:
        """Low-dimensional step fields ``[length, *shape]`` in features.json dtypes, plus episode metadata
        (scalars as Python values). The returned object is cached: treat it as read-only."""
        if self._cache is not None and self._cache[:2] == (split, episode):
            return self._cache[3]
        ex = self._parse(split, episode)
        n = self._num_steps(ex, split, episode)
        steps: dict[str, np.ndarray] = {}
        for f in self._steps:
            value = self._get(ex, f, split, episode)
            if f.cls != "Image":
                steps[f.name] = self._decode(value, f, n, split, episode)
            elif len(value) != n:
                self._fail(
                    split, episode, f, f"has {len(value)} encoded frames but the episode has {n} steps"
                )
        metadata = {}
        for f in self._meta:
            value = self._decode(self._get(ex, f, split, episode), f, None, split, episode)
            metadata[f.name] = value.item() if value.ndim == 0 else value
        ep = RawEpisode(split=split, index=episode, length=n, steps=steps, metadata=metadata)
        self._cache = (split, episode, ex, ep)
        if (lengths := self._splits[split].lengths) is not None:
            lengths[episode] = n
        return ep

    def read_images(
        self, split: str, episode: int, frames: Sequence[int], keys: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Decode (Pillow) only the requested frames: ``{key: uint8 [len(frames), H, W, C]}``."""
        ep = self.read_episode(split, episode)
        ex = self._cache[2] if self._cache is not None else {}
        out: dict[str, np.ndarray] = {}
        for key in keys:
            f = self._by_name.get(key)
            if f is None or f.cls != "Image":
                raise KeyError(
                    f"{self.path}: '{key}' is not an image feature; image keys: {self.image_keys()}"
                )
            if bad := [i for i in frames if not 0 <= i < ep.length]:
                raise IndexError(
                    f"{self.path}: frames {bad} out of range ({split} episode {episode}: {ep.length})"
                )
            arrays = [self._decode_image(ex[f.key][i], f, split, episode, i) for i in frames]
            out[key] = np.stack(arrays) if arrays else np.zeros((0, *(max(d, 0) for d in f.shape)), np.uint8)
        return out

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds, self._cache = {}, None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}, "_cache": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    def __del__(self) -> None:
        # At interpreter shutdown module globals (even `contextlib`) may already be gone: plain try/except only.
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass

    # ---- internals: files --------------------------------------------------------------------------------
    def _load_json(self, name: str) -> dict[str, Any]:
        p = self.path / name
        if not p.is_file():
            found = (
                sorted(d.parent.name for d in self.path.glob("*/dataset_info.json"))
                if self.path.is_dir()
                else []
            )
            hint = f" (found version folders {found}: pass one of them)" if found else ""
            raise DatasetFormatError(
                f"{p}: missing{hint}. An RLDS dataset is a TFDS version directory (e.g. "
                f".../bridge_dataset/1.0.0) with dataset_info.json, features.json and "
                f"NAME-SPLIT.tfrecord-XXXXX-of-YYYYY shards; re-download it or re-export it with TFDS."
            )
        try:
            return json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DatasetFormatError(
                f"{p}: not valid JSON ({e}); re-download or re-export the dataset."
            ) from None

    def _find_splits(self) -> dict[str, _Split]:
        """Shards per split from dataset_info.json; shard files found by globbing where it lacks them."""
        name, fmt = self._info.get("name") or "", self._info.get("fileFormat") or "tfrecord"
        globbed: dict[str, list[Path]] = {}
        for p in sorted(self.path.glob(f"*.{fmt}-?????-of-?????")):
            if m := SHARD_RE.match(p.name):
                globbed.setdefault(m["split"], []).append(p)
        splits: dict[str, _Split] = {}
        for entry in self._info.get("splits") or [{"name": s} for s in globbed]:
            split, counts = entry["name"], [int(x) for x in entry.get("shardLengths", [])]
            template = entry.get("filepathTemplate") or DEFAULT_TEMPLATE
            shards = [
                self.path / shard_name(template, name, split, fmt, i, len(counts)) for i in range(len(counts))
            ]
            if not counts or not all(p.is_file() for p in shards):
                _check_no_shard_missing(shards if counts else [], globbed.get(split, []), split)
                shards, counts = globbed.get(split, []), None
            if not shards:
                expected = f"{name}-{split}.{fmt}-XXXXX-of-YYYYY"
                raise DatasetFormatError(
                    f"{self.path}: no shards {expected} for split '{split}'; re-download it."
                )
            splits[split] = _Split(split, shards, counts)
        if not splits:
            raise DatasetFormatError(
                f"{self.path}: no NAME-SPLIT.{fmt}-XXXXX-of-YYYYY shards; re-download it."
            )
        return splits

    def _fd(self, path: Path) -> int:
        if self._pid != os.getpid():  # forked worker: close our copies of the parent's descriptors, reopen
            for inherited in self._fds.values():
                os.close(inherited)
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            except PermissionError:
                raise DatasetFormatError(
                    f"{path}: permission denied opening the shard; fix its permissions (e.g. chmod a+r {path})"
                ) from None
            except OSError as e:
                raise DatasetFormatError(
                    f"{path}: cannot open shard ({e.strerror}); re-download it."
                ) from None
        return fd

    def _split(self, split: str) -> _Split:
        if split not in self._splits:
            raise KeyError(f"{self.path}: no split '{split}'; splits: {list(self._splits)}")
        return self._splits[split]

    def _shard_index(self, s: _Split, i: int) -> np.ndarray:
        idx = s.index[i]
        if idx is None:
            idx = scan_tfrecord(s.shards[i], self._fd(s.shards[i]))
            if s.counts is not None and len(idx) != s.counts[i]:
                raise DatasetFormatError(
                    f"{s.shards[i]}: dataset_info.json lists {s.counts[i]} episodes for this shard but the "
                    f"file holds {len(idx)} records; the shard or dataset_info.json is stale; re-download it."
                )
            s.index[i] = idx  # kept only once checked: every later read of a bad shard fails the same way
        return idx

    def _cum(self, split: str) -> np.ndarray:
        s = self._split(split)
        if s.cum is None:
            counts = s.counts or [len(self._shard_index(s, i)) for i in range(len(s.shards))]
            s.cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return s.cum

    def _locate(self, split: str, episode: int) -> tuple[Path, int, int, int]:
        """(shard file, record number in it, byte offset, payload length) of an episode."""
        cum = self._cum(split)
        if not 0 <= episode < cum[-1]:
            raise IndexError(
                f"{self.path}: episode {episode} out of range for split '{split}' ({cum[-1]} episodes)"
            )
        s = self._splits[split]
        shard = int(np.searchsorted(cum, episode, side="right")) - 1
        record = episode - int(cum[shard])
        offset, length = self._shard_index(s, shard)[record]
        return s.shards[shard], record, int(offset), int(length)

    def _where(self, split: str, episode: int) -> str:
        path, record, _, _ = self._locate(split, episode)
        return f"{path}: record {record} ({split} episode {episode})"

    def _fail(self, split: str, episode: int, f: RLDSFeature, what: str) -> None:
        raise DatasetFormatError(
            f"{self._where(split, episode)}, feature '{f.key}' {what}; the episode disagrees with "
            f"features.json — re-export the dataset or fix features.json."
        )

    # ---- internals: decoding ------------------------------------------------------------------------------
    def _parse(self, split: str, episode: int) -> dict[str, FeatureValue]:
        path, record, offset, length = self._locate(split, episode)
        data = read_record(self._fd(path), path, offset, length, record, self.verify_crc)
        try:
            return parse_example(data)
        except DatasetFormatError as e:
            where = self._where(split, episode)
            raise DatasetFormatError(f"{where}: {e}; the shard is corrupt — re-download it.") from None

    def _pick_length_key(self) -> RLDSFeature:
        """The per-step field whose length is the step count: ``is_first`` if present, else another scalar."""
        for name in _LENGTH_KEYS:
            if name in self._by_name:
                return self._by_name[name]
        scalars = [f for f in self._steps if f.cls == "Scalar" and f.dtype != "str" and f.encoding == "none"]
        per_frame = [f for f in self._steps if f.cls in ("Image", "Text") or f.encoding != "none"]
        fixed = [f for f in self._steps if -1 not in f.shape and 0 not in f.shape]
        return (scalars or per_frame or fixed or self._steps)[0]

    def _num_steps(self, ex: dict[str, FeatureValue], split: str, episode: int) -> int:
        f = self._length_key
        value = self._get(ex, f, split, episode)
        per_step = int(np.prod(f.shape)) if isinstance(value, np.ndarray) else 1
        if per_step <= 0 or len(value) % per_step:
            self._fail(split, episode, f, f"has {len(value)} values, not a multiple of its shape {f.shape}")
        return len(value) // per_step

    def _get(self, ex: dict[str, FeatureValue], f: RLDSFeature, split: str, episode: int) -> FeatureValue:
        if f.key not in ex:
            self._fail(split, episode, f, "is missing from the record")
        return ex[f.key]

    def _decode(
        self, value: FeatureValue, f: RLDSFeature, n: int | None, split: str, episode: int
    ) -> np.ndarray:
        """Stored list -> array ``[n, *shape]`` (``shape`` if per-episode) in the features.json dtype."""
        if f.cls == "Image":  # per-episode image (rare): decode it eagerly
            return self._decode_image(value[0], f, split, episode, 0)
        if f.dtype == "str" or f.encoding in ("bytes", "zlib"):
            if not isinstance(value, list):
                self._fail(split, episode, f, "holds numbers but features.json says bytes/text")
            if f.dtype == "str":
                arr = np.empty(len(value), dtype=object)
                arr[:] = self._texts(value, f, split, episode)
            else:  # TFDS Tensor(encoding=bytes|zlib): one raw ndarray buffer per step
                raw = [zlib.decompress(v) if f.encoding == "zlib" else bytes(v) for v in value]
                arr = np.frombuffer(b"".join(raw), dtype=f.dtype)
        elif isinstance(value, list):
            if value:
                self._fail(split, episode, f, "holds bytes but features.json says a numeric tensor")
            arr = np.zeros(0, f.dtype)
        else:  # float64 was stored as float32 and bool as int64: cast back
            stored = "float" if value.dtype.kind == "f" else "int64"
            declared = "float" if np.dtype(f.dtype).kind == "f" else "int64"
            if stored != declared and len(value):  # a cast would silently truncate floats or relabel integers
                self._fail(split, episode, f, f"holds {stored} values but features.json declares {f.dtype}")
            arr = value != 0 if f.dtype == "bool" else value.astype(f.dtype)
        steps = 1 if n is None else n
        shape = f.shape
        if -1 in shape:  # one unknown dim: infer it from the element count
            known = int(np.prod([d for d in shape if d != -1])) * steps
            shape = tuple(arr.size // known if d == -1 and known else d for d in shape)
        if arr.size != (need := int(np.prod(shape)) * steps):
            self._fail(
                split,
                episode,
                f,
                f"has {arr.size} elements; features.json shape {f.shape} x {steps} steps needs {need}",
            )
        return arr.reshape(shape if n is None else (n, *shape))

    def _texts(self, values: list[memoryview], f: RLDSFeature, split: str, episode: int) -> list[str | bytes]:
        """Per-step strings of a text feature. ``Text`` features must be UTF-8 (strict: a value that is not is an
        error naming the record, the feature and the step, never a mojibake prompt); a ``Tensor(dtype=string)``
        may hold binary data and keeps the bytes of a value that is not UTF-8. A value equal to the previous
        step's is the same ``str`` object: an instruction repeated on every step is stored once in memory."""
        out: list[str | bytes] = []
        previous: tuple[memoryview, str | bytes] | None = None
        for step, v in enumerate(values):
            if previous is not None and previous[0] == v:
                out.append(previous[1])
                continue
            b = bytes(v)
            try:
                text: str | bytes = b.decode("utf-8")
            except UnicodeDecodeError as e:
                if f.cls == "Text":
                    self._fail(
                        split, episode, f,
                        f"step {step} is not UTF-8 text ({e.reason} at byte {e.start}: "
                        f"{b[max(0, e.start - 8) : e.start + 8]!r})",
                    )  # fmt: skip
                text = b
            out.append(text)
            previous = (v, text)
        return out

    def _decode_image(
        self, data: memoryview, f: RLDSFeature, split: str, episode: int, frame: int
    ) -> np.ndarray:
        mode = {1: "L", 3: "RGB", 4: "RGBA"}.get(f.shape[-1] if len(f.shape) == 3 else 3, "RGB")
        try:
            with Image.open(io.BytesIO(data)) as im:
                arr = np.asarray(im if im.mode == mode else im.convert(mode))
        except (OSError, ValueError, SyntaxError) as e:  # PIL: UnidentifiedImageError, truncated data, ...
            raise DatasetFormatError(
                f"{self._where(split, episode)}, frame {frame}, image '{f.name}': cannot decode "
                f"{f.encoding} data ({type(e).__name__}: {e}); the episode is corrupt — re-download or "
                f"re-export the dataset."
            ) from None
        arr = arr[:, :, None] if arr.ndim == 2 else arr
        if any(d not in (-1, a) for d, a in zip(f.shape, arr.shape)):
            raise DatasetFormatError(
                f"{self._where(split, episode)}, frame {frame}, image '{f.name}': decoded shape "
                f"{arr.shape} != features.json shape {f.shape}; fix features.json or re-export the dataset."
            )
        return arr


def _check_no_shard_missing(listed: list[Path], found: list[Path], split: str) -> None:
    """Refuse a split some of whose shards are absent, instead of silently reading the others: a shard that
    dataset_info.json lists (``listed``, named by its template) is missing while others it lists are there or the
    globbed shards (``found``) are fewer than it lists; or a globbed ``-XXXXX-of-YYYYY`` shard set holds fewer than
    YYYYY files. (Shards found only under other names than the template, as many as listed, are read.)"""
    missing = [p for p in listed if not p.is_file()]
    if missing and (len(missing) < len(listed) or len(found) < len(listed)):
        raise DatasetFormatError(
            f"{missing[0]}: missing; {len(missing)} of the {len(listed)} shards dataset_info.json lists for split "
            f"{split!r} are absent, so their episodes would be left out. Re-download them."
        )
    totals = {int(m["n"]) for p in found if (m := SHARD_RE.match(p.name))}
    if len(totals) == 1 and (total := totals.pop()) > len(found):
        have = {int(m["i"]) for p in found if (m := SHARD_RE.match(p.name))}
        absent = sorted(set(range(total)) - have)
        raise DatasetFormatError(
            f"{found[0].parent}: split {split!r} has {len(found)} of its {total} shards (-of-{total:05d}); shard(s) "
            f"{absent[:5]} are missing, so their episodes would be left out. Re-download them."
        )
