"""Shared test fixtures: offline hub, seeded RNG, and the team's genuine RLDS fixture when ``../shared`` exists."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from vla.runtime import realtime, scheduling, undo_realtime

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if (
    "VLA_TINY_CACHE" not in os.environ
):  # tiny backbones are built per test session, never into the user's home
    import tempfile

    os.environ["VLA_TINY_CACHE"] = tempfile.mkdtemp(prefix="vla-tiny-")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"
BRIDGE_FIXTURE = SHARED / "fixtures" / "oxe_bridge_dataset_octo_debug" / "1.0.0"


# The files holding the longest tests, longest first, as measured with `make test`'s two workers on the slowest CI CPU
# seen (a 2-core AVX2-only AMD EPYC): 30-300 s each, against seconds for most files. `make test` hands whole files
# to its workers in collection order (xdist's `--dist loadfile --no-loadscope-reorder`); starting with these keeps a
# long file from being the last one taken while the other worker sits idle. A stale order costs balance only; a
# name that no longer exists is an error (below), so a renamed file is not silently dropped from the front.
LONGEST_FIRST = (
    "test_train.py",
    "test_finetune.py",
    "test_sim_tasks.py",
    "test_transfer.py",
    "test_model.py",
    "test_train_distributed.py",
    "test_cli.py",
    "test_embodiment_draft.py",
    "test_eval_replay.py",
    "test_sim_end_to_end.py",
    "test_eval.py",
    "test_lerobot_format.py",
    "test_sim_generate.py",
    "test_model_training.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the files of ``LONGEST_FIRST`` first, in its order; every other file after them in its usual order."""
    missing = [name for name in LONGEST_FIRST if not (Path(__file__).parent / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}; "
                                "update the list to the files' new names")  # fmt: skip
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # stable: tests keep their order within a file
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# ---- a run that cannot hang after its tests: leaked processes, and what was running at make test's deadline ----
# pytest-timeout ends a hung *test*; nothing ends a process a test leaked. One that outlives its test keeps a pipe
# of CI's open (CI waits for its output to end) or is joined forever at interpreter exit (multiprocessing joins
# non-daemonic children), so the run would hang after its last test. Each pytest process (xdist's workers too) is
# a Linux child subreaper: a leaked process whose parent ended is re-parented here instead of to init, so at the
# session's end every process still below this one is a leak. They are reported (command line, on stderr and in
# the run's status folder) and SIGKILLed. `make test` sets VLA_TEST_STATUS to a folder where each process also
# records the test it is running, which make prints if its deadline (TEST_DEADLINE) ends the run.
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
LEAK_EXEMPT = ("multiprocessing.resource_tracker",)  # lives until its owner exits, by design


_RUNS_TESTS = True  # False in xdist's controller, which only relays its workers' reports


def _status_path() -> Path | None:
    """This pytest process's status file under ``VLA_TEST_STATUS`` (xdist worker id, else ``main``), or None."""
    folder = os.environ.get("VLA_TEST_STATUS")
    return Path(folder) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.txt" if folder else None


def _status_file() -> Path | None:
    """Where this process records its running test: none in xdist's controller (it only relays reports)."""
    return _status_path() if _RUNS_TESTS else None


