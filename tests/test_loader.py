"""The training loader: windows, padding/masks of mixed-embodiment batches, exact resume, rank sharding,
mixtures, normalization, augmentation determinism and bad-sample handling."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from vla.config import AugmentConfig, DataConfig, load_config
from vla.data.collate import collate
from vla.data.keymaps import KeyMap, raw, zeros
from vla.data.loader import SampleOrder, SkippedSamplesError, build_loader
from vla.data.normalize import Normalizer, StatsFile
from vla.data.readers import open_dataset
from vla.data.readers.base import FeatureInfo, RawEpisode
from vla.data.standardize import standardize_episode
from vla.data.stats import write_stats
from vla.data.windows import WindowDataset, build_source
from vla.data.writers.synthetic import decode_frame_code, make_lerobot_dataset
from vla.embodiments import get_embodiment
from vla.types import Batch

from fakes import FakeReader

LENGTHS = [12, 9, 15]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """Two LeRobot v3 datasets of different embodiments (widowx_bridge: 7/7, franka_droid: 8/8)."""
    root = tmp_path_factory.mktemp("data")
    make_lerobot_dataset(
        root / "widowx_set",
        num_episodes=3,
        episode_length=LENGTHS,
        state_dim=7,
        action_dim=7,
        cameras={"primary": (32, 40), "secondary": (32, 40)},
        robot_type="widowx_bridge",
        fps=5,
        seed=1,
    )
    make_lerobot_dataset(
        root / "franka_set",
        num_episodes=2,
        episode_length=[10, 11],
        state_dim=8,
        action_dim=8,
        cameras={"primary": (32, 40), "wrist": (32, 40)},
        robot_type="franka_droid",
        fps=15,
        seed=2,
    )
    return root


def _cfg(paths: list[Path], **kw) -> DataConfig:
    base = {
        "datasets": [str(p) for p in paths],
        "image_size": 0,
        "normalize": False,
        "batch_size": 4,
        "chunk_length": 4,
        "obs_history": 1,
    }
    base.update(kw)
    return load_config(DataConfig, base)


def _all(loader) -> list[Batch]:
    return list(loader)


def _key(batch: Batch) -> list[tuple]:
    return list(zip(batch.meta["dataset"], batch.meta["episode"], batch.meta["frame"]))


def test_mixed_embodiment_batch_contract(data_root: Path) -> None:
    loader = build_loader(_cfg([data_root / "widowx_set", data_root / "franka_set"], batch_size=8))
    assert loader.embodiment_ids == {"franka_droid": 0, "widowx_bridge": 1}
    seen = set()
    for batch in loader:
        batch.validate()
        assert batch.state.shape[1] == 8 and batch.actions.shape[1:] == (4, 8)
        for i, emb in enumerate(batch.meta["embodiment"]):
            width = 7 if emb == "widowx_bridge" else 8
            seen.add(emb)
            assert batch.state_mask[i].sum() == width and batch.action_mask[i].sum() == width
            assert torch.all(batch.state[i, width:] == 0) and torch.all(batch.actions[i, :, width:] == 0)
            # widowx has primary+secondary, franka primary+wrist: the missing slot is masked, not attended
            assert bool(batch.image_mask["wrist"][i]) == (emb == "franka_droid")
            assert bool(batch.image_mask["secondary"][i]) == (emb == "widowx_bridge")
            if not batch.image_mask["wrist"][i]:
                assert int(batch.images["wrist"][i].sum()) == 0
    assert seen == {"franka_droid", "widowx_bridge"}


def test_windows_history_chunk_and_padding(data_root: Path) -> None:
    path = data_root / "widowx_set"
    loader = build_loader(_cfg([path], obs_history=2, chunk_length=5, batch_size=1, shuffle=False))
    reader = open_dataset(path)
    stds = [standardize_episode(reader, "train", e) for e in range(3)]
    count = 0
    for batch in loader:
        ep, frame = batch.meta["episode"][0], batch.meta["frame"][0]
        std = stds[ep]
        pos = int(np.flatnonzero(std.frames == frame)[0])
        n = len(std.frames)
        # action chunk = the next 5 standardized actions; past the end padded (repeat last) and flagged
        want_pad = np.arange(pos, pos + 5) >= n
        assert batch.action_is_pad[0].numpy().tolist() == want_pad.tolist()
        want = std.action[np.minimum(np.arange(pos, pos + 5), n - 1)]
        np.testing.assert_array_equal(batch.actions[0].numpy(), want)
        np.testing.assert_array_equal(batch.state[0].numpy(), std.state[pos])
        # history: frames pos-1, pos (the first frame repeated at the episode start); images decode to them
        img = batch.images["primary"][0].numpy()
        got = [decode_frame_code(img[t])[:2] for t in range(2)]
        prev = std.frames[max(pos - 1, 0)]
        assert got == [(ep, int(prev)), (ep, int(frame))]
        assert batch.prompt[0] == reader.read_frame("train", ep, int(frame))["task"]
        count += 1
    assert count == sum(LENGTHS)


def test_windows_never_splice_across_a_gap_in_the_kept_frames(data_root: Path) -> None:
    """A filter that drops frames mid-episode (DROID's idle filter) leaves a gap: the chunk pads at the gap and
    the history restarts after it, instead of joining actions/images from both sides."""
    path = data_root / "widowx_set"
    cfg = _cfg([path], obs_history=3, chunk_length=5, batch_size=1, shuffle=False)
    reader = open_dataset(path)
    src = build_source(reader, "train")
    keep = np.array([0, 1, 2, 3, 7, 8, 9, 10, 11])  # raw frames 4..6 of episode 0 dropped
    gapped = standardize_episode(reader, "train", 0)
    gapped.frames, gapped.state, gapped.action = keep, gapped.state[keep], gapped.action[keep]
    gapped.prompt = [gapped.prompt[i] for i in keep]
    lengths = src.lengths.copy()
    lengths[0] = len(keep)
    ds = WindowDataset([dataclasses.replace(src, lengths=lengths)], cfg)
    ds._cache[(0, 0)] = gapped
    before = ds[2]  # raw frame 2: chunk 2, 3 | gap
    assert before["action_is_pad"].tolist() == [False, False, True, True, True]
    np.testing.assert_array_equal(before["actions"], gapped.action[[2, 3, 3, 3, 3]])
    after = ds[5]  # raw frame 8: history 7, 8 (7 repeated, not 3); chunk 8..11 then the episode end
    assert [decode_frame_code(img)[1] for img in after["images"]["primary"].numpy()] == [7, 7, 8]
    assert after["action_is_pad"].tolist() == [False, False, False, False, True]


def test_state_dims_a_dataset_does_not_record_are_masked_and_zeroed() -> None:
    """A key map's documented-zero state dims (toto has no gripper reading) are not real state for the model."""
    km = KeyMap(
        dataset="no_gripper_reading", embodiment="franka_oxe_joint", cameras={"primary": "image"},
        language="instruction", control_hz=10, action_space="eef_delta",
        state=(raw("joints"), zeros(1)), action=(raw("action"),),
        features={"joints": "float32[7]", "action": "float32[7]", "instruction": "string"},
    )  # fmt: skip
    steps = {
        "joints": np.ones((6, 7), np.float32),
        "action": np.zeros((6, 7), np.float32),
        "instruction": np.array(["wipe"] * 6, dtype=object),
    }
    feats = {
        "joints": FeatureInfo("joints", "tensor", "float32", (7,)),
        "action": FeatureInfo("action", "tensor", "float32", (7,)),
        "instruction": FeatureInfo("instruction", "string", "str", ()),
        "image": FeatureInfo("image", "image", "uint8", (8, 8, 3)),
    }
    reader = FakeReader(km.dataset, {"train": [RawEpisode("train", 0, 6, steps)]}, feats)
    cfg = load_config(
        DataConfig, {"datasets": ["unused"], "image_size": 0, "normalize": False, "batch_size": 2}
    )
    ds = WindowDataset([build_source(reader, "train", km)], cfg, normalize=lambda e, d, w, x: x + 5.0)
    batch = collate([ds[0], ds[1]], {"franka_oxe_joint": 0})
    batch.validate()
    assert batch.state_mask.tolist() == [[True] * 7 + [False]] * 2
    assert (
        batch.state[:, 7].tolist() == [0.0, 0.0] and batch.state[0, 0] == 6.0
    )  # normalized (+5), then zeroed


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_yields_exactly_the_same_batches(data_root: Path, num_workers: int) -> None:
    cfg = _cfg(
        [data_root / "widowx_set", data_root / "franka_set"],
        num_workers=num_workers,
        augment=AugmentConfig(enabled=True),
    )
    ref = build_loader(cfg)
    epoch0, epoch1 = _all(ref), _all(ref)
    assert [_key(b) for b in epoch0] != [_key(b) for b in epoch1]  # reshuffled per epoch
    a = build_loader(cfg)
    it = iter(a)
    for _ in range(3):
        next(it)
    state = a.state_dict()
    b = build_loader(cfg)
    b.load_state_dict(state)
    rest = _all(b)
    assert [_key(x) for x in rest] == [_key(x) for x in epoch0[3:]]
    for x, y in zip(rest, epoch0[3:]):
        for slot in x.images:
            assert torch.equal(
                x.images[slot], y.images[slot]
            )  # augmentation is seeded per sample, not per worker
        assert torch.equal(x.actions, y.actions)
    assert [_key(x) for x in _all(b)] == [_key(x) for x in epoch1]


def _by_sample(batches: list[Batch]) -> dict[tuple, torch.Tensor]:
    """Each sample's primary image, keyed by (dataset, episode, frame)."""
    return {k: b.images["primary"][i] for b in batches for i, k in enumerate(_key(b))}


def test_workers_persist_across_epochs_and_each_epoch_is_augmented_as_its_own(data_root: Path) -> None:
    """The loader keeps its two workers from one epoch to the next (new ones at every epoch stall the step that
    waits for them), and the epoch still reaches them: epoch 1's augmentation is epoch 1's, equal to what a loader
    starting fresh workers per epoch gives, not a repeat of epoch 0's (the workers' dataset copy predates it)."""
    cfg = _cfg([data_root / "widowx_set"], num_workers=2, augment=AugmentConfig(enabled=True))
    kept = build_loader(cfg)
    epoch0 = _all(kept)
    pids = [w.pid for w in kept._kept[1]._iterator._workers]
    epoch1 = _all(kept)
    assert [w.pid for w in kept._kept[1]._iterator._workers] == pids
    assert all(w.is_alive() for w in kept._kept[1]._iterator._workers)
    fresh = build_loader(cfg)
    fresh.persistent_workers = False
    for mine, theirs in zip((epoch0, epoch1), (_all(fresh), _all(fresh)), strict=True):
        assert [_key(b) for b in mine] == [_key(b) for b in theirs]
        for x, y in zip(mine, theirs, strict=True):
            for slot in x.images:
                assert torch.equal(x.images[slot], y.images[slot])
    assert fresh._kept is None
    first, second = _by_sample(epoch0), _by_sample(epoch1)
    assert any(not torch.equal(first[k], second[k]) for k in first)  # a new epoch, new augmentation
    workers = kept._kept[1]._iterator._workers
    kept.close()
    assert kept._kept is None and not any(w.is_alive() for w in workers)
    assert [_key(b) for b in _all(kept)] == [_key(b) for b in _all(fresh)]  # epoch 2, from new workers


def test_a_process_holding_a_loader_with_workers_exits(data_root: Path, tmp_path: Path) -> None:
    """A script that keeps its loader after an epoch (workers alive, idle) must still exit: multiprocessing's exit
    hook joins daemon workers without a timeout, and ours ignore the SIGTERM it sends them."""
    script = tmp_path / "hold.py"
    script.write_text(
        "import sys\n"
        "from vla.config import DataConfig, load_config\n"
        "from vla.data.loader import build_loader\n"
        "cfg = load_config(DataConfig, {'datasets': [sys.argv[1]], 'image_size': 0, 'normalize': False,\n"
        "    'batch_size': 4, 'chunk_length': 4, 'num_workers': 2})\n"
        "loader = build_loader(cfg)\n"
        "print(sum(b.batch_size for b in loader), flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, str(script), str(data_root / "widowx_set")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) > 0


def test_a_changed_embodiment_table_or_pinning_starts_new_workers(data_root: Path) -> None:
    """Workers copy the collate's embodiment table when they start: a change after that must reach the batches."""
    cfg = _cfg([data_root / "widowx_set"], num_workers=2)
    loader = build_loader(cfg)
    assert {int(i) for b in _all(loader) for i in b.embodiment_id} == {0}
    first = loader._kept[1]
    loader.embodiment_ids["widowx_bridge"] = 3
    assert {int(i) for b in _all(loader) for i in b.embodiment_id} == {3}
    assert loader._kept[1] is not first and first._iterator is None
    loader.close()


def test_sample_order_is_the_permutation_runs_were_started_with_and_is_made_lazily() -> None:
    """The shuffled order is still ``default_rng([seed, epoch]).permutation(n)`` strided by rank (runs started
    before the int32 order resume onto the same batches), and an epoch's batches are made as they are asked for:
    its indices stay one array per rank, not millions of Python ints (at DROID scale, 27M samples on 8 ranks, the
    old per-epoch lists held ~0.5 GB per rank)."""
    import tracemalloc

    n, world, size = 1003, 3, 7
    for rank in range(world):
        order = SampleOrder(n, size, shuffle=True, seed=5, rank=rank, world_size=world)
        order.epoch = 2
        want = np.random.default_rng([5, 2]).permutation(n)[rank::world][: n // world]
        got = [i for batch in order for _, i in batch]
        assert got == want[: len(order) * size].tolist()
        assert {e for batch in SampleOrder(n, size, shuffle=True, seed=5) for e, _ in batch} == {0}
    big = SampleOrder(2_000_000, 32, shuffle=True, seed=0, world_size=2)
    tracemalloc.start()
    try:
        first = next(iter(big))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(first) == 32
    assert peak < 16e6, peak  # the int32 order (8 MB) and this rank's copy (4 MB); the old lists took ~80 MB


def test_iterating_never_draws_from_the_global_torch_rng(data_root: Path) -> None:
    """Each epoch's DataLoader iterator takes its workers' base seed from the loader's own generator (data seed,
    rank, epoch), not from the global torch RNG: a resumed loader, which starts an extra iterator mid-epoch, leaves
    the training process's RNG exactly where the original run's was, and its workers get the original's seed."""
    cfg = _cfg([data_root / "widowx_set"])
    a = build_loader(cfg)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    it = iter(a)
    next(it)
    b = build_loader(cfg)
    b.load_state_dict(a.state_dict())
    _all(b)
    _all(b)
    assert torch.equal(torch.get_rng_state(), before)
    assert a._generator().initial_seed() == build_loader(cfg)._generator().initial_seed()
    b.epoch = 0
    assert b._generator().initial_seed() == a._generator().initial_seed()
    b.epoch = 1
    assert b._generator().initial_seed() != a._generator().initial_seed()


def test_resume_rejects_other_settings(data_root: Path) -> None:
    a = build_loader(_cfg([data_root / "widowx_set"]))
    state = a.state_dict()
    b = build_loader(_cfg([data_root / "widowx_set"], seed=1))
    with pytest.raises(ValueError, match="seed=0 but this loader has seed=1"):
        b.load_state_dict(state)


def test_resume_in_another_batch_size_continues_with_the_same_samples(data_root: Path) -> None:
    """A position saved at batch 4 continues at batch 2 from the same sample (a resumed run that trades
    data.batch_size for train.grad_accum); one that is not on a batch boundary of the new size is refused."""
    from vla.data.loader import LoaderPositionError

    paths = [data_root / "widowx_set"]
    samples = [k for b in _all(build_loader(_cfg(paths, batch_size=2))) for k in _key(b)]
    a = build_loader(_cfg(paths, batch_size=4))
    it = iter(a)
    next(it)
    state = a.state_dict()
    b = build_loader(_cfg(paths, batch_size=2))
    b.load_state_dict(state)
    assert b.batches_done == 2
    assert [k for x in _all(b) for k in _key(x)] == samples[4:]
    with pytest.raises(LoaderPositionError, match="4 samples is not a whole number of batches of 3"):
        build_loader(_cfg(paths, batch_size=3)).load_state_dict(state)


def test_ranks_get_disjoint_equal_shares(data_root: Path) -> None:
    cfg = _cfg([data_root / "widowx_set", data_root / "franka_set"], batch_size=2)
    keys = []
    for rank in range(2):
        loader = build_loader(cfg, rank=rank, world_size=2)
        keys.append([k for b in loader for k in _key(b)])
    assert len(keys[0]) == len(keys[1]) > 0
    assert not set(keys[0]) & set(keys[1])


def test_mixture_resume_and_rank_sharding(data_root: Path, tmp_path: Path) -> None:
    mix = tmp_path / "two.yaml"
    mix.write_text(
        yaml.safe_dump(
            {
                "name": "two",
                "balance_by_size": True,
                "datasets": [{"name": "widowx_set", "weight": 1.0}, {"name": "franka_set", "weight": 3.0}],
            }
        )
    )
    cfg = load_config(
        DataConfig,
        {
            "mixture": str(mix),
            "data_root": str(data_root),
            "image_size": 0,
            "normalize": False,
            "batch_size": 4,
            "chunk_length": 2,
        },
    )
    ref = build_loader(cfg)
    epochs = [_all(ref), _all(ref)]
    a = build_loader(cfg)
    it = iter(a)
    next(it), next(it)
    b = build_loader(cfg)
    b.load_state_dict(a.state_dict())
    assert [_key(x) for x in _all(b)] == [_key(x) for x in epochs[0][2:]]
    assert [_key(x) for x in _all(b)] == [_key(x) for x in epochs[1]]
    names = [d for batch in epochs[0] + epochs[1] for d in batch.meta["dataset"]]
    assert names.count("franka_set") > names.count("widowx_set")  # weight 3 x size vs 1 x size
    r0 = {k for batch in build_loader(cfg, rank=0, world_size=2) for k in _key(batch)}
    r1 = {k for batch in build_loader(cfg, rank=1, world_size=2) for k in _key(batch)}
    assert r0 and r1 and r0 != r1


def test_normalization_uses_dataset_stats_and_missing_stats_is_clear(data_root: Path, tmp_path: Path) -> None:
    path = data_root / "widowx_set"
    with pytest.raises(FileNotFoundError, match=r"Run 'vla data stats .*widowx_set'"):
        build_loader(_cfg([path], normalize=True, stats_path=None))
    stats_path = write_stats(path, out=tmp_path / "stats.json", progress=False)
    loader = build_loader(
        _cfg([path], normalize=True, stats_path=str(stats_path), shuffle=False, batch_size=1)
    )
    batch = next(iter(loader))
    std = standardize_episode(open_dataset(path), "train", batch.meta["episode"][0])
    pos = int(np.flatnonzero(std.frames == batch.meta["frame"][0])[0])
    norm = Normalizer.from_spec(StatsFile.load(stats_path), get_embodiment("widowx_bridge"), "state")
    np.testing.assert_allclose(
        batch.state[0, :7].numpy(), norm(std.state[pos : pos + 1])[0], rtol=1e-6, atol=1e-6
    )
    assert not np.allclose(batch.state[0, :7].numpy(), std.state[pos])


def test_bad_sample_raise_names_location_and_skip_counts(tmp_path: Path) -> None:
    path = make_lerobot_dataset(
        tmp_path / "bad",
        num_episodes=2,
        episode_length=8,
        state_dim=7,
        action_dim=7,
        cameras={"primary": (32, 40)},
        robot_type="widowx_bridge",
        video=True,
    )
    videos = sorted((path / "videos").rglob("*.mp4"))
    data = bytearray(videos[0].read_bytes())
    data[len(data) // 3 :] = b"\x00" * (
        len(data) - len(data) // 3
    )  # wipe the tail: frames there won't decode
    videos[0].write_bytes(bytes(data))
    with pytest.raises(Exception, match=r"while loading sample .*bad.*data.on_bad_sample=skip"):
        _all(build_loader(_cfg([path], shuffle=False, batch_size=2)))
    # the wiped file holds every episode's frames: skipping stops at the first batch past 1 % of the epoch
    loader = build_loader(_cfg([path], shuffle=False, batch_size=2, on_bad_sample="skip"))
    with pytest.raises(
        SkippedSamplesError, match=r"2 of this epoch's 16 samples .*First causes: sample 0: .*mp4"
    ):
        _all(loader)
    assert loader.num_skipped == 2
    # allowing every sample to be skipped still fails an epoch that yields no batch at all
    loader = build_loader(
        _cfg([path], shuffle=False, batch_size=2, on_bad_sample="skip", max_skipped_fraction=1.0)
    )
    with pytest.raises(SkippedSamplesError, match=r"16 of this epoch's 16 samples .*no batch was left"):
        _all(loader)


def test_nan_action_is_an_error_naming_the_frame_or_skipped(tmp_path: Path) -> None:
    path = make_lerobot_dataset(
        tmp_path / "nan",
        num_episodes=1,
        episode_length=6,
        state_dim=7,
        action_dim=7,
        cameras={"primary": (32, 40)},
        robot_type="widowx_bridge",
        video=False,
    )
    import pyarrow.parquet as pq

    f = next((path / "data").rglob("*.parquet"))
    table = pq.read_table(f)
    actions = table.column("action").to_pylist()
    actions[4][2] = float("nan")
    import pyarrow as pa

    table = table.set_column(
        table.schema.get_field_index("action"), "action", pa.array(actions, table.schema.field("action").type)
    )
    pq.write_table(table, f)
    with pytest.raises(
        ValueError, match=r"non-finite action at frame 4 .*episode 0.*data.on_bad_sample=skip"
    ):
        _all(build_loader(_cfg([path], shuffle=False, batch_size=1, chunk_length=2)))
    loader = build_loader(
        _cfg(
            [path],
            shuffle=False,
            batch_size=1,
            chunk_length=2,
            on_bad_sample="skip",
            max_skipped_fraction=0.5,
        )
    )
    frames = [b.meta["frame"][0] for b in loader]
    assert frames == [0, 1, 2, 5] and loader.num_skipped == 2  # frames 3 and 4 have the NaN in their chunk


@pytest.mark.distributed
def test_torchrun_two_ranks_get_disjoint_shares(data_root: Path, tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    with (
        socket.socket() as probe
    ):  # a port free now (a fixed one collides with any other run on this machine)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "verdict.json"
    script = Path(__file__).parent / "distributed" / "loader_ranks.py"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            str(script),
            str(data_root / "widowx_set"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = yaml.safe_load(out.read_text())
    assert verdict["disjoint"] and verdict["counts"][0] == verdict["counts"][1] > 0
    assert verdict["ranks"] == [0, 2]
    assert verdict["covered"] >= verdict["total"] - 2 * 2  # all but the last incomplete batch per rank


def test_joint_stats_over_two_datasets_normalize_per_embodiment(data_root: Path, tmp_path: Path) -> None:
    from vla.cli import main

    paths = [str(data_root / "widowx_set"), str(data_root / "franka_set")]
    out = tmp_path / "joint.json"
    assert main(["data", "stats", *paths, "--out", str(out)]) == 0
    stats = StatsFile.load(out)
    assert stats.get("widowx_bridge", "action") is not None and stats.get("franka_droid", "state") is not None
    loader = build_loader(
        _cfg([data_root / "widowx_set", data_root / "franka_set"], normalize=True, stats_path=str(out))
    )
    batch = next(iter(loader))
    assert torch.isfinite(batch.actions).all()
    assert main(["data", "stats", *paths]) == 2  # several datasets need --out


def _widowx(path: Path, seed: int) -> Path:
    return make_lerobot_dataset(
        path,
        num_episodes=2,
        episode_length=[8, 6],
        state_dim=7,
        action_dim=7,
        cameras={"primary": (16, 16)},
        robot_type="widowx_bridge",
        video=False,
        seed=seed,
    )


@pytest.mark.parametrize("files", ["renamed_dataset", "embodiment_keys_only"])
def test_datasets_of_one_embodiment_are_normalized_with_their_own_stats(
    tmp_path: Path, files: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each dataset's own stats file describes that dataset only: merging two of one embodiment must not let
    the last file's embodiment-wide entry normalize the other dataset."""
    a = _widowx(tmp_path / "a", seed=1)
    b = _widowx(tmp_path / ("b_before_rename" if files == "renamed_dataset" else "b"), seed=2)
    own = {"a": write_stats(a, progress=False), "b": write_stats(b, progress=False)}
    if files == "renamed_dataset":  # its file still says widowx_bridge@b_before_rename
        b = b.rename(tmp_path / "b")
        own["b"] = b / "meta" / "vla_stats.json"
    else:  # files carrying only embodiment-wide keys (hand-written or converted ones)
        for path in own.values():
            sf = StatsFile.load(path)
            sf.stats = {k: v for k, v in sf.stats.items() if "@" not in k}
            sf.save(path)
    spec = get_embodiment("widowx_bridge")
    norms = {n: Normalizer.from_spec(StatsFile.load(p), spec, "state") for n, p in own.items()}
    loader = build_loader(_cfg([b, a], normalize=True, shuffle=False, batch_size=1))
    readers = {"a": open_dataset(a), "b": open_dataset(b)}
    for batch in loader:
        name, ep, frame = batch.meta["dataset"][0], batch.meta["episode"][0], batch.meta["frame"][0]
        std = standardize_episode(readers[name], "train", ep)
        raw_state = std.state[int(np.flatnonzero(std.frames == frame)[0])][None]
        other = norms["b" if name == "a" else "a"](raw_state)[0]
        got = batch.state[0, :7].numpy()
        np.testing.assert_allclose(got, norms[name](raw_state)[0], rtol=1e-6, atol=1e-6)
        assert not np.allclose(got, other, atol=1e-3)
    assert loader.stats_keys == {
        n: {"state": f"widowx_bridge@{n}", "action": f"widowx_bridge@{n}"} for n in ("a", "b")
    }
    assert "widowx_bridge" not in loader.stats.stats  # no single embodiment-wide entry fits both
    assert "different stats" in caplog.text and str(own["a"]) in caplog.text and "joint.json" in caplog.text


def test_same_named_datasets_with_different_stats_are_an_error(tmp_path: Path) -> None:
    x, y = _widowx(tmp_path / "x" / "set", seed=1), _widowx(tmp_path / "y" / "set", seed=2)
    files = [write_stats(p, progress=False) for p in (x, y)]
    fix = r"share the name 'set'.*vla data stats .* --out joint.json.*stats_path"
    with pytest.raises(ValueError, match=fix) as error:
        build_loader(_cfg([x, y], normalize=True))
    assert all(str(f) in str(error.value) for f in files)


def test_loader_exposes_the_stats_it_normalizes_with(data_root: Path, tmp_path: Path) -> None:
    path = data_root / "widowx_set"
    assert build_loader(_cfg([path])).stats is None and build_loader(_cfg([path])).stats_keys == {}
    stats_path = write_stats(path, out=tmp_path / "stats.json", progress=False)
    loader = build_loader(_cfg([path], normalize=True, stats_path=str(stats_path)))
    assert loader.stats.path == stats_path
    assert loader.stats_keys == {"widowx_set": {"state": "widowx_bridge", "action": "widowx_bridge"}}
