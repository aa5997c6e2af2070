#!/usr/bin/env python3
"""Which attention kernel the CPU should use (one JSON line): PyTorch's SDPA, the explicit three-op grouped-query
form (``vla.models.attention.grouped_attention``) and SDPA on float32 copies (``sdpa_fp32``; the kernels of
``vla.models.attention.attend``) at the ``bench_smolvla`` config's real layouts (9 query heads over 3 KV heads of
width 64 in the backbone and the expert; a prefix of 114 tokens: 2 cameras x 49 image tokens, the prompt and the
embodiment token):

* ``training``: forward + backward at batch 8, in bf16 autocast and in fp32 (where ``sdpa_fp32`` is ``sdpa``, so
  it is left out), for the expert's chunk pass (the state and 50 actions over the prefix and themselves), the one-query
  pass a frozen backbone trains its embodiment token with (the ``-short`` layout training records separately) and
  the backbone's prefix;
* ``inference``: forward only without a gradient, bf16 and fp32 tensors, batch 1 and 8, ``sdpa`` and ``explicit``
  (``prepare_inference(attention=)``, which ``vla serve`` measures), for the expert, the backbone and the vision
  tower (6 heads of width 64 over 196 patches, two images per sample, no mask);
* ``compiled``: the same forward under ``torch.compile`` (as serving's graphs and training's frozen parts run it), in
  bf16 at batch 8, with HF's eager form (matmul, float32 softmax, matmul) beside ours: Inductor rewrites that form
  into the fused SDPA kernel (``rewritten_to_sdpa``), which is why the vision tower runs ``grouped_attention``.

Training measures its kernel per layout and ``vla serve`` its inference kernel, because CPU families disagree (AMX
Xeons, AVX-512-BF16 EPYCs); this script shows the numbers behind those choices on the machine at hand. Runs
interleave the kernels (A B C C B A ...) so a shared machine's load hits them alike; medians are reported.

    .venv/bin/python benchmarks/attention.py [--iters 20] [--threads 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
from harness import emit
from train import cpu_model

from vla.models.attention import KERNELS, attend

# bench_smolvla as benchmarks/train.py runs it (shapes read off its attention calls): 9 query heads over 3 KV heads
# of width 64 (the layout training records, "9x3x64"); a prefix of 114 tokens (2 cameras x 49 image tokens, the
# prompt, the embodiment token); the expert's 51 queries (state + 50 actions) over the prefix and themselves.
PREFIX = 114
LAYOUT = {"heads": 9, "kv_heads": 3, "head_dim": 64}
SHAPES = {
    "expert_chunk": {"batch": 8, **LAYOUT, "q_len": 51, "k_len": PREFIX + 51},
    "embodiment_token": {"batch": 8, **LAYOUT, "q_len": 1, "k_len": PREFIX},
    "backbone": {"batch": 8, **LAYOUT, "q_len": PREFIX, "k_len": PREFIX},
}
# the vision tower (SmolVLM's SigLIP at 224 px: 14 x 14 patches), two camera images per sample, every patch visible
VISION = {"heads": 6, "kv_heads": 6, "head_dim": 64, "q_len": 196, "k_len": 196, "images_per_sample": 2}
INFERENCE_SHAPES = ("expert_chunk", "backbone", "vision")
INFERENCE_KERNELS = ("sdpa", "explicit")
COMPILED_KERNELS = ("sdpa", "explicit", "hf_eager")


def inputs(
    shape: dict, seed: int = 0, *, grad: bool = True, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """q ``[B, H, Tq, d]``, k/v ``[B, KV, Tk, d]`` and a mask ``[B, 1, Tq, Tk]``: every query sees the keys before
    its own block, and its own block causally (the model's masks differ per pass; the kernels' cost does not)."""
    g = torch.Generator().manual_seed(seed)
    b, h, kv, t, s, d = (shape[k] for k in ("batch", "heads", "kv_heads", "q_len", "k_len", "head_dim"))
    b *= shape.get("images_per_sample", 1)
    q = torch.randn(b, h, t, d, generator=g).to(dtype).requires_grad_(grad)
    k = torch.randn(b, kv, s, d, generator=g).to(dtype).requires_grad_(grad)
    v = torch.randn(b, kv, s, d, generator=g).to(dtype).requires_grad_(grad)
    mask = torch.ones(b, 1, t, s, dtype=torch.bool)
    mask[..., s - t :] = torch.ones(t, t, dtype=torch.bool).tril()
    return q, k, v, None if "images_per_sample" in shape else mask


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
    return _summary(med)


def _summary(med: dict[str, float]) -> dict:
    return {
        "median_ms": {kind: 1e3 * m for kind, m in med.items()},
        "speedup_over_sdpa": {kind: med["sdpa"] / m for kind, m in med.items() if kind != "sdpa"},
        "faster": min(med, key=med.get),
    }


def _forward_medians(fns: dict, args: tuple, iters: int) -> dict[str, float]:
    """Median seconds of each ``fns[kind](*args)`` without a gradient, the kinds interleaved (A B, B A, ...) after
    two warm-up rounds."""
    kinds = list(fns)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    with torch.inference_mode():
        for i in range(iters + 2):
            for kind in kinds if i % 2 == 0 else kinds[::-1]:
                t0 = time.perf_counter()
                fns[kind](*args)
                if i >= 2:
                    times[kind].append(time.perf_counter() - t0)
    return {kind: statistics.median(ts) for kind, ts in times.items()}


def measure_inference(shape: dict, batch: int, dtype: torch.dtype, iters: int) -> dict:
    """Median forward time of each inference kernel, no gradient, ``dtype`` tensors (a served model's)."""
    q, k, v, mask = inputs({**shape, "batch": batch}, grad=False, dtype=dtype)
    fns = {kind: functools.partial(attend, kind) for kind in INFERENCE_KERNELS}
    return _summary(_forward_medians(fns, (q, k, v, mask, q.shape[-1] ** -0.5), iters))


def hf_eager(q, k, v, mask, scale):
    """HF's eager attention (``eager_attention_forward``: K/V heads repeated for grouped queries, ``repeat_kv``)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    return torch.matmul(torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype), v)


def measure_compiled(shape: dict, iters: int) -> dict:
    """Median forward time of each of ``COMPILED_KERNELS`` compiled (bf16 tensors, no gradient), and whether
    Inductor ran the fused SDPA kernel in its graph."""
    q, k, v, mask = inputs(shape, grad=False, dtype=torch.bfloat16)
    scale = q.shape[-1] ** -0.5
    fns = {
        kind: torch.compile(
            (lambda q, k, v, m, kind=kind: attend(kind, q, k, v, m, scale)) if kind != "hf_eager" else
            (lambda q, k, v, m: hf_eager(q, k, v, m, scale))
        )
        for kind in COMPILED_KERNELS
    }  # fmt: skip
    rewritten = {}
    with torch.inference_mode():
        for kind, fn in fns.items():
            fn(q, k, v, mask)  # compiles
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                fn(q, k, v, mask)
            rewritten[kind] = any("scaled_dot_product" in e.key for e in prof.key_averages())
    out = _summary(_forward_medians(fns, (q, k, v, mask), iters))
    return {**out, "rewritten_to_sdpa": {k: v for k, v in rewritten.items() if k != "sdpa"}}


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
        "inference": {},
    }
    tag = {torch.bfloat16: "bf16", torch.float32: "fp32"}
    for name, shape in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            res["results"][f"{name}_{tag[dtype]}"] = {"shape": shape, **measure(shape, dtype, args.iters)}
    shapes = {**SHAPES, "vision": VISION}
    for name in INFERENCE_SHAPES:
        for batch in (1, 8):
            for dtype in (torch.bfloat16, torch.float32):
                res["inference"][f"{name}_b{batch}_{tag[dtype]}"] = {
                    "shape": {**shapes[name], "batch": batch},
                    **measure_inference(shapes[name], batch, dtype, args.iters),
                }
    res["compiled"] = {}
    for name in ("backbone", "vision"):
        shape = {**shapes[name], "batch": 8}
        res["compiled"][f"{name}_b8_bf16"] = {"shape": shape, **measure_compiled(shape, args.iters)}
    res["load_average_at_end"] = os.getloadavg()
    emit(res, args.out)


if __name__ == "__main__":
    main()
