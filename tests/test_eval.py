"""``vla eval sim`` and the statistics under it: Wilson intervals and the sim-vs-reference metrics against
hand-computed values, the results.json contract, determinism per seed (in process and across workers), the
expert's and random's success rates through the eval path, and a checkpoint evaluated through ``vla.policy``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vla.cli import main
from vla.eval.metrics import agreement, kendall_tau, mmrv, pearson
from vla.eval.rollout import EvalConfig, evaluate, load_results
from vla.eval.stats import grouped_summary, success_summary, wilson_interval

TIMING_KEYS = {"policy_time_s", "sim_time_s", "wall_time_s", "episodes_per_s", "policy_ms_per_call",
               "sim_ms_per_step"}  # fmt: skip


# ---- Wilson intervals -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [  # reference values: statsmodels.stats.proportion.proportion_confint(k, n, method="wilson")
        (0, 10, 0.0, 0.277533),
        (1, 10, 0.017875, 0.404150),
        (5, 10, 0.236593, 0.763407),
        (10, 10, 0.722467, 1.0),
    ],
)
def test_wilson_interval_known_values(k: int, n: int, low: float, high: float) -> None:
    got = wilson_interval(k, n)
    assert got == pytest.approx((low, high), abs=2e-6)


def test_wilson_interval_by_hand() -> None:
    # 81 of 263: p = 0.307985, z^2 = 3.841459; centre = (p + z^2/526) / (1 + z^2/263) = 0.310752,
    # half-width = z / (1 + z^2/263) * sqrt(p(1-p)/263 + z^2/(4 * 263^2)) = 0.055462
    assert wilson_interval(81, 263) == pytest.approx((0.310752 - 0.055462, 0.310752 + 0.055462), abs=1e-5)


def test_wilson_interval_edges_and_errors() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(3, 7)
    assert 0 < lo < 3 / 7 < hi < 1
    with pytest.raises(ValueError, match="successes <= trials"):
        wilson_interval(4, 3)
    s = success_summary([True, False, True, True])
    assert s["episodes"] == 4 and s["successes"] == 3 and s["success_rate"] == 0.75
    assert s["ci95"] == list(wilson_interval(3, 4))
    rows = [
        {"level": "low", "success": True},
        {"level": "high", "success": False},
        {"level": "low", "success": False},
    ]
    g = grouped_summary(rows, "level")
    assert g["low"]["successes"] == 1 and g["low"]["episodes"] == 2 and g["high"]["successes"] == 0


# ---- agreement metrics ----------------------------------------------------------------------------------------
def test_pearson_hand_computed() -> None:
    # x - mean = [-1, 0, 1], y - mean = [-4/3, -1/3, 5/3]: r = 3 / sqrt(2 * 42/9)
    assert pearson(sim=[1, 2, 3], real=[1, 2, 4]) == pytest.approx(3 / math.sqrt(2 * 42 / 9))
    assert pearson(sim=[0.1, 0.2, 0.3], real=[0.9, 0.5, 0.1]) == pytest.approx(-1.0)
    assert math.isnan(pearson(sim=[0.5, 0.5, 0.5], real=[0.1, 0.2, 0.3]))


def test_mmrv_hand_computed_and_asymmetric() -> None:
    # Only policies 1 and 2 are ordered differently (sim 0.5 < 0.6, real 0.9 > 0.3): each gets the real gap 0.6,
    # policy 0 none: (0 + 0.6 + 0.6) / 3.
    sim, real = [0.1, 0.5, 0.6], [0.2, 0.9, 0.3]
    assert mmrv(sim=sim, real=real) == pytest.approx(0.4)
    # Swapped, the violation is weighted by the other vector's gap 0.1: the order of the arguments matters.
    assert mmrv(sim=real, real=sim) == pytest.approx(0.2 / 3)
    assert mmrv(sim=[0.1, 0.4, 0.8], real=[0.0, 0.3, 0.9]) == 0.0  # same ranking
    # Strict comparisons (as SimplerEnv): a sim tie with a real ordering is a violation for the better one only.
    assert mmrv(sim=[0.5, 0.5], real=[0.2, 0.8]) == pytest.approx(0.3)
    with pytest.raises(TypeError):
        mmrv(sim, real)  # type: ignore[misc]  # keyword-only: the order cannot be swapped by accident


def test_kendall_tau_and_agreement() -> None:
    # 6 pairs, one discordant (2 vs 3): (5 - 1) / 6
    assert kendall_tau(sim=[1, 2, 3, 4], real=[1, 3, 2, 4]) == pytest.approx(4 / 6)
    assert kendall_tau(sim=[1, 2, 3], real=[3, 2, 1]) == pytest.approx(-1.0)
    out = agreement(sim=[0.1, 0.5, 0.6], real=[0.2, 0.9, 0.3])
    assert out["policies"] == 3 and out["mmrv"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="equal length"):
        pearson(sim=[0.1, 0.2], real=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="at least 2"):
        mmrv(sim=[0.1], real=[0.2])


# ---- closed-loop runs -----------------------------------------------------------------------------------------
def _strip_timings(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {
            k: _strip_timings(v)
            for k, v in obj.items()
            if k not in TIMING_KEYS and k not in ("config", "out")
        }
    if isinstance(obj, list):
        return [_strip_timings(v) for v in obj]
    return obj


def test_results_contract_and_determinism_across_workers(tmp_path: Path) -> None:
    """Random on reach (seeded per episode): a run in process and a run on 2 spawned workers give the same
    results.json bar timings."""
    kw = {"policy": "random", "embodiment": "widowx", "task": "reach", "episodes": 3, "image_size": 32,
          "max_steps": 12, "randomization": "low", "seed": 5}  # fmt: skip
    a = evaluate(EvalConfig(**kw, out=str(tmp_path / "a")), progress_bar=False)
    b = evaluate(EvalConfig(**kw, out=str(tmp_path / "b"), workers=2), progress_bar=False)
    assert _strip_timings(a) == _strip_timings(b)
    assert load_results(tmp_path / "a")["episodes"] == 3
    # the contract's top level and per-episode fields
    for key in (
        "policy",
        "embodiment",
        "task",
        "randomization",
        "episodes",
        "successes",
        "success_rate",
        "ci95",
    ):
        assert key in a, key
    assert a["embodiment"] == "sim_widowx" and a["randomization"] == "low" and len(a["ci95"]) == 2
    seeds = [ep["seed"] for ep in a["episodes_detail"]]
    assert len(set(seeds)) == 3
    for ep in a["episodes_detail"]:
        assert {"seed", "success", "steps", "instruction", "randomization"} <= ep.keys()
        assert ep["randomization"]["level"] == "low" and "dynamics" in ep["randomization"]
        # graded progress: the TCP's closest and last distance to the named object (m), closest <= last
        assert 0 < ep["min_target_distance_m"] <= ep["final_target_distance_m"] < 5
        # which object the TCP ended over: the named one or a distractor (grounding vs. localisation)
        assert ep["end_object_is_target"] == (ep["end_object"].replace("_", " ") in ep["instruction"])
        assert ep["end_object"].split("_")[0] in ("red", "green", "blue", "yellow", "purple", "orange")
        assert 0 <= ep["end_object_distance_m"] < 2
    dist = a["target_distance_m"]
    assert dist["episodes"] == 3
    assert dist["end_object_is_target_rate"] == pytest.approx(
        np.mean([ep["end_object_is_target"] for ep in a["episodes_detail"]])
    )
    assert dist["min_mean"] == pytest.approx(
        np.mean([ep["min_target_distance_m"] for ep in a["episodes_detail"]])
    )
    for group in ("task", "embodiment", "level"):
        assert a["breakdown"][group], group
    assert a["breakdown"]["level"]["low"]["ci95"] == a["ci95"]
    # another seed, other initial states (so the comparison above could fail)
    d = evaluate(EvalConfig(**{**kw, "seed": 6}, out=str(tmp_path / "d")), progress_bar=False)
    assert [ep["seed"] for ep in d["episodes_detail"]] != seeds
    assert [ep["final_state"] for ep in d["episodes_detail"]] != [
        ep["final_state"] for ep in a["episodes_detail"]
    ]


def test_expert_reaches_its_success_rate_and_random_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The scripted expert solves WidowX pick_place (20/20 measured through this path, >= 90 % in vla.sim's sweep)
    through the CLI (videos of a sample); the uniform-random baseline does not."""
    out = tmp_path / "expert"
    rc = main(["eval", "sim", "expert", "--embodiment", "widowx", "--task", "pick_place", "--episodes", "5",
               "--image-size", "32", "--video-every", "3", "--out", str(out), "--no-progress"])  # fmt: skip
    assert rc == 0 and "expert on sim_widowx/pick_place" in capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert res["successes"] >= 4, res["successes"]
    assert res["videos"] and all((out / v).stat().st_size > 0 for v in res["videos"])
    assert "videos/episode_0000_success.mp4" in res["videos"]
    rnd = evaluate(EvalConfig(policy="random", embodiment="widowx", task="pick_place", episodes=3, image_size=32,
                              out=str(tmp_path / "random"), video_every=0), progress_bar=False)  # fmt: skip
    assert rnd["successes"] == 0 and rnd["ci95"][0] == 0.0
    # same seeds for both policies: paired comparisons
    assert [e["seed"] for e in rnd["episodes_detail"]] == [e["seed"] for e in res["episodes_detail"][:3]]
    assert rnd["videos"] == []  # --video-every 0: no videos at all
    # a robot with continuous (unlimited) joints: random draws them over one turn
    kin = evaluate(EvalConfig(policy="random", embodiment="kinova_gen3", task="reach", episodes=1, image_size=32,
                              max_steps=3, out=str(tmp_path / "kinova"), video_every=0), progress_bar=False)  # fmt: skip
    assert kin["episodes"] == 1 and kin["episodes_detail"][0]["steps"] == 3


