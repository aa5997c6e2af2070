#!/usr/bin/env python3
"""Regenerate tests/assets/flow_vla_tiny_golden.safetensors: the seeded loss and sampled actions of the tiny
presets (SmolVLM and PaliGemma) on a fixed synthetic batch. Run after an intended numerical change, then review
the diff in test output before committing:  .venv/bin/python scripts/make_golden.py"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from vla.models.testing import synthetic_batch, tiny_model

OUT = Path(__file__).resolve().parents[1] / "tests" / "assets" / "flow_vla_tiny_golden.safetensors"


def golden(family: str) -> dict[str, torch.Tensor]:
    model = tiny_model(family)
    batch = synthetic_batch(model)
    with torch.no_grad():
        loss, _ = model.loss(batch, generator=torch.Generator().manual_seed(7))
    actions = model.sample_actions(batch, generator=torch.Generator().manual_seed(11))
    return {f"{family}/loss": loss.reshape(1), f"{family}/actions": actions}


def main() -> None:
    tensors = {**golden("smolvlm"), **golden("paligemma")}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata={"torch": torch.__version__})
    print(f"wrote {OUT}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items()))


if __name__ == "__main__":
    main()