def _descendants(pid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process below ``pid`` (zombies excluded), from /proc (none without)."""
    children: dict[int, list[int]] = {}
    if not Path("/proc").is_dir():
        return []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            cmd = (
                Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            )
        except OSError:
            continue
        out.append((p, cmd))
    return out


_START_SCHEDULING = (
    scheduling()
)  # this process's scheduling policy and priority at start (tests must leave it so)


def pytest_configure(config: pytest.Config) -> None:
    global _RUNS_TESTS
    _RUNS_TESTS = hasattr(config, "workerinput") or not config.getoption("numprocesses", default=None)
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if (status := _status_file()) is not None:
        status.parent.mkdir(parents=True, exist_ok=True)
        status.write_text(f"{time.strftime('%H:%M:%S')} started {nodeid}\n")


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if (status := _status_file()) is not None:
        status.write_text(f"{time.strftime('%H:%M:%S')} finished {nodeid}, between tests\n")


@pytest.hookimpl(trylast=True)  # under xdist's controller: after it has stopped its workers
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Report and SIGKILL the processes the tests leaked (see above), then reap them."""
    if sys.platform != "linux":
        return
    status = _status_path()  # the controller reports its own leaks too
    leaked = [(p, cmd) for p, cmd in _descendants(os.getpid()) if not any(e in cmd for e in LEAK_EXEMPT)]
    # a process in the middle of exiting (an xdist worker just stopped: an empty command line) is not a leak
    deadline = time.monotonic() + 2
    while leaked and time.monotonic() < deadline and any(not cmd for _, cmd in leaked):
        time.sleep(0.05)
        live = dict(_descendants(os.getpid()))
        leaked = [(p, live[p] or cmd) for p, cmd in leaked if p in live]
    if not leaked:
        return
    lines = [f"  pid {p}: {cmd[:300]}" for p, cmd in leaked]
    text = f"tests leaked {len(leaked)} process(es), killed at the session's end:\n" + "\n".join(lines) + "\n"
    sys.__stderr__.write(text)
    if status is not None:
        with status.with_suffix(".leaks").open("a") as f:
            f.write(text)
    for p, _ in leaked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 5
    for p, _ in leaked:  # reap the ones that became ours (adopted orphans, our own children)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(p, os.WNOHANG)[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
    with contextlib.suppress(ChildProcessError):  # and orphans adopted during the run that ended since
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


@pytest.fixture(autouse=True)
def _not_real_time() -> Iterator[None]:
    """A test must not leave the pytest process real-time (SCHED_FIFO/RR): every process it starts afterwards
    inherits it, and a busy real-time process starves the machine (SVT-AV1 did this as root: a headless Chromium
    then spun at FIFO 99 and held both cores of CI until its deadline; ``vla.runtime.undo_realtime``). Such a test
    fails, and the process is put back to normal scheduling for the next one (unless pytest itself was started
    real-time, e.g. under ``chrt``: then nothing is checked)."""
    yield
    if _START_SCHEDULING is None:
        return
    if not realtime(_START_SCHEDULING[0]) and realtime(os.sched_getscheduler(0)):
        undo_realtime(_START_SCHEDULING)
        pytest.fail(
            "this test left the pytest process real-time (SCHED_FIFO/RR): see vla.runtime.undo_realtime"
        )


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    np.random.seed(0)
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass


@pytest.fixture(autouse=True)
def _fresh_attention_kernels():
    """Each test starts with no CPU bf16 attention kernel measured, pinned or restored (process-wide state in
    ``vla.models.attention``), so no test depends on which tests ran before it; untouched when not imported."""
    yield
    import sys

    attention = sys.modules.get("vla.models.attention")
    if attention is not None:
        attention.reset_cpu_bf16_kernels()


@pytest.fixture
def bridge_fixture() -> Path:
    """Path of the genuine Open X-Embodiment RLDS export (Octo's bridge_dataset debug copy), read-only."""
    if not BRIDGE_FIXTURE.is_dir():
        pytest.skip(
            f"shared RLDS fixture not found at {BRIDGE_FIXTURE} (only present in the team's workspace)"
        )
    return BRIDGE_FIXTURE


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained tiny checkpoint for sim_widowx with stats from 2 generated expert episodes."""
    from vla.cli import main

    root = tmp_path_factory.mktemp("eval_ckpt")
    ds, ckpt = root / "ds", root / "ckpt"
    assert main(["sim", "generate", "--embodiment", "widowx", "--task", "reach", "--episodes", "2",
                 "--image-size", "32", "--out", str(ds)]) == 0  # fmt: skip
    assert main(["data", "stats", str(ds)]) == 0
    assert main(["model", "init", "tiny_smolvlm", "--out", str(ckpt), "--embodiment", "sim_widowx",
                 "--stats-from", str(ds), "--set", "flow.num_steps=2"]) == 0  # fmt: skip
    return ckpt
