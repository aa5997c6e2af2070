"""The per-dataset episode index: same kept-frame counts as standardizing every episode, a warm start that
reads only metadata, invalidation when files or options change, the read-only cache fallback, corrupt files
rebuilt, and one builder among concurrent ranks."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from vla.config import DataConfig, load_config
from vla.data.episode_index import NO_CACHE_ENV, EpisodeIndex, count_kept, index_key, index_paths, key_digest
from vla.data.keymaps import KeyMapError
from vla.data.readers import DatasetFormatError, open_dataset
from vla.data.standardize import StandardizeOptions, keymap_for, standardize_episode
from vla.data.windows import WindowDataset, build_source
from vla.data.writers.rlds import droid_features, synthetic_droid_episode, write_rlds
from vla.data.writers.synthetic import make_lerobot_dataset

IMAGE = (48, 64, 3)
DROID_LENGTHS = [18, 25, 9, 30, 22, 16, 27, 12, 20, 24, 17, 28]
FAILED = {2, 5, 9}  # episodes whose file_path says failure (success_only drops them)
OPTIONS = {
    "default": StandardizeOptions(),
    "drop_first": StandardizeOptions(drop_first=2, drop_last=1),
    "success_only": StandardizeOptions(success_only=True),
    "idle_filter": StandardizeOptions(idle_filter=True),
}
LOGGER = "vla.data.episode_index"


def write_droid(version_dir: Path, lengths: list[int], seed: int = 0) -> Path:
    """A DROID-shaped RLDS dataset named "droid" (the DROID key map applies) over 3 shards."""
    rng = np.random.default_rng(seed)
    episodes = [synthetic_droid_episode(rng, n, IMAGE) for n in lengths]
    for i in FAILED & set(range(len(episodes))):
        episodes[i]["episode_metadata"]["file_path"] = "LAB1/failure/2023-07-01/trajectory.h5"
    write_rlds(version_dir, "droid", {"train": episodes}, *droid_features(IMAGE), num_shards=3)
    return version_dir


def full_scan(path: Path, options: StandardizeOptions) -> list[int]:
    reader = open_dataset(path)
    km = keymap_for(reader)
    return [
        len(standardize_episode(reader, "train", e, km, options=options).frames)
        for e in range(reader.num_episodes("train"))
    ]


def rchar() -> int:
    """Bytes this process (and its reaped children) read through read()/pread(), page cache hits included."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def dataset_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and "meta" not in p.parts)


@pytest.fixture
def droid(tmp_path: Path) -> Path:
    return write_droid(tmp_path / "droid" / "1.0.0", DROID_LENGTHS)


@pytest.fixture(scope="module")
def lerobot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lerobot_dataset(
        tmp_path_factory.mktemp("lr") / "widowx_set",
        num_episodes=4,
        episode_length=[12, 7, 15, 3],
        state_dim=7,
        action_dim=7,
        cameras={"primary": (16, 16)},
        robot_type="widowx_bridge",
        video=False,
    )


@pytest.mark.parametrize("option", list(OPTIONS))
def test_index_gives_the_lengths_of_a_full_scan(droid: Path, lerobot: Path, option: str) -> None:
    opts = OPTIONS[option]
    for path in (droid, lerobot):
        want = full_scan(path, opts)
        cold = build_source(open_dataset(path), "train", options=opts)
        warm = build_source(open_dataset(path), "train", options=opts)
        scanned = build_source(open_dataset(path), "train", options=opts, index_cache=False)
        assert cold.index is not None and warm.index == cold.index and scanned.index is None
        for src in (cold, warm, scanned):
            assert src.lengths.dtype == np.int64 and src.lengths.tolist() == want
    if option != "default":  # each option really changes the DROID counts, so equality above means something
        assert full_scan(droid, opts) != full_scan(droid, OPTIONS["default"])


def test_parallel_build_equals_serial(droid: Path) -> None:
    reader = open_dataset(droid)
    km, opts = keymap_for(reader), OPTIONS["idle_filter"]
    serial = count_kept(reader, km, opts, ["train"], workers=0)["train"]
    assert count_kept(reader, km, opts, ["train"], workers=2)["train"].tolist() == serial.tolist()
    assert serial.tolist() == full_scan(droid, opts)


