"""Training checkpoints: ``<run-dir>/checkpoints/step-XXXXXXX/``, crash-safe and resumable on any world size.

A step folder is a ``from_pretrained`` folder at its top level (config.json, model.safetensors — EMA weights when
EMA is on —, backbone/, embodiments/, norm_stats.json, preprocessing.json, README.md) plus ``train_state/``:

    train_state/dcp/            model (raw weights), optimizer and EMA state (torch.distributed.checkpoint:
                                sharded under FSDP2, reshardable on load, so a run resumes on another world size)
    train_state/rank<R>.json    rank R's loader position (epoch, batches consumed, mixture stream)
    train_state/rng<R>.pt       rank R's Python / NumPy / torch (and CUDA) RNG states
    train_state/trainer.json    step, samples seen, world size, global batch, scheduler state
    train_state/config.yaml     the resolved TrainConfig
    COMPLETE                    written last

Write protocol: everything goes into a hidden ``.step-XXXXXXX.partial`` folder; the COMPLETE marker is written and
fsync'ed last, then one ``rename`` publishes the folder (one atomic exchange when the step exists already, e.g. a
resumed run that re-reaches it). A SIGKILL at any moment therefore leaves either the previous checkpoints untouched
or a hidden partial folder (and, killed while the model was staged, ``save_pretrained``'s hidden staging copy
next to it), which the next save or start-up removes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import yaml

from vla.faults import kill_point
from vla.models.hub import swap_folders
from vla.models.run_dir import (
    CHECKPOINTS,
    COMPLETE,
    LEFTOVER,
    RUN_FILES,
    complete_steps,
    step_dir_name,
    step_of,
)

log = logging.getLogger(__name__)

TRAIN_STATE = "train_state"
#: seconds to stall before publishing a checkpoint (tests kill the writer inside this window)
STALL_ENV = "VLA_TEST_CHECKPOINT_STALL"
STALL_STEP_ENV = "VLA_TEST_CHECKPOINT_STALL_STEP"


def partial_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f".{step_dir_name(step)}.partial"


#: the file ``run_dir_lock`` holds an exclusive lock on (and writes its pid into) while a run trains in the folder
RUN_LOCK = RUN_FILES[0]


class RunDirBusy(RuntimeError):
    """Another training process holds the run folder."""


@contextlib.contextmanager
def run_dir_lock(
    run_dir: Path, *, rank: int | None = None, agree: Callable[[bool], bool] | None = None
) -> Iterator[None]:
    """Hold ``run_dir`` for one training process (rank 0 of a distributed run; other ranks pass through): a second
    launch on the same folder (a double submit, a requeue while the first job still runs) would delete the first's
    checkpoint in progress as a leftover and write over its steps. The lock is a POSIX record lock (``lockf``): the
    kernel releases it when the process dies, so a stale lock file never blocks a resume, and forked children (the
    loader's workers, which outlive a SIGKILLed trainer by seconds) do not inherit it, as they would a ``flock``.
    POSIX locks do not exclude the process holding them, so a folder held by a run in this process is refused too.

    ``rank`` defaults to the ``RANK`` environment variable. ``agree(ok) -> every rank's ok`` (an all-reduce, once
    the process group exists) tells every rank whether rank 0 got the lock, so all of them refuse together: a rank
    left alone would wait for a vanished peer at its first collective, forever under a per-rank launcher."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    agree = agree or (lambda ok: ok)
    if rank != 0:
        if not agree(True):
            raise RunDirBusy(
                f"{run_dir}: rank 0 could not take the run folder (another training process holds it, or it cannot "
                "be written: rank 0's error says which); wait for the other run to end, or fix the folder, or pass "
                "another --run-dir"
            )
        yield
        return
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_locked(run_dir))
        # busy, or the folder cannot be written (EACCES, a full disk): all refuse together
        except BaseException:
            agree(False)
            raise
        agree(True)
        yield


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    """``run_dir_lock`` on rank 0; raises ``RunDirBusy`` before yielding when another run holds the folder."""
    key = str(run_dir.resolve())
    if key in _HELD:
        raise RunDirBusy(
            f"{run_dir} is in use by another training run in this process: two runs in one folder would delete "
            "each other's checkpoints. Let it end first, or pass another run_dir"
        )
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock across processes
        fcntl = None
    run_dir.mkdir(parents=True, exist_ok=True)
    _HELD.add(key)
    try:
        if fcntl is None:
            yield
            return
        with open(run_dir / RUN_LOCK, "a+") as f:
            try:
                fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    # a filesystem without POSIX locks (NFSv3 without lockd, Lustre without flock): train unguarded
                    log.warning(
                        "%s: cannot lock the run folder (%s); a second launch on it would not be refused",
                        run_dir,
                        e,
                    )
                    yield
                    return
                f.seek(0)
                holder = f.read().strip() or "unknown"
                raise RunDirBusy(
                    f"{run_dir} is in use by another training process (pid {holder}): two runs in one folder would "
                    "delete each other's checkpoints. Wait for it to end (or stop it), or pass another --run-dir"
                ) from None
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()}\n")
            f.flush()
            try:
                yield
            finally:
                fcntl.lockf(f, fcntl.LOCK_UN)
    finally:
        _HELD.discard(key)


