"""Deterministic tiny models and batches for tests, golden values and benchmarks (no dataset, no download)."""

from __future__ import annotations

import torch

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
    """A mixed-embodiment ``Batch`` in the loader's layout (embodiments alternate; each sample has the spec's
    cameras), with seeded random pixels, states and actions and a few padded steps."""
    g = torch.Generator().manual_seed(seed)
    names = embodiments or [list(model.embodiment_ids)[i % len(model.specs)] for i in range(batch_size)]
    specs = [model.spec(n) for n in names]
    s_max, a_max = max(s.state_dim for s in specs), max(s.action_dim for s in specs)
    slots = sorted({slot for s in specs for slot in s.cameras})
    h, w = image_hw
    images = {
        slot: torch.randint(0, 256, (batch_size, 1, h, w, 3), generator=g, dtype=torch.uint8)
        for slot in slots
    }
    image_mask = {slot: torch.tensor([slot in s.cameras for s in specs]) for slot in slots}
    for slot in slots:
        images[slot][~image_mask[slot]] = 0
    state = torch.randn(batch_size, s_max, generator=g)
    state_mask = torch.zeros(batch_size, s_max, dtype=torch.bool)
    actions = torch.randn(batch_size, horizon, a_max, generator=g)
    action_mask = torch.zeros(batch_size, a_max, dtype=torch.bool)
    for i, s in enumerate(specs):
        state_mask[i, : s.state_dim] = True
        action_mask[i, : s.action_dim] = True
    state, actions = state * state_mask, actions * action_mask[:, None, :]
    is_pad = torch.zeros(batch_size, horizon, dtype=torch.bool)
    is_pad[0, horizon - 2 :] = True  # sample 0 ends two steps before its chunk does
    prompts = [
        "pick up the red cube",
        "open the top drawer",
        "push the blue block to the left",
        "stack the cups",
    ]
    return Batch(
        images=images,
        image_mask=image_mask,
        state=state,
        state_mask=state_mask,
        actions=actions,
        action_mask=action_mask,
        action_is_pad=is_pad,
        prompt=[prompts[i % len(prompts)] for i in range(batch_size)],
        embodiment_id=torch.tensor([model.embodiment_ids[n] for n in names], dtype=torch.int64),
    )
