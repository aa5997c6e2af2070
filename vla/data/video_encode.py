"""MP4 video encoding for dataset writers (PyAV), with LeRobot's settings so random access stays cheap.

Encoding writes uint8 ``[T, H, W, 3]`` stacks as yuv420p AV1 (SVT-AV1, LeRobot's default) or H.264 (x264)
with LeRobot's settings (GOP 2, CRF 30); ``concat_videos`` stream-copies per-episode files into one LeRobot v3
video file and ``cut_video`` cuts one episode back out of it, again without re-encoding. Only streams with the
same ``stream_signature`` concatenate: an MP4 stores one set of codec headers for its whole stream. Decoding
lives in ``vla.data.video`` (which re-exports everything here).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np

from vla.runtime import scheduling, undo_realtime

# SVT-AV1 prints a banner per encoder to stderr unless told otherwise (read by the library at encoder init).
os.environ.setdefault("SVT_LOG", "1")

ENCODERS: dict[str, tuple[str, ...]] = {
    "av1": ("libsvtav1", "libaom-av1", "librav1e"),
    "h264": ("libx264", "h264", "libopenh264"),
}
DEFAULT_GOP = 2
DEFAULT_CRF = 30


def available_encoder(vcodec: str) -> str:
    """The first encoder of ``vcodec`` ("av1" | "h264", or an encoder name) this PyAV build provides."""
    names = ENCODERS.get(vcodec, (vcodec,))
    for name in names:
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:
            continue
    raise ValueError(
        f"No encoder for vcodec={vcodec!r} in this PyAV build (tried {list(names)}); use 'av1' or 'h264'."
    )


def encoder_options(
    encoder: str, gop: int = DEFAULT_GOP, crf: int = DEFAULT_CRF, preset: int | str | None = None
) -> dict[str, str]:
    """Codec options mirroring LeRobot's ``VideoEncoderConfig.get_codec_options`` for the same settings.

    Two additions. libx264's macroblock-tree rate control is off (``mbtree=0``). With it, x264 reads uninitialized
    memory on some frame sizes (seen at 32, 48, 80 and 96 px), so the same frames encode to different bytes from
    run to run, and a resumed ``vla sim generate`` or conversion would not reproduce the uninterrupted output. The
    codec headers stay the same (``stream_signature``), so datasets encoded before still take appended episodes.
    SVT-AV1 (v4.1 in PyAV 18's wheels) runs on one logical processor (``lp=1``): with its default thread pool it
    deadlocked now and then (all its threads waiting, ``avcodec_send_frame`` never returning) on a loaded 2-core
    CPU, twice in ~2,400 encodes of a 90-frame 64x96 clip, against none in 3,000 with ``lp=1``; the bytes are the
    same either way (tested), the encode ~1.5x slower at that size. Run as root, SVT-AV1 also makes the calling
    thread and its own threads real-time (SCHED_FIFO 99); ``VideoEncoder`` puts them back
    (``vla.runtime.undo_realtime``).
    """
    opts = {"g": str(gop), "crf": str(crf)}
    if encoder == "libx264":
        opts["mbtree"] = "0"
    if encoder == "libsvtav1":
        opts |= {"preset": str(12 if preset is None else preset), "svtav1-params": "fast-decode=0:lp=1"}
    elif encoder == "libaom-av1":
        opts |= {"cpu-used": str(8 if preset is None else preset), "row-mt": "1"}
    elif preset is not None:
        opts["preset"] = str(preset)
    return opts


class VideoEncoder:
    """Streams uint8 RGB frames ``[H, W, 3]`` into one MP4 (yuv420p); frame ``i`` gets pts ``i / fps``."""

    def __init__(
        self,
        path: str | Path,
        fps: int | float,
        height: int,
        width: int,
        vcodec: str = "av1",
        gop: int = DEFAULT_GOP,
        crf: int = DEFAULT_CRF,
        preset: int | str | None = None,
    ) -> None:
        self._scheduling = scheduling()  # before PyAV opens anything: SVT-AV1 may make this thread real-time
        self.path, self.height, self.width = Path(path), height, width
        if height % 2 or width % 2:
            raise ValueError(f"{self.path}: yuv420p video needs even height and width, got {height}x{width}")
        self.encoder = available_encoder(vcodec)
        self.options = encoder_options(self.encoder, gop, crf, preset)
        self._rate = Fraction(fps).limit_denominator(1001)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._container = av.open(str(self.path), "w", options={"movflags": "faststart"})
        self._stream = self._container.add_stream(self.encoder, rate=self._rate, options=self.options)
        self._stream.width, self._stream.height, self._stream.pix_fmt = width, height, "yuv420p"
        self.num_frames = 0

    def write(self, image: np.ndarray) -> None:
        if image.shape != (self.height, self.width, 3) or image.dtype != np.uint8:
            raise ValueError(
                f"{self.path}: frame {self.num_frames} must be uint8 {(self.height, self.width, 3)}, "
                f"got {image.dtype} {image.shape}"
            )
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
        frame.pts, frame.time_base = self.num_frames, 1 / self._rate
        try:
            self._container.mux(self._stream.encode(frame))
        finally:
            if self.num_frames == 0:  # the encoder opened here (SVT-AV1 starts its threads)
                undo_realtime(self._scheduling)
        self.num_frames += 1

    def close(self) -> None:
        try:
            self._container.mux(self._stream.encode(None))
            self._container.close()
        finally:
            undo_realtime(self._scheduling)


def encode_video(
    frames: np.ndarray | Iterable[np.ndarray], path: str | Path, fps: int | float, **kwargs: Any
) -> int:
    """Encode ``frames`` (uint8 ``[T, H, W, 3]``) to ``path``; ``kwargs`` as :class:`VideoEncoder`. Returns T."""
    frames = list(frames)
    if not frames:
        raise ValueError(f"{path}: no frames to encode")
    encoder = VideoEncoder(path, fps, frames[0].shape[0], frames[0].shape[1], **kwargs)
    for image in frames:
        encoder.write(image)
    encoder.close()
    return encoder.num_frames


def _signature(stream: Any) -> dict[str, Any]:
    ctx = stream.codec_context
    return {"codec": ctx.codec.canonical_name, "pix_fmt": ctx.pix_fmt, "size": (stream.height, stream.width),
            "time_base": stream.time_base, "headers": bytes(ctx.extradata or b"")}  # fmt: skip


def stream_signature(path: str | Path) -> dict[str, Any]:
    """What two MP4s' video streams must share for their packets to form one stream: codec, pixel format, size
    ``(H, W)``, time base and codec headers (``extradata``: H.264 SPS/PPS, AV1 sequence header).

    The container keeps one set of headers per stream, so packets encoded against other headers (another
    encoder build, or other settings: x264's PPS holds the CRF's initial QP) decode to wrong pixels, silently.
    """
    with av.open(str(path)) as container:
        return _signature(container.streams.video[0])


def concat_videos(inputs: Sequence[str | Path], output: str | Path) -> list[float]:
    """Stream-copy MP4s with the same ``stream_signature`` into one, each starting where the previous ended.

    Returns each input's start time in seconds in ``output`` (LeRobot v3 ``from_timestamp``). Raises
    ``ValueError`` when an input's signature differs from the first's (its frames would decode wrong).
    """
    starts: list[float] = []
    with av.open(str(output), "w", options={"movflags": "faststart"}) as out:
        out_stream, offset, want = None, 0, {}  # offset in the output stream's time base
        for path in inputs:
            with av.open(str(path)) as src:
                stream = src.streams.video[0]
                if out_stream is None:
                    out_stream = out.add_stream_from_template(stream, opaque=True)
                    out_stream.time_base = stream.time_base
                    want = _signature(stream)
                got = _signature(stream)
                if diff := [k for k in want if got[k] != want[k]]:
                    shown = ", ".join(f"{k} {got[k]!r} vs {want[k]!r}" for k in diff if k != "headers")
                    raise ValueError(
                        f"{path}: cannot concatenate onto {inputs[0]}: the video streams differ in "
                        f"{shown or 'codec headers'}; put it in a new file or re-encode it with the same settings"
                    )
                starts.append(float(offset * stream.time_base))
                end, frame_ticks = (
                    offset,
                    round(1 / (stream.average_rate * stream.time_base)) if stream.average_rate else 1,
                )
                for packet in src.demux(stream):
                    if packet.dts is None:  # demuxer flush packet
                        continue
                    packet.pts, packet.dts = packet.pts + offset, packet.dts + offset
                    end = max(end, packet.pts + (packet.duration or frame_ticks))
                    packet.stream = out_stream
                    out.mux(packet)
                offset = end
    return starts


def cut_video(path: str | Path, start: float, length: int) -> bytes | None:
    """The ``length`` frames of ``path`` from ``start`` s on as a standalone MP4 (its bytes), by stream copy.

    The packets whose presentation time lies in the segment are remuxed unchanged, their timestamps shifted to
    start at 0, so the result decodes to exactly the frames the segment shows in ``path`` (the inverse of
    ``concat_videos``). ``None`` when that is impossible without re-encoding: the segment does not start on a
    keyframe (it would need earlier frames to decode) or does not hold ``length`` frames.
    """
    with av.open(str(path)) as src:
        stream = src.streams.video[0]
        tick = round(1 / (stream.average_rate * stream.time_base)) if stream.average_rate else 1
        first = round(start / stream.time_base)
        lo, hi = first - tick // 2, first + length * tick - tick // 2  # half a frame of rounding slack
        src.seek(max(lo - 2 * tick, 0), stream=stream, backward=True)  # a keyframe at or before the segment
        packets = []
        for packet in src.demux(stream):
            if packet.dts is None:  # demuxer flush packet
                continue
            if packet.dts >= hi:  # pts >= dts: nothing later belongs to the segment
                break
            if lo <= packet.pts < hi:
                packets.append(packet)
        if (
            len(packets) != length
            or not packets[0].is_keyframe
            or min(p.pts for p in packets) != packets[0].pts
        ):
            return None
        shift = packets[0].pts
        # a file, not memory: faststart (moov first, as encode_video writes) re-reads the output by name
        with tempfile.TemporaryDirectory(prefix="vla-cut-") as tmp:
            target = Path(tmp) / "segment.mp4"
            with av.open(str(target), "w", options={"movflags": "faststart"}) as out:
                out_stream = out.add_stream_from_template(stream, opaque=True)
                out_stream.time_base = stream.time_base
                for packet in packets:
                    packet.pts, packet.dts = packet.pts - shift, packet.dts - shift
                    packet.stream = out_stream
                    out.mux(packet)
            return target.read_bytes()
