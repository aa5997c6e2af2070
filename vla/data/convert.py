"""``vla data convert SRC DST --to lerobot``: any readable dataset -> LeRobot v3.0.

With a registered key map (every OXE/DROID dataset, our sim sets) the output is the *canonical* layout LeRobot
users expect from a port: ``observation.state`` ``[S]``, ``action`` ``[A]`` in the embodiment's field order,
one camera per slot as ``observation.images.<slot>``, ``task`` = the instruction, ``robot_type`` = the
embodiment name (so our generic LeRobot key map reads it back) and the source's episode metadata per episode.
Frames the key map drops (e.g. Bridge's all-zero first step) are not written. Without a key map, every numeric
per-step field and every camera is copied as stored (``/`` in RLDS names becomes ``.``).

Every split of the source is kept (``info.json`` ``splits``: one ``"start:stop"`` episode range each, in the
source's split order), so a validation split never leaks into training. ``ConvertSummary`` says what changed:
episodes and frames per split, cameras kept and dropped (and why), frames and episodes dropped (and why).
"""

from __future__ import annotations

import logging
import shlex
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vla.data.readers import DatasetReader, open_dataset
from vla.data.writers.progress import begin, finish, prepare_destination, save_progress

log = logging.getLogger(__name__)


def _fps(reader: DatasetReader, keymap: Any | None) -> int:
    fps = reader.fps or (keymap.control_hz if keymap is not None else None)
    if not fps:
        raise ValueError(
            f"{reader.path}: the source stores no frame rate and has no key map; LeRobot needs one (add a key map entry)"
        )
    return max(1, round(float(fps)))


def writer_episode_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """The source's episode metadata, minus the columns the LeRobot writer owns (a LeRobot source's ``tasks``...)."""
    from vla.data.inspect import to_jsonable
    from vla.data.writers.lerobot import _RESERVED

    return {k: to_jsonable(v) for k, v in meta.items() if k not in _RESERVED}