@pytest.mark.skipif(
    not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io to count bytes read"
)
def test_warm_start_reads_a_small_fraction_of_the_dataset(
    droid: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = dataset_bytes(droid)
    build_source(open_dataset(droid), "train")  # cold: builds the index (and imports everything)
    before = rchar()
    src = build_source(open_dataset(droid), "train")
    warm = rchar() - before
    assert src.index is not None and src.num_samples == sum(DROID_LENGTHS)
    # a fixed ~17 kB (metadata, the index) here: 2.1 % of this 0.8 MB dataset, far under the 2 % at real
    # sizes (benchmarks/loader_startup.py measures that); no record is read (the smallest shard is ~250 kB)
    assert warm < 0.05 * size, f"warm start read {warm} bytes of a {size}-byte dataset"
    assert warm < min(p.stat().st_size for p in droid.glob("*.tfrecord-*")) / 2
    monkeypatch.setenv(NO_CACHE_ENV, "1")  # the same start without the index reads every record
    before = rchar()
    build_source(open_dataset(droid), "train")
    assert rchar() - before >= 0.9 * size


def test_changed_files_rebuild_the_index(droid: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    first = build_source(open_dataset(droid), "train")
    shard = sorted(droid.glob("*.tfrecord-*"))[1]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same bytes, new mtime
    caplog.clear()
    touched = build_source(open_dataset(droid), "train")
    assert "stale" in caplog.text and shard.name in caplog.text
    assert touched.lengths.tolist() == first.lengths.tolist() and touched.index == first.index
    (droid / "extra.txt").write_text("x")  # an added file also invalidates
    caplog.clear()
    build_source(open_dataset(droid), "train")
    assert "added" in caplog.text and "extra.txt" in caplog.text
    caplog.clear()
    build_source(open_dataset(droid), "train")
    assert "rebuilding" not in caplog.text and "building" not in caplog.text  # fresh again: used as is
    new_lengths = [n + 3 for n in DROID_LENGTHS]
    write_droid(droid, new_lengths, seed=1)  # rewritten data: the counts change
    rewritten = build_source(open_dataset(droid), "train")
    assert rewritten.lengths.tolist() == full_scan(droid, StandardizeOptions()) == new_lengths


def test_a_file_name_that_is_not_utf8_is_indexed(lerobot: Path, tmp_path: Path) -> None:
    """A stray file whose name is not UTF-8 (Latin-1 ``café.txt`` from an old tool) under ``data/``: the index keys
    it by its raw bytes (before: an encoding error naming no file stopped every ``vla train``)."""
    import shutil

    ds = Path(shutil.copytree(lerobot, tmp_path / "latin1"))
    with open(os.fsencode(ds / "data") + b"/caf\xe9.txt", "wb") as f:
        f.write(b"x")
    cold = build_source(open_dataset(ds), "train")
    warm = build_source(open_dataset(ds), "train")
    assert cold.index is not None and warm.index == cold.index
    assert warm.lengths.tolist() == full_scan(lerobot, StandardizeOptions())


def test_options_use_their_own_index_entry(droid: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    a = build_source(open_dataset(droid), "train", options=OPTIONS["default"])
    b = build_source(open_dataset(droid), "train", options=OPTIONS["success_only"])
    assert a.index != b.index and a.index.is_file() and b.index.is_file()
    assert a.lengths.tolist() != b.lengths.tolist()
    caplog.clear()  # back to the first options, and prompt-only options: both served from the first entry
    again = build_source(open_dataset(droid), "train", options=OPTIONS["default"])
    seeded = build_source(
        open_dataset(droid), "train", options=StandardizeOptions(language_choice="random", seed=7)
    )
    assert again.index == seeded.index == a.index and "building" not in caplog.text


def test_read_only_dataset_puts_the_index_in_the_cache(
    droid: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VLA_CACHE_DIR", str(tmp_path / "cache"))
    mode = droid.stat().st_mode
    droid.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        caplog.set_level(logging.INFO, logger=LOGGER)
        src = build_source(open_dataset(droid), "train")
        assert not (droid / "meta").exists()
        assert src.index is not None and src.index.is_relative_to(tmp_path / "cache") and src.index.is_file()
        assert "read-only" in caplog.text
        assert build_source(open_dataset(droid), "train").index == src.index
        assert src.lengths.tolist() == DROID_LENGTHS
    finally:
        droid.chmod(mode)


@pytest.mark.parametrize("damage", ["truncate", "edit"])
def test_corrupt_index_is_rebuilt_with_a_warning(
    droid: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = build_source(open_dataset(droid), "train").index
    text = path.read_text()
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    else:  # still well-formed, one count changed: the checksum catches it
        header, counts, files, unreadable = text.splitlines()
        lengths = json.loads(counts)
        lengths["train"][0] += 1
        path.write_text("\n".join([header, json.dumps(lengths), files, unreadable]) + "\n")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    src = build_source(open_dataset(droid), "train")
    assert "corrupt" in caplog.text and str(path) in caplog.text
    assert src.lengths.tolist() == DROID_LENGTHS
    assert EpisodeIndex.load(path).lengths["train"].tolist() == DROID_LENGTHS


def test_counts_that_disagree_with_standardization_are_an_error_naming_the_index(droid: Path) -> None:
    """An index whose counts are wrong yet pass every check (a standardization change without a format bump)
    fails loudly on the first episode read instead of feeding misaligned samples."""
    reader = open_dataset(droid)
    km = keymap_for(reader)
    key = index_key(km, None)
    good = build_source(reader, "train")
    wrong = EpisodeIndex.load(good.index)
    wrong.lengths["train"][0] += 1
    wrong.save(index_paths(droid, key_digest(key))[0])
    src = build_source(open_dataset(droid), "train")
    assert src.lengths[0] == DROID_LENGTHS[0] + 1
    cfg = load_config(DataConfig, {"datasets": [str(droid)], "image_size": 0, "normalize": False})
    message = (
        rf"episode 0: standardization keeps {DROID_LENGTHS[0]} frames but its episode index .*vla_episode"
    )
    with pytest.raises(ValueError, match=message):
        WindowDataset([src], cfg)[0]


def _start_together(path: str, barrier, queue) -> None:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    barrier.wait()
    src = build_source(open_dataset(path), "train")
    queue.put((src.lengths.tolist(), any("standardized" in m for m in records)))


def test_concurrent_starts_build_once_and_agree(droid: Path) -> None:
    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_start_together, args=(str(droid), barrier, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(lengths == DROID_LENGTHS for lengths, _ in results)
    assert sum(built for _, built in results) == 1  # the others waited on the lock and read its index


@pytest.mark.parametrize(
    ("error", "recorded"),
    [
        (DatasetFormatError("x.parquet: truncated"), True),
        (KeyMapError("'observation.state' must have width 7"), True),
        (TypeError("unsupported operand type(s)"), False),  # a bug in our code, not bad data
        (KeyError("steps"), False),
        (PermissionError(13, "Permission denied"), False),
        ("wrapped_permission", False),  # a reader's named error for a file this user may not read
    ],
    ids=["format_error", "keymap_error", "type_error", "key_error", "permission", "wrapped_permission"],
)
def test_only_data_errors_are_recorded_as_unreadable_episodes(
    lerobot: Path, monkeypatch: pytest.MonkeyPatch, error: Exception | str, recorded: bool
) -> None:
    reader = open_dataset(lerobot)
    km = keymap_for(reader)
    read_episode = reader.read_episode

    def failing(split: str, episode: int) -> object:
        if episode != 2:
            return read_episode(split, episode)
        if error == "wrapped_permission":
            try:
                raise PermissionError(13, "Permission denied")
            except PermissionError:
                raise DatasetFormatError("x.parquet: permission denied") from None
        raise error

    monkeypatch.setattr(reader, "read_episode", failing)
    unreadable: dict[str, dict[int, str]] = {}
    if recorded:
        lengths = count_kept(reader, km, None, ["train"], workers=0, unreadable=unreadable)["train"]
        assert lengths.tolist() == [12, 7, 0, 3] and list(unreadable["train"]) == [2]
        assert str(error) in unreadable["train"][2]
    else:
        expected = DatasetFormatError if error == "wrapped_permission" else type(error)
        with pytest.raises(expected):
            count_kept(reader, km, None, ["train"], workers=0, unreadable=unreadable)
        assert not unreadable.get("train")
