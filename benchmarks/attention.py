#!/usr/bin/env python3
"""Which attention kernel a bf16 training step on the CPU should use (one JSON line): PyTorch's SDPA, the explicit
grouped-query form (``vla.models.attention.grouped_attention``) and SDPA on float32 copies (``sdpa_fp32``; the
kernels of ``vla.models.attention.attend``), forward + backward, at the action expert's and the backbone's shapes
of the ``bench_smolvla`` config, in bf16 autocast and in fp32 (where ``sdpa_fp32`` is ``sdpa``, so it is left out).

``SharedKVLayer._attend`` takes the explicit form for bf16 training on the CPU because SDPA's backward was measured
~3x slower there on an AMX Xeon. This script checks that choice on the machine at hand (CPU families differ: AMX
Xeons, AVX-512-BF16 EPYCs), so the claim is measured on each family rather than assumed. Runs interleave the two
kernels (A B C C B A ...) so a shared machine's load hits them alike; medians are reported.

    .venv/bin/python benchmarks/attention.py [--iters 20] [--threads 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from harness import emit
from train import cpu_model

from vla.models.attention import KERNELS, attend

# bench_smolvla (SmolVLM text config): 15 query heads over 5 KV heads of width 64; the 0.75-wide expert 9 over 3
# (the layout training records, "9x3x64"); expert queries = 1 state + 50 actions over prefix (2 cameras x 64
# tokens + 48 prompt tokens) + their own 51; backbone queries = the prefix.
SHAPES = {
    "expert": {"batch": 8, "heads": 9, "kv_heads": 3, "q_len": 51, "k_len": 176 + 51, "head_dim": 64},
    "backbone": {"batch": 8, "heads": 15, "kv_heads": 5, "q_len": 176, "k_len": 176, "head_dim": 64},
}


def inputs(shape: dict, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    b, h, kv, t, s, d = (shape[k] for k in ("batch", "heads", "kv_heads", "q_len", "k_len", "head_dim"))
    q = torch.randn(b, h, t, d, generator=g, requires_grad=True)
    k = torch.randn(b, kv, s, d, generator=g, requires_grad=True)
    v = torch.randn(b, kv, s, d, generator=g, requires_grad=True)
    mask = torch.ones(b, 1, t, s, dtype=torch.bool)
    return q, k, v, mask


def step(kind: str, q, k, v, mask, dtype: torch.dtype) -> float:
    """Seconds for one forward + backward of ``kind`` (one of ``vla.models.attention.KERNELS``)."""
    scale = q.shape[-1] ** -0.5
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        attend(kind, q, k, v, mask, scale).float().square().mean().backward()
    return time.perf_counter() - t0


def measure(shape: dict, dtype: torch.dtype, iters: int) -> dict:
    q, k, v, mask = inputs(shape)
    kinds = KERNELS if dtype == torch.bfloat16 else tuple(k for k in KERNELS if k != "sdpa_fp32")
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for i in range(iters + 2):  # 2 warm-up rounds
        for kind in kinds if i % 2 == 0 else kinds[::-1]:
            for t in (q, k, v):
                t.grad = None
            dt = step(kind, q, k, v, mask, dtype)
            if i >= 2:
                times[kind].append(dt)
    med = {kind: statistics.median(ts) for kind, ts in times.items()}
    return {
        "median_ms": {kind: 1e3 * m for kind, m in med.items()},
        "speedup_over_sdpa": {kind: med["sdpa"] / m for kind, m in med.items() if kind != "sdpa"},
        "faster": min(med, key=med.get),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = {
        "benchmark": "attention",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "threads": args.threads,
        "iters": args.iters,
        "torch": torch.__version__,
        "results": {},
    }
    for name, shape in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            key = f"{name}_{'bf16' if dtype == torch.bfloat16 else 'fp32'}"
            res["results"][key] = {"shape": shape, **measure(shape, dtype, args.iters)}
    res["load_average_at_end"] = os.getloadavg()
    emit(res, args.out)


if __name__ == "__main__":
    main()
