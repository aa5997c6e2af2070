"""The damaged inputs of ``scripts/corruption_campaign.py``: small clean datasets and a tiny checkpoint, and the
named ways to damage a copy of each.

Clean inputs (all written here, seeded, in seconds):

* ``png``   LeRobot v3, ``widowx_bridge``, 4 episodes x 6 frames, one 8x8 PNG camera stored in the parquet;
* ``v21``   LeRobot v2.1 (JSON-lines metadata, one parquet per episode), ``widowx_bridge``, 3 episodes x 6 frames;
* ``video`` LeRobot v3, ``widowx_bridge``, 3 episodes x 8 frames, one 16x24 h264 camera;
* ``sim``   ``vla sim generate`` of 2 Panda reach episodes (32 px, h264, two cameras);
* ``rlds``  an RLDS ``bridge_dataset`` of 3 episodes x 6 steps (the bridge key map), written by our RLDS writer
            (``rlds2``: the same over 2 shards);
* ``ckpt``  ``vla model init tiny_smolvlm`` for ``sim_panda`` with norm stats from ``sim``.

A :class:`Case` damages a copy of one of them (``damage(root)``), says where ``vla data show`` should look
(``show``), the names an error may use instead of a path (``names``), and whether an earlier corruption campaign
already reported this kind of damage (``listed``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

LENGTH = 6


@dataclass(frozen=True)
class Case:
    name: str
    base: str  # png | v21 | video | sim | rlds | rlds2 | ckpt
    damage: Callable[[Path], None]
    what: str
    listed: bool = False  # a kind of damage an earlier campaign already reported (the rest are new)
    show: tuple[int, int] = (0, 0)  # (episode, frame) for `vla data show`
    names: tuple[str, ...] = ()  # words an error may name instead of a path (a field, a feature)
    #: commands whose exit 0 with an output unlike the clean copy's is right, and why (they print the damaged value
    #: as stored, or what is now true of the data); every other changed output without a warning counts as silent
    correct: tuple[tuple[tuple[str, ...], str], ...] = ()


# ---- clean inputs ------------------------------------------------------------------------------------------
def make_png(root: Path) -> Path:
    from vla.data.writers.synthetic import make_lerobot_dataset

    return make_lerobot_dataset(
        root, num_episodes=4, episode_length=LENGTH, cameras={"front": (8, 8)}, state_dim=7, action_dim=7, fps=5,
        video=False, robot_type="widowx_bridge",
    )  # fmt: skip


def make_v21(root: Path) -> Path:
    from vla.data.writers.synthetic import make_lerobot_dataset

    return make_lerobot_dataset(
        root, num_episodes=3, episode_length=LENGTH, cameras={"front": (8, 8)}, state_dim=7, action_dim=7, fps=5,
        video=False, robot_type="widowx_bridge", version="v2.1",
    )  # fmt: skip


def make_video(root: Path) -> Path:
    from vla.data.writers.synthetic import make_lerobot_dataset

    return make_lerobot_dataset(
        root, num_episodes=3, episode_length=8, cameras={"front": (16, 24)}, state_dim=7, action_dim=7, fps=10,
        video=True, vcodec="h264", robot_type="widowx_bridge",
    )  # fmt: skip


def sim_argv(out: Path) -> list[str]:
    return ["sim", "generate", "--embodiment", "panda", "--task", "reach", "--episodes", "2", "--out", str(out),
            "--image-size", "32", "--vcodec", "h264", "--max-steps", "20"]  # fmt: skip


def make_sim(root: Path) -> Path:
    from vla.cli import main

    if main(sim_argv(root)) != 0:
        raise RuntimeError(f"vla sim generate into {root} failed")
    return root


def bridge_steps() -> dict[str, Any]:
    from vla.data.writers.rlds import image, scalar, tensor, text

    return {
        "observation/state": tensor([7]), "action": tensor([7]), "is_first": scalar("bool"),
        "is_last": scalar("bool"), "is_terminal": scalar("bool"), "language_instruction": text(),
        "observation/image_0": image((8, 8, 3), "png"), "observation/image_1": image((8, 8, 3), "png"),
    }  # fmt: skip


def rlds_episodes(change: Callable[[dict], None] | None = None) -> list[dict]:
    """The 3 clean RLDS episodes; ``change(steps)`` edits episode 1's steps."""
    rng = np.random.default_rng(0)
    flags = np.eye(LENGTH, dtype=bool)
    episodes = []
    for e in range(3):
        steps = {
            "observation/state": rng.normal(size=(LENGTH, 7)).astype(np.float32),
            "action": rng.normal(size=(LENGTH, 7)).astype(np.float32),
            "is_first": flags[0], "is_last": flags[-1], "is_terminal": flags[-1],
            "language_instruction": [f"pick block {e}"] * LENGTH,
            "observation/image_0": rng.integers(0, 255, (LENGTH, 8, 8, 3), dtype=np.uint8),
            "observation/image_1": np.zeros((LENGTH, 8, 8, 3), np.uint8),
        }  # fmt: skip
        if e == 1 and change is not None:
            change(steps)
        episodes.append({"steps": steps, "episode_metadata": {}})
    return episodes


