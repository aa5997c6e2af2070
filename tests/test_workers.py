"""``vla.workers.ordered_map``: results in job order, a worker's exception raised with its traceback, and a dead
worker an error naming its job, never a hang: killed while idle-free or busy, cut off in the middle of sending its
result (the case that left ``ProcessPoolExecutor`` reading forever), with one or two workers, forked or spawned.
Stopping is bounded (closing early, the parent dying) and the commands that use it fail cleanly when a worker dies.

Every test here has a short timeout: on a pool that loses a dead worker's job, each of them would hang instead.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vla.faults import KILL_ENV
from vla.workers import WorkerDied, ordered_map

pytestmark = pytest.mark.timeout(120)
METHODS = ["spawn", "fork"]


def _square(x: int) -> int:
    time.sleep(0.01 * (x % 3))  # finish out of order
    return x * x


def _fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError(f"bad job {x}")
    return x


class _OddError(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickles but cannot be rebuilt from its args
        super().__init__(f"{a}/{b}")


def _odd_error(x: int) -> int:
    if x == 1:
        raise _OddError(1, 2)
    return x


def _exits(x: int) -> int:
    if x == 1:
        sys.exit(0)
    return x


class _BadOnLoad:
    """Pickles fine, fails to unpickle (with an OSError, which must not pass for a dead worker)."""

    def __reduce__(self):
        return (_raise_missing, ())


def _raise_missing() -> None:
    raise FileNotFoundError("no such file: gone.bin")


def _awkward_result(x: int) -> object:
    if x == 1:
        return lambda: None  # cannot be pickled
    if x == 2:
        return _BadOnLoad()
    return x


def _sigkill_on_two(x: int) -> int:
    if x == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def _cut_off_mid_message(x: int) -> int:
    """Job 1 writes the start of a 100 MB reply on its pipe, then dies: the caller has a message header and a
    few bytes, and the rest never comes."""
    if x == 1:
        import vla.workers

        assert vla.workers.worker_conn is not None  # in a worker process
        os.write(vla.workers.worker_conn.fileno(), struct.pack("!i", 100_000_000) + b"x" * 4096)
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def _pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _gone(pid: int) -> bool:
    """No process ``pid`` any more (or only its zombie, which its parent has not reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


@pytest.mark.parametrize("method", METHODS)
def test_results_come_in_job_order(method: str) -> None:
    out = list(ordered_map(_square, range(25), workers=2, start_method=method))
    assert out == [x * x for x in range(25)]
    assert list(ordered_map(_square, range(5), workers=1)) == [0, 1, 4, 9, 16]  # in process


@pytest.mark.parametrize("method", METHODS)
def test_a_workers_exception_is_raised_with_its_traceback(method: str) -> None:
    got = []
    with pytest.raises(ValueError, match="bad job 3") as info:
        for r in ordered_map(_fail_on_three, range(8), workers=2, start_method=method):
            got.append(r)
    assert got == [0, 1, 2]  # everything before the failing job, in order
    cause = str(info.value.__cause__)
    assert "job 3 failed in its worker process" in cause and "_fail_on_three" in cause
    # an exception that cannot be rebuilt here arrives as its traceback's text
    with pytest.raises(RuntimeError, match=r"(?s)job 1 failed in its worker process.*_OddError: 1/2"):
        list(ordered_map(_odd_error, range(4), workers=2, start_method=method))


def test_sys_exit_or_an_unreadable_result_fails_the_job_not_the_caller() -> None:
    """``sys.exit(0)`` in a job must not end the caller with status 0 and episodes missing; a result that cannot
    be pickled, or not unpickled, fails its job by name (an OSError while reading it is not a worker death)."""
    with pytest.raises(RuntimeError, match=r"the job raised SystemExit\(0\) in its worker") as info:
        list(ordered_map(_exits, range(3), workers=2))
    assert "job 1 failed in its worker process" in str(info.value.__cause__)
    with pytest.raises(RuntimeError, match=r"(?s)job 1 failed in its worker process.*could not be sent back"):
        list(ordered_map(_awkward_result, [0, 1], workers=2))
    with pytest.raises(RuntimeError, match=r"job 2: its worker's reply could not be read here.*gone.bin"):
        list(ordered_map(_awkward_result, [0, 2], workers=2, describe="job {}".format))


def test_a_pool_started_from_another_thread_outlives_that_thread() -> None:
    """PR_SET_PDEATHSIG fires when the *thread* that started a worker ends: a generator started in a short-lived
    thread and consumed in this one must keep its workers."""
    import threading

    it = ordered_map(_square, range(8), workers=2)
    first: list[int] = []
    t = threading.Thread(target=lambda: first.append(next(it)))
    t.start()
    t.join()
    assert first + list(it) == [x * x for x in range(8)]


@pytest.mark.parametrize("method", METHODS)
def test_a_killed_worker_is_an_error_naming_its_job(method: str) -> None:
    got = []
    with pytest.raises(
        WorkerDied, match=r"died while running item 2: SIGKILL.*2 of 6 items had been delivered"
    ):
        for r in ordered_map(_sigkill_on_two, range(6), workers=2, start_method=method, what="item"):
            got.append(r)
    assert got == [0, 1]
    describe = "episode {}".format
    with pytest.raises(WorkerDied, match="died while running episode 2"):
        list(ordered_map(_sigkill_on_two, range(4), workers=2, start_method=method, describe=describe))


@pytest.mark.parametrize("jobs", [[1, 0], [0, 1, 2, 3]], ids=["other-worker-idle", "other-worker-busy"])
@pytest.mark.parametrize("method", METHODS)
def test_a_worker_cut_off_while_sending_is_an_error_not_a_hang(method: str, jobs: list[int]) -> None:
    """A reply's header and first bytes arrive, then the worker dies. The other worker (forked after it, under
    fork) must hold no copy of its pipe, or the pipe would never close and the read would wait forever."""
    with pytest.raises(WorkerDied, match="died while running value 1: SIGKILL"):
        list(
            ordered_map(
                _cut_off_mid_message, jobs, workers=2, start_method=method, describe="value {}".format
            )
        )


def test_closing_early_stops_every_worker_and_they_ignore_ctrl_c() -> None:
    it = ordered_map(_pid_after, [0.2, 0.2, 0.2, 30.0, 30.0], workers=2)
    pids = {next(it), next(it)}
    assert len(pids) == 2
    for pid in pids:  # Ctrl-C goes to the whole foreground process group: the workers leave it to the caller
        os.kill(pid, signal.SIGINT)
    assert next(it) in pids  # still working
    t0 = time.perf_counter()
    it.close()  # two 30 s jobs are running: asked, then SIGTERM
    assert time.perf_counter() - t0 < 10
    assert all(_gone(pid) for pid in pids)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_their_parent(tmp_path: Path) -> None:
    """A caller SIGKILLed (no cleanup at all) takes its workers with it: none goes on working for nobody."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_workers import _pid_after
        from vla.workers import ordered_map
        if __name__ == "__main__":
            for pid in ordered_map(_pid_after, [0.0, 0.0, 60.0, 60.0], workers=2):
                print(pid, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = {int(proc.stdout.readline()), int(proc.stdout.readline())}
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), pids


def test_eval_with_a_killed_worker_fails_naming_the_episode(tmp_path: Path, monkeypatch) -> None:
    from vla.eval.rollout import RESULTS_FILE, EvalConfig, evaluate

    monkeypatch.setenv(KILL_ENV, "eval.worker:2")  # each spawned worker dies at its second episode
    cfg = EvalConfig(policy="random", embodiment="widowx", task="reach", episodes=4, image_size=32, max_steps=6,
                     seed=5, workers=2, out=str(tmp_path / "run"))  # fmt: skip
    with pytest.raises(WorkerDied, match=r"died while running episode [23]: SIGKILL"):
        evaluate(cfg, progress_bar=False)
    assert not (tmp_path / "run" / RESULTS_FILE).exists()  # no results from a run that lost episodes


def test_sim_generate_with_killed_workers_keeps_what_it_wrote_and_resumes(
    tmp_path: Path, monkeypatch
) -> None:
    from vla.data.readers import open_dataset
    from vla.data.writers.progress import read_progress
    from vla.sim.generate import GenerateConfig, generate

    cfg = GenerateConfig(embodiment="panda", task="reach", episodes=4, out=str(tmp_path / "ds"), image_size=32,
                         vcodec="h264", workers=2)  # fmt: skip
    monkeypatch.setenv(KILL_ENV, "sim.worker:2")
    with pytest.raises(WorkerDied, match=r"died while running episode [23]"):
        generate(cfg, progress_bar=False)
    monkeypatch.delenv(KILL_ENV)
    reader = open_dataset(tmp_path / "ds")
    assert reader.num_episodes("train") == 2  # the two finished episodes, committed and readable
    progress = read_progress(tmp_path / "ds")
    assert progress is not None and not progress.complete  # reported incomplete until a re-run finishes it
    counts = generate(cfg, progress_bar=False)
    assert counts["written"] == 2 and counts["skipped"] == 2
    reader = open_dataset(tmp_path / "ds")
    sims = sorted(int(reader.episode_metadata("train", e)["sim_index"]) for e in range(4))
    assert sims == [0, 1, 2, 3] and read_progress(tmp_path / "ds").complete
