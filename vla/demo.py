"""``vla demo`` (``make demo``): the main job end to end on embedded defaults, every stage the real command.

1. ``vla sim generate``: domain-randomized scripted demonstrations of a language-conditioned task (``TASK``: reach
   the object named by colour among three) for three pretraining robots and, few, for a robot pretraining never sees;
   ``vla data stats`` for each dataset.
2. ``vla train``: cross-embodiment pretraining of the tiny VLA on the three robots' mixture.
3. ``vla finetune`` (LoRA) on the unseen robot from (a) the pretrained model and (b) a freshly initialised one, with
   the same data and steps; ``vla export --merge`` of each.
4. ``vla eval sim`` on the same seeds: (a), (b), the scripted expert and a random policy, under the training
   randomization and under the held-out ``reality_proxy`` preset; success rates with 95 % Wilson intervals.
5. ``vla serve`` the fine-tuned model and run one episode through the serving client and its action-chunk broker
   (``vla eval sim --via-server``: a robot's control loop), with its video.
6. ``vla eval report``: ``report.html`` (tables, plots, videos), plus the fine-tuned model's Hugging Face model card.

Each stage prints one line with its elapsed time; the commands draw their own progress bars. Running the demo again
reuses finished stages: each command resumes (generation, training and fine-tuning from their newest complete
state) and an evaluation whose ``results.json`` exists is kept. ``--quick`` shrinks every size to a smoke run (the
tests use it); the numbers of a quick run mean nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PRETRAIN_ROBOTS = ("panda", "ur5e", "widowx")
NEW_ROBOT = "kinova_gen3"
# Each colour on a fixed slot: the instruction alone says where to reach, the setting where pretraining on other robots
# was shown to raise an unseen robot's success (README, the transfer study); on plain `reach` the target must be
# found in the image, which the tiny model does not learn at this scale.
TASK = "reach_fixed_slots"


@dataclass(frozen=True)
class DemoSizes:
    """How much of everything the demo does (the defaults fit ``make demo`` on a 2-core CPU)."""

    episodes_per_robot: int = 24  # pretraining demonstrations per robot
    new_robot_episodes: int = (
        16  # fine-tuning demonstrations of the unseen robot (+ 2 held out for validation)
    )
    pretrain_steps: int = 300
    finetune_steps: int = 150
    batch_size: int = 16
    eval_episodes: int = 10  # per policy and randomization, on the same seeds for every policy
    workers: int = 2
    # rendered and model input size (the tiny vision tower's native 64 px; others: a multiple of 16)
    image_size: int = 64
    randomization: str = "low"  # generation and the first evaluation column
    train_seed: int = 0  # pretraining's and fine-tuning's train.seed
    new_robot_seed: int = 1000  # generation seed of the unseen robot's demonstrations (pretraining data: 0)
    eval_seed: int = 7  # first episode seed of every evaluation (same for every policy: paired)
    execute_steps: int | None = None  # actions the learned policies run per chunk (None: the whole chunk)
    finetune_preset: str = "finetune_lora"  # `vla finetune --preset` of both fine-tuning runs
    finetune_lr: float | None = None  # optim.lr of both fine-tuning runs (None: the preset's)
    task: str = TASK  # the sim task of every stage (a name in vla.sim.tasks.TASKS)


QUICK = DemoSizes(
    episodes_per_robot=3,
    new_robot_episodes=3,
    pretrain_steps=2,
    finetune_steps=2,
    batch_size=4,
    eval_episodes=1,
    workers=1,
)


def _check_kept(out: Path, wanted: dict[str, object]) -> None:
    """A finished evaluation is reused only when it was made with the settings asked for now (task, first episode
    seed, episodes, randomization, actions per chunk); otherwise an error naming the folder and each difference."""
    kept = json.loads((out / "results.json").read_text())
    diff = {k: (kept.get(k), v) for k, v in wanted.items() if kept.get(k) != v}
    if diff:
        what = ", ".join(f"{k}={old!r} (now {new!r})" for k, (old, new) in diff.items())
        raise SystemExit(
            f"{out}/results.json was evaluated with {what}: delete {out} (or use another work folder) to "
            "evaluate again"
        )


class Demo:
    """The stages above over one work folder (``runs/demo`` by default)."""

    def __init__(self, workdir: str | Path, sizes: DemoSizes) -> None:
        self.root = Path(workdir)
        self.sizes = sizes
        self.data = self.root / "data"
        self.t0 = time.perf_counter()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # embedded defaults only: nothing is downloaded
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("MUJOCO_GL", "egl")

    # ---- plumbing ----------------------------------------------------------------------------------------------
    def vla(self, *args: object, hint: str = "") -> None:
        """Run ``vla ARGS`` (the command's own ``main``, in this process: no interpreter start-up per command) and
        fail loudly with its command line (and ``hint``, appended to that error)."""
        from vla.cli import main

        argv = [str(a) for a in args]
        print("  $ vla " + " ".join(argv), flush=True)
        rc = main(argv)
        if rc != 0:
            raise RuntimeError(f"`vla {' '.join(argv)}` failed (exit {rc}); its error is printed above{hint}")

    def stage(self, number: int, title: str, fn) -> None:
        start = time.perf_counter()
        print(f"\n[{number}/6] {title}", flush=True)
        fn()
        now = time.perf_counter()
        print(f"[{number}/6] done in {now - start:.0f} s (total {now - self.t0:.0f} s)", flush=True)

    def dataset(self, robot: str) -> Path:
        return self.data / f"sim_{robot}_{self.sizes.task}"

    @property
    def eval_root(self) -> Path:
        """Where stage 4 writes one folder per policy and randomization."""
        return self.root / "eval"

    # ---- 1. data -------------------------------------------------------------------------------------------------
    def generate(self) -> None:
        s = self.sizes
        jobs = [(r, s.episodes_per_robot, 0) for r in PRETRAIN_ROBOTS]
        jobs.append((NEW_ROBOT, s.new_robot_episodes + 2, s.new_robot_seed))  # other seeds; 2 held out
        for robot, episodes, seed in jobs:
            out = self.dataset(robot)
            self.vla("sim", "generate", "--embodiment", robot, "--task", self.sizes.task, "--episodes", episodes,
                     "--out", out, "--workers", s.workers, "--seed", seed, "--image-size", s.image_size,
                     "--randomization", s.randomization,
                     hint=f". If its settings differ only because {out} was generated by an older vla (e.g. "
                          f"servo_model), delete {out} (or pass another --workdir) and run again")  # fmt: skip
            self.vla("data", "stats", out)
        mixture = self.root / "pretrain_mixture.yaml"
        lines = ["format_version: 1", "name: demo_pretrain", "description: the demo's simulated robots",
                 "balance_by_size: false", "datasets:"]  # fmt: skip
        lines += [f"  - {{name: sim_{r}_{self.sizes.task}, weight: 1.0, path: {self.dataset(r).resolve()}, kind: sim}}"
                  for r in PRETRAIN_ROBOTS]  # fmt: skip
        mixture.write_text("\n".join(lines) + "\n")

    # ---- 2. pretraining ------------------------------------------------------------------------------------------
    def common_sets(self, steps: int) -> list[str]:
        s = self.sizes
        sets = {
            "train.steps": steps,
            "train.seed": s.train_seed,
            "train.save_every": max(1, steps // 2),
            "data.batch_size": s.batch_size,
            "data.num_workers": min(2, s.workers),
            "data.val_episodes": 1,
            "train.val_every": max(1, steps // 3),
            "train.val_batches": 2,
            "train.val_at_start": "true",
            "logging.every": max(1, steps // 20),
        }
        return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]

    def pretrain(self) -> None:
        sets = self.common_sets(self.sizes.pretrain_steps)
        self.vla("train", "debug", "--run-dir", self.root / "pretrain",
                 "--set", f"data.mixture={self.root / 'pretrain_mixture.yaml'}",
                 "--set", "optim.warmup_steps=20", "--set", f"model.backbone.image_size={self.sizes.image_size}",
                 *sets)  # fmt: skip

    # ---- 3. fine-tuning --------------------------------------------------------------------------------------
    def finetune(self) -> None:
        fresh = self.root / "fresh_init"
        if not (fresh / "config.json").is_file():
            robots = [a for r in PRETRAIN_ROBOTS for a in ("--embodiment", f"sim_{r}")]
            self.vla("model", "init", "tiny_smolvlm", "--out", fresh, *robots, "--overwrite",
                     "--set", f"backbone.image_size={self.sizes.image_size}")  # fmt: skip
        s = self.sizes
        sets = self.common_sets(s.finetune_steps)
        if s.finetune_lr is not None:
            sets += ["--set", f"optim.lr={s.finetune_lr}"]
        data = ["--set", f"data.datasets=[{self.dataset(NEW_ROBOT).resolve()}]"]
        for name, init in (("pretrained", self.root / "pretrain"), ("fresh", fresh)):
            run = self.root / f"finetune_{name}"
            self.vla("finetune", init, "--embodiment", f"sim_{NEW_ROBOT}", "--run-dir", run,
                     "--preset", s.finetune_preset, *data, *sets, "--set", "optim.warmup_steps=10")  # fmt: skip
            self.vla("export", run, "--merge", "--out", self.root / f"export_{name}", "--overwrite")

    # ---- 4. evaluation ---------------------------------------------------------------------------------------
    def policies(self) -> dict[str, str]:
        return {
            "finetuned_from_pretrained": str(self.root / "export_pretrained"),
            "finetuned_from_fresh": str(self.root / "export_fresh"),
            "expert": "expert",
            "random": "random",
        }

    def evaluate(self) -> None:
        s = self.sizes
        for level in (s.randomization, "reality_proxy"):
            for name, policy in self.policies().items():
                out = self.eval_root / f"{name}_{level}"
                learned = policy not in ("expert", "random")
                execute = s.execute_steps if learned else None
                if (out / "results.json").is_file():
                    _check_kept(out, {"task": s.task, "seed": s.eval_seed, "episodes": s.eval_episodes,
                                      "randomization": level, "execute_steps": execute})  # fmt: skip
                    print(f"  {out}/results.json exists: kept", flush=True)
                    continue
                extra = ["--execute-steps", execute] if execute is not None else []
                self.vla("eval", "sim", policy, "--embodiment", NEW_ROBOT, "--task", self.sizes.task, "--episodes",
                         s.eval_episodes, "--randomization", level, "--workers", s.workers,
                         "--seed", s.eval_seed, *extra,
                         "--image-size", s.image_size, "--video-every", max(1, s.eval_episodes // 2),
                         "--out", out)  # fmt: skip

    # ---- 5. serving ------------------------------------------------------------------------------------------
    def serve(self) -> None:
        out = self.root / "served_episode"
        if (out / "results.json").is_file():
            print(f"  {out}/results.json exists: kept", flush=True)
            return
        cmd = [sys.executable, "-m", "vla.cli", "serve", str(self.root / "export_pretrained"), "--port", "0",
               "--dtype", "float32", "--no-compile"]  # fmt: skip
        print("  $ vla " + " ".join(cmd[3:]), flush=True)
        server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            url = _wait_ready(server)
            s = self.sizes
            self.vla("eval", "sim", "served", "--via-server", url, "--embodiment", NEW_ROBOT, "--task", self.sizes.task,
                     "--episodes", 1, "--seed", s.eval_seed, "--image-size", s.image_size, "--video-every", 1,
                     "--randomization", s.randomization, "--out", out)  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=60)

    # ---- 6. report -------------------------------------------------------------------------------------------
    def report(self) -> None:
        runs = [*sorted(self.eval_root.iterdir()), self.root / "served_episode"]
        self.vla("eval", "report", *runs, "--out", self.root / "report.html")
        card = self.root / "export_pretrained" / "README.md"
        shutil.copyfile(card, self.root / "MODEL_CARD.md")

    def summary(self) -> str:
        """The success table of stage 4 (policy x randomization) from the results files."""
        lines = [
            f"{'policy':<28}" + "".join(f"{lvl:>28}" for lvl in (self.sizes.randomization, "reality_proxy"))
        ]
        for name in self.policies():
            cells = []
            for level in (self.sizes.randomization, "reality_proxy"):
                res = json.loads((self.eval_root / f"{name}_{level}" / "results.json").read_text())
                lo, hi = res["ci95"]
                cells.append(f"{res['successes']}/{res['episodes']} [{lo:.2f}, {hi:.2f}]")
            lines.append(f"{name:<28}" + "".join(f"{c:>28}" for c in cells))
        return "\n".join(lines)

    def run(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        print(f"vla demo in {self.root} ({self.sizes})", flush=True)
        self.stage(1, f"simulated demonstrations: {', '.join(PRETRAIN_ROBOTS)} + unseen {NEW_ROBOT} ({self.sizes.task})",
                   self.generate)  # fmt: skip
        self.stage(2, "cross-embodiment pretraining (vla train)", self.pretrain)
        self.stage(
            3, f"LoRA fine-tuning on {NEW_ROBOT}: from the pretrained and from a fresh model", self.finetune
        )
        self.stage(4, "closed-loop evaluation on the same seeds (vla eval sim)", self.evaluate)
        self.stage(5, "one served episode through the client and broker (vla serve)", self.serve)
        self.stage(6, "report and model card", self.report)
        print("\nsuccess on the unseen robot (successes/episodes, 95 % Wilson interval):")
        print(self.summary())
        print(f"\nreport:     {self.root / 'report.html'}")
        print(f"model card: {self.root / 'MODEL_CARD.md'}")
        print(f"served episode video: {self.root / 'served_episode' / 'videos'}")
        print(f"demo finished in {time.perf_counter() - self.t0:.0f} s")
        return 0


def _wait_ready(server: subprocess.Popen, timeout: float = 300) -> str:
    """The WebSocket URL ``vla serve`` prints when it is ready (its output is echoed meanwhile)."""
    assert server.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"vla serve exited with {server.wait()} before it was ready")
        print("  | " + line.rstrip(), flush=True)
        if m := re.search(r"ready at (ws://\S+)", line):
            return m.group(1)
    raise RuntimeError(f"vla serve was not ready within {timeout:.0f} s")


def run_demo(workdir: str | Path = "runs/demo", *, quick: bool = False) -> int:
    return Demo(workdir, QUICK if quick else DemoSizes()).run()


__all__ = ["QUICK", "Demo", "DemoSizes", "run_demo"]
