"""Integration tests of the ``vla`` command as a user runs it: ``vla data info|show|stats|preview`` and ``vla demo``.

Every dataset is written here (LeRobot v3.0 by our writer, RLDS by ``write_rlds``) or is the team's genuine Open
X-Embodiment fixture; every value the CLI prints is checked against the files read independently of the readers
(TFRecord records parsed with ``parse_example``, parquet read with pyarrow, JPEG/PNG decoded with Pillow, video
decoded with PyAV). The CLI runs in-process through ``vla.cli.main`` and, where the console script itself matters,
as a subprocess of ``.venv/bin/vla``. ``vla data validate`` and ``vla data convert`` live in
``test_validate_convert.py``.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vla.cli import main
from vla.data.keymaps.conversions import binarize_gripper
from vla.data.preview import CAMERA_HEIGHT
from vla.data.readers.tfrecord import iter_tfrecord, parse_example
from vla.data.writers.rlds import (
    droid_features,
    image,
    scalar,
    synthetic_droid_episode,
    tensor,
    text,
    write_rlds,
)
from vla.data.writers.synthetic import TASKS, decode_frame_code, make_lerobot_dataset

REPO_ROOT = Path(__file__).resolve().parents[1]
VLA_BIN = Path(sys.executable).parent / "vla"
SHOW_KEYS = {"format", "split", "episode", "frame", "num_frames", "episode_metadata", "raw", "standardized"}
SHOW_EXTRA_KEYS = {"path", "standardized_note"}  # also printed; not part of the parsed contract
DROID_IMAGE = (24, 32, 3)
DROID_LENGTHS = (4, 5, 6, 7, 8)  # distinct lengths: a wrong episode shows up in num_frames too
CAMERAS = {"front": (24, 32), "side": (24, 32)}  # generic LeRobot map: front -> primary, side -> secondary
LEROBOT_LENGTHS = [8, 10, 6]


# ---- running the CLI ------------------------------------------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """``vla *argv`` in-process -> (exit code, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _no_nan_constants(name: str) -> Any:
    raise AssertionError(f"`vla data show --json` printed {name}, which is not JSON")


def parse_one_json_line(out: str) -> Any:
    """The contract: exactly one line of strict JSON (no NaN/Infinity tokens)."""
    assert out.endswith("\n") and out.count("\n") == 1, f"expected one JSON line, got {out[:300]!r}"
    return json.loads(out, parse_constant=_no_nan_constants)


def show(capsys: pytest.CaptureFixture[str], path: Path, *args: object) -> dict[str, Any]:
    rc, out, err = run_cli(capsys, "data", "show", path, *args, "--json")
    assert rc == 0, err
    obj = parse_one_json_line(out)
    assert SHOW_KEYS - {"standardized"} <= set(obj), f"missing contract keys: {SHOW_KEYS - set(obj)}"
    assert set(obj) <= SHOW_KEYS | SHOW_EXTRA_KEYS, (
        f"unexpected keys {set(obj) - SHOW_KEYS - SHOW_EXTRA_KEYS}"
    )
    return obj


def assert_user_error(rc: int, out: str, err: str, *needles: str) -> str:
    """Exit 2, nothing on stdout, one ``error: ...`` line on stderr containing every needle, no traceback."""
    assert rc == 2, (rc, out, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected a one-line error, got {err!r}"
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def image_mean_of_bytes(data: bytes) -> tuple[list[int], float, np.ndarray]:
    """Decode JPEG/PNG bytes with Pillow -> (shape, mean pixel value, RGB array)."""
    arr = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    return list(arr.shape), float(arr.astype(np.float64).mean()), arr


def records_in_file_order(version_dir: Path, name: str, split: str) -> list[bytes]:
    """Every episode record of a split, as RLDS readers must count them: shard files by name, then records."""
    shards = sorted(version_dir.glob(f"{name}-{split}.tfrecord-*"))
    assert shards, f"no shards of {name}/{split} in {version_dir}"
    return [rec for shard in shards for rec in iter_tfrecord(shard)]


# ---- datasets -------------------------------------------------------------------------------------------------


@dataclass
class RLDSData:
    root: Path  # what the user passes (the folder holding 1.0.0/)
    version_dir: Path
    name: str
    episodes: list[dict[str, Any]]  # input episodes
    order: list[int]  # reader episode k is input episode order[k]


@pytest.fixture(scope="module")
def droid_rlds(tmp_path_factory: pytest.TempPathFactory) -> RLDSData:
    """DROID-shaped RLDS named "droid" (so the DROID key map applies): 5 episodes shuffled over 3 shards."""
    root = tmp_path_factory.mktemp("rlds") / "droid"
    rng = np.random.default_rng(1)
    episodes = [synthetic_droid_episode(rng, n, DROID_IMAGE) for n in DROID_LENGTHS]
    order = write_rlds(
        root / "1.0.0",
        "droid",
        {"train": episodes},
        *droid_features(DROID_IMAGE),
        num_shards=3,
        shuffle_seed=3,
    )["train"]
    return RLDSData(root, root / "1.0.0", "droid", episodes, order)


UNMAPPED_STEPS = {
    "observation/state": tensor([3]),
    "action": tensor([2]),
    "language_instruction": text(),
    "is_first": scalar("bool"),
    "observation/image": image([16, 16, 3], encoding="png"),
}


def _unmapped_episode(rng: np.random.Generator, length: int, episode_id: int) -> dict[str, Any]:
    first = np.zeros(length, dtype=bool)
    first[0] = True
    steps = {
        "observation/state": rng.normal(size=(length, 3)).astype(np.float32),
        "action": rng.normal(size=(length, 2)).astype(np.float32),
        "language_instruction": [f"task {episode_id}"] * length,
        "is_first": first,
        "observation/image": rng.integers(0, 256, size=(length, 16, 16, 3), dtype=np.uint8),
    }
    return {"steps": steps, "episode_metadata": {"episode_id": episode_id}}


@pytest.fixture(scope="module")
def unmapped_rlds(tmp_path_factory: pytest.TempPathFactory) -> RLDSData:
    """An RLDS dataset under a name no key map knows, with two splits (train: 2 episodes, test: 1)."""
    root = tmp_path_factory.mktemp("rlds") / "my_unmapped_set"
    rng = np.random.default_rng(2)
    episodes = [_unmapped_episode(rng, n, i) for i, n in enumerate((5, 3, 4))]
    write_rlds(
        root / "1.0.0",
        "my_unmapped_set",
        {"train": episodes[:2], "test": episodes[2:]},
        UNMAPPED_STEPS,
        {"episode_id": scalar("int64")},
    )
    return RLDSData(root, root / "1.0.0", "my_unmapped_set", episodes, [0, 1])


@pytest.fixture(scope="module")
def lerobot_png(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LeRobot v3.0, robot_type widowx_bridge (generic key map), PNG images in parquet (lossless)."""
    return make_lerobot_dataset(
        tmp_path_factory.mktemp("lerobot") / "widowx_png",
        num_episodes=3,
        episode_length=LEROBOT_LENGTHS,
        cameras=CAMERAS,
        state_dim=7,
        action_dim=7,
        fps=5,
        video=False,
        robot_type="widowx_bridge",
    )


@pytest.fixture(scope="module")
def lerobot_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LeRobot v3.0 with AV1 video (the writer's default), all episodes in one data file and one video file."""
    return make_lerobot_dataset(
        tmp_path_factory.mktemp("lerobot") / "widowx_video",
        num_episodes=3,
        episode_length=LEROBOT_LENGTHS,
        cameras=CAMERAS,
        state_dim=7,
        action_dim=7,
        fps=5,
        robot_type="widowx_bridge",
    )


def lerobot_rows(root: Path) -> list[dict[str, Any]]:
    files = sorted((root / "data").rglob("*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files]).to_pylist()


# ---- vla data show --json -------------------------------------------------------------------------------------


def test_show_json_rlds_counts_episodes_by_shard_name_then_record(
    droid_rlds: RLDSData, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = droid_rlds
    assert ds.order != sorted(ds.order), "the shuffle must make file order differ from input order"
    records = records_in_file_order(ds.version_dir, "droid", "train")
    assert len(records) == len(DROID_LENGTHS)
    spec, _ = droid_features(DROID_IMAGE)
    for k, record in enumerate(records):
        ex = parse_example(record)
        src = ds.episodes[ds.order[k]]
        steps = src["steps"]
        n = len(steps["is_first"])
        frame = n - 2
        out = show(capsys, ds.root, "--episode", k, "--frame", frame)
        assert (out["format"], out["split"], out["episode"], out["frame"]) == ("rlds", "train", k, frame)
        assert out["num_frames"] == n
        assert out["episode_metadata"] == src["episode_metadata"]
        assert out["episode_metadata"]["file_path"] == bytes(ex["episode_metadata/file_path"][0]).decode()

        raw = out["raw"]
        assert set(raw) == set(spec), "raw holds every step field under its RLDS path without 'steps/'"
        assert "action_dict/cartesian_position" in raw and "observation/joint_position" in raw
        for name, f in spec.items():
            stored = ex[f"steps/{name}"]
            if f.cls == "Image":
                shape, mean, _ = image_mean_of_bytes(bytes(stored[frame]))
                assert raw[name] == {"shape": shape, "mean": pytest.approx(mean, abs=1e-9)}, name
            elif f.cls == "Text":
                assert raw[name] == bytes(stored[frame]).decode() == steps[name][frame]
            elif f.dtype == "bool":
                assert raw[name] is bool(stored[frame]), name
            else:
                value = stored.reshape(n, *f.shape)[frame]
                assert raw[name] == value.tolist(), name
                np.testing.assert_array_equal(np.float32(raw[name]), steps[name][frame].astype(np.float32))
        assert raw["is_first"] is False and raw["is_last"] is False

        std = out["standardized"]  # DROID map: joints ++ gripper; joint velocity ++ gripper target
        assert std["embodiment"] == "franka_droid"
        state = np.concatenate(
            [steps["observation/joint_position"], steps["observation/gripper_position"]], 1
        )
        action = np.concatenate(
            [steps["action_dict/joint_velocity"], steps["action_dict/gripper_position"]], 1
        )
        assert std["state"] == state[frame].astype(np.float32).tolist()
        assert std["action"] == action[frame].astype(np.float32).tolist()
        assert std["prompt"] == steps["language_instruction"][frame]
        assert std["images"] == {
            "primary": raw["observation/exterior_image_1_left"],
            "secondary": raw["observation/exterior_image_2_left"],
            "wrist": raw["observation/wrist_image_left"],
        }


def test_show_json_bridge_fixture_equals_the_stored_record(
    bridge_fixture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's example command, checked field by field against the TFRecord parsed directly."""
    episode, frame, n = 2, 5, 10
    out = show(capsys, bridge_fixture, "--split", "val", "--episode", episode, "--frame", frame)
    assert (out["format"], out["split"], out["num_frames"]) == ("rlds", "val", n)
    assert (out["episode"], out["frame"]) == (episode, frame)
    records = records_in_file_order(bridge_fixture, "bridge_dataset", "val")
    assert len(records) == 25
    ex = parse_example(records[episode])

    raw = out["raw"]
    step_keys = {k.removeprefix("steps/") for k in ex if k.startswith("steps/")}
    assert set(raw) == step_keys
    assert {
        "observation/state",
        "action",
        "language_instruction",
        "is_first",
        "observation/image_0",
    } <= step_keys
    for name in step_keys:
        stored = ex[f"steps/{name}"]
        if isinstance(stored, list):
            item = bytes(stored[frame])
            if item.startswith(b"\xff\xd8"):  # JPEG
                shape, mean, _ = image_mean_of_bytes(item)
                assert raw[name] == {"shape": shape, "mean": pytest.approx(mean, abs=1e-9)}, name
                assert shape == [64, 64, 3]
            else:
                assert raw[name] == item.decode(), name
        elif stored.dtype == np.int64:  # is_first / is_last / is_terminal: bools stored as int64
            assert raw[name] is bool(stored[frame]), name
        else:
            per_step = stored.reshape(n, -1)[frame]
            expected = per_step.tolist() if per_step.size > 1 else per_step[0].item()
            assert raw[name] == expected, name
    assert len(raw["language_embedding"]) == 512 and len(raw["observation/state"]) == 7

    meta = out["episode_metadata"]
    assert meta["episode_id"] == int(ex["episode_metadata/episode_id"][0])
    assert meta["file_path"] == bytes(ex["episode_metadata/file_path"][0]).decode()
    assert meta["has_language"] is bool(ex["episode_metadata/has_language"][0])

    # Bridge map: state = observation/state; movement action = next state - state; gripper binarized
    states = ex["steps/observation/state"].reshape(n, 7).astype(np.float64)
    actions = ex["steps/action"].reshape(n, 7).astype(np.float64)
    std = out["standardized"]
    assert std["embodiment"] == "widowx_bridge"
    assert std["state"] == raw["observation/state"]
    assert std["action"][:6] == (states[frame + 1, :6] - states[frame, :6]).astype(np.float32).tolist()
    assert std["action"][6] == binarize_gripper(actions[:, 6])[frame]
    assert std["prompt"] == raw["language_instruction"].strip()
    assert std["images"] == {"primary": raw["observation/image_0"], "secondary": raw["observation/image_1"]}


@pytest.mark.parametrize(("frame", "reason"), [(0, "drop_first"), (9, "no next state")])
def test_show_json_frame_dropped_by_the_key_map_says_why(
    bridge_fixture: Path, capsys: pytest.CaptureFixture[str], frame: int, reason: str
) -> None:
    out = show(capsys, bridge_fixture, "--episode", 0, "--frame", frame)
    assert out["split"] == "train"  # the default split
    assert out["raw"]["is_first"] is (frame == 0)  # (this debug copy stores is_last all False)
    assert out["standardized"] is None
    assert "dropped" in out["standardized_note"] and reason in out["standardized_note"]


def test_show_json_lerobot_equals_the_parquet_row(
    lerobot_png: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    episode, frame = 1, 3
    out = show(capsys, lerobot_png, "--episode", episode, "--frame", frame)
    assert out["format"] == "lerobot_v3.0"
    assert (out["split"], out["episode"], out["frame"], out["num_frames"]) == ("train", 1, 3, 10)
    assert out["episode_metadata"]["length"] == 10
    assert out["episode_metadata"]["tasks"] == [TASKS[1]]

    row = next(r for r in lerobot_rows(lerobot_png) if (r["episode_index"], r["frame_index"]) == (1, 3))
    tasks = {
        t["task_index"]: t["task"] for t in pq.read_table(lerobot_png / "meta/tasks.parquet").to_pylist()
    }
    raw = out["raw"]
    images = {f"observation.images.{c}" for c in CAMERAS}
    assert set(raw) == set(row) | {"task"}
    for key, value in row.items():
        if key in images:
            shape, mean, arr = image_mean_of_bytes(value["bytes"])
            assert raw[key] == {"shape": shape, "mean": pytest.approx(mean, abs=1e-9)}, key
            assert decode_frame_code(arr)[:2] == (episode, frame), "the parquet row itself is the right frame"
        else:
            assert raw[key] == value, key
    assert raw["task"] == tasks[row["task_index"]] == TASKS[1]
    assert raw["observation.images.front"]["shape"] == [24, 32, 3]

    std = out["standardized"]  # generic LeRobot map from robot_type: the stored vectors as they are
    assert std["embodiment"] == "widowx_bridge"
    assert std["state"] == raw["observation.state"] and std["action"] == raw["action"]
    assert std["prompt"] == raw["task"]
    assert std["images"] == {
        "primary": raw["observation.images.front"],
        "secondary": raw["observation.images.side"],
    }


def test_show_json_lerobot_video_mean_is_of_the_decoded_frame(
    lerobot_video: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import av

    episode, frame = 2, 4
    out = show(capsys, lerobot_video, "--episode", episode, "--frame", frame)
    files = sorted((lerobot_video / "videos/observation.images.side").rglob("*.mp4"))
    assert len(files) == 1, "all episodes share one video file here"
    with av.open(str(files[0])) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(decoded) == sum(LEROBOT_LENGTHS)
    expected = decoded[sum(LEROBOT_LENGTHS[:episode]) + frame]
    assert decode_frame_code(expected) == (episode, frame, 1)  # our independent decode found the right frame
    summary = out["raw"]["observation.images.side"]
    assert summary["shape"] == [24, 32, 3]
    assert summary["mean"] == pytest.approx(float(expected.mean()), abs=0.5)


def test_show_json_without_key_map_has_no_standardized(
    unmapped_rlds: RLDSData, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = unmapped_rlds
    out = show(capsys, ds.root, "--split", "test", "--episode", 0, "--frame", 2)
    assert "standardized" not in out and "my_unmapped_set" in out["standardized_note"]  # why there is none
    assert (out["format"], out["split"], out["num_frames"]) == ("rlds", "test", 4)
    src = ds.episodes[2]["steps"]
    raw = out["raw"]
    assert set(raw) == set(UNMAPPED_STEPS)
    assert raw["observation/state"] == src["observation/state"][2].tolist()
    assert raw["action"] == src["action"][2].tolist()
    assert raw["language_instruction"] == "task 2" and raw["is_first"] is False
    img = src["observation/image"][2]  # PNG: lossless, so the mean is the written image's
    assert raw["observation/image"] == {
        "shape": [16, 16, 3],
        "mean": pytest.approx(float(img.mean()), abs=1e-9),
    }
    assert out["episode_metadata"] == {"episode_id": 2}
    # the default split is train
    assert show(capsys, ds.root, "--episode", 1, "--frame", 0)["split"] == "train"


def test_show_json_step_with_nan_and_inf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The step ``validate`` flags is exactly the one a user then inspects; JSON has no NaN, so it prints "nan"."""
    episode = synthetic_droid_episode(np.random.default_rng(4), 4, DROID_IMAGE)
    episode["steps"]["action_dict/joint_velocity"][1, 4] = np.nan
    episode["steps"]["observation/joint_position"][1, 0] = np.inf
    write_rlds(tmp_path / "droid" / "1.0.0", "droid", {"train": [episode]}, *droid_features(DROID_IMAGE))
    out = show(capsys, tmp_path / "droid", "--episode", 0, "--frame", 1)
    velocity = episode["steps"]["action_dict/joint_velocity"][1].astype(np.float32).tolist()
    assert out["raw"]["action_dict/joint_velocity"] == [*velocity[:4], "nan", *velocity[5:]]
    assert out["raw"]["observation/joint_position"][0] == "inf"
    assert out["standardized"]["action"][4] == "nan" and out["standardized"]["state"][0] == "inf"


def test_show_without_json_prints_a_readable_summary(
    droid_rlds: RLDSData, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line per field: short arrays in full, long ones as shape + first values, images as shape + mean."""
    one_line = show(capsys, droid_rlds.root, "--episode", 1, "--frame", 2)
    rc, out, err = run_cli(capsys, "data", "show", droid_rlds.root, "--episode", 1, "--frame", 2)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].endswith(f"split 'train', episode 1, frame 2 of {one_line['num_frames']}")
    fields = {line.split()[0]: line for line in lines if line.startswith("  ")}
    for key, value in one_line["raw"].items():
        assert key in fields, key
        if isinstance(value, dict):  # an image
            assert f"image {value['shape']}, mean" in fields[key]
    assert len(lines) < 3 + len(one_line["raw"]) + len(one_line["episode_metadata"]) + 12
    long = np.arange(600, dtype=np.float64).tolist()
    from vla.data.inspect import format_frame

    text = format_frame({**one_line, "raw": {"embedding": long}})
    assert (
        "embedding" in text and "[600] 0, 1, 2, 3, 4, 5, 6, 7, ... (first 8 of 600; --json for all)" in text
    )


def test_console_script_show_json_and_error(droid_rlds: RLDSData, capsys: pytest.CaptureFixture[str]) -> None:
    """The installed ``vla`` entry point: same JSON as in-process; a user error is one line, exit 2."""
    assert VLA_BIN.is_file(), f"console script not installed at {VLA_BIN}"
    env = {k: v for k, v in os.environ.items() if k != "VLA_DEBUG"}
    args = ["data", "show", str(droid_rlds.root), "--episode", "3", "--frame", "1", "--json"]
    proc = subprocess.run([str(VLA_BIN), *args], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert parse_one_json_line(proc.stdout) == show(capsys, droid_rlds.root, "--episode", 3, "--frame", 1)

    missing = droid_rlds.root.parent / "no_such_dataset"
    proc = subprocess.run(
        [str(VLA_BIN), "data", "show", str(missing), "--episode", "0", "--frame", "0", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert_user_error(proc.returncode, proc.stdout, proc.stderr, str(missing), "no such file or directory")


# ---- vla data info --------------------------------------------------------------------------------------------


def test_info_bridge_fixture(bridge_fixture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "data", "info", bridge_fixture, "--json")
    assert rc == 0, err
    info = parse_one_json_line(out)
    assert info["format"] == "rlds" and info["name"] == "bridge_dataset"
    assert info["embodiment"] == "widowx_bridge"
    assert info["splits"] == {
        "train": {"episodes": 25, "frames": 250},
        "val": {"episodes": 25, "frames": 250},
    }
    spec = json.loads((bridge_fixture / "features.json").read_text())
    steps = spec["featuresDict"]["features"]["steps"]["sequence"]["feature"]["featuresDict"]["features"]
    observation = steps["observation"]["featuresDict"]["features"]
    expected_names = {k for k in steps if k != "observation"} | {f"observation/{k}" for k in observation}
    assert set(info["features"]) == expected_names
    assert info["features"]["observation/image_0"] | {"description": ""} == {
        "kind": "image",
        "dtype": "uint8",
        "shape": [64, 64, 3],
        "description": "",
    }
    assert info["features"]["observation/state"]["shape"] == [7]
    assert info["features"]["language_instruction"]["kind"] == "string"

    rc, out, err = run_cli(capsys, "data", "info", bridge_fixture)
    assert rc == 0, err
    assert re.search(r"format:\s+rlds", out) and re.search(r"embodiment:\s+widowx_bridge", out)
    assert "split 'train': 25 episodes, 250 frames" in out and "split 'val': 25 episodes, 250 frames" in out
    for name in expected_names:
        assert re.search(rf"^\s+{re.escape(name)}\s", out, re.M), name


def test_info_lerobot(lerobot_video: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "data", "info", lerobot_video, "--json")
    assert rc == 0, err
    info = parse_one_json_line(out)
    assert info["format"] == "lerobot_v3.0" and info["name"] == "widowx_video"
    assert info["embodiment"] == "widowx_bridge" and info["robot_type"] == "widowx_bridge"
    assert info["fps"] == 5
    assert info["splits"] == {"train": {"episodes": 3, "frames": sum(LEROBOT_LENGTHS)}}
    stored = json.loads((lerobot_video / "meta/info.json").read_text())["features"]
    assert set(info["features"]) == set(stored) | {"task"}
    assert info["features"]["observation.images.front"]["kind"] == "video"
    assert info["features"]["observation.images.front"]["shape"] == [24, 32, 3]
    assert info["features"]["action"] | {"description": ""} == {
        "kind": "tensor",
        "dtype": "float32",
        "shape": [7],
        "description": "",
    }
    rc, out, err = run_cli(capsys, "data", "info", lerobot_video)
    assert rc == 0, err
    assert re.search(r"format:\s+lerobot_v3.0", out) and re.search(r"fps:\s+5", out)
    assert f"split 'train': 3 episodes, {sum(LEROBOT_LENGTHS)} frames" in out


def test_info_without_key_map(unmapped_rlds: RLDSData, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "data", "info", unmapped_rlds.root, "--json")
    assert rc == 0, err
    info = parse_one_json_line(out)
    assert info["embodiment"] is None and info["name"] == "my_unmapped_set"
    assert "my_unmapped_set" in info["key_map_problem"]  # why no key map applies
    assert info["splits"] == {"train": {"episodes": 2, "frames": 8}, "test": {"episodes": 1, "frames": 4}}
    assert set(info["features"]) == set(UNMAPPED_STEPS)
    rc, out, _ = run_cli(capsys, "data", "info", unmapped_rlds.root)
    assert rc == 0 and "(no registered key map: " in out and "my_unmapped_set" in out


# ---- user errors: exit 2, one line naming the value and what is valid ------------------------------------------


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLA_DEBUG", raising=False)


@pytest.mark.parametrize("episode", [5, 17, -1])
def test_show_episode_out_of_range(
    droid_rlds: RLDSData, capsys: pytest.CaptureFixture[str], episode: int
) -> None:
    res = run_cli(capsys, "data", "show", droid_rlds.root, "--episode", episode, "--frame", 0, "--json")
    assert_user_error(*res, f"--episode {episode}", "5 episodes", "0..4")


def test_show_frame_out_of_range(droid_rlds: RLDSData, capsys: pytest.CaptureFixture[str]) -> None:
    n = DROID_LENGTHS[droid_rlds.order[0]]
    res = run_cli(capsys, "data", "show", droid_rlds.root, "--episode", 0, "--frame", n, "--json")
    assert_user_error(*res, f"--frame {n}", f"{n} frames", f"0..{n - 1}")


def test_show_lerobot_out_of_range(lerobot_png: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = run_cli(capsys, "data", "show", lerobot_png, "--episode", 3, "--frame", 0, "--json")
    assert_user_error(*res, "--episode 3", "3 episodes", "0..2")
    res = run_cli(capsys, "data", "show", lerobot_png, "--episode", 2, "--frame", 6, "--json")
    assert_user_error(*res, "--frame 6", "6 frames", "0..5")


def test_show_unknown_split_lists_the_splits(
    bridge_fixture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    res = run_cli(
        capsys, "data", "show", bridge_fixture, "--split", "validation", "--episode", 0, "--frame", 0
    )
    assert_user_error(*res, "'validation'", "'train'", "'val'")


def test_show_unknown_split_synthetic(unmapped_rlds: RLDSData, capsys: pytest.CaptureFixture[str]) -> None:
    res = run_cli(capsys, "data", "show", unmapped_rlds.root, "--split", "val", "--episode", 0, "--frame", 0)
    assert_user_error(*res, "'val'", "'train'", "'test'")


@pytest.mark.parametrize(
    "argv",
    [
        ["data", "info", "{p}"],
        ["data", "info", "{p}", "--json"],
        ["data", "show", "{p}", "--episode", "0", "--frame", "0", "--json"],
        ["data", "stats", "{p}", "--out", "{p}.json"],
        ["data", "preview", "{p}", "--out", "{p}.gif"],
        ["data", "convert", "{p}", "{p}_out", "--to", "lerobot"],
    ],
    ids=["info", "info-json", "show", "stats", "preview", "convert"],
)
def test_nonexistent_path(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    missing = tmp_path / "no_such_dataset"
    res = run_cli(capsys, *[a.format(p=missing) for a in argv])
    assert_user_error(*res, str(missing), "no such file or directory")
    assert list(tmp_path.iterdir()) == [], "nothing is written for a failed command"


def test_not_a_dataset_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    res = run_cli(capsys, "data", "info", tmp_path)
    assert_user_error(*res, str(tmp_path), "meta/info.json", "dataset_info.json")


# ---- vla data stats ------------------------------------------------------------------------------------------


def _check_norm_stats(entry: dict[str, Any], x: np.ndarray) -> None:
    """One field's stats against numpy on the standardized ``x`` ``[N, D]``."""
    x = x.astype(np.float64)
    assert entry["count"] == len(x)
    np.testing.assert_allclose(entry["mean"], x.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(entry["std"], x.std(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(entry["min"], x.min(0), rtol=0, atol=1e-7)
    np.testing.assert_allclose(entry["max"], x.max(0), rtol=0, atol=1e-7)
    span = x.max(0) - x.min(0)  # quantiles come from a histogram: within a small fraction of the range
    np.testing.assert_allclose(entry["q01"], np.quantile(x, 0.01, axis=0), atol=0.02 * span.max() + 1e-6)
    np.testing.assert_allclose(entry["q99"], np.quantile(x, 0.99, axis=0), atol=0.02 * span.max() + 1e-6)


def _load_stats(path: Path) -> dict[str, Any]:
    stats = json.loads(path.read_text())
    assert isinstance(stats["format_version"], int) and stats["format_version"] >= 1
    return stats


def test_stats_lerobot_equals_numpy(
    lerobot_png: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "stats" / "widowx.json"
    rc, out, err = run_cli(capsys, "data", "stats", lerobot_png, "--out", out_file)
    assert rc == 0, err
    assert out.strip() == f"wrote {out_file}"
    stats = _load_stats(out_file)
    rows = lerobot_rows(lerobot_png)
    assert set(stats["stats"]) >= {"widowx_bridge"}
    for field, key in (("state", "observation.state"), ("action", "action")):
        _check_norm_stats(stats["stats"]["widowx_bridge"][field], np.array([r[key] for r in rows]))
    (source,) = stats["sources"]
    assert source["episodes"] == 3 and source["frames"] == sum(LEROBOT_LENGTHS)


def test_stats_droid_rlds_equals_numpy(
    droid_rlds: RLDSData, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "droid_stats.json"
    rc, _, err = run_cli(capsys, "data", "stats", droid_rlds.root, "--out", out_file)
    assert rc == 0, err
    stats = _load_stats(out_file)["stats"]["franka_droid"]
    steps = [e["steps"] for e in droid_rlds.episodes]  # the DROID map, applied by hand
    state = np.concatenate(
        [
            np.concatenate([s["observation/joint_position"], s["observation/gripper_position"]], 1)
            for s in steps
        ]
    )
    action = np.concatenate(
        [
            np.concatenate([s["action_dict/joint_velocity"], s["action_dict/gripper_position"]], 1)
            for s in steps
        ]
    )
    _check_norm_stats(stats["state"], state)
    _check_norm_stats(stats["action"], action)


def test_stats_bridge_fixture_equals_numpy_on_standardized(
    bridge_fixture: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vla.data.readers import open_dataset
    from vla.data.standardize import standardize_episode

    out_file = tmp_path / "bridge_stats.json"
    rc, _, err = run_cli(capsys, "data", "stats", bridge_fixture, "--out", out_file)
    assert rc == 0, err
    stats = _load_stats(out_file)["stats"]["widowx_bridge"]
    reader = open_dataset(bridge_fixture)
    eps = [standardize_episode(reader, s, e) for s in ("train", "val") for e in range(25)]
    assert sum(len(e) for e in eps) == 50 * 8  # first and last frame of each episode dropped
    _check_norm_stats(stats["state"], np.concatenate([e.state for e in eps]))
    _check_norm_stats(stats["action"], np.concatenate([e.action for e in eps]))


def test_stats_default_location_is_inside_the_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_lerobot_dataset(
        tmp_path / "small", num_episodes=2, episode_length=5, video=False, state_dim=7, action_dim=7,
        robot_type="widowx_bridge",
    )  # fmt: skip
    rc, out, err = run_cli(capsys, "data", "stats", root)
    assert rc == 0, err
    expected = root / "meta" / "vla_stats.json"
    assert out.strip() == f"wrote {expected.resolve()}" or out.strip() == f"wrote {expected}"
    assert _load_stats(expected)["stats"]["widowx_bridge"]["state"]["count"] == 10


# ---- vla data preview ----------------------------------------------------------------------------------------


def _mp4_frames(path: Path) -> list[np.ndarray]:
    import av

    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def test_preview_mp4_has_one_frame_per_step(
    lerobot_png: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "previews" / "ep1.mp4"
    rc, out, err = run_cli(capsys, "data", "preview", lerobot_png, "--episode", 1, "--out", out_file)
    assert rc == 0, err
    assert out.strip() == f"wrote {out_file}"
    frames = _mp4_frames(out_file)
    assert len(frames) == LEROBOT_LENGTHS[1]
    height = CAMERA_HEIGHT
    assert frames[0].shape[1] == 2 * round(32 * height / 24)  # two 24x32 cameras side by side, resized
    assert frames[0].shape[0] > height  # with the state/action traces below
    assert not np.array_equal(frames[0], frames[-1])


def test_preview_gif_of_an_rlds_episode(
    droid_rlds: RLDSData, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "ep2.gif"
    rc, _, err = run_cli(capsys, "data", "preview", droid_rlds.root, "--episode", 2, "--out", out_file)
    assert rc == 0, err
    with Image.open(out_file) as gif:
        assert gif.format == "GIF"
        assert gif.n_frames == DROID_LENGTHS[droid_rlds.order[2]]
        assert gif.size[0] == 3 * round(32 * CAMERA_HEIGHT / 24)  # three cameras side by side


def test_preview_rlds_mp4(droid_rlds: RLDSData, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "ep4.mp4"
    rc, _, err = run_cli(capsys, "data", "preview", droid_rlds.root, "--episode", 4, "--out", out_file)
    assert rc == 0, err
    assert len(_mp4_frames(out_file)) == DROID_LENGTHS[droid_rlds.order[4]]


@pytest.mark.parametrize("name", ["ep0.avi", "ep0.png", "ep0"])
def test_preview_bad_suffix(
    lerobot_png: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    out_file = tmp_path / name
    res = run_cli(capsys, "data", "preview", lerobot_png, "--out", out_file)
    assert_user_error(*res, str(out_file), ".mp4", ".gif")
    assert not out_file.exists()


def test_preview_episode_out_of_range(
    lerobot_png: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    res = run_cli(capsys, "data", "preview", lerobot_png, "--episode", 3, "--out", tmp_path / "x.mp4")
    assert_user_error(*res, "--episode 3", "3")
    assert not (tmp_path / "x.mp4").exists()


# ---- vla demo (`make demo`) ----------------------------------------------------------------------------------


def _make_recipe(target: str) -> list[str]:
    """The shell commands of a Makefile target (litgpt-style: test the README's command as written)."""
    lines = (REPO_ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"^{target}\s*:", line))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_make_demo_command_runs_end_to_end(tmp_path: Path) -> None:
    """`make demo`'s command at smoke sizes (`--quick`): every stage is the real command, and a second run reuses
    what the first finished (each command resumes; finished evaluations are kept)."""
    assert "make demo" in (REPO_ROOT / "README.md").read_text()
    command, *after = _make_recipe("demo")
    assert any("source $(VENV)/bin/activate" in line for line in after), "make demo says how to get `vla`"
    venv = Path(sys.executable).parent.parent
    argv = shlex.split(command.replace("$(VENV)", str(venv)))
    assert Path(argv[0]) == VLA_BIN and argv[1:] == ["demo"], command
    workdir = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if k != "VLA_DEBUG"}
    run = [*argv, "--workdir", str(workdir), "--quick"]
    proc = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.findall(r"^\[(\d)/6\] done in \d+ s", out, re.M) == [str(i) for i in range(1, 7)], out[-3000:]
    for command in ("vla sim generate", "vla train debug", "vla finetune", "vla export", "vla eval sim",
                    "vla serve", "vla eval report"):  # fmt: skip
        assert f"$ {command}" in out, command
    policies = ("finetuned_from_pretrained", "finetuned_from_fresh", "expert", "random")
    for policy in policies:
        for level in ("low", "reality_proxy"):
            res = json.loads((workdir / "eval" / f"{policy}_{level}" / "results.json").read_text())
            assert res["episodes"] == 1 and res["embodiment"].endswith("kinova_gen3")
        assert re.search(rf"^{policy}\s+\d/1 \[", out, re.M), policy
    served = json.loads((workdir / "served_episode" / "results.json").read_text())
    assert served["episodes"] == 1 and list((workdir / "served_episode").rglob("*.mp4"))
    assert "<html" in (workdir / "report.html").read_text()[:2000].lower()
    assert "library_name: vla" in (workdir / "MODEL_CARD.md").read_text()
    assert re.search(r"demo finished in \d+ s", out)
    assert not (tmp_path / "runs").exists(), "--workdir is honoured"

    again = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=1200)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("results.json exists: kept") == 9  # 8 evaluations + the served episode
    # a work folder whose data an older vla generated (its settings lack today's servo model) is refused, with the fix
    progress = next((workdir / "data").glob("sim_*")) / "meta" / "vla_progress.json"
    record = json.loads(progress.read_text())
    del record["config"]["servo_model"]
    progress.write_text(json.dumps(record))
    old = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=1200)
    assert old.returncode != 0 and "servo_model: None then" in old.stdout + old.stderr
    assert f"delete {progress.parents[1]} (or pass another --workdir)" in old.stdout + old.stderr
