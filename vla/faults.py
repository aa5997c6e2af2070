"""A test hook that SIGKILLs the process at a named point of a write, so interrupted-write tests are deterministic.

Writers call :func:`kill_point` at the moments a kill is most damaging (a dataset commit between its manifest and
its renames, a checkpoint between folder renames). With ``VLA_TEST_KILL_AT=<point>:<n>`` in the environment the
process kills itself (``SIGKILL``: no handler, no cleanup, exactly what ``kill -9`` or the OOM killer does) the
n-th time it reaches ``<point>``; otherwise the call costs one dictionary lookup. Points in use:

    lerobot.staged        a dataset episode's files are staged, its commit manifest not yet in place
    lerobot.committed     the manifest is in place (the commit point), no file renamed yet
    lerobot.renaming      the first staged file is renamed into the dataset, the others are not
    progress.saved        a dataset-writing command's progress record was just replaced
    hub.staged            a checkpoint folder is fully written under its hidden temporary name
    hub.swapped           the new checkpoint folder is in place, the old one not yet deleted
    checkpoint.swapped    a training step folder was replaced by its rewrite, the old one not yet deleted
    checkpoint.aside      (no atomic exchange) a step folder being rewritten is renamed aside, the new one not yet in
    sim.worker            a `vla sim generate` worker process is about to simulate an episode (vla.workers)
    eval.worker           a `vla eval sim` worker process is about to run an episode (vla.workers)
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter

KILL_ENV = "VLA_TEST_KILL_AT"
_passes: Counter[str] = Counter()  # calls per point while the variable is set (tests size their kill points)


def kill_point(name: str) -> None:
    """SIGKILL this process if ``VLA_TEST_KILL_AT`` is ``name:n`` and this is the n-th call with ``name``."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    point, _, count = spec.rpartition(":")
    _passes[name] += 1
    if point == name and _passes[name] == int(count):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
