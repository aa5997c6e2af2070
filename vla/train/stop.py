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
  The run removes the file when it stops or ends; a launch that finds one older than itself removes it with a
  warning (else every relaunch would stop after one step), and one created during its start-up is obeyed.

A second SIGTERM more than a few seconds after the first kills the process at once (the previous checkpoint
stays); repeats within them are the same request arriving by several paths (a scheduler signals every process of
the job, and torchrun forwards its own). The handler runs when Python next runs in the main thread: a process
stuck inside one C call (a collective waiting for a dead peer) does not see SIGTERM, and only SIGKILL ends it
(torchrun and SLURM send one after their grace period). Every rank of a run stopped by SIGTERM on any rank exits
143, so a supervisor sees one outcome. Under ``torchrun``, torchrun's own exit status is 1 when it was sent the
SIGTERM itself (its ``SignalException``), whatever the workers did.

The ranks agree once per step (an all-reduce of one flag, after the step's own synchronization), so all of them
stop at the same step, whichever rank got the signal or saw the file; a request that arrives while a scheduled
checkpoint is written stops the run on that checkpoint. The loader's worker processes ignore SIGTERM
(``vla.data.loader._ignore_sigterm``): a scheduler signals every process of the job, and a worker killed by it
would make the training process fail before it could write the checkpoint; the workers end with it. Not covered:
a worker being started (each epoch and validation pass starts new ones) has torch's own handler for a moment, and
a worker stuck in user code outlives the trainer until torch's watchdog notices the parent is gone.

Logged losses are means over the logging window (``logging.every`` steps); the window starts again at a resume or
a stop, so with ``logging.every`` > 1 the first row after one averages fewer steps than an uninterrupted run's
(the weights, optimizer and data order stay exact).
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
#: a SIGTERM this soon after the first is the same request arriving twice (a scheduler signals every process of
#: the job and torchrun forwards its own: milliseconds apart), not a second one asking to die at once
_REPEAT_S = 5.0
#: seconds between two looks for the STOP file (a stat on a shared filesystem costs up to milliseconds)
_FILE_EVERY_S = 1.0
#: a STOP file this much older than the launch is left from before (file times come from a coarse clock, a jiffy
#: behind time.time(), or from another host's)
_CLOCK_SLACK_S = 2.0
#: exit status of a run stopped by SIGTERM after writing its checkpoint (128 + SIGTERM, as if killed by it)
SIGTERM_EXIT = 128 + signal.SIGTERM
_launched_at = time.time()


def mark_launch() -> None:
    """Note when this launch started (``vla.train.trainer.train`` calls it first): a STOP file older than that was
    left from before and is removed; one created during start-up (model build, index, resume: minutes on a
    cluster) stops the run after its first step."""
    global _launched_at
    _launched_at = time.time()


class StopRequests:
    """SIGTERM and the ``STOP`` file of ``run_dir``, agreed on by every rank (``all_true``: ``Runtime.all_true``).

    Use as a context manager around the training loop (it installs the SIGTERM handler in the main thread and
    restores the previous one) and call ``check()`` once per optimizer step on every rank."""

    def __init__(self, run_dir: Path, *, is_main: bool, all_true: Callable[[bool], bool]) -> None:
        self.file = Path(run_dir) / STOP_FILE
        self.is_main, self.all_true = is_main, all_true
        self.signalled = False
        self.first_signal = 0.0
        self.file_seen = False
        self._next_look = 0.0
        self._previous: Any = None

    def __enter__(self) -> StopRequests:
        try:
            stale = self.is_main and self.file.stat().st_mtime < _launched_at - _CLOCK_SLACK_S
        except OSError:  # none (or a shared filesystem's hiccup: an error here must not stop rank 0 alone)
            stale = False
        if stale:
            log.warning(
                "%s: removed a STOP file left from before this launch (it would have stopped the run after its "
                "first step); touch it again to stop this run",
                self.file,
            )
            self._remove()
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            # None: a handler installed from C; the default is the closest to put back
            self._previous = signal.SIG_DFL if previous is None else previous
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _remove(self) -> None:
        try:
            self.file.unlink(missing_ok=True)
        except OSError as e:
            log.warning(
                "%s: cannot remove the STOP file (%s); remove it before the next launch", self.file, e
            )

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.signalled and now - self.first_signal > _REPEAT_S:  # asked again, later: stop now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        if not self.signalled:
            self.signalled, self.first_signal = True, now

    def _file_now(self) -> bool:
        if not self.is_main or self.file_seen:
            return self.file_seen
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + _FILE_EVERY_S
            try:
                self.file_seen = self.file.exists()
            # ESTALE, EIO on a shared filesystem: not a reason to leave the collective below
            except OSError as e:
                log.warning(
                    "%s: cannot look for the STOP file (%s); looking again in %.0f s",
                    self.file,
                    e,
                    _FILE_EVERY_S,
                )
        return self.file_seen

    def check(self) -> str | None:
        """Why the run must stop now (the same answer on every rank), or None. Collective."""
        local = self.signalled or self._file_now()
        if self.all_true(not local):
            return None
        # a second agreement (only when stopping): whether any rank got SIGTERM, so every rank exits alike (143);
        # a rank exiting 0 would look finished to a supervisor, and the job would not be restarted
        if not self.all_true(not self.signalled):
            return "SIGTERM"
        return f"{self.file} exists"

    def done(self) -> None:
        """The run stopped: remove the STOP file (rank 0), so the relaunch trains on."""
        if self.is_main:
            self._remove()
