"""Replay error and system identification: a sim dataset replays with ~0 error under its own parameters and with
error growing in an injected parameter error; CMA-ES recovers known parameters from synthetic logs (and flags the
ones the logs cannot tell); ``vla eval sysid`` writes a preset ``--randomization`` accepts; the genuine Bridge
logs replay on the sim WidowX within a stated end-effector divergence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vla.cli import main
from vla.eval.replay import SimParams, read_sim_episodes, replay
from vla.eval.sysid import fit, synthesize_logs, write_preset
from vla.sim.generate import GenerateConfig, generate
from vla.sim.randomization import load_randomization


@pytest.fixture(scope="module")
def known_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two expert episodes of WidowX reach in a world with servo stiffness x0.8 and one step of latency."""
    root = tmp_path_factory.mktemp("replay")
    preset = root / "known.yaml"
    preset.write_text(yaml.safe_dump({"name": "known", "actuation": {"gain_scale": [0.8, 0.8],
                                                                      "latency_steps": [1, 1]}}))  # fmt: skip
    out = root / "ds"
    generate(GenerateConfig(embodiment="widowx", task="reach", episodes=2, out=str(out), image_size=32,
                            randomization=str(preset), keep_failed=True), progress_bar=False)  # fmt: skip
    return out


def test_replay_is_exact_with_the_logged_parameters_and_grows_with_injected_error(
    known_dataset: Path,
) -> None:
    episodes = read_sim_episodes(known_dataset)
    assert len(episodes) == 2 and episodes[0].record["actuation"]["latency_steps"] == 1
    same = replay(episodes).summary()
    assert same["max"] < 1e-5, same  # float32 storage of the logged states is the only difference
    errors = [replay(episodes, SimParams(kp=k)).summary()["mean"] for k in (1.0, 0.9, 0.75, 0.5)]
    assert errors[0] < 1e-5 < errors[1] < errors[2] < errors[3], errors
    lat = [replay(episodes, SimParams(latency=k)).summary()["mean"] for k in (0, 1, 2)]
    assert lat[0] < 1e-5 < lat[1] < lat[2], lat
    # without the record the world is the nominal one: the logs' kp and latency are missing
    assert replay(episodes, use_record=False).summary()["mean"] > errors[1]


