#!/usr/bin/env python3
"""Data-loader throughput, side by side with LeRobot 0.6.1's ``LeRobotDataset`` on the same files (one JSON line).

Setting (the one ``../shared/peer/`` measures LeRobot with): a LeRobot v3.0 dataset written by LeRobot's own
writer — 6 episodes x 40 frames, two 96x128 AV1 cameras, 8-d state, 7-d action — read through a torch DataLoader
with batch 8, shuffled, a 10-step action chunk per sample, 0 and 2 workers. We read exactly the same files.
The same setting is also measured on an RLDS copy (JPEG per step) written with our RLDS writer.

Our loader does strictly more per sample than LeRobotDataset here (key-map standardization, collation into a
padded mixed-embodiment ``Batch`` with masks). Our video decoder keeps a per-process cache of decoded frames
(``VLA_VIDEO_CACHE_MB``, default 256): on this tiny dataset every frame fits, so after the warm-up epoch a
cached run never decodes again. The headline comparison therefore uses ``VLA_VIDEO_CACHE_MB=0`` (every frame
decoded every time, as LeRobot does); the cached figure is reported beside it.

    .venv/bin/python benchmarks/data_loader.py [--reps 5] [--skip-peer] [--out FILE.json]

The peer runs only where its venv exists (``../shared/peer/setup_lerobot_venv.sh``; ``$PEER_VENV``).
Each measurement runs in its own subprocess so each peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import time
from pathlib import Path

from harness import PEER_DIR, PEER_VENV, cpu_model, emit, peak_rss_mb, run_child, run_peer, stats3

PEER_CACHE = Path(os.environ.get("PEER_LEROBOT_CACHE", "/tmp/peer_lerobot_cache"))
PEER_DATASET = PEER_CACHE / "lerobot_v3_sample"
OWN_CACHE = Path(os.environ.get("VLA_BENCH_CACHE", "/tmp/vla_bench_data"))
N_EP, N_FR, H, W, STATE, ACTION, FPS = 6, 40, 96, 128, 8, 7, 10
BATCH, CHUNK = 8, 10


def ensure_lerobot_dataset() -> tuple[Path, str]:
    """The peer's LeRobot-written sample (same files for both sides) or, without the peer, our equivalent."""
    peer_py = PEER_VENV / "bin" / "python"
    if not (PEER_DATASET / "meta" / "info.json").exists() and peer_py.exists():
        subprocess.run(
            [str(peer_py), str(PEER_DIR / "peer_lerobot_bench.py"), "make-dataset"],
            check=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            capture_output=True,
        )
    if (PEER_DATASET / "meta" / "info.json").exists():
        return PEER_DATASET, "written by LeRobot 0.6.1 (peer make-dataset)"
    from vla.data.writers.synthetic import make_lerobot_dataset

    root = OWN_CACHE / "lerobot_v3_sample"
    if not (root / "meta" / "info.json").exists():
        make_lerobot_dataset(
            root,
            num_episodes=N_EP,
            episode_length=N_FR,
            cameras={"front": (H, W), "wrist": (H, W)},
            state_dim=STATE,
            action_dim=ACTION,
            fps=FPS,
            robot_type="synthetic_7dof",
        )
    return root, "written by vla's LeRobotWriter (peer venv absent)"


def ensure_rlds_dataset(src: Path) -> Path:
    """An RLDS copy of the LeRobot sample: same frames (JPEG q95), state, action and tasks."""
    import numpy as np

    from vla.data.readers import open_dataset
    from vla.data.writers.rlds import image, scalar, tensor, text, write_rlds

    out = OWN_CACHE / "rlds_sample"
    if (out / "dataset_info.json").exists():
        return out
    reader = open_dataset(src)
    episodes = []
    for e in range(reader.num_episodes("train")):
        raw = reader.read_episode("train", e)
        imgs = reader.read_images("train", e, list(range(raw.length)), reader.image_keys())
        steps = {
            "observation/state": raw.steps["observation.state"],
            "action": raw.steps["action"],
            "observation/image_front": imgs["observation.images.front"],
            "observation/image_wrist": imgs["observation.images.wrist"],
            "language_instruction": [str(t) for t in raw.steps["task"]],
            "is_first": np.arange(raw.length) == 0,
            "is_last": np.arange(raw.length) == raw.length - 1,
        }
        episodes.append({"steps": steps})
    spec = {
        "observation/state": tensor([STATE]),
        "action": tensor([ACTION]),
        "observation/image_front": image([H, W, 3]),
        "observation/image_wrist": image([H, W, 3]),
        "language_instruction": text(),
        "is_first": scalar("bool"),
        "is_last": scalar("bool"),
    }
    write_rlds(out, "bench_rlds_sample", {"train": episodes}, spec)
    return out


def bench_keymap(fmt: str):
    """An explicit key map for the benchmark datasets (their robot_type is not a registered embodiment)."""
    from vla.data.keymaps import KeyMap, raw

    if fmt == "lerobot":
        cams = {"primary": "observation.images.front", "wrist": "observation.images.wrist"}
        state, action, lang = "observation.state", "action", "task"
    else:
        cams = {"primary": "observation/image_front", "wrist": "observation/image_wrist"}
        state, action, lang = "observation/state", "action", "language_instruction"
    features = {state: f"float32[{STATE}]", action: f"float32[{ACTION}]", lang: "string"}
    return KeyMap(
        dataset=f"bench_{fmt}",
        embodiment="franka_oxe_joint",
        cameras=cams,
        language=lang,
        control_hz=FPS,
        action_space="joint_delta",
        state=(raw(state),),
        action=(raw(action),),
        features=features,
    )


