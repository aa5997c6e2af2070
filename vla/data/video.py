"""MP4 video decoding for datasets (PyAV): exact random access to frames; encoding re-exported from ``video_encode``.

Decoding keeps one open container per file *per process* (re-opened after a DataLoader fork), indexes every
packet once (pts, keyframe, file offset), and serves frames by feeding packets from the nearest preceding
keyframe straight to the decoder; a decoder that is already positioned inside the right GOP simply continues
forward, so frames of one episode requested in ascending order cost one forward pass. Decoded frames go to a
per-process LRU (``VLA_VIDEO_CACHE_MB``, default 256) and are converted to RGB only when asked for.

Encoding (``VideoEncoder``, ``encode_video``, ``concat_videos``, ``cut_video``, ``stream_signature``; AV1 or
H.264 with LeRobot's settings) lives in ``vla.data.video_encode`` and is re-exported here, so
``from vla.data import video`` covers both directions.
"""

from __future__ import annotations

import bisect
import mmap
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from vla.data.readers.base import DatasetFormatError
from vla.data.video_encode import (
    DEFAULT_CRF,
    DEFAULT_GOP,
    ENCODERS,
    VideoEncoder,
    available_encoder,
    concat_videos,
    cut_video,
    encode_video,
    encoder_options,
    stream_signature,
)

__all__ = [
    "DEFAULT_CRF",
    "DEFAULT_GOP",
    "ENCODERS",
    "VideoDecoder",
    "VideoEncoder",
    "available_encoder",
    "close_decoder",
    "close_decoders",
    "concat_videos",
    "cut_video",
    "decode_frames",
    "encode_video",
    "encoder_options",
    "get_decoder",
    "probe_video",
    "stream_signature",
]


def probe_video(path: str | Path) -> dict[str, Any]:
    """Stream facts in LeRobot's ``info.json`` vocabulary (``video.height``, ``video.codec``, ...)."""
    with _open_container(Path(path), "") as container:
        stream = container.streams.video[0]
        return {
            "video.height": stream.height,
            "video.width": stream.width,
            "video.codec": stream.codec_context.codec.canonical_name,
            "video.pix_fmt": stream.codec_context.pix_fmt,
            "video.fps": float(stream.average_rate) if stream.average_rate else None,
            "video.channels": 3,
            "has_audio": bool(container.streams.audio),
            "frames": stream.frames,
            "duration_s": float(stream.duration * stream.time_base) if stream.duration else None,
        }


# ---- decoding ---------------------------------------------------------------------------------------------
def _open_container(path: Path, context: str) -> Any:
    try:
        container = av.open(str(path))
    except FileNotFoundError as e:
        raise DatasetFormatError(
            f"{path}{context}: video file missing; re-download the dataset's videos/"
        ) from e
    except av.error.FFmpegError as e:
        raise DatasetFormatError(
            f"{path}{context}: cannot open video ({e}); the file is corrupt or truncated, re-encode or re-download it"
        ) from e
    if not container.streams.video:
        container.close()
        raise DatasetFormatError(
            f"{path}{context}: no video stream in file (corrupt?); re-encode or re-download it"
        )
    return container


