"""One episode in LeRobot 0.6's stored forms: parquet rows, per-feature statistics and encoded camera streams.

Parquet: LeRobot's column types (``fixed_size_list<float32>[D]`` vectors, scalars for shape ``(1,)``, PNG
``{bytes, path}`` structs for image features) plus the Hugging Face ``datasets`` schema metadata, one row group
per episode.

Stats (``meta/stats.json``, ``stats/*`` episode columns) per episode: min/max/mean/std/count and quantiles
q01/q10/q50/q90/q99 from a 5000-bin histogram between the episode's min and max (LeRobot's
``RunningQuantileStats`` on one batch). Cameras: per-channel stats of up to 100+ evenly sampled frames
(downsampled when a side is >= 300 px), divided by 255, shape ``(3, 1, 1)``. Across episodes: count-weighted
means, pooled variance, min of mins, max of maxes, count-weighted quantiles.

Videos: ``encode_episode`` turns an episode's camera frames into one MP4 per camera plus their stats, the costly
part of a commit. It needs nothing from the dataset, so it runs wherever the frames are (a simulation worker);
``LeRobotWriter.add_encoded_episode`` then only concatenates streams and writes metadata.
"""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def _hf_feature(dtype: str, shape: Sequence[int]) -> dict[str, Any]:
    """Hugging Face ``datasets`` feature JSON (stored in the parquet schema metadata, as LeRobot writes it)."""
    if dtype == "image":
        return {"_type": "Image"}
    spec: dict[str, Any] = {"dtype": dtype, "_type": "Value"}
    for n in reversed([] if list(shape) == [1] else list(shape)):
        spec = {"feature": spec, "length": n, "_type": "List"}
    return spec


def _arrow_column(values: np.ndarray, ft: dict[str, Any]) -> pa.Array:
    if ft["dtype"] == "image":
        from PIL import Image

        cells = []
        for image in values:
            buf = io.BytesIO()
            Image.fromarray(image).save(buf, format="PNG", compress_level=1)
            cells.append(buf.getvalue())
        return pa.StructArray.from_arrays(
            [pa.array(cells, pa.binary()), pa.nulls(len(cells), pa.string())], ["bytes", "path"]
        )
    shape = [] if list(ft["shape"]) == [1] else list(ft["shape"])
    arr: pa.Array = pa.array(np.ascontiguousarray(values, dtype=ft["dtype"]).reshape(-1))
    for n in reversed(shape):
        arr = pa.FixedSizeListArray.from_arrays(arr, n)
    return arr


def data_table(columns: dict[str, np.ndarray], features: dict[str, dict[str, Any]]) -> pa.Table:
    """One episode's parquet rows: every non-video feature, LeRobot's column types and HF schema metadata."""
    keys = [k for k, ft in features.items() if ft["dtype"] != "video"]
    hf = {"info": {"features": {k: _hf_feature(features[k]["dtype"], features[k]["shape"]) for k in keys}}}
    table = pa.table({k: _arrow_column(columns[k], features[k]) for k in keys})
    return table.replace_schema_metadata({"huggingface": json.dumps(hf)})


def write_parquet(tables: list[pa.Table], path: Path) -> None:
    """One row group per table (= per episode, as LeRobot writes), schema of the last table."""
    schema = tables[-1].schema
    with pq.ParquetWriter(path, schema, compression="snappy", use_dictionary=True) as writer:
        for t in tables:
            writer.write_table(t.cast(schema) if t.schema != schema else t)


QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
NUM_BINS = 5000


def _quantile(cumsum: np.ndarray, edges: np.ndarray, target: float) -> float:
    idx = int(np.searchsorted(cumsum, target))
    if idx == 0:
        return float(edges[0])
    if idx >= len(cumsum):
        return float(edges[-1])
    before = cumsum[idx - 1]
    in_bin = cumsum[idx] - before
    if in_bin == 0:
        return float(edges[idx])
    return float(edges[idx] + (target - before) / in_bin * (edges[idx + 1] - edges[idx]))


def array_stats(x: np.ndarray) -> dict[str, np.ndarray]:
    """Stats of ``x`` ``[N, D]`` over N: each ``[D]``, plus ``count`` ``[1]``."""
    # same dtype promotion (and so the same float32 edge rounding) as LeRobot
    x = x.astype(np.result_type(x.dtype, np.float32), copy=False)
    n = len(x)
    if n < 2:
        mean = np.mean(x, axis=0)
        out = {"min": np.min(x, axis=0), "max": np.max(x, axis=0), "mean": mean, "std": np.std(x, axis=0)}
        return out | {"count": np.array([n])} | {f"q{int(q * 100):02d}": mean.copy() for q in QUANTILES}
    mean, mean_sq = np.mean(x, axis=0), np.mean(x**2, axis=0)
    lo, hi = np.min(x, axis=0), np.max(x, axis=0)
    quantiles = np.empty((len(QUANTILES), x.shape[1]))
    for d in range(x.shape[1]):
        edges = np.linspace(lo[d] - 1e-10, hi[d] + 1e-10, NUM_BINS + 1)
        cumsum = np.cumsum(np.histogram(x[:, d], bins=edges)[0].astype(np.float64))
        quantiles[:, d] = [_quantile(cumsum, edges, q * n) for q in QUANTILES]
    out = {
        "min": lo,
        "max": hi,
        "mean": mean,
        "std": np.sqrt(np.maximum(0, mean_sq - mean**2)),
        "count": np.array([n]),
    }
    return out | {f"q{int(q * 100):02d}": quantiles[i] for i, q in enumerate(QUANTILES)}


