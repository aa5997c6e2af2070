"""Shared test fixtures: offline hub, seeded RNG, and the team's genuine RLDS fixture when ``../shared`` exists."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

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
