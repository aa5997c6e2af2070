"""Where the LeRobot 0.6.1 peer venv is (built by ../shared/peer/setup_lerobot_venv.sh), for interop tests."""

from __future__ import annotations

import os
from pathlib import Path


def peer_python() -> Path | None:
    """The peer venv's python (``PEER_VENV``, default ``$TMPDIR/peer-venv``), or None when it is not built."""
    venv = os.environ.get("PEER_VENV") or str(Path(os.environ.get("TMPDIR", "/tmp")) / "peer-venv")
    python = Path(venv) / "bin" / "python"
    return python if python.exists() else None


# A script for the peer venv: ``python -c LOAD_ITEMS ROOT QUERY_JSON OUT`` loads ROOT with LeRobotDataset under both
# video backends and collects, per backend, len/num_episodes/fps and for each index in QUERY its low-dim values
# and task (``result[backend]["items"]``); camera frames are saved as uint8 ``OUT/<backend>-<idx>-<key>.npy``.
# Callers append their own checks and end with ``(out / "result.json").write_text(json.dumps(result))``.
LOAD_ITEMS = """
import json, sys
from pathlib import Path
import numpy as np
from lerobot.datasets.lerobot_dataset import LeRobotDataset
root, query, out = Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])
result = {}
for backend in ("torchcodec", "pyav"):
    ds = LeRobotDataset("local/" + root.name, root=root, video_backend=backend)
    res = result[backend] = {"len": len(ds), "num_episodes": ds.num_episodes, "fps": ds.fps, "items": []}
    for idx in query:
        item = ds[idx]
        row = {k: item[k].tolist() for k in ("observation.state", "action", "episode_index", "frame_index", "index")}
        row["task"] = item["task"]
        for k in [k for k in item if k.startswith("observation.images.")]:
            img = (item[k].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
            np.save(out / f"{backend}-{idx}-{k}.npy", img)
        res["items"].append(row)
"""
