"""The procedural and bimanual sim robots end to end: ``vla sim generate`` -> ``vla data`` commands -> the training
loader's normalized ``Batch`` -> the tiny model's loss; plus the registered ``sim_procedural_<dof>dof`` specs."""

from __future__ import annotations

from pathlib import Path

import mujoco
import numpy as np
import pytest
import torch

from vla.cli import main
from vla.config import DataConfig, load_config
from vla.data.loader import build_loader
from vla.data.readers import open_dataset
from vla.embodiments import get_embodiment
from vla.sim import ROBOTS, build_robot, build_world, procedural_embodiment_spec, procedural_family_spec
from vla.sim.env import make
from vla.sim.procedural import AXIS_PATTERNS
from vla.sim.tasks import Workspace

DOFS = sorted(AXIS_PATTERNS)


@pytest.mark.parametrize("dof", DOFS)
def test_procedural_family_yaml_matches_and_bounds_every_arm(dof: int) -> None:
    spec = get_embodiment(f"sim_procedural_{dof}dof")
    assert spec == procedural_family_spec(dof), "YAML out of date: regenerate with procedural_family_spec"
    lo, hi = spec.limits("action")
    for seed in range(8):
        arm = procedural_embodiment_spec(build_robot("procedural", mujoco.MjSpec(), seed=seed, dof=dof))
        assert arm.action_names() == spec.action_names() and arm.state_names() == spec.state_names()
        assert arm.cameras.keys() == spec.cameras.keys()
        arm_lo, arm_hi = arm.limits("action")
        assert np.all(lo <= arm_lo) and np.all(arm_hi <= hi), (seed, arm_lo, arm_hi)


def test_env_names_fix_the_procedural_dof() -> None:
    for name, dof in (("procedural_4dof", 4), ("sim_procedural_7dof", 7)):
        env = make(name, "reach", image_size=16)
        assert env.embodiment_spec.name == f"sim_procedural_{dof}dof"
        assert env.action_space.shape == (dof + 1,)
        _, info = env.reset(seed=3)
        assert info["robot_params"]["dof"] == dof
    plain = make("procedural", "reach", image_size=16)  # the DoF of the first seed's arm (seed 0)
    assert plain.robot_options["dof"] == build_world("procedural", seed=0).robot.dof
    with pytest.raises(ValueError, match="has dof 4 but robot_options say 6"):
        make("procedural_4dof", "reach", robot_options={"dof": 6})


@pytest.mark.parametrize("robot", [r for r in ROBOTS.names() if r != "procedural"])
def test_fixed_robots_workspace_does_not_depend_on_the_seed(robot: str) -> None:
    # VLASimEnv.reset relies on this to build one world per reset instead of a probe and the real one.
    env = make(robot, "reach", image_size=16)
    assert env._workspace is not None
    for seed in (1, 12345):
        ws = Workspace.of(build_world(robot, seed=seed, image_size=16))
        for field in ("center", "half", "base"):
            np.testing.assert_array_equal(getattr(ws, field), getattr(env._workspace, field))
        assert (ws.reach, ws.robot) == (env._workspace.reach, env._workspace.robot)


