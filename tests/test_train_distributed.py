"""`vla train` on 2 processes (torchrun, gloo, CPU): DDP computes the same steps as 1 process at the same global
batch; FSDP2 shards, saves a consolidated model and a reshardable train state that 1 process resumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import events, metrics, run_cli, tiny_dataset, torchrun, weights

from vla.models.run_dir import latest_complete

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def wx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_dataset(tmp_path_factory.mktemp("data"))


def _sets(ds: Path, *extra: str, steps: int = 3) -> list[str]:
    over = [
        f"data.datasets=[{ds}]",
        f"train.steps={steps}",
        f"train.save_every={steps}",
        "logging.every=1",
        "logging.progress=false",
        "optim.warmup_steps=1",
        *extra,
    ]
    return [x for a in over for x in ("--set", a)]


def _per_rank(args: list[str], world: int = 2) -> list[Any]:
    """``vla.cli ARGS`` started once per rank, as a per-rank launcher (``srun`` with a task per GPU, MPI) starts
    them: no torchrun agent between them, so each process's own exit status is seen."""
    import subprocess
    import sys

    from train_helpers import REPO, cli_env, free_port

    env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    cmd = [sys.executable, "-m", "vla.cli", *args]
    return [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env={**cli_env(), **env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(world)
    ]


def _every_rank_refuses(args: list[str], said: list[str]) -> None:
    """Run ``vla.cli ARGS`` per rank (``_per_rank``); every rank must exit 2 with its line of ``said``, within a
    timeout that a rank left waiting in a collective would exceed."""
    procs = _per_rank(args, world=len(said))
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 2 and said[rank] in out, (rank, out[-3000:])


@pytest.fixture(scope="module")
def one_process(wx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: 3 steps of batch 4 in one process."""
    run = tmp_path_factory.mktemp("one") / "run"
    r = run_cli(["train", "debug", "--run-dir", str(run), *_sets(wx, "data.batch_size=4")])
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def _same_steps(reference: Path, run: Path) -> None:
    """Same losses at every step and the same final weights (up to float reduction order)."""
    rows1, rows2 = metrics(reference), metrics(run)
    assert [r["step"] for r in rows2] == [1, 2, 3]  # rank 0 logs alone
    for a, b in zip(rows1, rows2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert b["loss/widowx_bridge"] == pytest.approx(a["loss/widowx_bridge"], rel=1e-5, abs=1e-6)
    w1, w2 = weights(latest_complete(reference)), weights(latest_complete(run))
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-6, msg=k)


def test_ddp_two_processes_equal_one_process_at_the_same_global_batch(
    wx: Path, one_process: Path, tmp_path: Path
) -> None:
    two = torchrun(["train", "debug", "--run-dir", str(tmp_path / "two"), *_sets(wx, "data.batch_size=2")])
    assert two.returncode == 0, two.stderr[-3000:]
    _same_steps(one_process, tmp_path / "two")
    ts = latest_complete(tmp_path / "two") / "train_state"
    assert (ts / "rank0.json").is_file() and (ts / "rank1.json").is_file()  # every rank's loader position
    assert (ts / "rng0.pt").is_file() and (ts / "rng1.pt").is_file()
    assert (ts / "attention0.json").is_file() and (ts / "attention1.json").is_file()  # each rank's kernels


@pytest.mark.parametrize("preset", ["ddp", "fsdp2"])
def test_accelerate_launch_with_the_presets(preset: str, wx: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from train_helpers import REPO, cli_env, free_port

    run = tmp_path / "acc"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / f"configs/accelerate/{preset}.yaml"),
        "--num_processes", "2", "--main_process_port", str(free_port()),
        "-m", "vla.cli", "train", "debug", "--run-dir", str(run), *_sets(wx, "data.batch_size=2", steps=2),
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    start = events(run, "start")[0]
    assert start["processes"] == 2 and start["strategy"] == preset and start["global_batch"] == 4
    assert latest_complete(run).name == "step-0000002"


def test_fsdp2_two_processes_save_and_one_process_resumes(
    wx: Path, one_process: Path, tmp_path: Path
) -> None:
    """FSDP2 on 2 processes computes the reference steps, writes a consolidated model.safetensors that
    from_pretrained loads, and a sharded train state that 1 process (another world size) resumes and continues."""
    from vla.models.hub import from_pretrained

    run = tmp_path / "fsdp"
    fsdp = ["data.batch_size=2", "distributed.strategy=fsdp2"]
    r = torchrun(["train", "debug", "--run-dir", str(run), *_sets(wx, *fsdp)])
    assert r.returncode == 0, r.stderr[-3000:]
    # no layer returns a view (FSDP2 warns: an in-place op on one would skip the layer's pre-backward hook)
    assert "returned a view tensor" not in r.stderr, r.stderr[-3000:]
    assert events(run, "start")[0]["strategy"] == "fsdp2"
    _same_steps(one_process, run)
    step3 = latest_complete(run)
    model = from_pretrained(step3)  # one consolidated file, plain tensors
    reference = weights(latest_complete(one_process))
    for name, p in model.state_dict().items():
        if name in reference:
            torch.testing.assert_close(p, reference[name], rtol=1e-4, atol=1e-6, msg=name)
    r = run_cli(["train", "debug", "--run-dir", str(run), *_sets(wx, "data.batch_size=4", steps=5)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "written by 2 process(es), this run has 1" in r.stderr
    assert latest_complete(run).name == "step-0000005"
    assert [row["step"] for row in metrics(run)][-2:] == [4, 5]
    # back on 2 processes at the same global batch through gradient accumulation (1 x 2 processes x 2): allowed;
    # only rank 0 logs, so the world-size warning is printed once
    r = torchrun(
        [
            "train",
            "debug",
            "--run-dir",
            str(run),
            *_sets(wx, "data.batch_size=1", fsdp[1], "train.grad_accum=2", steps=6),
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("written by 1 process(es), this run has 2") == 1, r.stderr[-3000:]
    assert latest_complete(run).name == "step-0000006"


def test_a_second_launch_on_a_busy_run_folder_is_refused_on_every_rank(wx: Path, tmp_path: Path) -> None:
    """Rank 0 cannot lock the folder (another run holds it): every rank stops with the error. The ranks are started
    as a per-rank launcher (``srun`` with one task per GPU, or MPI) starts them: no torchrun agent tears the group
    down when one rank dies. Before, rank 0 alone refused, before the process group existed, and rank 1 waited in
    ``init_process_group`` for a peer that was gone, until the store's timeout (30 minutes)."""

    from vla.train.checkpoint import run_dir_lock

    run = tmp_path / "run"
    with run_dir_lock(run):  # this test process plays the first run
        _every_rank_refuses(
            ["train", "debug", "--run-dir", str(run), *_sets(wx)],
            ["is in use by another training process (pid", "rank 0 could not take the run folder"],
        )
    assert not (run / "checkpoints").exists()  # nothing written by the refused launch


def test_a_stop_file_stops_every_rank_at_the_same_step_with_a_checkpoint(wx: Path, tmp_path: Path) -> None:
    """``touch RUN/STOP`` (what the SLURM script does ahead of the time limit): rank 0 sees it, every rank learns
    it at the same step (one all-reduce per step), they write that step's checkpoint together and exit 0."""
    import subprocess
    import sys
    import time

    from train_helpers import REPO, cli_env, free_port, metrics

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "vla.cli", "train", "debug", "--run-dir", str(run),
           *_sets(wx, "data.batch_size=2", "train.save_every=1000", steps=400)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(), cwd=REPO
    )
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").is_file() or len(metrics(run)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        (run / "STOP").touch()
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    (stopped,) = events(run, "stopped")
    assert 2 <= stopped["step"] < 400 and out.count(f"stopped at step {stopped['step']}") == 1, out[-3000:]
    assert latest_complete(run).name == f"step-{stopped['step']:07d}"
    assert not (run / "STOP").exists()


def test_sigterm_to_one_rank_stops_every_rank_with_the_same_exit_status(wx: Path, tmp_path: Path) -> None:
    """SIGTERM reaches rank 1 only (a node's share of a preemption): both ranks write the checkpoint of the same
    step and both exit 143. Before, rank 0 exited 0, so a supervisor saw that node finished and never restarted
    it. Ranks started as a per-rank launcher starts them, so each exit status is seen."""
    import signal
    import time

    from train_helpers import metrics

    run = tmp_path / "run"
    procs = _per_rank(["train", "debug", "--run-dir", str(run),
                       *_sets(wx, "data.batch_size=2", "train.save_every=1000", steps=300)])  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").is_file() or len(metrics(run)) < 2:
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [143, 143], [o[-2000:] for o in outs]
    (stopped,) = events(run, "stopped")
    assert stopped["reason"] == "SIGTERM" and latest_complete(run).name == f"step-{stopped['step']:07d}"


def test_a_damaged_per_rank_state_stops_every_rank(wx: Path, tmp_path: Path) -> None:
    """Rank 1's RNG file of the newest checkpoint is cut short: rank 1 cannot resume, and rank 0 (whose files are
    fine) stops too instead of waiting in the next collective for a rank that has left (with a per-rank launcher
    no agent tears the group down: a hang until distributed.timeout_minutes)."""
    from train_helpers import torchrun

    run = tmp_path / "run"
    r = torchrun(["train", "debug", "--run-dir", str(run), *_sets(wx, "data.batch_size=2", steps=2)])
    assert r.returncode == 0, r.stderr[-3000:]
    rng = latest_complete(run) / "train_state" / "rng1.pt"
    rng.write_bytes(rng.read_bytes()[:100])
    _every_rank_refuses(
        ["train", "debug", "--run-dir", str(run), *_sets(wx, "data.batch_size=2", steps=4)],
        ["another process's loader or RNG state cannot be read", "marked complete but its training state"],
    )
    assert latest_complete(run).name == "step-0000002"
