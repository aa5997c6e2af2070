#!/usr/bin/env python3
"""Model speed and memory, side by side with LeRobot 0.6.1's SmolVLA at exactly the config ../shared/peer/ uses
(one JSON line).

Config (both sides): SmolVLM-family backbone, vision 384 x 4 layers at 224 px, text 576 x 8 layers, the full
49,280-token vocabulary, random init; expert 0.75x width x 8 layers; two 96x128 cameras resized to 224; state 8,
action 7, chunk 50, prompt <= 48 tokens; backbone frozen (expert, projections and heads trained).
Measured: a training step (forward + backward + grad-clip + AdamW + LR-scheduler step, batch 8) in fp32 and with
bf16 autocast, and one-chunk inference (batch 1, 10 flow steps) in fp32 and bf16 autocast (both sides), plus our
serving modes (``prepare_inference``: fp32 or bf16 weights, optionally compiled with frozen weights) and the peer's
own compiled inference (``compile_model=True``, ``benchmarks/peer_smolvla_compiled.py``), each with its peak RSS; every measurement in its own subprocess. Serving modes also report how far their chunk is from the
fp32 eager chunk (same weights, same noise). Model FLOPs utilization: the FLOPs of one training step / one chunk
(counted with ``torch.utils.flop_counter``) over the time, against the matmul peak of the same dtype measured in the
same run; the peer's MFU uses our count (same architecture; its state token sits in the prefix).

    .venv/bin/python benchmarks/model.py [--iters 12] [--warmup 3] [--precisions auto|fp32|fp32,bf16] [--skip-peer]
                                         [--skip-peer-compiled] [--out FILE.json]

``--precisions auto`` (the default) times our bf16 modes only on CPUs with bf16 units (AVX-512 BF16 or AMX): on an
AVX2-only CPU bf16 is emulated, 30-80x slower than fp32, and the bf16 children alone ran for over 15 minutes there
while telling nothing a user would run. The peer's own script (``../shared/peer``) still times its bf16 modes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from harness import cpu_features, cpu_model, emit, peak_rss_mb, run_child, run_in_peer_venv, run_peer, stats3

TASKS = [
    "pick up the red cube and place it in the bowl",
    "open the top drawer and push the blue block inside",
]
STATE, ACTION, CHUNK, H, W = 8, 7, 50, 96, 128

BENCH_SPEC = {
    "name": "bench_arm",
    "robot": "synthetic_7dof",
    "control_hz": 10,
    "chunk_length": CHUNK,
    "cameras": {"primary": {"height": H, "width": W}, "wrist": {"height": H, "width": W}},
    "state": [{"name": "joints", "kind": "joint_pos", "dims": [f"s{i}" for i in range(STATE)]}],
    "action": [{"name": "joints", "kind": "joint_pos", "dims": [f"a{i}" for i in range(ACTION)]}],
}


def build(batch_size: int):
    import torch

    from vla.embodiments import EmbodimentSpec
    from vla.models.config import load_model_config
    from vla.models.policies.flow_vla import FlowVLA
    from vla.types import Batch

    cfg = load_model_config("bench_smolvla")
    torch.manual_seed(0)
    model = FlowVLA(cfg, [EmbodimentSpec.from_dict(BENCH_SPEC)])
    g = torch.Generator().manual_seed(1234)
    images = {
        k: torch.randint(0, 256, (batch_size, 1, H, W, 3), generator=g, dtype=torch.uint8)
        for k in ("primary", "wrist")
    }
    batch = Batch(
        images=images, image_mask={k: torch.ones(batch_size, dtype=torch.bool) for k in images},
        state=torch.randn(batch_size, STATE, generator=g), state_mask=torch.ones(batch_size, STATE, dtype=torch.bool),
        actions=torch.randn(batch_size, CHUNK, ACTION, generator=g), action_mask=torch.ones(batch_size, ACTION, dtype=torch.bool),
        action_is_pad=torch.zeros(batch_size, CHUNK, dtype=torch.bool), prompt=[TASKS[i % 2] for i in range(batch_size)],
        embodiment_id=torch.zeros(batch_size, dtype=torch.int64),
    )  # fmt: skip
    return model, batch


def child_train(job: dict) -> dict:
    from contextlib import nullcontext

    import torch

    torch.set_num_threads(job["threads"])
    model, batch = build(job["batch"])
    params = [p for p in model.parameters() if p.requires_grad]
    # the peer's SmolVLA preset (AdamW 0.9/0.95, wd 1e-10, clip 10); torch's fused AdamW kernel, as vla trains
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=1e-10, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000))
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if job["amp"] == "bf16" else nullcontext()
    model.train()
    times, losses = [], []
    flops = None
    if job["amp"] == "fp32":  # the FLOPs of one step's forward + backward (a warm-up step, untimed)
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            model.loss(batch)[0].backward()
        opt.zero_grad()
        flops = counter.get_total_flops()
    for i in range(job["warmup"] + job["iters"]):
        t0 = time.perf_counter()
        with amp:
            loss, _ = model.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 10.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        dt = time.perf_counter() - t0
        losses.append(float(loss))
        if i >= job["warmup"]:
            times.append(dt)
    counts = model.parameter_counts()
    s = stats3(times)
    return {
        "batch": job["batch"],
        "amp": job["amp"],
        "s_per_step": s,
        "samples_per_s": job["batch"] / s["median"],
        "flops_per_step": flops,
        "loss_first_last": [losses[0], losses[-1]],
        "params_total": counts["all"]["total"],
        "params_trainable": counts["all"]["trainable"],
        "params_by_part": counts,
        "peak_rss_mb": peak_rss_mb(),
    }


def child_peak(job: dict) -> dict:
    """The machine's matmul peak (TFLOP/s) per dtype (``job["dtypes"]``, default both): the best of a few square
    ``n`` (default 2048) matmuls."""
    import torch

    torch.set_num_threads(job["threads"])
    out = {}
    n = job.get("n", 2048)  # smaller on CPUs without native bf16, where a 2048 bf16 matmul takes ~20 s
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for name in job.get("dtypes", list(dtypes)):
        dtype = dtypes[name]
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(3):
            a @ b
        best = min(_timed(lambda a=a, b=b: a @ b) for _ in range(10))
        out[f"{name}_tflops"] = 2 * n**3 / best / 1e12
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def child_infer(job: dict) -> dict:
    from contextlib import nullcontext

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    torch.set_num_threads(job["threads"])
    model, batch = build(1)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if job["amp"] == "bf16" else nullcontext()
    model.eval()
    compile_s, flops, diff = None, None, None
    if job["amp"] == "fp32":
        with FlopCounterMode(display=False) as counter:
            model.sample_actions(batch, num_steps=10)
        flops = counter.get_total_flops()
    if job["amp"] in SERVING:  # serving modes: weights cast (no per-op casts), optionally compiled
        amp = nullcontext()
        ref = model.sample_actions(batch, num_steps=10, generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        dtype, compile_ = SERVING[job["amp"]]
        model.prepare_inference(dtype, compile=compile_)
        out = model.sample_actions(batch, num_steps=10, generator=torch.Generator().manual_seed(0))
        compile_s = (
            time.perf_counter() - t0
        )  # compiling (if any) happens in this first call, outside the timing
        diff = float((out - ref).abs().max() / ref.abs().max())
    times = []
    for i in range(job["warmup"] + job["iters"]):
        t0 = time.perf_counter()
        with amp:
            out = model.sample_actions(batch, num_steps=10)
        dt = time.perf_counter() - t0
        if i >= job["warmup"]:
            times.append(dt)
    return {
        "amp": job["amp"],
        "prepare_s": compile_s,
        "flops_per_chunk": flops,
        "max_abs_diff_vs_fp32_eager_over_max_abs": diff,
        "chunk_shape": [1, CHUNK, ACTION],
        "model_output_shape": list(out.shape),
        "s_per_chunk": stats3(times),
        "peak_rss_mb": peak_rss_mb(),
    }


SERVING = {  # mode -> prepare_inference(dtype, compile)
    "fp32_compiled": ("float32", True),
    "bf16_weights": ("bfloat16", False),
    "bf16_weights_compiled": ("bfloat16", True),
}


def run_peer_smolvla(args: argparse.Namespace) -> dict:
    bench = [
        "--only",
        "smolvla",
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
    ]
    return run_peer(bench, Path(os.environ.get("TMPDIR", "/tmp")) / "vla_peer_model.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", nargs="?", default="bench", choices=["bench", "_child"])
    ap.add_argument("job", nargs="?")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-peer-compiled", action="store_true", help="skip LeRobot with compile_model=True")
    ap.add_argument("--precisions", default="auto",
                    help="our precisions: auto (bf16 too only with bf16 units), fp32, or fp32,bf16")  # fmt: skip
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.cmd == "_child":
        job = json.loads(args.job)
        fn = {"train": child_train, "infer": child_infer, "peak": child_peak}[job["kind"]]
        print("RESULT " + json.dumps(fn(job)), flush=True)
        return
    from vla.models.tiny import tiny_backbone_path

    tiny_backbone_path("smolvlm", "bench")  # build once, outside the timed children
    common = {"threads": args.threads, "iters": args.iters, "warmup": args.warmup}
    features = cpu_features()
    if args.precisions == "auto":
        precisions = ["fp32", "bf16"] if features.get("bf16_units") else ["fp32"]
    else:
        precisions = args.precisions.split(",")
        if not precisions or any(p not in ("fp32", "bf16") for p in precisions):
            ap.error(f"--precisions: auto or a comma list of fp32, bf16; got {args.precisions!r}")
    res: dict = {
        "benchmark": "model",
        "cpu_model": cpu_model(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu_count": os.cpu_count(),
        "config": "configs/model/bench_smolvla.yaml",
        "precisions": precisions,
        "ours": {},
    }
    if "bf16" not in precisions:
        res["bf16_skipped"] = (
            "no bf16 units (AVX-512 BF16 / AMX) on this CPU: bf16 is emulated, 30-80x slower"
            if args.precisions == "auto"
            else f"not asked for (--precisions {args.precisions})"
        )
    for amp in precisions:
        res["ours"][f"train_b8_{amp}"] = run_child(
            __file__, {"kind": "train", "batch": 8, "amp": amp, **common}
        )
    for amp in (*precisions, *(m for m in SERVING if "bf16" in precisions or not m.startswith("bf16"))):
        res["ours"][f"infer_b1_{amp}"] = run_child(
            __file__, {"kind": "infer", "amp": amp, **common, "iters": 2 * args.iters}
        )
    res["matmul_peak"] = run_child(__file__, {"kind": "peak", "threads": args.threads, "dtypes": precisions})
    if not args.skip_peer:
        peer = run_peer_smolvla(args)
        if not args.skip_peer_compiled:  # LeRobot's own compile_model=True (minutes of max-autotune per mode)
            for amp in precisions:
                job = {"amp": amp, "threads": args.threads, "iters": 2 * args.iters, "warmup": args.warmup}
                peer[f"smolvla_infer_b1_{amp}_compiled"] = run_in_peer_venv(
                    str(Path(__file__).with_name("peer_smolvla_compiled.py")), job
                )
        res["peer_lerobot"] = peer
        ratios = {}
        for kind, key, name in (("train_b8", "s_per_step", "train"), ("infer_b1", "s_per_chunk", "infer")):
            for amp in precisions:
                theirs, ours = peer.get(f"smolvla_{kind}_{amp}", {}), res["ours"][f"{kind}_{amp}"]
                p, o = theirs.get(key, {}).get("median"), ours.get(key, {}).get("median")
                if p and o:
                    ratios[f"{name}_{amp}_speedup"] = p / o
                    ratios[f"{name}_{amp}_peak_rss_ratio_ours_over_peer"] = (
                        ours["peak_rss_mb"] / theirs["peak_rss_mb"]
                    )
        for mode in SERVING:
            o = res["ours"].get(f"infer_b1_{mode}", {}).get("s_per_chunk", {}).get("median")
            for peer_mode in ("fp32", "bf16", "fp32_compiled", "bf16_compiled"):
                p = peer.get(f"smolvla_infer_b1_{peer_mode}", {}).get("s_per_chunk", {}).get("median")
                if p and o:
                    ratios[f"infer_{mode}_vs_peer_{peer_mode}_speedup"] = p / o
        res["speedup"] = ratios
    res["mfu"] = {
        "train_b8": _mfu(res, "train_b8", "flops_per_step", "s_per_step"),
        "infer_b1": _mfu(res, "infer_b1", "flops_per_chunk", "s_per_chunk"),
    }
    emit(res, args.out)


def _mfu(res: dict, kind: str, flops_key: str, time_key: str) -> dict:
    """Achieved TFLOP/s and its fraction of the same dtype's matmul peak, per mode of ``kind`` (``train_b8`` or
    ``infer_b1``), ours and the peer's (whose FLOPs are taken as ours: same architecture)."""
    flops = res["ours"].get(f"{kind}_fp32", {}).get(flops_key)
    peak = res.get("matmul_peak", {})
    if not flops or "fp32_tflops" not in peak:
        return {}
    out: dict = {flops_key: flops, "peak_tflops": peak}
    timings = {f"ours_{k[len(kind) + 1 :]}": v.get(time_key, {}).get("median") for k, v in res["ours"].items()
               if k.startswith(kind)}  # fmt: skip
    for amp in ("fp32", "bf16", "fp32_compiled", "bf16_compiled"):
        timings[f"peer_{amp}"] = res.get("peer_lerobot", {}).get(f"smolvla_{kind}_{amp}", {}).get(time_key, {}).get("median")  # fmt: skip
    for name, sec in timings.items():
        against = peak.get("bf16_tflops" if "bf16" in name else "fp32_tflops")
        if sec and against:  # (no bf16 peak where bf16 was not timed)
            tflops = flops / sec / 1e12
            out[name] = {"tflops": tflops, "mfu": tflops / against}
    return out


if __name__ == "__main__":
    main()
