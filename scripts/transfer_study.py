#!/usr/bin/env python3
"""Does cross-embodiment pretraining help a robot it never saw? ``make demo``'s experiment at a scale that can show it.

Per training seed (``--seeds``, default 3), with the real commands (``vla.demo.Demo``'s stages):

1. ``vla sim generate`` domain-randomized demonstrations of a language-conditioned task (``--task``: ``reach`` by
   default, or ``reach_slots`` with the objects on fixed slots; the target is named by colour among distractors)
   for the three pretraining robots (shared by every seed) and a few for the unseen
   Kinova Gen3 (drawn anew per seed: a different small dataset is part of what a seed varies);
2. ``vla train`` cross-embodiment pretraining (``train.seed`` = the seed);
3. ``vla finetune`` (LoRA by default, ``--finetune-preset``) on the Kinova demonstrations from (a) the pretrained
   model and (b) a freshly initialised one, same data, steps, preset and seed;
4. ``vla eval sim`` of (a), (b), the scripted expert and a random policy, under the training randomization and under
   the held-out ``reality_proxy`` preset, every policy on the same initial states (paired). Each seed evaluates its
   own block of episode seeds, so the pooled episodes cover ``seeds x episodes`` distinct initial states.

Writes ``benchmarks/results/transfer_study_<date>.json`` (settings, the CPU, per-seed and pooled success with 95 %
Wilson intervals, the held-out validation loss of each fine-tuning run, and whether (a) beats (b) and random with
non-overlapping intervals) and a PNG of the pooled rates next to it.

Tuning never sees the evaluation episodes: ``--validation`` evaluates on a disjoint block of episode seeds (from
``VALIDATION_SEED``) into its own work folder and writes ``transfer_study_validation_<date>.json``; tune the sizes
there, then run once without it. Every stage resumes, so an interrupted study continues where it stopped. Training
never sees evaluation seeds, so the reported run may evaluate the validation run's models instead of training the
same seeds again: ``--training-from runs/transfer_study/validation`` runs stage 4 only, into ``reported/``.

A task other than ``reach`` works in ``<workdir>/<task>/`` and writes ``transfer_study[_validation]_<task>_<date>``.

    .venv/bin/python scripts/transfer_study.py [--task reach] [--seeds 3] [--eval-episodes 50] [--workdir runs/transfer_study]
        [--pretrain-steps N] [--finetune-steps N] [--episodes-per-robot N] [--new-robot-episodes N] [--finetune-preset P]
        [--finetune-lr LR] [--image-size PX] [--validation] [--training-from DIR] [--first-eval-seed S]
        [--first-seed K]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import cpu_model  # noqa: E402

from vla.demo import NEW_ROBOT, PRETRAIN_ROBOTS, Demo, DemoSizes  # noqa: E402
from vla.eval.rollout import count_diverged, count_non_finite  # noqa: E402
from vla.eval.stats import wilson_interval  # noqa: E402
from vla.sim.tasks import TASKS  # noqa: E402

EVAL_SEED = (
    10_000  # first episode seed of the reported evaluation; seed k evaluates [EVAL_SEED + k*N, ... + N)
)
VALIDATION_SEED = 5_000_000  # first episode seed of the tuning evaluation (disjoint from the reported one)
ARMS = ("finetuned_from_pretrained", "finetuned_from_fresh", "expert", "random")
TARGET_TASKS = tuple(n for n in TASKS.names() if TASKS.get(n).names_object)  # the instruction picks an object


@dataclasses.dataclass(frozen=True)
class StudySizes(DemoSizes):
    """The study's scale (defaults sized for about 90 minutes on a 2-core CPU) and its number of seeds."""

    episodes_per_robot: int = 60
    new_robot_episodes: int = 20
    pretrain_steps: int = 2000
    finetune_steps: int = 400
    eval_episodes: int = 50  # per seed, policy and randomization
    seeds: int = 3
    task: str = "reach"  # the study's first task (its result files keep their names); make demo's is another


