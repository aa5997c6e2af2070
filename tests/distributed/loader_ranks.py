"""Run under ``torchrun --nproc_per_node 2``: each rank builds the loader from the same config (rank/world from
the initialized gloo group), iterates one epoch, and rank 0 checks that the ranks' samples are disjoint, equally
many, and together cover the data; writes the verdict to ``argv[2]``."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from vla.config import DataConfig, load_config
from vla.data.loader import build_loader


def main() -> None:
    dataset, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    cfg = load_config(
        DataConfig,
        {"datasets": [dataset], "image_size": 0, "normalize": False, "batch_size": 2, "chunk_length": 3},
    )
    loader = build_loader(cfg)
    keys = [(ep, fr) for b in loader for ep, fr in zip(b.meta["episode"], b.meta["frame"])]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, keys)
    if dist.get_rank() == 0:
        sets = [set(map(tuple, g)) for g in gathered]
        total = len(loader.dataset)
        verdict = {
            "counts": [len(g) for g in gathered],
            "disjoint": not (sets[0] & sets[1]),
            "covered": len(sets[0] | sets[1]),
            "total": total,
            "ranks": [loader.order.rank, loader.order.world_size],
        }
        with open(out, "w") as f:
            json.dump(verdict, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
