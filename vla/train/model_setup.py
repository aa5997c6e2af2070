"""The model a training run starts from: a fresh ``FlowVLA`` whose embodiment table is the data's, or a checkpoint
(resume, fine-tuning) extended with the data's new embodiments; plus the preprocessing it is trained with, stored
in every checkpoint so that serving and evaluation reproduce it (image size, observation history, chunk length,
normalization and the exact stats)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vla.data.loader import VLALoader
from vla.embodiments import get_embodiment
from vla.models.attention import SharedKVLayer
from vla.models.hub import from_pretrained
from vla.models.policies import POLICIES
from vla.models.policies.flow_vla import FlowVLA
from vla.models.run_dir import resolve_checkpoint
from vla.train.config import TrainConfig

log = logging.getLogger(__name__)


def loader_stats(loader: VLALoader) -> Any:
    """The ``StatsFile`` the loader normalizes with (None when ``data.normalize`` is false)."""
    if not loader.cfg.normalize:
        return None
    stats = getattr(loader, "stats", None)
    if stats is None:  # loaders that do not expose it: the same lookup build_loader made
        from vla.data.loader import _load_stats

        stats, _ = _load_stats(loader.cfg, loader.dataset.sources)
    return stats


def preprocessing(cfg: TrainConfig, loader: VLALoader) -> dict[str, Any]:
    """What a server or evaluator must apply to an observation to give the model what training gave it."""
    data = cfg.data
    return {
        "image_size": data.image_size,
        "obs_history": data.obs_history,
        "chunk_length": data.chunk_length,
        "normalize": data.normalize,
        "clip": None,
        "stats_keys": dict(getattr(loader, "stats_keys", {}) or {}),
        "datasets": sorted({s.name for s in loader.dataset.sources}),
        # which frames and instructions were samples (drop_first/last, idle filter, language choice and its seed):
        # `vla model predict` rebuilds the same episodes from them
        "standardize": dataclasses.asdict(data.standardize),
        "data_seed": data.seed,
    }


def set_gradient_checkpointing(model: FlowVLA, on: bool) -> None:
    """Turn activation checkpointing of every backbone and expert layer on or off, and record it in the model's
    config (saved in config.json). A loaded checkpoint (a resumed run, a fine-tune's base) carries the setting it
    was trained with; this run's ``model.backbone.gradient_checkpointing`` (memory only, not the computation)
    decides."""
    for module in model.modules():
        if isinstance(module, SharedKVLayer):
            module.checkpoint_activations = on
    backbone_cfg = dataclasses.replace(model.cfg.backbone, gradient_checkpointing=on)
    model.cfg = dataclasses.replace(model.cfg, backbone=backbone_cfg)
    model.backbone.cfg = backbone_cfg


def build_model(
    cfg: TrainConfig, loader: VLALoader, *, init_from: str | Path | None = None, seed: int = 0
) -> FlowVLA:
    """A fresh model (seeded) for the data's embodiments, or ``init_from``'s weights with any embodiment the data
    has and the checkpoint lacks added (each initialised from its most similar existing slot)."""
    names = sorted(loader.embodiment_ids)
    if cfg.model.embodiments and sorted(cfg.model.embodiments) != names:
        # vla model init's setting; a run keeps it in its config, so a value here would also block resuming
        raise ValueError(
            f"model.embodiments={list(cfg.model.embodiments)}: vla train builds the embodiment table from the "
            f"data ({names}); leave model.embodiments unset, and add data for a robot to give it a slot"
        )
    stats = loader_stats(loader)
    if init_from is not None:
        model = from_pretrained(resolve_checkpoint(init_from))
        model.base_embodiments = list(model.embodiment_ids)
        theirs, ours = _architecture(model.cfg), _architecture(cfg.model)
        if theirs != ours:
            diff = ", ".join(f"{k}: {theirs[k]!r} vs {ours[k]!r}" for k in theirs if theirs[k] != ours[k])
            raise ValueError(
                f"{init_from}: its architecture differs from this run's model.* settings ({diff}); drop those "
                "model.* overrides (the checkpoint defines the architecture)"
            )
        set_gradient_checkpointing(model, cfg.model.backbone.gradient_checkpointing)
        for name in names:
            if name not in model.embodiment_ids:
                slot = model.add_embodiment(get_embodiment(name))
                log.warning("embodiment %r is new to %s: slot %d added", name, init_from, slot)
    else:
        torch.manual_seed(seed)
        model = POLICIES.get(cfg.model.policy)(cfg.model, [get_embodiment(n) for n in names])
    if init_from is not None:  # keep what the checkpoint knows of the embodiments this data does not cover
        stats = with_base_stats(stats, model.norm_stats)
        pre = preprocessing(cfg, loader)
        base_keys = (getattr(model, "preprocessing", None) or {}).get("stats_keys") or {}
        pre["stats_keys"] = {**base_keys, **pre["stats_keys"]}
        model.preprocessing = pre
    else:
        model.preprocessing = preprocessing(cfg, loader)
    model.norm_stats = stats
    _check_image_size(cfg, model)
    return model


def with_base_stats(stats: Any, base: Any) -> Any:
    """The data's stats on top of the base checkpoint's (``StatsFile``s; the data's win for a key both have), so a
    fine-tuned checkpoint still carries the stats its base embodiments need to be served."""
    if stats is None or base is None:
        return stats
    from vla.data.normalize import StatsFile

    merged = StatsFile(stats={**base.stats, **stats.stats}, sources=[*base.sources])
    merged.sources += [s for s in stats.sources if s not in merged.sources]
    return merged


def _architecture(cfg: Any) -> dict[str, Any]:
    """The model-config fields that shape the weights (gradient checkpointing and freezing do not)."""
    b, e = cfg.backbone, cfg.expert
    return {
        "backbone.family": b.family,
        "backbone.num_vlm_layers": b.num_vlm_layers,
        "backbone.image_size": b.image_size,
        "expert.width_ratio": e.width_ratio,
        "expert.mlp_ratio": e.mlp_ratio,
        "expert.num_layers": e.num_layers,
        "max_state_dim": cfg.max_state_dim,
        "max_action_dim": cfg.max_action_dim,
        "chunk_length": cfg.chunk_length,
    }


def _check_image_size(cfg: TrainConfig, model: FlowVLA) -> None:
    """One resize, to the size the vision tower reads: the loader's output size must be the model's input size."""
    want, got = model.backbone.image_size, cfg.data.image_size
    if got != want:
        raise ValueError(
            f"data.image_size={got} but the model's vision tower reads {want} px images "
            f"(model.backbone.image_size): set data.image_size={want} (or leave it unset to follow the model) so "
            "images are resized once, in the loader, exactly as serving will"
        )


#: layers whose weights bf16 autocast casts to bf16 at every call (its lower-precision op list on CPU and CUDA)
_AUTOCAST_CAST = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def hold_frozen_in_bf16(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Store the weights of frozen Linear/Conv layers in bf16, for a bf16-autocast run; returns the layers changed.

    Autocast casts a layer's float32 weight to bf16 at every call, and caches the cast only for weights that need
    gradients: a frozen backbone's weights were rounded again on every forward pass (about 6 % of a
    ``bench_smolvla`` bf16 training step on a 2-core AMX Xeon). Rounding them once gives the matmuls the very same
    bf16 operands, so losses and gradients are bit for bit those of the float32-held model, with half the frozen
    weights' memory.
    Layers sharing a parameter with another module (tied embeddings) and layers with any trainable parameter keep
    float32. Saving goes through ``held_in_float32`` so checkpoints stay float32 tensors, holding the bf16-rounded
    values the run trained with (a pretrained backbone published in bf16 loses nothing)."""
    held = holdable_in_bf16(model)
    for module in held:
        module.to(torch.bfloat16)
    return held


def holdable_in_bf16(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers ``hold_frozen_in_bf16`` would change (also on the meta device, for ``--dry-run``'s memory)."""
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    held = []
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if (
            type(module) in _AUTOCAST_CAST  # exactly: a subclass may compute in float32 on purpose
            and own
            and not any(p.requires_grad for p in own)
            and all(users[id(p)] == 1 and p.dtype == torch.float32 for p in own)
        ):
            held.append(module)
    return held


@contextlib.contextmanager
def held_in_float32(held: list[torch.nn.Module]) -> Iterator[None]:
    """Float32 weights for the layers ``hold_frozen_in_bf16`` changed, while saving (bf16 -> float32 -> bf16 is
    exact, so the run continues on the same weights)."""
    for module in held:
        module.float()
    try:
        yield
    finally:
        for module in held:
            module.to(torch.bfloat16)
