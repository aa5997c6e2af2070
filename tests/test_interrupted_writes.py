"""SIGKILL at any moment of a writing command, then re-run the same command: the result is the uninterrupted one.

Kills land on named points of the writers (``vla.faults``: inside a dataset commit between its manifest and its
renames, between checkpoint folder renames, ...), chosen by a seeded draw among every point an uninterrupted run
passes, so each kill is reproducible. The killed command runs in a forked child (no interpreter start-up; the kill
is a real SIGKILL: no handler, no cleanup) except ``vla sim generate``, which runs as the real command line.
Until a re-run finishes it, an interrupted dataset is reported incomplete (``info``, ``validate``, the loader),
naming the command that finishes it.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

import vla.faults
from vla.cli import main
from vla.config import DataConfig
from vla.data.inspect import dataset_info
from vla.data.loader import build_loader
from vla.data.readers import DatasetFormatError
from vla.data.readers.lerobot import LeRobotReader
from vla.data.validate import validate_dataset
from vla.data.writers.synthetic import make_lerobot_dataset
from vla.faults import KILL_ENV

REPO = Path(__file__).resolve().parents[1]
#: the points of a dataset write (a kill after the last progress.saved, the one marking it complete, is no
#: interruption)
DATASET_POINTS = ("lerobot.staged", "lerobot.committed", "lerobot.renaming", "progress.saved")


# ---- helpers ------------------------------------------------------------------------------------------------
def passes(fn: Callable[[], object]) -> Counter[str]:
    """Run ``fn`` uninterrupted in this process and count how often it passes each kill point."""
    os.environ[KILL_ENV] = "count-only:0"
    vla.faults._passes.clear()
    try:
        fn()
    finally:
        del os.environ[KILL_ENV]
    return Counter(vla.faults._passes)


def kill_at(fn: Callable[[], object], point: str, patch: Callable[[], None] | None = None) -> None:
    """Run ``fn`` in a forked child that SIGKILLs itself at ``point`` (``name:n``); fail unless it died there."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.environ[KILL_ENV] = point
            vla.faults._passes.clear()
            if patch is not None:
                patch()
            fn()
        except BaseException:
            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
        f"the child was not killed at {point} (exit status {status}): it never got there, or failed first"
    )


def draw_point(seed: int, counts: Counter[str], points: tuple[str, ...] = DATASET_POINTS) -> str:
    """A seeded kill point ``name:n`` among the passes an uninterrupted run made (never the completion itself)."""
    rng = random.Random(seed)
    choices = [(p, n) for p in points for n in range(1, counts[p] + 1)]
    choices = [(p, n) for p, n in choices if not (p == "progress.saved" and n == counts[p])]
    point, n = rng.choice(choices)
    return f"{point}:{n}"


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root``: relative path -> sha256 of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def assert_marked_incomplete(path: Path, command: str) -> None:
    """``info`` and ``validate`` say the dataset is unfinished and name the command that finishes it."""
    try:
        info = dataset_info(path)
    except DatasetFormatError as e:  # killed inside a commit, or before its first episode
        assert f"re-run `{command}" in str(e), e
    else:
        assert info["incomplete"] and info["incomplete"].startswith(command), info
    problems = validate_dataset(path)
    assert any(command in str(p) for p in problems), problems


def small_source(root: Path, seed: int = 0, **kw: object) -> Path:
    """A 3-episode LeRobot dataset with one small h264 camera (seconds to convert or merge)."""
    args: dict = dict(num_episodes=3, episode_length=5, cameras={"front": (16, 24)}, state_dim=3, action_dim=2,
                      fps=10, vcodec="h264", seed=seed)  # fmt: skip
    return make_lerobot_dataset(root, **(args | kw))


def killed_and_resumed(tmp_path: Path, argv: list[str], out: Path, seed: int, command: str) -> None:
    """Run ``vla ARGV`` uninterrupted, then again killed at a seeded point and re-run: the same files."""
    counts = passes(lambda: main(argv))
    ref = out.with_name(out.name + "-ref")
    out.rename(ref)  # the run under test writes to the same path (the progress record names it)
    point = draw_point(seed, counts)
    kill_at(lambda: main(argv), point)
    assert_marked_incomplete(out, command)
    assert main(argv) == 0, f"re-run after a kill at {point}"
    assert tree(out) == tree(ref), f"killed at {point}"
    assert dataset_info(out)["incomplete"] is None and validate_dataset(out) == []
    assert main(argv) == 0 and tree(out) == tree(ref), "re-running a finished command changes nothing"