def make_rlds(root: Path, shards: int = 1) -> Path:
    from vla.data.writers.rlds import write_rlds

    path = root / "bridge_dataset" / "1.0.0"
    write_rlds(path, "bridge_dataset", {"train": rlds_episodes()}, bridge_steps(), num_shards=shards)
    return path


def ckpt_argv(out: Path, stats_from: Path, seed: int = 0) -> list[str]:
    return ["model", "init", "tiny_smolvlm", "--out", str(out), "--embodiment", "sim_panda", "--stats-from",
            str(stats_from), "--seed", str(seed)]  # fmt: skip


# ---- damage helpers --------------------------------------------------------------------------------------
def edit_parquet(path: Path, fn: Callable[[dict[str, list]], dict[str, Any] | None]) -> None:
    """Rewrite ``path`` after ``fn(columns)`` edits the rows in place (same schema) or returns new columns."""
    table = pq.read_table(path)
    columns = table.to_pydict()
    new = fn(columns)
    pq.write_table(pa.table(new) if new is not None else pa.table(columns, schema=table.schema), path)


def edit_json(path: Path, fn: Callable[[Any], None]) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(path: Path) -> None:
    path.write_bytes(b"")


def garbage(path: Path) -> None:
    """Same size, seeded random bytes."""
    path.write_bytes(np.random.default_rng(1).integers(0, 256, path.stat().st_size, dtype=np.uint8).tobytes())


def episodes_pq(root: Path) -> Path:
    return next((root / "meta" / "episodes").rglob("*.parquet"))


def data_pq(root: Path) -> Path:
    return next((root / "data").rglob("*.parquet"))


def video_file(root: Path, camera: str = "") -> Path:
    return next(p for p in sorted((root / "videos").rglob("*.mp4")) if camera in str(p))


def info(root: Path) -> Path:
    return root / "meta" / "info.json"


def set_value(column: str, episode: int, frame: int, value: float, dim: int = 0) -> Callable[[Path], None]:
    """Set ``column[dim]`` of one frame in the data parquet."""

    def damage(root: Path) -> None:
        def fn(c: dict[str, list]) -> None:
            row = next(
                i
                for i, (e, f) in enumerate(zip(c["episode_index"], c["frame_index"]))
                if (e, f) == (episode, frame)
            )
            c[column][row][dim] = value

        edit_parquet(data_pq(root), fn)

    return damage


def drop_rows(root: Path, episode: int, frames: set[int]) -> None:
    def fn(c: dict[str, list]) -> dict[str, list]:
        keep = [
            i
            for i, (e, f) in enumerate(zip(c["episode_index"], c["frame_index"]))
            if not (e == episode and f in frames)
        ]
        return {k: [v[i] for i in keep] for k, v in c.items()}

    table = pq.read_table(data_pq(root))
    cols = fn(table.to_pydict())
    pq.write_table(pa.table(cols, schema=table.schema), data_pq(root))


def renumber(root: Path, old: int, new: int) -> None:
    def fn(c: dict[str, list]) -> None:
        c["episode_index"] = [new if e == old else e for e in c["episode_index"]]

    edit_parquet(episodes_pq(root), fn)
    edit_parquet(data_pq(root), fn)


def zero_length_episode(root: Path) -> None:
    """Episode 2 keeps its meta/episodes row with length 0 and loses its frames (a recorder that saved nothing)."""
    drop_rows(root, 2, set(range(LENGTH)))

    def fn(c: dict[str, list]) -> None:
        i = c["episode_index"].index(2)
        c["length"][i] = 0
        for e in range(i + 1, len(c["episode_index"])):
            c["dataset_from_index"][e] -= LENGTH
        c["dataset_to_index"] = [f + n for f, n in zip(c["dataset_from_index"], c["length"])]

    edit_parquet(episodes_pq(root), fn)
    edit_json(info(root), lambda i: i.update(total_frames=i["total_frames"] - LENGTH))


