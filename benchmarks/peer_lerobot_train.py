#!/usr/bin/env python3
"""LeRobot 0.6.1's own training script (``lerobot-train``, ``lerobot.scripts.lerobot_train``) on a local LeRobot
v3 dataset with SmolVLA, offline on the CPU, timed from its own per-step log lines.

Runs in the peer venv (``benchmarks/train.py`` starts it) and prints ``RESULT <json>`` like the peer's children:

    $PEER_VENV/bin/python benchmarks/peer_lerobot_train.py PEER_DIR '{"root": ..., "steps": 30, ...}'

The SmolVLA policy is the one ``../shared/peer/peer_lerobot_bench.py`` times (its ``SMOLVLA_OVERRIDES``: the tiny
local SmolVLM folder from ``make_local_smolvlm`` with ``load_vlm_weights=False``, 224 px, 8 VLM layers, chunk 50;
SmolVLA's defaults ``train_expert_only`` and ``freeze_vision_encoder``). LeRobot's loop is left as it is: its
DataLoader (episode-aware sampler, ``num_workers``, prefetch 4, persistent spawn workers), its preprocessor, its
optimizer preset and accelerate's autocast (``policy.use_amp=true`` -> bf16 on the CPU).

Timing: with ``log_freq=1`` every step logs ``updt_s`` (forward, backward, clip, optimizer and scheduler step) and
``data_s`` (waiting for the batch plus the preprocessor: normalization, tokenization), both from
``time.perf_counter`` in ``lerobot/scripts/lerobot_train.py``; a step is their sum. The wall-clock interval between
consecutive log lines is reported beside it as a cross-check. Steps after ``warmup`` are counted.
"""

from __future__ import annotations

import json
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

# stdlib only: importable from the peer venv (this script's folder is on sys.path)
from harness import kept_steps

# A MetricsTracker line, e.g. "step:7 smpl:56 ep:1 epch:0.23 loss:1.234 grdn:5.678 lr:1.0e-07 updt_s:1.234
# data_s:0.012 smp/s:6" (lerobot/utils/logging_utils.py MetricsTracker.__str__).
STEP_LINE = re.compile(r"step:\S+ smpl:\S+ .*?loss:(\S+) .*?updt_s:([\d.]+) data_s:([\d.]+)")


class _Tee:
    """A stream that passes writes on and records, for every complete line, its text and arrival time."""

    def __init__(self, stream) -> None:
        self.stream, self.buffer, self.lines = stream, "", []

    def write(self, text: str) -> int:
        now = time.perf_counter()
        self.buffer += text
        *done, self.buffer = re.split(r"[\r\n]", self.buffer)
        self.lines += [(now, line) for line in done if line]
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()


def command(job: dict, vlm_dir: Path, overrides: dict, output_dir: Path) -> list[str]:
    """The ``lerobot-train`` arguments: SmolVLA on the local dataset, CPU, no hub, no wandb, no eval, no saving."""
    resize = overrides["resize_imgs_with_padding"]
    return [
        f"--dataset.repo_id=local/{Path(job['root']).name}",
        f"--dataset.root={job['root']}",
        "--policy.type=smolvla",
        f"--policy.vlm_model_name={vlm_dir}",
        f"--policy.load_vlm_weights={str(overrides['load_vlm_weights']).lower()}",
        f"--policy.resize_imgs_with_padding=[{resize[0]},{resize[1]}]",
        f"--policy.num_vlm_layers={overrides['num_vlm_layers']}",
        f"--policy.chunk_size={overrides['chunk_size']}",
        f"--policy.n_action_steps={overrides['n_action_steps']}",
        "--policy.train_expert_only=true",
        "--policy.freeze_vision_encoder=true",
        "--policy.device=cpu",
        f"--policy.use_amp={'true' if job['amp'] == 'bf16' else 'false'}",
        "--policy.push_to_hub=false",
        f"--batch_size={job['batch']}",
        f"--num_workers={job['workers']}",
        f"--steps={job['steps']}",
        "--log_freq=1",
        "--save_checkpoint=false",
        "--env_eval_freq=0",
        "--eval_steps=0",
        "--wandb.enable=false",
        f"--seed={job.get('seed', 0)}",
        f"--output_dir={output_dir}",
    ]


def stats3(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def summarize(lines: list[tuple[float, str]], job: dict) -> dict:
    """Per-step timings from the log lines; the first ``warmup`` steps are dropped."""
    steps = [(t, *map(float, m.groups())) for t, line in lines if (m := STEP_LINE.search(line))]
    if len(steps) != job["steps"]:
        raise RuntimeError(f"expected {job['steps']} step log lines from lerobot-train, parsed {len(steps)}")
    timed = steps[job["warmup"] :]
    wall = [b[0] - a[0] for a, b in zip(steps[job["warmup"] - 1 :], timed)] if job["warmup"] else []
    longest = job.get("paused_step_s")  # a time-sliced run: steps a pause fell into are not counted
    # none left (every step held a pause): all kept here, and the common window reports the error
    keep = kept_steps([u + d for _, _, u, d in timed], longest) or list(range(len(timed)))
    dropped = len(timed) - len(keep)
    timed = [timed[i] for i in keep]
    update = [u for _, _, u, _ in timed]
    data = [d for _, _, _, d in timed]
    step = [u + d for u, d in zip(update, data)]
    n = len(timed) * job["batch"]
    out = {
        "timed_steps": len(timed),
        "s_per_step": stats3(step),
        "update_s": stats3(update),
        "data_s": stats3(data),
        "samples_per_s": n / sum(step),
        "samples_per_s_median_step": job["batch"] / statistics.median(step),
        "data_wait_frac": sum(data) / sum(step),
        "loss_first_last": [steps[0][1], steps[-1][1]],
    }
    if longest is not None:
        out["dropped_paused_steps"] = dropped
        out["step_s"] = [u + d for _, _, u, d in steps]  # every step, for the controller's common window
    elif wall:
        out["wall_s_per_step"] = stats3(wall)
        out["samples_per_s_wall"] = n / sum(wall)
    return out


def main() -> None:
    peer_dir, job = Path(sys.argv[1]), json.loads(sys.argv[2])
    sys.path.insert(0, str(peer_dir))
    import peer_lerobot_bench as peer  # the peer benchmark's tiny SmolVLM and SmolVLA settings
    import torch

    torch.set_num_threads(job["threads"])
    vlm_dir = peer.make_local_smolvlm(peer.DEFAULT_CACHE / "tiny_smolvlm")
    output_dir = Path(tempfile.mkdtemp(prefix="lerobot-train-")) / "run"  # must not exist yet
    args = command(job, vlm_dir, peer.SMOLVLA_OVERRIDES, output_dir)
    from lerobot.scripts import lerobot_train

    tee = _Tee(sys.stderr)
    sys.stderr, sys.argv = tee, ["lerobot-train", *args]
    t0 = time.perf_counter()
    try:
        lerobot_train.main()
    finally:
        sys.stderr = tee.stream
    res = summarize(tee.lines, job)
    res |= {
        "wall_s_total": time.perf_counter() - t0,
        "command": "lerobot-train " + " ".join(args),
        "versions": peer.versions(),
        "peak_rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_rss_workers_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        **{k: job[k] for k in ("steps", "warmup", "batch", "workers", "amp", "threads")},
    }
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
