"""``ordered_map``: run a function over jobs in worker processes, results in job order, and never hang on a dead one.

It replaces ``multiprocessing.Pool.imap`` in the commands that fan work out to processes (``vla eval sim``,
``vla sim generate``, ``vla data stats``, the episode index). The stdlib pools fail in the ways that matter here:

- ``Pool`` replaces a worker that dies (SIGKILL, the OOM killer, a segfault in a native library) and loses the
  job it held, so ``imap`` waits for that result forever: every process alive, idle, nothing printed.
- ``ProcessPoolExecutor`` notices a death, but one cut off while it sends a large result can leave the reader
  waiting for the rest of the message, and its exit-time join waits on workers it could not stop.

Here each worker has its own pipe and holds at most one job. The parent waits on the pipes and on the processes'
sentinels together (``multiprocessing.connection.wait``), so a death is seen at once: as the end of its pipe
(mid-message included: the parent holds no copy of a worker's end, so the pipe closes with the worker) or as its
sentinel. Either raises :class:`WorkerDied` naming the job, the exit code and what it means. An exception inside
``fn`` is raised here with the worker's traceback attached. However the caller stops (exhausted, an error, Ctrl-C,
``close()`` of the generator), every worker is stopped with bounded waits: asked, then SIGTERM, then SIGKILL.
Workers ignore SIGINT (Ctrl-C reaches them through the caller) and, on Linux, are SIGKILLed when their parent dies.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from vla.faults import kill_point

J = TypeVar("J")
R = TypeVar("R")

STOP_TIMEOUT_S = 2.0  # per stage of stopping a worker: asked to exit, then SIGTERM, then SIGKILL

EXIT_MEANINGS = {
    -signal.SIGKILL: "SIGKILL: killed from outside; most often the kernel's OOM killer (see `dmesg`), or kill -9",
    -signal.SIGSEGV: "SIGSEGV: a crash inside native code (a simulator, codec or BLAS library)",
    -signal.SIGTERM: "SIGTERM: stopped by another process (a scheduler, a container runtime)",
    -signal.SIGABRT: "SIGABRT: a native library aborted (an assertion or a corrupted heap)",
    0: "exit code 0: the worker's process ended normally in the middle of a job (sys.exit or os._exit in it)",
    1: "exit code 1: an uncaught error in the worker process outside the job (its traceback is printed above), "
    "often while it started (importing the main module, the initializer)",
}


class WorkerDied(RuntimeError):
    """A worker process ended while it held a job, or before it could send that job's result."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, attached as ``__cause__`` of the re-raised exception."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running when its pipe closed"
    return EXIT_MEANINGS.get(code, f"exit code {code}")


#: in a worker process, its own end of its pipe (tests cut a reply off through it); None elsewhere
worker_conn: Connection | None = None


