"""``vla model predict``: a checkpoint's action chunk on one stored frame next to the recorded actions.

Everything is written here: a LeRobot v3.0 dataset of the ``widowx_bridge`` embodiment (generic key map: the
stored action is the standardized action), its stats (``vla data stats``) and tiny checkpoints (``vla model
init tiny_smolvlm``). Recorded actions are checked against the parquet rows read with pyarrow, not our reader.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vla.cli import main
from vla.data.writers.synthetic import make_lerobot_dataset
from vla.embodiments import get_embodiment

EMBODIMENT = "widowx_bridge"
LENGTHS = [6, 9, 5]
SPEC = get_embodiment(EMBODIMENT)
H = min(SPEC.chunk_length, 8)  # tiny_smolvlm's chunk_length is 8
A = SPEC.action_dim


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def predict(capsys: pytest.CaptureFixture[str], ckpt: Path, ds: Path, *args: object) -> dict[str, Any]:
    rc, out, err = run_cli(capsys, "model", "predict", ckpt, ds, *args, "--json")
    assert rc == 0, err
    assert out.count("\n") == 1, "--json prints exactly one line"
    return json.loads(out)


def init_checkpoint(out: Path, *args: object, capsys: pytest.CaptureFixture[str] | None = None) -> Path:
    """``vla model init tiny_smolvlm --out OUT ARGS``; its "wrote" line is taken off ``capsys`` when given."""
    assert main(["model", "init", "tiny_smolvlm", "--out", str(out), *map(str, args)]) == 0
    if capsys is not None:
        capsys.readouterr()
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_lerobot_dataset(
        tmp_path_factory.mktemp("predict") / "widowx",
        num_episodes=len(LENGTHS),
        episode_length=LENGTHS,
        cameras={"front": (24, 32)},
        state_dim=SPEC.state_dim,
        action_dim=A,
        fps=5,
        video=False,
        robot_type=EMBODIMENT,
    )
    assert main(["data", "stats", str(root)]) == 0
    return root


@pytest.fixture(scope="module")
def checkpoint(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    return init_checkpoint(out, "--embodiment", EMBODIMENT, "--stats-from", dataset)


def recorded_actions(root: Path, episode: int) -> np.ndarray:
    """``[T, A]`` actions of ``episode`` straight from the parquet files, in frame order."""
    rows = pa.concat_tables(
        [pq.read_table(f) for f in sorted((root / "data").rglob("*.parquet"))]
    ).to_pylist()
    mine = sorted((r for r in rows if r["episode_index"] == episode), key=lambda r: r["frame_index"])
    return np.array([r["action"] for r in mine], dtype=np.float64)


def test_json_contract_and_recorded_window(
    checkpoint: Path, dataset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    episode, frame = 1, LENGTHS[1] - 2  # two real steps, then past the episode end
    out = predict(capsys, checkpoint, dataset, "--episode", episode, "--frame", frame)
    assert out["embodiment"] == EMBODIMENT and out["action_names"] == SPEC.action_names()
    actions = np.array(out["actions"])
    assert actions.shape == (H, A) and np.isfinite(actions).all()
    truth = recorded_actions(dataset, episode)
    n_valid = LENGTHS[episode] - frame
    assert out["recorded_is_pad"] == [False] * n_valid + [True] * (H - n_valid)
    assert out["recorded"][n_valid:] == [None] * (H - n_valid)
    recorded = np.array(out["recorded"][:n_valid])
    np.testing.assert_allclose(recorded, truth[frame:], rtol=0, atol=1e-6)
    mae = np.abs(actions[:n_valid] - truth[frame:])
    np.testing.assert_allclose(out["error"]["per_dim"], mae.mean(axis=0), rtol=1e-5, atol=1e-6)
    assert out["error"]["overall"] == pytest.approx(mae.mean(), rel=1e-5)
    assert out["error"]["valid_steps"] == n_valid

    rc, text, _ = run_cli(
        capsys, "model", "predict", checkpoint, dataset, "--episode", episode, "--frame", frame
    )
    assert rc == 0 and "(past episode end)" in text
    assert f"{actions[0, 0]:.4f}" in text and f"{truth[frame, 0]:.4f}" in text


def test_same_seed_same_chunk_other_seed_differs(
    checkpoint: Path, dataset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--episode", 0, "--frame", 1)
    a = predict(capsys, checkpoint, dataset, *args, "--seed", 3)
    b = predict(capsys, checkpoint, dataset, *args, "--seed", 3)
    c = predict(capsys, checkpoint, dataset, *args, "--seed", 4)
    assert a["actions"] == b["actions"]
    assert not np.allclose(a["actions"], c["actions"])


def _edit_stats(folder: Path, fn: Any) -> None:
    f = folder / "norm_stats.json"
    stats = json.loads(f.read_text())
    fn(stats["stats"])
    f.write_text(json.dumps(stats))


def test_unnormalized_with_the_checkpoints_stats_not_the_datasets(
    checkpoint: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--episode", 2, "--frame", 0, "--seed", 1)
    base = np.array(predict(capsys, checkpoint, dataset, *args)["actions"])
    # The dataset's own stats file is not read: garbage there changes nothing.
    ds_copy = shutil.copytree(dataset, tmp_path / "ds")
    stats_file = ds_copy / "meta" / "vla_stats.json"
    stats = json.loads(stats_file.read_text())
    for entry in stats["stats"].values():
        for key in ("q01", "min", "mean"):
            entry["action"][key] = [v - 5.0 for v in entry["action"][key]]
    stats_file.write_text(json.dumps(stats))
    np.testing.assert_array_equal(predict(capsys, checkpoint, ds_copy, *args)["actions"], base)
    # Shifting the checkpoint's action stats by c shifts the quantile-normalized dims of the chunk by c.
    shifted = shutil.copytree(checkpoint, tmp_path / "shifted")

    def shift(s: dict[str, Any]) -> None:
        for entry in s.values():
            for key in ("mean", "min", "max", "q01", "q99"):
                entry["action"][key] = [v + 0.5 for v in entry["action"][key]]

    _edit_stats(shifted, shift)
    moved = np.array(predict(capsys, shifted, dataset, *args)["actions"])
    quantile = np.array([m == "quantile" for m in SPEC.norm_modes("action")])
    assert quantile.any() and not quantile.all()
    np.testing.assert_allclose(moved[:, quantile] - base[:, quantile], 0.5, atol=1e-5)
    np.testing.assert_allclose(moved[:, ~quantile], base[:, ~quantile], atol=1e-6)


def test_run_folder_picks_the_newest_complete_step(
    checkpoint: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--episode", 0, "--frame", 2, "--seed", 5)
    other = init_checkpoint(
        tmp_path / "other", "--embodiment", EMBODIMENT, "--stats-from", dataset, "--seed", 1, capsys=capsys
    )
    run = tmp_path / "run"
    complete = shutil.copytree(checkpoint, run / "checkpoints" / "step-0000002")
    (complete / "COMPLETE").touch()
    shutil.copytree(other, run / "checkpoints" / "step-0000005")  # newer, but its write never finished
    out = predict(capsys, run, dataset, *args)
    assert Path(out["checkpoint"]) == complete
    assert out["actions"] == predict(capsys, checkpoint, dataset, *args)["actions"]
    assert out["actions"] != predict(capsys, other, dataset, *args)["actions"]  # a wrong pick would show
    rc, _, err = run_cli(
        capsys,
        "model",
        "predict",
        run / "checkpoints" / "step-0000005",
        dataset,
        "--episode",
        0,
        "--frame",
        0,
    )
    assert rc == 2 and "COMPLETE" in err


def test_embodiment_not_in_the_model(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = init_checkpoint(tmp_path / "franka", "--embodiment", "franka_oxe_joint", capsys=capsys)
    rc, _, err = run_cli(capsys, "model", "predict", ckpt, dataset, "--episode", 0, "--frame", 0)
    assert rc == 2
    assert EMBODIMENT in err and "franka_oxe_joint" in err
    # the suggested command is one vla finetune accepts (it named a positional dataset it has not)
    fix = f"vla finetune {ckpt.resolve()} --embodiment {EMBODIMENT} --run-dir RUN --set data.datasets=[{dataset}]"
    assert fix in err, err


def test_checkpoint_without_stats(
    checkpoint: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = init_checkpoint(tmp_path / "bare", "--embodiment", EMBODIMENT, capsys=capsys)
    rc, _, err = run_cli(capsys, "model", "predict", bare, dataset, "--episode", 0, "--frame", 0)
    assert rc == 2 and "no normalization stats" in err and f"vla data stats {dataset}" in err
    other = shutil.copytree(checkpoint, tmp_path / "other_stats")

    def only_another_embodiment(s: dict[str, Any]) -> None:
        entry = s[EMBODIMENT]
        s.clear()
        s["franka_oxe_joint"] = entry

    _edit_stats(other, only_another_embodiment)
    rc, _, err = run_cli(capsys, "model", "predict", other, dataset, "--episode", 0, "--frame", 0)
    assert rc == 2 and f"'{EMBODIMENT}/state'" in err and f"vla data stats {dataset}" in err


@pytest.mark.parametrize(
    ("episode", "frame", "message"),
    [
        (3, 0, "--episode 3 out of range; split 'train' has 3 episodes (0..2)"),
        (-1, 0, "--episode -1 out of range"),
        (2, 5, "--frame 5 out of range; train episode 2 has 5 frames (0..4)"),
    ],
)
def test_episode_or_frame_out_of_range(
    checkpoint: Path,
    dataset: Path,
    capsys: pytest.CaptureFixture[str],
    episode: int,
    frame: int,
    message: str,
) -> None:
    rc, out, err = run_cli(
        capsys, "model", "predict", checkpoint, dataset, "--episode", episode, "--frame", frame
    )
    assert rc == 2 and out == "" and message in err


def test_a_damaged_episode_refuses_only_itself(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One episode's file truncated (LeRobot v2.1: a parquet file per episode): the others still predict, and
    asking for the damaged one names it (before: every episode was refused, pointing to a setting predict lacks)."""
    ds = make_lerobot_dataset(
        tmp_path / "v21", num_episodes=len(LENGTHS), episode_length=LENGTHS, cameras={"front": (24, 32)},
        state_dim=SPEC.state_dim, action_dim=A, fps=5, video=False, robot_type=EMBODIMENT, version="v2.1",
    )  # fmt: skip
    damaged = sorted((ds / "data").rglob("episode_000002.parquet"))[0]
    damaged.write_bytes(damaged.read_bytes()[:100])
    out = predict(capsys, checkpoint, ds, "--episode", 0, "--frame", 1)
    assert out["episode"] == 0 and len(out["actions"][0]) == A
    rc, _, err = run_cli(capsys, "model", "predict", checkpoint, ds, "--episode", 2, "--frame", 0)
    assert rc == 2 and "episode 2 cannot be read" in err and "on_bad_sample" not in err, err


