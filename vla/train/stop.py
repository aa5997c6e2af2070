"""Stopping a training run early without losing its steps.

A scheduler ends jobs with SIGTERM (SLURM at the time limit or on preemption and ``scancel``, Kubernetes on
eviction, ``torchrun`` passing its own SIGTERM on), then kills them some seconds later (SLURM's ``KillWait``,
30 s by default; Kubernetes' grace period; torchrun's 30 s). Two ways to ask a run to stop:

* **SIGTERM** to a training process. Every rank finishes the optimizer step in progress, then they write a
  checkpoint at that step together and exit with 143 (terminated), so a supervisor restarts the job and the
  relaunch resumes from that step. Whether the write fits before the kill depends on the model and the disk: a
  kill inside it still leaves the previous checkpoint (the writes are atomic).
* **A ``STOP`` file in the run folder** (``touch RUN/STOP``): the same at the next step boundary, exit 0. Made
  for schedulers that can signal a job ahead of its end: ``scripts/slurm/pretrain.sbatch`` asks SLURM for a
  signal ten minutes before the time limit, creates the file, and requeues the job once the run has stopped.
  The run removes the file when it stops; a launch that finds one left from before removes it with a warning
  (else every relaunch would stop after one step).

The ranks agree once per step (an all-reduce of one flag, after the step's own synchronization), so all of them
stop at the same step, whichever rank got the signal or saw the file. The loader's worker processes ignore
SIGTERM (``vla.data.loader._ignore_sigterm``): a scheduler signals every process of the job, and a worker killed by it would make
the training process fail before it could write the checkpoint; the workers end with it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STOP_FILE = "STOP"
#: seconds between two looks for the STOP file (a stat on a shared filesystem costs up to milliseconds)
_FILE_EVERY_S = 1.0
#: exit status of a run stopped by SIGTERM after writing its checkpoint (128 + SIGTERM, as if killed by it)
SIGTERM_EXIT = 128 + signal.SIGTERM


class StopRequests:
    """SIGTERM and the ``STOP`` file of ``run_dir``, agreed on by every rank (``all_true``: ``Runtime.all_true``).

    Use as a context manager around the training loop (it installs the SIGTERM handler in the main thread and
    restores the previous one) and call ``check()`` once per optimizer step on every rank."""

    def __init__(self, run_dir: Path, *, is_main: bool, all_true: Callable[[bool], bool]) -> None:
        self.file = Path(run_dir) / STOP_FILE
        self.is_main, self.all_true = is_main, all_true
        self.signalled = False
        self.file_seen = False
        self._next_look = 0.0
        self._previous: Any = None

    def __enter__(self) -> StopRequests:
        if self.is_main and self.file.exists():
            log.warning(
                "%s: removed a STOP file left from before this launch (it would have stopped the run after its "
                "first step); touch it again to stop this run",
                self.file,
            )
            self.file.unlink(missing_ok=True)
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.signalled:  # a second SIGTERM: stop now, as without the handler
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        self.signalled = True

    def _file_now(self) -> bool:
        if not self.is_main or self.file_seen:
            return self.file_seen
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + _FILE_EVERY_S
            self.file_seen = self.file.exists()
        return self.file_seen

    def check(self) -> str | None:
        """Why the run must stop now (the same answer on every rank), or None. Collective."""
        local = self.signalled or self._file_now()
        if self.all_true(not local):
            return None
        if self.signalled:
            return "SIGTERM"
        if self.file_seen:
            return f"{self.file} exists"
        return "another rank was asked to stop"

    def done(self) -> None:
        """The run stopped: remove the STOP file (rank 0), so the relaunch trains on."""
        if self.is_main:
            self.file.unlink(missing_ok=True)
