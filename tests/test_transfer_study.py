"""``scripts/transfer_study.py``'s bookkeeping: per-seed runs laid out as its stages write them, pooled over seeds with
Wilson intervals, the claims decided by non-overlapping intervals, and the plot written. (The stages themselves are
``vla.demo.Demo``'s, run end to end by the ``make demo`` test.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from vla.eval.stats import wilson_interval
from vla.sim.tasks import TASKS

REPO = Path(__file__).resolve().parents[1]


def _study():
    spec = importlib.util.spec_from_file_location("transfer_study", REPO / "scripts" / "transfer_study.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["transfer_study"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# closest TCP-to-target distance (m) of episode i per arm and level: at "low" the pretrained model's fine-tune is
# 3 cm closer on every episode; at "reality_proxy" it is 1 cm closer on even episodes and 1 cm farther on odd ones
DISTANCE = {
    "low": {"finetuned_from_pretrained": lambda i: 0.05 + 0.001 * i,
            "finetuned_from_fresh": lambda i: 0.08 + 0.001 * i},
    "reality_proxy": {"finetuned_from_pretrained": lambda i: 0.1 + (0.01 if i % 2 else -0.01),
                      "finetuned_from_fresh": lambda i: 0.1},
}  # fmt: skip


def _write_seed(study, workdir: Path, seed: int, successes: dict[str, dict[str, int]], n: int, val: float):
    sizes = study.StudySizes(eval_episodes=n, train_seed=seed)
    run = study.SeedRun(workdir, seed, sizes)
    for arm, per_level in successes.items():
        for lvl, k in per_level.items():
            out = run.root / "eval" / f"{arm}_{lvl}"
            out.mkdir(parents=True)
            lo, hi = wilson_interval(k, n)
            dist = DISTANCE[lvl].get(arm, lambda i: 0.01)
            # episode seeds: disjoint blocks per training seed, as the study's evaluations draw them
            rows = [{"seed": 100 * seed + i, "min_target_distance_m": dist(i)} for i in range(n)]
            for i, row in enumerate(rows):  # the pretrained fine-tune goes to the named object in 4 of 5
                row["end_object_is_target"] = i % 5 != 0 if arm == "finetuned_from_pretrained" else i % 3 == 0
            if arm == "finetuned_from_fresh" and lvl == "reality_proxy":
                rows[seed]["physics_diverged"] = True  # one simulation blow-up per seed
            if arm == "finetuned_from_pretrained" and lvl == "low" and seed == 1:
                rows[0]["non_finite_action"] = True  # one NaN policy output in all
            out.joinpath("results.json").write_text(json.dumps(
                {"successes": k, "episodes": n, "success_rate": k / n, "ci95": [lo, hi], "episodes_detail": rows}
            ))  # fmt: skip
    for name, loss in (("finetune_pretrained", val), ("finetune_fresh", val + 0.5)):
        (run.root / name).mkdir(parents=True)
        lines = [{"step": 1, "loss": 2.0}, {"step": 5, "val_loss": loss + 1}, {"step": 10, "val_loss": loss}]
        (run.root / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


def test_pooled_rates_intervals_claims_and_plot(tmp_path: Path) -> None:
    study = _study()
    levels = ("low", "reality_proxy")
    a_wins = {
        "finetuned_from_pretrained": {"low": 40, "reality_proxy": 20},
        "finetuned_from_fresh": {"low": 10, "reality_proxy": 15},
        "expert": {"low": 50, "reality_proxy": 45},
        "random": {"low": 0, "reality_proxy": 1},
    }
    runs = [_write_seed(study, tmp_path, s, a_wins, 50, 0.4 + 0.1 * s) for s in range(3)]
    summary = study.summarize(runs, levels)

    pre = summary["pooled"]["finetuned_from_pretrained"]["low"]
    assert (pre["successes"], pre["episodes"]) == (120, 150)
    assert pre["ci95"] == pytest.approx(list(wilson_interval(120, 150)))
    assert pre["per_seed_rates"] == [0.8, 0.8, 0.8] and pre["per_seed_std"] == 0.0
    # low: 120/150 vs 30/150 -> disjoint; reality_proxy: 60/150 vs 45/150 -> the intervals overlap
    assert summary["claims"]["low"] == {
        "pretrained_beats_fresh": True,
        "pretrained_beats_random": True,
        "fresh_beats_random": True,
    }
    assert summary["claims"]["reality_proxy"]["pretrained_beats_fresh"] is False
    assert summary["claims"]["reality_proxy"]["pretrained_beats_random"] is True
    assert summary["finetune_final_val_loss"]["finetuned_from_pretrained"] == pytest.approx(
        {"0": 0.4, "1": 0.5, "2": 0.6}
    )
    assert summary["per_seed"]["2"]["random"]["reality_proxy"]["successes"] == 1
    assert summary["physics_diverged"]["finetuned_from_fresh"] == {"low": 0, "reality_proxy": 3}
    assert summary["physics_diverged"]["finetuned_from_pretrained"] == {"low": 0, "reality_proxy": 0}
    assert summary["non_finite_actions"]["finetuned_from_pretrained"] == {"low": 1, "reality_proxy": 0}
    assert summary["non_finite_actions"]["random"] == {"low": 0, "reality_proxy": 0}

    # graded progress: paired per-episode differences over all 150 episodes of the 3 seeds
    low, proxy = summary["target_distance"]["low"], summary["target_distance"]["reality_proxy"]
    assert low["pretrained_minus_fresh_m"]["n"] == 150
    assert low["pretrained_minus_fresh_m"]["mean"] == pytest.approx(-0.03)
    assert low["closest_m"]["finetuned_from_pretrained"]["mean"] == pytest.approx(0.05 + 0.001 * 24.5)
    assert low["pretrained_closer_than_fresh"] is True
    assert proxy["pretrained_minus_fresh_m"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert proxy["pretrained_minus_fresh_m"]["ci95"][0] < 0 < proxy["pretrained_minus_fresh_m"]["ci95"][1]
    assert proxy["pretrained_closer_than_fresh"] is False
    # grounding: the object each episode ended over, named or distractor (i % 5 != 0: 40 of 50 per seed)
    chose = low["end_object_is_target"]["finetuned_from_pretrained"]
    assert (chose["count"], chose["episodes"]) == (120, 150) and chose["rate"] == pytest.approx(0.8)
    assert chose["ci95"] == pytest.approx(list(wilson_interval(120, 150)))
    assert low["end_object_is_target"]["finetuned_from_fresh"]["count"] == 3 * 17  # i % 3 == 0 for i < 50

    png = tmp_path / "study.png"
    study.plot(summary, levels, png, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_rate_counts_only_recorded_flags() -> None:
    study = _study()
    assert study._rate([None, None]) is None  # results from before the record: no rate, not 0
    r = study._rate([True, False, None, True])
    assert (r["count"], r["episodes"]) == (2, 3) and r["ci95"] == pytest.approx(list(wilson_interval(2, 3)))


def test_seed_layout_shares_pretraining_data_and_draws_the_new_robot_per_seed(tmp_path: Path) -> None:
    study = _study()
    a, b = (study.SeedRun(tmp_path, s, study.StudySizes(train_seed=s)) for s in (0, 1))
    assert a.dataset("panda") == b.dataset("panda") == tmp_path / "data" / "sim_panda_reach"
    # another task names every dataset and reaches every command
    slots = study.SeedRun(tmp_path, 0, study.StudySizes(train_seed=0, task="reach_slots"))
    assert slots.dataset("panda").name == "sim_panda_reach_slots"
    assert slots.dataset(study.NEW_ROBOT).name == "sim_kinova_gen3_reach_slots_seed0"
    calls: list[list[str]] = []
    slots.vla = lambda *args, **_: calls.append([str(x) for x in args])
    slots.root.mkdir(parents=True)  # run_stages makes it before stage 1
    slots.generate()
    tasks = {c[c.index("--task") + 1] for c in calls if "--task" in c}
    assert (
        tasks == {"reach_slots"}
        and "sim_panda_reach_slots" in slots.root.joinpath("pretrain_mixture.yaml").read_text()
    )
    assert a.dataset(study.NEW_ROBOT) != b.dataset(study.NEW_ROBOT)
    assert a.root != b.root and a.root.parent == tmp_path
    # the reported and the tuning evaluations never share an episode seed
    sizes = study.StudySizes()
    reported = range(study.EVAL_SEED, study.EVAL_SEED + sizes.seeds * sizes.eval_episodes)
    assert study.VALIDATION_SEED not in reported and reported[-1] < study.VALIDATION_SEED


def test_a_kept_evaluation_is_reused_only_with_the_same_settings(tmp_path: Path) -> None:
    """Stage 4 resumes by keeping finished evaluations; one made with other seeds (e.g. the validation block), episode
    count, randomization or actions per chunk is an error naming the folder and the difference, never reused."""
    from vla.demo import _check_kept

    out = tmp_path / "eval" / "finetuned_from_pretrained_low"
    out.mkdir(parents=True)
    kept = {"seed": 5_000_000, "episodes": 50, "randomization": "low", "execute_steps": None}
    (out / "results.json").write_text(json.dumps(kept))
    _check_kept(out, dict(kept))  # same settings: kept silently
    with pytest.raises(SystemExit, match=r"task=None \(now 'reach_slots'\)"):  # evaluated on another task
        _check_kept(out, kept | {"task": "reach_slots"})
    with pytest.raises(SystemExit, match=r"finetuned_from_pretrained_low.*seed=5000000 \(now 10000\)"):
        _check_kept(out, kept | {"seed": 10_000})
    with pytest.raises(SystemExit, match=r"execute_steps=None \(now 4\)"):
        _check_kept(out, kept | {"execute_steps": 4})


def test_training_from_evaluates_the_kept_models_into_its_own_folder(tmp_path: Path) -> None:
    """``--training-from``: stage 4 only, on the given study's exported models, written under the new work folder
    (the validation run's evaluations stay where they are); missing exports are an error naming them."""
    study = _study()
    trained, reported = tmp_path / "validation", tmp_path / "reported"
    sizes = study.StudySizes(eval_episodes=3, eval_seed=10_000)
    run = study.SeedRun(reported, 0, sizes, training_from=trained)
    with pytest.raises(SystemExit, match=r"export_pretrained.*not found"):
        run.run_stages()
    for name in ("export_pretrained", "export_fresh"):
        (trained / "seed_0" / name).mkdir(parents=True)
        (trained / "seed_0" / name / "config.json").write_text("{}")
    # models fine-tuned on another task's data (a reach study evaluated as reach_slots): refused, naming the task
    other = study.SeedRun(reported, 0, dataclasses.replace(sizes, task="reach_slots"), training_from=trained)
    with pytest.raises(SystemExit, match=r"sim_kinova_gen3_reach_slots_seed0.*--task reach_slots"):
        other.run_stages()
    run.dataset(study.NEW_ROBOT).mkdir(parents=True)
    calls: list[list[str]] = []
    run.vla = lambda *args: calls.append(
        [str(a) for a in args]
    )  # record the commands instead of running them
    run.run_stages()
    assert {c[0] for c in calls} == {"eval"}  # no generation, training or fine-tuning
    policies = {c[2] for c in calls}
    assert policies == {str(trained / "seed_0" / "export_pretrained"), str(trained / "seed_0" / "export_fresh"),
                        "expert", "random"}  # fmt: skip
    outs = {c[c.index("--out") + 1] for c in calls}
    assert outs == {str(reported / "seed_0" / "eval" / f"{a}_{lvl}") for a in study.ARMS
                    for lvl in ("low", "reality_proxy")}  # fmt: skip
    assert all(c[c.index("--seed") + 1] == "10000" for c in calls)


def test_both_fine_tunes_get_the_same_preset_and_learning_rate(tmp_path: Path) -> None:
    """``--finetune-preset``/``--finetune-lr`` (a tuning lever: e.g. full fine-tuning instead of LoRA) reach both
    ``vla finetune`` runs alike, so the pretrained and the fresh arm stay one recipe; by default LoRA at the
    preset's rate."""
    study = _study()
    for sizes, preset, lr in ((study.StudySizes(), "finetune_lora", None),
                              (study.StudySizes(finetune_preset="finetune_full", finetune_lr=1e-4), "finetune_full",
                               "0.0001")):  # fmt: skip
        run = study.SeedRun(tmp_path / preset, 0, sizes)
        (run.root / "fresh_init").mkdir(parents=True)
        (run.root / "fresh_init" / "config.json").write_text(
            "{}"
        )  # a fresh model exists: no `vla model init`
        calls: list[list[str]] = []
        run.vla = lambda *args, calls=calls: calls.append([str(a) for a in args])
        run.finetune()
        tunes = [c for c in calls if c[0] == "finetune"]
        assert [c[1] for c in tunes] == [str(run.root / "pretrain"), str(run.root / "fresh_init")]
        for c in tunes:
            assert c[c.index("--preset") + 1] == preset
            sets = [c[i + 1] for i, a in enumerate(c) if a == "--set"]
            assert [s for s in sets if s.startswith("optim.lr=")] == ([f"optim.lr={lr}"] if lr else []), sets


def test_the_result_records_the_recipe_the_evaluated_fine_tunes_were_trained_with(tmp_path: Path) -> None:
    """With ``--training-from`` the command line's fine-tuning flags need not be the kept models' recipe: the study
    reads it from each run's ``config.yaml``."""
    study = _study()
    run = tmp_path / "finetune_pretrained"
    assert study._finetune_recipe(run) is None  # no run there
    run.mkdir()
    (run / "config.yaml").write_text("optim:\n  lr: 3.0e-05\nfinetune:\n  mode: full\n  lora: null\n")
    assert study._finetune_recipe(run) == {"mode": "full", "lora": None, "lr": 3e-05}


def test_study_tasks_are_those_whose_instruction_picks_an_object() -> None:
    """A task joins the study's --task choices by saying its instruction names an object among distractors (the
    drawer task names none, so it could not test grounding)."""
    study = _study()
    # exact: a new task joins only by opting in (Task.names_object defaults to False); drawer names no object
    assert set(study.TARGET_TASKS) == set(TASKS.names()) - {"drawer"}
    assert {"reach", "reach_slots", "reach_fixed_slots"} <= set(study.TARGET_TASKS)


def test_first_eval_seed_moves_the_reported_block_and_never_into_the_validation_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--first-eval-seed``: a confirmation run on episodes no earlier run evaluated. Seed k starts at S + k*N; a
    block reaching the validation episodes, or the flag with ``--validation``, is refused before anything runs."""
    study = _study()
    seen: list[int] = []

    class Stop(Exception):
        pass

    def record(self) -> None:
        seen.append(self.sizes.eval_seed)
        if len(seen) == 3:
            raise Stop

    monkeypatch.setattr(study.SeedRun, "run_stages", record)
    base = ["--workdir", str(tmp_path), "--out", str(tmp_path / "r.json")]
    with pytest.raises(Stop):
        study.main([*base, "--first-eval-seed", "30000", "--eval-episodes", "150"])
    assert seen == [30_000, 30_150, 30_300]
    seen.clear()
    # --first-seed 3: training seeds 3..5, each evaluated on its own block after the default run's
    with pytest.raises(Stop):
        study.main([*base, "--first-seed", "3"])
    assert seen == [study.EVAL_SEED + 150, study.EVAL_SEED + 200, study.EVAL_SEED + 250]
    seen.clear()
    for bad in (["--first-eval-seed", str(study.VALIDATION_SEED - 100)],  # seed 2's block would start inside it
                ["--first-eval-seed", "-1"], ["--first-eval-seed", "30000", "--validation"],
                ["--first-seed", "-1"]):  # fmt: skip
        with pytest.raises(SystemExit):
            study.main([*base, *bad])
    assert seen == []
