"""`vla embodiment draft`: a spec drafted from a dataset of an unregistered robot loads, matches the data, and makes
the robot trainable (`vla data stats --embodiment`, `vla finetune --embodiment`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from train_helpers import run_cli

from vla.data.readers import open_dataset
from vla.data.writers.synthetic import make_lerobot_dataset
from vla.embodiments import EmbodimentSpec


@pytest.fixture(scope="module")
def my_arm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lerobot_dataset(
        tmp_path_factory.mktemp("draft") / "my_arm_data",
        num_episodes=3,
        episode_length=[20, 24, 18],
        cameras={"primary": (48, 64), "wrist": (32, 32)},
        state_dim=7,
        action_dim=7,
        fps=15,
        robot_type="my_arm",
        seed=4,
    )


def test_draft_matches_the_data(my_arm: Path, tmp_path: Path) -> None:
    out = tmp_path / "my_arm.yaml"
    r = run_cli(["embodiment", "draft", str(my_arm), "--name", "my_arm", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "state 7, action 7, 15 Hz" in r.stdout
    spec = EmbodimentSpec.from_yaml(out)
    assert spec.name == "my_arm" and spec.state_dim == 7 and spec.action_dim == 7 and spec.control_hz == 15
    assert {s: (c.height, c.width) for s, c in spec.cameras.items()} == {
        "primary": (48, 64),
        "wrist": (32, 32),
    }
    assert "TODO" in out.read_text()
    reader = open_dataset(my_arm)
    action = np.concatenate([reader.read_episode("train", e).steps["action"] for e in range(3)])
    low = np.concatenate([f.low for f in spec.action])
    high = np.concatenate([f.high for f in spec.action])
    assert np.all(action >= low) and np.all(action <= high)  # the limits contain the data
    r = run_cli(["embodiment", "draft", str(my_arm), "--name", "my_arm", "--out", str(out)])
    assert r.returncode == 2 and "--overwrite" in r.stderr


def test_drafted_robot_is_trainable(my_arm: Path, tmp_path: Path) -> None:
    out = tmp_path / "my_arm.yaml"
    assert (
        run_cli(["embodiment", "draft", str(my_arm), "--name", "my_arm", "--out", str(out)]).returncode == 0
    )
    r = run_cli(["data", "stats", str(my_arm)])
    assert r.returncode == 2 and "vla embodiment draft" in r.stderr  # without the spec: names the fix
    r = run_cli(["data", "stats", str(my_arm), "--embodiment", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    base = tmp_path / "base"
    assert (
        run_cli(
            ["model", "init", "tiny_smolvlm", "--out", str(base), "--embodiment", "widowx_bridge"]
        ).returncode
        == 0
    )
    sets = [
        "data.num_workers=0",
        "train.steps=2",
        "train.save_every=2",
        "logging.progress=false",
        f"data.datasets=[{my_arm}]",
    ]
    args = ["finetune", str(base), "--embodiment", str(out), "--run-dir", str(tmp_path / "ft")]
    r = run_cli([*args, *[x for a in sets for x in ("--set", a)]])
    assert r.returncode == 0, r.stderr[-3000:]


def test_draft_of_the_bridge_rlds_fixture(bridge_fixture: Path, tmp_path: Path) -> None:
    out = tmp_path / "bridge.yaml"
    r = run_cli(["embodiment", "draft", str(bridge_fixture), "--name", "bridge_draft", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    spec = EmbodimentSpec.from_yaml(out)
    assert spec.action_dim == 7 and spec.state_dim == 7 and spec.control_hz == 5 and "primary" in spec.cameras