class _FrameCache:
    """LRU of decoded frames keyed by ``(decoder id, frame index)``; values are ``av.VideoFrame`` or RGB arrays."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self._items: OrderedDict[tuple[int, int], tuple[Any, int]] = OrderedDict()

    def get(self, key: tuple[int, int]) -> Any:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: tuple[int, int], value: Any, nbytes: int) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._items[key] = (value, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes and len(self._items) > 1:
            self.bytes -= self._items.popitem(last=False)[1][1]


def file_identity(path: Path) -> tuple[int, int, int, int] | None:
    """(device, inode, size, mtime ns) of ``path``, None when it cannot be stat'ed: changes when the file is
    replaced (renamed over, rewritten), so an open decoder and its cached frames are not served for new content."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class VideoDecoder:
    """Random access to the frames of one MP4 file (one video stream). Create through :func:`get_decoder`."""

    _next_uid = 0

    def __init__(self, path: str | Path, cache: _FrameCache, threads: int = 1) -> None:
        self.path, self._cache = Path(path), cache
        self.identity = file_identity(self.path)  # what was opened: a replaced file is reopened (get_decoder)
        VideoDecoder._next_uid += 1
        self._uid = VideoDecoder._next_uid
        self._container = _open_container(self.path, "")
        stream = self._container.streams.video[0]
        stream.codec_context.thread_count = threads
        self._codec = stream.codec_context
        self._reformatter = VideoReformatter()  # one shared swscale context: a fresh one per frame costs ~5x
        self.height, self.width, self._time_base = stream.height, stream.width, stream.time_base
        try:
            packets = [
                (p.pts if p.pts is not None else p.dts, p.dts, p.is_keyframe, p.pos, p.size)
                for p in self._container.demux(stream)
                if p.size
            ]
        except av.error.FFmpegError as e:
            raise DatasetFormatError(
                f"{self.path}: cannot read video packets ({e}); re-encode or re-download it"
            ) from e
        if not packets or any(p[0] is None for p in packets):
            raise DatasetFormatError(
                f"{self.path}: video has no (timestamped) packets; re-encode or re-download it"
            )
        self._packets = packets  # decode order
        pts = np.array([p[0] for p in packets], dtype=np.int64)
        order = np.argsort(pts, kind="stable")
        self._decode_index = order  # presentation index -> decode index
        self._pts = pts[order]  # presentation order
        self.times = self._pts.astype(np.float64) * float(self._time_base)  # [num_frames] seconds
        self._times_list = self.times.tolist()
        self._pts_to_frame = {int(p): i for i, p in enumerate(self._pts)}
        keyframe = np.array([p[2] for p in packets], dtype=bool)
        keyframe[0] = True  # decode must start somewhere; a non-key first packet is decoded as best it can
        self._gop_start = np.maximum.accumulate(np.where(keyframe, np.arange(len(packets)), 0))
        with open(self.path, "rb") as f:
            self._data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if any(p[3] < 0 or p[3] + p[4] > len(self._data) for p in packets):
            raise DatasetFormatError(
                f"{self.path}: packet offsets outside the file (truncated?); re-encode or re-download it"
            )
        self._next: int | None = None  # next packet (decode order) to feed; None -> decoder must restart
        self._last_pts = -(2**62)  # last presentation timestamp the decoder emitted since its last flush

    @property
    def num_frames(self) -> int:
        return len(self._pts)

    def frame_indices(
        self, timestamps: Sequence[float] | np.ndarray, tolerance_s: float, context: str = ""
    ) -> list[int]:
        """Index of the frame nearest each timestamp; error when none lies within ``tolerance_s``."""
        times, out = self._times_list, []
        for t in timestamps:  # a few timestamps per call: bisect beats numpy's per-call overhead
            right = min(max(bisect.bisect_left(times, t), 1), len(times) - 1) if len(times) > 1 else 0
            i = right - 1 if right > 0 and abs(times[right - 1] - t) <= abs(times[right] - t) else right
            if abs(times[i] - t) > tolerance_s:
                raise DatasetFormatError(
                    f"{self.path}{context}: no frame within {tolerance_s:.4f}s of t={t:.4f}s (nearest {times[i]:.4f}s, "
                    f"video spans {times[0]:.4f}-{times[-1]:.4f}s); episode timestamps and video disagree, "
                    "re-encode the episode's video or fix meta/episodes from/to_timestamp"
                )
            out.append(i)
        return out

    def frames(self, indices: Sequence[int] | np.ndarray, context: str = "") -> np.ndarray:
        """RGB frames ``uint8 [len(indices), H, W, 3]`` for presentation-order frame indices."""
        idx = [int(i) for i in indices]
        # ascending, so the frames of one GOP come out of one forward decode
        rgb = {i: self._rgb(i, context) for i in sorted(set(idx))}
        return np.stack([rgb[i] for i in idx]) if idx else np.empty((0, self.height, self.width, 3), np.uint8)

    def _rgb(self, i: int, context: str) -> np.ndarray:
        key = (self._uid, i)
        value = self._cache.get(key)
        if value is None:
            self._decode_until(i, context)
            value = self._cache.get(key)
        if isinstance(value, np.ndarray):
            return value
        rgb = self._reformatter.reformat(value, format="rgb24").to_ndarray()
        rgb.flags.writeable = False
        self._cache.put(key, rgb, rgb.nbytes)
        return rgb

    def _decode_until(self, i: int, context: str) -> None:
        j = int(self._decode_index[i])
        start, target = int(self._gop_start[j]), int(self._pts[i])
        if self._next is None or start > self._next or target <= self._last_pts:
            self._codec.flush_buffers()
            self._next, self._last_pts = start, -(2**62)
        frame_bytes = self.height * self.width * 3 // 2
        try:
            while self._last_pts < target:
                if self._next < len(self._packets):
                    pts, dts, _, pos, size = self._packets[self._next]
                    packet = av.Packet(self._data[pos : pos + size])
                    packet.pts, packet.dts, packet.time_base = pts, dts, self._time_base
                    self._next += 1
                    decoded = self._codec.decode(packet)
                else:  # end of stream: drain the decoder; it must be flushed before reuse
                    decoded, self._next = self._codec.decode(None), None
                for frame in decoded:
                    k = self._pts_to_frame.get(frame.pts)
                    if k is not None and self._cache.get((self._uid, k)) is None:
                        self._cache.put((self._uid, k), frame, frame_bytes)
                    if k is not None:
                        self._last_pts = max(self._last_pts, int(frame.pts))
                if self._next is None:
                    break
        except av.error.FFmpegError as e:
            self._next = None
            raise DatasetFormatError(
                f"{self.path}{context}: corrupt video data near t={self.times[i]:.4f}s ({e}); re-encode or re-download this file"
            ) from e
        if self._cache.get((self._uid, i)) is None:
            self._next = None
            raise DatasetFormatError(
                f"{self.path}{context}: frame {i} (t={self.times[i]:.4f}s) could not be decoded; "
                "the file is corrupt, re-encode or re-download it"
            )

    def close(self) -> None:
        self._container.close()
        self._data.close()


