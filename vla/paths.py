"""Where the project's data-only files live (``configs/``, ``data_mixtures/``).

The framework is used from a clone (``pip install -e .``), so these are the top-level folders of the checkout;
``VLA_CONFIG_DIR`` / ``VLA_MIXTURE_DIR`` point elsewhere (e.g. a cluster-wide copy).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def config_dir() -> Path:
    return Path(os.environ.get("VLA_CONFIG_DIR", REPO_ROOT / "configs"))


def mixture_dir() -> Path:
    return Path(os.environ.get("VLA_MIXTURE_DIR", REPO_ROOT / "data_mixtures"))
