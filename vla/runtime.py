"""Process-wide settings for model work on the CPU, applied by ``vla`` commands at start-up.

``tune_allocator``: glibc's malloc hands every allocation above its mmap threshold (128 KiB at first, raised on the
fly to at most 32 MiB) fresh pages from the kernel and returns them when the tensor is freed, and trims the heap top
whenever more than twice that threshold is free. A training step or an action chunk allocates and frees hundreds of
activation tensors of a few MB, so the same memory is faulted in again and again: measured on a 2-core AMD EPYC VM,
~30,000 page faults per bf16 training step at the ``bench_smolvla`` config (batch 8) and ~4,600 per fp32 action
chunk, at ~2 us each. Keeping freed memory in the process (the effect of the jemalloc/tcmalloc preloads PyTorch's
CPU tuning guide recommends, without a new dependency) removes nearly all of them (training step and chunk ~5 %
faster there against glibc's initial thresholds, within that VM's run-to-run noise; README, Benchmarks); the price
is that the process keeps freed memory (resident memory stays at about its peak, more with fragmentation) instead
of returning it between steps, in forked loader workers too.

``VLA_MALLOC_TUNING=0`` leaves the allocator as it is. Elsewhere than on glibc this does nothing.

``cpu_bf16_slowdown``: how much slower a bf16 matmul runs than an fp32 one on this CPU. CPUs with bf16 units (AMX,
AVX-512 BF16) run it 2-6x *faster* (measured on this project's machines); CPUs without them (AVX2 only, e.g. the
AMD EPYC 7001 "Zen 1" VMs this project also runs on) emulate it, measured 30-80x *slower* there (256x256 and
1024x1024 matmuls), so bf16 weights or bf16 autocast make every model slower by about that much. ``vla serve``
leaves bf16 out of its mode trials there (a single trial of it took minutes), and ``vla train`` warns when asked
for bf16 there.

``undo_realtime``: puts back threads that a library made real-time (SVT-AV1 does, run as root: see there).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

ENV = "VLA_MALLOC_TUNING"
# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
#: allocations below this come from the heap, whose freed memory is reused (glibc may refuse more than 32 MiB)
MMAP_THRESHOLDS = (1 << 30, 32 << 20)
TRIM_THRESHOLD = (1 << 31) - 1  # the largest an int takes: free heap top is kept up to 2 GiB
TOP_PAD = 64 << 20  # grow the heap 64 MiB beyond each request: fewer brk calls

_applied: dict[str, int] | None = None

#: a bf16 matmul this many times slower than fp32 means the CPU emulates bf16 (no AMX / AVX-512 BF16 units)
BF16_EMULATED_SLOWDOWN = 2.0
_bf16_slowdown: float | None = None


def tune_allocator() -> dict[str, int] | None:
    """Keep freed memory in the process (see the module docstring); idempotent. Returns the settings applied, or
    None where it did nothing (``VLA_MALLOC_TUNING=0``, not Linux/glibc, or glibc refused)."""
    global _applied
    if _applied is not None:
        return _applied
    off = os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")
    if off or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")  # (find_library would start a subprocess on every command)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (an AttributeError off glibc, e.g. musl)
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    threshold = next((t for t in MMAP_THRESHOLDS if mallopt(M_MMAP_THRESHOLD, t) == 1), None)
    if (
        threshold is None
        or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1
        or mallopt(M_TOP_PAD, TOP_PAD) != 1
    ):
        log.warning("glibc refused a mallopt setting: the allocator is not (or only partly) tuned")
        return None
    _applied = {"mmap_threshold": threshold, "trim_threshold": TRIM_THRESHOLD, "top_pad": TOP_PAD}
    log.debug("allocator: %s", _applied)
    return _applied


def cpu_bf16_slowdown(n: int = 256, repeats: int = 5) -> float:
    """Seconds of a bf16 ``[n, n] @ [n, n]`` matmul over those of an fp32 one on this CPU, at the current torch
    thread count (best of ``repeats`` each, after a warm-up); measured once per process (~1 ms where bf16 is
    native, ~0.3 s where it is emulated). Above ``BF16_EMULATED_SLOWDOWN``: the CPU has no bf16 units."""
    global _bf16_slowdown
    if _bf16_slowdown is None:
        import time

        import torch

        best = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.ones(n, n, dtype=dtype), torch.ones(n, n, dtype=dtype)
            a @ b  # warm-up (kernel selection, first-touch)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - start)
            best[dtype] = min(times)
        _bf16_slowdown = best[torch.bfloat16] / max(best[torch.float32], 1e-9)
        log.debug("bf16 matmul: %.2fx the time of fp32 on this CPU", _bf16_slowdown)
    return _bf16_slowdown


def cpu_emulates_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls far slower than fp32 (``cpu_bf16_slowdown``; no AMX / AVX-512 BF16)."""
    return cpu_bf16_slowdown() > BF16_EMULATED_SLOWDOWN


# ---- real-time scheduling that libraries raise behind our back ----
_SCHED_RESET_ON_FORK = 0x40000000  # <linux/sched.h>: a flag bit OR-ed into the policy


def scheduling() -> tuple[int, int] | None:
    """The calling thread's scheduling policy and priority (None where the OS has no such calls)."""
    if not hasattr(os, "sched_getscheduler"):
        return None
    return os.sched_getscheduler(0), os.sched_getparam(0).sched_priority


def realtime(policy: int) -> bool:
    return policy & ~_SCHED_RESET_ON_FORK in (os.SCHED_FIFO, os.SCHED_RR)


def undo_realtime(before: tuple[int, int] | None) -> int:
    """Put every thread of this process that is real-time now back to ``before`` (``scheduling()`` of the caller
    before a library call), unless ``before`` was real-time itself (a user's ``chrt``). Returns how many.

    SVT-AV1 (PyAV's AV1 encoder, LeRobot's default codec), run as root (as in most containers), switches the thread
    that opens the encoder and its own worker threads to SCHED_FIFO at priority 99, and leaves them so. Every
    process started from that thread afterwards inherits it: a busy real-time process is never preempted by normal
    ones, so on a small machine it starves everything else (seen: a headless Chromium spinning at FIFO 99 held both
    cores of a CI machine until its deadline; a training run after ``vla sim generate`` in one process would run
    real-time too)."""
    if before is None or realtime(before[0]):
        return 0
    undone = 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            if realtime(os.sched_getscheduler(tid)):
                os.sched_setscheduler(tid, before[0], os.sched_param(before[1]))
                undone += 1
        except OSError:  # the thread ended meanwhile
            continue
    return undone
