"""Damaged input gets a named error, never a silent result.

Each test writes a small clean dataset (LeRobot v3 through ``LeRobotWriter``, RLDS through ``write_rlds``) or a
tiny checkpoint, damages a copy the way files get damaged in practice (episode-index gaps, text that is not
UTF-8, declared types that disagree with the data, truncated or unreadable files, a dataset whose every sample
is bad, a huge task string), and checks that every command -- ``vla data info/show/validate/stats``, the
loader, ``vla model info`` -- either reads the data correctly or fails with the project's own error type and
a message naming the file; ``validate`` reports each problem by kind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from vla.cli import main
from vla.config import DataConfig
from vla.data.keymaps import KeyMapError
from vla.data.loader import SkippedSamplesError, build_loader
from vla.data.readers import DatasetFormatError, open_dataset
from vla.data.standardize import standardize_episode
from vla.data.writers.rlds import image, scalar, tensor, text, write_rlds
from vla.data.writers.synthetic import TASKS, make_lerobot_dataset

EPISODES, LENGTH, FPS = 4, 6, 5


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLA_DEBUG", raising=False)
    monkeypatch.setenv("VLA_NO_INDEX_CACHE", "1")  # each test damages files after writing them


# ---- clean datasets and their damaged copies -------------------------------------------------------------------
@pytest.fixture(scope="module")
def clean_lerobot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LeRobot v3, widowx_bridge (generic key map), 4 episodes x 6 frames, PNG images in the parquet."""
    return make_lerobot_dataset(
        tmp_path_factory.mktemp("clean") / "widowx_set", num_episodes=EPISODES, episode_length=LENGTH,
        cameras={"front": (8, 8)}, state_dim=7, action_dim=7, fps=FPS, video=False, robot_type="widowx_bridge",
    )  # fmt: skip


def lerobot_copy(clean: Path, tmp_path: Path) -> Path:
    dst = tmp_path / clean.name
    shutil.copytree(clean, dst)
    return dst


def edit_parquet(path: Path, fn: Callable[[dict[str, list]], dict[str, Any] | None]) -> None:
    """Rewrite ``path`` after ``fn(columns)`` edits the rows in place (same schema) or returns new columns."""
    table = pq.read_table(path)
    columns = table.to_pydict()
    new = fn(columns)
    pq.write_table(pa.table(new) if new is not None else pa.table(columns, schema=table.schema), path)


