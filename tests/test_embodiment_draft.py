"""`vla embodiment draft` and spec files passed as `--embodiment`: a drafted spec loads, matches the data it was
drafted from (dims, names, cameras, rate, limits, absolute vs delta where the truth is known), and makes a LeRobot
dataset of an unregistered robot loadable with only the YAML."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from train_helpers import run_cli

from vla.cli import main
from vla.config import DataConfig
from vla.data.draft_spec import draft_spec, write_draft
from vla.data.loader import build_loader
from vla.data.readers import DatasetFormatError, open_dataset
from vla.data.stats import write_stats
from vla.data.writers.synthetic import make_lerobot_dataset
from vla.embodiments import EMBODIMENTS, EmbodimentSpec, SpecError, get_embodiment, register_embodiment
from vla.sim.generate import GenerateConfig, generate

JOINTS = ["shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "wrist_yaw", "gripper"]


@pytest.fixture(scope="module")
def my_arm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LeRobot v3 dataset of robot_type `my_arm` (registered nowhere) with per-dim names and a `phone` camera,
    a name no slot heuristic knows."""
    path = make_lerobot_dataset(
        tmp_path_factory.mktemp("draft") / "my_arm_data",
        num_episodes=3,
        episode_length=[20, 24, 18],
        cameras={"phone": (48, 64), "wrist": (32, 32)},
        state_dim=7,
        action_dim=7,
        fps=15,
        robot_type="my_arm",
        seed=4,
    )
    info_file = path / "meta" / "info.json"
    info = json.loads(info_file.read_text())
    for key in (
        "observation.state",
        "action",
    ):  # LeRobot's per-dimension names, as a real robot's dataset has
        info["features"][key]["names"] = JOINTS
    info_file.write_text(json.dumps(info, indent=2))
    return path


@pytest.fixture
def registry_restored() -> Iterator[None]:
    """Specs registered during the test (from YAML files) are removed after it: the registry is process-wide."""
    before = set(EMBODIMENTS.names())
    yield
    for name in set(EMBODIMENTS.names()) - before:
        del EMBODIMENTS._items[name]


def _all(path: Path, key: str) -> np.ndarray:
    reader = open_dataset(path)
    split = reader.splits()[0]
    return np.concatenate(
        [reader.read_episode(split, e).steps[key] for e in range(reader.num_episodes(split))]
    )


def _assert_limits_contain(spec: EmbodimentSpec, path: Path, state_key: str) -> None:
    for which, key in (("state", state_key), ("action", "action")):
        low, high = spec.limits(which)
        data = _all(path, key)
        assert np.isfinite(low).all() and np.isfinite(high).all()
        assert np.all(data >= low) and np.all(data <= high), which
        assert np.all(
            high - low <= 1.2 * np.maximum(data.max(0) - data.min(0), 1.0) + 0.1
        )  # a margin, not a guess


