"""Scripted-expert dataset generation: worker-count invariance, shards + merge, resume, interruption, dropped
vs flagged failures, and the output read back through our reader and loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import vla.sim.generate as gen
from vla.config import DataConfig, load_config
from vla.data.loader import build_loader
from vla.data.readers import open_dataset
from vla.sim.generate import GenerateConfig, generate, merge_datasets, shard_range


def _cfg(out: Path, **kw) -> GenerateConfig:
    base = dict(embodiment="panda", task="reach", episodes=4, out=str(out), image_size=48, vcodec="h264")
    base.update(kw)
    return GenerateConfig(**base)


def _episodes(path: Path) -> list[tuple]:
    r = open_dataset(path)
    out = []
    for e in range(r.num_episodes("train")):
        raw = r.read_episode("train", e)
        meta = r.episode_metadata("train", e)
        out.append(
            (
                int(meta["sim_index"]),
                raw.steps["action"].tobytes(),
                raw.steps["observation.state"].tobytes(),
                str(raw.steps["task"][0]),
            )
        )
    return out


def test_shard_ranges_partition_the_episodes() -> None:
    parts = [shard_range(10, k, 3) for k in range(3)]
    assert [len(p) for p in parts] == [4, 3, 3] and sorted(i for p in parts for i in p) == list(range(10))


def test_worker_count_does_not_change_the_data(tmp_path: Path) -> None:
    a = generate(_cfg(tmp_path / "w1", workers=1), progress_bar=False)
    b = generate(_cfg(tmp_path / "w2", workers=2), progress_bar=False)
    assert a["written"] == b["written"] == 4
    assert _episodes(tmp_path / "w1") == _episodes(tmp_path / "w2")


def test_shards_merge_into_the_single_run_dataset(tmp_path: Path) -> None:
    generate(_cfg(tmp_path / "single"), progress_bar=False)
    for k in range(2):
        generate(_cfg(tmp_path / f"shard{k}", shard=k, num_shards=2), progress_bar=False)
    assert [e[0] for e in _episodes(tmp_path / "shard0")] == [0, 1]
    merged = merge_datasets([tmp_path / "shard1", tmp_path / "shard0"], tmp_path / "merged")
    assert _episodes(merged) == _episodes(tmp_path / "single")
    with pytest.raises(FileExistsError):
        merge_datasets([tmp_path / "shard0"], tmp_path / "merged")


def test_interrupt_leaves_a_valid_dataset_and_rerun_completes(tmp_path: Path, monkeypatch) -> None:
    real = gen.run_episode

    def flaky(cfg, index):
        if index == 2:
            raise KeyboardInterrupt
        return real(cfg, index)

    monkeypatch.setattr(gen, "run_episode", flaky)
    with pytest.raises(KeyboardInterrupt):
        generate(_cfg(tmp_path / "ds"), progress_bar=False)
    assert [e[0] for e in _episodes(tmp_path / "ds")] == [0, 1]  # readable, the finished episodes only
    monkeypatch.setattr(gen, "run_episode", real)
    counts = generate(_cfg(tmp_path / "ds"), progress_bar=False)
    assert counts == {"written": 2, "dropped": 0, "skipped": 2, "out": str(tmp_path / "ds")}
    generate(_cfg(tmp_path / "ref"), progress_bar=False)
    assert _episodes(tmp_path / "ds") == _episodes(tmp_path / "ref")
    with pytest.raises(ValueError, match="these settings differ"):
        generate(_cfg(tmp_path / "ds", seed=5), progress_bar=False)


def test_failures_are_dropped_or_kept_flagged_never_mixed_in(tmp_path: Path) -> None:
    counts = generate(_cfg(tmp_path / "drop", task="pick_place", max_steps=2), progress_bar=False)
    assert counts["written"] == 0 and counts["dropped"] == 4
    assert not (tmp_path / "drop" / "meta" / "info.json").exists()
    counts = generate(
        _cfg(tmp_path / "keep", task="pick_place", max_steps=2, keep_failed=True), progress_bar=False
    )
    assert counts["written"] == 4
    r = open_dataset(tmp_path / "keep")
    assert all(r.episode_metadata("train", e)["success"] is False for e in range(4))


def test_output_loads_in_our_loader_with_instructions_and_randomization(tmp_path: Path) -> None:
    out = tmp_path / "rand"
    generate(_cfg(out, task="pick_place", episodes=2, randomization="medium"), progress_bar=False)
    r = open_dataset(out)
    meta = r.episode_metadata("train", 0)
    assert meta["success"] is True and meta["randomization"]["level"] == "medium"
    assert meta["instruction"] == str(r.read_episode("train", 0).steps["task"][0])
    cfg = load_config(
        DataConfig,
        {"datasets": [str(out)], "normalize": False, "batch_size": 4, "chunk_length": 5, "image_size": 0},
    )
    batch = next(iter(build_loader(cfg)))
    batch.validate()
    assert batch.state.shape == (4, 8) and batch.actions.shape == (4, 5, 8)
    assert set(batch.images) == {"primary", "wrist"} and batch.images["primary"].shape[2:] == (48, 48, 3)
    assert all(
        p in {meta["instruction"], r.episode_metadata("train", 1)["instruction"]} for p in batch.prompt
    )
    assert np.isfinite(batch.actions.numpy()).all()


def test_cli_generate_merge_and_preview(tmp_path: Path, capsys) -> None:
    from vla.cli import main

    common = ["--embodiment", "panda", "--task", "reach", "--episodes", "2", "--image-size", "48"]
    for k in range(2):
        assert (
            main(
                [
                    "sim",
                    "generate",
                    *common,
                    "--out",
                    str(tmp_path / f"s{k}"),
                    "--shard",
                    str(k),
                    "--num-shards",
                    "2",
                ]
            )
            == 0
        )
    assert "wrote 1 episodes" in capsys.readouterr().out
    assert (
        main(["data", "merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(tmp_path / "m")]) == 0
    )
    assert [e[0] for e in _episodes(tmp_path / "m")] == [0, 1]
    assert (
        main(["sim", "preview", "--embodiment", "panda", "--task", "reach", "--out", str(tmp_path / "p.gif")])
        == 0
    )
    from PIL import Image

    assert Image.open(tmp_path / "p.gif").n_frames > 2
    assert main(["sim", "generate", *common, "--out", str(tmp_path / "x"), "--shard", "3"]) == 2
    assert "--shard must be in [0, --num-shards=1)" in capsys.readouterr().err


def test_sim_mix_names_are_generatable_robot_task_pairs() -> None:
    from vla.data.mixture import get_mixture
    from vla.sim import ROBOTS
    from vla.sim.tasks import TASKS

    pairs = {f"sim_{r}_{t}" for r in ROBOTS.names() for t in TASKS.names()}
    names = [d.name for d in get_mixture("sim_mix").datasets]
    assert names and set(names) <= pairs, sorted(set(names) - pairs)
