"""FSDP2 for the VLA: ``apply_fsdp2(model)`` shards it in place, one unit per decoder layer.

Units (each ``fully_shard``-ed, so a rank holds ~1/N of its weights except while the unit runs): every backbone
language layer, every expert layer, every vision encoder layer and the rest of the vision tower, the projector, the
token embedding table, and the root (embodiment tokens, heads, the expert's final norm). A unit's weights are
all-gathered right before its forward (and its backward) and freed after. That works because every layer is run
through its module call (``vla.models.attention``), never by reaching into its weights.

The vision tower is sharded whether it is trained or frozen: frozen weights take the same memory (SigLIP-So400m in
PaliGemma2: 412M parameters, 1.6 GB in float32, on every rank if replicated), and a frozen unit costs only its
all-gather (it has no gradients to reduce-scatter).

Training calls ``model(batch, ...)`` (``forward`` = ``loss_terms``; ``loss`` goes through it too) and inference
``model.sample_actions(batch)``, registered as a forward method so the root's weights are gathered for it as well.
Other entry points (``compute_prefix``, ``velocity``) are not hooked: call them on an unsharded model.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from vla.models.policies.flow_vla import FlowVLA


def sharding_units(model: FlowVLA) -> list[nn.Module]:
    """The modules ``apply_fsdp2`` shards on their own, innermost first (the root is sharded last)."""
    backbone = model.backbone
    vision_layers = [
        layer
        for name, layers in backbone.vision.named_modules()
        if name.endswith("encoder.layers") and isinstance(layers, nn.ModuleList)
        for layer in layers
    ]
    return [
        *vision_layers,
        backbone.vision,
        backbone.projector,
        backbone.embed_tokens,
        *backbone.layers,
        *model.expert.layers,
    ]


def apply_fsdp2(
    model: FlowVLA,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    *,
    reshard_after_forward: bool = True,
) -> FlowVLA:
    """Shard ``model`` in place with FSDP2 (``torch.distributed.fsdp.fully_shard``) over ``mesh`` (default: every
    process of the default group) and return it. Call it after ``add_embodiment`` and before building the optimizer.

    ``mp_policy``: FSDP2 mixed precision (e.g. bf16 parameters, float32 gradient reduction). The units cast their
    floating inputs to its ``param_dtype``; the root does not, so the targets and flow noise of the loss stay
    float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    from vla.models.attention import SharedKVLayer

    mp = mp_policy or MixedPrecisionPolicy()
    for unit in sharding_units(model):
        if isinstance(unit, SharedKVLayer):
            unit.contiguous_values = True  # its outputs must not be views (see SharedKVLayer)
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    root_mp = dataclasses.replace(mp, cast_forward_inputs=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=root_mp)
    register_fsdp_forward_method(model, "sample_actions")
    return model


def check_not_sharded(model: nn.Module, what: str) -> None:
    """Refuse ``what`` (an operation that replaces parameters) on a model sharded with FSDP2: its parameters are
    DTensors managed per unit, and new parameters would be neither sharded nor seen by the optimizer."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters()
    ):
        raise RuntimeError(
            f"{what} on a model sharded with FSDP2 (fully_shard; its parameters are DTensors): the parameters it "
            f"creates would be unsharded and unknown to the optimizer. Call {what} first, then "
            "vla.models.sharding.apply_fsdp2, then build the optimizer"
        )
