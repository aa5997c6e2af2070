"""LoRA adapters (peft) on the VLA's backbone language layers and action expert.

``apply_lora(model, LoraSettings(...))`` wraps the attention (q/k/v/o) and MLP (gate/up/down) projections of every
backbone language layer and/or expert layer with peft's ``lora.Linear``: ``y = W x + (B A x) * alpha / r`` with
``A`` ``[r, in]`` and ``B`` ``[out, r]``; peft initialises B to zero, so a freshly adapted model computes bitwise what
the base computes (the adapter adds exact zeros). The backbone's last layer keeps only its key/value projections
(``SharedKVLayer.keep_keys_values_only``), so only those are wrapped there. The vision tower is never adapted.

The decoder layers call their projections as modules (``vla.models.attention``), so the adapters act on every
path that runs them: the training loss, the cached-prefix sampling (``ActionExpert.extend``/``run``,
``VLMBackbone.run_layers``) and the compiled serving graphs of ``prepare_inference(compile=True)``.

What changes in the model: each wrapped projection's weight moves from ``<module>.weight`` to
``<module>.base_layer.weight`` (in ``named_parameters`` and ``state_dict``), its adapter weights are
``<module>.lora_A.default.weight`` / ``<module>.lora_B.default.weight``, and the model gets a ``peft_config``
attribute. Every other name is unchanged. ``merge_lora`` folds the adapters into the weights (``W += B A alpha / r``)
and puts the plain modules back, so names, keys and ``requires_grad`` are the plain model's again (what
``save_pretrained`` writes and serving loads).

Both calls replace parameters, so they bump ``model.table_version``: build the optimizer (and DDP/FSDP2) after
``apply_lora``. A model sharded with FSDP2 is refused: shard after ``apply_lora``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from vla.config import _require
from vla.models.sharding import check_not_sharded

if TYPE_CHECKING:
    from vla.models.policies.flow_vla import FlowVLA

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULES = ("backbone", "expert")
ADAPTER = "default"  # peft's adapter name: part of every adapter parameter's name
_BASE_REQUIRES_GRAD = (
    "_vla_base_requires_grad"  # on each wrapped module: its weights' flags before apply_lora
)


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
        # YAML and JSON give lists: keep the settings hashable and comparable
        object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "modules", tuple(self.modules))
        _require(
            isinstance(self.r, int) and self.r >= 1,
            f"finetune.lora.r must be an integer >= 1, got {self.r!r}",
        )
        _require(self.alpha > 0, f"finetune.lora.alpha must be > 0, got {self.alpha!r}")
        _require(0 <= self.dropout < 1, f"finetune.lora.dropout must be in [0, 1), got {self.dropout!r}")
        _require(bool(self.targets), f"finetune.lora.targets must name at least one of {TARGETS}, got ()")
        bad = sorted(set(self.targets) - set(TARGETS))
        _require(not bad, f"finetune.lora.targets: unknown {bad}; choose from {TARGETS}")
        bad = sorted(set(self.modules) - set(MODULES))
        _require(
            bool(self.modules) and not bad,
            f"finetune.lora.modules must be a non-empty subset of {MODULES}, got {self.modules}",
        )


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def has_lora(model: nn.Module) -> bool:
    """Whether any module of ``model`` is a peft LoRA layer."""
    return bool(_lora_layers(model))


def _check_plain(model: nn.Module, what: str) -> None:
    if not (hasattr(model, "backbone") and hasattr(model, "expert")):
        raise TypeError(
            f"{what} takes the FlowVLA itself, got {type(model).__name__}; pass model.module of a DDP wrapper, "
            f"or better call {what} before wrapping"
        )
    check_not_sharded(model, what)


def target_module_names(model: FlowVLA, settings: LoraSettings) -> list[str]:
    """Full names of the Linear modules ``settings`` adapts in ``model`` (what exists: the backbone's last layer
    has only k/v projections)."""
    stacks = {
        "backbone": ("backbone.layers", model.backbone.layers),
        "expert": ("expert.layers", model.expert.layers),
    }
    names = []
    for which in settings.modules:
        root, layers = stacks[which]
        for name, module in layers.named_modules():
            parent, _, leaf = name.rpartition(".")
            if leaf in settings.targets and parent.endswith(("self_attn", "mlp")):
                if not isinstance(module, nn.Linear):
                    raise TypeError(
                        f"{root}.{name} is a {type(module).__name__}, not nn.Linear: LoRA here supports Linear "
                        "projections only; drop it from finetune.lora.targets"
                    )
                names.append(f"{root}.{name}")
    return names


def apply_lora(model: FlowVLA, settings: LoraSettings) -> FlowVLA:
    """Wrap the target projections with LoRA adapters (in place) and return ``model``.

    The wrapped base weights are frozen and the adapters trainable; every other parameter keeps its
    ``requires_grad``. Adapter weights take their base weight's device and dtype. Build the optimizer (and DDP)
    afterwards: ``model.table_version`` goes up."""
    from peft import LoraConfig, inject_adapter_in_model

    _check_plain(model, "apply_lora")
    if has_lora(model):
        raise ValueError(
            "apply_lora: this model already has LoRA adapters; merge_lora(model) first to stack another set, or "
            "load_lora_state_dict(model, state) to replace their weights"
        )
    names = target_module_names(model, settings)
    if not names:
        raise ValueError(
            f"apply_lora: finetune.lora.targets {settings.targets} match no projection of {settings.modules}"
        )
    flags = {p: p.requires_grad for p in model.parameters()}
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules="|".join(re.escape(n) for n in names),  # peft full-matches a string against each name
        bias="none",
    )
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    wrapped = dict(_lora_layers(model))
    if sorted(wrapped) != sorted(names):  # peft decides by pattern; the set must be exactly the one computed
        raise RuntimeError(f"peft wrapped {sorted(wrapped)[:5]}..., expected {names[:5]}...")
    # peft freezes every non-adapter parameter (heads, tokens, norms): put back what the caller had set
    for p, flag in flags.items():
        p.requires_grad_(flag)
    for layer in wrapped.values():
        base = layer.get_base_layer()
        setattr(layer, _BASE_REQUIRES_GRAD, {n: p.requires_grad for n, p in base.named_parameters()})
        base.requires_grad_(False)
        for p in (*layer.lora_A.parameters(), *layer.lora_B.parameters()):
            p.requires_grad_(True)
    model.table_version += 1
    return model


def lora_parameter_names(model: nn.Module) -> list[str]:
    """Names of the adapter parameters (``...lora_A.default.weight`` / ``...lora_B.default.weight``), in
    ``named_parameters`` order."""
    adapters = {
        id(p)
        for _, layer in _lora_layers(model)
        for p in (*layer.lora_A.parameters(), *layer.lora_B.parameters())
    }
    return [n for n, p in model.named_parameters() if id(p) in adapters]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights by their names in ``model`` (detached, sharing storage as ``state_dict()`` does)."""
    params = dict(model.named_parameters())
    return {n: params[n].detach() for n in lora_parameter_names(model)}


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter weights into a model with the same adapters (``apply_lora`` with the same settings): names
    and shapes must match exactly; values are cast to the model's dtype."""
    mine = lora_parameter_names(model)
    if not mine:
        raise ValueError(
            "load_lora_state_dict: this model has no LoRA adapters; apply_lora(model, settings) with the settings "
            "the state was trained with first"
        )
    missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    if missing or unexpected:
        raise ValueError(
            f"LoRA state does not match the model's adapters: missing {missing[:5]} ({len(missing)}), unexpected "
            f"{unexpected[:5]} ({len(unexpected)}); apply_lora with the settings (targets, modules) it was trained "
            "with"
        )
    params = dict(model.named_parameters())
    for name in mine:
        if params[name].shape != state[name].shape:
            raise ValueError(
                f"LoRA weight {name} is {list(state[name].shape)} in the state, {list(params[name].shape)} in the "
                "model; apply_lora with the rank r it was trained with"
            )
    for name in mine:
        params[name].copy_(state[name])


@torch.no_grad()
def merge_lora(model: FlowVLA) -> FlowVLA:
    """Fold every adapter into its base weight (``W += B A alpha / r``) and put the plain modules back, with the
    ``requires_grad`` they had before ``apply_lora`` (in place). Returns ``model``."""
    _check_plain(model, "merge_lora")
    layers = _lora_layers(model)
    if not layers:
        raise ValueError("merge_lora: this model has no LoRA adapters (check has_lora(model) first)")
    for name, layer in layers:
        layer.merge(
            safe_merge=True, adapter_names=[ADAPTER]
        )  # safe_merge: refuse NaN/inf instead of storing it
        base = layer.get_base_layer()
        for pname, flag in getattr(layer, _BASE_REQUIRES_GRAD, {}).items():
            base.get_parameter(pname).requires_grad_(flag)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, base)
    if "peft_config" in vars(model):
        del model.peft_config
    model.table_version += 1
    return model
