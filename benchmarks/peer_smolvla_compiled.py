#!/usr/bin/env python3
"""LeRobot 0.6.1's SmolVLA inference with its own ``compile_model=True`` (``torch.compile`` of ``sample_actions``,
LeRobot's default mode ``max-autotune``), at exactly the config and batch of ``../shared/peer/`` — so our compiled
serving mode is compared with the peer's compiled one, not only with its eager modes.

Runs in the peer venv (``benchmarks/model.py`` starts it); prints ``RESULT <json>`` like the peer's children:

    $PEER_VENV/bin/python benchmarks/peer_smolvla_compiled.py PEER_DIR '{"amp": "bf16", "threads": 2, ...}'
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    peer_dir, job = Path(sys.argv[1]), json.loads(sys.argv[2])
    sys.path.insert(0, str(peer_dir))
    import peer_lerobot_bench as peer  # the peer's own builders, batch and timing loop

    peer.SMOLVLA_OVERRIDES = {**peer.SMOLVLA_OVERRIDES, "compile_model": True}
    vlm_dir = peer.make_local_smolvlm(peer.DEFAULT_CACHE / "tiny_smolvlm")
    t0 = time.perf_counter()
    res = peer.child_infer({"kind": "infer", "policy": "smolvla", "vlm_dir": str(vlm_dir), **job})
    res["wall_s_including_compile"] = time.perf_counter() - t0
    res["compile_model"] = True
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
