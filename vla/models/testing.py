"""Deterministic tiny models and batches for tests, golden values and benchmarks (no dataset, no download)."""

from __future__ import annotations

import numpy as np
import torch

from vla.data.collate import collate
from vla.embodiments import EmbodimentSpec, get_embodiment
from vla.models.config import ModelConfig, load_model_config
from vla.models.policies.flow_vla import FlowVLA
from vla.types import Batch

GOLDEN_EMBODIMENTS = ("widowx_bridge", "franka_droid")


def tiny_model(
    family: str = "smolvlm",
    embodiments: tuple[str, ...] = GOLDEN_EMBODIMENTS,
    seed: int = 0,
    **overrides: object,
) -> FlowVLA:
    """The ``tiny`` preset of ``family`` with the given embodiments, seeded (same seed -> same weights).
    ``overrides`` are ``ModelConfig`` fields; a ``backbone`` dict is merged into the family's tiny backbone."""
    backbone = {"family": family, "pretrained": f"tiny:{family}", **overrides.pop("backbone", {})}
    cfg: ModelConfig = load_model_config({"backbone": backbone, "chunk_length": 6, **overrides})
    torch.manual_seed(seed)
    specs: list[EmbodimentSpec] = [get_embodiment(n) for n in embodiments]
    return FlowVLA(cfg, specs).eval()


def synthetic_batch(
    model: FlowVLA,
    batch_size: int = 4,
    horizon: int = 6,
    image_hw: tuple[int, int] = (32, 40),
    seed: int = 0,
    embodiments: list[str] | None = None,
) -> Batch:
    """A mixed-embodiment ``Batch`` padded by the loader's own ``collate`` (embodiments alternate; each sample has
    its spec's cameras ``[1, H, W, 3]``, state ``[state_dim]`` and actions ``[horizon, action_dim]``), with seeded
    random pixels, states and actions; sample 0 ends two steps before its chunk does."""
    g = torch.Generator().manual_seed(seed)
    names = embodiments or [list(model.embodiment_ids)[i % len(model.specs)] for i in range(batch_size)]
    specs = [model.spec(n) for n in names]
    s_max, a_max = max(s.state_dim for s in specs), max(s.action_dim for s in specs)
    slots = sorted({slot for s in specs for slot in s.cameras})
    h, w = image_hw
    # Drawn batch-wide (one generator, fixed order) so golden values do not depend on the embodiment mix.
    images = {
        slot: torch.randint(0, 256, (batch_size, 1, h, w, 3), generator=g, dtype=torch.uint8)
        for slot in slots
    }
    state = torch.randn(batch_size, s_max, generator=g)
    actions = torch.randn(batch_size, horizon, a_max, generator=g)
    is_pad = np.zeros((batch_size, horizon), dtype=bool)
    is_pad[0, horizon - 2 :] = True
    prompts = [
        "pick up the red cube",
        "open the top drawer",
        "push the blue block to the left",
        "stack the cups",
    ]
    samples = [
        {
            "images": {slot: images[slot][i] for slot in spec.cameras},
            "state": state[i, : spec.state_dim].numpy(),
            "actions": actions[i, :, : spec.action_dim].numpy(),
            "action_is_pad": is_pad[i],
            "prompt": prompts[i % len(prompts)],
            "embodiment": spec.name,
            "dataset": "synthetic",
            "episode": i,
            "frame": 0,
        }
        for i, spec in enumerate(specs)
    ]
    batch = collate(samples, model.embodiment_ids)
    assert isinstance(batch, Batch)  # only skipped samples collate to a list of messages
    return batch
