"""Where the LeRobot 0.6.1 peer venv is (built by ../shared/peer/setup_lerobot_venv.sh), for interop tests."""

from __future__ import annotations

import os
from pathlib import Path


def peer_python() -> Path | None:
    """The peer venv's python (``PEER_VENV``, default ``$TMPDIR/peer-venv``), or None when it is not built."""
    venv = os.environ.get("PEER_VENV") or str(Path(os.environ.get("TMPDIR", "/tmp")) / "peer-venv")
    python = Path(venv) / "bin" / "python"
    return python if python.exists() else None