def _write_preprocessing(folder: Path, **values: Any) -> None:
    (folder / "preprocessing.json").write_text(json.dumps(values))


def test_the_checkpoints_preprocessing_is_applied(
    checkpoint: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``preprocessing.json`` (what ``vla train`` saves): its chunk length, and its per-dataset stats keys."""
    args = ("--episode", 1, "--frame", 3, "--seed", 2)
    base = predict(capsys, checkpoint, dataset, *args)
    short = shutil.copytree(checkpoint, tmp_path / "short")
    _write_preprocessing(short, image_size=64, chunk_length=2, obs_history=1, normalize=True)
    out = predict(capsys, short, dataset, *args)
    assert np.array(out["actions"]).shape == (2, A) and len(out["recorded"]) == 2
    np.testing.assert_allclose(out["recorded"], np.array(base["recorded"])[:2])
    # Trained with the dataset's own "<embodiment>@<dataset>" stats: those unnormalize, not the embodiment's.
    own = shutil.copytree(checkpoint, tmp_path / "own")
    key = f"{EMBODIMENT}@{dataset.name}"

    def shift_own(s: dict[str, Any]) -> None:
        assert key in s
        for name in ("mean", "min", "max", "q01", "q99"):
            s[key]["action"][name] = [v + 0.25 for v in s[key]["action"][name]]

    _edit_stats(own, shift_own)
    assert (
        predict(capsys, own, dataset, *args)["actions"] == base["actions"]
    )  # no stats_keys: embodiment-wide
    keys = {"state": key, "action": key}
    _write_preprocessing(own, image_size=64, chunk_length=4, normalize=True, stats_keys={dataset.name: keys})
    moved = np.array(predict(capsys, own, dataset, *args)["actions"])
    quantile = np.array([m == "quantile" for m in SPEC.norm_modes("action")])
    np.testing.assert_allclose(moved[:, quantile] - np.array(base["actions"])[:, quantile], 0.25, atol=1e-5)


def test_the_runs_standardization_decides_which_frames_are_samples(
    checkpoint: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run trained with ``data.standardize.drop_first=2`` never saw frames 0 and 1 of an episode: predict
    rebuilds the episodes with the recorded options, refuses those frames, and keeps the windows' raw frames."""
    args = ("--episode", 1, "--frame", 3, "--seed", 2)
    base = predict(capsys, checkpoint, dataset, *args)
    dropped = shutil.copytree(checkpoint, tmp_path / "dropped")
    standardize = {"drop_first": 2, "drop_last": None, "language_choice": "first_nonempty"}
    _write_preprocessing(dropped, image_size=64, normalize=True, standardize=standardize, data_seed=0)
    rc, out, err = run_cli(capsys, "model", "predict", dropped, dataset, "--episode", 1, "--frame", 1)
    assert out == ""
    assert rc == 2 and "frame 1 is not a training sample" in err and "kept frames run 2..8" in err
    same = predict(capsys, dropped, dataset, *args)  # frame 3 is a sample either way: the same window
    assert same["recorded"] == base["recorded"] and same["actions"] == base["actions"]


def test_a_checkpoint_whose_spec_text_is_older_still_loads(
    checkpoint: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint saved before a built-in spec's descriptions were edited (e.g. the sim arms' joint speed limits
    added to their action text) predicts as before; a changed field that matters is still refused."""
    import yaml

    old = tmp_path / "old"
    shutil.copytree(checkpoint, old)
    path = old / "embodiments" / f"{EMBODIMENT}.yaml"
    spec = yaml.safe_load(path.read_text())
    spec["action"][0]["description"] = "an older text"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    fresh = predict(capsys, checkpoint, dataset, "--episode", 0, "--frame", 0)
    assert predict(capsys, old, dataset, "--episode", 0, "--frame", 0)["actions"] == fresh["actions"]
    spec["action"][0]["units"] = "deg"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    rc, _, err = run_cli(capsys, "model", "predict", old, dataset, "--episode", 0, "--frame", 0)
    assert rc != 0 and "already registered with a different spec (differs in ['action'])" in err