def edit_json(path: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def episodes_parquet(root: Path) -> Path:
    return next((root / "meta" / "episodes").rglob("*.parquet"))


def data_parquet(root: Path) -> Path:
    return next((root / "data").rglob("*.parquet"))


BRIDGE_STEPS = {
    "observation/state": tensor([7]), "action": tensor([7]), "is_first": scalar("bool"),
    "is_last": scalar("bool"), "is_terminal": scalar("bool"), "language_instruction": text(),
    "observation/image_0": image((8, 8, 3), "png"), "observation/image_1": image((8, 8, 3), "png"),
}  # fmt: skip


def bridge_rlds(
    root: Path, instruction: Callable[[int], str | bytes] = lambda e: f"pick block {e}", shards: int = 1
) -> Path:
    """An RLDS ``bridge_dataset`` (its registered key map) of 3 episodes x 6 steps in ``shards`` shards;
    ``instruction(e)`` is the language instruction of every step of episode ``e``."""
    rng = np.random.default_rng(0)
    flags = np.eye(LENGTH, dtype=bool)
    episodes = [
        {"steps": {
            "observation/state": rng.normal(size=(LENGTH, 7)).astype(np.float32),
            "action": rng.normal(size=(LENGTH, 7)).astype(np.float32),
            "is_first": flags[0], "is_last": flags[-1], "is_terminal": flags[-1],
            "language_instruction": [instruction(e)] * LENGTH,
            "observation/image_0": np.zeros((LENGTH, 8, 8, 3), np.uint8),
            "observation/image_1": np.zeros((LENGTH, 8, 8, 3), np.uint8),
        }, "episode_metadata": {}}
        for e in range(3)
    ]  # fmt: skip
    path = root / "bridge_dataset" / "1.0.0"
    write_rlds(path, "bridge_dataset", {"train": episodes}, BRIDGE_STEPS, num_shards=shards)
    return path


# ---- running commands --------------------------------------------------------------------------------------------
def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def cli_error(capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    """Run a command that must fail on bad input: exit 2, one ``error:`` line, no traceback -> that line."""
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == "" and "Traceback" not in err, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def problems(capsys: pytest.CaptureFixture[str], path: Path) -> list[dict[str, str]]:
    """``vla data validate --json`` -> its problems (the exit code must say whether there are any)."""
    rc, out, _ = run_cli(capsys, "data", "validate", path, "--json")
    found = json.loads(out)
    assert rc == (1 if found else 0)
    return found


def kinds(found: list[dict[str, str]]) -> set[str]:
    return {p["kind"] for p in found}


def loader_cfg(path: Path, **kw: Any) -> DataConfig:
    base = {"datasets": (str(path),), "batch_size": 2, "normalize": False, "image_size": 0, "chunk_length": 2,
            "shuffle": False}  # fmt: skip
    return DataConfig(**(base | kw))


def epoch(cfg: DataConfig) -> list[Any]:
    return list(build_loader(cfg))


# ---- episode-index gaps --------------------------------------------------------------------------------------
def renumber_episode(root: Path, old: int, new: int) -> None:
    """Give episode ``old`` the index ``new`` in meta/episodes and the data (as after deleting episodes)."""

    def fn(c: dict[str, list]) -> None:
        c["episode_index"] = [new if e == old else e for e in c["episode_index"]]

    edit_parquet(episodes_parquet(root), fn)
    edit_parquet(data_parquet(root), fn)


def test_episode_index_gap_reads_every_listed_episode(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    renumber_episode(root, 3, 5)  # episodes 0, 1, 2, 5 ("splits": {"train": "0:4"} as written)
    info_out = json.loads(run_cli(capsys, "data", "info", root, "--json")[1])
    assert info_out["splits"]["train"] == {"episodes": EPISODES, "frames": EPISODES * LENGTH}
    reader = open_dataset(root)
    assert reader.read_episode("train", 3).steps["episode_index"].tolist() == [5] * LENGTH
    frames = sum(len(b.prompt) for b in epoch(loader_cfg(root)))
    assert frames == EPISODES * LENGTH  # no frame silently dropped
    found = problems(capsys, root)
    assert kinds(found) == {"episode_gap"}
    assert str(root / "meta") in found[0]["where"] and "[3, 4]" in found[0]["message"]


def test_episode_outside_every_split_is_an_error(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    renumber_episode(root, 3, 5)
    edit_json(root / "meta" / "info.json", lambda i: i.update(splits={"train": "0:2", "val": "2:4"}))
    with pytest.raises(DatasetFormatError, match=r"info\.json: 1 episode\(s\) .* in no split .*\[5\]"):
        open_dataset(root)
    assert str(root / "meta" / "info.json") in cli_error(capsys, "data", "info", root)


def test_validate_reports_totals_that_disagree_with_the_episodes(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    edit_json(root / "meta" / "info.json", lambda i: i.update(total_frames=i["total_frames"] + 3))
    found = problems(capsys, root)
    assert kinds(found) == {"totals"} and str(root / "meta" / "info.json") in found[0]["where"]


def test_an_episode_of_zero_frames_is_read_as_empty_and_reported(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Episode 2 listed with length 0 and no rows: every command reads the other episodes (it was a KeyError for
    the episode without rows), validate names the empty episode."""
    root = lerobot_copy(clean_lerobot, tmp_path)
    data = data_parquet(root)
    table = pq.read_table(data)
    pq.write_table(table.filter(pc.not_equal(table["episode_index"], 2)), data)

    def fn(c: dict[str, list]) -> None:
        c["length"][2] = 0
        c["dataset_from_index"][3] -= LENGTH
        c["dataset_to_index"] = [f + n for f, n in zip(c["dataset_from_index"], c["length"])]

    edit_parquet(episodes_parquet(root), fn)
    edit_json(root / INFO, lambda i: i.update(total_frames=(EPISODES - 1) * LENGTH))
    assert open_dataset(root).read_episode("train", 2).steps["action"].shape == (0, 7)
    assert run_cli(capsys, "data", "stats", root, "--out", tmp_path / "stats.json")[0] == 0
    assert sum(len(b.prompt) for b in epoch(loader_cfg(root))) == (EPISODES - 1) * LENGTH
    found = problems(capsys, root)
    assert kinds(found) == {"empty_episode"} and "episode_index [2] has 0 frames" in found[0]["message"]


def test_validate_reports_a_split_that_spans_fewer_episodes_than_listed(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    edit_json(root / INFO, lambda i: i.update(splits={"train": "0:2"}))
    found = problems(capsys, root)
    assert kinds(found) == {"splits"} and found[0]["where"] == f"{root / INFO} splits"
    assert "spans 2 episodes but the episode metadata lists 4" in found[0]["message"]


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda r: edit_parquet(episodes_parquet(r), lambda c: c["length"].__setitem__(1, 60)),
         "holds 24 rows but the episode metadata lists 78 frames"),
        (lambda r: data_parquet(r).unlink(), "missing; the episode metadata lists 24 frames"),
        (lambda r: data_parquet(r).write_bytes(b""), "cannot read it"),
    ],
    ids=["lengths_past_the_data", "data_file_missing", "data_file_empty"],
)  # fmt: skip
def test_info_says_when_the_data_files_do_not_hold_the_listed_frames(
    clean_lerobot: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Path], None],
    problem: str,
) -> None:
    """``info`` counts frames from the episode metadata; one parquet footer per data file tells it when the data
    disagrees, instead of printing counts the data does not hold."""
    root = lerobot_copy(clean_lerobot, tmp_path)
    data_file = data_parquet(root)  # found before the damage, which may delete it
    damage(root)
    info_out = json.loads(run_cli(capsys, "data", "info", root, "--json")[1])
    assert info_out["data_problem"].startswith(f"{data_file}: ") and problem in info_out["data_problem"]
    rc, out, _ = run_cli(capsys, "data", "info", root)
    assert rc == 0 and f"DATA PROBLEM: {data_file}" in out
    clean = json.loads(run_cli(capsys, "data", "info", clean_lerobot, "--json")[1])
    assert clean["data_problem"] is None


def test_stats_of_data_with_nan_warn_naming_the_dataset(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)

    def nan_state(c: dict[str, list]) -> None:
        c["observation.state"][8][0] = float("nan")  # episode 1 frame 2

    edit_parquet(data_parquet(root), nan_state)
    rc, out, err = run_cli(capsys, "data", "stats", root, "--out", tmp_path / "stats.json")
    assert rc == 0 and out.startswith("wrote ")
    assert err.startswith(f"warning: {root}: 1 non-finite (NaN/inf) value(s) in the standardized state"), err
    assert "dims [0]" in err and f"vla data validate {root}" in err
    assert run_cli(capsys, "data", "stats", clean_lerobot, "--out", tmp_path / "clean.json")[2] == ""


def duplicate_last_episode(root: Path) -> None:
    def fn(c: dict[str, list]) -> None:
        for values in c.values():
            values.append(values[-1])

    edit_parquet(episodes_parquet(root), fn)


INFO = Path("meta/info.json")


@pytest.mark.parametrize(
    ("damage", "named", "message"),
    [
        (lambda r: (r / INFO).write_text("[]"), INFO, "not a JSON object"),
        (lambda r: edit_json(r / INFO, lambda i: i.update(features=[1, 2])), INFO, "'features' must map"),
        (lambda r: edit_json(r / INFO, lambda i: i.update(fps=0)), INFO, "fps must be a positive number"),
        (lambda r: edit_json(r / INFO, lambda i: i.update(data_path="data/{nope}.parquet")), INFO, "data_path"),
        (duplicate_last_episode, Path("meta/episodes/chunk-000/file-000.parquet"), "listed more than once"),
        (lambda r: episodes_parquet(r).write_bytes(b""), Path("meta/episodes/chunk-000/file-000.parquet"),
         "empty file"),
        (lambda r: (r / "meta" / "tasks.parquet").write_bytes(b""), Path("meta/tasks.parquet"), "empty file"),
    ],
    ids=["info_not_object", "features_not_object", "fps_zero", "bad_data_path", "duplicate_episode",
         "empty_episodes_parquet", "empty_tasks_parquet"],
)  # fmt: skip
def test_damaged_lerobot_metadata_is_one_named_error(
    clean_lerobot: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Path], None],
    named: Path,
    message: str,
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    damage(root)
    with pytest.raises(DatasetFormatError, match=message):
        build_loader(loader_cfg(root))
    line = cli_error(capsys, "data", "info", root)
    assert f"{root / named}:" in line and message in line


def test_damaged_rlds_features_spec_is_a_named_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = bridge_rlds(tmp_path)
    edit_json(root / "features.json", lambda s: s["featuresDict"]["features"].update(steps=[]))
    with pytest.raises(DatasetFormatError, match="not a TFDS features spec"):
        open_dataset(root)
    assert f"{root / 'features.json'}:" in cli_error(capsys, "data", "info", root)


def test_validate_reports_empty_tasks_and_non_numeric_stats(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    edit_parquet(root / "meta" / "tasks.parquet", lambda c: c.update(task=[" ", *c["task"][1:]]))
    (root / "meta" / "stats.json").write_text('{"action": {"mean": "x"}}')
    assert kinds(problems(capsys, root)) == {"empty_task", "stats_json"}


# ---- text that is not UTF-8 --------------------------------------------------------------------------------------
def binary_tasks(root: Path, first: bytes, as_string: bool) -> None:
    """Store meta/tasks.parquet's task column as binary (or as a string column holding raw bytes)."""

    def fn(c: dict[str, list]) -> dict[str, Any]:
        values = [first] + [t.encode() for t in c["task"][1:]]
        arr = pa.array(values, pa.binary())
        if as_string:  # what a broken exporter writes: a string column whose bytes are not UTF-8
            arr = pa.Array.from_buffers(pa.string(), len(arr), arr.buffers())
        return {"task_index": c["task_index"], "task": arr}

    edit_parquet(root / "meta" / "tasks.parquet", fn)


def test_lerobot_task_stored_as_utf8_bytes_is_the_text(clean_lerobot: Path, tmp_path: Path) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    binary_tasks(root, TASKS[0].encode(), as_string=False)
    prompts = {p for b in epoch(loader_cfg(root)) for p in b.prompt}
    assert prompts == set(TASKS)  # never "b'pick up the red cube'"


@pytest.mark.parametrize("as_string", [False, True], ids=["binary_column", "string_column"])
def test_lerobot_task_not_utf8_is_a_named_error(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], as_string: bool
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    binary_tasks(root, b"\xff\xfe pick", as_string)
    tasks = root / "meta" / "tasks.parquet"
    with pytest.raises(DatasetFormatError, match=r"column 'task' row 0 is not UTF-8"):
        epoch(loader_cfg(root))
    assert str(tasks) in cli_error(capsys, "data", "info", root)
    found = problems(capsys, root)
    assert any(str(tasks) in p["message"] and "UTF-8" in p["message"] for p in found)


def test_rlds_instruction_not_utf8_is_a_named_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = bridge_rlds(tmp_path, lambda e: b"\xff\xfe pick" if e == 1 else f"pick block {e}")
    shard = next(root.glob("*.tfrecord-*"))
    reader = open_dataset(root)
    with pytest.raises(DatasetFormatError, match=r"record 1 \(train episode 1\), feature 'steps/language_instruction' step 0 is not UTF-8"):  # fmt: skip
        reader.read_episode("train", 1)
    with pytest.raises(
        DatasetFormatError, match=rf"{re.escape(str(shard))}.*on_bad_sample=skip"
    ):  # names the shard and the way out
        epoch(loader_cfg(root))
    # skip: the unreadable episode is left out and counted against data.max_skipped_fraction (default 1 %)
    with pytest.raises(
        SkippedSamplesError, match=rf"1 of \d+ episodes cannot be read .*{re.escape(str(shard))}"
    ):
        epoch(loader_cfg(root, on_bad_sample="skip"))
    loader = build_loader(loader_cfg(root, on_bad_sample="skip", max_skipped_fraction=0.5))
    src = loader.dataset.sources[0]
    assert list(src.unreadable) == [1] and src.lengths[1] == 0 and src.lengths[0] > 0
    prompts = {p for batch in loader for p in batch.prompt}
    assert prompts and prompts <= {f"pick block {e}" for e in range(len(src.lengths)) if e != 1}, prompts
    # the cached index remembers the unreadable episode: the default setting refuses the dataset again
    with pytest.raises(DatasetFormatError, match=str(shard)):
        epoch(loader_cfg(root))
    assert str(shard) in cli_error(capsys, "data", "show", root, "--episode", 1, "--frame", 0)
    found = problems(capsys, root)
    assert len(found) == 1 and "episode 1" in found[0]["where"] and str(shard) in found[0]["message"]


@pytest.mark.parametrize("damage", ["shard_empty", "shard_lengths_wrong"])
def test_rlds_shard_that_disagrees_with_its_listed_length_fails_every_read_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    """Every episode of the shard, not only the first read, gets the named error (an IndexError out of the reader's
    record index before)."""
    root = bridge_rlds(tmp_path)
    shard = next(root.glob("*.tfrecord-*"))
    if damage == "shard_empty":
        shard.write_bytes(b"")
    else:
        edit_json(root / "dataset_info.json", lambda d: d["splits"][0].update(shardLengths=["5"]))
    reader = open_dataset(root)
    for episode in range(3):
        with pytest.raises(
            DatasetFormatError, match=rf"{re.escape(str(shard))}: dataset_info.json lists \d episodes"
        ):
            reader.read_episode("train", episode)
    with pytest.raises(DatasetFormatError, match=re.escape(str(shard))):
        epoch(loader_cfg(root))
    with pytest.raises(DatasetFormatError, match=re.escape(str(shard))):
        epoch(loader_cfg(root, on_bad_sample="skip", max_skipped_fraction=1.0))


@pytest.mark.parametrize("listed", [True, False], ids=["shard_lengths_listed", "shards_globbed"])
def test_a_missing_rlds_shard_is_named_not_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], listed: bool
) -> None:
    """Of 2 shards, the second deleted: every command refuses the split naming the shard, whether
    dataset_info.json lists the shard lengths or the shards are found by their -XXXXX-of-00002 names (the episodes
    of the first shard were read alone, silently)."""
    root = bridge_rlds(tmp_path, shards=2)
    if not listed:
        edit_json(root / "dataset_info.json", lambda d: d["splits"][0].pop("shardLengths"))
    assert open_dataset(root).num_episodes("train") == 3
    gone = sorted(root.glob("*.tfrecord-*"))[1]
    gone.unlink()
    named = str(gone) if listed else "shard(s) [1] are missing"
    with pytest.raises(DatasetFormatError, match=re.escape(named)):
        open_dataset(root)
    assert named in cli_error(capsys, "data", "info", root)
    with pytest.raises(DatasetFormatError, match=re.escape(named)):
        build_loader(loader_cfg(root))


def test_show_marks_binary_strings_that_are_not_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = BRIDGE_STEPS | {"blob": tensor([], "string")}  # Tensor(dtype=string): binary data is allowed
    ep = {"steps": {k: (np.zeros((2, *f.shape), np.float32) if f.cls == "Tensor" else None) for k, f in steps.items()},
          "episode_metadata": {}}  # fmt: skip
    ep["steps"] |= {"is_first": np.array([1, 0], bool), "is_last": np.array([0, 1], bool),
                    "is_terminal": np.array([0, 1], bool), "language_instruction": ["go", "go"],
                    "observation/image_0": np.zeros((2, 8, 8, 3), np.uint8),
                    "observation/image_1": np.zeros((2, 8, 8, 3), np.uint8), "blob": [b"\xff\x00", b"ok"]}  # fmt: skip
    root = tmp_path / "blobs" / "1.0.0"
    write_rlds(root, "blobs", {"train": [ep]}, steps)
    out = json.loads(run_cli(capsys, "data", "show", root, "--episode", 0, "--frame", 0, "--json")[1])
    assert out["raw"]["blob"] == "<2 bytes, not UTF-8: ff00>" and out["raw"]["language_instruction"] == "go"


# ---- declared types that disagree with the data ----------------------------------------------------------------
def test_rlds_declared_int_with_float_values_is_a_named_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = bridge_rlds(tmp_path)

    def declare_int(spec: dict[str, Any]) -> None:
        spec["featuresDict"]["features"]["steps"]["sequence"]["feature"]["featuresDict"]["features"][
            "action"
        ]["tensor"]["dtype"] = "int64"

    edit_json(root / "features.json", declare_int)
    with pytest.raises(DatasetFormatError, match=r"feature 'steps/action' holds float values but features.json declares int64"):  # fmt: skip
        open_dataset(root).read_episode("train", 0)
    assert "steps/action" in cli_error(capsys, "data", "show", root, "--episode", 0, "--frame", 0)
    assert all("steps/action" in p["message"] for p in problems(capsys, root))


def test_missing_state_feature_is_named(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    edit_json(root / "meta" / "info.json", lambda i: i["features"].pop("observation.state"))
    with pytest.raises(KeyMapError, match=r"'observation.state' must have width 7 .* found no such feature"):
        build_loader(loader_cfg(root))
    assert "'observation.state'" in cli_error(capsys, "data", "stats", root)
    found = problems(capsys, root)
    assert kinds(found) == {"keymap"} and "'observation.state'" in found[0]["message"]
    # info and show say why nothing is standardized instead of leaving the key map out silently
    info_out = json.loads(run_cli(capsys, "data", "info", root, "--json")[1])
    assert info_out["key_map"] is None and "'observation.state'" in info_out["key_map_problem"]
    shown = json.loads(run_cli(capsys, "data", "show", root, "--episode", 0, "--frame", 0, "--json")[1])
    assert "standardized" not in shown and "'observation.state'" in shown["standardized_note"]


def test_stats_json_with_nan_is_reported(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    edit_json(root / "meta" / "stats.json", lambda s: s["action"].update(std=[float("nan")] * 7))
    found = problems(capsys, root)
    assert (
        kinds(found) == {"stats_json"}
        and "non-finite (NaN or inf) statistics ['action/std']" in found[0]["message"]
    )


def test_stats_json_that_is_not_json_is_reported(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    (root / "meta" / "stats.json").write_text('{"action": {"mean": [0.1,')
    found = problems(capsys, root)
    assert kinds(found) == {"stats_json"} and found[0]["where"] == str(root / "meta" / "stats.json")


def test_timestamps_that_disagree_with_frame_index_and_fps_are_reported(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)

    def half_speed(c: dict[str, list]) -> None:  # no gap longer than 1.5 / fps, but not frame_index / fps
        c["timestamp"] = [t * 0.5 if e == 2 else t for t, e in zip(c["timestamp"], c["episode_index"])]

    edit_parquet(data_parquet(root), half_speed)
    found = problems(capsys, root)
    assert kinds(found) == {"timestamp"} and "episode 2 field 'timestamp'" in found[0]["where"]
    assert "expected 0.2 s" in found[0]["message"]


def test_video_fps_that_disagrees_with_the_dataset_fps_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_lerobot_dataset(tmp_path / "vid", num_episodes=1, episode_length=3, cameras={"front": (8, 8)},
                                state_dim=7, action_dim=7, fps=FPS, vcodec="h264", robot_type="widowx_bridge")  # fmt: skip
    assert problems(capsys, root) == []
    edit_json(
        root / INFO, lambda i: i["features"]["observation.images.front"]["info"].update({"video.fps": 30})
    )
    found = problems(capsys, root)
    assert (
        kinds(found) == {"video_fps"}
        and "features.observation.images.front.info.video.fps" in found[0]["where"]
    )
    assert f"video.fps 30 differs from the dataset's fps {FPS}" in found[0]["message"]


def test_rlds_episode_without_boundary_flags_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = bridge_rlds(tmp_path)
    assert problems(capsys, root) == []
    reader = open_dataset(root)
    episodes = []
    for e in range(reader.num_episodes("train")):
        steps = reader.read_episode("train", e).steps
        flags = {k: np.array(steps[k], bool) for k in ("is_first", "is_last", "is_terminal")}
        if e == 0:  # is_last on no step: as genuine OXE exports leave it, accepted
            flags["is_last"][:] = False
        if e == 1:
            flags["is_first"][:] = False
        if e == 2:  # is_last in the middle of the episode
            flags["is_last"][2] = True
        episodes.append({"steps": {
            "observation/state": steps["observation/state"], "action": steps["action"], **flags,
            "language_instruction": [str(t) for t in steps["language_instruction"]],
            "observation/image_0": np.zeros((LENGTH, 8, 8, 3), np.uint8),
            "observation/image_1": np.zeros((LENGTH, 8, 8, 3), np.uint8),
        }, "episode_metadata": {}})  # fmt: skip
    shutil.rmtree(root)
    write_rlds(root, "bridge_dataset", {"train": episodes}, BRIDGE_STEPS)
    found = problems(capsys, root)
    assert [p["where"].removeprefix(f"{root} split 'train' ") for p in found] == [
        "episode 1 field 'is_first'", "episode 2 field 'is_last'"
    ]  # fmt: skip
    assert "is_first is set on step(s) [], expected the first step (0) only" in found[0]["message"]
    assert (
        f"is_last is set on step(s) [2, {LENGTH - 1}], expected the last step ({LENGTH - 1}) only"
        in found[1]["message"]
    )


# ---- errors that name the file ---------------------------------------------------------------------------------
def test_truncated_episode_metadata_names_the_file(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    path = episodes_parquet(root)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DatasetFormatError, match="truncated or corrupt"):
        open_dataset(root)
    assert str(path) in cli_error(capsys, "data", "info", root)
    with pytest.raises(DatasetFormatError, match=str(path)):
        build_loader(loader_cfg(root))


def test_unreadable_episode_metadata_folder_says_permission_denied(
    clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    folder = episodes_parquet(root).parent
    if os.geteuid() == 0:  # root reads whatever the mode bits say: make the folder unreadable to this process
        scandir = os.scandir

        def denied(path: Any = ".") -> Any:
            if Path(path) == folder:
                raise PermissionError(13, "Permission denied", str(path))
            return scandir(path)

        monkeypatch.setattr(os, "scandir", denied)
    folder.chmod(0)
    try:
        line = cli_error(capsys, "data", "info", root)
    finally:
        folder.chmod(0o755)
    assert f"{folder}: permission denied" in line and "chmod" in line


def test_every_sample_bad_fails_the_epoch(
    clean_lerobot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)

    def garbage_images(c: dict[str, list]) -> None:
        c["observation.images.front"] = [{"bytes": b"not a png", "path": None} for _ in c["episode_index"]]

    edit_parquet(data_parquet(root), garbage_images)
    with pytest.raises(
        SkippedSamplesError, match=r"2 of this epoch's 24 samples .*First causes: .*cannot be decoded"
    ):
        epoch(loader_cfg(root, on_bad_sample="skip"))
    with pytest.raises(SkippedSamplesError, match=r"24 of this epoch's 24 samples .*no batch was left"):
        epoch(loader_cfg(root, on_bad_sample="skip", max_skipped_fraction=1.0))


# ---- a huge task string is held once ------------------------------------------------------------------------
def test_a_long_task_is_stored_once(clean_lerobot: Path, tmp_path: Path) -> None:
    root = lerobot_copy(clean_lerobot, tmp_path)
    long_task = "stack the cups " * 70_000 + "\n"  # 1 MB; trailing whitespace is stripped from the prompt

    def fn(c: dict[str, list]) -> dict[str, Any]:
        return {"task_index": c["task_index"], "task": [long_task] * len(c["task"])}

    edit_parquet(root / "meta" / "tasks.parquet", fn)
    reader = open_dataset(root)
    std = standardize_episode(reader, "train", 0)
    assert std.prompt[0] == long_task.strip()
    assert all(p is std.prompt[0] for p in std.prompt)  # one object, not a copy per frame

    rlds = bridge_rlds(tmp_path, lambda e: long_task)
    std = standardize_episode(open_dataset(rlds), "train", 0)
    assert std.prompt[0] == long_task.strip() and all(p is std.prompt[0] for p in std.prompt)


# ---- damaged checkpoints ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clean_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vla.models.hub import save_pretrained
    from vla.models.testing import tiny_model

    out = tmp_path_factory.mktemp("ckpt") / "model"
    save_pretrained(tiny_model(embodiments=("widowx_bridge",)), out)
    return out


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def nan_weight(ckpt: Path) -> None:
    """One NaN in the weights (a diverged training step saved, or a flipped bit in an exponent)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    name = sorted(n for n in tensors if n.startswith("heads."))[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("damage", "named", "problem"),
    [
        (lambda ck: truncate(ck / "model.safetensors"), "model.safetensors", "truncated or corrupt"),
        (lambda ck: (ck / "backbone" / "tokenizer.json").unlink(), "backbone/tokenizer.json", "tokenizer is missing"),
        (lambda ck: shutil.rmtree(ck / "backbone"), "backbone", "backbone folder is missing"),
        (lambda ck: (ck / "model.safetensors").unlink(), "model.safetensors", "weights file is missing"),
        (lambda ck: truncate(ck / "config.json"), "config.json", "not valid JSON"),
        (lambda ck: truncate(ck / "backbone" / "tokenizer.json"), "backbone/tokenizer.json", "not valid JSON"),
        (lambda ck: (ck / "backbone" / "tokenizer_config.json").unlink(), "backbone/tokenizer_config.json", "missing"),
        (lambda ck: (ck / "backbone" / "vla_image_norm.json").write_bytes(b"\xff{"), "backbone/vla_image_norm.json",
         "not valid JSON"),
        (lambda ck: (ck / "embodiments" / "widowx_bridge.yaml").write_bytes(b"\xff:"), "embodiments/widowx_bridge.yaml",
         "not UTF-8"),
        (nan_weight, "model.safetensors", "holds 1 NaN/inf value(s)"),
        (lambda ck: (ck / "config.json").unlink(), "config.json", "missing, so"),
        (lambda ck: edit_json(ck / "config.json", lambda c: c["model"]["flow"].update(num_steps="ten")), "config.json",
         "flow.num_steps: expected an integer, got ten"),
        (lambda ck: edit_json(ck / "config.json", lambda c: c.pop("model")), "config.json", "no 'model' section"),
        # valid JSON of the wrong shape, and a damaged preprocessing.json: each named (before: tracebacks, or a
        # bare JSON / int() message naming no file)
        (lambda ck: (ck / "config.json").write_text("[]"), "config.json", "a JSON list where"),
        (lambda ck: (ck / "norm_stats.json").write_text("[]"), "norm_stats.json", "not a vla stats file"),
        (lambda ck: (ck / "preprocessing.json").write_text("{bad"), "preprocessing.json", "not valid JSON"),
        (lambda ck: (ck / "preprocessing.json").write_text('"x"'), "preprocessing.json", "a JSON str where"),
        (lambda ck: (ck / "preprocessing.json").write_text('{"image_size": "big"}'), "preprocessing.json",
         "a field does not parse"),
    ],
    ids=["truncated_weights", "no_tokenizer", "no_backbone", "no_weights", "truncated_config", "truncated_tokenizer",
         "no_tokenizer_config", "image_norm_not_utf8", "embodiment_not_utf8", "nan_weight", "no_config",
         "config_value_not_parsed", "config_without_model", "config_a_list", "stats_a_list",
         "preprocessing_not_json", "preprocessing_a_string", "preprocessing_field"],
)  # fmt: skip
def test_damaged_checkpoint_names_the_file(
    clean_checkpoint: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Path], None],
    named: str,
    problem: str,
) -> None:
    ckpt = tmp_path / "model"
    shutil.copytree(clean_checkpoint, ckpt)
    damage(ckpt)
    line = cli_error(capsys, "model", "info", ckpt)
    assert f"{ckpt / named}:" in line and problem in line


def test_model_info_says_when_the_checkpoint_stats_cannot_serve(
    clean_checkpoint: Path, clean_lerobot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN quantile bound in norm_stats.json: ``model info`` still describes the checkpoint but says serving
    refuses it, as ``Policy`` does (it printed "included" as for good stats)."""
    from vla.data.stats import compute_stats

    ckpt = tmp_path / "model"
    shutil.copytree(clean_checkpoint, ckpt)
    compute_stats(clean_lerobot, progress=False).save(ckpt / "norm_stats.json")
    info_out = json.loads(run_cli(capsys, "model", "info", ckpt, "--json")[1])
    assert info_out["norm_stats"] == {"widowx_bridge": True} and info_out["serving_problem"] is None

    def nan_q99(stats: dict[str, Any]) -> None:
        stats["stats"]["widowx_bridge"]["state"]["q99"][0] = float("nan")

    edit_json(ckpt / "norm_stats.json", nan_q99)
    rc, out, _ = run_cli(capsys, "model", "info", ckpt, "--json")
    problem = json.loads(out)["serving_problem"]
    assert (
        rc == 0
        and problem.startswith(f"{ckpt}: cannot serve 'widowx_bridge'")
        and "widowx_bridge/state" in problem
    )
    rc, out, _ = run_cli(capsys, "model", "info", ckpt)
    assert rc == 0 and f"SERVING PROBLEM: {ckpt}: cannot serve 'widowx_bridge'" in out
