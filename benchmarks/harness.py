"""Shared plumbing of the benchmark scripts: each measurement in its own subprocess (so each peak RSS is its own),
the peer (LeRobot 0.6.1 in its own venv, ``../shared/peer/``) run side by side, and min/median/max summaries."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEER_DIR = REPO.parent / "shared" / "peer"
PEER_VENV = Path(os.environ.get("PEER_VENV", Path(os.environ.get("TMPDIR", "/tmp")) / "peer-venv"))
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def cpu_model() -> str:
    """``lscpu``'s model name, recorded with every result (kernels and ratios differ between CPU families)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


#: the instruction-set flags that decide which kernels and precisions are fast (matmul width, bf16 units)
MATMUL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_features() -> dict[str, object]:
    """The CPU beyond its model name, recorded with every result: lscpu's "AMD EPYC" names both an AVX2-only
    "Zen 1" VM (CPU family 23, bf16 emulated: a bf16 matmul 30-80x slower than fp32) and an AVX-512 BF16 one, whose
    numbers differ several-fold. Family/model from ``/proc/cpuinfo``, and which of ``MATMUL_FLAGS`` it has."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        first[key.strip()] = value.strip()
    flags = set(first.get("flags", "").split())
    return {
        "vendor": first.get("vendor_id"),
        "family": first.get("cpu family"),
        "model": first.get("model"),
        "matmul_flags": [f for f in MATMUL_FLAGS if f in flags],
        "bf16_units": bool(flags & {"avx512_bf16", "amx_bf16"}),
    }


def stats3(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def percentiles(xs: list[float], suffix: str = "_ms") -> dict[str, float]:
    """Median, 99th percentile and mean of ``xs`` (one interpolation, ``statistics.quantiles``' inclusive method,
    for our side and the peer's, so their tails compare), with the sample count; keys ``p50<suffix>`` etc."""
    s = sorted(xs)
    q = statistics.quantiles(s, n=100, method="inclusive") if len(s) > 1 else [s[0]] * 99
    return {"n": len(s), f"p50{suffix}": q[49], f"p99{suffix}": q[98], f"mean{suffix}": statistics.fmean(s)}


def peak_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux reports KiB


def run_child(script: str, job: dict, env_extra: dict[str, str] | None = None, timeout: int = 3600) -> dict:
    """Run ``script _child JOB`` and return the dict it prints after ``RESULT `` (or ``{"error": ...}``)."""
    return _result([sys.executable, script, "_child", json.dumps(job)], env_extra, timeout)


def _peer_python() -> Path | None:
    py = PEER_VENV / "bin" / "python"
    return py if py.exists() else None


def peer_missing() -> dict:
    """Why the peer did not run: its venv is missing (and how to build it)."""
    return {"skipped": f"peer venv not found at {PEER_VENV}; build it with {PEER_DIR}/setup_lerobot_venv.sh"}


class Child:
    """A benchmark child started in a session (process group) of its own, its output to files (a stopped process
    never blocks on a full pipe); ``result()`` waits and returns the dict it printed after ``RESULT ``."""

    def __init__(
        self,
        cmd: list[str],
        name: str,
        env_extra: dict[str, str] | None = None,
        steps_done: Callable[[Child], int] | None = None,
    ) -> None:
        # ``steps_done(child)``: training steps it has logged so far (read from its files; see ``time_sliced``)
        self.name, self.steps_done = name, steps_done or (lambda child: 0)
        self.dir = Path(tempfile.mkdtemp(prefix="bench-child-"))
        with open(self.dir / "out", "w") as out, open(self.dir / "err", "w") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=err,
                env={**os.environ, **CHILD_ENV, **(env_extra or {})},
                start_new_session=True,
            )

    def signal(self, sig: int) -> None:
        """``sig`` to the child's whole process group (its loader workers and subprocesses too)."""
        with contextlib.suppress(ProcessLookupError):  # the group is gone
            os.killpg(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait()

    def result(self) -> dict:
        """Wait for the child; the dict it printed after ``RESULT `` (or ``{"error": its stderr's tail}``). Its
        output files are removed."""
        self.proc.wait()
        out, err = (self.dir / "out").read_text(), (self.dir / "err").read_text(errors="replace")
        shutil.rmtree(self.dir, ignore_errors=True)
        for line in out.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        return {"error": (err or out)[-3000:]}


def start_child(script: str, job: dict, name: str, steps_done: Callable[[Child], int]) -> Child:
    """``run_child`` without waiting (see ``time_sliced``)."""
    return Child([sys.executable, script, "_child", json.dumps(job)], name, steps_done=steps_done)


def start_in_peer_venv(script: str, job: dict, name: str, steps_done: Callable[[Child], int]) -> Child | None:
    """``run_in_peer_venv`` without waiting; None where the peer venv is missing."""
    py = _peer_python()
    if py is None:
        return None
    return Child([str(py), script, str(PEER_DIR), json.dumps(job)], name, steps_done=steps_done)


def time_sliced(children: list[Child], slice_s: float, timeout: float = 3600) -> dict:
    """Run ``children`` (started together) one at a time, in turns of ``slice_s`` seconds, until every one has exited:
    each turn SIGCONTs one child's process group and SIGSTOPs it again when the turn ends. A shared VM's speed
    drifts by 10-30 % within minutes; runs that take turns every few seconds see the same drift, where runs minutes
    apart do not.

    Start-up takes different times (LeRobot's is longer): a child that has logged its first training step waits,
    stopped, until every other child has too (or has exited). The window in which all of them train together ends
    when the first one exits. Returns, per child, its turns and ``window_steps``: the index range ``[first, end)``
    of its steps that ran inside that window (step counts read at turn boundaries, while the others were stopped;
    ``end`` None: all of them, the child exited first). A step a pause fell into is as long as a whole turn of the
    others (>= ``slice_s``): summaries drop steps longer than ``paused_step_s(slice_s)`` and the step after each
    (caches gone cold; ``kept_steps``). Which steps a pause falls into is nearly independent of their length (a
    step of length d holds one with probability ~d / turn), so dropping them shifts the mean step by about
    variance / turn: well under 1 % for steps of ~1 s with a 10 % spread and turns of 10 s. A step finished but
    not yet logged when its child was stopped is counted one step early at a window's edge.

    Raises ``TimeoutError`` past ``timeout``. Whatever happens, every child's process group is continued and killed
    before this returns or raises (a child's loader workers included, its leader gone or not)."""
    for child in children:  # each runs only in its turns from here on
        child.signal(signal.SIGSTOP)
    turns = {child.name: 0 for child in children}
    first: dict[str, int] = {}  # steps done when every child was training
    end: dict[str, int] = {}  # steps done when the first child exited
    start = time.monotonic()

    def training(child: Child) -> bool:
        return child.proc.poll() is not None or child.steps_done(child) > 0

    try:
        while alive := [c for c in children if c.proc.poll() is None]:
            everyone = all(training(c) for c in children)
            if everyone and not first:
                first = {c.name: c.steps_done(c) for c in children}
            for child in alive:
                if not everyone and training(child) and len(alive) > 1:
                    continue  # ahead of the others: wait for them, stopped
                if time.monotonic() - start > timeout:
                    raise TimeoutError(f"time-sliced runs still going after {timeout:.0f} s")
                child.signal(signal.SIGCONT)
                turns[child.name] += 1
                _turn(child, slice_s, until_training=not everyone)
                if child.proc.poll() is not None and first and not end:  # the common window closes
                    end = {c.name: None if c.proc.poll() is not None else c.steps_done(c) for c in children}
                    break  # the others' counts are read while they are stopped
    finally:
        for child in children:  # exited leaders too: their workers may be left in the group, stopped
            child.signal(signal.SIGCONT)
            child.signal(signal.SIGKILL)
    # a child that exited before all were training (a crash at start-up) has no window: [0, 0]
    return {
        "slice_s": slice_s,
        "wall_s": time.monotonic() - start,
        "children": {
            c.name: {
                "turns": turns[c.name],
                "window_steps": [first.get(c.name, 0), end.get(c.name) if end else None]
                if c.name in first and first[c.name] > 0
                else [0, 0],
            }
            for c in children
        },
    }


def _turn(child: Child, slice_s: float, until_training: bool) -> None:
    """Let ``child`` run for ``slice_s`` seconds (or until it exits), then SIGSTOP it; ``until_training``: stop it as
    soon as it has logged a training step (checked every 50 ms), so it waits for the others from its first step."""
    end = time.monotonic() + slice_s
    while (left := end - time.monotonic()) > 0:
        try:
            child.proc.wait(min(left, 0.05) if until_training else left)
            return  # exited
        except subprocess.TimeoutExpired:
            if until_training and child.steps_done(child) > 0:
                break
    child.signal(signal.SIGSTOP)


def paused_step_s(slice_s: float) -> float:
    """The step length above which a time-sliced run's step is taken to hold a pause (half a turn)."""
    return slice_s / 2


def window_rates(step_s: list[float], window: list[int], warmup: int, batch: int, longest_s: float) -> dict:
    """Samples/s of a time-sliced run over its steps inside the common window (``time_sliced``), past ``warmup``,
    paused ones dropped: over all of them and at the median step. ``step_s``: every step's seconds, in order."""
    lo, hi = max(window[0], warmup), len(step_s) if window[1] is None else window[1]
    steps = [
        step_s[i] for i in kept_steps(step_s, longest_s) if lo <= i < hi
    ]  # a pause just before lo counts
    if not steps:
        return {"window_steps": [lo, hi], "error": "no step inside the common window: give more --steps"}
    return {
        "window_steps": [lo, hi],
        "counted_steps": len(steps),
        "samples_per_s": batch * len(steps) / sum(steps),
        "samples_per_s_median_step": batch / statistics.median(steps),
    }


def kept_steps(durations: list[float], longest_s: float | None) -> list[int]:
    """Indices of the steps to count: all of them, or (a time-sliced run, ``longest_s`` set) those not longer than
    ``longest_s`` and not right after one that was."""
    if longest_s is None:
        return list(range(len(durations)))
    paused = [d > longest_s for d in durations]
    return [i for i, d in enumerate(durations) if not paused[i] and not (i and paused[i - 1])]


def run_in_peer_venv(script: str, job: dict, timeout: int = 3600) -> dict:
    """Run ``script PEER_DIR JOB`` with the peer venv's python; the dict it prints after ``RESULT ``."""
    py = _peer_python()
    if py is None:
        return peer_missing()
    return _result([str(py), script, str(PEER_DIR), json.dumps(job)], None, timeout)


def _result(cmd: list[str], env_extra: dict[str, str] | None, timeout: int) -> dict:
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={**os.environ, **CHILD_ENV, **(env_extra or {})},
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (proc.stderr or proc.stdout)[-3000:]}


def run_peer(bench_args: list[str], out: Path, timeout: int = 3600) -> dict:
    """``peer_lerobot_bench.py bench ARGS --out OUT`` in the peer venv; its JSON, or why there is none."""
    py = _peer_python()
    if py is None:
        return peer_missing()
    proc = subprocess.run(
        [str(py), str(PEER_DIR / "peer_lerobot_bench.py"), "bench", *bench_args, "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=timeout,
    )
    if proc.returncode != 0 or not out.exists():
        return {"error": proc.stderr[-3000:]}
    return json.loads(out.read_text())


def emit(result: dict, out: str = "") -> None:
    """Print the result as one JSON line (and write it to ``out`` when given); a result that names its CPU
    (``cpu_model`` or ``cpu``) gets ``cpu_features`` beside it."""
    if (
        isinstance(result, dict)
        and ("cpu_model" in result or "cpu" in result)
        and "cpu_features" not in result
    ):
        result = {**result, "cpu_features": cpu_features()}
    line = json.dumps(result, separators=(",", ":"), default=float)
    if out:
        Path(out).write_text(line + "\n")
    print(line)