#: run folders held by a training run of this process (POSIX locks do not exclude their own process)
_HELD: set[str] = set()


#: below this much free space, a failed checkpoint write's error says how little is left (torch.save reports a
#: full disk as "unexpected pos N vs M", without the OSError)
_FULL_DISK_BYTES = 256 * 2**20


@contextlib.contextmanager
def explained_write_errors(run_dir: Path, step: int) -> Iterator[None]:
    """Turn any failure while writing step ``step``'s checkpoint into one error naming the step and the folder, and
    saying that the disk is full when it is: DCP raises a ``BaseException`` subclass and safetensors its own error
    type, which surfaced as tracebacks with messages such as "unexpected pos 704 vs 598". The previous checkpoints
    are untouched by a failed write (it goes to a hidden folder, published by one rename)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:
        where = run_dir / CHECKPOINTS
        try:
            free: int | None = shutil.disk_usage(where).free
        except OSError:
            free = None
        # DCP's CheckpointException holds each rank's error with its traceback (str() prints them all)
        failures = getattr(e, "failures", None)
        inner = [x for x, _ in failures.values()] if isinstance(failures, dict) else [e]
        detail = "; ".join(f"{type(x).__name__}: {str(x)[:300]}" for x in inner)
        chain = []
        for cause in inner:
            while cause is not None and len(chain) < 16:
                chain.append(cause)
                cause = cause.__cause__ or cause.__context__
        full = any(getattr(c, "errno", None) == errno.ENOSPC or "No space left" in str(c) for c in chain)
        what = f"writing the checkpoint of step {step} under {where} failed"
        after = "the previous checkpoints are intact; re-run the same command to resume from the newest"
        left = f"{free / 2**20:.0f} MiB free" if free is not None else "no space left"
        if full:
            raise OSError(
                errno.ENOSPC,
                f"{what}: the disk is full ({left}). Free space (or lower train.keep_last), then {after}",
            ) from e
        # torch.save reports a full disk as "unexpected pos N vs M": say what the disk holds, without claiming it
        low = (
            f"; the disk has only {left}, likely full" if free is not None and free < _FULL_DISK_BYTES else ""
        )
        raise RuntimeError(f"{what} ({type(e).__name__}: {detail}{low}); {after}") from e


def clean_partials(run_dir: Path) -> list[Path]:
    """Remove hidden folders left by interrupted writes or deletions (``LEFTOVER``), after renaming back a
    complete step that a kill left aside while it was being replaced (``.step-*.replaced``). Complete steps and
    names of any other pattern are never touched."""
    root = run_dir / CHECKPOINTS
    removed = []
    if root.is_dir():
        for p in sorted(root.glob(".step-*.replaced")):
            final = root / p.name[1 : -len(".replaced")]
            if final.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.replace(p, final)
        for p in sorted(root.iterdir()):
            if p.is_dir() and LEFTOVER.fullmatch(p.name):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    if removed:
        log.warning("removed %d unfinished checkpoint folder(s) left by an interrupted run", len(removed))
    return removed


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` and every folder (so names and contents are durable before the rename)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists: exactly the single-process run."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states: Python, numpy, torch's CPU generator and, on a CUDA ``device``, that device's
    generator only (a rank draws on its own GPU; every visible GPU's state would tie the file to that count)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore ``rng_state``'s states; the CUDA one onto ``device``. Checkpoints written before this held every
    visible GPU's state (a list): the entry of ``device``'s index is used, and none where the resuming process
    sees fewer GPUs than the writer did (before, ``set_rng_state_all`` raised IndexError there)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or device is None or device.type != "cuda":
        return
    if isinstance(cuda, list | tuple):
        index = device.index or 0
        if index >= len(cuda):
            log.warning(
                "the checkpoint's CUDA RNG states cover %d GPU(s), not %s: that device's generator starts afresh",
                len(cuda),
                device,
            )
            return
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda, device)


def save_train_state(
    folder: Path,
    *,
    rank: int,
    app_state: dict[str, Any],
    loader_state: dict[str, Any],
    attention: dict[str, str] | None = None,
    device: torch.device | None = None,
) -> None:
    """Collective: every rank writes its DCP shard of ``app_state`` (model/optimizer/EMA state dicts) and its own
    loader position, RNG states (``device``: the rank's accelerator, whose generator is saved) and CPU bf16
    attention kernels (``attention``: each rank measures its own, so two ranks may differ) into
    ``folder/train_state``."""
    ts = folder / TRAIN_STATE
    ts.mkdir(parents=True, exist_ok=True)
    with _single_process_quiet():
        dcp.save(app_state, checkpoint_id=str(ts / "dcp"))
    (ts / f"rank{rank}.json").write_text(json.dumps(loader_state))
    torch.save(rng_state(device), ts / f"rng{rank}.pt")
    if attention is not None:
        (ts / f"attention{rank}.json").write_text(json.dumps(attention))


def write_trainer_meta(folder: Path, meta: dict[str, Any], config: dict[str, Any]) -> None:
    ts = folder / TRAIN_STATE
    ts.mkdir(parents=True, exist_ok=True)
    (ts / "trainer.json").write_text(json.dumps(meta, indent=2))
    (ts / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def publish(run_dir: Path, step: int) -> Path:
    """Rank 0, after every rank has written: COMPLETE last (fsync'ed), then one rename makes the step visible."""
    tmp = partial_dir(run_dir, step)
    stall = float(os.environ.get(STALL_ENV, "0") or 0)
    if stall and int(os.environ.get(STALL_STEP_ENV, step)) == step:
        log.warning("test hook %s: stalling %.1f s before publishing step %d", STALL_ENV, stall, step)
        time.sleep(stall)
    fsync_tree(tmp)
    marker = tmp / COMPLETE
    marker.write_text(json.dumps({"step": step, "time": time.time()}))
    fd = os.open(marker, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    final = run_dir / CHECKPOINTS / step_dir_name(step)
    if final.exists():  # the same step written again (a resumed run that re-reached it): replace it whole
        _replace(tmp, final)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def _replace(tmp: Path, final: Path) -> None:
    """Put the complete step folder ``tmp`` in place of the complete ``final``; a kill at any moment leaves one of
    them complete under ``final``'s name, or (fallback, between two renames) the old one as ``.<step>.replaced``,
    which ``clean_partials`` renames back."""
    if swap_folders(tmp, final):  # tmp now holds the old step: a leftover partial folder if killed here
        kill_point("checkpoint.swapped")
        shutil.rmtree(tmp, ignore_errors=True)
        return
    aside = final.with_name(f".{final.name}.replaced")
    os.replace(final, aside)
    kill_point("checkpoint.aside")
    os.replace(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


def prune(run_dir: Path, keep_last: int, keep_every: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last`` (keeping multiples of ``keep_every``). Each is
    renamed to a hidden folder first, so a kill mid-deletion never leaves a half-deleted folder that looks
    complete."""
    doomed = pruned_by(run_dir, keep_last, keep_every)
    for p in doomed:
        aside = p.with_name(f".{p.name}.deleting")
        os.replace(p, aside)
        shutil.rmtree(aside, ignore_errors=True)
    return doomed


def pruned_by(run_dir: Path, keep_last: int, keep_every: int) -> list[Path]:
    """The complete checkpoints ``prune`` would delete now with these settings."""
    steps = complete_steps(run_dir)
    return [p for p in steps[:-keep_last] if not (keep_every and step_of(p) % keep_every == 0)]


def load_train_state(folder: Path, app_state: dict[str, Any]) -> None:
    """Collective: fill ``app_state``'s tensors in place from the checkpoint's DCP folder (resharded as needed)."""
    with _single_process_quiet():
        dcp.load(app_state, checkpoint_id=str(folder / TRAIN_STATE / "dcp"))


def has_train_state_key(folder: Path, top: str) -> bool:
    """Whether the checkpoint's DCP state holds ``top`` (e.g. ``"ema"``: runs without EMA save none)."""
    metadata = dcp.FileSystemReader(str(folder / TRAIN_STATE / "dcp")).read_metadata()
    return any(k == top or k.startswith(top + ".") for k in metadata.state_dict_metadata)


def read_trainer_meta(folder: Path) -> dict[str, Any]:
    path = folder / TRAIN_STATE / "trainer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder}: no {TRAIN_STATE}/trainer.json, so this is a model folder, not a training checkpoint to "
            "resume; start a new run (or fine-tune from it)"
        )
    return json.loads(path.read_text())


def read_rank_attention(folder: Path, rank: int) -> dict[str, str] | None:
    """The CPU bf16 attention kernels ``rank`` recorded, or None (no such rank then, or a checkpoint from before
    per-rank records: trainer.json's, rank 0's, apply)."""
    f = folder / TRAIN_STATE / f"attention{rank}.json"
    return json.loads(f.read_text()) if f.is_file() else None


def read_rank_state(folder: Path, rank: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(loader state, RNG state) that ``rank`` saved, or None where that rank did not exist then."""
    ts = folder / TRAIN_STATE
    loader = ts / f"rank{rank}.json"
    rng = ts / f"rng{rank}.pt"
    return (
        json.loads(loader.read_text()) if loader.is_file() else None,
        torch.load(rng, weights_only=False) if rng.is_file() else None,
    )
