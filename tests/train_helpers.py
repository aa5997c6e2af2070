"""Small datasets and run helpers shared by the training tests (tiny model, a few steps, seconds on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from vla.data.stats import write_stats
from vla.data.writers.synthetic import make_lerobot_dataset

REPO = Path(__file__).resolve().parents[1]


def tiny_dataset(root: Path, name: str = "wx", *, robot_type: str = "widowx_bridge", seed: int = 0) -> Path:
    """A 4-episode LeRobot v3 dataset (one 48x64 camera, 7-d state/action) with its stats written."""
    path = make_lerobot_dataset(
        root / name,
        num_episodes=4,
        episode_length=[24, 30, 20, 26],
        cameras={"primary": (48, 64)},
        state_dim=7,
        action_dim=7,
        fps=5,
        robot_type=robot_type,
        seed=seed,
    )
    write_stats(path)
    return path


def mixture_file(root: Path, datasets: list[Path]) -> Path:
    """A two-dataset mixture YAML (paths given explicitly, weights 1 and 2)."""
    lines = [
        "format_version: 1",
        "name: test_mix",
        "balance_by_size: false",
        "datasets:",
    ]
    for i, d in enumerate(datasets):
        lines.append(f"  - {{name: {d.name}, weight: {i + 1}.0, path: {d}}}")
    path = root / "test_mix.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(REPO))
    return env


def run_cli(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vla.cli", *args],
        capture_output=True,
        text=True,
        env=env or cli_env(),
        timeout=timeout,
        cwd=REPO,
    )


def kill_inside_checkpoint(
    args: list[str], run_dir: Path, step: int, *, timeout: float = 240, while_stalled: Any = None
) -> None:
    """Start ``vla train``, let it stall while publishing ``step``'s checkpoint (test hook), call ``while_stalled()``
    (if given) and SIGKILL it there."""
    env = cli_env()
    env.update(VLA_TEST_CHECKPOINT_STALL="120", VLA_TEST_CHECKPOINT_STALL_STEP=str(step))
    log = run_dir.parent / f"{run_dir.name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vla.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )
        deadline = time.monotonic() + timeout
        try:
            while "stalling" not in log.read_text():
                if proc.poll() is not None:
                    raise AssertionError(
                        f"training exited ({proc.returncode}) before the stall:\n{log.read_text()}"
                    )
                if time.monotonic() > deadline:
                    raise AssertionError(f"no checkpoint stall within {timeout} s:\n{log.read_text()}")
                time.sleep(0.2)
            if while_stalled is not None:
                while_stalled()
        finally:
            proc.kill()
            proc.wait()


def weights(step_dir: Path) -> dict:
    return load_file(str(step_dir / "model.safetensors"))


def _metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def metrics(run_dir: Path) -> list[dict]:
    """The logged training steps of a run (``metrics.jsonl`` rows with a loss)."""
    return [r for r in _metrics_rows(run_dir) if "loss" in r]


def events(run_dir: Path, name: str) -> list[dict]:
    """The run's ``name`` events (``validation``, ``compile``, ...) from ``metrics.jsonl``, in order."""
    return [r for r in _metrics_rows(run_dir) if r.get("event") == name]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(args: list[str], *, nproc: int = 2, env: dict[str, str] | None = None, timeout: float = 300):
    """``torchrun --nproc-per-node nproc -m vla.cli ARGS`` on a free port (gloo on CPU)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "vla.cli",
        *args,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, env=env or cli_env(), timeout=timeout, cwd=REPO
    )


def count_attention_kernels(monkeypatch) -> dict[str, int]:
    """Count, per kernel, the attention calls made from now on (``vla.models.attention.attend`` wrapped for the
    test); the returned dict fills as the model runs."""
    from vla.models import attention

    calls = dict.fromkeys(attention.KERNELS, 0)
    real = attention.attend

    def counting(kernel: str, *args: object, **kwargs: object):
        calls[kernel] += 1
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(attention, "attend", counting)
    return calls
