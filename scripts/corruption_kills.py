"""Part 2 of ``scripts/corruption_campaign.py``: every writing command SIGKILLed, then re-run.

``vla sim generate``, ``vla data convert`` (LeRobot and RLDS sources), ``vla data merge`` and a checkpoint write
(``vla model init --overwrite`` over an existing checkpoint) each run once uninterrupted (counting how often they
pass each ``vla.faults`` kill point), then are SIGKILLed at seeded kill points (inside a dataset commit, between
checkpoint folder renames, ...) and at seeded random moments, and re-run: the re-run must exit 0 and give the
uninterrupted run's files byte for byte, and a second re-run must change nothing; in between, ``vla data info`` must
say the dataset is incomplete or name the command that finishes it (or call it complete only when its files already
equal the uninterrupted run's: a kill after the last write, which does not count as landed), and a killed checkpoint
write must leave the old or the new checkpoint complete (and the re-run no hidden temporary folder).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import signal
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import corruption_cases as cc
from forked import Run, cli, in_child

import vla.faults
from vla.cli import main as vla_main

DATASET_POINTS = ("lerobot.staged", "lerobot.committed", "lerobot.renaming", "progress.saved")
CKPT_POINTS = ("hub.staged", "hub.swapped")


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def counted(argv: list[str], timeout: float) -> tuple[Run, Counter[str]]:
    """Run ``vla ARGV`` uninterrupted in a child, counting how often it passes each kill point."""
    counts_file = Path(tempfile.mktemp(suffix=".json"))

    def fn() -> int:
        try:
            return vla_main(argv)
        finally:
            counts_file.write_text(json.dumps(dict(vla.faults._passes)))

    run = in_child(fn, timeout, env={vla.faults.KILL_ENV: "count-only:0"})
    counts = Counter(json.loads(counts_file.read_text())) if counts_file.is_file() else Counter()
    counts_file.unlink(missing_ok=True)
    return run, counts


def kill_plan(seed: int, counts: Counter[str], points: tuple[str, ...], named: int, timed: int, duration: float) -> list[tuple[str, Any]]:  # fmt: skip
    """``named`` seeded kill points (``name:n`` among the passes an uninterrupted run makes, never its last
    progress record, which marks it complete) and ``timed`` seeded moments within the run's duration."""
    rng = random.Random(seed)
    choices = [(p, n) for p in points for n in range(1, counts[p] + 1)]
    choices = [f"{p}:{n}" for p, n in choices if not (p == "progress.saved" and n == counts[p])]
    plan: list[tuple[str, Any]] = [("point", c) for c in rng.sample(choices, min(named, len(choices)))]
    return plan + [("time", round(rng.uniform(0.15, 0.9) * duration, 2)) for _ in range(timed)]


def interrupted_state(out: Path, want: dict[str, str], timeout: float) -> str:
    """What ``vla data info`` says of a killed command's dataset: 'incomplete', 'names the command', 'complete'
    (only right when the files already equal the uninterrupted run's ``want``: the kill came after the last
    write), or the problem."""
    if not out.exists():
        return "nothing written yet"
    run = in_child(cli("data", "info", out, "--json"), timeout)
    if run.rc == 0:
        info = json.loads(run.out)
        if info.get("incomplete"):
            return "incomplete: " + str(info["incomplete"])
        if tree(out) == want:
            return "complete: killed after its last write (the files equal the uninterrupted run's)"
        return "SILENT: info says complete, the files differ from the uninterrupted run's"
    if "re-run" in run.err:
        return "error naming the command: " + run.err.strip().splitlines()[-1][:160]
    return "UNCLEAR: " + run.err.strip()[-200:]


def kill_dataset_command(
    label: str, argv: list[str], out: Path, seed: int, timeout: float
) -> list[dict[str, Any]]:
    ref_run, counts = counted(argv, timeout)
    if ref_run.rc != 0:
        raise RuntimeError(f"{label} failed uninterrupted: {ref_run.err[-2000:]}")
    ref = out.with_name(out.name + "-ref")
    shutil.rmtree(ref, ignore_errors=True)
    out.rename(ref)
    want = tree(ref)
    rows = []
    for kind, at in kill_plan(seed, counts, DATASET_POINTS, 3, 2, ref_run.seconds):
        shutil.rmtree(out, ignore_errors=True)
        env = {vla.faults.KILL_ENV: at} if kind == "point" else {}
        killed = in_child(cli(*argv), timeout, env=env, kill_after=at if kind == "time" else None)
        state = (
            interrupted_state(out, want, timeout)
            if killed.signaled == signal.SIGKILL
            else "finished before the kill"
        )
        rerun = in_child(cli(*argv), timeout)
        same = rerun.rc == 0 and out.exists() and tree(out) == want
        again = in_child(cli(*argv), timeout)  # a finished command re-run changes nothing
        landed = killed.signaled == signal.SIGKILL and not state.startswith("complete")
        rows.append({"command": label, "kill": f"{kind} {at}", "killed": landed,
                     "after_kill": state, "rerun_exit": rerun.rc, "matches_uninterrupted": same,
                     "second_rerun_noop": again.rc == 0 and tree(out) == want,
                     "recovered": same and not state.startswith(("SILENT", "UNCLEAR")),
                     "rerun_error": rerun.err.strip()[-300:] if rerun.rc else ""})  # fmt: skip
        print(
            f"  {label:22s} kill {kind} {at!s:22s} -> {state[:60]:60s} rerun {rerun.rc} same={same}",
            flush=True,
        )
    shutil.rmtree(out, ignore_errors=True)
    return rows


