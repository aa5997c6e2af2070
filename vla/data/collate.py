"""Collation of samples into a padded, mixed-embodiment ``Batch`` (shapes in ``vla.types``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vla.types import Batch


def collate(samples: Sequence[dict[str, Any] | None], embodiment_ids: dict[str, int]) -> Batch | list[str]:
    """Pad a list of samples into one ``Batch`` (shapes in ``vla.types``); skipped samples are dropped and counted
    in ``meta["skipped"]`` (a batch of only bad samples collates to the list of their messages). Slots missing from a sample are zero images with ``image_mask`` False."""
    skipped = [s["__skipped__"] for s in samples if s is not None and "__skipped__" in s]
    good = [s for s in samples if s is not None and "__skipped__" not in s]
    if not good:
        return skipped  # the loader counts and logs these, and moves on to the next batch
    b = len(good)
    s_max = max(len(s["state"]) for s in good)
    h_max = max(s["actions"].shape[0] for s in good)
    a_max = max(s["actions"].shape[1] for s in good)
    state = torch.zeros(b, s_max)
    state_mask = torch.zeros(b, s_max, dtype=torch.bool)
    actions = torch.zeros(b, h_max, a_max)
    action_mask = torch.zeros(b, a_max, dtype=torch.bool)
    is_pad = torch.ones(b, h_max, dtype=torch.bool)
    slots = sorted({k for s in good for k in s["images"]})
    images: dict[str, torch.Tensor] = {}
    image_mask: dict[str, torch.Tensor] = {}
    for slot in slots:
        shapes = {tuple(s["images"][slot].shape) for s in good if slot in s["images"]}
        if len(shapes) > 1:
            raise ValueError(
                f"camera slot {slot!r} has different image shapes in one batch {sorted(shapes)}; set data.image_size "
                "to resize every camera to one size"
            )
        shape = shapes.pop()
        images[slot] = torch.zeros(b, *shape, dtype=torch.uint8)
        image_mask[slot] = torch.zeros(b, dtype=torch.bool)
    for i, s in enumerate(good):
        sd, (h, a) = len(s["state"]), s["actions"].shape
        state[i, :sd] = torch.from_numpy(s["state"])
        state_mask[i, :sd] = torch.from_numpy(np.asarray(s.get("state_valid", True), dtype=bool))
        actions[i, :h, :a] = torch.from_numpy(s["actions"])
        action_mask[i, :a] = True
        is_pad[i, :h] = torch.from_numpy(np.asarray(s["action_is_pad"]))
        for slot, img in s["images"].items():
            images[slot][i] = img
            image_mask[slot][i] = True
    unknown = sorted({s["embodiment"] for s in good} - set(embodiment_ids))
    if unknown:
        raise KeyError(
            f"embodiment(s) {unknown} are not in the loader's embodiment table {sorted(embodiment_ids)}"
        )
    return Batch(
        images=images,
        image_mask=image_mask,
        state=state,
        state_mask=state_mask,
        actions=actions,
        action_mask=action_mask,
        action_is_pad=is_pad,
        prompt=[s["prompt"] for s in good],
        embodiment_id=torch.tensor([embodiment_ids[s["embodiment"]] for s in good], dtype=torch.int64),
        meta={
            "embodiment": [s["embodiment"] for s in good],
            "dataset": [s["dataset"] for s in good],
            "episode": [s["episode"] for s in good],
            "frame": [s["frame"] for s in good],
            "skipped": skipped,
        },
    )


class _Collate:
    """Picklable collate function bound to an embodiment table (DataLoader workers need to pickle it)."""

    def __init__(self, embodiment_ids: dict[str, int]) -> None:
        self.embodiment_ids = embodiment_ids

    def __call__(self, samples: Sequence[dict[str, Any] | None]) -> Batch | list[str]:
        return collate(samples, self.embodiment_ids)