def binary_task(root: Path) -> None:
    def fn(c: dict[str, list]) -> dict[str, Any]:
        arr = pa.array([b"\xff\xfe pick", *(t.encode() for t in c["task"][1:])], pa.binary())
        return {
            "task_index": c["task_index"],
            "task": pa.Array.from_buffers(pa.string(), len(arr), arr.buffers()),
        }

    edit_parquet(root / "meta" / "tasks.parquet", fn)


def feature(name: str, **kw: Any) -> Callable[[Path], None]:
    return lambda root: edit_json(info(root), lambda i: i["features"][name].update(kw))


def column_as(column: str, typ: pa.DataType, cast: Callable[[Any], Any]) -> Callable[[Path], None]:
    """Store a data column with another type than info.json declares (values converted by ``cast``)."""

    def damage(root: Path) -> None:
        table = pq.read_table(data_pq(root))
        cols = table.to_pydict()
        cols[column] = pa.array([cast(v) for v in cols[column]], typ)
        pq.write_table(pa.table(cols), data_pq(root))

    return damage


def png_images(root: Path, episode: int, payload: Callable[[bytes], bytes]) -> None:
    def fn(c: dict[str, list]) -> None:
        for i, e in enumerate(c["episode_index"]):
            if e == episode:
                c["observation.images.front"][i] = {
                    "bytes": payload(c["observation.images.front"][i]["bytes"]),
                    "path": None,
                }

    edit_parquet(data_pq(root), fn)


def tiny_png(_: bytes) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def shift_video(root: Path) -> None:
    """meta/episodes points episode 2's frames past the end of the video file."""

    def fn(c: dict[str, list]) -> None:
        for k in [k for k in c if k.endswith("from_timestamp") or k.endswith("to_timestamp")]:
            c[k][2] += 5.0

    edit_parquet(episodes_pq(root), fn)


def progress(root: Path, text: str | None) -> None:
    path = root / "meta" / "vla_progress.json"
    if text is None:
        edit_json(path, lambda p: p.update(complete=False))
    else:
        path.write_text(text)


def bad_episode_metadata(root: Path) -> None:
    def fn(c: dict[str, list]) -> None:
        c["vla_episode_metadata_json"][1] = '{"randomization": {"seed": 1,'

    edit_parquet(episodes_pq(root), fn)


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def shard(root: Path, i: int = 0) -> Path:
    return sorted(root.glob("*.tfrecord-*"))[i]


def v21_line(root: Path, name: str, fn: Callable[[list[str]], list[str]]) -> None:
    path = root / "meta" / name
    path.write_text("\n".join(fn(path.read_text().splitlines())) + "\n")


def v21_data(root: Path, episode: int) -> Path:
    return root / "data" / "chunk-000" / f"episode_{episode:06d}.parquet"


def null_action(root: Path) -> None:
    table = pq.read_table(data_pq(root))
    cols = table.to_pydict()
    cols["action"][7] = None
    pq.write_table(pa.table(cols, schema=table.schema), data_pq(root))


def ragged_state(root: Path) -> None:
    """A variable-length list column (as some exporters write) whose row 9 holds 5 values, the others 7."""
    table = pq.read_table(data_pq(root))
    cols = table.to_pydict()
    cols["observation.state"][9] = cols["observation.state"][9][:5]
    cols["observation.state"] = pa.array(cols["observation.state"], pa.list_(pa.float32()))
    pq.write_table(pa.table(cols), data_pq(root))


def drop_column(path_of: Callable[[Path], Path], column: str) -> Callable[[Path], None]:
    def damage(root: Path) -> None:
        table = pq.read_table(path_of(root))
        pq.write_table(table.drop_columns([column]), path_of(root))

    return damage


def safetensors_header_garbage(root: Path) -> None:
    """The 8-byte header length says 2**40 (a flipped high byte): the header cannot be where it says."""
    path = root / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[5] = 0x01
    path.write_bytes(bytes(data))


def stats_of_another_embodiment(s: dict) -> None:
    s["stats"] = {"sim_ur5e" if k == "sim_panda" else k: v for k, v in s["stats"].items()}