# ---- vla data convert / merge -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow),
                                  pytest.param(3, marks=pytest.mark.slow)])  # fmt: skip
def test_convert_killed_at_a_random_point_resumes_to_the_same_bytes(tmp_path: Path, seed: int) -> None:
    src = small_source(tmp_path / "src")
    dst = tmp_path / "dst"
    argv = ["data", "convert", str(src), str(dst), "--to", "lerobot", "--vcodec", "h264"]
    killed_and_resumed(tmp_path, argv, dst, seed, "vla data convert")


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow),
                                  pytest.param(3, marks=pytest.mark.slow)])  # fmt: skip
def test_merge_killed_at_a_random_point_resumes_to_the_same_bytes(tmp_path: Path, seed: int) -> None:
    a, b = small_source(tmp_path / "a", seed=1), small_source(tmp_path / "b", seed=2)
    out = tmp_path / "merged"
    argv = ["data", "merge", str(a), str(b), "--out", str(out)]
    killed_and_resumed(tmp_path, argv, out, seed, "vla data merge")


def test_an_interrupted_conversion_is_refused_by_the_loader_and_named_by_info_and_validate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = small_source(
        tmp_path / "src", robot_type="widowx_bridge", state_dim=7, action_dim=7, num_episodes=4
    )
    dst = tmp_path / "dst"
    argv = ["data", "convert", str(src), str(dst), "--to", "lerobot", "--vcodec", "h264"]
    kill_at(lambda: main(argv), "lerobot.staged:3")  # two episodes committed, the third staged
    assert LeRobotReader(dst).num_episodes("train") == 2  # readable: what was written so far
    cfg = {"datasets": (str(dst),), "normalize": False, "batch_size": 2, "image_size": 32, "chunk_length": 2}
    with pytest.raises(ValueError, match=r"is incomplete: `vla data convert .*data\.allow_incomplete=true"):
        build_loader(DataConfig(**cfg))
    batch = next(iter(build_loader(DataConfig(**cfg, allow_incomplete=True))))
    assert batch.state.shape[0] == 2
    capsys.readouterr()
    assert main(["data", "info", str(dst)]) == 0
    assert "INCOMPLETE" in capsys.readouterr().out
    assert main(["data", "validate", str(dst)]) == 1
    out = capsys.readouterr().out
    assert "[incomplete]" in out and f"vla data convert {src}" in out
    # an interrupted dataset is no source: merging or converting it would look complete while missing episodes
    assert main(["data", "merge", str(dst), "--out", str(tmp_path / "m")]) == 2
    assert "re-run it to finish it" in capsys.readouterr().err
    assert main(argv) == 0  # the re-run finishes it
    assert LeRobotReader(dst).num_episodes("train") == 4
    assert next(iter(build_loader(DataConfig(**cfg)))).state.shape[0] == 2


def test_rerun_with_other_settings_is_refused_naming_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = small_source(tmp_path / "src")
    dst = tmp_path / "dst"
    kill_at(lambda: main(["data", "convert", str(src), str(dst), "--to", "lerobot", "--vcodec", "h264"]),
            "lerobot.committed:2")  # fmt: skip
    assert main(["data", "convert", str(src), str(dst), "--to", "lerobot", "--no-video"]) == 2
    err = capsys.readouterr().err
    assert "was being written by `vla data convert" in err and "video: True then, False now" in err