class _ProcessState:
    """Open decoders and the frame cache of the current process (rebuilt after ``fork``)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.cache = _FrameCache(int(float(os.environ.get("VLA_VIDEO_CACHE_MB", "256")) * 2**20))
        self.decoders: OrderedDict[str, VideoDecoder] = OrderedDict()
        self.max_open = int(os.environ.get("VLA_VIDEO_MAX_OPEN", "64"))
        self.threads = int(os.environ.get("VLA_VIDEO_DECODE_THREADS", "1"))


_STATE = _ProcessState()
# Decoder state inherited through fork is never freed in the child (its codec contexts belong to the parent).
_ABANDONED: list[_ProcessState] = []


def _state() -> _ProcessState:
    global _STATE
    if _STATE.pid != os.getpid():
        _ABANDONED.append(_STATE)
        _STATE = _ProcessState()
    return _STATE


def get_decoder(path: str | Path) -> VideoDecoder:
    """This process's open decoder for ``path`` (opened on first use, least recently used closed past 64; reopened
    when the file was replaced since: its old frames, under the old decoder's id, age out of the cache)."""
    state, key = _state(), str(path)
    decoder = state.decoders.get(key)
    if decoder is not None and decoder.identity != file_identity(Path(path)):
        del state.decoders[key]
        decoder.close()
        decoder = None
    if decoder is None:
        decoder = state.decoders[key] = VideoDecoder(path, state.cache, state.threads)
        while len(state.decoders) > state.max_open:
            state.decoders.popitem(last=False)[1].close()
    else:
        state.decoders.move_to_end(key)
    return decoder


def close_decoder(path: str | Path) -> None:
    """Close this process's decoder for ``path`` if it is open (its cached frames age out of the LRU)."""
    decoder = _state().decoders.pop(str(path), None)
    if decoder is not None:
        decoder.close()


def close_decoders() -> None:
    """Close every decoder this process opened and drop the frame cache."""
    state = _state()
    for decoder in state.decoders.values():
        decoder.close()
    state.decoders.clear()
    state.cache = _FrameCache(state.cache.max_bytes)


def decode_frames(
    path: str | Path, timestamps: Sequence[float] | np.ndarray, tolerance_s: float, context: str = ""
) -> np.ndarray:
    """Frames nearest ``timestamps`` (seconds, each within ``tolerance_s``): uint8 ``[N, H, W, 3]``."""
    decoder = get_decoder(path)
    return decoder.frames(decoder.frame_indices(timestamps, tolerance_s, context), context)
