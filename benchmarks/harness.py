"""Shared plumbing of the benchmark scripts: each measurement in its own subprocess (so each peak RSS is its own),
the peer (LeRobot 0.6.1 in its own venv, ``../shared/peer/``) run side by side, and min/median/max summaries."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
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


def _peer_missing() -> dict:
    return {"skipped": f"peer venv not found at {PEER_VENV}; build it with {PEER_DIR}/setup_lerobot_venv.sh"}


def run_in_peer_venv(script: str, job: dict, timeout: int = 3600) -> dict:
    """Run ``script PEER_DIR JOB`` with the peer venv's python; the dict it prints after ``RESULT ``."""
    py = _peer_python()
    if py is None:
        return _peer_missing()
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
        return _peer_missing()
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
