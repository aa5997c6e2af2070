#!/usr/bin/env python3
"""Loader start-up on a DROID-shaped RLDS dataset: cold episode-index build vs warm start (one JSON line).

Start-up needs every episode's kept-frame count; without an index that means standardizing (for RLDS: parsing,
images included) every episode, every launch, on every rank. With the index (``vla.data.episode_index``) a
cold start builds it in one parallel pass and a warm start reads only metadata. Bytes read are counted with
``rchar`` of ``/proc/self/io`` (read()/pread() bytes of the process and its reaped children, page-cache hits
included), so the figures do not depend on what the page cache holds; times do.

Measured, each in its own subprocess with vla imported before counting, with openpi's DROID training filters
(``idle_filter``, ``success_only``): ``no_index`` (``VLA_NO_INDEX_CACHE=1``: every launch standardizes every
episode, in the same worker processes as a build), ``cold`` (``build_source`` building the index) and ``warm``
(``build_source``, and the whole ``build_loader`` with ``data.normalize=false``, reading the index back).
``index_lookup_100k`` times the warm lookup alone (file identities + index load and checks) for 100,000
episodes over a fake file list in two layouts: an RLDS folder of 2,048 shards and a LeRobot v2.1 folder of one
parquet per episode.

    .venv/bin/python benchmarks/loader_startup.py [--episodes 2000] [--path RLDS_DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from harness import cpu_model, emit, run_child, stats3

CACHE = Path(os.environ.get("VLA_BENCH_CACHE", "/tmp/vla_bench_data"))
IMAGE = (48, 64, 3)
PER_SHARD = 45  # episodes per shard file


def ensure_dataset(episodes: int, min_len: int, max_len: int) -> tuple[Path, float | None]:
    """A DROID-shaped RLDS version folder named ``droid`` (the DROID key map applies), written once; and the
    seconds writing it took (None when it already existed)."""
    import numpy as np

    from vla.data.writers.rlds import droid_features, synthetic_droid_episode, write_rlds

    root = CACHE / f"droid_startup_{episodes}x{min_len}-{max_len}" / "droid" / "1.0.0"
    if (root / "dataset_info.json").is_file():
        return root, None
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    eps = [
        synthetic_droid_episode(rng, int(rng.integers(min_len, max_len + 1)), IMAGE) for _ in range(episodes)
    ]
    for i in range(0, episodes, 5):  # every fifth episode a failure, as success_only would drop it
        eps[i]["episode_metadata"]["file_path"] = "LAB0/failure/2023-07-01/trajectory.h5"
    tmp = root.with_name(".writing")
    shutil.rmtree(tmp, ignore_errors=True)
    write_rlds(tmp, "droid", {"train": eps}, *droid_features(IMAGE), num_shards=max(1, episodes // PER_SHARD))
    tmp.rename(root)
    return root, time.perf_counter() - t0


def dataset_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


# ---- children ----------------------------------------------------------------------------------------------
def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def child_start(job: dict) -> dict:
    """``build_source`` or ``build_loader`` (``job["step"]``) on ``job["path"]``: bytes read and seconds."""
    import vla.data.normalize
    import vla.data.readers.rlds  # noqa: F401
    from vla.config import DataConfig, load_config
    from vla.data.episode_index import default_workers
    from vla.data.keymaps import KEYMAPS
    from vla.data.loader import build_loader, standardize_options
    from vla.data.readers import open_dataset
    from vla.data.windows import build_source
    from vla.embodiments import get_embodiment

    # Code is imported and configs parsed before counting (a trainer has done it by then): rchar counts every
    # read, and importing vla's modules reads ~0.3 MB of .pyc files.
    KEYMAPS.names(), get_embodiment("franka_droid")
    cfg = load_config(
        DataConfig,
        {
            "datasets": [job["path"]],
            "normalize": False,
            "image_size": 0,
            "standardize": {"idle_filter": True, "success_only": True},
        },
    )
    r0, t0 = _rchar(), time.perf_counter()
    if job["step"] == "build_source":
        src = build_source(
            open_dataset(job["path"]), "train", options=standardize_options(cfg), workers=job["workers"]
        )
    else:
        src = build_loader(cfg).dataset.sources[0]
    out = {"seconds": time.perf_counter() - t0, "rchar_bytes": _rchar() - r0}
    return out | {
        "episodes": len(src.lengths),
        "kept_samples": src.num_samples,
        "index": str(src.index) if src.index else None,
        "index_bytes": src.index.stat().st_size if src.index else 0,
        "workers": default_workers(len(src.lengths)) if job["workers"] is None else job["workers"],
    }


def child_lookup(job: dict) -> dict:
    """Time the warm lookup of a 100k-episode index over a fake file list (``job["layout"]``)."""
    import numpy as np

    from vla.data.episode_index import EpisodeIndex, file_identity, find_index, index_paths, key_digest

    n, reps = job["episodes"], job["reps"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "dataset"
        if job["layout"] == "rlds":
            root.mkdir()
            (root / "dataset_info.json").write_text("{}")
            (root / "features.json").write_text("{}")
            names = [f"droid-train.tfrecord-{i:05d}-of-{job['files']:05d}" for i in range(job["files"])]
            fmt = "rlds"
        else:
            (root / "meta").mkdir(parents=True)
            (root / "meta" / "info.json").write_text("{}")
            names = [f"data/chunk-{i // 1000:03d}/episode_{i:06d}.parquet" for i in range(job["files"])]
            fmt = "lerobot_v2.1"
        for name in names:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(b"x" * 64)
        key = {"format_version": 1, "keymap": "synthetic", "n": n}
        lengths = np.random.default_rng(0).integers(100, 400, n)
        path = index_paths(root, key_digest(key))[0]
        EpisodeIndex(key, file_identity(root, fmt), {"train": lengths}).save(path)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            index, rejected = find_index(
                index_paths(root, key_digest(key)), key, file_identity(root, fmt), ["train"]
            )
            times.append(time.perf_counter() - t0)
            assert index is not None and not rejected and len(index.lengths["train"]) == n
        return {
            "layout": job["layout"],
            "episodes": n,
            "files": len(names),
            "index_bytes": path.stat().st_size,
            "seconds": stats3(times),
        }


# ---- driver ------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", nargs="?", default="bench", choices=["bench", "_child"])
    ap.add_argument("job", nargs="?")
    ap.add_argument("--path", default="", help="an existing RLDS version folder of a dataset named droid")
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--min-length", type=int, default=15)
    ap.add_argument("--max-length", type=int, default=45)
    ap.add_argument("--workers", type=int, default=None, help="index build processes (default: vla's choice)")
    ap.add_argument("--lookup-episodes", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.cmd == "_child":
        job = json.loads(args.job)
        print("RESULT " + json.dumps(child_lookup(job) if "layout" in job else child_start(job)), flush=True)
        return
    if args.path:
        path, written_s = Path(args.path), None
    else:
        path, written_s = ensure_dataset(args.episodes, args.min_length, args.max_length)
    size = dataset_bytes(path)
    shutil.rmtree(path / "meta", ignore_errors=True)  # no index yet: the first start is cold
    job = {"path": str(path), "workers": args.workers, "step": "build_source"}
    no_index = run_child(__file__, job, {"VLA_NO_INDEX_CACHE": "1"})
    cold = run_child(__file__, job)
    warm = {
        step: [run_child(__file__, job | {"step": step}) for _ in range(args.reps)]
        for step in ("build_source", "build_loader")
    }
    for r in (no_index, cold, *warm["build_source"], *warm["build_loader"]):
        if "error" in r:
            raise SystemExit(r["error"])
        r["fraction_of_dataset"] = r["rchar_bytes"] / size
    warm_summary = {
        step: {
            "seconds": stats3([r["seconds"] for r in runs]),
            "rchar_bytes": stats3([r["rchar_bytes"] for r in runs]),
            "fraction_of_dataset_max": max(r["fraction_of_dataset"] for r in runs),
        }
        for step, runs in warm.items()
    }
    lookups = {
        layout: run_child(
            __file__,
            {"layout": layout, "episodes": args.lookup_episodes, "files": files, "reps": args.reps},
        )
        for layout, files in (("rlds", 2048), ("lerobot_v2.1", args.lookup_episodes))
    }
    emit(
        {
            "benchmark": "loader_startup",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(),
            "dataset": {
                "path": str(path),
                "bytes": size,
                "episodes": cold["episodes"],
                "kept_samples": cold["kept_samples"],
                "image_hw": list(IMAGE[:2]),
                "cameras": 3,
                "written_s": written_s,
            },
            "options": {"idle_filter": True, "success_only": True},
            "workers": cold["workers"],
            "index_bytes": cold["index_bytes"],
            "no_index": no_index,
            "cold": cold,
            "warm": warm_summary,
            "index_lookup_100k": lookups,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
