"""``vla eval sweep`` (one randomization source per cell, reality_proxy column, plots) and ``vla eval gap``
(pairing runs with a CSV or with other runs, the metrics, errors that name the fix)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vla.cli import main
from vla.eval.gap import gap
from vla.eval.metrics import kendall_tau, mmrv, pearson
from vla.eval.rollout import summarize, write_results
from vla.eval.sweep import axis_preset, parse_axes, parse_levels
from vla.sim.randomization import load_randomization

PNG = b"\x89PNG\r\n\x1a\n"


def test_axis_presets_move_one_source_only(tmp_path: Path) -> None:
    high = load_randomization("high")
    cfg = load_randomization(axis_preset("actuation", 3, tmp_path))
    assert cfg.name == "actuation=high" and cfg.actuation == high.actuation
    none = load_randomization("none")
    assert (cfg.dynamics, cfg.perception, cfg.system) == (none.dynamics, none.perception, none.system)
    assert load_randomization(axis_preset("dynamics", 0, tmp_path)) == none
    assert parse_axes("dynamics,system") == ["dynamics", "system"] and parse_levels("3,0,1") == [0, 1, 3]
    with pytest.raises(ValueError, match="choose from dynamics"):
        parse_axes("dynamcs")
    with pytest.raises(ValueError, match=r"0\.\.3"):
        parse_levels("0,4")


def test_sweep_cells_records_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    rc = main(["eval", "sweep", "random", "--embodiment", "widowx", "--task", "reach", "--episodes", "1",
               "--max-steps", "3", "--image-size", "32", "--axes", "actuation,system", "--levels", "0,2",
               "--out", str(out), "--no-progress"])  # fmt: skip
    assert rc == 0 and "reality_proxy" in capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert [c["level"] for c in res["axes"]["actuation"]] == ["none", "medium"]
    assert res["axes"]["actuation"][0]["run"] == res["axes"]["system"][0]["run"] == "runs/none"  # shared
    for axis in ("actuation", "system"):
        assert (out / f"sweep_{axis}.png").read_bytes()[:8] == PNG
    cell = json.loads((out / "runs" / "actuation_2" / "results.json").read_text())
    rec = cell["episodes_detail"][0]["randomization"]
    assert rec["level"] == "actuation=medium"
    assert set(rec["dynamics"]["friction_scale"]) == {1.0}  # the other sources stay nominal
    assert any(v != 1.0 for v in rec["actuation"]["gain_scale"].values())
    proxy = json.loads((out / "runs" / "reality_proxy" / "results.json").read_text())
    assert (
        proxy["episodes_detail"][0]["randomization"]["actuation"]["latency_steps"] >= 3
    )  # held out: > high's 2
    assert res["reality_proxy"]["episodes"] == 1 and len(res["reality_proxy"]["ci95"]) == 2


def _run(folder: Path, policy: str, outcomes: list[bool], task: str = "pick_place") -> Path:
    """A results.json with these episode outcomes (the fields gap reads)."""
    rows = [{"index": i, "seed": i, "success": s, "steps": 10, "policy_calls": 1, "instruction": "x",
             "task": task, "embodiment": "sim_panda", "level": "none", "randomization": {},
             "policy_time_s": 0.0, "sim_time_s": 0.0} for i, s in enumerate(outcomes)]  # fmt: skip
    cfg = {"policy": policy, "embodiment": "panda", "task": task, "randomization": "none", "seed": 0}
    folder.mkdir(parents=True)
    write_results(folder, summarize(cfg, rows))
    return folder


def test_gap_against_csv_and_against_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # sim rates 0.25, 0.5, 0.75 for three checkpoints (given as paths: matched by folder name)
    sims = [_run(tmp_path / f"sim_{n}", f"/ckpts/{n}", [True] * k + [False] * (4 - k))
            for n, k in (("a", 1), ("b", 2), ("c", 3))]  # fmt: skip
    csv = tmp_path / "real.csv"
    csv.write_text("policy,task,success_rate\na,pick_place,0.2\nb,pick_place,0.9\nc,pick_place,0.3\n")
    rc = main(["eval", "gap", *map(str, sims), "--reference", str(csv), "--out", str(tmp_path / "gap")])
    assert rc == 0 and "3 policies" in capsys.readouterr().out
    got = json.loads((tmp_path / "gap" / "gap.json").read_text())
    sim, real = [0.25, 0.5, 0.75], [0.2, 0.9, 0.3]
    assert [p["sim"] for p in got["pairs"]] == sim and [p["real"] for p in got["pairs"]] == real
    assert got["mmrv"] == pytest.approx(mmrv(sim=sim, real=real)) == pytest.approx(0.4)
    assert got["pearson"] == pytest.approx(pearson(sim=sim, real=real))
    assert got["kendall_tau"] == pytest.approx(kendall_tau(sim=sim, real=real))
    assert (tmp_path / "gap" / "gap.png").read_bytes()[:8] == PNG
    # a second set of runs as the reference (e.g. reality_proxy): same ranking -> MMRV 0, tau 1
    refs = [_run(tmp_path / f"proxy_{n}", f"/ckpts/{n}", [True] * k + [False] * (8 - k))
            for n, k in (("a", 0), ("b", 3), ("c", 6))]  # fmt: skip
    res = gap(sims, refs, tmp_path / "gap2")
    assert res["mmrv"] == 0.0 and res["kendall_tau"] == pytest.approx(1.0) and res["reference"] == "runs"


def test_gap_errors_name_the_fix(tmp_path: Path) -> None:
    sims = [_run(tmp_path / f"s{i}", f"p{i}", [True, False]) for i in range(2)]
    bad = tmp_path / "bad.csv"
    bad.write_text("name,rate\np0,0.5\n")
    with pytest.raises(ValueError, match="needs a 'policy' column"):
        gap(sims, [bad], tmp_path / "o")
    pct = tmp_path / "pct.csv"
    pct.write_text("policy,success_rate\np0,50\np1,20\n")
    with pytest.raises(ValueError, match="a fraction, not a percent"):
        gap(sims, [pct], tmp_path / "o")
    missing = tmp_path / "missing.csv"
    missing.write_text("policy,successes,episodes\np0,1,4\n")
    with pytest.raises(ValueError, match="no reference success rate for policy 'p1'"):
        gap(sims, [missing], tmp_path / "o")
