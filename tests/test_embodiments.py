"""Embodiment specs: a contract test over every registered spec, and error messages for malformed ones."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from vla.embodiments import EMBODIMENTS, EmbodimentSpec, SpecError, get_embodiment
from vla.paths import config_dir
from vla.types import IMAGE_SLOTS

SPEC_NAMES = EMBODIMENTS.names()


def test_registry_has_the_oxe_and_droid_bodies() -> None:
    for name in (
        "widowx_bridge",
        "franka_droid",
        "franka_oxe_eef",
        "franka_oxe_joint",
        "google_robot_rt1",
        "aloha",
    ):
        assert name in EMBODIMENTS


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_spec_contract(name: str) -> None:
    spec = get_embodiment(name)
    path = config_dir() / "embodiments" / f"{name}.yaml"
    assert path.is_file(), f"spec {name!r} must live in a file named after it: {path}"
    assert yaml.safe_load(path.read_text())["name"] == name, f"{path}: its name field must be {name!r}"

    # Round trips: dict and YAML text (what checkpoints and the server handshake carry).
    assert EmbodimentSpec.from_dict(spec.to_dict()) == spec
    assert EmbodimentSpec.from_dict(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec

    # Dims and limits line up.
    assert spec.action_dim > 0 and spec.control_hz > 0 and spec.chunk_length > 0
    for which, fields, dim in (
        ("state", spec.state, spec.state_dim),
        ("action", spec.action, spec.action_dim),
    ):
        assert len(spec.state_names() if which == "state" else spec.action_names()) == dim
        lo, hi = spec.limits(which)
        assert lo.shape == hi.shape == (dim,)
        assert np.all(lo <= hi), f"{name}.{which}: low > high somewhere"
        for f in fields:
            for lim in (f.low, f.high):
                assert lim is None or len(lim) == f.width
            assert f.kind != "eef_rot" or f.rotation_format

    # Cameras: at least one, known slots, positive native resolution.
    assert spec.cameras, f"{name}: a spec needs at least one camera"
    for slot, cam in spec.cameras.items():
        assert slot in IMAGE_SLOTS
        assert cam.height > 0 and cam.width > 0

    # Grippers: action grippers carry [0, 1]-ish safety limits; state grippers too when they declare limits
    # (a dataset-native state reading may have no limits).
    for which, fields in (("state", spec.state), ("action", spec.action)):
        for f in fields:
            if f.kind != "gripper":
                continue
            if which == "action":
                assert f.low is not None and f.high is not None, (
                    f"{name}.action.{f.name}: gripper needs limits"
                )
            if f.low is not None and f.high is not None:
                assert all(-1.0 <= lo < hi <= 1.5 for lo, hi in zip(f.low, f.high)), (
                    name,
                    f.name,
                    f.low,
                    f.high,
                )
            assert f.units, f"{name}.{which}.{f.name}: say what 1 means (open or closed)"
    assert spec.sources, f"{name}: cite sources"


def _write(tmp_path: Path, spec: dict, name: str = "bad_robot") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _base() -> dict:
    return get_embodiment("widowx_bridge").to_dict()


def test_unknown_kind_names_file_field_and_allowed_values(tmp_path: Path) -> None:
    d = _base()
    d["action"][0]["kind"] = "joint_position"
    path = _write(tmp_path, d)
    with pytest.raises(SpecError) as e:
        EmbodimentSpec.from_yaml(path)
    msg = str(e.value)
    assert str(path) in msg and "eef_delta_pos.kind" in msg and "'joint_position'" in msg
    assert "joint_pos" in msg and "gripper" in msg  # the allowed values


def test_limit_length_mismatch_is_reported(tmp_path: Path) -> None:
    d = _base()
    d["action"][0]["low"] = [-0.1, -0.1]
    path = _write(tmp_path, d)
    with pytest.raises(SpecError, match=r"eef_delta_pos\.low has 2 values but dims has 3"):
        EmbodimentSpec.from_yaml(path)


def test_unknown_keys_are_rejected_with_allowed_keys(tmp_path: Path) -> None:
    d = _base()
    d["colour"] = "red"
    with pytest.raises(SpecError, match=r"unknown key\(s\) \['colour'\]; allowed: .*control_hz"):
        EmbodimentSpec.from_yaml(_write(tmp_path, d))
    d = _base()
    d["state"][0]["unit"] = "m"
    with pytest.raises(SpecError, match=r"state: unknown key\(s\) \['unit'\]"):
        EmbodimentSpec.from_yaml(_write(tmp_path, d))


def test_unknown_camera_slot_and_rotation_format(tmp_path: Path) -> None:
    d = _base()
    d["cameras"]["head"] = {"height": 10, "width": 10}
    with pytest.raises(SpecError, match=r"unknown slot 'head'; allowed: \('primary'"):
        EmbodimentSpec.from_yaml(_write(tmp_path, d))
    d = _base()
    d["state"][1]["rotation_format"] = "rpy"
    with pytest.raises(SpecError, match=r"rotation_format must be one of .*euler_xyz"):
        EmbodimentSpec.from_yaml(_write(tmp_path, d))


def test_unbounded_limits_round_trip() -> None:
    spec = get_embodiment("franka_oxe_eef")
    lo, hi = spec.limits("action")
    assert math.isinf(lo[0]) and hi[-1] == 1.0
    assert EmbodimentSpec.from_dict(spec.to_dict()).limits("action")[0][0] == -math.inf