def kill_checkpoint_write(work: Path, sim: Path, seed: int, timeout: float) -> list[dict[str, Any]]:
    """``vla model init --seed 1 --overwrite`` over a seed-0 checkpoint, killed and re-run."""
    old, out = work / "ckpt-old", work / "ckpt"
    for path, s in ((old, 0), (work / "ckpt-new", 1)):
        run = in_child(cli(*cc.ckpt_argv(path, sim, s)), timeout)
        if run.rc != 0:
            raise RuntimeError(f"model init failed: {run.err[-2000:]}")
    old_tree, new_tree = tree(old), tree(work / "ckpt-new")
    argv = [*cc.ckpt_argv(out, sim, 1), "--overwrite"]
    shutil.copytree(old, out)
    ref_run, counts = counted(argv, timeout)
    if ref_run.rc != 0 or tree(out) != new_tree:
        raise RuntimeError(
            f"model init --overwrite did not give the fresh seed-1 checkpoint: {ref_run.err[-2000:]}"
        )
    rows = []
    for kind, at in kill_plan(seed, counts, CKPT_POINTS, 2, 3, ref_run.seconds):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(old, out)
        env = {vla.faults.KILL_ENV: at} if kind == "point" else {}
        killed = in_child(cli(*argv), timeout, env=env, kill_after=at if kind == "time" else None)
        now = tree(out) if out.exists() else {}
        state = (
            "old checkpoint"
            if now == old_tree
            else "new checkpoint"
            if now == new_tree
            else "NEITHER old nor new"
        )
        rerun = in_child(cli(*argv), timeout)
        leftovers = sorted(p.name for p in work.iterdir() if p.name.startswith("."))
        same = rerun.rc == 0 and tree(out) == new_tree
        rows.append({"command": "model init --overwrite", "kill": f"{kind} {at}", "killed": killed.signaled == signal.SIGKILL,
                     "after_kill": state, "rerun_exit": rerun.rc, "matches_uninterrupted": same,
                     "hidden_leftovers_after_rerun": leftovers,
                     "recovered": same and not state.startswith("NEITHER") and not leftovers,
                     "rerun_error": rerun.err.strip()[-300:] if rerun.rc else ""})  # fmt: skip
        print(
            f"  {'model init --overwrite':22s} kill {kind} {at!s:22s} -> {state:60s} rerun {rerun.rc} same={same}",
            flush=True,
        )
    return rows


def run_kills(work: Path, clean: dict[str, Path], timeout: float) -> list[dict[str, Any]]:
    k = work / "kills"
    k.mkdir(parents=True, exist_ok=True)
    two = copy_of(clean["video"], k / "second")  # merge needs two sources; a copy of one is a valid second
    jobs = [
        ("sim generate", cc.sim_argv(k / "sim"), k / "sim"),
        ("data convert lerobot", ["data", "convert", str(clean["video"]), str(k / "conv"), "--to", "lerobot", "--vcodec", "h264"], k / "conv"),
        ("data convert rlds", ["data", "convert", str(clean["rlds"]), str(k / "conv_rlds"), "--to", "lerobot", "--vcodec", "h264"], k / "conv_rlds"),
        ("data merge", ["data", "merge", str(clean["video"]), str(two), "--out", str(k / "merged")], k / "merged"),
    ]  # fmt: skip
    rows = []
    for seed, (label, argv, out) in enumerate(jobs):
        rows += kill_dataset_command(label, argv, out, seed, timeout)
    rows += kill_checkpoint_write(k, clean["sim"], len(jobs), timeout)
    return rows


def copy_of(src: Path, dst_parent: Path) -> Path:
    """A fresh copy of ``src`` under ``dst_parent`` keeping the folder names below the clean input's folder."""
    rel = src.relative_to(src.parents[1]) if src.name == "1.0.0" else Path(src.name)  # RLDS: <name>/<version>
    dst = dst_parent / rel
    shutil.rmtree(dst_parent, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst
