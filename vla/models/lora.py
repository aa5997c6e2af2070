"""LoRA adapters (peft) on the VLA's backbone language layers and action expert.

``apply_lora(model, LoraSettings(...))`` wraps the attention (q/k/v/o) and MLP (gate/up/down) projections of every
backbone language layer and/or expert layer with peft's ``lora.Linear`` (``W x + B A x * alpha / r``; B starts at
zero, so a freshly adapted model computes exactly what the base computes). The layers call those projections as
modules (``vla.models.attention``), so the adapters act on every path that runs them: the training loss, the
cached-prefix sampling and the compiled serving graphs. The vision tower is never adapted.

Wrapped weights move to ``<module>.base_layer.weight``; adapter weights are ``<module>.lora_A.default.weight`` /
``lora_B``. ``merge_lora`` folds the adapters into the weights and unwraps the modules, so the state-dict names are
the plain model's again (what ``save_pretrained`` writes and serving loads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from vla.config import _require

if TYPE_CHECKING:
    from vla.models.policies.flow_vla import FlowVLA

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULES = ("backbone", "expert")
ADAPTER = "default"


@dataclass(frozen=True)
class LoraSettings:
    """Rank ``r``, scale ``alpha / r``, dropout on the adapter input, which projections (``targets``) of which
    stacks (``modules``: the backbone's language layers and/or the expert's layers) get adapters."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    modules: tuple[str, ...] = MODULES

    def __post_init__(self) -> None:
        _require(self.r >= 1, f"finetune.lora.r must be >= 1, got {self.r}")
        _require(self.alpha > 0, f"finetune.lora.alpha must be > 0, got {self.alpha}")
        _require(0 <= self.dropout < 1, f"finetune.lora.dropout must be in [0, 1), got {self.dropout}")
        _require(bool(self.targets), "finetune.lora.targets must name at least one projection")
        bad = sorted(set(self.targets) - set(TARGETS))
        _require(not bad, f"finetune.lora.targets: unknown {bad}; choose from {TARGETS}")
        bad = sorted(set(self.modules) - set(MODULES))
        _require(
            bool(self.modules) and not bad,
            f"finetune.lora.modules must be a subset of {MODULES}, got {self.modules}",
        )


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def has_lora(model: nn.Module) -> bool:
    return bool(_lora_layers(model))


def apply_lora(model: FlowVLA, settings: LoraSettings) -> FlowVLA:
    """Wrap the target projections with LoRA adapters (in place); base weights of wrapped modules are frozen, the
    adapters trainable. Build the optimizer (and DDP) afterwards: the wrapped modules are new objects."""
    from peft import LoraConfig, inject_adapter_in_model

    from vla.models.sharding import check_not_sharded

    check_not_sharded(model, "apply_lora")
    if has_lora(model):
        raise ValueError("this model already has LoRA adapters; merge_lora(model) first to stack another set")
    stacks = {"backbone": r"backbone\.layers", "expert": r"expert\.layers"}
    where = "|".join(stacks[m] for m in settings.modules)
    pattern = rf"(?:{where})\.\d+\.(?:self_attn|mlp)\.(?:{'|'.join(settings.targets)})"
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=pattern,
        bias="none",
    )
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    layers = _lora_layers(model)
    if not layers:
        raise ValueError(f"LoRA matched no module of this model (pattern {pattern!r})")
    for _, layer in layers:
        layer.get_base_layer().requires_grad_(False)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
    model.table_version = getattr(model, "table_version", 0) + 1  # new parameters: rebuild optimizers
    return model


def lora_parameter_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if ".lora_" in n]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights by their names in ``model``."""
    params = dict(model.named_parameters())
    return {n: params[n].detach() for n in lora_parameter_names(model)}


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter weights into a model with the same adapters (names and shapes must match exactly)."""
    params = dict(model.named_parameters())
    mine = set(lora_parameter_names(model))
    if set(state) != mine:
        raise ValueError(
            f"LoRA state does not match the model's adapters: missing {sorted(mine - set(state))[:5]}, "
            f"unexpected {sorted(set(state) - mine)[:5]}"
        )
    for name, tensor in state.items():
        if params[name].shape != tensor.shape:
            raise ValueError(
                f"LoRA weight {name}: {list(tensor.shape)} vs {list(params[name].shape)} in the model"
            )
        params[name].copy_(tensor)


@torch.no_grad()
def merge_lora(model: FlowVLA) -> FlowVLA:
    """Fold every adapter into its base weight (``W += B A alpha / r``) and put the plain module back (in place)."""
    for name, layer in _lora_layers(model):
        layer.merge(safe_merge=True)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.get_base_layer())
    model.table_version = getattr(model, "table_version", 0) + 1
    return model