def test_draft_of_an_unregistered_lerobot_robot(my_arm: Path, tmp_path: Path) -> None:
    out = tmp_path / "my_arm.yaml"
    r = run_cli(["embodiment", "draft", str(my_arm), "--name", "my_arm", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "primary <- observation.images.phone 48x64 (GUESS: first free slot)" in r.stdout
    assert "wrist <- observation.images.wrist 32x32 (by its name)" in r.stdout
    spec = EmbodimentSpec.from_yaml(out)
    assert spec.name == "my_arm" and spec.control_hz == 15 and spec.chunk_length == 15
    for fields in (spec.state, spec.action):  # names from info.json; wrist_roll + wrist_yaw are no rotation
        assert [(f.name, f.kind, list(f.dims)) for f in fields] == [
            ("joint_pos", "joint_pos", JOINTS[:6]),
            ("gripper", "gripper", ["gripper"]),
        ]
    assert {s: (c.height, c.width) for s, c in spec.cameras.items()} == {
        "primary": (48, 64),
        "wrist": (32, 32),
    }
    assert spec.extra["lerobot_cameras"] == {
        "primary": "observation.images.phone",
        "wrist": "observation.images.wrist",
    }
    _assert_limits_contain(spec, my_arm, "observation.state")
    text = out.read_text()
    for todo in ("TODO units", "TODO camera slot", "what 1 means", "absolute vs delta actions"):
        assert todo in text

    r = run_cli(["embodiment", "draft", str(my_arm), "--name", "my_arm2", "--out", str(out)])
    assert r.returncode == 2 and "--overwrite" in r.stderr and EmbodimentSpec.from_yaml(out).name == "my_arm"
    r = run_cli(["embodiment", "draft", str(my_arm), "--name", "my_arm2", "--out", str(out), "--overwrite"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert EmbodimentSpec.from_yaml(out).name == "my_arm2" and "robot_type is 'my_arm'" in r.stdout


def test_drafted_spec_makes_the_robot_loadable(my_arm: Path, tmp_path: Path, registry_restored: None) -> None:
    out = tmp_path / "spec" / "my_arm.yaml"
    write_draft(my_arm, "my_arm", out)
    assert "my_arm" not in EMBODIMENTS
    with pytest.raises(ValueError, match="vla embodiment draft"):  # without the spec: the error names the fix
        write_stats(my_arm)
    r = run_cli(["data", "stats", str(my_arm), "--embodiment", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    # the inspection commands take the spec file too (each a fresh process: only --embodiment registers it)
    r = run_cli(["data", "info", str(my_arm), "--json"])
    assert r.returncode == 0 and json.loads(r.stdout)["embodiment"] in (None, ""), r.stdout[-500:]
    r = run_cli(["data", "info", str(my_arm), "--json", "--embodiment", str(out)])
    assert r.returncode == 0 and json.loads(r.stdout)["embodiment"] == "my_arm", r.stderr[-2000:]
    r = run_cli(["data", "validate", str(my_arm), "--embodiment", str(out)])
    assert r.returncode == 0 and "OK: no problems" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    r = run_cli(
        ["data", "show", str(my_arm), "--episode", "0", "--frame", "1", "--json", "--embodiment", str(out)]
    )
    assert r.returncode == 0, r.stderr[-2000:]

    spec = get_embodiment(out)  # registered under the name inside the file ...
    assert spec.name == "my_arm" and get_embodiment("my_arm") is spec and get_embodiment(str(out)) is spec
    # ... so the generic LeRobot key map (robot_type == name) applies; two forked workers see it too
    loader = build_loader(
        DataConfig(datasets=(str(my_arm),), batch_size=4, num_workers=2, image_size=32, chunk_length=4)
    )
    batch = next(iter(loader))
    batch.validate()
    assert set(batch.meta["embodiment"]) == {"my_arm"} and batch.state.shape == (4, 7)
    assert batch.actions.shape == (4, 4, 7) and bool(batch.action_mask.all())
    # the `phone` camera reaches the primary slot through the spec's lerobot_cameras
    assert bool(batch.image_mask["primary"].all()) and bool(batch.image_mask["wrist"].all())

    # model commands take the spec file where they take a name
    assert (
        main(["model", "info", "tiny_smolvlm", "--embodiment", str(out), "--embodiment", "widowx_bridge"])
        == 0
    )


def test_draft_of_a_simulated_dataset_matches_its_registered_spec(tmp_path: Path) -> None:
    data = tmp_path / "sim_wx"
    generate(
        GenerateConfig(embodiment="widowx", task="reach", episodes=2, out=str(data), image_size=32),
        progress_bar=False,
    )
    out = tmp_path / "wx.yaml"
    draft = write_draft(data, "sim_widowx_draft", out)
    spec, truth = EmbodimentSpec.from_yaml(out), get_embodiment("sim_widowx")
    assert (spec.state_dim, spec.action_dim, spec.control_hz) == (truth.state_dim, truth.action_dim, 10.0)
    assert {s: (c.height, c.width) for s, c in spec.cameras.items()} == {
        "primary": (32, 32),
        "wrist": (32, 32),
    }
    for which in ("state", "action"):  # 6 joints, then the gripper found from its [0, 1] range
        got = [(f.kind, f.width) for f in getattr(spec, which)]
        assert got == [(f.kind, f.width) for f in getattr(truth, which)] == [("joint_pos", 6), ("gripper", 1)]
    # the simulator's actions are absolute joint targets: the evidence says so
    assert [f.absolute for f in spec.action] == [f.absolute for f in truth.action] == [True, True]
    assert "looks ABSOLUTE" in draft.action_evidence
    assert "robot_type is 'sim_widowx'" in "\n".join(draft.summary())
    _assert_limits_contain(spec, data, "observation.state")


def test_draft_of_the_bridge_rlds_fixture(bridge_fixture: Path, tmp_path: Path) -> None:
    out = tmp_path / "bridge.yaml"
    draft = write_draft(bridge_fixture, "bridge_draft", out)
    spec, truth = EmbodimentSpec.from_yaml(out), get_embodiment("widowx_bridge")
    assert spec.action_dim == 7 and spec.state_dim == 7 and spec.control_hz == 5  # rate from the key map
    assert {s: (c.height, c.width) for s, c in spec.cameras.items()} == {
        "primary": (64, 64),
        "secondary": (64, 64),
    }
    assert draft.unused_cameras == ["observation/image_2", "observation/image_3"]
    # Bridge actions are end-effector deltas plus an absolute [0, 1] gripper (configs/embodiments/widowx_bridge.yaml)
    assert [f.absolute for f in truth.action] == [False, False, True]
    assert [(f.kind, f.width, f.absolute) for f in spec.action] == [
        ("joint_pos", 6, False),
        ("gripper", 1, True),
    ]
    assert "looks DELTA" in draft.action_evidence
    _assert_limits_contain(spec, bridge_fixture, "observation/state")


def test_draft_errors_name_the_problem(my_arm: Path, tmp_path: Path) -> None:
    with pytest.raises(DatasetFormatError, match="no such file or directory"):
        draft_spec(tmp_path / "missing", "x")
    bare = make_lerobot_dataset(
        tmp_path / "no_state", num_episodes=1, episode_length=5, state_dim=3, action_dim=2
    )
    info_file = bare / "meta" / "info.json"
    info = json.loads(info_file.read_text())
    info["features"]["observation.state"]["shape"] = [3, 1]  # not a 1-d vector: no usable state
    info_file.write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"no state feature .*'action': 'tensor\[2\]'"):
        draft_spec(bare, "x")
    with pytest.raises(ValueError, match=r"must end in \.yaml"):
        write_draft(my_arm, "my_arm", tmp_path / "my_arm.json")


def test_get_embodiment_by_path(
    tmp_path: Path, registry_restored: None, caplog: pytest.LogCaptureFixture
) -> None:
    assert get_embodiment("widowx_bridge").name == "widowx_bridge"  # names keep working
    with pytest.raises(FileNotFoundError, match=r"missing\.yaml does not exist.*vla embodiment draft"):
        get_embodiment(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad_arm\ncontrol_hz: 10\nchunk_length: 4\naction:\n- {name: a, kind: wheel, dims: [x]}\n"
    )
    with pytest.raises(SpecError, match=r"bad\.yaml.*kind must be one of"):
        get_embodiment(bad)
    spec = get_embodiment("sim_ur5e").to_dict()
    spec["name"] = "ur5e_copy"
    copy = tmp_path / "any_file_name.yml"
    copy.write_text(json.dumps(spec))  # JSON is YAML
    assert get_embodiment(copy).name == "ur5e_copy" and "ur5e_copy" in EMBODIMENTS  # the name inside the file
    assert register_embodiment(EmbodimentSpec.from_dict(spec)) is get_embodiment(
        "ur5e_copy"
    )  # same spec: no-op
    # only prose differs (a checkpoint saved before a built-in spec's descriptions were edited): the registered
    # spec is used, with a warning
    prose = json.loads(json.dumps(spec))
    prose["description"] = "an older text"
    prose["action"][0]["description"] = "joints, before speed limits were stated"
    with caplog.at_level("WARNING", logger="vla.embodiments"):
        assert register_embodiment(EmbodimentSpec.from_dict(prose)) is get_embodiment("ur5e_copy")
    assert "only in its descriptions or sources" in caplog.text
    # a user's `extra` is kept whole, even a key of its own named "description"
    extra = {**spec, "name": "ur5e_extra", "extra": {"description": "gripper v1"}}
    register_embodiment(EmbodimentSpec.from_dict(extra))
    extra["extra"] = {"description": "gripper v2"}
    with pytest.raises(SpecError, match=r"differs in \['extra'\]"):
        register_embodiment(EmbodimentSpec.from_dict(extra))
    spec["control_hz"] = 99.0
    with pytest.raises(
        SpecError, match=r"already registered with a different spec \(differs in \['control_hz'\]\)"
    ):
        register_embodiment(EmbodimentSpec.from_dict(spec))
