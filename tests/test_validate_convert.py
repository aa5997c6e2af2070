"""Integration tests of ``vla data validate`` and ``vla data convert`` as a user runs them.

Validate: clean datasets pass (exit 0); datasets with several problems injected at once (NaN, truncated video,
corrupt JPEG/PNG, wrong-size image, frame_index and timestamp gaps, a record with a bad CRC) report every problem in
one pass with its location (exit 1), and nothing on the clean episodes. Convert: the output reads back with
``LeRobotReader`` and standardizes to the same frames as the source (state/action exactly, prompt equal, images
exactly with ``--no-video``, close with lossy video).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vla.cli import main
from vla.data.readers import open_dataset
from vla.data.readers.lerobot import LeRobotReader
from vla.data.standardize import standardize_episode
from vla.data.writers.rlds import droid_features, synthetic_droid_episode, write_rlds
from vla.data.writers.synthetic import make_lerobot_dataset

DROID_IMAGE = (24, 32, 3)
DROID_LENGTHS = (4, 5, 6, 7, 8)
CAMERAS = {"front": (24, 32), "side": (24, 32)}  # generic LeRobot map for widowx_bridge: primary, secondary


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLA_DEBUG", raising=False)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(rc: int, out: str, err: str, *needles: str) -> str:
    """Exit 2, nothing on stdout, one ``error: ...`` line on stderr containing every needle, no traceback."""
    assert rc == 2, (rc, out, err)
    assert out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def validate(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, list[dict[str, str]], str]:
    """Run ``validate --json`` and plain ``validate``; check they agree -> (exit code, problems, text output)."""
    rc, out, _ = run_cli(capsys, "data", "validate", path, "--json")
    problems = json.loads(out)
    assert isinstance(problems, list) and all(set(p) == {"kind", "where", "message", "fix"} for p in problems)
    rc_text, text, _ = run_cli(capsys, "data", "validate", path)
    assert rc_text == rc
    lines = text.strip().splitlines()
    if problems:
        assert lines[-1] == f"{len(problems)} problem(s) found in {path}"
        assert len(lines) == len(problems) + 1
        for p, line in zip(problems, lines):
            assert line.startswith(f"[{p['kind']}] {p['where']}: {p['message']}")
    else:
        assert lines == [f"OK: no problems found in {path}"]
    return rc, problems, text


def at(problems: list[dict[str, str]], episode: int) -> list[dict[str, str]]:
    """Problems located at ``episode`` (``where`` ends the location with ``episode N`` or ``episode N field ...``)."""
    return [p for p in problems if f" episode {episode} " in p["where"] + " "]


def stats_problem(p: dict[str, str]) -> bool:
    return p["kind"] == "degenerate_stats" and " embodiment " in p["where"]


# ---- datasets ------------------------------------------------------------------------------------------------


def droid_episodes(seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [synthetic_droid_episode(rng, n, DROID_IMAGE) for n in DROID_LENGTHS]


def write_droid(root: Path, episodes: list[dict[str, Any]]) -> list[int]:
    """DROID-shaped RLDS named "droid" (DROID key map), 3 shards, shuffled; returns input index per reader episode."""
    return write_rlds(
        root / "1.0.0",
        "droid",
        {"train": episodes},
        *droid_features(DROID_IMAGE),
        num_shards=3,
        shuffle_seed=3,
    )["train"]


def widowx_lerobot(root: Path, **kwargs: Any) -> Path:
    args: dict[str, Any] = dict(
        num_episodes=3, episode_length=8, cameras=CAMERAS, state_dim=7, action_dim=7, fps=5,
        robot_type="widowx_bridge",
    )  # fmt: skip
    return make_lerobot_dataset(root, **(args | kwargs))


def edit_parquet(path: Path, fn: Any) -> None:
    """Rewrite a parquet file after ``fn(columns: dict[str, list])`` edits its rows in place (same schema)."""
    table = pq.read_table(path)
    columns = table.to_pydict()
    fn(columns)
    pq.write_table(pa.table(columns, schema=table.schema), path)


def png_bytes(shape: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full(shape, 99, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


# ---- vla data validate ---------------------------------------------------------------------------------------


def test_validate_clean_datasets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lerobot = widowx_lerobot(tmp_path / "widowx")
    write_droid(tmp_path / "droid", droid_episodes(0))
    for path in (lerobot, tmp_path / "droid"):
        rc, problems, _ = validate(capsys, path)
        assert (rc, problems) == (0, [])


def test_validate_bridge_fixture_is_clean(bridge_fixture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, problems, _ = validate(capsys, bridge_fixture)
    assert (rc, problems) == (0, [])


def test_validate_reports_every_lerobot_problem_in_one_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One file per episode; NaN (ep 0), truncated video (ep 1), frame_index gap (ep 2), timestamp gap (ep 3)."""
    root = widowx_lerobot(tmp_path / "broken", num_episodes=5, max_frames_per_file=8)
    data = sorted((root / "data").rglob("*.parquet"))
    assert len(data) == 5, "one data file per episode"

    def nan_action(c: dict[str, list]) -> None:
        c["action"][2][3] = float("nan")

    def frame_index_gap(c: dict[str, list]) -> None:
        c["frame_index"][4:] = [i + 1 for i in c["frame_index"][4:]]

    def timestamp_gap(c: dict[str, list]) -> None:
        c["timestamp"][5:] = [t + 1.0 for t in c["timestamp"][5:]]

    edit_parquet(data[0], nan_action)
    video = sorted((root / "videos" / "observation.images.front").rglob("*.mp4"))[1]
    video.write_bytes(video.read_bytes()[: video.stat().st_size // 2])
    edit_parquet(data[2], frame_index_gap)
    edit_parquet(data[3], timestamp_gap)

    rc, problems, _ = validate(capsys, root)
    assert rc == 1
    (p,) = at(problems, 0)
    assert p["kind"] == "non_finite" and p["where"].endswith("episode 0 field 'action'")
    assert "1 frame(s)" in p["message"] and "[2]" in p["message"]
    (p,) = at(problems, 1)  # only the front camera is broken; the side camera of episode 1 decodes
    assert p["kind"] == "undecodable_image" and p["where"].endswith(
        "episode 1 image 'observation.images.front'"
    )
    assert "8 frame(s)" in p["message"] and str(video) in p["message"]
    (p,) = at(problems, 2)
    assert "frame_index" in p["where"] + p["message"]
    (p,) = at(problems, 3)
    assert p["kind"] == "missing_frames" and p["where"].endswith("episode 3 field 'timestamp'")
    assert "after frames [4]" in p["message"]
    assert at(problems, 4) == []
    others = [p for p in problems if not any(p in at(problems, e) for e in range(5))]
    assert all(stats_problem(p) for p in others), others  # the NaN also makes the action stats non-finite


def test_validate_reports_image_problems_in_a_shared_data_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PNG images in the parquet (all episodes in one file): a corrupt PNG (ep 1 frame 2), a PNG of the wrong
    size (ep 0 frame 5, side camera) and a NaN state (ep 2 frame 6) are all reported with their locations."""
    root = widowx_lerobot(tmp_path / "broken_png", video=False)
    (data,) = sorted((root / "data").rglob("*.parquet"))

    def damage(c: dict[str, list]) -> None:
        c["observation.images.front"][8 + 2] = {"bytes": b"\x89PNG\r\n\x1a\n truncated", "path": None}
        c["observation.images.side"][5] = {"bytes": png_bytes((10, 12, 3)), "path": None}
        c["observation.state"][16 + 6][0] = float("nan")

    edit_parquet(data, damage)
    rc, problems, _ = validate(capsys, root)
    assert rc == 1
    (p,) = at(problems, 0)
    assert p["kind"] in ("undecodable_image", "shape") and "image 'observation.images.side'" in p["where"]
    assert "(10, 12, 3)" in p["message"] or "[10, 12, 3]" in p["message"]
    (p,) = at(problems, 1)
    assert p["kind"] == "undecodable_image" and p["where"].endswith(
        "episode 1 image 'observation.images.front'"
    )
    assert "1 frame(s)" in p["message"] and "[2]" in p["message"]
    (p,) = at(problems, 2)
    assert p["kind"] == "non_finite" and p["where"].endswith("episode 2 field 'observation.state'")
    assert "[6]" in p["message"]


def test_validate_frame_index_gap_does_not_hide_other_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The common LeRobot v3 layout: every episode in one data file. NaN in episode 0, frame_index gap in 2."""
    root = widowx_lerobot(tmp_path / "one_file", num_episodes=4)
    (data,) = sorted((root / "data").rglob("*.parquet"))

    def damage(c: dict[str, list]) -> None:
        c["action"][2][3] = float("nan")
        c["frame_index"][16 + 4 : 24] = [i + 1 for i in c["frame_index"][16 + 4 : 24]]

    edit_parquet(data, damage)
    rc, problems, _ = validate(capsys, root)
    assert rc == 1
    assert [p["kind"] for p in at(problems, 0)] == ["non_finite"]
    (p,) = at(problems, 2)
    assert "frame_index" in p["where"] and "[4]" in p["message"]  # missing frame 4
    assert at(problems, 1) == [] and at(problems, 3) == []


def test_validate_reports_every_rlds_problem_in_one_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """NaN in one episode, a corrupt JPEG in another, a record whose bytes were flipped (CRC) in a third."""
    episodes = droid_episodes(5)
    episodes[1]["steps"]["action_dict/joint_velocity"][2, 4] = np.nan
    wrist = list(episodes[3]["steps"]["observation/wrist_image_left"])
    wrist[3] = b"\xff\xd8\xff\xe0 not a jpeg"
    episodes[3]["steps"]["observation/wrist_image_left"] = wrist
    order = write_droid(tmp_path / "droid", episodes)
    shards = sorted((tmp_path / "droid" / "1.0.0").glob("droid-train.tfrecord-*"))
    last = bytearray(shards[-1].read_bytes())  # holds only the last reader episode
    last[len(last) // 2] ^= 0xFF
    shards[-1].write_bytes(bytes(last))
    nan_ep, jpeg_ep, crc_ep = order.index(1), order.index(3), len(order) - 1
    assert len({nan_ep, jpeg_ep, crc_ep}) == 3

    rc, problems, _ = validate(capsys, tmp_path / "droid")
    assert rc == 1
    (p,) = at(problems, nan_ep)
    assert p["kind"] == "non_finite" and p["where"].endswith(
        f"episode {nan_ep} field 'action_dict/joint_velocity'"
    )
    assert "[2]" in p["message"]
    (p,) = at(problems, jpeg_ep)
    assert p["kind"] == "undecodable_image"
    assert p["where"].endswith(f"episode {jpeg_ep} image 'observation/wrist_image_left'")
    assert "1 frame(s)" in p["message"] and "[3]" in p["message"]
    (p,) = at(problems, crc_ep)
    assert p["kind"] == "unreadable" and shards[-1].name in p["message"]
    for clean in set(range(len(order))) - {nan_ep, jpeg_ep, crc_ep}:
        assert at(problems, clean) == []
    others = [p for p in problems if not any(p in at(problems, e) for e in range(len(order)))]
    assert all(stats_problem(p) for p in others), others


def test_validate_max_episodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = widowx_lerobot(tmp_path / "w", num_episodes=3, max_frames_per_file=8)
    edit_parquet(
        sorted((root / "data").rglob("*.parquet"))[2], lambda c: c["action"][0].__setitem__(0, np.inf)
    )
    assert run_cli(capsys, "data", "validate", root, "--max-episodes", 2)[0] == 0
    rc, out, _ = run_cli(capsys, "data", "validate", root)
    assert rc == 1 and "episode 2 field 'action'" in out


# ---- vla data convert ----------------------------------------------------------------------------------------


def assert_same_standardized(
    src: Any, src_split: str, src_ep: int, dst: Any, dst_ep: int, exact: bool, dst_split: str = "train"
) -> int:
    """Standardized frames of the source episode == those of the converted episode; returns the frame count."""
    a = standardize_episode(src, src_split, src_ep)
    b = standardize_episode(dst, dst_split, dst_ep)
    assert b.embodiment == a.embodiment
    assert len(b) == len(a) > 0
    np.testing.assert_array_equal(b.state, a.state)
    np.testing.assert_array_equal(b.action, a.action)
    assert b.prompt == a.prompt
    assert set(b.cameras) == set(a.cameras)
    imgs_a = src.read_images(src_split, src_ep, a.frames.tolist(), list(a.cameras.values()))
    imgs_b = dst.read_images(dst_split, dst_ep, b.frames.tolist(), list(b.cameras.values()))
    for slot in a.cameras:
        x, y = imgs_a[a.cameras[slot]], imgs_b[b.cameras[slot]]
        assert x.shape == y.shape
        if exact:
            np.testing.assert_array_equal(y, x, err_msg=slot)
        else:
            assert np.abs(x.astype(np.float64) - y).mean() < 4.0, slot
    return len(a)


@pytest.mark.parametrize("flags", [["--no-video"], [], ["--vcodec", "h264"]], ids=["png", "av1", "h264"])
def test_convert_droid_rlds(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    episodes = droid_episodes(7)
    write_droid(tmp_path / "droid", episodes)
    dst = tmp_path / "droid_lerobot"
    rc, out, err = run_cli(capsys, "data", "convert", tmp_path / "droid", dst, "--to", "lerobot", *flags)
    assert rc == 0, err
    assert out.splitlines()[0] == f"wrote {dst}"
    assert f"  split 'train': {len(episodes)} episodes" in out

    reader = LeRobotReader(dst)
    info = json.loads((dst / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["robot_type"] == "franka_droid" and info["fps"] == 15
    assert info["features"]["observation.state"]["shape"] == [8]
    assert info["features"]["action"]["shape"] == [8]
    kind = "image" if flags == ["--no-video"] else "video"
    for slot in ("primary", "secondary", "wrist"):
        assert info["features"][f"observation.images.{slot}"]["dtype"] == kind
    src = open_dataset(tmp_path / "droid")
    assert reader.splits() == ["train"] and reader.num_episodes("train") == len(episodes)
    for e in range(len(episodes)):
        meta = reader.episode_metadata("train", e)
        assert (meta["source_split"], meta["source_episode"]) == ("train", e)
        assert meta["file_path"] == src.episode_metadata("train", e)["file_path"]
        n = assert_same_standardized(src, "train", e, reader, e, exact=kind != "video")
        assert reader.episode_length("train", e) == n == src.episode_length("train", e)


def test_convert_bridge_fixture(
    bridge_fixture: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "bridge_lerobot"
    rc, out, err = run_cli(capsys, "data", "convert", bridge_fixture, dst, "--to", "lerobot", "--no-video")
    assert rc == 0, err
    reader = LeRobotReader(dst)
    src = open_dataset(bridge_fixture)
    assert reader.robot_type == "widowx_bridge" and reader.fps == 5
    # the val split stays val: nothing of it leaks into train
    info = json.loads((dst / "meta" / "info.json").read_text())
    assert info["splits"] == {"train": "0:25", "val": "25:50"}
    assert reader.splits() == ["train", "val"]
    assert [reader.num_episodes(s) for s in ("train", "val")] == [25, 25]
    for split in ("train", "val"):
        for e in range(25):
            meta = reader.episode_metadata(split, e)
            assert (meta["source_split"], meta["source_episode"]) == (split, e)
            assert meta["episode_id"] == src.episode_metadata(split, e)["episode_id"]
            # Bridge's dropped frames (all-zero first step, last step without a next state) are not written
            assert assert_same_standardized(src, split, e, reader, e, exact=True, dst_split=split) == 8
            assert reader.episode_length(split, e) == 8
    lines = out.strip().splitlines()
    assert lines[0] == f"wrote {dst}"
    assert "  split 'train': 25 episodes, 200 frames" in lines
    assert "  split 'val': 25 episodes, 200 frames" in lines
    assert "  camera kept: observation/image_0 -> observation.images.primary" in lines
    dropped = [line for line in lines if line.startswith("  camera dropped: ")]
    assert sorted(line.split()[2] for line in dropped) == ["observation/image_2", "observation/image_3"]
    assert all("no camera slot in the 'widowx_bridge' key map" in line for line in dropped)
    frames_dropped = [line for line in lines if line.startswith("  frames dropped: ")]
    assert frames_dropped and sum(int(line.split()[2]) for line in frames_dropped) == 100  # 2 per episode
    assert any("drop_first" in line for line in frames_dropped)


def test_convert_keeps_every_split_and_says_what_it_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(11)
    train = [synthetic_droid_episode(rng, n, DROID_IMAGE) for n in (4, 5, 6)]
    val = [synthetic_droid_episode(rng, n, DROID_IMAGE) for n in (7, 8)]
    write_rlds(tmp_path / "droid" / "1.0.0", "droid", {"train": train, "val": val},
               *droid_features(DROID_IMAGE))  # fmt: skip
    dst = tmp_path / "out"
    rc, out, err = run_cli(
        capsys, "data", "convert", tmp_path / "droid", dst, "--to", "lerobot", "--no-video"
    )
    assert rc == 0, err
    info = json.loads((dst / "meta" / "info.json").read_text())
    assert info["splits"] == {"train": "0:3", "val": "3:5"}
    reader, src = LeRobotReader(dst), open_dataset(tmp_path / "droid")
    for split, n in (("train", 3), ("val", 2)):
        assert reader.num_episodes(split) == n
        frames = sum(reader.episode_length(split, e) for e in range(n))
        assert f"  split {split!r}: {n} episodes, {frames} frames" in out.splitlines()
        for e in range(n):
            assert reader.episode_metadata(split, e)["source_split"] == split
            assert_same_standardized(src, split, e, reader, e, exact=True, dst_split=split)
    assert "camera kept: " in out and "camera dropped: " not in out


def test_convert_max_episodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_droid(tmp_path / "droid", droid_episodes(8))
    dst = tmp_path / "two"
    rc, _, err = run_cli(capsys, "data", "convert", tmp_path / "droid", dst, "--to", "lerobot", "--no-video",
                         "--max-episodes", 2)  # fmt: skip
    assert rc == 0, err
    assert LeRobotReader(dst).num_episodes("train") == 2


def test_convert_without_key_map_or_frame_rate_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vla.data.writers.rlds import tensor

    ep = {"steps": {"observation/state": np.zeros((3, 2), np.float32)}, "episode_metadata": {}}
    write_rlds(tmp_path / "my_unmapped_set" / "1.0.0", "my_unmapped_set", {"train": [ep]},
               {"observation/state": tensor([2])})  # fmt: skip
    dst = tmp_path / "out"
    res = run_cli(capsys, "data", "convert", tmp_path / "my_unmapped_set", dst, "--to", "lerobot")
    assert_user_error(*res, "frame rate", "key map")
    assert not (dst / "meta" / "info.json").exists()


@pytest.mark.parametrize("existing", ["dataset", "file"])
def test_convert_to_an_existing_destination_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], existing: str
) -> None:
    write_droid(tmp_path / "droid", droid_episodes(9))
    dst = tmp_path / "dst"
    if existing == "dataset":
        widowx_lerobot(dst, num_episodes=1)
    else:
        dst.write_text("not a folder")
    before = {p: p.stat().st_mtime_ns for p in [dst, *dst.rglob("*")]}
    res = run_cli(capsys, "data", "convert", tmp_path / "droid", dst, "--to", "lerobot", "--no-video")
    assert_user_error(*res, str(dst))
    assert {p: p.stat().st_mtime_ns for p in [dst, *dst.rglob("*")]} == before, "DST is left untouched"


def test_convert_refuses_a_non_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_droid(tmp_path / "droid", droid_episodes(10))
    dst = tmp_path / "my_project"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    res = run_cli(capsys, "data", "convert", tmp_path / "droid", dst, "--to", "lerobot", "--no-video")
    assert sorted(os.listdir(dst)) == ["notes.txt"], "nothing is written next to the user's files"
    assert_user_error(*res, str(dst))


def test_convert_lerobot_v21_to_v30(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src_root = widowx_lerobot(tmp_path / "v21", num_episodes=2, episode_length=6, version="v2.1", video=False)
    dst = tmp_path / "v30"
    rc, _, err = run_cli(capsys, "data", "convert", src_root, dst, "--to", "lerobot", "--no-video")
    assert rc == 0, err
    src, reader = LeRobotReader(src_root), LeRobotReader(dst)
    assert src.format == "lerobot_v2.1" and reader.format == "lerobot_v3.0"
    for e in range(2):
        assert assert_same_standardized(src, "train", e, reader, e, exact=True) == 6


def test_convert_lerobot_without_key_map_copies_fields_as_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src_root = make_lerobot_dataset(
        tmp_path / "arm", num_episodes=2, episode_length=6, cameras={"front": (24, 32)}, state_dim=3,
        action_dim=2, fps=10, version="v2.1", video=False, robot_type="synthetic_arm",
    )  # fmt: skip
    dst = tmp_path / "arm_v30"
    rc, _, err = run_cli(capsys, "data", "convert", src_root, dst, "--to", "lerobot", "--no-video")
    assert rc == 0, err
    src, reader = LeRobotReader(src_root), LeRobotReader(dst)
    assert reader.fps == 10 and reader.num_episodes("train") == 2
    for e in range(2):
        a, b = src.read_episode("train", e), reader.read_episode("train", e)
        for key in ("observation.state", "action", "task"):
            np.testing.assert_array_equal(b.steps[key], a.steps[key])
        frames = list(range(a.length))
        np.testing.assert_array_equal(
            reader.read_images("train", e, frames, ["observation.images.front"])["observation.images.front"],
            src.read_images("train", e, frames, ["observation.images.front"])["observation.images.front"],
        )


def test_convert_overwrite_replaces_only_a_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_droid(tmp_path / "droid", droid_episodes(12))
    dst = tmp_path / "dst"
    widowx_lerobot(dst, num_episodes=1)
    argv = ("data", "convert", tmp_path / "droid", dst, "--to", "lerobot", "--no-video")
    assert_user_error(*run_cli(capsys, *argv), str(dst), "--overwrite")
    rc, _, err = run_cli(capsys, *argv, "--overwrite")
    assert rc == 0, err
    assert LeRobotReader(dst).robot_type == "franka_droid"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert_user_error(*run_cli(capsys, "data", "convert", tmp_path / "droid", mine, "--to", "lerobot",
                               "--overwrite"), str(mine))  # fmt: skip
    assert sorted(os.listdir(mine)) == ["notes.txt"]
