#!/usr/bin/env python3
"""Regenerate model_cards/tiny_smolvlm_example.md: the generated card of an untrained tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

from vla.embodiments import get_embodiment
from vla.models.config import load_model_config
from vla.models.hub import model_card
from vla.models.policies.flow_vla import FlowVLA

OUT = Path(__file__).resolve().parents[1] / "model_cards" / "tiny_smolvlm_example.md"

if __name__ == "__main__":
    model = FlowVLA(
        load_model_config("tiny_smolvlm"), [get_embodiment("widowx_bridge"), get_embodiment("franka_droid")]
    )
    OUT.write_text(model_card(model))
    print(f"wrote {OUT}")