def _worker_main(conn: Connection, fn: Callable[[Any], Any], initializer: Callable[..., None] | None,
                 initargs: tuple[Any, ...], kill_name: str | None, parent: int, die_with_parent: bool) -> None:  # fmt: skip
    """A worker's loop: receive ``(index, job)``, send ``(index, ok, result_or_error)``, until ``None`` or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle; it stops us
    if sys.platform == "linux" and die_with_parent:
        import ctypes

        # SIGKILL when the *thread* that started us ends: only set when that was the main thread (it ends with the
        # process); a pool started from another thread relies on the pipe closing instead
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:  # it died before prctl took effect (re-parented to init or a subreaper)
            os._exit(1)
    global worker_conn
    worker_conn = conn
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if msg is None:
            return
        index, job = msg
        if kill_name is not None:
            kill_point(kill_name)
        try:
            reply: tuple[int, bool, Any] = (index, True, fn(job))
        except BaseException as e:  # every failure goes back to the caller
            text = traceback.format_exc()
            if not isinstance(e, Exception):  # SystemExit, KeyboardInterrupt: must not end the caller quietly
                e = RuntimeError(f"the job raised {type(e).__name__}({e}) in its worker process")
            try:
                exc: bytes | None = pickle.dumps(e)
                pickle.loads(exc)  # an exception class whose __init__ takes other arguments fails only here
            except Exception:  # then the caller gets the traceback's text alone
                exc = None
            reply = (index, False, (exc, text))
        try:
            conn.send(reply)
        except Exception as e:  # a result that cannot be pickled
            text = "".join(traceback.format_exception(e))
            conn.send((index, False, (None, f"its result could not be sent back to the caller:\n{text}")))


class _Worker:
    """One process with its own duplex pipe; ``job`` is the index it holds, or None."""

    def __init__(self, ctx: Any, fn: Callable[[Any], Any], initializer: Callable[..., None] | None,
                 initargs: tuple[Any, ...], kill_name: str | None) -> None:  # fmt: skip
        self.conn, child = ctx.Pipe(duplex=True)
        main = threading.current_thread() is threading.main_thread()
        args = (child, fn, initializer, initargs, kill_name, os.getpid(), main)
        self.proc = ctx.Process(target=_worker_main, args=args, daemon=True)
        self.proc.start()
        # Hold no copy of the worker's end: its pipe must close when it dies, mid-message included (a forked sibling
        # started later cannot inherit it either).
        child.close()
        self.job: int | None = None
        self.dead = False  # its death was seen (and reported as its job's outcome)


def _stop(pool: list[_Worker]) -> None:
    """Stop every worker with bounded waits: an idle one is asked to exit (None), a busy one (its result no longer
    wanted) gets SIGTERM; then SIGTERM, then SIGKILL, for any still running. Closes the pipes."""
    for w in pool:
        if not w.proc.is_alive():
            continue
        if w.job is None:
            with contextlib.suppress(OSError, ValueError):  # it may die meanwhile
                w.conn.send(None)
        else:
            w.proc.terminate()
    for action in ("ask", "terminate", "kill"):
        alive = [w.proc for w in pool if w.proc.is_alive()]
        if not alive:
            break
        for proc in alive:
            if action == "terminate":
                proc.terminate()
            elif action == "kill":
                proc.kill()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in alive:  # each reaped when it ends (join), all within one deadline per stage
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for w in pool:
        w.conn.close()


def ordered_map(
    fn: Callable[[J], R],
    jobs: Iterable[J],
    *,
    workers: int,
    start_method: str = "spawn",
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
    describe: Callable[[J], str] | None = None,
    kill_name: str | None = None,
    what: str = "job",
) -> Iterator[R]:
    """``fn(job)`` for every job in ``workers`` processes, yielded in job order (``workers <= 1``: in this process).

    ``fn``, the jobs and the results must be picklable (``fn`` a module-level function). At most ``2 * workers``
    jobs run or wait ahead of the one to yield next, so memory stays bounded when one job is slow. ``describe(job)``
    names a job in a :class:`WorkerDied` message (default: ``what`` and its position). ``kill_name``: the
    :mod:`vla.faults` kill point a worker passes before each job (tests kill workers there).
    """
    jobs = list(jobs)
    if workers <= 1 or len(jobs) <= 1:  # no initializer here: it is for worker processes
        for job in jobs:
            yield fn(job)
        return

    def name(i: int) -> str:
        return describe(jobs[i]) if describe is not None else f"{what} {i}"

    ctx = mp.get_context(start_method)
    started: list[_Worker] = []
    try:
        for _ in range(min(workers, len(jobs))):
            started.append(_Worker(ctx, fn, initializer, initargs, kill_name))
        pool = list(started)  # the live ones
        window = 2 * len(pool)
        done: dict[int, Any] = {}  # finished, not yet yielded: results and _Failed outcomes
        next_job = next_out = 0
        failed = False  # after a failure no job is handed out; the ones before it still come
        while next_out < len(jobs):
            for w in pool:  # hand out jobs within the window
                if not failed and w.job is None and next_job < len(jobs) and next_job < next_out + window:
                    w.job, next_job = next_job, next_job + 1
                    try:
                        w.conn.send((w.job, jobs[w.job]))
                    except OSError:  # it had died while idle
                        done[w.job] = _Failed(died=_death(w))
                        failed = True
            while next_out in done:  # yield what is ready, in order; a yielded result is dropped here
                out = done.pop(next_out)
                if isinstance(out, _Failed):
                    raise out.error(name, next_out, len(jobs), what)
                yield out
                next_out += 1
            pool = [w for w in pool if not w.dead]
            busy = [w for w in pool if w.job is not None]
            if next_out >= len(jobs):
                break
            if not busy:
                if not failed and next_job < len(jobs) and pool:
                    continue  # the window moved on: hand out more
                # cannot happen: every job before a failure is handed out, and a failure is raised in its turn
                raise RuntimeError(f"ordered_map: {name(next_out)} was never handed out")
            ready = set(wait([w.conn for w in busy] + [w.proc.sentinel for w in busy]))
            for w in busy:
                if w.conn in ready or w.proc.sentinel in ready:
                    index, out = _collect(w, name)
                    done[index] = out
                    failed = failed or isinstance(out, _Failed)
    finally:
        _stop(started)


class _Failed:
    """A job's failure, raised when its turn comes: the worker's exception, or its death."""

    def __init__(
        self, exc: BaseException | None = None, died: tuple[int, int | None, int] | None = None
    ) -> None:
        self.exc, self.died = exc, died

    def error(self, name: Callable[[int], str], delivered: int, total: int, what: str) -> BaseException:
        if self.exc is not None:
            return self.exc
        assert self.died is not None
        pid, code, index = self.died
        return WorkerDied(
            f"a worker process (pid {pid}) died while running {name(index)}: {_describe_exit(code)}. "
            f"{delivered} of {total} {what}s had been delivered in order; the rest were not run or were lost. "
            "Fix: free memory (fewer --workers, a smaller image size) or find what killed it, then re-run; "
            "commands that write resume from what they committed."
        )


def _collect(w: _Worker, name: Callable[[int], str]) -> tuple[int, Any]:
    """``(index, outcome)`` of ``w``'s job: its result, or a :class:`_Failed` (its exception, or its death)."""
    index = w.job
    assert index is not None
    try:
        # a reply, or the end of the pipe; a reply sent just before the process ended still counts
        data = w.conn.recv_bytes() if w.conn.poll() else None
    except (EOFError, OSError):  # cut off: it died while sending, or its pipe closed
        data = None
    if data is None:
        return index, _Failed(died=_death(w))
    w.job = None
    where = f"{name(index)} failed in its worker process"
    try:  # only now: an error unpickling the reply is the job's failure, not a death
        _, ok, payload = pickle.loads(data)
        if ok:
            return index, payload
        exc, text = payload
        if exc is None:
            return index, _Failed(RuntimeError(f"{where}:\n{text}"))
        error = pickle.loads(exc)
    except Exception as e:
        return index, _Failed(
            RuntimeError(f"{name(index)}: its worker's reply could not be read here: {e!r}")
        )
    error.__cause__ = RemoteTraceback(f"\n\n{where}:\n{text}")
    return index, _Failed(error)


def _death(w: _Worker) -> tuple[int, int | None, int]:
    """``(pid, exit code, job)`` of ``w``, which ended (or closed its pipe) while it held a job; w leaves the pool."""
    index = w.job
    assert index is not None
    w.dead = True
    w.proc.join(timeout=STOP_TIMEOUT_S)
    code = w.proc.exitcode
    if code is None:  # its pipe closed but it lives on: it can do nothing more for us
        w.proc.kill()
        w.proc.join(timeout=STOP_TIMEOUT_S)
    return w.proc.pid or -1, code, index
