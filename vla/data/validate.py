"""``vla data validate``: find every problem in a dataset in one pass, each with its location and a fix.

Checks: files readable (truncated parquet/tfrecord, missing meta files, text that is not UTF-8), per-step
shapes against the declared features, NaN/inf values, missing frames (LeRobot ``frame_index``/``timestamp``
gaps), undecodable images or video frames, the key map's standardization, degenerate normalization statistics,
and the metadata against the data (``vla.data.consistency``: episode-index gaps, info.json totals,
``meta/stats.json``, a registered robot without a usable key map, timestamps against ``frame_index / fps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from vla.data.readers import DatasetReader, open_dataset

IMAGE_CHUNK = 64
MAX_BAD_FRAMES_LISTED = 5


@dataclass(frozen=True)
class Problem:
    """One problem: ``kind`` (machine-readable), ``where`` (file/split/episode/frame/field) and a message + fix."""

    kind: str
    where: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        return f"[{self.kind}] {self.where}: {self.message}" + (f" Fix: {self.fix}" if self.fix else "")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "where": self.where, "message": self.message, "fix": self.fix}


def _check_lowdim(
    reader: DatasetReader, where: str, steps: dict[str, np.ndarray], problems: list[Problem]
) -> None:
    feats = reader.features()
    for key, arr in steps.items():
        f = feats.get(key)
        if (
            f is not None
            and f.kind == "tensor"
            and arr.dtype != object
            and tuple(arr.shape[1:]) != tuple(f.shape)
        ):
            problems.append(
                Problem(
                    "shape",
                    f"{where} field {key!r}",
                    f"per-step shape {list(arr.shape[1:])} differs from the declared {list(f.shape)}",
                    "re-export the dataset or fix its feature declaration",
                )
            )
        if arr.dtype.kind == "f":
            # [frames, values per frame]: an explicit width, since -1 is undefined for an episode of 0 frames
            bad = ~np.isfinite(arr.reshape(len(arr), int(np.prod(arr.shape[1:])))).all(axis=1)
            if bad.any():
                frames = np.flatnonzero(bad)
                problems.append(
                    Problem(
                        "non_finite",
                        f"{where} field {key!r}",
                        f"NaN/inf at {len(frames)} frame(s), first {frames[:MAX_BAD_FRAMES_LISTED].tolist()}",
                        "drop or repair these frames before training",
                    )
                )
    fi = steps.get("frame_index")
    if fi is not None and len(fi) and not np.array_equal(np.asarray(fi).reshape(-1), np.arange(len(fi))):
        missing = sorted(set(range(int(np.max(fi)) + 1)) - set(np.asarray(fi).reshape(-1).tolist()))
        problems.append(
            Problem(
                "missing_frames",
                f"{where} field 'frame_index'",
                f"frame_index is not 0..{len(fi) - 1}; missing {missing[:MAX_BAD_FRAMES_LISTED]}",
                "re-record or re-convert the episode",
            )
        )
    ts = steps.get("timestamp")
    if ts is not None and reader.fps and len(ts) > 1:
        gaps = np.flatnonzero(np.diff(np.asarray(ts, dtype=np.float64).reshape(-1)) > 1.5 / reader.fps)
        if len(gaps):
            problems.append(
                Problem(
                    "missing_frames",
                    f"{where} field 'timestamp'",
                    f"{len(gaps)} timestamp gap(s) longer than 1.5/fps after frames {gaps[:MAX_BAD_FRAMES_LISTED].tolist()}",
                    "re-record or re-convert the episode",
                )
            )


def _check_images(
    reader: DatasetReader, split: str, ep: int, length: int, where: str, problems: list[Problem]
) -> None:
    feats = reader.features()
    for key in reader.image_keys():
        bad: list[tuple[int, str]] = []
        for start in range(0, length, IMAGE_CHUNK):
            idx = list(range(start, min(start + IMAGE_CHUNK, length)))
            try:
                imgs = reader.read_images(split, ep, idx, [key])[key]
            except Exception:
                for i in idx:  # find exactly which frames fail
                    try:
                        reader.read_images(split, ep, [i], [key])
                    except Exception as e:
                        bad.append((i, str(e)))
                continue
            want = tuple(feats[key].shape)
            if want and len(want) == 3 and tuple(imgs.shape[1:]) != want:
                problems.append(
                    Problem(
                        "shape",
                        f"{where} image {key!r}",
                        f"decoded frames are {list(imgs.shape[1:])}, declared {list(want)}",
                        "fix the feature declaration or re-encode",
                    )
                )
        if bad:
            problems.append(
                Problem(
                    "undecodable_image",
                    f"{where} image {key!r}",
                    f"{len(bad)} frame(s) cannot be decoded, first {[b[0] for b in bad[:MAX_BAD_FRAMES_LISTED]]}: {bad[0][1]}",
                    "re-encode the video/images of this episode or drop it",
                )
            )


def validate_dataset(
    path: str | Path, *, max_episodes: int | None = None, progress: bool | None = None
) -> list[Problem]:
    """All problems found in the dataset at ``path`` (empty list = clean). ``progress``: a progress bar over the
    episodes on stderr (``None``: only when stderr is a terminal)."""
    try:
        reader = open_dataset(path)
        splits = reader.splits()
    except Exception as e:
        return [Problem("unreadable", str(path), str(e), "check the path and that the dataset is complete")]
    from vla.data.consistency import flag_problems, metadata_problems, timestamp_problems
    from vla.data.running_stats import RunningStats
    from vla.data.standardize import keymap_for, standardize_episode

    keymap = keymap_for(reader)
    problems: list[Problem] = []
    if reader.incomplete:
        problems.append(Problem("incomplete", str(reader.path),
                                f"`{reader.incomplete}` was interrupted; the dataset holds only the episodes written so far.",
                                "re-run that command to finish it"))  # fmt: skip
    problems.extend(metadata_problems(reader))
    # standardized state/action stats per embodiment, accumulated as we go (no frames kept in memory)
    per_embodiment: dict[str, dict[str, RunningStats]] = {}
    todo = [(s, e) for s in splits for e in range(reader.num_episodes(s))[:max_episodes]]
    bar = tqdm(total=len(todo), desc=f"validate {reader.name}", unit="ep",
               disable=None if progress is None else not progress)  # fmt: skip
    with bar:
        for split, ep in todo:
            bar.update(1)
            where = f"{reader.path} split {split!r} episode {ep}"
            try:
                raw = reader.read_episode(split, ep)
            except Exception as e:
                problems.append(Problem("unreadable", where, str(e), "repair or remove the damaged file"))
                continue
            _check_lowdim(reader, where, raw.steps, problems)
            problems.extend(flag_problems(where, raw.steps))
            if not any(p.kind == "missing_frames" and p.where.startswith(f"{where} ") for p in problems):
                problems.extend(timestamp_problems(reader, where, raw.steps))  # a gap is reported once
            _check_images(reader, split, ep, raw.length, where, problems)
            if keymap is not None:
                try:
                    std = standardize_episode(reader, split, ep, keymap, raw=raw)
                except Exception as e:
                    problems.append(
                        Problem("standardize", where, str(e), f"fix the key map entry {keymap.dataset!r}")
                    )
                    continue
                acc = per_embodiment.setdefault(
                    std.embodiment, {f: RunningStats(getattr(std, f).shape[1]) for f in ("state", "action")}
                )
                for f, stats in acc.items():
                    if len(getattr(std, f)):
                        stats.update(getattr(std, f))
    problems.extend(_stats_problems(reader, per_embodiment))
    return problems


def _stats_problems(reader: DatasetReader, per_embodiment: dict[str, dict[str, Any]]) -> list[Problem]:
    """Degenerate or non-finite normalization statistics of the standardized state/action, per embodiment
    (``per_embodiment[embodiment][field]`` is a ``RunningStats``)."""
    from vla.data.normalize import StatsFile, validate_stats
    from vla.embodiments import get_embodiment

    out: list[Problem] = []
    for emb, fields in per_embodiment.items():
        spec = get_embodiment(emb)
        finalized = {f: rs.finalize() for f, rs in fields.items() if rs.dim}
        entry = {f: st for f, st in finalized.items() if st.count}  # fields without frames: nothing to check
        for prob in validate_stats(StatsFile(stats={emb: entry}), spec):
            out.append(Problem("degenerate_stats", f"{reader.path} embodiment {emb!r}", str(prob)))
    return out
