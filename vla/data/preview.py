"""``vla data preview``: render one episode so a person can look at it.

Each output frame shows every camera side by side (resized to a common height) and, under them, the episode's
state and action traces (matplotlib, drawn once) with a cursor at the current step. MP4 (H.264 via PyAV) or GIF.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vla.data.readers import open_dataset
from vla.data.transforms import resize_images

CAMERA_HEIGHT = 192
CHUNK = 32  # frames decoded per read_images call (the composed preview frames are all kept until written)


def _lowdim_traces(steps: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The state- and action-like numeric fields of an episode, as float ``[T, D]`` arrays."""
    out = {}
    for key, arr in steps.items():
        if arr.dtype.kind not in "fiub" or arr.dtype == object:
            continue
        low = key.lower()
        if any(w in low for w in ("state", "action", "position", "velocity", "proprio", "joint", "gripper")):
            a = arr.reshape(len(arr), -1).astype(np.float64)
            if a.shape[1] <= 32:
                out[key] = a
    return out


def _plot_panel(traces: dict[str, np.ndarray], width: int, fps: float) -> tuple[np.ndarray, float, float]:
    """Render the traces once; returns (RGB uint8 [h, width, 3], x pixel of t=0, pixels per second)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(traces))
    dpi = 100
    fig, axes = plt.subplots(n, 1, figsize=(width / dpi, 1.6 * n), dpi=dpi, sharex=True, squeeze=False)
    length = max((len(v) for v in traces.values()), default=1)
    t = np.arange(length) / fps
    for ax, (key, arr) in zip(axes[:, 0], traces.items()):
        for d in range(arr.shape[1]):
            ax.plot(t[: len(arr)], arr[:, d], linewidth=1)
        ax.set_ylabel(key, fontsize=7, rotation=0, ha="right", va="center")
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
    keys = reader.image_keys()
    traces = _lowdim_traces(ep.steps)

    frames: list[np.ndarray] = []
    panel = None
    for start in range(0, ep.length, CHUNK):
        idx = list(range(start, min(start + CHUNK, ep.length)))
        imgs = reader.read_images(split, episode, idx, keys) if keys else {}
        for j, _ in enumerate(idx):
            row = [
                np.asarray(
                    resize_images(
                        v[j : j + 1], (CAMERA_HEIGHT, max(1, round(v.shape[2] * CAMERA_HEIGHT / v.shape[1])))
                    )
                )[0]
                for v in imgs.values()
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
