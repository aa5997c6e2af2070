"""``vla.runtime.tune_allocator``: freed tensors' memory stays in the process, so repeated allocations stop
faulting pages in; every ``vla`` command applies it, ``VLA_MALLOC_TUNING=0`` turns it off."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import vla.runtime
from vla import cli

# a step's pattern in miniature: tensors with overlapping lifetimes, allocated, filled and freed again and again.
# At 36-48 MB they are above glibc's largest dynamic mmap threshold (32 MiB), so its default maps fresh pages for
# each and faults them all in (~30,000 faults a round with 4 KiB pages), whatever happened before in the process.
CHILD = """
import json, os, resource, torch
from vla.runtime import tune_allocator
applied = tune_allocator()
def step():
    a = torch.ones(10_000_000); b = torch.ones(9_000_000); del a; c = torch.ones(12_000_000); del b, c
for _ in range(10):  # the tuned heap grows to its steady size in the first rounds
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
os.environ["VLA_MALLOC_TUNING"] = "0"
import vla.runtime
vla.runtime._applied = None
off = vla.runtime.tune_allocator()
print(json.dumps({"applied": applied, "faults_per_step": faults, "after_env_off": off}))
"""


def _child(tuning: str) -> dict:
    env = {**os.environ, vla.runtime.ENV: tuning}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning: glibc only")
def test_tuned_allocator_stops_faulting_pages_in_for_repeated_tensors() -> None:
    default, tuned = _child("0"), _child("1")
    assert default["applied"] is None and tuned["after_env_off"] is None
    assert tuned["applied"] is not None
    if tuned["applied"]["mmap_threshold"] < 48 << 20:
        pytest.skip("this glibc caps the mmap threshold below the test's 48 MB tensors")
    assert default["faults_per_step"] >= 10, default  # 4 KiB pages: thousands; fewer with huge pages
    assert tuned["faults_per_step"] <= default["faults_per_step"] / 10, (default, tuned)


def test_every_command_applies_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(vla.runtime, "tune_allocator", lambda: calls.append(1))
    assert cli.main(["model", "info", "/nonexistent/checkpoint"]) == 2  # fails after start-up
    assert calls == [1]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {
        f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()
    }


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="x86 CPU flags decide the expectation"
)
def test_bf16_probe_tells_emulating_cpus_from_native_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe agrees with the CPU's flags where they decide it: bf16 units (AMX, AVX-512 BF16) run a bf16 matmul
    faster than fp32; AVX2-only CPUs emulate it (the 2-core AMD EPYC 7001 VM: 30-80x slower)."""
    import torch

    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this system")
    monkeypatch.setattr(vla.runtime, "_bf16_slowdown", None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        slowdown = vla.runtime.cpu_bf16_slowdown()
    finally:
        torch.set_num_threads(threads)
    assert 0 < slowdown < float("inf")
    assert vla.runtime.cpu_bf16_slowdown() == slowdown  # measured once per process
    if flags & {"amx_bf16", "avx512_bf16"}:
        assert not vla.runtime.cpu_emulates_bf16(), (slowdown, sorted(flags & {"amx_bf16", "avx512_bf16"}))
    elif "avx512f" not in flags:
        assert vla.runtime.cpu_emulates_bf16(), slowdown
    else:
        pytest.skip(f"AVX-512 without bf16 units: no fixed expectation (measured {slowdown:.1f}x)")