def test_a_policy_that_outputs_nan_fails_its_episodes_flagged_and_the_run_goes_on(
    tmp_path: Path, monkeypatch
) -> None:
    """A broken policy's NaN action ends that episode as a counted failure, not the whole evaluation."""
    import vla.eval.policies as policies
    import vla.eval.rollout as rollout

    class NaNAfterTwo:
        def reset(self, env, seed: int) -> None:
            self.calls = 0

        def act(self, obs, env, steps: int) -> list[np.ndarray]:
            self.calls += 1
            action = env.expert_action()
            if self.calls > 2:
                action[0] = np.nan
            return [action]

    monkeypatch.setattr(policies, "make_policy", lambda *a, **k: NaNAfterTwo())
    monkeypatch.setattr(rollout, "_CONTEXT", None)
    res = evaluate(EvalConfig(policy="nan", embodiment="widowx", task="reach", episodes=2, image_size=32,
                              max_steps=10, out=str(tmp_path / "nan")), progress_bar=False)  # fmt: skip
    monkeypatch.setattr(rollout, "_CONTEXT", None)  # no later test may reuse this policy
    assert res["episodes"] == 2 and res["successes"] == 0 and res["non_finite_actions"] == 2
    # two control steps simulated; the third action was NaN, so the episode ended before it
    assert [(e["steps"], e["non_finite_action"]) for e in res["episodes_detail"]] == [(2, True), (2, True)]
    assert res["physics_diverged"] == 0


