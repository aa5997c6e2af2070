"""Scripted-expert dataset generation: worker-count invariance, shards + merge, resume, interruption, dropped
vs flagged failures, and the output read back through our reader and loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import vla.sim.generate as gen
from vla.config import DataConfig, load_config
from vla.data.loader import build_loader
from vla.data.merge import merge_datasets
from vla.data.readers import open_dataset
from vla.sim.generate import GenerateConfig, generate, shard_range


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
    assert (merged.copied, merged.reencoded) == (4, 0), merged  # alike shards: videos stream-copied
    assert "stream-copied for 4" in str(merged) and "re-encoded" not in str(merged)
    assert _episodes(merged.out) == _episodes(tmp_path / "single")
    _assert_frames_equal_sources(merged.out, [tmp_path / "shard0", tmp_path / "shard1"])
    # the image stats the shards recorded are kept, so the merged stats equal the single run's (up to the
    # rounding of aggregating them in float64 rather than the float32 they were computed in)
    got, want = (
        json.loads((p / "meta" / "stats.json").read_text()) for p in (merged.out, tmp_path / "single")
    )
    assert got.keys() == want.keys()
    for key in want:
        for stat in want[key]:
            np.testing.assert_allclose(got[key][stat], want[key][stat], rtol=1e-6, err_msg=f"{key}/{stat}")
    with pytest.raises(FileExistsError):
        merge_datasets([tmp_path / "shard0"], tmp_path / "merged")


def _assert_frames_equal_sources(merged: Path, sources: list[Path]) -> None:
    """Every frame of every camera of ``merged`` decodes byte-identical to the same frame of its source."""
    readers = [open_dataset(s) for s in sources]
    where = {int(r.episode_metadata("train", e)["sim_index"]): (r, e) for r in readers
             for e in range(r.num_episodes("train"))}  # fmt: skip
    out = open_dataset(merged)
    assert out.num_episodes("train") == len(where)
    for e in range(out.num_episodes("train")):
        src, se = where[int(out.episode_metadata("train", e)["sim_index"])]
        frames = list(range(out.episode_length("train", e)))
        assert frames == list(range(src.episode_length("train", se)))
        got, want = (r.read_images("train", i, frames, out.image_keys()) for r, i in ((out, e), (src, se)))
        for key in out.image_keys():
            assert got[key].shape[0] == len(frames) and got[key].tobytes() == want[key].tobytes(), (e, key)


def test_merge_reencodes_sources_whose_videos_differ(tmp_path: Path) -> None:
    """Shards encoded with different codecs cannot share a stream: frames are decoded and re-encoded (said so in
    the summary), the result loads with the same low-dim data and nearly the same frames."""
    generate(_cfg(tmp_path / "s0", shard=0, num_shards=2), progress_bar=False)
    generate(_cfg(tmp_path / "s1", shard=1, num_shards=2, vcodec="av1"), progress_bar=False)
    merged = merge_datasets([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m")
    assert (merged.copied, merged.reencoded) == (0, 4), merged
    assert "codec 'h264' vs 'av1'" in str(merged) and "re-encoded for 4" in str(merged)
    assert sorted(_episodes(merged.out)) == sorted(_episodes(tmp_path / "s0") + _episodes(tmp_path / "s1"))
    out, src = open_dataset(merged.out), open_dataset(tmp_path / "s1")
    key, n = out.image_keys()[0], src.episode_length("train", 0)
    got = out.read_images("train", 2, list(range(n)), [key])[key].astype(float)
    want = src.read_images("train", 0, list(range(n)), [key])[key].astype(float)
    assert got.shape == want.shape and np.abs(got - want).mean() < 4  # lossy, but the same pictures


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


def test_resume_refuses_a_dataset_begun_under_another_servo_model(tmp_path: Path, monkeypatch) -> None:
    """Episodes recorded before the arms had joint speed limits (servos jumped to each target) must not be topped
    up with today's: the dataset's settings record the servo model, and a resume under another one is refused."""
    generate(_cfg(tmp_path / "ds", episodes=2), progress_bar=False)
    monkeypatch.setattr("vla.sim.world.SERVO_MODEL", "another_servo_model")
    with pytest.raises(
        ValueError, match=r"servo_model: 'joint_speed_limited_ramp' then, 'another_servo_model' now"
    ):
        generate(_cfg(tmp_path / "ds", episodes=2), progress_bar=False)


def test_merge_refuses_shards_of_different_servo_models(tmp_path: Path, monkeypatch) -> None:
    """Shards generated under different servo models (different arm physics) are not merged into one dataset; the
    error names both models and where each was found, and nothing is written."""
    generate(_cfg(tmp_path / "s0", shard=0, num_shards=2), progress_bar=False)
    for module in ("vla.sim.world", "vla.sim.generate"):
        monkeypatch.setattr(f"{module}.SERVO_MODEL", "another_servo_model", raising=False)
    generate(_cfg(tmp_path / "s1", shard=1, num_shards=2), progress_bar=False)
    assert open_dataset(tmp_path / "s1").episode_metadata("train", 0)["servo_model"] == "another_servo_model"
    with pytest.raises(ValueError, match=r"different servo models \('joint_speed_limited_ramp' first in .*s0 "
                       r"\(train episode 0\); 'another_servo_model' first in .*s1"):  # fmt: skip
        merge_datasets([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m")
    assert not (tmp_path / "m").exists()
    # --overwrite of an earlier merge: refused before the earlier one is deleted
    merge_datasets([tmp_path / "s0"], tmp_path / "m")
    with pytest.raises(ValueError, match=r"different servo models"):
        merge_datasets([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m", overwrite=True)
    assert open_dataset(tmp_path / "m").num_episodes("train") == 2


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


def test_merge_reencodes_an_episode_it_cannot_cut(tmp_path: Path, monkeypatch) -> None:
    """An episode whose segment does not start on a keyframe is decoded and re-encoded (with the sources'
    codec and settings) between stream-copied ones; the summary says which and why."""
    import vla.data.merge as merge

    for k in range(2):
        generate(_cfg(tmp_path / f"s{k}", shard=k, num_shards=2), progress_bar=False)
    real = merge.video.cut_video
    calls: list[int] = []

    def uncuttable_third(path, start, length):  # the third episode's first camera (merge order 0, 1, 2, 3)
        calls.append(length)
        return None if len(calls) == 2 * 2 + 1 else real(path, start, length)

    monkeypatch.setattr(merge.video, "cut_video", uncuttable_third)
    merged = merge_datasets([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m")
    assert (merged.copied, merged.reencoded) == (3, 1), merged
    assert "episode 0 does not start on a keyframe" in str(merged)
    assert [e[0] for e in _episodes(merged.out)] == [0, 1, 2, 3]
    out, src = open_dataset(merged.out), open_dataset(tmp_path / "s1")
    for e, se in ((2, 0), (3, 1)):  # the re-encoded episode is close to its source, the next one exact
        n = src.episode_length("train", se)
        got, want = (
            r.read_images("train", i, list(range(n)), r.image_keys()) for r, i in ((out, e), (src, se))
        )
        for key in out.image_keys():
            diff = np.abs(got[key].astype(float) - want[key].astype(float)).mean()
            assert diff < 4 if e == 2 else diff == 0, (e, key, diff)


def test_merge_puts_an_episode_reencoded_with_other_headers_in_its_own_file(
    tmp_path: Path, monkeypatch
) -> None:
    """Sources written by another encoder build re-encode to other codec headers (simulated: the source's
    info.json claims CRF 10, so the merge re-encodes at 10 under copied CRF-30 streams). The re-encoded episode
    must not be appended under the copied stream's headers (it would decode to wrong pixels): it gets its own
    file, and every frame of every episode reads back right."""
    import vla.data.merge as merge
    from vla.data import video
    from vla.data.writers.synthetic import make_lerobot_dataset

    src = make_lerobot_dataset(tmp_path / "src", num_episodes=3, episode_length=[9, 7, 8], vcodec="h264")
    info = json.loads((src / "meta" / "info.json").read_text())
    key = "observation.images.front"
    info["features"][key]["info"]["video.crf"] = 10
    (src / "meta" / "info.json").write_text(json.dumps(info))
    real = merge.video.cut_video
    monkeypatch.setattr(merge.video, "cut_video", lambda p, s, n: None if n == 7 else real(p, s, n))
    merged = merge_datasets([src], tmp_path / "m")
    assert (merged.copied, merged.reencoded) == (2, 1), merged
    out, ref = open_dataset(merged.out), open_dataset(src)
    for e in range(3):
        n = ref.episode_length("train", e)
        got, want = (r.read_images("train", e, list(range(n)), [key])[key].astype(float) for r in (out, ref))
        diff = np.abs(got - want).mean()
        assert diff < 4 if e == 1 else diff == 0, (e, diff)
    files = sorted((merged.out / "videos" / key).rglob("*.mp4"))
    assert [p.name for p in files] == ["file-000.mp4", "file-001.mp4", "file-002.mp4"]  # copied | re | copied
    heads = [video.stream_signature(p)["headers"] for p in files]
    assert heads[0] == heads[2] != heads[1]