def sample_indices(length: int) -> list[int]:
    """LeRobot's evenly spaced frame sample for image stats (all frames below 100, then ~length**0.75)."""
    low = min(100, length)
    num = max(low, min(int(length**0.75), 10_000))
    return np.round(np.linspace(0, length - 1, num)).astype(int).tolist()


def image_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel stats of uint8 frames ``[T, H, W, C]`` in [0, 1]: each ``[C, 1, 1]``, count = sampled frames."""
    sampled = frames[sample_indices(len(frames))]
    h, w = sampled.shape[1:3]
    if max(h, w) >= 300:
        step = int(w / 150) if w > h else int(h / 150)
        sampled = sampled[:, ::step, ::step]
    stats = array_stats(sampled.reshape(-1, sampled.shape[-1]))
    return {k: v if k == "count" else (v / 255.0).reshape(-1, 1, 1) for k, v in stats.items()} | {
        "count": np.array([len(sampled)])
    }


def episode_stats(
    columns: dict[str, np.ndarray], features: dict[str, dict[str, Any]]
) -> dict[str, dict[str, np.ndarray]]:
    """Stats of every feature of one episode (``columns[key]`` is ``[T, *shape]``)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, ft in features.items():
        values = columns[key]
        if ft["dtype"] in ("image", "video"):
            out[key] = image_stats(values)
        elif ft["dtype"] != "string":
            out[key] = array_stats(values.reshape(len(values), -1))
    return out


def aggregate_stats(stats_list: list[dict[str, dict[str, np.ndarray]]]) -> dict[str, dict[str, np.ndarray]]:
    """Combine per-episode (or per-dataset) stats as LeRobot's ``aggregate_stats`` does."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key in dict.fromkeys(k for stats in stats_list for k in stats):
        parts = [s[key] for s in stats_list if key in s]
        means = np.stack([p["mean"] for p in parts])
        counts = np.stack([p["count"] for p in parts])
        total = counts.sum(axis=0)
        while counts.ndim < means.ndim:
            counts = np.expand_dims(counts, -1)
        mean = (means * counts).sum(axis=0) / total
        var = ((np.stack([p["std"] ** 2 for p in parts]) + (means - mean) ** 2) * counts).sum(axis=0) / total
        agg = {
            "min": np.min(np.stack([p["min"] for p in parts]), axis=0),
            "max": np.max(np.stack([p["max"] for p in parts]), axis=0),
            "mean": mean,
            "std": np.sqrt(var),
            "count": total,
        }
        for q in (k for k in parts[0] if k.startswith("q") and k[1:].isdigit()):
            if all(q in p for p in parts):
                agg[q] = (np.stack([p[q] for p in parts]) * counts).sum(axis=0) / total
        out[key] = agg
    return out


@dataclass
class EncodedEpisode:
    """An episode whose camera streams are encoded (``encode_episode``), ready for ``add_encoded_episode``.

    ``frames``: every non-video feature, ``[T, *shape]``; ``videos``: video key -> the episode's MP4 (frame ``i`` at
    ``i / fps``); ``video_stats``: video key -> ``image_stats`` of its frames; ``encoder``: the encoder that made
    the MP4s (``libsvtav1``, ``libx264``, ...), which must be the dataset's for stream-copy concatenation.
    """

    length: int
    frames: dict[str, np.ndarray]
    videos: dict[str, bytes]
    video_stats: dict[str, dict[str, np.ndarray]]
    encoder: str
    fps: float


def encode_episode(
    frames: dict[str, np.ndarray],
    video_keys: Sequence[str],
    fps: float,
    *,
    vcodec: str = "av1",
    crf: int | None = None,
    gop: int | None = None,
    preset: int | str | None = None,
) -> EncodedEpisode:
    """Encode ``frames[key]`` (uint8 ``[T, H, W, 3]``) of each of ``video_keys``; other features pass through."""
    from vla.data import video

    length = len(next(iter(frames.values())))
    encoder = video.available_encoder(vcodec)
    options = {
        "crf": video.DEFAULT_CRF if crf is None else crf,
        "gop": video.DEFAULT_GOP if gop is None else gop,
    }
    videos: dict[str, bytes] = {}
    stats: dict[str, dict[str, np.ndarray]] = {}
    with tempfile.TemporaryDirectory(prefix="vla-episode-") as tmp:
        for key in video_keys:
            images = np.asarray(frames[key])
            if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3 or len(images) != length:
                raise ValueError(
                    f"episode: {key!r} must be uint8 [{length}, H, W, 3], got {images.dtype} {images.shape}"
                )
            path = Path(tmp) / "episode.mp4"
            video.encode_video(images, path, fps, vcodec=encoder, preset=preset, **options)
            videos[key], stats[key] = path.read_bytes(), image_stats(images)
    rest = {k: np.asarray(v) for k, v in frames.items() if k not in videos}
    return EncodedEpisode(length, rest, videos, stats, encoder, float(fps))