@pytest.mark.parametrize(
    ("embodiment", "task", "spec_name"),
    [("procedural_5dof", "reach", "sim_procedural_5dof"), ("aloha", "reach", "sim_aloha")],
)
def test_generate_to_loader_batch_to_model_loss(
    tmp_path: Path, capsys, embodiment: str, task: str, spec_name: str
) -> None:
    out = tmp_path / "ds"
    args = ["--embodiment", embodiment, "--task", task, "--episodes", "2", "--image-size", "32"]
    assert main(["sim", "generate", *args, "--out", str(out), "--workers", "2"]) == 0
    for cmd in (["info"], ["show", "--episode", "0", "--frame", "1"], ["stats"], ["validate"]):
        assert main(["data", *cmd, str(out)]) == 0, capsys.readouterr()
    text = capsys.readouterr().out
    assert spec_name in text and "OK: no problems found" in text
    spec = get_embodiment(spec_name)
    reader = open_dataset(out)
    assert reader.robot_type == spec_name
    if embodiment.startswith("procedural"):  # each episode's own arm, from a family of one DoF
        params = [reader.episode_metadata("train", e)["robot_params"] for e in range(2)]
        assert [p["dof"] for p in params] == [5, 5] and params[0]["upper_arm"] != params[1]["upper_arm"]

    cfg = load_config(
        DataConfig, {"datasets": [str(out)], "batch_size": 4, "chunk_length": 4, "image_size": 0}
    )
    batch = next(iter(build_loader(cfg)))
    batch.validate()
    assert batch.state.shape == (4, spec.state_dim) and batch.actions.shape == (4, 4, spec.action_dim)
    assert set(batch.images) == set(spec.cameras) and batch.images["primary"].shape[2:] == (32, 32, 3)
    assert torch.isfinite(batch.state).all() and torch.isfinite(batch.actions).all()
    assert batch.actions.abs().max() < 10  # normalized (quantile -> about [-1, 1])

    from vla.models.testing import tiny_model

    model = tiny_model("smolvlm", embodiments=(spec_name,), chunk_length=4)
    batch = next(iter(build_loader(cfg, embodiment_ids=model.embodiment_ids)))
    loss, _ = model.loss(batch, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and loss > 0


SAVE_RESULT = '\n(out / "result.json").write_text(json.dumps(result))\n'


def test_lerobot_loads_a_generated_bimanual_dataset(tmp_path: Path) -> None:
    """Worker-encoded, stream-concatenated sim videos load in LeRobot 0.6.1 (both video backends), every camera
    frame and every low-dim value as our reader reads them."""
    from peer import LOAD_ITEMS, peer_python

    python = peer_python()
    if python is None:
        pytest.skip("LeRobot peer venv not found (set PEER_VENV or run ../shared/peer/setup_lerobot_venv.sh)")
    import json
    import os
    import subprocess

    out = tmp_path / "ds"
    args = [
        "--embodiment",
        "aloha",
        "--task",
        "reach",
        "--episodes",
        "2",
        "--image-size",
        "32",
        "--workers",
        "2",
    ]
    assert main(["sim", "generate", *args, "--out", str(out)]) == 0
    reader = open_dataset(out)
    lengths = [reader.episode_length("train", e) for e in range(2)]
    starts = [0, lengths[0]]
    query = [0, lengths[0] - 1, lengths[0], lengths[0] + lengths[1] - 1]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_LEROBOT_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([str(python), "-c", LOAD_ITEMS + SAVE_RESULT, str(out), json.dumps(query), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    cams = reader.image_keys()
    assert len(cams) == 3  # primary + two wrists
    for backend, res in result.items():
        assert (res["len"], res["num_episodes"], res["fps"]) == (sum(lengths), 2, reader.fps), backend
        for idx, row in zip(query, res["items"], strict=True):
            e = int(idx >= lengths[0])
            f = idx - starts[e]
            ep = reader.read_episode("train", e)
            assert (row["episode_index"], row["frame_index"]) == (e, f)
            np.testing.assert_array_equal(
                np.float32(row["observation.state"]), ep.steps["observation.state"][f]
            )
            np.testing.assert_array_equal(np.float32(row["action"]), ep.steps["action"][f])
            assert row["task"] == reader.read_frame("train", e, f)["task"]
            ours = reader.read_images("train", e, [f], cams)
            for cam in cams:
                theirs = np.load(tmp_path / f"{backend}-{idx}-{cam}.npy")
                diff = np.abs(theirs.astype(int) - ours[cam][0].astype(int))
                assert diff.mean() < 1.0 and diff.max() <= 8, (backend, idx, cam, diff.mean(), diff.max())