class SeedRun(Demo):
    """One seed of the study: ``Demo``'s stages 1-4 in ``workdir/seed_<k>``, with the pretraining data shared by
    every seed (``workdir/data``) and the unseen robot's demonstrations drawn per seed."""

    def __init__(self, workdir: Path, seed: int, sizes: DemoSizes, training_from: Path | None = None) -> None:
        """``training_from``: a finished study's work folder whose stages 1-3 (data, pretraining, fine-tuning) this
        run evaluates instead of repeating them; stage 4 still writes to ``workdir``."""
        base = training_from or workdir
        super().__init__(base / f"seed_{seed}", sizes)
        self.data = base / "data"
        self.seed = seed
        self.training_from = training_from
        self._eval_root = workdir / f"seed_{seed}" / "eval"

    @property
    def eval_root(self) -> Path:
        return self._eval_root

    def dataset(self, robot: str) -> Path:
        if robot == NEW_ROBOT:
            return self.data / f"sim_{robot}_{self.sizes.task}_seed{self.seed}"
        return super().dataset(robot)

    def run_stages(self) -> None:
        if self.training_from is not None:
            missing = [p for p in (self.root / "export_pretrained", self.root / "export_fresh")
                       if not (p / "config.json").is_file()]  # fmt: skip
            if missing:
                raise SystemExit(
                    f"--training-from {self.training_from}: {', '.join(map(str, missing))} not found; run the "
                    "study there first (without --training-from) so its stages 1-3 finish"
                )
            if not self.dataset(NEW_ROBOT).is_dir():  # its fine-tuning data names the task it was trained on
                raise SystemExit(
                    f"--training-from {self.training_from}: no {self.dataset(NEW_ROBOT)}, so its models were not "
                    f"trained on --task {self.sizes.task}; pass the --task that study ran"
                )
            print(
                f"\n[1-3/6] seed {self.seed}: data, pretraining and fine-tuning of {self.root} (kept)",
                flush=True,
            )
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            self.stage(
                1,
                f"seed {self.seed}: demonstrations ({', '.join(PRETRAIN_ROBOTS)} + {NEW_ROBOT})",
                self.generate,
            )
            self.stage(2, f"seed {self.seed}: cross-embodiment pretraining", self.pretrain)
            self.stage(
                3,
                f"seed {self.seed}: {self.sizes.finetune_preset} on {NEW_ROBOT} from the pretrained and a fresh model",
                self.finetune,
            )
        self.stage(4, f"seed {self.seed}: closed-loop evaluation", self.evaluate)

    def results(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{arm: {level: results.json}}`` of stage 4."""
        levels = (self.sizes.randomization, "reality_proxy")
        return {
            arm: {
                lvl: json.loads((self.eval_root / f"{arm}_{lvl}" / "results.json").read_text())
                for lvl in levels
            }
            for arm in ARMS
        }

    def final_val_loss(self, arm: str) -> float | None:
        """The last held-out validation loss logged by ``arm``'s fine-tuning run (``metrics.jsonl``)."""
        run = self.root / ("finetune_pretrained" if arm == "finetuned_from_pretrained" else "finetune_fresh")
        losses = [
            rec["val_loss"]
            for line in (run / "metrics.jsonl").read_text().splitlines()
            if line.strip() and "val_loss" in (rec := json.loads(line))
        ]
        return losses[-1] if losses else None


def pooled(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Successes and episodes summed over seeds, with the Wilson interval of the pooled rate, and the per-seed rates'
    mean and standard deviation (the spread the pooled interval does not show)."""
    k = sum(r["successes"] for r in per_seed)
    n = sum(r["episodes"] for r in per_seed)
    rates = [r["success_rate"] for r in per_seed]
    low, high = wilson_interval(k, n)
    return {
        "successes": k,
        "episodes": n,
        "success_rate": k / n if n else 0.0,
        "ci95": [low, high],
        "per_seed_rates": rates,
        "per_seed_mean": statistics.fmean(rates) if rates else 0.0,
        "per_seed_std": statistics.stdev(rates) if len(rates) > 1 else 0.0,
    }


def mean_ci(values: list[float]) -> dict[str, Any]:
    """Mean of ``values`` with its 95 % normal-approximation interval (1.96 standard errors)."""
    n = len(values)
    mean = statistics.fmean(values) if values else float("nan")
    half = 1.96 * statistics.stdev(values) / n**0.5 if n > 1 else float("nan")
    return {"n": n, "mean": mean, "ci95": [mean - half, mean + half]}


def closest_distances(results: list[dict[str, Any]]) -> dict[int, float]:
    """``{episode seed: closest TCP-to-target distance (m)}`` over the per-seed ``results.json`` objects."""
    return {
        int(row["seed"]): float(row["min_target_distance_m"])
        for res in results
        for row in res["episodes_detail"]
        if row.get("min_target_distance_m") is not None
    }


def distance_summary(
    per_seed: dict[int, dict[str, dict[str, Any]]], levels: tuple[str, str]
) -> dict[str, Any]:
    """Graded progress next to success: per arm and level the mean closest distance of the TCP to the named
    object (m, 95 % interval), the paired per-episode difference pretrained - fresh (same initial states;
    negative = the pretrained model's fine-tune gets closer), and ``end_object_is_target``: how often the object an
    episode ended over was the named one (None where the results predate that record)."""
    out: dict[str, Any] = {}
    for lvl in levels:
        by_arm = {arm: closest_distances([per_seed[s][arm][lvl] for s in per_seed]) for arm in ARMS}
        a, b = by_arm["finetuned_from_pretrained"], by_arm["finetuned_from_fresh"]
        diff = mean_ci([a[k] - b[k] for k in sorted(a.keys() & b.keys())])
        rows = {arm: [r for s in per_seed for r in per_seed[s][arm][lvl]["episodes_detail"]] for arm in ARMS}
        out[lvl] = {
            "closest_m": {arm: mean_ci(list(d.values())) for arm, d in by_arm.items()},
            # how often the object the TCP ended over was the named one (a random pick among the three objects
            # of reach / reach_slots: 1/3): grounding, apart from reaching precision
            "end_object_is_target": {
                arm: _rate([r.get("end_object_is_target") for r in rows[arm]]) for arm in ARMS
            },
            "pretrained_minus_fresh_m": diff,
            "pretrained_closer_than_fresh": bool(diff["n"] > 1 and diff["ci95"][1] < 0),
        }
    return out


def _rate(flags: list[bool | None]) -> dict[str, Any] | None:
    """Share of True among the recorded ``flags`` with its 95 % Wilson interval; None when none was recorded."""
    known = [bool(f) for f in flags if f is not None]
    if not known:
        return None
    k = sum(known)
    return {
        "count": k,
        "episodes": len(known),
        "rate": k / len(known),
        "ci95": list(wilson_interval(k, len(known))),
    }


def beats(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a``'s 95 % interval lies entirely above ``b``'s (the study's claim, per randomization level)."""
    return a["ci95"][0] > b["ci95"][1]


def summarize(runs: list[SeedRun], levels: tuple[str, str]) -> dict[str, Any]:
    """Per-seed and pooled success per arm and level, fine-tuning validation losses, and the claims' verdicts."""
    per_seed = {run.seed: run.results() for run in runs}
    pool = {arm: {lvl: pooled([per_seed[s][arm][lvl] for s in per_seed]) for lvl in levels} for arm in ARMS}
    claims = {
        lvl: {
            "pretrained_beats_fresh": beats(
                pool["finetuned_from_pretrained"][lvl], pool["finetuned_from_fresh"][lvl]
            ),
            "pretrained_beats_random": beats(pool["finetuned_from_pretrained"][lvl], pool["random"][lvl]),
            "fresh_beats_random": beats(pool["finetuned_from_fresh"][lvl], pool["random"][lvl]),
        }
        for lvl in levels
    }
    # episodes ended by a simulation blow-up or by a NaN/inf policy output (counted as failures), per arm and level
    diverged, non_finite = (
        {
            arm: {
                lvl: sum(count(per_seed[s][arm][lvl]["episodes_detail"]) for s in per_seed) for lvl in levels
            }
            for arm in ARMS
        }
        for count in (count_diverged, count_non_finite)
    )
    val = {
        arm: {str(run.seed): run.final_val_loss(arm) for run in runs}
        for arm in ("finetuned_from_pretrained", "finetuned_from_fresh")
    }
    return {
        "per_seed": {
            str(s): {
                arm: {
                    lvl: {k: r[lvl][k] for k in ("successes", "episodes", "success_rate", "ci95")}
                    for lvl in levels
                }
                for arm, r in res.items()
            }
            for s, res in per_seed.items()
        },
        "pooled": pool,
        "finetune_final_val_loss": val,
        "physics_diverged": diverged,
        "non_finite_actions": non_finite,
        "target_distance": distance_summary(per_seed, levels),
        "claims": claims,
    }


def plot(summary: dict[str, Any], levels: tuple[str, str], out: Path, title: str) -> None:
    """Grouped bars of the pooled success rate per arm and level, with the 95 % intervals as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(levels)
    for j, lvl in enumerate(levels):
        xs = [i + (j - (len(levels) - 1) / 2) * width for i in range(len(ARMS))]
        rates = [summary["pooled"][arm][lvl]["success_rate"] for arm in ARMS]
        lows = [r - summary["pooled"][arm][lvl]["ci95"][0] for arm, r in zip(ARMS, rates, strict=True)]
        highs = [summary["pooled"][arm][lvl]["ci95"][1] - r for arm, r in zip(ARMS, rates, strict=True)]
        ax.bar(xs, rates, width, yerr=[lows, highs], capsize=3, label=lvl)
    ax.set_xticks(range(len(ARMS)), [a.replace("_", "\n", 1) for a in ARMS])
    ax.set_ylim(0, 1)
    ax.set_ylabel("success rate (pooled, 95 % Wilson)")
    ax.set_title(title, fontsize=9)
    ax.legend(title="randomization")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _commit() -> str | None:
    """The git commit the study ran on (``+dirty`` with uncommitted changes), None outside a git checkout."""
    import subprocess

    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _finetune_recipe(run: Path) -> dict[str, Any] | None:
    """``finetune.mode``, ``finetune.lora`` and ``optim.lr`` of a fine-tuning run (its ``config.yaml``), or None
    when the run folder has no config."""
    import yaml

    cfg_file = run / "config.yaml"
    if not cfg_file.is_file():
        return None
    cfg = yaml.safe_load(cfg_file.read_text())
    ft = cfg.get("finetune") or {}
    return {"mode": ft.get("mode"), "lora": ft.get("lora"), "lr": (cfg.get("optim") or {}).get("lr")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = StudySizes()
    ap.add_argument("--seeds", type=int, default=d.seeds)
    ap.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="first training seed: seeds K..K+seeds-1 (a replication on training seeds no earlier run used)",
    )
    ap.add_argument("--task", default=d.task, choices=TARGET_TASKS,
                    help="the sim task (reach_slots: the objects on three slots; reach_fixed_slots: each colour always on "
                         "the same slot)")  # fmt: skip
    ap.add_argument("--episodes-per-robot", type=int, default=d.episodes_per_robot)
    ap.add_argument("--new-robot-episodes", type=int, default=d.new_robot_episodes)
    ap.add_argument("--pretrain-steps", type=int, default=d.pretrain_steps)
    ap.add_argument("--finetune-steps", type=int, default=d.finetune_steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--eval-episodes", type=int, default=d.eval_episodes, help="per seed, policy and level")
    ap.add_argument("--workers", type=int, default=d.workers)
    ap.add_argument("--image-size", type=int, default=d.image_size)
    ap.add_argument(
        "--randomization", default=d.randomization, help="generation and the first evaluation column"
    )
    ap.add_argument("--execute-steps", type=int, default=d.execute_steps,
                    help="actions the learned policies run per chunk (default: the whole chunk)")  # fmt: skip
    ap.add_argument("--finetune-preset", default=d.finetune_preset,
                    help="vla finetune --preset of both fine-tuning runs (e.g. finetune_full)")  # fmt: skip
    ap.add_argument("--finetune-lr", type=float, default=d.finetune_lr,
                    help="optim.lr of both fine-tuning runs (default: the preset's)")  # fmt: skip
    ap.add_argument(
        "--validation", action="store_true", help="evaluate on the tuning seeds, not the reported ones"
    )
    ap.add_argument("--workdir", type=Path, default=REPO / "runs" / "transfer_study")
    ap.add_argument(
        "--training-from",
        type=Path,
        default=None,
        help="evaluate the trained models of a finished study's work folder (e.g. runs/transfer_study/validation: "
        "training never sees evaluation seeds, so the same seeds train the same models) instead of training again",
    )
    ap.add_argument(
        "--first-eval-seed",
        type=int,
        default=EVAL_SEED,
        help="first episode seed of the reported evaluation: a block no earlier run evaluated gives a confirmation "
        "run on new episodes (seed k evaluates episodes (S + k*N, i), i < N)",
    )
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default benchmarks/results/...)")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.eval_episodes < 1 or args.first_seed < 0:
        ap.error("--seeds and --eval-episodes must be at least 1, --first-seed at least 0")
    if args.execute_steps is not None and args.execute_steps < 1:
        ap.error(f"--execute-steps must be at least 1, got {args.execute_steps}")

    if args.validation and args.first_eval_seed != EVAL_SEED:
        ap.error("--first-eval-seed sets the reported evaluation's block; --validation always uses its own")
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    last_base = args.first_eval_seed + seeds[-1] * args.eval_episodes
    if not args.validation and not 0 <= args.first_eval_seed <= last_base < VALIDATION_SEED:
        ap.error(
            f"--first-eval-seed {args.first_eval_seed}: the reported blocks must lie in [0, {VALIDATION_SEED}) "
            f"(this run's last block starts at {last_base}); from {VALIDATION_SEED} on are the validation "
            "episodes tuning looked at"
        )

    kind = "transfer_study_validation" if args.validation else "transfer_study"
    named = "" if args.task == "reach" else f"_{args.task}"
    out = args.out or REPO / "benchmarks" / "results" / f"{kind}{named}_{date.today().isoformat()}.json"
    if args.task != "reach":
        args.workdir = args.workdir / args.task
    first_eval_seed = VALIDATION_SEED if args.validation else args.first_eval_seed
    workdir = args.workdir / ("validation" if args.validation else "reported")
    t0 = time.perf_counter()
    runs = []
    for seed in seeds:
        sizes = StudySizes(
            episodes_per_robot=args.episodes_per_robot,
            new_robot_episodes=args.new_robot_episodes,
            pretrain_steps=args.pretrain_steps,
            finetune_steps=args.finetune_steps,
            batch_size=args.batch_size,
            eval_episodes=args.eval_episodes,
            workers=args.workers,
            image_size=args.image_size,
            randomization=args.randomization,
            execute_steps=args.execute_steps,
            finetune_preset=args.finetune_preset,
            finetune_lr=args.finetune_lr,
            task=args.task,
            seeds=args.seeds,
            train_seed=seed,
            new_robot_seed=1000 + 100 * seed,
            eval_seed=first_eval_seed + seed * args.eval_episodes,
        )
        run = SeedRun(workdir, seed, sizes, training_from=args.training_from)
        run.t0 = t0
        run.run_stages()
        runs.append(run)

    levels = (args.randomization, "reality_proxy")
    summary = summarize(runs, levels)
    settings = {k: v for k, v in dataclasses.asdict(runs[0].sizes).items()
                if k not in ("train_seed", "new_robot_seed", "eval_seed")}  # fmt: skip
    result = {
        "benchmark": kind,
        "date": date.today().isoformat(),
        "cpu_model": cpu_model(),
        "commit": _commit(),
        "wall_s": round(time.perf_counter() - t0, 1),
        "settings": settings
        | {
            "model": "tiny_smolvlm (vla train's debug preset)",
            "pretrain_robots": list(PRETRAIN_ROBOTS),
            "new_robot": NEW_ROBOT,
            "levels": list(levels),
            "first_eval_seed": first_eval_seed,
            "training_seeds": list(seeds),
            # what the evaluated fine-tunes were trained with, read from their runs (with --training-from the
            # flags above may differ from the kept models' recipe)
            "finetune_used": [_finetune_recipe(r.root / "finetune_pretrained") for r in runs],
            "training_from": str(args.training_from) if args.training_from else None,
        },
        **summary,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    title = (f"{NEW_ROBOT} {args.task}: {args.seeds} seeds x {args.eval_episodes} episodes, pretrain "
             f"{args.pretrain_steps} steps, {args.finetune_preset} {args.finetune_steps} steps on {args.new_robot_episodes} demos")  # fmt: skip
    plot(summary, levels, out.with_suffix(".png"), title)

    print(f"\n{'arm':<28}" + "".join(f"{lvl:>30}" for lvl in levels))
    for arm in ARMS:
        cells = []
        for lvl in levels:
            p = summary["pooled"][arm][lvl]
            cells.append(f"{p['successes']}/{p['episodes']} [{p['ci95'][0]:.2f}, {p['ci95'][1]:.2f}]")
        print(f"{arm:<28}" + "".join(f"{c:>30}" for c in cells))
    for lvl, verdict in summary["claims"].items():
        print(f"{lvl}: " + ", ".join(f"{k}={v}" for k, v in verdict.items()))
    for lvl, dist in summary["target_distance"].items():
        d = dist["pretrained_minus_fresh_m"]
        closest = ", ".join(f"{arm} {c['mean']:.3f}" for arm, c in dist["closest_m"].items())
        print(f"{lvl}: closest distance to the target (m): {closest}; pretrained - fresh {d['mean']:+.3f} "
              f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]")  # fmt: skip
        chose = ", ".join(
            f"{arm} {c['count']}/{c['episodes']}" for arm, c in dist["end_object_is_target"].items() if c
        )
        if chose:
            print(f"{lvl}: episodes that ended over the named object: {chose}")
    print(f"results: {out} and {out.with_suffix('.png')} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
