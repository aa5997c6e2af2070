"""``vla data preview``: render one episode so a person can look at it.

Each output frame shows every camera side by side (resized to a common height, each labelled with its name) and,
under them, the episode's state and action traces (matplotlib, drawn once; one line per dim, named in a legend)
with a cursor at the current step. MP4 (H.264 via PyAV) or GIF.

With a registered key map the preview shows what training sees, so a raw dataset and its ``vla data convert``
output look the same: cameras in camera-slot order labelled ``slot (stored key)`` (cameras without a slot follow,
marked unmapped), and the standardized state and action with the embodiment spec's dim names, at the raw frames
the key map keeps. Without one, every camera and every state/action-like field as stored.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vla.data.readers import DatasetReader, open_dataset
from vla.data.transforms import resize_images

CAMERA_HEIGHT = 192
CHUNK = 32  # frames decoded per read_images call (the composed preview frames are all kept until written)


#: A trace: (raw frame indices ``[T]``, values ``[T, D]``, one name per dim).
Trace = tuple[np.ndarray, np.ndarray, list[str]]


def _lowdim_traces(steps: dict[str, np.ndarray], names: dict[str, list[str]]) -> dict[str, Trace]:
    """The state- and action-like numeric fields of an episode as stored (``names``: dim names per field)."""
    out = {}
    for key, arr in steps.items():
        if arr.dtype.kind not in "fiub" or arr.dtype == object:
            continue
        low = key.lower()
        if any(w in low for w in ("state", "action", "position", "velocity", "proprio", "joint", "gripper")):
            a = arr.reshape(len(arr), -1).astype(np.float64)
            if a.shape[1] <= 32:
                dims = names.get(key) or []
                dims = dims if len(dims) == a.shape[1] else [f"{key}[{d}]" for d in range(a.shape[1])]
                out[key] = (np.arange(len(a)), a, [str(d) for d in dims])
    return out


def _feature_names(reader: DatasetReader) -> dict[str, list[str]]:
    """Per-dim names a LeRobot dataset declares (``info.json`` features' ``names``), when it does."""
    info = reader.lerobot_info() if hasattr(reader, "lerobot_info") else {}
    out = {}
    for key, ft in (info.get("features") or {}).items():
        names = ft.get("names")
        if isinstance(names, dict):  # LeRobot v2 style {"motors": [...]}
            names = next(iter(names.values()), None)
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            out[key] = names
    return out


def episode_content(
    reader: DatasetReader, split: str, episode: int, steps: dict[str, np.ndarray]
) -> tuple[list[tuple[str, str]], dict[str, Trace]]:
    """What the preview shows: cameras as ``(label, stored key)`` in display order, and the traces by title."""
    from vla.data.standardize import keymap_for, standardize_episode

    keymap = keymap_for(reader)
    if keymap is None:
        return [(k, k) for k in reader.image_keys()], _lowdim_traces(steps, _feature_names(reader))
    from vla.embodiments import get_embodiment

    std = standardize_episode(reader, split, episode, keymap)
    spec = get_embodiment(keymap.embodiment)
    cameras = [(f"{slot} ({key})", key) for slot, key in keymap.cameras.items()]
    cameras += [
        (f"{key} (unmapped)", key) for key in reader.image_keys() if key not in keymap.cameras.values()
    ]
    traces = {
        f"{keymap.embodiment} state": (std.frames, std.state.astype(np.float64), spec.state_names()),
        f"{keymap.embodiment} action": (std.frames, std.action.astype(np.float64), spec.action_names()),
    }
    return cameras, traces


def _label(image: np.ndarray, text: str) -> np.ndarray:
    """``image`` (uint8 ``[H, W, 3]``) with ``text`` on a dark strip along its top edge."""
    from PIL import Image, ImageDraw

    im = Image.fromarray(image)
    draw = ImageDraw.Draw(im)
    draw.rectangle((0, 0, im.width, 12), fill=(0, 0, 0))
    draw.text((3, 1), text, fill=(255, 255, 255))
    return np.asarray(im)


def _plot_panel(traces: dict[str, Trace], width: int, fps: float) -> tuple[np.ndarray, float, float]:
    """Render the traces once; returns (RGB uint8 [h, width, 3], x pixel of t=0, pixels per second)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(traces))
    dpi = 100
    fig, axes = plt.subplots(n, 1, figsize=(width / dpi, 1.6 * n), dpi=dpi, sharex=True, squeeze=False)
    length = max((int(f[-1]) + 1 for f, _, _ in traces.values() if len(f)), default=1)
    t = np.arange(length) / fps
    for ax, (key, (frames, arr, names)) in zip(axes[:, 0], traces.items()):
        for d in range(arr.shape[1]):
            ax.plot(frames / fps, arr[:, d], linewidth=1, label=names[d])
        ax.set_title(key, fontsize=7, loc="left")
        ax.legend(fontsize=5, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False,
                  ncol=1 + arr.shape[1] // 9)  # fmt: skip
        ax.tick_params(labelsize=6)
    axes[-1, 0].set_xlabel("time [s]", fontsize=7)
    axes[0, 0].set_xlim(0, max(t[-1], 1e-3))
    fig.tight_layout()
    fig.canvas.draw()
    img = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    ax = axes[0, 0]
    x0 = ax.transData.transform((0.0, 0.0))[0]
    x1 = ax.transData.transform((max(t[-1], 1e-3), 0.0))[0]
    plt.close(fig)
    scale = img.shape[1] / (width or img.shape[1])
    return img, x0 / scale, (x1 - x0) / scale / max(t[-1], 1e-3)


def preview_episode(
    path: str | Path, out: str | Path, *, split: str | None = None, episode: int = 0, fps: float | None = None
) -> Path:
    """Write ``out`` (.mp4 or .gif) showing ``episode`` of the dataset at ``path``; returns the path."""
    out = preview_path(out)
    reader = open_dataset(path)
    splits = reader.splits()
    split = split or ("train" if "train" in splits else splits[0])
    if split not in splits:
        raise ValueError(f"{reader.path}: no split {split!r}; available: {splits}")
    if not 0 <= episode < reader.num_episodes(split):
        raise IndexError(
            f"{reader.path}: --episode {episode} out of range (split {split!r} has {reader.num_episodes(split)})"
        )
    if not fps:
        from vla.data.standardize import keymap_for

        keymap = keymap_for(reader)
        fps = reader.fps or (keymap.control_hz if keymap is not None else None) or 10.0
    ep = reader.read_episode(split, episode)
    cameras, traces = episode_content(reader, split, episode, ep.steps)
    keys = [key for _, key in cameras]

    frames: list[np.ndarray] = []
    panel = None
    for start in range(0, ep.length, CHUNK):
        idx = list(range(start, min(start + CHUNK, ep.length)))
        imgs = reader.read_images(split, episode, idx, keys) if keys else {}
        for j, _ in enumerate(idx):
            row = [
                _label(
                    np.asarray(
                        resize_images(
                            imgs[key][j : j + 1],
                            (
                                CAMERA_HEIGHT,
                                max(1, round(imgs[key].shape[2] * CAMERA_HEIGHT / imgs[key].shape[1])),
                            ),
                        )
                    )[0],
                    label,
                )
                for label, key in cameras
            ] or [np.zeros((CAMERA_HEIGHT, CAMERA_HEIGHT, 3), np.uint8)]
            frames.append(np.concatenate(row, axis=1))
    width = frames[0].shape[1]
    if traces:
        panel, x0, px_per_s = _plot_panel(traces, width, fps)
        panel = np.asarray(resize_images(panel[None], (panel.shape[0], width)))[0]
    composed = []
    for i, top in enumerate(frames):
        if panel is None:
            composed.append(top)
            continue
        bottom = panel.copy()
        x = round(x0 + i / fps * px_per_s)
        bottom[:, max(0, x - 1) : x + 1] = (220, 30, 30)
        composed.append(np.concatenate([top, bottom], axis=0))
    return write_preview(out, composed, fps)


def preview_path(out: str | Path) -> Path:
    """``out`` as a Path, or a clear error when it is not a .mp4/.gif file (checked before any work is done)."""
    out = Path(out)
    if out.suffix.lower() not in (".mp4", ".gif"):
        raise ValueError(f"--out {out}: the preview must be a .mp4 or .gif file")
    return out


def write_preview(out: str | Path, frames: list[np.ndarray], fps: float) -> Path:
    """Write uint8 ``[H, W, 3]`` frames as a GIF (Pillow) or an H.264 MP4; shared by data and sim previews."""
    out = preview_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".gif":
        from PIL import Image

        ims = [Image.fromarray(f) for f in frames]
        ims[0].save(out, save_all=True, append_images=ims[1:], duration=int(1000 / fps), loop=0)
        return out
    from vla.data.video_encode import VideoEncoder

    h, w = frames[0].shape[:2]
    h2, w2 = h - h % 2, w - w % 2  # yuv420p needs even sizes
    # x264's own defaults (keyframe every 250, CRF 23): a preview is watched front to back, not random-accessed
    encoder = VideoEncoder(out, fps, h2, w2, vcodec="h264", gop=250, crf=23)
    for f in frames:
        encoder.write(np.ascontiguousarray(f[:h2, :w2]))
    encoder.close()
    return out