def rlds_features(root: Path, fn: Callable[[dict], None]) -> None:
    def edit(spec: dict) -> None:
        fn(spec["featuresDict"]["features"]["steps"]["sequence"]["feature"]["featuresDict"]["features"])

    edit_json(root / "features.json", edit)


def rewrite_rlds(root: Path, change: Callable[[dict], None]) -> None:
    """Rewrite the RLDS dataset at ``root`` with ``change(steps)`` applied to episode 1."""
    from vla.data.writers.rlds import write_rlds

    shutil.rmtree(root)
    write_rlds(root, "bridge_dataset", {"train": rlds_episodes(change)}, bridge_steps())


def rlds_nan(steps: dict) -> None:
    steps["action"][2, 3] = np.nan


def rlds_not_utf8(steps: dict) -> None:
    steps["language_instruction"] = [b"\xff\xfe pick"] * LENGTH


def rlds_no_first(steps: dict) -> None:
    steps["is_first"] = np.zeros(LENGTH, bool)
    steps["is_last"] = np.zeros(LENGTH, bool)


def safetensors_edit(fn: Callable[[dict], dict]) -> Callable[[Path], None]:
    def damage(root: Path) -> None:
        from safetensors.numpy import load_file, save_file

        path = root / "model.safetensors"
        save_file(fn(load_file(str(path))), str(path), metadata={"format": "pt"})

    return damage


def drop_first_tensor(t: dict) -> dict:
    return {k: v for k, v in t.items() if k != sorted(t)[0]}


def reshape_first_tensor(t: dict) -> dict:
    k = sorted(k for k, v in t.items() if v.ndim == 2)[0]
    return t | {k: np.zeros((t[k].shape[0] + 1, t[k].shape[1]), t[k].dtype)}


def nan_weights(t: dict) -> dict:
    k = sorted(k for k, v in t.items() if v.dtype.kind == "f" and v.ndim == 2)[-1]
    w = t[k].copy()
    w[0, 0] = np.nan
    return t | {k: w}


def norm_stats(root: Path, fn: Callable[[dict], None]) -> None:
    edit_json(root / "norm_stats.json", fn)


def nan_in_stats(s: dict) -> None:
    def walk(d: Any) -> bool:
        if isinstance(d, dict):
            for k, v in d.items():
                if k == "q99" and isinstance(v, list) and v and isinstance(v[0], (int, float)):
                    v[0] = float("nan")
                    return True
                if walk(v):
                    return True
        return False

    if not walk(s):
        raise RuntimeError("norm_stats.json has no q99 list to damage")


def drop_a_stats_field(s: dict) -> None:
    def walk(d: Any) -> bool:
        if isinstance(d, dict):
            for k in ("q99", "q01"):
                if k in d:
                    del d[k]
                    return True
            return any(walk(v) for v in d.values())
        return False

    if not walk(s):
        raise RuntimeError("norm_stats.json has no q01/q99 to drop")


def chmod0(path_of: Callable[[Path], Path]) -> Callable[[Path], None]:
    """Mode 0 on a file. As root (euid 0) the mode bits are not enforced, so the command reads it anyway."""
    return lambda root: os.chmod(path_of(root), 0)


# ---- the cases ---------------------------------------------------------------------------------------------
def _unlink(path_of: Callable[[Path], Path]) -> Callable[[Path], None]:
    return lambda root: path_of(root).unlink()


def _rmtree(path_of: Callable[[Path], Path]) -> Callable[[Path], None]:
    return lambda root: shutil.rmtree(path_of(root))