# ---- one measurement (child process) ---------------------------------------------------------------------------
def child_ours(job: dict) -> dict:
    import torch

    from vla.config import DataConfig, load_config
    from vla.data.loader import VLALoader, WindowDataset, build_source
    from vla.data.readers import open_dataset

    torch.set_num_threads(job["threads"])
    cfg = load_config(
        DataConfig,
        {
            "datasets": [job["path"]],
            "batch_size": BATCH,
            "chunk_length": CHUNK,
            "image_size": 0,
            "normalize": False,
            "num_workers": job["workers"],
            "shuffle": True,
        },
    )
    source = build_source(open_dataset(job["path"]), "train", keymap=bench_keymap(job["format"]))
    loader = VLALoader(
        WindowDataset([source], cfg, train=True), cfg, {"franka_oxe_joint": 0}, drop_last=False
    )
    # workers started per epoch, as in the peer's loader benchmark (LeRobot's DataLoader default; its trainer and
    # ours keep them): each epoch's figure includes their start-up, and RUSAGE_CHILDREN counts reaped workers
    loader.persistent_workers = False
    shapes = None
    for b in loader:  # warm-up epoch (as the peer does)
        shapes = shapes or {"images/" + k: list(v.shape) for k, v in b.images.items()} | {
            "state": list(b.state.shape),
            "actions": list(b.actions.shape),
        }
    epoch_sps, steady_sps, first = [], [], []
    for _ in range(job["reps"]):
        n = n_after = 0
        t0 = time.perf_counter()
        t1 = None
        for b in loader:
            n += b.batch_size
            if t1 is None:
                t1 = time.perf_counter()
            else:
                n_after += b.batch_size
        t2 = time.perf_counter()
        epoch_sps.append(n / (t2 - t0))
        steady_sps.append(n_after / (t2 - t1))
        first.append(t1 - t0)
    return {
        "format": job["format"],
        "num_workers": job["workers"],
        "video_cache_mb": job.get("cache_mb"),
        "samples_per_epoch": len(loader.dataset),
        "batch_shapes": shapes,
        "samples_per_s_epoch": stats3(epoch_sps),
        "samples_per_s_after_first_batch": stats3(steady_sps),
        "first_batch_s": stats3(first),
        "peak_rss_main_mb": peak_rss_mb(),
        "peak_rss_workers_mb": peak_rss_mb(resource.RUSAGE_CHILDREN),
    }


def run_peer_data(reps: int, threads: int) -> dict:
    args = [
        "--only",
        "data",
        "--data-reps",
        str(reps),
        "--threads",
        str(threads),
        "--root",
        str(PEER_DATASET),
    ]
    return run_peer(args, OWN_CACHE / "peer_data.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", nargs="?", default="bench", choices=["bench", "_child"])
    ap.add_argument("job", nargs="?")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.cmd == "_child":
        print("RESULT " + json.dumps(child_ours(json.loads(args.job))), flush=True)
        return
    OWN_CACHE.mkdir(parents=True, exist_ok=True)
    lerobot_path, provenance = ensure_lerobot_dataset()
    rlds_path = ensure_rlds_dataset(lerobot_path)
    res: dict = {
        "benchmark": "data_loader",
        "cpu_model": cpu_model(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu_count": os.cpu_count(),
        "setting": {
            "batch": BATCH,
            "action_chunk": CHUNK,
            "shuffle": True,
            "cameras": 2,
            "camera_hw": [H, W],
            "state_dim": STATE,
            "action_dim": ACTION,
            "episodes": N_EP,
            "frames_per_episode": N_FR,
            "reps": args.reps,
            "threads": args.threads,
        },
        "datasets": {
            "lerobot_v3": {"path": str(lerobot_path), "provenance": provenance},
            "rlds": {"path": str(rlds_path), "provenance": "RLDS copy written by vla (JPEG q95)"},
        },
        "ours": {},
    }
    common = {"reps": args.reps, "threads": args.threads}
    for workers in (0, 2):
        for cache_mb in ("0", "256"):
            res["ours"][f"lerobot_v3_w{workers}_cache{cache_mb}mb"] = run_child(
                __file__,
                {
                    "format": "lerobot",
                    "path": str(lerobot_path),
                    "workers": workers,
                    "cache_mb": cache_mb,
                    **common,
                },
                {"VLA_VIDEO_CACHE_MB": cache_mb},
            )
        res["ours"][f"rlds_w{workers}"] = run_child(
            __file__, {"format": "rlds", "path": str(rlds_path), "workers": workers, **common}
        )
    if not args.skip_peer:
        peer = run_peer_data(args.reps, args.threads)
        res["peer_lerobot"] = peer
        ratios = {}
        for workers in (0, 2):
            p = peer.get(f"data_torchcodec_w{workers}", {}).get("samples_per_s_epoch", {}).get("median")
            o = res["ours"][f"lerobot_v3_w{workers}_cache0mb"].get("samples_per_s_epoch", {}).get("median")
            if p and o:
                ratios[f"w{workers}_ours_nocache_vs_lerobot_torchcodec"] = o / p
        res["speedup"] = ratios
    emit(res, args.out)


if __name__ == "__main__":
    main()