# ---- vla sim generate ---------------------------------------------------------------------------------------
def test_sim_generate_killed_inside_a_commit_resumes_to_the_same_bytes(tmp_path: Path) -> None:
    """The real command line, SIGKILLed between the renames of a commit: every reader names the command that
    finishes it, and re-running that command recovers the commit first (before it reads what is done)."""
    out = tmp_path / "sim"
    argv = ["sim", "generate", "--embodiment", "panda", "--task", "reach", "--episodes", "3", "--out", str(out),
            "--image-size", "32", "--vcodec", "h264", "--max-steps", "30"]  # fmt: skip
    counts = passes(lambda: main(argv))
    ref = tmp_path / "sim-ref"
    out.rename(ref)
    point = draw_point(0, counts, ("lerobot.renaming",))
    env = dict(os.environ, **{KILL_ENV: point, "PYTHONPATH": str(REPO)})
    proc = subprocess.run([sys.executable, "-m", "vla.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    with pytest.raises(DatasetFormatError, match=r"interrupted while committing.*re-run `vla sim generate"):
        LeRobotReader(out)
    assert_marked_incomplete(out, "vla sim generate")
    assert main(argv) == 0
    assert tree(out) == tree(ref), f"killed at {point}"


# ---- checkpoints --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_models():
    import copy

    import torch

    from vla.models.testing import tiny_model

    old = tiny_model("smolvlm", seed=0)
    new = copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(1.0)
    return old, new


def _no_swap() -> None:
    """In the killed child: a filesystem without atomic exchange (the rename-aside fallback)."""
    import vla.models.hub

    vla.models.hub.swap_folders = lambda a, b: False


@pytest.mark.parametrize(
    ("point", "swap"),
    [("hub.staged:1", True), ("hub.swapped:1", True), ("hub.swapped:1", False)],
    ids=["before-publish", "after-swap", "after-renames-without-exchange"],
)
def test_save_pretrained_killed_leaves_the_old_or_new_checkpoint_and_the_next_save_cleans_up(
    tmp_path: Path, two_models, point: str, swap: bool
) -> None:
    from safetensors.torch import load_file

    from vla.models.hub import from_pretrained, save_pretrained

    old, new = two_models
    out = tmp_path / "ckpt"
    save_pretrained(old, out)
    want_old = load_file(str(out / "model.safetensors"))
    kill_at(lambda: save_pretrained(new, out), point, None if swap else _no_swap)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.")]
    assert leftovers, "a killed save leaves its hidden folder (the test must kill mid-write)"
    got = load_file(str(out / "model.safetensors"))
    expect_new = point.startswith("hub.swapped")
    ref = {k: v for k, v in new.state_dict().items() if k in got} if expect_new else want_old
    assert got.keys() == ref.keys() and all(got[k].equal(ref[k]) for k in got), "a complete old or new model"
    from_pretrained(out)  # every file of the checkpoint is there
    save_pretrained(old, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "the next write removes the leftovers"


def test_save_pretrained_killed_between_fallback_renames_restores_the_old_checkpoint(
    tmp_path: Path, two_models
) -> None:
    """Without an atomic exchange, a kill between renaming the old folder aside and the new one in leaves no
    checkpoint at the destination for a moment; the next write renames the old one back before anything else."""
    import vla.models.hub as hub

    old, new = two_models
    out = tmp_path / "ckpt"
    hub.save_pretrained(old, out)
    before = tree(out)

    def aside_then_die() -> None:
        hub.swap_folders = lambda a, b: False
        real = hub.os.replace

        def replace(src: object, dst: object) -> None:
            real(src, dst)
            if ".old-" in str(dst):
                os.kill(os.getpid(), signal.SIGKILL)

        hub.os.replace = replace  # type: ignore[assignment]

    kill_at(lambda: hub.save_pretrained(new, out), "none:0", aside_then_die)
    assert not out.exists()
    hub._restore_aside(out)
    assert tree(out) == before


def test_training_step_rewrite_killed_leaves_a_complete_step(tmp_path: Path) -> None:
    """Re-publishing an existing step (a resumed run that re-reaches it), killed anywhere: after the start-up
    clean-up the step is complete (old or new), never gone."""
    from vla.models.run_dir import complete_steps
    from vla.train import checkpoint as ckpt

    def step_folders(tag: str) -> None:
        final = tmp_path / "checkpoints" / "step-0000004"
        final.mkdir(parents=True, exist_ok=True)
        if not (final / "COMPLETE").exists():
            (final / "weights").write_text("old")
            (final / "COMPLETE").write_text("{}")
        tmp = ckpt.partial_dir(tmp_path, 4)
        tmp.mkdir()
        (tmp / "weights").write_text(tag)

    for point, patch in [("checkpoint.swapped:1", None), ("checkpoint.aside:1", _no_swap_in_checkpoint)]:
        step_folders("new")
        kill_at(lambda: ckpt.publish(tmp_path, 4), point, patch)
        ckpt.clean_partials(tmp_path)
        assert [p.name for p in complete_steps(tmp_path)] == ["step-0000004"], point
        assert (tmp_path / "checkpoints" / "step-0000004" / "weights").read_text() in ("old", "new")
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000004"], point


def _no_swap_in_checkpoint() -> None:
    import vla.train.checkpoint

    vla.train.checkpoint.swap_folders = lambda a, b: False


# ---- kills at random moments (not only at the named points) ---------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("command", ["sim generate", "data convert", "data merge"])
def test_repeated_kills_at_random_moments_then_a_rerun_give_the_uninterrupted_dataset(
    tmp_path: Path, command: str
) -> None:
    """The real command line SIGKILLed after seeded random delays, several times in a row (whatever it was doing:
    simulating, encoding, staging, committing), then run to the end: the uninterrupted run's files."""
    out = tmp_path / "out"
    if command == "sim generate":
        argv = ["sim", "generate", "--embodiment", "panda", "--task", "reach", "--episodes", "4", "--out", str(out),
                "--image-size", "32", "--vcodec", "h264"]  # fmt: skip
    else:
        a = small_source(tmp_path / "a", seed=1, num_episodes=6)
        b = small_source(tmp_path / "b", seed=2, num_episodes=6)
        argv = (["data", "convert", str(a), str(out), "--to", "lerobot", "--vcodec", "h264"]
                if command == "data convert" else ["data", "merge", str(a), str(b), "--out", str(out)])  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cli = [sys.executable, "-m", "vla.cli", *argv]
    start = time.monotonic()
    subprocess.run(cli, env=env, cwd=REPO, check=True, capture_output=True, timeout=600)
    duration = time.monotonic() - start  # of a whole run, start-up included: kills land anywhere in it
    ref = tmp_path / "ref"
    out.rename(ref)
    rng = random.Random(0)
    kills, latest = 0, 1.0
    for _ in range(10):
        proc = subprocess.Popen(cli, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=rng.uniform(0.2, latest) * duration)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            kills += 1
            if kills == 3:
                break
            continue
        if kills:  # finished after earlier kills: the re-run below has nothing left to do
            break
        shutil.rmtree(out)  # finished before any kill (this run was faster than the timed one): kill sooner
        latest *= 0.7
    assert kills, "every run finished before its kill"
    assert main(argv) == 0  # finishes the dataset (nothing to do when a run above finished it)
    assert tree(out) == tree(ref)


@pytest.mark.slow
def test_sim_generate_workers_die_with_a_killed_run(tmp_path: Path) -> None:
    """SIGKILL of a ``--workers 2`` run: no worker goes on simulating episodes nobody will write."""
    token = f"vla-test-{os.getpid()}-{random.random()}"
    argv = ["sim", "generate", "--embodiment", "panda", "--task", "reach", "--episodes", "4", "--out",
            str(tmp_path / "sim"), "--image-size", "32", "--vcodec", "h264", "--workers", "2"]  # fmt: skip
    env = dict(
        os.environ, **{KILL_ENV: "lerobot.committed:1", "PYTHONPATH": str(REPO), "VLA_TEST_TOKEN": token}
    )
    log = tmp_path / "log"
    with log.open("w") as out:  # a file, not a pipe: waiting for a pipe's EOF would wait for the workers too
        proc = subprocess.run([sys.executable, "-m", "vla.cli", *argv], env=env, stdout=out, stderr=out,
                              timeout=300, cwd=REPO)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-2000:]

    def survivors() -> list[str]:
        found = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if token.encode() in environ.read_bytes():
                    found.append(environ.parent.name)
            except OSError:  # exited meanwhile, or not ours to read
                pass
        return found

    deadline = time.monotonic() + 1.5  # dying with the run is immediate; finishing queued episodes is not
    while survivors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not survivors(), "pool workers outlived the killed run"


@pytest.mark.parametrize("command", ["convert", "merge"])
def test_a_kill_before_the_first_progress_record_leaves_a_destination_the_rerun_takes(
    tmp_path: Path, command: str
) -> None:
    """Killed while writing its very first progress record, a command leaves only that record's temporary file:
    the re-run starts afresh instead of refusing a non-empty folder."""
    src = small_source(tmp_path / "src")
    out = tmp_path / "out"
    (out / "meta").mkdir(parents=True)
    (out / "meta" / ".vla_progress.json.tmp").write_text('{"comm')
    argv = (["data", "convert", str(src), str(out), "--to", "lerobot", "--vcodec", "h264"] if command == "convert"
            else ["data", "merge", str(src), "--out", str(out)])  # fmt: skip
    assert main(argv) == 0
    assert LeRobotReader(out).num_episodes("train") == 3 and LeRobotReader(out).incomplete is None