C = Case
CASES: list[Case] = [
    # LeRobot metadata files
    C("info_json_missing", "png", _unlink(info), "meta/info.json deleted", True),
    C("info_json_truncated", "png", lambda r: truncate(info(r)), "meta/info.json cut in half", True),
    C("info_json_empty", "png", lambda r: empty(info(r)), "meta/info.json 0 bytes"),
    C("info_json_not_utf8", "png", lambda r: info(r).write_bytes(b"\xff" + info(r).read_bytes()), "a 0xff byte before info.json's text"),
    C("info_fps_wrong", "png", lambda r: edit_json(info(r), lambda i: i.update(fps=7)), "info.json fps 7, the timestamps say 5", True, names=("fps", "timestamp"), correct=((("info",), "info prints the fps info.json declares; validate reports the timestamps that disagree"),)),
    C("info_total_episodes_wrong", "png", lambda r: edit_json(info(r), lambda i: i.update(total_episodes=5)), "info.json total_episodes 5 of 4", True, names=("total_episodes",)),
    C("info_state_missing", "png", lambda r: edit_json(info(r), lambda i: i["features"].pop("observation.state")), "info.json without observation.state", True, names=("observation.state",)),
    C("info_action_dtype_int", "png", feature("action", dtype="int64"), "info.json declares action int64, the data holds floats", True, names=("action",), correct=((("info",), "info prints the features as info.json declares them"),)),
    C("info_action_shape_wrong", "png", feature("action", shape=[6]), "info.json declares action [6], the data holds 7 values", names=("action",), correct=((("info",), "info prints the features as info.json declares them"),)),
    C("info_robot_type_unknown", "png", lambda r: edit_json(info(r), lambda i: i.update(robot_type="nonexistent_bot")), "robot_type no key map or spec knows", names=("nonexistent_bot",), correct=((("validate",), "a robot_type no spec registers is not damage: validate checks the data; info, show, stats and the loader name the robot_type and `vla embodiment draft`"),)),
    C("info_splits_short", "png", lambda r: edit_json(info(r), lambda i: i.update(splits={"train": "0:2"})), "splits cover 2 of 4 episodes", names=("splits",)),
    C("episodes_parquet_truncated", "png", lambda r: truncate(episodes_pq(r)), "meta/episodes parquet cut in half", True),
    C("episodes_parquet_missing", "png", lambda r: episodes_pq(r).unlink(), "meta/episodes parquet deleted"),
    C("episodes_parquet_empty", "png", lambda r: empty(episodes_pq(r)), "meta/episodes parquet 0 bytes"),
    C("episodes_length_too_long", "png", lambda r: edit_parquet(episodes_pq(r), lambda c: c["length"].__setitem__(1, 60)), "meta/episodes says episode 1 has 60 frames, the data 6", show=(1, 0), names=("length",)),
    C("episode_index_gap", "png", lambda r: renumber(r, 3, 5), "episodes 0,1,2,5", True, show=(3, 0), correct=((("show",), "--episode 3 is the fourth listed episode, whose episode_index is 5"),)),
    C("zero_length_episode", "png", zero_length_episode, "episode 2: length 0, no frames", show=(2, 0), correct=((("info", "stats", "loader"), "the 18 frames the dataset holds are counted, summarized and loaded (validate reports the empty episode)"),)),
    C("tasks_parquet_missing", "png", _unlink(lambda r: r / "meta" / "tasks.parquet"), "meta/tasks.parquet deleted"),
    C("tasks_parquet_truncated", "png", lambda r: truncate(r / "meta" / "tasks.parquet"), "meta/tasks.parquet cut in half"),
    C("task_not_utf8", "png", binary_task, "task 0 stored as bytes that are not UTF-8", True),
    C("task_index_unknown", "png", lambda r: edit_parquet(data_pq(r), lambda c: c["task_index"].__setitem__(0, 9)), "a frame's task_index 9, no such task", names=("task_index",)),
    C("data_parquet_truncated", "png", lambda r: truncate(data_pq(r)), "data parquet cut in half", True),
    C("data_parquet_missing", "png", lambda r: data_pq(r).unlink(), "data parquet deleted"),
    C("data_parquet_empty", "png", lambda r: empty(data_pq(r)), "data parquet 0 bytes"),
    C("data_parquet_bitflip", "png", lambda r: flip_byte(data_pq(r), 0.3), "one byte flipped in the data parquet (same size)"),
    C("data_rows_missing", "png", lambda r: drop_rows(r, 1, {2, 3}), "episode 1 loses frames 2-3 in the data, meta says 6", show=(1, 2), names=("episode 1",)),
    C("data_unlisted_episode", "png", lambda r: renumber_data_only(r, 3, 7), "the data's episode 3 rows say episode 7", show=(3, 0), names=("episode 3", "episode_index")),
    C("state_nan", "png", set_value("observation.state", 1, 2, float("nan")), "NaN in episode 1 frame 2's state", show=(1, 2), names=("observation.state", "state"), correct=((("show",), "show prints the stored NaN"),)),
    C("action_inf", "png", set_value("action", 2, 3, float("inf"), 4), "inf in episode 2 frame 3's action", show=(2, 3), names=("action",), correct=((("show",), "show prints the stored inf"),)),
    C("action_stored_as_int", "png", column_as("action", pa.list_(pa.int64()), lambda v: [round(x) for x in v]), "action column int64 in the data, float32 in info.json", names=("action",)),
    C("action_stored_as_string", "png", column_as("action", pa.string(), json.dumps), "action column stored as JSON strings", names=("action",)),
    C("timestamps_wrong", "png", lambda r: edit_parquet(data_pq(r), lambda c: c.update(timestamp=[t * 0.5 if e == 2 else t for t, e in zip(c["timestamp"], c["episode_index"])])), "episode 2 timestamps at half speed", True, show=(2, 1), names=("timestamp",), correct=((("show",), "show prints the stored timestamp"),)),
    C("timestamps_not_monotonic", "png", lambda r: edit_parquet(data_pq(r), lambda c: c["timestamp"].__setitem__(8, 0.0)), "episode 1 frame 2 timestamp 0", show=(1, 2), names=("timestamp",), correct=((("show",), "show prints the stored timestamp"),)),
    C("frame_index_duplicate", "png", lambda r: edit_parquet(data_pq(r), lambda c: c["frame_index"].__setitem__(3, 2)), "episode 0 frame_index 0,1,2,2,4,5", show=(0, 3), names=("frame_index",), correct=((("show",), "show prints the stored frame_index"),)),
    C("stats_json_not_json", "png", lambda r: (r / "meta" / "stats.json").write_text('{"action": {"mean": [0.1,'), "meta/stats.json cut mid-number", True),
    C("stats_json_nan", "png", lambda r: edit_json(r / "meta" / "stats.json", lambda s: s["action"].update(std=[float("nan")] * 7)), "meta/stats.json action std NaN", names=("stats.json",)),
    C("png_not_decodable", "png", lambda r: png_images(r, 1, lambda b: b"not a png"), "episode 1's PNG bytes are garbage", show=(1, 0), names=("observation.images.front",)),
    C("png_wrong_size", "png", lambda r: png_images(r, 2, tiny_png), "episode 2's images 4x4, info.json says 8x8", show=(2, 0), names=("observation.images.front",)),
    C("progress_incomplete", "sim", lambda r: progress(r, None), "meta/vla_progress.json says an interrupted write (complete: false)", names=("incomplete", "re-run")),
    C("progress_not_json", "sim", lambda r: progress(r, '{"command": ["vla", '), "meta/vla_progress.json cut mid-list", names=("vla_progress.json",)),
    C("meta_file_mode_0", "png", chmod0(info), "meta/info.json mode 000 (root ignores mode bits)", correct=(((("info", "show", "validate", "stats", "loader"), "as root (euid 0) mode bits are not enforced: the file is read, nothing is damaged for this process"),) if os.geteuid() == 0 else ())),
    # LeRobot video
    C("video_missing", "video", lambda r: video_file(r).unlink(), "the camera's mp4 deleted"),
    C("video_truncated", "video", lambda r: truncate(video_file(r)), "the camera's mp4 cut in half", show=(2, 7)),
    C("video_empty", "video", lambda r: empty(video_file(r)), "the camera's mp4 0 bytes"),
    C("video_garbage", "video", lambda r: garbage(video_file(r)), "the camera's mp4 replaced by random bytes of its size"),
    C("videos_folder_missing", "video", _rmtree(lambda r: r / "videos"), "videos/ deleted"),
    C("video_fps_wrong", "video", lambda r: edit_json(info(r), lambda i: i["features"]["observation.images.front"]["info"].update({"video.fps": 30})), "info.json video.fps 30, the file 10", names=("video.fps", "fps")),
    C("video_shape_wrong", "video", feature("observation.images.front", shape=[32, 32, 3]), "info.json says 32x32x3, the video is 16x24", names=("observation.images.front",), correct=((("info",), "info prints the features as info.json declares them"),)),
    C("video_timestamps_past_end", "video", shift_video, "meta/episodes puts episode 2's frames 5 s past the video's end", show=(2, 0), names=("observation.images.front", "timestamp")),
    C("sim_wrist_video_missing", "sim", lambda r: video_file(r, "wrist").unlink(), "sim dataset: the wrist camera's mp4 deleted"),
    C("sim_episode_metadata_broken", "sim", bad_episode_metadata, "sim dataset: episode 1's metadata JSON cut", show=(1, 0), names=("vla_episode_metadata_json", "metadata")),
    C("sim_state_nan", "sim", set_value("observation.state", 0, 5, float("nan"), 2), "sim dataset: NaN in episode 0 frame 5's state", show=(0, 5), names=("observation.state", "state"), correct=((("show",), "show prints the stored NaN"),)),
    # RLDS
    C("rlds_dataset_info_missing", "rlds", _unlink(lambda r: r / "dataset_info.json"), "dataset_info.json deleted", True),
    C("rlds_features_missing", "rlds", _unlink(lambda r: r / "features.json"), "features.json deleted", True),
    C("rlds_features_not_json", "rlds", lambda r: truncate(r / "features.json"), "features.json cut in half"),
    C("rlds_shard_truncated", "rlds", lambda r: truncate(shard(r)), "the tfrecord shard cut in half", True),
    C("rlds_shard_missing", "rlds", lambda r: shard(r).unlink(), "the tfrecord shard deleted"),
    C("rlds_shard_empty", "rlds", lambda r: empty(shard(r)), "the tfrecord shard 0 bytes"),
    C("rlds_crc_mismatch", "rlds", lambda r: flip_byte(shard(r), 0.6), "one byte flipped inside a record (CRC mismatch)", True),
    C("rlds_shard_length_wrong", "rlds", lambda r: edit_json(r / "dataset_info.json", lambda d: d["splits"][0].update(shardLengths=["5"])), "dataset_info.json says 5 records, the shard holds 3", True, names=("shardLengths",)),
    C("rlds_instruction_not_utf8", "rlds", lambda r: rewrite_rlds(r, rlds_not_utf8), "episode 1's instruction bytes are not UTF-8", True, show=(1, 0)),
    C("rlds_action_declared_int", "rlds", lambda r: rlds_features(r, lambda f: f["action"]["tensor"].update(dtype="int64")), "features.json declares action int64, the records hold floats", True, names=("steps/action",), correct=((("info",), "info prints the features as features.json declares them"),)),
    C("rlds_state_shape_wrong", "rlds", lambda r: rlds_features(r, lambda f: f["observation"]["featuresDict"]["features"]["state"]["tensor"]["shape"].update(dimensions=["8"])), "features.json declares state [8], the records hold 7", names=("state",), correct=((("info",), "info prints the features as features.json declares them"),)),
    C("rlds_action_nan", "rlds", lambda r: rewrite_rlds(r, rlds_nan), "NaN in episode 1 step 2's action", show=(1, 2), names=("action",), correct=((("show",), "show prints the stored NaN"),)),
    C("rlds_no_is_first", "rlds", lambda r: rewrite_rlds(r, rlds_no_first), "episode 1: no step flagged is_first / is_last", show=(1, 0), names=("is_first", "is_last"), correct=((("show",), "show prints the stored flags"),)),
    # LeRobot v2.1, null and ragged rows, a missing column, a second RLDS shard
    C("v21_episodes_jsonl_bad_line", "v21", lambda r: v21_line(r, "episodes.jsonl", lambda ls: [ls[0], ls[1][: len(ls[1]) // 2], *ls[2:]]), "meta/episodes.jsonl: line 2 cut mid-object"),
    C("v21_tasks_jsonl_missing", "v21", _unlink(lambda r: r / "meta" / "tasks.jsonl"), "meta/tasks.jsonl deleted"),
    C("v21_tasks_jsonl_not_utf8", "v21", lambda r: (r / "meta" / "tasks.jsonl").write_bytes(b"\xff" + (r / "meta" / "tasks.jsonl").read_bytes()), "meta/tasks.jsonl starts with a 0xff byte"),
    C("v21_episode_parquet_missing", "v21", lambda r: v21_data(r, 1).unlink(), "episode 1's parquet deleted", show=(1, 0)),
    C("v21_episode_parquet_truncated", "v21", lambda r: truncate(v21_data(r, 2)), "episode 2's parquet cut in half", show=(2, 0)),
    C("action_null_row", "png", null_action, "a null action in episode 1 frame 1", show=(1, 1), names=("action",)),
    C("state_ragged_row", "png", ragged_state, "episode 1 frame 3's state holds 5 values, the others 7", show=(1, 3), names=("observation.state",)),
    C("episodes_length_column_missing", "png", drop_column(episodes_pq, "length"), "meta/episodes without its length column", names=("length",)),
    C("data_timestamp_column_missing", "png", drop_column(data_pq, "timestamp"), "the data parquet without its timestamp column", names=("timestamp",)),
    C("rlds_second_shard_missing", "rlds2", lambda r: shard(r, 1).unlink(), "the second of 2 shards deleted", show=(2, 0)),
    C("rlds_features_not_utf8", "rlds", lambda r: (r / "features.json").write_bytes(b"\xff" + (r / "features.json").read_bytes()), "features.json starts with a 0xff byte"),
    # checkpoints
    C("ckpt_weights_truncated", "ckpt", lambda r: truncate(r / "model.safetensors"), "model.safetensors cut in half", True),
    C("ckpt_weights_missing", "ckpt", _unlink(lambda r: r / "model.safetensors"), "model.safetensors deleted"),
    C("ckpt_weights_empty", "ckpt", lambda r: empty(r / "model.safetensors"), "model.safetensors 0 bytes"),
    C("ckpt_weights_tensor_missing", "ckpt", safetensors_edit(drop_first_tensor), "model.safetensors without one tensor", names=("model.safetensors",)),
    C("ckpt_weights_shape_wrong", "ckpt", safetensors_edit(reshape_first_tensor), "model.safetensors: one tensor one row too many", names=("model.safetensors",)),
    C("ckpt_weights_nan", "ckpt", safetensors_edit(nan_weights), "model.safetensors: one weight NaN", names=("model.safetensors",)),
    C("ckpt_config_missing", "ckpt", _unlink(lambda r: r / "config.json"), "config.json deleted", True),
    C("ckpt_config_not_json", "ckpt", lambda r: truncate(r / "config.json"), "config.json cut in half"),
    C("ckpt_config_bad_value", "ckpt", lambda r: edit_json(r / "config.json", lambda c: walk_set(c, "num_steps", "ten")), "config.json: a number field holds a string", names=("num_steps",)),
    C("ckpt_config_no_model_section", "ckpt", lambda r: edit_json(r / "config.json", lambda c: c.pop("model")), "config.json without its 'model' section"),
    C("ckpt_backbone_missing", "ckpt", _rmtree(lambda r: r / "backbone"), "backbone/ deleted", True),
    C("ckpt_tokenizer_missing", "ckpt", _unlink(lambda r: r / "backbone" / "tokenizer.json"), "backbone/tokenizer.json deleted", True),
    C("ckpt_tokenizer_config_missing", "ckpt", _unlink(lambda r: r / "backbone" / "tokenizer_config.json"), "backbone/tokenizer_config.json deleted", True),
    C("ckpt_backbone_config_missing", "ckpt", _unlink(lambda r: r / "backbone" / "config.json"), "backbone/config.json deleted"),
    C("ckpt_embodiment_yaml_missing", "ckpt", _unlink(lambda r: r / "embodiments" / "sim_panda.yaml"), "embodiments/sim_panda.yaml deleted", names=("sim_panda",)),
    C("ckpt_embodiment_yaml_not_utf8", "ckpt", lambda r: (r / "embodiments" / "sim_panda.yaml").write_bytes(b"\xff:"), "embodiments/sim_panda.yaml not UTF-8", True),
    C("ckpt_norm_stats_not_json", "ckpt", lambda r: truncate(r / "norm_stats.json"), "norm_stats.json cut in half"),
    C("ckpt_norm_stats_nan", "ckpt", lambda r: norm_stats(r, nan_in_stats), "norm_stats.json: the first q99 (a quantile-mode bound) NaN", names=("norm_stats",)),
    C("ckpt_weights_header_garbage", "ckpt", safetensors_header_garbage, "model.safetensors' header length byte flipped"),
    C("ckpt_norm_stats_other_embodiment", "ckpt", lambda r: norm_stats(r, stats_of_another_embodiment), "norm_stats.json holds stats of sim_ur5e, not the checkpoint's sim_panda", names=("sim_panda", "norm_stats")),
    C("ckpt_norm_stats_field_missing", "ckpt", lambda r: norm_stats(r, drop_a_stats_field), "norm_stats.json: a field without q01/q99", names=("norm_stats", "q01", "q99")),
]  # fmt: skip


def renumber_data_only(root: Path, old: int, new: int) -> None:
    def fn(c: dict[str, list]) -> None:
        c["episode_index"] = [new if e == old else e for e in c["episode_index"]]

    edit_parquet(data_pq(root), fn)


def walk_set(d: Any, key: str, value: Any) -> None:
    """Set every ``key`` in a nested dict (fails when there is none)."""
    found = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k == key:
                    found.append(x)
                walk(v)

    walk(d)
    if not found:
        raise RuntimeError(f"no {key!r} in the checkpoint config")
    for x in found:
        x[key] = value
