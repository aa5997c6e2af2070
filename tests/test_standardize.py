"""Standardization: a contract test over every registered key map, the conversions, DROID options, errors, the
generic LeRobot map, and the genuine Bridge RLDS fixture.

``FakeReader`` (tests/fakes.py) is an in-memory implementation of the ``DatasetReader`` contract (a test double of
the reader, not of the code under test); fake episodes are built from each key map's declared raw features.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

from vla.config import DataConfig, load_config
from vla.data.keymaps import KEYMAPS, KeyMap, KeyMapError, Part, parse_feature_type, raw, zeros
from vla.data.keymaps.lerobot import assign_camera_slots, camera_slot, generic_keymap_reason
from vla.data.readers.base import FeatureInfo, RawEpisode
from vla.data.standardize import (
    GRIPPER_FNS,
    FrameDroppedError,
    StandardizeOptions,
    binarize_gripper,
    keymap_for,
    openpi_idle_keep_mask,
    quat_to_euler,
    rel2abs_gripper,
    standardize_episode,
    standardize_frame,
)
from vla.data.windows import standardize_options
from vla.embodiments import get_embodiment
from vla.types import IMAGE_SLOTS

from fakes import FakeReader

PROMPT = "put the cup in the sink"


def _unit_range_columns(km: KeyMap) -> dict[str, list[int]]:
    """Raw columns that feed a spec gripper dim through a conversion whose input is a [0, 1] value (``none``,
    ``invert``, ``binarize``): fake data must respect the raw convention there, as real data does."""
    spec = get_embodiment(km.embodiment)
    gripper_dims, offset = set(), 0
    for f in spec.action:
        if f.kind == "gripper":
            gripper_dims.update(range(offset, offset + f.width))
        offset += f.width
    out: dict[str, list[int]] = {}
    offset = 0
    for p in km.action:
        width = km.raw_width(p.key) if p.key else 0
        n = p.out_width(width)
        if p.key and p.convert in ("none", "invert", "binarize"):
            cols = (
                list(range(width))
                if p.index is None
                else [p.index]
                if isinstance(p.index, int)
                else list(range(*p.index.indices(width)))
            )
            out.setdefault(p.key, []).extend(c for j, c in enumerate(cols) if offset + j in gripper_dims)
        offset += n
    return out


def fake_episode(km: KeyMap, length: int = 30, seed: int = 0, metadata: dict | None = None) -> RawEpisode:
    """A random episode with every raw key ``km`` declares, in the declared per-step types."""
    rng = np.random.default_rng(seed)
    unit_cols = _unit_range_columns(km)
    steps: dict[str, np.ndarray] = {}
    for key, spec in km.features.items():
        compressed, dtype, shape = parse_feature_type(spec)
        if dtype == "string":
            text = "" if key.endswith("instruction") and "language_instruction_2" in km.features else PROMPT
            steps[key] = np.array([text] * length, dtype=object)
        elif dtype == "int32":
            codes = np.zeros((length, shape[0]), dtype=np.int32)
            codes[:, : len(PROMPT)] = [ord(c) for c in PROMPT]
            steps[key] = codes
        elif dtype == "bool":
            steps[key] = rng.random((length, *shape)) > 0.5
        else:
            arr = rng.uniform(-1, 1, (length, *shape)).astype(dtype)
            for c in unit_cols.get(key, []):
                arr[..., c] = rng.uniform(0, 1, length)
            if compressed:
                steps[key] = np.array([zlib.compress(row.tobytes()) for row in arr], dtype=object)
            else:
                steps[key] = arr
    meta = {"file_path": "/data/lab/success/2023-01-01/trajectory.h5"} if metadata is None else metadata
    return RawEpisode(split="train", index=0, length=length, steps=steps, metadata=meta)


def fake_reader(km: KeyMap, name: str | None = None, episodes: list[RawEpisode] | None = None) -> FakeReader:
    feats = {}
    for key, spec in km.features.items():
        _, dtype, shape = parse_feature_type(spec)
        feats[key] = FeatureInfo(key, "string" if dtype == "string" else "tensor", dtype, shape)
    for key in km.cameras.values():
        feats[key] = FeatureInfo(key, "image", "uint8", (8, 8, 3))
    return FakeReader(name or km.dataset, {"train": episodes or [fake_episode(km)]}, feats)


# ---- contract: every registered key map -------------------------------------------------------------------------


@pytest.mark.parametrize("name", KEYMAPS.names())
def test_keymap_contract(name: str) -> None:
    km = KEYMAPS.get(name)
    spec = get_embodiment(km.embodiment)
    assert km.width("state") == spec.state_dim, (name, km.describe("state"), spec.state_names())
    assert km.width("action") == spec.action_dim, (name, km.describe("action"), spec.action_names())
    assert km.cameras and set(km.cameras) <= set(spec.cameras), (name, km.cameras, list(spec.cameras))
    assert km.sources, f"{name}: cite the facts the entry follows"

    reader = fake_reader(km, name)
    raw_ep = reader.read_episode("train", 0)
    std = standardize_episode(reader, "train", 0)
    t = len(std)
    assert 0 < t <= raw_ep.length - km.drop_first - km.drop_last
    assert std.frames.dtype == np.int64 and np.all(np.diff(std.frames) > 0)
    assert std.state.shape == (t, spec.state_dim) and std.state.dtype == np.float32
    assert std.action.shape == (t, spec.action_dim) and std.action.dtype == np.float32
    assert np.isfinite(std.state).all() and np.isfinite(std.action).all()
    assert std.prompt == [PROMPT] * t
    assert std.embodiment == spec.name and std.dataset == name
    assert set(std.cameras) <= set(IMAGE_SLOTS)
    assert (
        len(std.metadata["state_valid"]) == spec.state_dim
        and len(std.metadata["action_valid"]) == spec.action_dim
    )
    lo, hi = spec.limits("action")
    offset = 0
    for f in spec.action:
        if f.kind == "gripper":
            g = std.action[:, offset : offset + f.width]
            assert np.all(g >= lo[offset] - 1e-6) and np.all(g <= hi[offset] + 1e-6), (
                name,
                f.name,
                g.min(),
                g.max(),
            )
        offset += f.width
    frame = standardize_frame(reader, "train", 0, int(std.frames[0]))
    frame.validate(spec.state_dim, spec.action_dim)
    assert set(frame.images) == set(km.cameras)


def test_every_magic_soup_dataset_and_droid_has_a_map() -> None:
    soup = [
        # Octo/OpenVLA oxe_magic_soup (reference §1) ...
        "fractal20220817_data", "kuka", "bridge_dataset", "bridge_orig", "taco_play", "jaco_play",
        "berkeley_cable_routing", "roboturk", "nyu_door_opening_surprising_effectiveness", "viola",
        "berkeley_autolab_ur5", "toto", "language_table", "stanford_hydra_dataset_converted_externally_to_rlds",
        "austin_buds_dataset_converted_externally_to_rlds", "nyu_franka_play_dataset_converted_externally_to_rlds",
        "furniture_bench_dataset_converted_externally_to_rlds", "ucsd_kitchen_dataset_converted_externally_to_rlds",
        "austin_sailor_dataset_converted_externally_to_rlds", "austin_sirius_dataset_converted_externally_to_rlds",
        "bc_z", "dlr_edan_shared_control_converted_externally_to_rlds",
        "iamlab_cmu_pickup_insert_converted_externally_to_rlds", "utaustin_mutex", "berkeley_fanuc_manipulation",
        "cmu_stretch",
        # ... OpenVLA _plus / _plus_minus additions, DROID, and the RT-X Bridge layout.
        "fmb_dataset", "dobbe", "droid", "bridge",
    ]  # fmt: skip
    missing = [d for d in soup if d not in KEYMAPS]
    assert not missing
    assert KEYMAPS.get("bridge_orig") is KEYMAPS.get("bridge_dataset")


# ---- conversions ------------------------------------------------------------------------------------------------


def test_rel2abs_follows_the_last_event_and_starts_opposite_to_the_first() -> None:
    # + = close, - = open; before the first event (a close) the gripper is open.
    np.testing.assert_array_equal(rel2abs_gripper(np.array([0, 0.05, 0.5, 0, -0.5, 0.0])), [1, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(rel2abs_gripper(np.array([0.0, -1.0, 0.0, 1.0])), [0, 1, 1, 0])
    np.testing.assert_array_equal(rel2abs_gripper(np.zeros(4)), [1, 1, 1, 1])  # no event: open


def test_binarize_scans_backwards_and_carries_the_last_raw_value() -> None:
    x = np.array([1.0, 0.5, 0.0, 0.5, 0.98, 0.6])
    np.testing.assert_allclose(binarize_gripper(x), [1, 0, 0, 1, 1, 0.6])
    np.testing.assert_array_equal(binarize_gripper(np.array([0.96, 0.5, 0.3, 0.04])), [1, 0, 0, 0])


def test_simple_gripper_conversions() -> None:
    x = np.array([-1.0, 0.0, 0.25, 1.0])
    np.testing.assert_allclose(GRIPPER_FNS["invert"](x), [2, 1, 0.75, 0])
    np.testing.assert_allclose(GRIPPER_FNS["clip"](x), [0, 0, 0.25, 1])
    np.testing.assert_allclose(GRIPPER_FNS["clip_invert"](x), [1, 1, 0.75, 0])


def test_quat_to_euler_inverts_euler_to_quat() -> None:
    rng = np.random.default_rng(0)
    rpy = rng.uniform([-np.pi, -1.5, -np.pi], [np.pi, 1.5, np.pi], (50, 3))
    r, p, y = (rpy[:, i] / 2 for i in range(3))
    q = np.stack(  # xyzw of Rz(yaw) Ry(pitch) Rx(roll)
        [
            np.sin(r) * np.cos(p) * np.cos(y) - np.cos(r) * np.sin(p) * np.sin(y),
            np.cos(r) * np.sin(p) * np.cos(y) + np.sin(r) * np.cos(p) * np.sin(y),
            np.cos(r) * np.cos(p) * np.sin(y) - np.sin(r) * np.sin(p) * np.cos(y),
            np.cos(r) * np.cos(p) * np.cos(y) + np.sin(r) * np.sin(p) * np.sin(y),
        ],
        axis=1,
    )
    np.testing.assert_allclose(quat_to_euler(q), rpy, atol=1e-9)
    np.testing.assert_allclose(
        quat_to_euler(np.array([[0, 0, np.sin(np.pi / 4), np.cos(np.pi / 4)]])), [[0, 0, np.pi / 2]]
    )


def test_openpi_idle_filter_rule() -> None:
    rng = np.random.default_rng(0)
    jv = rng.uniform(-1, 1, (80, 7))
    jv[20:30] = jv[20]  # frames 21..29 idle (9 >= 7): removed
    jv[40:45] = jv[40]  # frames 41..44 idle (4 < 7): kept
    jv[60:68] = jv[60]  # frames 61..67 idle (7): removed -> [30, 61) and [68, 80) remain
    keep = openpi_idle_keep_mask(jv)
    expected = np.zeros(80, dtype=bool)
    expected[0:11] = True  # run [0, 21) is >= 16 long, minus its last 10
    expected[30:51] = True  # run [30, 61), minus 10
    # run [68, 80) is 12 < 16 long: dropped entirely
    np.testing.assert_array_equal(keep, expected)
    jv2 = jv.copy()
    jv2[1] = jv2[0] + 5e-4  # a change below 1e-3 in every joint is idle, but a lone idle frame is kept
    assert openpi_idle_keep_mask(jv2)[1]
    assert not openpi_idle_keep_mask(np.zeros((12, 7))).any()


# ---- DROID options ----------------------------------------------------------------------------------------------


def _droid_reader(
    file_path: str = "/lab/success/x/trajectory.h5", texts: tuple[str, str, str] = ("", "wipe", "")
) -> FakeReader:
    km = KEYMAPS.get("droid")
    ep = fake_episode(km, length=60, metadata={"file_path": file_path, "recording_folderpath": "/lab/rec"})
    for key, text in zip(("language_instruction", "language_instruction_2", "language_instruction_3"), texts):
        ep.steps[key] = np.array([text] * 60, dtype=object)
    ep.steps["action_dict/joint_velocity"][10:40] = 0.25  # a long idle stretch
    return fake_reader(km, "droid", [ep])


def test_droid_language_choice() -> None:
    std = standardize_episode(_droid_reader(), "train", 0)
    assert std.prompt[0] == "wipe" and std.metadata["language_key"] == "language_instruction_2"
    reader = _droid_reader(texts=("wipe the table", "clean", "tidy up"))
    assert standardize_episode(reader, "train", 0).prompt[0] == "wipe the table"
    opts = StandardizeOptions(language_choice="random", seed=3)
    picks = {
        standardize_episode(
            reader, "train", 0, options=StandardizeOptions(language_choice="random", seed=s)
        ).prompt[0]
        for s in range(20)
    }
    assert picks == {"wipe the table", "clean", "tidy up"}
    assert (
        standardize_episode(reader, "train", 0, options=opts).prompt
        == standardize_episode(reader, "train", 0, options=opts).prompt
    )


def test_droid_state_action_and_filters() -> None:
    reader = _droid_reader()
    raw_ep = reader.read_episode("train", 0)
    std = standardize_episode(reader, "train", 0)
    assert len(std) == 60  # filters are opt-in
    np.testing.assert_allclose(std.state[:, :7], raw_ep.steps["observation/joint_position"], rtol=1e-6)
    np.testing.assert_allclose(
        std.action[:, 7], raw_ep.steps["action_dict/gripper_position"][:, 0], rtol=1e-6
    )
    idle = standardize_episode(reader, "train", 0, options=StandardizeOptions(idle_filter=True))
    np.testing.assert_array_equal(
        idle.frames, np.flatnonzero(openpi_idle_keep_mask(raw_ep.steps["action_dict/joint_velocity"]))
    )
    assert 15 not in idle.frames
    with pytest.raises(FrameDroppedError, match="idle frame"):
        standardize_frame(reader, "train", 0, 15, options=StandardizeOptions(idle_filter=True))
    failed = _droid_reader(file_path="/lab/failure/x/trajectory.h5")
    assert len(standardize_episode(failed, "train", 0, options=StandardizeOptions(success_only=True))) == 0
    assert len(standardize_episode(reader, "train", 0, options=StandardizeOptions(success_only=True))) == 60
    with pytest.raises(FrameDroppedError, match="does not match"):
        standardize_frame(failed, "train", 0, 3, options=StandardizeOptions(success_only=True))


def test_drop_first_option_overrides_the_map() -> None:
    km = KEYMAPS.get("bridge_dataset")
    reader = fake_reader(km)
    assert standardize_episode(reader, "train", 0).frames[0] == 1
    kept = standardize_episode(reader, "train", 0, options=StandardizeOptions(drop_first=0))
    assert kept.frames[0] == 0 and kept.frames[-1] == 28  # the relabel still drops the last frame


def test_data_config_standardize_reaches_the_options() -> None:
    cfg = load_config(
        DataConfig,
        {
            "datasets": ["any"],
            "seed": 5,
            "standardize": {
                "drop_first": 0,
                "drop_last": 2,
                "language_choice": "random",
                "idle_filter": True,
                "success_only": True,
            },
        },
    )
    assert standardize_options(cfg) == StandardizeOptions(
        drop_first=0, drop_last=2, language_choice="random", seed=5, idle_filter=True, success_only=True
    )


def test_language_table_code_points_are_decoded() -> None:
    km = KEYMAPS.get("language_table")
    ep = fake_episode(km)
    ep.steps["observation/instruction"][:, len(PROMPT) + 1 :] = ord("x")  # garbage after the first NUL is cut
    assert standardize_episode(fake_reader(km, episodes=[ep]), "train", 0).prompt[0] == PROMPT


# ---- errors -----------------------------------------------------------------------------------------------------


def test_missing_raw_key_names_dataset_entry_key_and_available_keys() -> None:
    km = KEYMAPS.get("fractal20220817_data")
    ep = fake_episode(km)
    del ep.steps["observation/gripper_closed"]
    with pytest.raises(KeyMapError) as e:
        standardize_episode(fake_reader(km, episodes=[ep]), "train", 0)
    msg = str(e.value)
    assert "'fractal20220817_data'" in msg and "vla/data/keymaps/oxe.py" in msg
    assert (
        "'observation/gripper_closed'" in msg
        and "observation/base_pose_tool_reached" in msg
        and "state part 1" in msg
    )


def test_missing_camera_and_wrong_width_are_reported() -> None:
    km = KEYMAPS.get("bridge_dataset")
    reader = fake_reader(km)
    del reader._features["observation/image_1"]
    with pytest.raises(KeyMapError, match=r"camera slot 'secondary' reads raw key 'observation/image_1'"):
        standardize_episode(reader, "train", 0)
    ep = fake_episode(km)
    ep.steps["action"] = np.zeros((ep.length, 10), dtype=np.float32)
    with pytest.raises(
        KeyMapError, match=r"'action' has per-step shape \[10\] but the entry declares 'float32\[7\]'"
    ):
        standardize_episode(fake_reader(km, episodes=[ep]), "train", 0)


def test_dataset_without_a_map_says_how_to_add_one() -> None:
    km = KEYMAPS.get("bridge_dataset")
    reader = fake_reader(km, "my_new_dataset")
    assert keymap_for(reader) is None
    with pytest.raises(KeyMapError) as e:
        standardize_episode(reader, "train", 0)
    msg = str(e.value)
    assert (
        "'my_new_dataset'" in msg and "vla/data/keymaps/" in msg and "register" in msg and "robot_type" in msg
    )


def test_keymap_validation_errors() -> None:
    base = dict(
        dataset="x",
        embodiment="widowx_bridge",
        cameras={"primary": "img"},
        language="t",
        control_hz=5,
        action_space="eef_delta",
        state=(),
        features={"a": "float32[7]", "t": "string"},
    )
    with pytest.raises(KeyMapError, match=r"action\[0\]\.convert must be one of .*rel2abs"):
        KeyMap(**base, action=(raw("a", 0, "flip"),))
    with pytest.raises(KeyMapError, match=r"raw key 'b' is not declared"):
        KeyMap(**base, action=(raw("b"),))
    with pytest.raises(KeyMapError, match=r"needs a 1-wide part"):
        KeyMap(**base, action=(raw("a", slice(0, 2), "binarize"),))
    with pytest.raises(KeyMapError, match=r"action_space must be one of"):
        KeyMap(**{**base, "action_space": "cartesian"}, action=(raw("a"),))
    with pytest.raises(KeyMapError, match=r"unknown slot 'head'"):
        KeyMap(**{**base, "cameras": {"head": "img"}}, action=(raw("a"),))
    with pytest.raises(KeyMapError, match=r"features\['a'\]: feature type 'float\[7\]' is not understood"):
        KeyMap(**{**base, "features": {"a": "float[7]", "t": "string"}}, action=(raw("a"),))
    km = KeyMap(**base, action=(raw("a", slice(0, 6)), zeros(1)))
    assert km.width("action") == 7 and isinstance(km.action[1], Part)


# ---- generic LeRobot maps ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "slot"),
    [
        ("top", "primary"),
        ("cam_high", "primary"),
        ("cam_low", "secondary"),
        ("cam_left_wrist", "left_wrist"),
        ("right_wrist", "right_wrist"),
        ("wrist45_image", "wrist"),
        ("eye_in_hand_rgb", "wrist"),
        ("agentview", "primary"),
        ("image_side_1", "secondary"),
        ("exterior_image_1_left", "primary"),
        ("laptop", None),
        ("follower", None),
    ],
)
def test_camera_slot_heuristic(name: str, slot: str | None) -> None:
    assert camera_slot(name) == slot


def test_camera_assignment_spills_primary_and_respects_the_spec() -> None:
    slots, unused = assign_camera_slots(
        ["front", "exterior_2", "gripper", "phone"], ["primary", "secondary", "wrist"]
    )
    assert slots == {"primary": "front", "secondary": "exterior_2", "wrist": "gripper"} and unused == [
        "phone"
    ]


def _lerobot_reader(state_width: int = 14, robot_type: str = "aloha") -> FakeReader:
    feats = {
        "observation.state": FeatureInfo("observation.state", "tensor", "float32", (state_width,)),
        "action": FeatureInfo("action", "tensor", "float32", (14,)),
        "task": FeatureInfo("task", "string", "string", ()),
    }
    for cam in ("cam_high", "cam_low", "cam_left_wrist", "cam_right_wrist"):
        feats[f"observation.images.{cam}"] = FeatureInfo(
            f"observation.images.{cam}", "video", "uint8", (8, 8, 3)
        )
    rng = np.random.default_rng(0)
    steps: dict[str, Any] = {
        "observation.state": rng.uniform(0, 1, (20, state_width)).astype(np.float32),
        "action": rng.uniform(0, 1, (20, 14)).astype(np.float32),
        "task": np.array(["insert the peg"] * 20, dtype=object),
    }
    ep = RawEpisode(split="train", index=0, length=20, steps=steps)
    return FakeReader(
        "my_aloha_recordings", {"train": [ep]}, feats, robot_type=robot_type, fps=50, fmt="lerobot"
    )


def test_generic_lerobot_map_from_robot_type() -> None:
    reader = _lerobot_reader()
    km = keymap_for(reader)
    assert (
        km is not None and km.embodiment == "aloha" and km.action_space == "joint_pos" and km.control_hz == 50
    )
    assert km.cameras == {
        "primary": "observation.images.cam_high",
        "secondary": "observation.images.cam_low",
        "left_wrist": "observation.images.cam_left_wrist",
        "right_wrist": "observation.images.cam_right_wrist",
    }
    std = standardize_episode(reader, "train", 0)
    assert std.state.shape == (20, 14) and std.prompt[0] == "insert the peg"
    np.testing.assert_allclose(std.action, reader.read_episode("train", 0).steps["action"])


def test_generic_lerobot_map_needs_matching_widths_and_a_known_robot() -> None:
    bad = _lerobot_reader(state_width=16)
    assert keymap_for(bad) is None
    assert "'observation.state' must have width 14" in generic_keymap_reason(bad)
    assert "not a registered embodiment" in generic_keymap_reason(_lerobot_reader(robot_type="koch"))
    with pytest.raises(KeyMapError, match="width 14"):
        standardize_episode(bad, "train", 0)


def test_generic_map_on_a_real_lerobot_dataset(tmp_path) -> None:
    from vla.data.readers import open_dataset
    from vla.data.writers import synthetic

    cams = {"cam_high": (32, 40), "cam_left_wrist": (32, 40)}
    root = synthetic.make_lerobot_dataset(
        tmp_path / "my_aloha", num_episodes=2, episode_length=12, robot_type="aloha", state_dim=14,
        action_dim=14, cameras=cams, video=False,
    )  # fmt: skip
    reader = open_dataset(root)
    split = reader.splits()[0]
    km = keymap_for(reader)
    assert km is not None and km.cameras == {
        "primary": "observation.images.cam_high",
        "left_wrist": "observation.images.cam_left_wrist",
    }
    std = standardize_episode(reader, split, 1)
    assert std.state.shape == (12, 14) and std.prompt[0] == synthetic.TASKS[1]
    frame = standardize_frame(reader, split, 1, 3)
    frame.validate(14, 14)
    assert frame.images["left_wrist"].shape == (32, 40, 3)


# ---- the genuine Bridge RLDS fixture ----------------------------------------------------------------------------


@pytest.fixture
def bridge_reader(bridge_fixture):
    from vla.data.readers.rlds import RLDSReader

    reader = RLDSReader(bridge_fixture)
    yield reader
    reader.close()


def test_bridge_fixture_conventions(bridge_reader) -> None:
    assert keymap_for(bridge_reader) is KEYMAPS.get("bridge_dataset")
    saw_partial = False
    for split in bridge_reader.splits():
        for ep in range(bridge_reader.num_episodes(split)):
            raw_ep = bridge_reader.read_episode(split, ep)
            state, action = raw_ep.steps["observation/state"], raw_ep.steps["action"]
            np.testing.assert_allclose(action[0, :6], 0, atol=1e-5)  # why OpenVLA drops the first step
            std = standardize_episode(bridge_reader, split, ep, raw=raw_ep)
            n = raw_ep.length
            np.testing.assert_array_equal(std.frames, np.arange(1, n - 1))
            f = std.frames
            np.testing.assert_allclose(std.action[:, :6], state[f + 1, :6] - state[f, :6], atol=1e-6)
            assert set(np.unique(std.action[:, 6])) <= {0.0, 1.0}
            np.testing.assert_array_equal(
                std.action[:, 6], binarize_gripper(action[:, 6].astype(np.float64))[f]
            )
            saw_partial |= bool(np.any((action[:, 6] > 0.05) & (action[:, 6] < 0.95)))
            np.testing.assert_allclose(std.state, state[f], rtol=1e-6)
            assert std.prompt == [str(s) for s in raw_ep.steps["language_instruction"][f]]
            assert std.prompt[0]
    assert saw_partial  # the fixture exercises the in-between branch of binarize


def test_bridge_fixture_frames(bridge_reader) -> None:
    with pytest.raises(FrameDroppedError, match="drop_first"):
        standardize_frame(bridge_reader, "train", 0, 0)
    with pytest.raises(FrameDroppedError, match="no next state"):
        standardize_frame(bridge_reader, "train", 0, 9)
    frame = standardize_frame(bridge_reader, "train", 0, 1)
    frame.validate(7, 7)
    assert set(frame.images) == {"primary", "secondary"} and frame.images["primary"].shape == (64, 64, 3)
    octo = standardize_episode(bridge_reader, "train", 0, options=StandardizeOptions(drop_first=0))
    assert octo.frames[0] == 0 and np.abs(octo.action[0, :6]).max() < 0.05
