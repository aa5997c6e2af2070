"""LeRobot v2.1/v3.0 reader, v3.0 writer and video decode/encode: exact random access, LeRobot interop both ways,
atomic/resumable writes, and a DatasetFormatError that names file/episode/field for every kind of bad input."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from peer import LOAD_ITEMS, peer_python

from vla.data import video
from vla.data.readers import open_dataset
from vla.data.readers.base import DatasetFormatError
from vla.data.readers.lerobot import FrameIndexError, LeRobotReader
from vla.data.writers import staging
from vla.data.writers.lerobot import LeRobotWriter
from vla.data.writers.lerobot_episode import encode_episode
from vla.data.writers.synthetic import (
    TASKS,
    decode_frame_code,
    frame_code_image,
    make_lerobot_dataset,
    synthetic_episode,
)

CAMS = {"front": (64, 80), "wrist": (48, 64)}
LENGTHS = [20, 25, 15]
REPO_ROOT = Path(__file__).resolve().parents[1]
PEER_SCRIPT = REPO_ROOT.parent / "shared" / "peer" / "peer_lerobot_bench.py"
PEER_CACHE = Path(os.environ.get("PEER_LEROBOT_CACHE", "/tmp/peer_lerobot_cache"))


def _make(root: Path, **kw: object) -> Path:
    args = {"num_episodes": 3, "episode_length": LENGTHS, "cameras": CAMS, "episode_metadata": True} | kw
    return make_lerobot_dataset(root, **args)  # type: ignore[arg-type]


def _check_exact(reader: LeRobotReader, cams: dict[str, tuple[int, int]] = CAMS) -> None:
    """Low-dim values equal the generator; every camera frame, read in shuffled order, is the requested one."""
    rng = random.Random(0)
    for e in range(reader.num_episodes("train")):
        ep = reader.read_episode("train", e)
        ref = synthetic_episode(e, ep.length, cams, 6, 4, 0)
        np.testing.assert_array_equal(ep.steps["observation.state"], ref["observation.state"])
        np.testing.assert_array_equal(ep.steps["action"], ref["action"])
        np.testing.assert_array_equal(ep.steps["frame_index"], np.arange(ep.length))
        assert ep.steps["episode_index"].tolist() == [e] * ep.length
        assert set(ep.steps["task"]) == {TASKS[e % len(TASKS)]}
        frames = rng.sample(range(ep.length), ep.length)
        images = reader.read_images("train", e, frames, reader.image_keys())
        for cam, key in enumerate(f"observation.images.{c}" for c in cams):
            assert images[key].shape == (ep.length, *cams[key.rsplit(".", 1)[1]], 3)
            assert [decode_frame_code(im) for im in images[key]] == [(e, f, cam) for f in frames]


@pytest.fixture(scope="module")
def v3_av1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(tmp_path_factory.mktemp("v3") / "sim_pick")


# ---- video ------------------------------------------------------------------------------------------------
def test_av1_encoding_leaves_no_thread_real_time(tmp_path: Path) -> None:
    """Run as root, SVT-AV1 makes the thread that opens the encoder and its own threads SCHED_FIFO 99 (checked here
    on raw PyAV first, in a child process); ``VideoEncoder`` puts every such thread back, so processes started
    afterwards (a browser, a loader worker) are not real-time."""
    if os.geteuid() != 0 or not hasattr(os, "sched_getscheduler"):
        pytest.skip("SVT-AV1 raises scheduling priority only when run as root on Linux")
    probe = """
