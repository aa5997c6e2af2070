"""Model configuration: backbone, action expert, flow matching and per-embodiment head sizes.

One YAML preset per model under ``configs/model/`` (``load_model_config("tiny_smolvlm", ["flow.num_steps=5"])``).
``backbone.pretrained`` is a hub id, a local directory, or ``tiny:<family>[:<size>]`` — a randomly initialised
model of the real classes built locally by ``vla.models.tiny`` (tests and the demo), loaded through the very same
``from_pretrained`` path as real weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vla.config import ConfigError, _require, load_config

FAMILIES = ("smolvlm", "paligemma", "paligemma2")


@dataclass(frozen=True)
class BackboneConfig:
    """The Hugging Face VLM. ``num_vlm_layers`` keeps only the first N language layers (SmolVLA does; 0 = all)."""

    family: str = "smolvlm"
    pretrained: str = "tiny:smolvlm"
    num_vlm_layers: int = 0
    image_size: int = 0  # 0 = the vision tower's native resolution
    max_prompt_tokens: int = 48
    freeze_vision: bool = True
    freeze_language: bool = False
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        _require(
            self.family in FAMILIES, f"model.backbone.family must be one of {FAMILIES}, got {self.family!r}"
        )
        _require(
            self.num_vlm_layers >= 0, f"model.backbone.num_vlm_layers must be >= 0, got {self.num_vlm_layers}"
        )
        _require(self.image_size >= 0, f"model.backbone.image_size must be >= 0, got {self.image_size}")
        _require(
            self.max_prompt_tokens >= 1,
            f"model.backbone.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}",
        )


@dataclass(frozen=True)
class ExpertConfig:
    """The action expert: a smaller transformer of the backbone's layer class whose layer ``i`` attends to the
    backbone's layer-``i`` keys/values. ``num_layers`` 0 = as many as backbone layers used."""

    width_ratio: float = 0.75
    mlp_ratio: float = 4.0
    num_layers: int = 0
    compile: bool = False

    def __post_init__(self) -> None:
        _require(
            0.05 <= self.width_ratio <= 4.0,
            f"model.expert.width_ratio must be in [0.05, 4], got {self.width_ratio}",
        )
        _require(self.mlp_ratio > 0, f"model.expert.mlp_ratio must be > 0, got {self.mlp_ratio}")
        _require(self.num_layers >= 0, f"model.expert.num_layers must be >= 0, got {self.num_layers}")


@dataclass(frozen=True)
class FlowConfig:
    """Flow matching: t ~ Beta(alpha, beta) (scaled into [t_min, 1]); Euler integration from noise (t=1) to actions."""

    num_steps: int = 10
    beta_alpha: float = 1.5
    beta_beta: float = 1.0
    t_min: float = 0.001

    def __post_init__(self) -> None:
        _require(self.num_steps >= 1, f"model.flow.num_steps must be >= 1, got {self.num_steps}")
        _require(
            self.beta_alpha > 0 and self.beta_beta > 0, "model.flow.beta_alpha and beta_beta must be > 0"
        )
        _require(0 <= self.t_min < 1, f"model.flow.t_min must be in [0, 1), got {self.t_min}")


@dataclass(frozen=True)
class ModelConfig:
    """The whole VLA. ``max_state_dim``/``max_action_dim`` are the widths of the per-embodiment head tables (every
    embodiment's own dims must fit); ``chunk_length`` is the default H (each embodiment may use fewer)."""

    policy: str = "flow_vla"
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    expert: ExpertConfig = field(default_factory=ExpertConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    embodiments: tuple[str, ...] = ()
    max_state_dim: int = 32
    max_action_dim: int = 32
    chunk_length: int = 50

    def __post_init__(self) -> None:
        _require(self.max_state_dim >= 1, f"model.max_state_dim must be >= 1, got {self.max_state_dim}")
        _require(self.max_action_dim >= 1, f"model.max_action_dim must be >= 1, got {self.max_action_dim}")
        _require(self.chunk_length >= 1, f"model.chunk_length must be >= 1, got {self.chunk_length}")
        _require(
            len(set(self.embodiments)) == len(self.embodiments),
            f"model.embodiments has duplicates: {self.embodiments}",
        )


def load_model_config(
    preset: str | Path | dict[str, Any] | None = None, overrides: list[str] | None = None
) -> ModelConfig:
    """A ``ModelConfig`` from a preset name under ``configs/model/``, a YAML path or a dict, plus dotted overrides."""
    try:
        return load_config(ModelConfig, preset, overrides, kind="model")
    except ConfigError:
        raise