def test_env_step_checks_the_action_shape_before_its_values() -> None:
    """A wrong-shaped action is a caller's bug, reported as such even when it holds NaN (not a policy failure)."""
    from vla.sim.env import make

    env = make("widowx", "reach", image_size=16)
    try:
        env.reset(seed=0)
        with pytest.raises(ValueError, match=r"action has shape \(3,\), expected \(7,\)"):
            env.step(np.array([np.nan, 0.0, 0.0]))
        assert env.step_index == 0
        *_, truncated, info = env.step(np.full(7, np.nan))  # the right shape: a flagged failure, as before
        assert truncated and info["non_finite_action"]
        assert env.step_index == 0  # nothing was simulated: no control step counted
    finally:
        env.close()


def test_checkpoint_through_the_policy_is_deterministic(tiny_checkpoint: Path, tmp_path: Path) -> None:
    kw = {"policy": str(tiny_checkpoint), "embodiment": "widowx", "task": "reach", "episodes": 2, "image_size": 32,
          "max_steps": 10, "execute_steps": 4, "video_every": 1}  # fmt: skip
    a = evaluate(EvalConfig(**kw, out=str(tmp_path / "a")), progress_bar=False)
    b = evaluate(EvalConfig(**kw, out=str(tmp_path / "b")), progress_bar=False)
    assert _strip_timings(a) == _strip_timings(b)
    calls = [(ep["steps"], ep["policy_calls"]) for ep in a["episodes_detail"]]
    assert all(c == -(-s // 4) for s, c in calls) and max(s for s, _ in calls) == 10, (
        calls
    )  # 4 actions per chunk
    assert a["timing"]["policy_time_s"] > 0 and len(a["videos"]) == 2
    # the policy moved the arm (its actions were executed, not the home pose held)
    from vla.sim.env import make

    env = make("widowx", "reach", image_size=32)
    home, _ = env.reset(seed=a["episodes_detail"][0]["seed"])
    assert np.abs(np.asarray(a["episodes_detail"][0]["final_state"]) - home["state"]).max() > 1e-3


def test_observation_history_reaches_the_model(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A checkpoint trained with 3 frames of history gets the last 3 control steps' frames (oldest first)."""
    import shutil

    from vla.eval.policies import CheckpointPolicy
    from vla.sim.env import make

    ckpt = Path(shutil.copytree(tiny_checkpoint, tmp_path / "hist"))
    (ckpt / "preprocessing.json").write_text(json.dumps({"obs_history": 3}))
    policy = CheckpointPolicy(ckpt, "sim_widowx", execute_steps=1)
    assert policy.history == 3
    env = make("widowx", "reach", image_size=32)
    obs, _ = env.reset(seed=0)
    policy.reset(env, 0)
    policy.observe(obs)
    assert policy.observation(obs, env).images["primary"].shape == (1, 32, 32, 3)
    seen = [obs["images"]["primary"].copy()]
    for step in range(3):
        obs, *_ = env.step(policy.act(obs, env, step)[0])
        policy.observe(obs)
        seen.append(obs["images"]["primary"].copy())
    images = policy.observation(obs, env).images
    assert images["primary"].shape == (3, 32, 32, 3) and set(images) == {"primary", "wrist"}
    assert np.array_equal(images["primary"], np.stack(seen[-3:]))
    assert not np.array_equal(seen[-1], seen[-2])  # consecutive frames differ: the arm moved
    policy.reset(env, 1)  # a new episode starts a new history
    policy.observe(obs)
    assert policy.observation(obs, env).images["primary"].shape == (1, 32, 32, 3)
    # the rollout shows the policy every step's frames (not only those where it is asked for a chunk)
    from vla.eval import rollout

    cfg = EvalConfig(policy=str(ckpt), embodiment="widowx", task="reach", episodes=1, image_size=32, max_steps=4,
                     execute_steps=4, out=str(tmp_path / "run"))  # fmt: skip
    res = evaluate(cfg, progress_bar=False)
    assert res["episodes_detail"][0]["policy_calls"] == 1
    in_worker = rollout._CONTEXT[2]  # this process's policy (workers=1)
    assert len(in_worker._frames["primary"]) == 3 and in_worker.history == 3


def test_errors_name_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["eval", "sim", str(tmp_path / "nope"), "--embodiment", "widowx", "--task", "reach", "--out",
               str(tmp_path / "o"), "--no-progress"])  # fmt: skip
    assert rc == 2 and "neither 'expert', 'random' nor an existing checkpoint" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--episodes must be >= 1"):
        EvalConfig(policy="expert", embodiment="widowx", task="reach", episodes=0, out=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="vla eval sim"):
        load_results(tmp_path)


def test_via_server_matches_in_process(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The same checkpoint served by `vla serve` (fp32 eager) and evaluated through the robot-side client gives
    the in-process trajectories: the request carries each chunk's seed."""
    import re
    import subprocess
    import sys

    from train_helpers import REPO, cli_env

    proc = subprocess.Popen(
        [sys.executable, "-m", "vla.cli", "serve", str(tiny_checkpoint), "--port", "0", "--dtype", "float32",
         "--no-compile"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(), cwd=REPO,
    )  # fmt: skip
    try:
        url = None
        for line in proc.stdout:  # type: ignore[union-attr]
            if m := re.search(r"ready at (ws://\S+)", line):
                url = m.group(1)
                break
        assert url, "vla serve did not become ready"
        kw = {"policy": str(tiny_checkpoint), "embodiment": "widowx", "task": "reach", "episodes": 2,
              "image_size": 32, "max_steps": 8, "execute_steps": 4}  # fmt: skip
        local = evaluate(EvalConfig(**kw, out=str(tmp_path / "local")), progress_bar=False)
        remote = evaluate(EvalConfig(**kw, out=str(tmp_path / "remote"), via_server=url), progress_bar=False)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert remote["config"]["via_server"] == url and remote["policy"] == local["policy"]
    for a, b in zip(local["episodes_detail"], remote["episodes_detail"], strict=True):
        assert (a["steps"], a["policy_calls"], a["success"]) == (b["steps"], b["policy_calls"], b["success"])
        assert np.allclose(a["final_state"], b["final_state"], atol=1e-4), (
            a["final_state"],
            b["final_state"],
        )


def test_distance_summary_leaves_diverged_episodes_out_of_the_final_mean() -> None:
    """An episode ended by a physics blow-up keeps its closest distance (reached before the blow-up) but not its final
    one (a launched object can be metres away by then); the count of such episodes is reported."""
    from vla.eval.rollout import distance_summary

    rows = [
        {"min_target_distance_m": 0.05, "final_target_distance_m": 0.10, "physics_diverged": False},
        {"min_target_distance_m": 0.03, "final_target_distance_m": 59336.9, "physics_diverged": True},
        {"min_target_distance_m": 0.07, "final_target_distance_m": 0.20, "physics_diverged": False},
    ]
    s = distance_summary(rows)
    assert s["episodes"] == 3 and s["diverged"] == 1
    assert s["min_mean"] == pytest.approx(0.05)
    assert s["final_mean"] == pytest.approx(0.15)
    # every episode diverged (one reality_proxy episode in make demo's test did): no final mean, still valid JSON
    only = distance_summary(rows[1:2])
    assert only["final_mean"] is None and only["diverged"] == 1
    json.dumps(only, allow_nan=False)


def test_eval_workers_take_their_share_of_the_cores_even_when_torch_came_first() -> None:
    """A spawned evaluation worker re-imports the parent's main module before its initializer runs; a script that
    imports torch (or vla.sim) at the top used to leave every worker with one torch thread per core, and on 2
    cores 2 workers x 2 spinning threads made each chunk ~25x slower (the transfer study's evaluations)."""
    code = (
        "import torch; torch.set_num_threads(2)\n"
        "from vla.eval.rollout import _init_worker\n"
        "_init_worker(1)\n"
        "import os; print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"]
