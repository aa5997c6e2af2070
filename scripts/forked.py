"""Run a callable in a child forked from this process: stdout/stderr captured in files, an uncaught exception's
traceback printed as the interpreter would, a timeout (the child is killed: a hang) or a deliberate SIGKILL after a
delay. Forking from a process that has already imported vla (and torch) makes each run cost no interpreter
start-up. Used by ``scripts/corruption_campaign.py`` and ``scripts/corruption_kills.py``.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import vla.faults
from vla.cli import main as vla_main


class Run:
    def __init__(self, rc: int | None, out: str, err: str, seconds: float, signaled: int | None = None):
        self.rc, self.out, self.err, self.seconds, self.signaled = rc, out, err, seconds, signaled

    @property
    def hang(self) -> bool:
        return self.rc is None and self.signaled is None


def in_child(fn: Callable[[], int | None], timeout: float, env: dict[str, str] | None = None,
             kill_after: float | None = None) -> Run:  # fmt: skip
    """Run ``fn`` in a forked child with stdout/stderr captured; ``kill_after`` seconds: SIGKILL it then."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                os.environ.update(env or {})
                vla.faults._passes.clear()
                code = int(fn() or 0)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        limit = min(timeout, kill_after) if kill_after is not None else timeout
        status = None
        while time.monotonic() - start < limit:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.01)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = None
        seconds = time.monotonic() - start

        def text(f: Any) -> str:
            f.seek(0)
            return f.read().decode(errors="replace")

        if status is None:  # killed here: on purpose (kill_after) or as hung (timeout)
            killed = signal.SIGKILL if kill_after is not None and kill_after <= timeout else None
            return Run(None, text(out), text(err), seconds, killed)
        if os.WIFSIGNALED(status):
            return Run(None, text(out), text(err), seconds, os.WTERMSIG(status))
        return Run(os.WEXITSTATUS(status), text(out), text(err), seconds)


def cli(*argv: object) -> Callable[[], int]:
    return lambda: vla_main([str(a) for a in argv])