def test_replay_cli(known_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "replay.json"
    assert (
        main(
            ["eval", "replay", str(known_dataset), "--episodes", "1", "--params", "kp=0.9", "--out", str(out)]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["params"]["kp"] == 0.9 and len(report["episodes"]) == 1
    per_step = report["episodes"][0]["per_step"]
    assert per_step[0] < 1e-6 and max(per_step) > 1e-4  # same start; the kp error shows later
    with pytest.raises(ValueError, match="NAME in friction, damping"):
        SimParams.parse("stiffness=2")


def test_sysid_recovers_known_parameters() -> None:
    """kp x0.7, armature x1.6, 1 step latency: recovered within 5 % / 10 % / exactly; joint damping (0 on the
    WidowX: its damping is in the servos) is reported as not identifiable."""
    truth = SimParams(kp=0.7, armature=1.6, latency=1)
    logs = synthesize_logs("widowx", "reach", truth, seeds=[0, 1], max_steps=40)
    res = fit(logs, ["kp", "armature", "latency", "damping"], max_evals=120)
    p = res["params"]
    assert p["kp"] == pytest.approx(0.7, rel=0.05), p
    assert p["armature"] == pytest.approx(1.6, rel=0.10), p
    assert p["latency"] == 1, p
    assert res["error_after"] < 0.05 * res["error_before"], res
    assert res["identifiable"] == {"kp": True, "armature": True, "latency": True, "damping": False}


def test_sysid_cli_writes_a_usable_preset(known_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "fit.yaml"
    assert main(["eval", "sysid", str(known_dataset), "--embodiment", "widowx", "--params", "kp,latency",
                 "--max-evals", "80", "--out", str(out)]) == 0  # fmt: skip
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["params"]["latency"] == 1 and res["params"]["kp"] == pytest.approx(0.8, rel=0.05), res
    assert res["error_after"] < 0.1 * res["error_before"]
    cfg = load_randomization(out)  # usable as --randomization
    assert cfg.actuation.latency_steps == (1, 1)
    low, high = cfg.actuation.gain_scale
    assert low < res["params"]["kp"] < high and (low + high) / 2 == pytest.approx(
        res["params"]["kp"], rel=1e-4
    )
    assert "replay error before" in out.read_text()
    with pytest.raises(ValueError, match="--spread"):
        write_preset(res, tmp_path / "x.yaml", name="x", spread=1.5)


def test_bridge_replay_on_the_sim_widowx(bridge_fixture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real WidowX logs (Bridge) on the sim WidowX through IK. Measured on all 25 fixture episodes: mean
    end-effector divergence 8.1 mm, 13.5 mm after 9 steps, while the real arm travels 64 mm and its own
    command chain is 8.1 mm from its logged poses (with the joint speed limits; 8.3 / 14.0 mm before)."""
    from vla.eval.bridge import replay_bridge

    rep = replay_bridge(bridge_fixture, episodes=[0, 1, 2, 3, 4])
    s = rep["summary"]
    assert s["episodes"] == 5
    assert s["start_error_m"] < 0.005  # IK reaches the logged initial poses
    assert 0.001 < s["mean_m"] < 0.02, s  # sim tracks the commands: mm-level, not zero, far below the travel
    assert s["mean_m"] < 0.5 * s["log_travel_m"]
    assert s["mean_m"] < 2 * s["command_chain_mean_m"] + 0.005
    assert all(len(e["per_step_m"]) == e["steps"] == 10 for e in rep["episodes"])


def test_replay_warns_about_data_recorded_before_the_joint_speed_limits(
    known_dataset: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`vla sim generate` records its servo model; data without it (made when setpoints jumped to each target at
    once) still replays, with a warning that the replay cannot reproduce it exactly."""
    from vla.eval.replay import check_servo_model
    from vla.sim.world import SERVO_MODEL

    with caplog.at_level("WARNING", logger="vla.eval.replay"):
        read_sim_episodes(known_dataset)
        assert not caplog.records  # written today: no warning
        assert check_servo_model({"servo_model": SERVO_MODEL}, "new") is True
        assert check_servo_model({}, "old data") is False
    assert "old data was recorded with servo model None" in caplog.text and "regenerate it" in caplog.text


def test_reading_a_dataset_of_another_servo_model_warns_once_not_per_episode(
    known_dataset: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # today's data then looks like old data
    monkeypatch.setattr("vla.sim.world.SERVO_MODEL", "a_later_servo_model")
    with caplog.at_level("WARNING", logger="vla.eval.replay"):
        episodes = read_sim_episodes(known_dataset)
    assert len(episodes) >= 2
    warned = [r for r in caplog.records if "recorded with servo model" in r.getMessage()]
    assert len(warned) == 1 and "and every other episode with the same record" in warned[0].getMessage()
    assert "'joint_speed_limited_ramp', not 'a_later_servo_model'" in warned[0].getMessage()


def test_logs_with_nan_or_inf_are_refused_before_any_replay_step() -> None:
    """A logged episode (sim or Bridge) holding NaN/inf is a ValueError naming the episode, the array, the first bad
    step and its dims, before anything is simulated; a shape mismatch is an error too."""
    import numpy as np

    from vla.eval.bridge import BridgeReplayer
    from vla.eval.replay import LoggedEpisode

    states, actions = np.zeros((5, 7)), np.zeros((5, 7))
    actions[3, [1, 4]] = [np.nan, np.inf]
    with pytest.raises(
        ValueError, match=r"ep/3: actions hold NaN or inf \(2 values\), first at step 3, dims \[1, 4\]"
    ):
        LoggedEpisode("widowx", "reach", states, actions, name="ep/3")
    bad_states = np.zeros((5, 7))
    bad_states[0, 6] = -np.inf
    with pytest.raises(ValueError, match=r"states hold NaN or inf .* step 0, dims \[6\]"):
        LoggedEpisode("widowx", "reach", bad_states, np.zeros((5, 7)), name="ep/0")
    with pytest.raises(ValueError, match=r"same T"):
        LoggedEpisode("widowx", "reach", np.zeros((5, 7)), np.zeros((4, 7)), name="ep/1")
    replayer = BridgeReplayer()
    try:
        t0 = replayer.env.world.data.time if replayer.env.world is not None else None
        with pytest.raises(ValueError, match=r"bridge/0: actions hold NaN or inf"):
            replayer.replay(states, actions, "bridge/0")
        if t0 is not None:
            assert replayer.env.world.data.time == t0  # nothing was simulated
    finally:
        replayer.close()
