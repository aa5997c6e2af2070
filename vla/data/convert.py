"""``vla data convert SRC DST --to lerobot``: any readable dataset -> LeRobot v3.0.

With a registered key map (every OXE/DROID dataset, our sim sets) the output is the *canonical* layout LeRobot
users expect from a port: ``observation.state`` ``[S]``, ``action`` ``[A]`` in the embodiment's field order,
one camera per slot as ``observation.images.<slot>``, ``task`` = the instruction, ``robot_type`` = the
embodiment name (so our generic LeRobot key map reads it back) and the source's episode metadata per episode.
Frames the key map drops (e.g. Bridge's all-zero first step) are not written. Without a key map, every numeric
per-step field and every camera is copied as stored (``/`` in RLDS names becomes ``.``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from vla.data.readers import DatasetReader, open_dataset

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


def convert_dataset(
    src: str | Path,
    dst: str | Path,
    *,
    to: str = "lerobot",
    video: bool = True,
    vcodec: str = "av1",
    max_episodes: int | None = None,
    split: str | None = None,
) -> Path:
    """Convert ``src`` into a LeRobot v3.0 dataset at ``dst`` (which must not exist yet); returns ``dst``.

    All splits are concatenated (LeRobot stores one episode list); ``split`` restricts to one.
    """
    if to != "lerobot":
        raise ValueError(f"--to {to!r}: only 'lerobot' (LeRobot v3.0) is supported")
    from vla.data.standardize import keymap_for, standardize_episode
    from vla.data.writers.lerobot import DEFAULT_FEATURES, LeRobotWriter

    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        what = (
            "holds a dataset"
            if (dst / "meta" / "info.json").exists()
            else "exists and is not an empty folder"
        )
        raise FileExistsError(f"{dst} {what}; choose a new destination or delete it first")
    reader = open_dataset(src)
    keymap = keymap_for(reader)
    splits = [split] if split else reader.splits()
    feats = reader.features()
    if keymap is not None:
        from vla.embodiments import get_embodiment

        spec = get_embodiment(keymap.embodiment)
        first = next(((s, e) for s in splits for e in range(reader.num_episodes(s))), None)
        if first is None:
            raise ValueError(f"{reader.path}: no episodes in split(s) {splits}; nothing to convert")
        probe = reader.read_images(first[0], first[1], [0], list(keymap.cameras.values()))
        features: dict[str, dict[str, Any]] = {
            "observation.state": {"dtype": "float32", "shape": [spec.state_dim], "names": spec.state_names()},
            "action": {"dtype": "float32", "shape": [spec.action_dim], "names": spec.action_names()},
        }
        for slot, key in keymap.cameras.items():
            features[f"observation.images.{slot}"] = {
                "dtype": "video" if video else "image",
                "shape": list(probe[key].shape[1:]),
            }
        robot_type = keymap.embodiment
    else:
        features = {}
        for key, f in feats.items():
            name = key.replace("/", ".")
            if name in DEFAULT_FEATURES:  # timestamp, frame_index, ...: the writer makes its own
                continue
            if f.kind in ("image", "video"):
                features[name] = {"dtype": "video" if video else "image", "shape": list(f.shape)}
            elif f.kind == "tensor" and f.dtype not in ("object", "str"):
                dtype = (
                    "float32" if f.dtype.startswith("float") else ("bool" if f.dtype == "bool" else "int64")
                )
                features[name] = {"dtype": dtype, "shape": list(f.shape) or [1]}
        robot_type = reader.robot_type
    written = 0
    with LeRobotWriter(
        dst, _fps(reader, keymap), features, robot_type=robot_type, video=video, vcodec=vcodec, mode="create"
    ) as writer:
        for s in splits:
            for ep in range(reader.num_episodes(s)):
                if max_episodes is not None and written >= max_episodes:
                    break
                meta = {
                    "source_split": s,
                    "source_episode": ep,
                    **writer_episode_metadata(reader.episode_metadata(s, ep)),
                }
                if keymap is not None:
                    std = standardize_episode(reader, s, ep, keymap)
                    if len(std.frames) == 0:
                        log.warning(
                            "%s: %s episode %d keeps no frames after standardization; skipped", src, s, ep
                        )
                        continue
                    imgs = reader.read_images(s, ep, std.frames.tolist(), list(keymap.cameras.values()))
                    frames = {"observation.state": std.state, "action": std.action}
                    frames |= {
                        f"observation.images.{slot}": imgs[key] for slot, key in keymap.cameras.items()
                    }
                    tasks: list[str] | str = list(std.prompt)
                else:
                    raw = reader.read_episode(s, ep)
                    idx = list(range(raw.length))
                    imgs = reader.read_images(s, ep, idx, reader.image_keys())
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
                    tasks = [str(t) for t in text] if text is not None else "unknown task"
                writer.add_episode(frames, tasks, meta)
                written += 1
    if written == 0:
        raise ValueError(f"{src}: no episode was converted (all empty after standardization?)")
    return dst