import os, sys, av, numpy as np
out = av.open(sys.argv[1], "w")
s = out.add_stream("libsvtav1", rate=10, options={"preset": "12", "svtav1-params": "lp=1"})
s.width = s.height = 32
s.pix_fmt = "yuv420p"
out.mux(s.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")))
print(os.sched_getscheduler(0))
"""
    raw = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "raw.mp4")], capture_output=True, text=True,
                         env={**os.environ, "SVT_LOG": "1"}, timeout=120)  # fmt: skip
    if raw.returncode != 0:
        pytest.skip(f"this PyAV build cannot encode with libsvtav1: {raw.stderr.strip()[-300:]}")
    if int(raw.stdout.split()[-1]) not in (os.SCHED_FIFO, os.SCHED_RR):
        pytest.skip("this PyAV build's AV1 encoder does not raise scheduling priority")
    from vla.runtime import realtime

    video.encode_video(np.zeros((3, 32, 32, 3), np.uint8), tmp_path / "ours.mp4", 10, vcodec="av1")
    left = {t: os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}
    assert not any(realtime(p) for p in left.values()), left


def test_encoders_available() -> None:
    assert video.available_encoder("av1") in video.ENCODERS["av1"]
    assert video.available_encoder("h264") in video.ENCODERS["h264"]
    with pytest.raises(ValueError, match="No encoder"):
        video.available_encoder("nope")


@pytest.mark.parametrize(("vcodec", "gop"), [("av1", 2), ("h264", 2), ("h264", 30)])
def test_video_random_access_is_exact(tmp_path: Path, vcodec: str, gop: int) -> None:
    # gop 30 with x264 defaults has B-frames (decode order != presentation order)
    frames = [frame_code_image(0, i, 0, 64, 96) for i in range(90)]
    path = tmp_path / "v.mp4"
    video.encode_video(frames, path, 15, vcodec=vcodec, gop=gop)
    order = [*random.Random(1).sample(range(90), 90), 5, 5, 89, 0]
    out = video.decode_frames(path, [i / 15 for i in order], 0.5 / 15)
    assert [decode_frame_code(im)[1] for im in out] == order
    assert video.probe_video(path)["video.codec"] == vcodec


def test_a_replaced_video_is_decoded_anew_in_the_same_process(tmp_path: Path) -> None:
    """The per-process decoder and frame cache never serve the frames of a file that has since been replaced
    (a re-encoded or repaired video written over the old one, or renamed over it)."""
    path = tmp_path / "v.mp4"
    video.encode_video([frame_code_image(1, i, 0, 48, 64) for i in range(6)], path, 10)
    assert [decode_frame_code(im)[0] for im in video.decode_frames(path, [0.0, 0.3], 0.05)] == [1, 1]
    video.encode_video([frame_code_image(2, i, 0, 48, 64) for i in range(6)], tmp_path / "new.mp4", 10)
    os.replace(tmp_path / "new.mp4", path)  # renamed over it
    assert [decode_frame_code(im)[0] for im in video.decode_frames(path, [0.0, 0.3], 0.05)] == [2, 2]
    video.encode_video([frame_code_image(3, i, 0, 48, 64) for i in range(8)], path, 10)  # rewritten in place
    assert [decode_frame_code(im)[:2] for im in video.decode_frames(path, [0.0, 0.7], 0.05)] == [
        (3, 0),
        (3, 7),
    ]


def test_concat_videos_start_times_and_frames(tmp_path: Path) -> None:
    parts = []
    for k, n in enumerate([12, 7, 9]):
        parts.append(tmp_path / f"p{k}.mp4")
        video.encode_video([frame_code_image(k, i, 0, 48, 64) for i in range(n)], parts[-1], 10)
    starts = video.concat_videos(parts, tmp_path / "all.mp4")
    assert starts == pytest.approx([0.0, 1.2, 1.9])
    for k, (start, n) in enumerate(zip(starts, [12, 7, 9])):
        out = video.decode_frames(tmp_path / "all.mp4", [start + i / 10 for i in range(n)], 0.05)
        assert [decode_frame_code(im)[:2] for im in out] == [(k, i) for i in range(n)]


def test_concat_videos_refuses_streams_with_other_codec_headers(tmp_path: Path) -> None:
    """x264 stores the CRF's initial QP in the PPS: the same encoder at another CRF makes other codec headers,
    and its packets appended under the first file's headers would decode to wrong pixels."""
    for name, crf in (("a", 30), ("b", 10)):
        frames = [frame_code_image(0, i, 0, 48, 64) for i in range(6)]
        video.encode_video(frames, tmp_path / f"{name}.mp4", 10, vcodec="h264", crf=crf)
    a, b = (video.stream_signature(tmp_path / f"{n}.mp4") for n in "ab")
    assert [k for k in a if a[k] != b[k]] == ["headers"]
    with pytest.raises(ValueError, match=r"b\.mp4: cannot concatenate .* differ in codec headers"):
        video.concat_videos([tmp_path / "a.mp4", tmp_path / "b.mp4"], tmp_path / "ab.mp4")


_ENCODE_DISC = """
import sys
import numpy as np
from vla.data import video
size = int(sys.argv[2])
y, x = np.mgrid[:size, :size]
frames = []
for i in range(30):  # a red disc moving across a colour gradient
    img = np.stack([x * 255 // size, y * 255 // size, np.full_like(x, 90)], -1).astype(np.uint8)
    img[(x - 5 - i * size // 40) ** 2 + (y - size // 2) ** 2 < (size // 6) ** 2] = (220, 40, 40)
    frames.append(img)
video.encode_video(frames, sys.argv[1], 10, vcodec=sys.argv[3])
"""


@pytest.mark.parametrize("vcodec", ["h264", "av1"])
def test_same_frames_same_bytes_whatever_the_heap_holds(tmp_path: Path, vcodec: str) -> None:
    """A resumed ``vla sim generate`` must reproduce the uninterrupted bytes, so encoding may not depend on memory
    it never wrote. glibc's ``MALLOC_PERTURB_`` fills fresh heap blocks with a given byte: x264's default
    macroblock-tree rate control read such memory (at 48 and 96 px this clip came out differently per byte)."""
    out = {}
    for size in (48, 96):
        for fill in ("85", "170"):
            path = tmp_path / f"{size}_{fill}.mp4"
            env = dict(os.environ, MALLOC_PERTURB_=fill, PYTHONPATH=str(REPO_ROOT))
            cmd = [sys.executable, "-c", _ENCODE_DISC, str(path), str(size), vcodec]
            subprocess.run(cmd, env=env, check=True, timeout=120)
            out[size, fill] = path.read_bytes()
        assert out[size, "85"] == out[size, "170"], f"{vcodec} at {size} px depends on uninitialized memory"


def test_x264_without_mbtree_keeps_the_codec_headers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Episodes encoded before ``mbtree=0`` (x264's default rate control) have the same codec headers as new ones,
    so a dataset written before still takes appended episodes by stream copy."""
    from vla.data import video_encode

    frames = [frame_code_image(0, i, 0, 48, 64) for i in range(6)]
    video.encode_video(frames, tmp_path / "new.mp4", 10, vcodec="h264")
    current = video_encode.encoder_options
    monkeypatch.setattr(
        video_encode,
        "encoder_options",
        lambda *a, **k: {o: v for o, v in current(*a, **k).items() if o != "mbtree"},
    )
    video.encode_video(frames, tmp_path / "old.mp4", 10, vcodec="h264")
    assert (tmp_path / "old.mp4").read_bytes() != (
        tmp_path / "new.mp4"
    ).read_bytes()  # the options did differ
    assert video.stream_signature(tmp_path / "old.mp4") == video.stream_signature(tmp_path / "new.mp4")
    starts = video.concat_videos([tmp_path / "old.mp4", tmp_path / "new.mp4"], tmp_path / "both.mp4")
    out = video.decode_frames(tmp_path / "both.mp4", [starts[1] + i / 10 for i in range(6)], 0.05)
    assert [decode_frame_code(im)[:2] for im in out] == [(0, i) for i in range(6)]


def test_svt_av1_on_one_logical_processor_writes_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SVT-AV1 runs with ``lp=1`` (its default thread pool deadlocked now and then on a loaded 2-core CPU): the
    same frames give the same bytes as with its default threading, so datasets written before are unchanged."""
    from vla.data import video_encode

    if video.available_encoder("av1") != "libsvtav1":
        pytest.skip(f"this PyAV build encodes AV1 with {video.available_encoder('av1')}, not SVT-AV1")
    assert "lp=1" in video_encode.encoder_options("libsvtav1")["svtav1-params"].split(":")
    frames = [frame_code_image(0, i, 0, 48, 64) for i in range(20)]
    video.encode_video(frames, tmp_path / "lp1.mp4", 10, vcodec="av1")
    current, used = video_encode.encoder_options, []

    def default_threads(*args: Any, **kwargs: Any) -> dict[str, str]:
        opts = current(*args, **kwargs)
        used.append([p for p in opts["svtav1-params"].split(":") if p != "lp=1"])
        return {**opts, "svtav1-params": ":".join(used[-1])}

    monkeypatch.setattr(video_encode, "encoder_options", default_threads)
    video.encode_video(frames, tmp_path / "default.mp4", 10, vcodec="av1")
    assert used == [["fast-decode=0"]]  # the second clip was encoded without lp=1
    assert (tmp_path / "lp1.mp4").read_bytes() == (tmp_path / "default.mp4").read_bytes()


@pytest.mark.parametrize(("vcodec", "gop"), [("av1", 2), ("h264", 2), ("h264", 30)])
def test_cut_video_inverts_concat_without_reencoding(tmp_path: Path, vcodec: str, gop: int) -> None:
    """Each part cut back out of the concatenation holds the part's packets unchanged (so the same frames); a
    segment that starts between keyframes cannot be cut without re-encoding."""
    parts, lengths = [], [12, 7, 9]
    for k, n in enumerate(lengths):
        parts.append(tmp_path / f"p{k}.mp4")
        video.encode_video(
            [frame_code_image(k, i, 0, 48, 64) for i in range(n)], parts[-1], 10, vcodec=vcodec, gop=gop
        )
    starts = video.concat_videos(parts, tmp_path / "all.mp4")
    for k, (start, n) in enumerate(zip(starts, lengths)):
        cut = video.cut_video(tmp_path / "all.mp4", start, n)
        assert cut is not None
        (tmp_path / f"cut{k}.mp4").write_bytes(cut)
        assert video.probe_video(tmp_path / f"cut{k}.mp4")["frames"] == n
        times = [i / 10 for i in range(n)]
        got = video.decode_frames(tmp_path / f"cut{k}.mp4", times, 0.05)
        np.testing.assert_array_equal(got, video.decode_frames(parts[k], times, 0.05))
        assert [decode_frame_code(im)[:2] for im in got] == [(k, i) for i in range(n)]
    assert video.cut_video(tmp_path / "all.mp4", starts[0] + 0.1, 5) is None  # frame 1 is no keyframe


def test_timestamp_outside_tolerance_is_an_error(tmp_path: Path) -> None:
    video.encode_video([frame_code_image(0, i, 0, 48, 64) for i in range(10)], tmp_path / "v.mp4", 10)
    with pytest.raises(DatasetFormatError, match=r"v\.mp4.*no frame within"):
        video.decode_frames(tmp_path / "v.mp4", [1.5], 0.05)


def _child_decode(reader: LeRobotReader, queue: mp.Queue) -> None:
    images = reader.read_images("train", 1, [3, 0], ["observation.images.front"])["observation.images.front"]
    queue.put([decode_frame_code(im) for im in images])


def test_decoders_reopen_after_fork(v3_av1: Path) -> None:
    reader = LeRobotReader(v3_av1)
    reader.read_images("train", 1, [2], ["observation.images.front"])  # parent opens its decoder first
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_decode, args=(reader, queue))
    child.start()
    result = queue.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0 and result == [(1, 3, 0), (1, 0, 0)]


# ---- v3.0 round trip ----------------------------------------------------------------------------------------
def test_v3_reader_properties(v3_av1: Path) -> None:
    reader = LeRobotReader(v3_av1)
    assert (reader.format, reader.name, reader.fps, reader.robot_type) == (
        "lerobot_v3.0",
        "sim_pick",
        10.0,
        "synthetic_arm",
    )
    assert reader.splits() == ["train"] and reader.num_episodes("train") == 3
    assert [reader.episode_length("train", e) for e in range(3)] == LENGTHS
    features = reader.features()
    assert features["observation.images.front"].kind == "video" and features[
        "observation.images.front"
    ].shape == (64, 80, 3)
    assert (features["observation.state"].dtype, features["observation.state"].shape) == ("float32", (6,))
    assert features["timestamp"].shape == () and features["task"].kind == "string"
    assert reader.image_keys() == ["observation.images.front", "observation.images.wrist"]
    assert reader.episode_metadata("train", 1) == {
        "tasks": [TASKS[1]], "length": 25, "randomization": {"friction": pytest.approx(0.6), "light": {"level": 1}}, "seed": 1
    }  # fmt: skip
    frame = reader.read_frame("train", 2, 7)
    assert (
        frame["task"] == TASKS[2]
        and frame["index"] == 20 + 25 + 7
        and decode_frame_code(frame["observation.images.wrist"]) == (2, 7, 1)
    )


@pytest.mark.parametrize(("use_video", "vcodec"), [(True, "av1"), (True, "h264"), (False, "av1")])
def test_v3_exact_random_access(tmp_path: Path, use_video: bool, vcodec: str) -> None:
    reader = LeRobotReader(_make(tmp_path / "ds", video=use_video, vcodec=vcodec))
    assert reader.features()["observation.images.front"].kind == ("video" if use_video else "image")
    _check_exact(reader)


def test_v3_on_disk_layout(v3_av1: Path) -> None:
    info = json.loads((v3_av1 / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["splits"] == {"train": "0:3"}
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 60, 3)
    assert info["features"]["observation.images.front"]["info"]["video.codec"] == "av1"
    assert info["features"]["observation.images.front"]["info"]["video.g"] == 2
    assert sorted(p.relative_to(v3_av1).as_posix() for p in v3_av1.rglob("*") if p.is_file()) == [
        "data/chunk-000/file-000.parquet", "meta/episodes/chunk-000/file-000.parquet", "meta/info.json",
        "meta/stats.json", "meta/tasks.parquet", "videos/observation.images.front/chunk-000/file-000.mp4",
        "videos/observation.images.wrist/chunk-000/file-000.mp4",
    ]  # fmt: skip
    episodes = pq.read_table(v3_av1 / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    key = "videos/observation.images.front"
    assert [e[f"{key}/from_timestamp"] for e in episodes] == pytest.approx([0.0, 2.0, 4.5])
    assert [e[f"{key}/to_timestamp"] for e in episodes] == pytest.approx([2.0, 4.5, 6.0])
    assert [(e["dataset_from_index"], e["dataset_to_index"]) for e in episodes] == [
        (0, 20),
        (20, 45),
        (45, 60),
    ]
    assert pq.ParquetFile(v3_av1 / "data/chunk-000/file-000.parquet").num_row_groups == 3  # one per episode
    stats = json.loads((v3_av1 / "meta/stats.json").read_text())
    assert set(stats["action"]) == {"min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99"}
    assert np.asarray(stats["observation.images.front"]["mean"]).shape == (3, 1, 1)
    actions = np.concatenate(
        [synthetic_episode(e, n, CAMS, 6, 4, 0)["action"] for e, n in enumerate(LENGTHS)]
    )
    np.testing.assert_allclose(stats["action"]["mean"], actions.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["action"]["std"], actions.std(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats["action"]["min"], actions.min(0))
    assert stats["action"]["count"] == [60]


def test_splits_from_info_are_honoured(tmp_path: Path) -> None:
    root = _make(tmp_path / "ds", episode_metadata=False)
    info = json.loads((root / "meta/info.json").read_text())
    (root / "meta/info.json").write_text(json.dumps(info | {"splits": {"train": "0:2", "val": "2:3"}}))
    reader = LeRobotReader(root)
    assert reader.splits() == ["train", "val"]
    assert (reader.num_episodes("train"), reader.num_episodes("val"), reader.episode_length("val", 0)) == (
        2,
        1,
        15,
    )
    assert reader.read_episode("val", 0).steps["episode_index"][0] == 2


# ---- v2.1 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_video", [True, False])
def test_v21_reader_exact(tmp_path: Path, use_video: bool) -> None:
    root = _make(tmp_path / "old", version="v2.1", video=use_video)
    assert (root / "meta/episodes.jsonl").exists() and (
        root / "data/chunk-000/episode_000001.parquet"
    ).exists()
    reader = LeRobotReader(root)
    assert (
        reader.format == "lerobot_v2.1" and [reader.episode_length("train", e) for e in range(3)] == LENGTHS
    )
    _check_exact(reader)


# ---- writer API, resume, atomicity ------------------------------------------------------------------------
FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [6]},
    "action": {"dtype": "float32", "shape": [4]},
    "observation.images.front": {"dtype": "video", "shape": [64, 80, 3]},
    "observation.images.wrist": {"dtype": "video", "shape": [48, 64, 3]},
}


def _add_episode_by_frames(writer: LeRobotWriter, e: int, length: int, **save: object) -> int:
    data = synthetic_episode(e, length, CAMS, 6, 4, 0)
    buffers = {k: np.empty_like(v[0]) for k, v in data.items()}  # reused every step, as simulators do
    for i in range(length):
        for k, v in data.items():
            buffers[k][...] = v[i]
        writer.add_frame(buffers | ({} if save else {"task": TASKS[e % 3]}))
    return writer.save_episode(**save)  # type: ignore[arg-type]


def test_episode_metadata_whose_keys_differ_between_episodes_is_kept_exactly(tmp_path: Path) -> None:
    """Per-object randomization records name the episode's objects, so later episodes bring keys the first one lacks
    (a flat-column table built from the first row's keys dropped them); numpy values, None and lists survive too."""
    records = [
        {"success": True, "sim_seed": np.int64(5), "randomization": {"mass": {"red_cube": 0.1, "blue_cube": 0.2}}},
        {"success": False, "randomization": {"mass": {"green_cube": np.float32(0.5)}, "light": [0.1, 0.2]},
         "robot_params": {"dof": 6}, "note": None},
        {"success": True, "sim_seed": 7, "randomization": {}},
    ]  # fmt: skip
    writer = LeRobotWriter(tmp_path / "ds", 10, FEATURES, robot_type="arm", mode="create")
    for e, meta in enumerate(records):
        _add_episode_by_frames(writer, e, 12, task=TASKS[e], metadata=meta)
    writer.finalize()
    reader = LeRobotReader(tmp_path / "ds")
    want = json.loads(json.dumps(records, default=lambda v: v.item()))
    for e in range(3):
        got = reader.episode_metadata("train", e)
        assert {k: v for k, v in got.items() if k not in ("tasks", "length")} == want[e], e
    # LeRobot users still see the top-level values as columns of meta/episodes
    table = pq.read_table(next((tmp_path / "ds" / "meta" / "episodes").rglob("*.parquet")))
    assert table.column("success").to_pylist() == [True, False, True]
    assert table.column("sim_seed").to_pylist() == [5, None, 7]
    with pytest.raises(ValueError, match="cannot be stored"):
        _add_episode_by_frames(
            LeRobotWriter(tmp_path / "ds2", 10, FEATURES, robot_type="arm", mode="create"),
            0, 12, task=TASKS[0], metadata={"x": {"y": object()}},
        )  # fmt: skip


def test_add_frame_api_and_validation(tmp_path: Path) -> None:
    writer = LeRobotWriter(tmp_path / "ds", 10, FEATURES, robot_type="arm", mode="create")
    assert _add_episode_by_frames(writer, 0, 20) == 0
    assert (
        _add_episode_by_frames(writer, 1, 25, task=TASKS[1], metadata={"randomization": {"friction": 0.6}})
        == 1
    )
    frame = {k: v[0] for k, v in synthetic_episode(0, 1, CAMS, 6, 4, 0).items()}
    with pytest.raises(KeyError, match="missing feature"):
        writer.add_frame({k: v for k, v in frame.items() if k != "action"})
    with pytest.raises(KeyError, match="unknown feature"):
        writer.add_frame(frame | {"observation.stat": frame["observation.state"]})
    with pytest.raises(ValueError, match=r"observation\.state.*must be"):
        writer.add_frame(frame | {"observation.state": np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match="uint8"):
        writer.add_frame(
            frame | {"observation.images.front": frame["observation.images.front"].astype(np.float32)}
        )
    writer.add_frame(frame)
    with pytest.raises(ValueError, match="needs a task"):
        writer.save_episode()
    writer.clear_episode()
    writer.add_episode(synthetic_episode(2, 15, CAMS, 6, 4, 0), TASKS[2])
    writer.finalize()
    with pytest.raises(FileExistsError):
        LeRobotWriter(tmp_path / "ds", 10, FEATURES, mode="create")
    _check_exact(LeRobotReader(tmp_path / "ds"))


def test_resume_appends_to_existing_files(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    with LeRobotWriter(root, 10, FEATURES) as writer:
        for e in range(2):
            writer.add_episode(synthetic_episode(e, LENGTHS[e], CAMS, 6, 4, 0), TASKS[e])
    with pytest.raises(ValueError, match="differ"):
        LeRobotWriter(root, 10, {**FEATURES, "action": {"dtype": "float32", "shape": [5]}})
    with LeRobotWriter(root, 10, FEATURES) as writer:  # mode="append" (default) resumes
        assert writer.num_episodes == 2
        writer.add_episode(synthetic_episode(2, LENGTHS[2], CAMS, 6, 4, 0), TASKS[2])
    reader = LeRobotReader(root)
    _check_exact(reader)
    assert reader.read_episode("train", 2).steps["index"][0] == 45
    assert len(list((root / "videos").rglob("*.mp4"))) == 2  # still one concatenated file per camera


def test_files_roll_over_at_max_frames(tmp_path: Path) -> None:
    root = _make(tmp_path / "ds", max_frames_per_file=30, chunks_size=2)
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.mp4") if "front" in str(p))
    assert names == [  # 20 | 25 | 15 frames: each episode would push its file past 30 frames
        "videos/observation.images.front/chunk-000/file-000.mp4",
        "videos/observation.images.front/chunk-000/file-001.mp4",
        "videos/observation.images.front/chunk-001/file-000.mp4",
    ]
    assert len(list((root / "data").rglob("*.parquet"))) == 3
    _check_exact(LeRobotReader(root))


def test_episode_with_other_codec_headers_starts_a_new_file(tmp_path: Path) -> None:
    """Episodes encoded with other settings (here x264 CRF, which changes the PPS) never share a file with the
    current one's stream: the camera's file rolls over, also on resume, and every frame decodes exactly."""
    root, key, n = tmp_path / "ds", "observation.images.front", 8
    features = {"observation.state": FEATURES["observation.state"], key: FEATURES[key]}
    crfs = [30, 10, 30, 30, 10]  # -> files 0 | 1 | 2 2 | 3 (the last after a resume)
    episodes = []
    for e, crf in enumerate(crfs):
        frames = {key: np.stack([frame_code_image(e, i, 0, 64, 80) for i in range(n)]),
                  "observation.state": np.zeros((n, 6), np.float32)}  # fmt: skip
        episodes.append(encode_episode(frames, [key], 10, vcodec="h264", crf=crf))
        (tmp_path / f"ep{e}.mp4").write_bytes(episodes[-1].videos[key])
    with LeRobotWriter(root, 10, features, vcodec="h264") as writer:
        for e in range(4):
            writer.add_encoded_episode(episodes[e], TASKS[0])
    with LeRobotWriter(root, vcodec="h264") as writer:
        writer.add_encoded_episode(episodes[4], TASKS[0])
    dataset = open_dataset(root)
    for e in range(len(crfs)):
        got = dataset.read_images("train", e, list(range(n)), [key])[key]
        want = video.decode_frames(tmp_path / f"ep{e}.mp4", [i / 10 for i in range(n)], 0.05)
        assert got.tobytes() == want.tobytes(), e  # the episode's own stream, bit for bit
        assert [decode_frame_code(im)[:2] for im in got] == [(e, i) for i in range(n)]
    reader = LeRobotReader(root)
    records = [reader.meta.episodes[reader.meta.splits["train"][e]].videos[key] for e in range(len(crfs))]
    assert [path.name for path, _ in records] == ["file-000.mp4", "file-001.mp4", *["file-002.mp4"] * 2,
                                                  "file-003.mp4"]  # fmt: skip
    assert [start for _, start in records] == pytest.approx([0, 0, 0, n / 10, 0])
    heads = [video.stream_signature(path)["headers"] for path, _ in records]
    assert heads[0] == heads[2] == heads[3] != heads[1] == heads[4]


CRASH_SCRIPT = """
import os, signal, sys
from vla.data import video
from vla.data.writers.lerobot import LeRobotWriter
from vla.data.writers.synthetic import TASKS, synthetic_episode
root, where, cams, features = sys.argv[1], sys.argv[2], eval(sys.argv[3]), eval(sys.argv[4])
writer = LeRobotWriter(root, 10, features)
for e in range(2):
    writer.add_episode(synthetic_episode(e, 20, cams, 6, 4, 0), TASKS[e])
data = synthetic_episode(2, 20, cams, 6, 4, 0)
for i in range(10):
    writer.add_frame({k: v[i] for k, v in data.items()})
if where == "mid-episode":
    os.kill(os.getpid(), signal.SIGKILL)
video.concat_videos = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # die while staging the episode
writer.save_episode(task=TASKS[2])
"""


@pytest.mark.parametrize("where", ["mid-episode", "mid-save"])
def test_killed_writer_leaves_valid_resumable_dataset(tmp_path: Path, where: str) -> None:
    root = tmp_path / "ds"
    cmd = [sys.executable, "-c", CRASH_SCRIPT, str(root), where, repr(CAMS), repr(FEATURES)]
    proc = subprocess.run(cmd, capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    reader = LeRobotReader(root)  # staged leftovers of the unfinished episode are ignored
    assert reader.num_episodes("train") == 2
    with LeRobotWriter(root, 10, FEATURES) as writer:
        assert not (root / staging.STAGING_DIR).exists()
        writer.add_episode(synthetic_episode(2, 15, CAMS, 6, 4, 0), TASKS[2])
    reader = LeRobotReader(root)
    assert [reader.episode_length("train", e) for e in range(3)] == [20, 20, 15]
    _check_exact(reader)


def test_interrupted_commit_is_detected_and_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ds"
    writer = LeRobotWriter(root, 10, FEATURES)
    writer.add_episode(synthetic_episode(0, 20, CAMS, 6, 4, 0), TASKS[0])
    calls, real_replace = [], os.replace

    def flaky_replace(src: object, dst: object) -> None:
        calls.append(dst)
        if len(calls) == 3:  # manifest + first file renamed, then Ctrl-C
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(staging.os, "replace", flaky_replace)
    with pytest.raises(KeyboardInterrupt):
        writer.add_episode(synthetic_episode(1, 25, CAMS, 6, 4, 0), TASKS[1])
    monkeypatch.undo()
    with pytest.raises(
        DatasetFormatError, match=r"interrupted while committing an episode; re-run the vla command"
    ):
        LeRobotReader(root)
    LeRobotWriter(root).finalize()  # opening a writer finishes the commit
    reader = LeRobotReader(root)
    assert [reader.episode_length("train", e) for e in range(2)] == [20, 25]
    _check_exact(reader)


# ---- bad input ----------------------------------------------------------------------------------------------
@pytest.fixture
def copy_v3(v3_av1: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(v3_av1, tmp_path / "copy"))


@pytest.mark.parametrize(
    ("victim", "match"),
    [
        ("meta/info.json", r"meta/info\.json: missing"),
        ("meta/tasks.parquet", r"tasks\.parquet: missing"),
        ("meta/episodes/chunk-000/file-000.parquet", r"meta/episodes: no episode metadata"),
    ],
)
def test_missing_metadata_files(copy_v3: Path, victim: str, match: str) -> None:
    (copy_v3 / victim).unlink()
    with pytest.raises(DatasetFormatError, match=match):
        LeRobotReader(copy_v3)


def test_unsupported_version_and_incomplete_metadata(copy_v3: Path) -> None:
    info = json.loads((copy_v3 / "meta/info.json").read_text())
    (copy_v3 / "meta/info.json").write_text(json.dumps(info | {"codebase_version": "v1.6"}))
    with pytest.raises(DatasetFormatError, match=r"unsupported codebase_version 'v1\.6'"):
        LeRobotReader(copy_v3)
    (copy_v3 / "meta/info.json").write_text(json.dumps(info | {"total_episodes": 5}))
    with pytest.raises(DatasetFormatError, match=r"total_episodes=5.*lists 3"):
        LeRobotReader(copy_v3)


def test_truncated_parquet(copy_v3: Path) -> None:
    path = copy_v3 / "data/chunk-000/file-000.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    reader = LeRobotReader(copy_v3)  # metadata is fine; the data file fails when first read
    with pytest.raises(DatasetFormatError, match=r"data/chunk-000/file-000\.parquet: cannot read.*truncated"):
        reader.read_episode("train", 0)


@pytest.mark.parametrize("where", ["header", "packets"])
def test_corrupt_video(copy_v3: Path, where: str) -> None:
    path = copy_v3 / "videos/observation.images.wrist/chunk-000/file-000.mp4"
    data = bytearray(path.read_bytes())
    start = 0 if where == "header" else len(data) // 2
    stop = 64 if where == "header" else len(data)  # packets: the second half of the mdat, moov is in front
    data[start:stop] = np.random.default_rng(0).integers(0, 256, stop - start, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    reader = LeRobotReader(copy_v3)
    with pytest.raises(DatasetFormatError, match=r"wrist/chunk-000/file-000\.mp4.*(corrupt|re-encode)"):
        for e in range(3):
            reader.read_images(
                "train", e, list(range(reader.episode_length("train", e))), ["observation.images.wrist"]
            )


def test_column_dtype_and_shape_mismatch(copy_v3: Path) -> None:
    path = copy_v3 / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    state = np.stack(table["observation.state"].to_numpy(zero_copy_only=False)).astype(np.float64)
    i = table.column_names.index("observation.state")
    pq.write_table(table.set_column(i, "observation.state", pa.array(list(state))), path)
    with pytest.raises(
        DatasetFormatError, match=r"file-000\.parquet: column 'observation.state' is float64.*float32"
    ):
        LeRobotReader(copy_v3).read_episode("train", 0)
    info = json.loads((copy_v3 / "meta/info.json").read_text())
    info["features"]["action"]["shape"] = [7]
    (copy_v3 / "meta/info.json").write_text(json.dumps(info))
    pq.write_table(table, path)
    with pytest.raises(DatasetFormatError, match=r"column 'action' .*shape \(4,\).*\(7,\)"):
        LeRobotReader(copy_v3).read_episode("train", 1)


def test_frame_and_episode_out_of_range(v3_av1: Path) -> None:
    reader = LeRobotReader(v3_av1)
    with pytest.raises(FrameIndexError, match=r"frame 20 out of range for train episode 0 .*0\.\.19"):
        reader.read_images("train", 0, [3, 20], ["observation.images.front"])
    with pytest.raises(DatasetFormatError, match="frame -1 out of range"):
        reader.read_frame("train", 0, -1)
    with pytest.raises(IndexError, match="episode 3 out of range"):
        reader.read_episode("train", 3)
    with pytest.raises(KeyError, match="no split 'test'"):
        reader.num_episodes("test")


# ---- LeRobot interop ---------------------------------------------------------------------------------------
PEER_CHECK = (
    LOAD_ITEMS
    + """
for backend, res in result.items():
    ds = LeRobotDataset("local/" + root.name, root=root, video_backend=backend)
    res["stats_q01_action"] = np.asarray(ds.meta.stats["action"]["q01"]).tolist()
    chunk = LeRobotDataset("local/" + root.name, root=root, video_backend=backend,
                           delta_timestamps={"action": [i / ds.fps for i in range(5)]})[query[-1]]
    res["last_action_is_pad"] = chunk["action_is_pad"].tolist()
# LeRobot's own stats of episode 0 (action; front camera from the source frames) vs what our writer stored
import pyarrow.parquet as pq
from lerobot.datasets import compute_stats as cs
row = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()[0]
ds = LeRobotDataset("local/" + root.name, root=root)
actions = np.stack([ds[i]["action"].numpy() for i in range(row["length"])])
frames = np.load(out / "source_front_ep0.npy").transpose(0, 3, 1, 2)[cs.sample_indices(row["length"])]
frames = np.stack([cs.auto_downsample_height_width(f) for f in frames])
image = cs.get_feature_stats(frames, axis=(0, 2, 3), keepdims=True)
result["stats"] = {
    "action": {k: [np.asarray(v).tolist(), row[f"stats/action/{k}"]] for k, v in
               cs.get_feature_stats(actions, axis=0, keepdims=False).items()},
    "front": {k: [np.asarray(v if k == "count" else v[0] / 255).tolist(), row[f"stats/observation.images.front/{k}"]]
              for k, v in image.items()},
}
(out / "result.json").write_text(json.dumps(result))
"""
)


def _run_lerobot_check(root: Path, out: Path) -> None:
    np.save(
        out / "source_front_ep0.npy",
        synthetic_episode(0, LENGTHS[0], CAMS, 6, 4, 0)["observation.images.front"],
    )


def _check_lerobot_result(root: Path, out: Path, query: list[int], result: dict) -> None:
    starts = np.cumsum([0, *LENGTHS])
    for name, stats in result.pop("stats").items():  # [LeRobot's compute_stats, what we stored]
        for stat, (theirs, ours) in stats.items():
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7, err_msg=f"{name} {stat}")
    for backend, res in result.items():
        assert (res["len"], res["num_episodes"], res["fps"]) == (60, 3, 10), backend
        for idx, row in zip(query, res["items"]):
            e = int(np.searchsorted(starts, idx, side="right") - 1)
            f = idx - starts[e]
            ref = synthetic_episode(e, LENGTHS[e], CAMS, 6, 4, 0)
            np.testing.assert_array_equal(np.float32(row["observation.state"]), ref["observation.state"][f])
            assert (row["episode_index"], row["frame_index"], row["index"], row["task"]) == (
                e,
                f,
                idx,
                TASKS[e],
            )
            for cam, name in enumerate(CAMS):
                image = np.load(out / f"{backend}-{idx}-observation.images.{name}.npy")
                assert decode_frame_code(image) == (e, f, cam), (backend, idx, name)
        assert res["last_action_is_pad"] == [False, True, True, True, True]  # last frame of episode 0
        ours = json.loads((root / "meta/stats.json").read_text())["action"]["q01"]
        np.testing.assert_allclose(res["stats_q01_action"], ours)


QUERY = [0, 37, 20, 59, 45, 19]


def test_peer_venv_lerobot_loads_our_dataset(v3_av1: Path, tmp_path: Path) -> None:
    python = peer_python()
    if python is None:
        pytest.skip("LeRobot peer venv not found (set PEER_VENV or run ../shared/peer/setup_lerobot_venv.sh)")
    _run_lerobot_check(v3_av1, tmp_path)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_LEROBOT_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [str(python), "-c", PEER_CHECK, str(v3_av1), json.dumps(QUERY), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_lerobot_result(v3_av1, tmp_path, QUERY, json.loads((tmp_path / "result.json").read_text()))


@pytest.fixture(scope="module")
def lerobot_written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A v3.0 dataset written by LeRobot's own writer (peer ``make-dataset``) and its expectations JSON."""
    root, expect = PEER_CACHE / "lerobot_v3_sample", PEER_CACHE / "lerobot_v3_sample_expect.json"
    if not (root / "meta/info.json").exists() or not expect.exists():
        python = peer_python()
        if python is None or not PEER_SCRIPT.exists():
            pytest.skip(
                "no LeRobot-written sample (run peer_lerobot_bench.py make-dataset) and no peer venv to make one"
            )
        tmp = tmp_path_factory.mktemp("peer")
        root, expect = tmp / "lerobot_v3_sample", tmp / "expect.json"
        cmd = [str(python), str(PEER_SCRIPT), "make-dataset", "--root", str(root), "--expect", str(expect)]
        subprocess.run(
            cmd, check=True, capture_output=True, env=os.environ | {"HF_HUB_OFFLINE": "1"}, timeout=600
        )
    return root, json.loads(expect.read_text())


def _peer_state(ep: int, t: int) -> np.ndarray:  # the peer's documented generator
    j = np.arange(8, dtype=np.float64)
    return (0.5 * np.sin(2 * np.pi * (0.05 + 0.02 * j) * t / 10 * 4 + 0.3 * ep + 0.7 * j)).astype(np.float32)


def test_reads_dataset_written_by_lerobot(lerobot_written: tuple[Path, dict]) -> None:
    root, expect = lerobot_written
    reader = LeRobotReader(root)
    assert reader.format == "lerobot_v3.0" and reader.num_frames("train") == expect["total_frames"]
    for e in range(reader.num_episodes("train")):
        ep = reader.read_episode("train", e)
        np.testing.assert_array_equal(
            ep.steps["observation.state"], np.stack([_peer_state(e, t) for t in range(ep.length)])
        )
        assert set(ep.steps["task"]) == {expect["task_of_episode"][str(e)]}
    q = expect["query"]
    frame = reader.read_frame("train", q["episode_index"], q["frame_index"])
    assert frame["task"] == expect["task"] and frame["index"] == q["global_index"]
    np.testing.assert_array_equal(frame["action"], np.float32(expect["action"]))
    for key, image in expect["images"].items():  # same pixels as LeRobot's own decode (pyav == torchcodec)
        np.testing.assert_allclose(
            frame[key].reshape(-1, 3).mean(0) / 255, image["decoded_mean_per_channel_rgb"], atol=1e-6
        )
    # random access == sequential decode for every frame of every episode
    key = "observation.images.front"
    for e in range(reader.num_episodes("train")):
        n = reader.episode_length("train", e)
        sequential = reader.read_images("train", e, list(range(n)), [key])[key]
        video.close_decoders()
        for f in random.Random(e).sample(range(n), 8):
            np.testing.assert_array_equal(reader.read_images("train", e, [f], [key])[key][0], sequential[f])


def test_append_to_dataset_written_by_lerobot(lerobot_written: tuple[Path, dict], tmp_path: Path) -> None:
    import shutil

    root = Path(shutil.copytree(lerobot_written[0], tmp_path / "appended"))
    with LeRobotWriter(root) as writer:  # resume: features, codec and files come from the existing dataset
        assert writer.num_episodes == 6
        frames = {"observation.state": np.ones((12, 8), np.float32), "action": np.zeros((12, 7), np.float32)}
        for cam, name in enumerate(("front", "wrist")):
            frames[f"observation.images.{name}"] = np.stack(
                [frame_code_image(6, i, cam, 96, 128) for i in range(12)]
            )
        assert writer.add_episode(frames, "a new task") == 6
    reader = LeRobotReader(root)
    assert reader.num_episodes("train") == 7 and len(list((root / "videos").rglob("*.mp4"))) == 2
    ep = reader.read_episode("train", 6)
    assert ep.steps["task"][0] == "a new task" and ep.steps["index"][0] == 240
    images = reader.read_images("train", 6, [11, 0, 5], reader.image_keys())
    assert [decode_frame_code(im) for im in images["observation.images.wrist"]] == [
        (6, 11, 1),
        (6, 0, 1),
        (6, 5, 1),
    ]
    state = reader.read_episode("train", 3).steps["observation.state"]  # LeRobot's episodes are untouched
    np.testing.assert_array_equal(state, np.stack([_peer_state(3, t) for t in range(40)]))


# Peer venv script: ``python -c FEATURE_STATS IN.npy OUT.json``: LeRobot's own per-feature stats of an array.
FEATURE_STATS = """
import json, sys
import numpy as np
from lerobot.datasets.compute_stats import get_feature_stats
stats = get_feature_stats(np.load(sys.argv[1]), axis=0, keepdims=False)
open(sys.argv[2], "w").write(json.dumps({k: np.asarray(v).tolist() for k, v in stats.items()}))
"""


def test_stats_match_lerobot_compute_stats(tmp_path: Path) -> None:
    python = peer_python()
    if python is None:
        pytest.skip("LeRobot peer venv not found (set PEER_VENV or run ../shared/peer/setup_lerobot_venv.sh)")
    from vla.data.writers.lerobot_episode import episode_stats

    data = synthetic_episode(0, 20, CAMS, 6, 4, 0)
    features = {"action": {"dtype": "float32", "shape": [4]}}
    ours = episode_stats({"action": data["action"]}, features)["action"]
    np.save(tmp_path / "action.npy", data["action"])
    proc = subprocess.run(
        [str(python), "-c", FEATURE_STATS, str(tmp_path / "action.npy"), str(tmp_path / "stats.json")],
        capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads((tmp_path / "stats.json").read_text())
    assert theirs and set(theirs) <= set(ours), (sorted(theirs), sorted(ours))
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-6, err_msg=name)