@dataclass
class ConvertSummary:
    """What ``convert_dataset`` wrote: ``splits[name] = [episodes, frames]`` in the output, ``cameras`` output
    feature -> source key, ``dropped_cameras`` source key -> why, ``dropped_frames`` / ``dropped_episodes`` reason
    -> count."""

    out: Path
    source: str
    splits: dict[str, list[int]] = field(default_factory=dict)
    cameras: dict[str, str] = field(default_factory=dict)
    dropped_cameras: dict[str, str] = field(default_factory=dict)
    dropped_frames: Counter[str] = field(default_factory=Counter)
    dropped_episodes: Counter[str] = field(default_factory=Counter)
    position: int = 0  # source episodes handled (written or dropped), in conversion order

    def state(self) -> dict[str, Any]:
        """The counts as the progress record keeps them (so a resumed run reports the whole conversion)."""
        return {"position": self.position, "splits": self.splits, "dropped_frames": dict(self.dropped_frames),
                "dropped_episodes": dict(self.dropped_episodes)}  # fmt: skip

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from the counts of ``state`` (a progress record's; empty for a new conversion)."""
        self.position = int(state.get("position", 0))
        self.splits = {k: list(v) for k, v in state.get("splits", {}).items()}
        self.dropped_frames = Counter(state.get("dropped_frames", {}))
        self.dropped_episodes = Counter(state.get("dropped_episodes", {}))

    def lines(self) -> list[str]:
        """The summary as printed by ``vla data convert`` (first line: ``wrote DST``)."""
        out = [f"wrote {self.out}"]
        for split, (episodes, frames) in self.splits.items():
            out.append(f"  split {split!r}: {episodes} episodes, {frames} frames")
        for feature, key in self.cameras.items():
            out.append(f"  camera kept: {key} -> {feature}")
        for key, why in self.dropped_cameras.items():
            out.append(f"  camera dropped: {key} ({why})")
        for why, n in self.dropped_frames.items():
            out.append(f"  frames dropped: {n} ({why})")
        for why, n in self.dropped_episodes.items():
            out.append(f"  episodes skipped: {n} ({why})")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _camera_plan(reader: DatasetReader, keymap: Any | None) -> tuple[dict[str, str], dict[str, str]]:
    """(output feature -> source camera key kept, source camera key -> why it is dropped)."""
    if keymap is None:
        return {k.replace("/", "."): k for k in reader.image_keys()}, {}
    kept = {f"observation.images.{slot}": key for slot, key in keymap.cameras.items()}
    dropped = {
        key: f"no camera slot in the {keymap.embodiment!r} key map"
        for key in reader.image_keys()
        if key not in keymap.cameras.values()
    }
    return kept, dropped


def _output_features(
    reader: DatasetReader, keymap: Any | None, cameras: dict[str, str], splits: list[str], video: bool
) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The output's features (LeRobot specs) and ``robot_type``: the canonical layout of the key map's embodiment,
    or every numeric per-step field and camera as stored when there is no key map."""
    from vla.data.writers.lerobot import DEFAULT_FEATURES

    camera_dtype = "video" if video else "image"
    if keymap is None:
        features: dict[str, dict[str, Any]] = {}
        for key, f in reader.features().items():
            name = key.replace("/", ".")
            if name in DEFAULT_FEATURES:  # timestamp, frame_index, ...: the writer makes its own
                continue
            if f.kind in ("image", "video"):
                features[name] = {"dtype": camera_dtype, "shape": list(f.shape)}
            elif f.kind == "tensor" and f.dtype not in ("object", "str"):
                dtype = (
                    "float32" if f.dtype.startswith("float") else ("bool" if f.dtype == "bool" else "int64")
                )
                features[name] = {"dtype": dtype, "shape": list(f.shape) or [1]}
        return features, reader.robot_type
    from vla.embodiments import get_embodiment

    spec = get_embodiment(keymap.embodiment)
    first = next(((s, e) for s in splits for e in range(reader.num_episodes(s))), None)
    if first is None:
        raise ValueError(f"{reader.path}: no episodes in split(s) {splits}; nothing to convert")
    probe = reader.read_images(first[0], first[1], [0], list(keymap.cameras.values()))
    features = {
        "observation.state": {"dtype": "float32", "shape": [spec.state_dim], "names": spec.state_names()},
        "action": {"dtype": "float32", "shape": [spec.action_dim], "names": spec.action_names()},
    }
    for name, key in cameras.items():
        features[name] = {"dtype": camera_dtype, "shape": list(probe[key].shape[1:])}
    return features, keymap.embodiment


def _resume_command(src: str | Path, dst: Path, settings: dict[str, Any]) -> str:
    """The ``vla data convert`` command line that runs (or resumes) this conversion from any folder."""
    args = ["vla", "data", "convert", str(Path(src).resolve()), str(dst.resolve()), "--to", settings["to"]]
    if settings["vcodec"] != "av1":
        args += ["--vcodec", settings["vcodec"]]
    if not settings["video"]:
        args.append("--no-video")
    if settings["max_episodes"] is not None:
        args += ["--max-episodes", str(settings["max_episodes"])]
    if settings["split"] is not None:
        args += ["--split", settings["split"]]
    return shlex.join(args)


def _convert_episode(
    reader: DatasetReader,
    split: str,
    episode: int,
    keymap: Any | None,
    cameras: dict[str, str],
    features: dict[str, dict[str, Any]],
    summary: ConvertSummary,
) -> tuple[dict[str, np.ndarray], list[str] | str] | None:
    """One source episode as output frames ``{feature: [T, *shape]}`` and its task strings (None when the key map
    leaves no frame of it); ``summary`` counts what was dropped."""
    if keymap is None:
        return _frames_as_stored(reader, split, episode, features)
    from vla.data.standardize import standardize_episode

    std = standardize_episode(reader, split, episode, keymap)
    summary.dropped_frames.update(std.metadata.get("dropped", {}))
    if len(std.frames) == 0:
        why = "no frames left after standardization"
        log.info("%s: %s episode %d: %s; skipped", reader.path, split, episode, why)
        summary.dropped_episodes[why] += 1
        return None
    imgs = reader.read_images(split, episode, std.frames.tolist(), list(keymap.cameras.values()))
    frames = {"observation.state": std.state, "action": std.action}
    frames |= {name: imgs[key] for name, key in cameras.items()}
    return frames, list(std.prompt)


def convert_dataset(
    src: str | Path,
    dst: str | Path,
    *,
    to: str = "lerobot",
    video: bool = True,
    vcodec: str = "av1",
    max_episodes: int | None = None,
    split: str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> ConvertSummary:
    """Convert ``src`` into a LeRobot v3.0 dataset at ``dst``; returns what was written (``ConvertSummary``).

    ``dst`` must not exist yet (or be an empty folder), or hold the output of this same call: one that was
    interrupted resumes where it stopped and gives the same files an uninterrupted run gives (until it finishes,
    the dataset is marked incomplete, see ``vla.data.writers.progress``); a finished one is left as it is and its
    summary returned. ``overwrite`` replaces an existing dataset there. Every split is kept (``split`` restricts to one); ``max_episodes`` caps the episodes
    over all splits. ``progress``: a progress bar on stderr (``None``: only when stderr is a terminal).
    """
    if to != "lerobot":
        raise ValueError(f"--to {to!r}: only 'lerobot' (LeRobot v3.0) is supported")
    from tqdm import tqdm

    from vla.data.standardize import keymap_for
    from vla.data.writers.lerobot import LeRobotWriter

    dst = Path(dst)
    reader = open_dataset(src)
    if reader.incomplete:
        raise ValueError(
            f"{src} is incomplete: `{reader.incomplete}` was interrupted; re-run it to finish it, then convert"
        )
    prepare_destination(dst, overwrite)
    settings = {"source": str(Path(src).resolve()), "to": to, "video": video, "vcodec": vcodec,
                "max_episodes": max_episodes, "split": split}  # fmt: skip
    record = begin(
        dst,
        _resume_command(src, dst, settings),
        settings,
        replace_hint=" (or pass --overwrite to replace it)",
    )
    keymap = keymap_for(reader)
    splits = [split] if split else reader.splits()
    cameras, dropped_cameras = _camera_plan(reader, keymap)
    features, robot_type = _output_features(reader, keymap, cameras, splits, video)
    summary = ConvertSummary(dst, str(src), cameras=cameras, dropped_cameras=dropped_cameras)
    summary.restore(record.state)
    todo = [(s, e) for s in splits for e in range(reader.num_episodes(s))][:max_episodes]
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(
        total=len(todo), initial=summary.position, desc=f"convert {reader.name}", unit="ep", disable=not show
    )
    with LeRobotWriter(dst, _fps(reader, keymap), features, robot_type=robot_type, video=video, vcodec=vcodec,
                       mode="append") as writer:  # fmt: skip
        writer.progress = record  # committed with each episode: a re-run resumes after the last one on disk
        for s, ep in todo[summary.position :]:
            converted = _convert_episode(reader, s, ep, keymap, cameras, features, summary)
            summary.position += 1
            if converted is not None:
                frames, tasks = converted
                counts = summary.splits.setdefault(s, [0, 0])
                counts[0], counts[1] = counts[0] + 1, counts[1] + len(next(iter(frames.values())))
            record.state = summary.state()
            if converted is None:
                save_progress(dst, record)
            else:
                meta = {"source_split": s, "source_episode": ep,
                        **writer_episode_metadata(reader.episode_metadata(s, ep))}  # fmt: skip
                writer.add_episode(frames, tasks, meta, split=s)
            bar.update(1)
    bar.close()
    if not summary.splits:
        raise ValueError(
            f"{src}: no episode was converted ({dict(summary.dropped_episodes) or 'no episodes'})"
        )
    finish(dst, record)
    return summary


def _frames_as_stored(
    reader: DatasetReader, split: str, episode: int, features: dict[str, dict[str, Any]]
) -> tuple[dict[str, np.ndarray], list[str] | str]:
    """Every feature of one episode copied as stored (no key map): ``{name: [T, *shape]}`` and its task strings."""
    feats = reader.features()
    raw = reader.read_episode(split, episode)
    imgs = reader.read_images(split, episode, list(range(raw.length)), reader.image_keys())
    frames = {}
    for key in feats:
        name = key.replace("/", ".")
        if name not in features:
            continue
        value = imgs[key] if key in imgs else raw.steps[key]
        frames[name] = np.asarray(value).reshape(raw.length, *features[name]["shape"])
    text = next(
        (
            raw.steps[k]
            for k, f in feats.items()
            if f.kind == "string" and ("instruction" in k or k == "task")
        ),
        None,
    )
    return frames, [str(t) for t in text] if text is not None else "unknown task"
