"""``vla data merge``: join LeRobot datasets with the same features (e.g. ``vla sim generate`` shards) into one.

Camera streams are copied, not re-encoded, when every source stores them alike (codec, pixel format, size, fps,
codec headers; LeRobot v3.0): each episode's packets are cut out of its source file (``video.cut_video``; each
episode was encoded on its own, so it starts on a keyframe) and appended through
``LeRobotWriter.add_encoded_episode`` with the image stats the source recorded for it. The frames decode
bit-identical to the sources' and a merge costs little more than copying files. When the sources differ (or
an episode cannot be cut: it does not start on a keyframe, or its stats are missing) frames are decoded and
re-encoded instead; ``MergeSummary`` says which path each episode took, and why. A re-encoded episode whose
codec headers differ from the copied ones' (the sources were written by another encoder build) goes to a new
video file, as the writer does for any episode whose stream does not match the current file's.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm

from vla.data import video
from vla.data.convert import writer_episode_metadata
from vla.data.readers.lerobot import LeRobotReader
from vla.data.writers.lerobot import DEFAULT_FEATURES, LeRobotWriter
from vla.data.writers.lerobot_episode import EncodedEpisode
from vla.data.writers.progress import begin, finish, prepare_destination

VideoStats = dict[str, dict[str, np.ndarray]]  # video key -> stat name -> array


@dataclass(frozen=True)
class MergeSummary:
    """What ``merge_datasets`` wrote: ``copied`` episodes had their videos stream-copied, ``reencoded`` ones were
    decoded and re-encoded; ``reason`` says why any were re-encoded (``None`` when all were copied)."""

    out: Path
    episodes: int
    copied: int
    reencoded: int
    reason: str | None = None

    def __str__(self) -> str:
        line = f"wrote {self.out}: {self.episodes} episodes"
        if self.copied or self.reencoded:
            line += f"; videos stream-copied for {self.copied}"
        if self.reencoded:
            line += f", decoded and re-encoded for {self.reencoded} ({self.reason})"
        return line


def _stream_signature(path: Path) -> dict[str, Any]:
    """What must be equal for packets of two files to be concatenated into one stream (and the same fps)."""
    with av.open(str(path)) as container:
        fps = container.streams.video[0].average_rate
    return {**video.stream_signature(path), "fps": fps}


def _copy_plan(readers: list[LeRobotReader], keys: list[str]) -> tuple[str | None, str]:
    """(why the sources' videos cannot be stream-copied into one dataset or ``None`` when they can, their codec)."""
    for r in readers:
        if r.version != "v3.0":
            return f"{r.path} is LeRobot {r.version}; stream copy reads v3.0 video files", ""
    if len({r.fps for r in readers}) > 1:
        return f"the sources' fps differ ({sorted({r.fps for r in readers})})", ""
    codec = ""
    for key in keys:
        files = sorted({ep.videos[key][0] for r in readers for ep in r.meta.episodes.values()})
        want = _stream_signature(files[0]) if files else {}
        codec = codec or want.get("codec", "")
        for path in files[1:]:
            got = _stream_signature(path)
            if diff := [k for k in want if got[k] != want[k]]:
                shown = ", ".join(f"{k} {want[k]!r} vs {got[k]!r}" for k in diff if k != "headers")
                return f"{key}: {path} differs from {files[0]} in {shown or 'codec headers'}", ""
    try:  # the writer checks stream-copied episodes against its own encoder for this codec
        video.available_encoder(codec)
    except ValueError as e:
        return str(e), ""
    return None, codec


def _video_stats(reader: LeRobotReader, keys: list[str]) -> dict[int, VideoStats]:
    """The per-episode image stats the source recorded (``stats/<key>/<stat>`` episode columns) by episode_index."""
    out: dict[int, VideoStats] = {}
    for path in sorted((reader.path / "meta" / "episodes").glob("*/*.parquet")):
        names = [n for n in pq.read_schema(path).names if n.startswith(tuple(f"stats/{k}/" for k in keys))]
        for row in pq.read_table(path, columns=["episode_index", *names]).to_pylist():
            stats: VideoStats = {}
            for name in names:
                key, stat = name[len("stats/") :].rsplit("/", 1)
                if row[name] is not None:
                    stats.setdefault(key, {})[stat] = np.asarray(row[name])
            out[int(row["episode_index"])] = stats
    return out


def _cut_episode(reader: LeRobotReader, split: str, episode: int, keys: list[str], stats: VideoStats
                 ) -> tuple[dict[str, bytes], str | None]:  # fmt: skip
    """The episode's MP4 per video key, cut out of the source by stream copy; or why it cannot be."""
    record = reader.meta.episodes[reader.meta.splits[split][episode]]
    if missing := [k for k in keys if not {"mean", "std", "min", "max", "count"} <= set(stats.get(k, {}))]:
        return {}, f"{reader.path} episode {record.index} has no image stats for {missing}"
    videos = {}
    for key in keys:
        path, start = record.videos[key]
        cut = video.cut_video(path, start, record.length)
        if cut is None:
            return {}, f"{path} episode {record.index} does not start on a keyframe"
        videos[key] = cut
    return videos, None


def _feature_difference(a: LeRobotReader, b: LeRobotReader) -> str | None:
    """The first feature ``a`` and ``b`` disagree on, named with both kinds/shapes; None when they agree."""
    fa = {k: (f.kind, list(f.shape)) for k, f in a.features().items()}
    fb = {k: (f.kind, list(f.shape)) for k, f in b.features().items()}
    for key in sorted(set(fa) | set(fb)):
        if fa.get(key) != fb.get(key):

            def shown(f: tuple[str, list[int]] | None) -> str:
                return "missing" if f is None else f"{f[0]} {f[1]}"

            return f"{key}: {shown(fa.get(key))} vs {shown(fb.get(key))}"
    return None


def _episodes_by_split(readers: list[LeRobotReader]) -> list[tuple[str, LeRobotReader, int, dict[str, Any]]]:
    """Every (split, reader, episode, metadata): split by split (in order of first appearance), within a split by
    ``sim_index`` when every episode has one (merged shards equal a single-run dataset), else source by source."""
    splits = list(dict.fromkeys(s for r in readers for s in r.splits()))
    items = []
    for split in splits:
        part = [(split, r, e, r.episode_metadata(split, e)) for r in readers if split in r.splits()
                for e in range(r.num_episodes(split))]  # fmt: skip
        if all("sim_index" in m for *_, m in part):
            part.sort(key=lambda x: int(x[3]["sim_index"]))
        items += part
    return items


def _check_servo_models(items: list[tuple[str, LeRobotReader, int, dict[str, Any]]]) -> None:
    """Sim episodes (``vla sim generate``'s, with a ``sim_seed``) recorded under different servo models
    (``vla.sim.world.SERVO_MODEL``; none before the arms had joint speed limits) followed different physics: one
    dataset must not mix them (``vla sim generate`` refuses to top one up across models for the same reason)."""
    first: dict[Any, str] = {}
    for split, r, e, meta in items:
        if "sim_seed" in meta:
            first.setdefault(meta.get("servo_model"), f"{r.path} ({split} episode {e})")
    if len(first) > 1:
        seen = "; ".join(f"{model!r} first in {where}" for model, where in first.items())
        raise ValueError(
            f"the sources' sim episodes were recorded under different servo models ({seen}; None: before the arms "
            "had joint speed limits), i.e. different arm physics; regenerate the older ones with `vla sim "
            "generate` (today's servo model) and merge again"
        )


def _prepare_out(out: Path, sources: list[str | Path], overwrite: bool) -> None:
    """Refuse an ``out`` that is one of the sources; otherwise ``prepare_destination``'s rules."""
    if out.resolve() in {Path(s).resolve() for s in sources}:
        raise FileExistsError(f"--out {out} is one of the sources; merge into a new folder")
    prepare_destination(out, overwrite, option="--out")


def _open_sources(sources: list[str | Path]) -> list[LeRobotReader]:
    """The sources' readers: complete datasets (a merge of an interrupted shard would look complete while missing
    its episodes) with the same features."""
    readers = [LeRobotReader(s) for s in sources]
    for r in readers:
        if r.incomplete:
            raise ValueError(
                f"{r.path} is incomplete: `{r.incomplete}` was interrupted; re-run it to finish it, then merge"
            )
    for r in readers[1:]:
        if diff := _feature_difference(readers[0], r):
            raise ValueError(
                f"{r.path} and {readers[0].path} differ in {diff}; only datasets with the same features merge"
            )
    return readers


def _resume_command(sources: list[str | Path], out: Path) -> str:
    """The ``vla data merge`` command line that runs (or resumes) this merge from any folder."""
    return shlex.join(
        ["vla", "data", "merge", *(str(Path(s).resolve()) for s in sources), "--out", str(out.resolve())]
    )


def merge_datasets(
    sources: list[str | Path], out: str | Path, *, overwrite: bool = False, progress: bool | None = None
) -> MergeSummary:
    """Join LeRobot datasets with the same features (e.g. generation shards) into a new dataset at ``out``.

    Every split is kept (the sources' episodes of a split together). Episodes are ordered by their ``sim_index``
    when every source has one (so merged shards equal a single-run dataset), else source by source; episode
    metadata is kept. Videos are stream-copied where possible (see the module docstring), low-dim features
    rewritten. ``overwrite`` replaces a dataset already at ``out``; an ``out`` this same merge was writing when it
    was interrupted is resumed (the same files as an uninterrupted run; marked incomplete until it finishes, see
    ``vla.data.writers.progress``), a finished one left as it is. ``progress``: a progress bar on stderr (``None``: only when stderr is a
    terminal).
    """
    out = Path(out)
    # the sources are read and checked before anything at ``out`` is touched (--overwrite deletes it)
    readers = _open_sources(sources)
    items = _episodes_by_split(readers)
    _check_servo_models(items)
    _prepare_out(out, sources, overwrite)
    identity = {"sources": [str(Path(s).resolve()) for s in sources]}
    record = begin(
        out, _resume_command(sources, out), identity, replace_hint=" (or pass --overwrite to replace it)"
    )
    info = readers[0].lerobot_info()
    user = {k: v for k, v in info["features"].items() if k not in DEFAULT_FEATURES}
    keys = [k for k, ft in user.items() if ft["dtype"] == "video"]
    blocker, codec = _copy_plan(readers, keys) if keys else ("no videos", "")
    copy = blocker is None
    settings: dict[str, Any] = {}
    if copy:  # the sources' codec and settings: info.json and any re-encoded episode match the copied ones
        enc = user[keys[0]].get("info", {})
        settings = {"vcodec": codec}
        settings |= {name: enc[f"video.{k}"] for name, k in (("crf", "crf"), ("gop", "g"), ("preset", "preset"))
                     if enc.get(f"video.{k}") is not None}  # fmt: skip
    stats = {r.path: _video_stats(r, keys) for r in readers} if copy else {}
    state = {"position": 0, "copied": 0, "reasons": [] if copy else [blocker]} | record.state
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(
        total=len(items), initial=state["position"], desc=f"merge -> {out.name}", unit="ep", disable=not show
    )
    # cameras stay stored as the sources store them (PNG images stay lossless images, videos stay videos)
    with LeRobotWriter(out, fps=info["fps"], features=user, robot_type=info.get("robot_type"), mode="append",
                       video=bool(keys), **settings) as w:  # fmt: skip
        w.progress = record  # committed with each episode: a re-run resumes after the last one on disk
        for split, r, e, meta in items[state["position"] :]:
            episode, tasks, why = _source_episode(
                r, split, e, user, stats.get(r.path) if copy else None, codec
            )
            state["position"] += 1
            state["copied"] += isinstance(episode, EncodedEpisode)
            if why is not None and why not in state["reasons"]:
                state["reasons"].append(why)
            record.state = state  # committed with the episode
            if isinstance(episode, EncodedEpisode):
                w.add_encoded_episode(episode, tasks, writer_episode_metadata(meta), split=split)
            else:
                w.add_episode(episode, tasks, writer_episode_metadata(meta), split=split)
            bar.update(1)
    bar.close()
    finish(out, record)
    reencoded = len(items) - state["copied"] if keys else 0
    shown = state["reasons"]
    reason = (
        "; ".join(shown[:3]) + (f"; ... ({len(shown) - 3} more)" if len(shown) > 3 else "")
        if reencoded
        else None
    )
    return MergeSummary(out, len(items), state["copied"], reencoded, reason)


def _source_episode(
    reader: LeRobotReader,
    split: str,
    episode: int,
    user: dict[str, dict[str, Any]],
    stats: dict[int, VideoStats] | None,
    codec: str,
) -> tuple[EncodedEpisode | dict[str, np.ndarray], list[str], str | None]:
    """One source episode ready to append: an ``EncodedEpisode`` with its videos cut out of the source's files when
    ``stats`` (the source's recorded image stats; None: the sources cannot be stream-copied) and the cut works,
    else its decoded frames ``{feature: [T, *shape]}``; plus its task strings and why its videos were not copied."""
    keys = [k for k, ft in user.items() if ft["dtype"] == "video"]
    raw = reader.read_episode(split, episode)
    tasks, why = [str(t) for t in raw.steps["task"]], None
    if stats is not None:
        ep_stats = stats.get(reader.meta.splits[split][episode], {})
        videos, why = _cut_episode(reader, split, episode, keys, ep_stats)
        if why is None:
            frames = {k: raw.steps[k] for k in user if k not in keys}
            return EncodedEpisode(raw.length, frames, videos, {k: ep_stats[k] for k in keys},
                                  video.available_encoder(codec), float(reader.fps)), tasks, None  # fmt: skip
    cameras = [k for k, ft in user.items() if ft["dtype"] in ("video", "image")]  # decoded when not copied
    imgs = reader.read_images(split, episode, list(range(raw.length)), cameras)
    return {k: (imgs[k] if k in imgs else raw.steps[k]) for k in user}, tasks, why


__all__ = ["MergeSummary", "merge_datasets"]
