"""Optimizer and learning-rate schedule: AdamW over parameter groups (backbone / expert / heads, each with its own
learning rate, weight decay only on matrices) and linear warmup followed by cosine decay."""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable

import torch
from torch import nn

from vla.train.config import OptimConfig

log = logging.getLogger(__name__)

#: parameter-name prefix -> group; the first matching prefix wins
GROUPS = (
    ("backbone.", "backbone"),
    ("expert.", "expert"),
    ("heads.", "heads"),
    ("embodiment_tokens", "heads"),
)


def _group_of(name: str) -> str:
    for prefix, group in GROUPS:
        if name.startswith(prefix):
            return group
    raise ValueError(f"parameter {name!r} belongs to no optimizer group {[p for p, _ in GROUPS]}")


def _decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay on weight matrices (and the per-embodiment [E, in, out] tables), not on biases, norms or
    embeddings (the usual AdamW practice, e.g. nanoGPT / HF Trainer)."""
    return p.dim() >= 2 and not name.endswith(".bias") and "norm" not in name and "embed" not in name


def param_groups(
    named: Iterable[tuple[str, nn.Parameter]], cfg: OptimConfig, no_decay: Collection[str] = ()
) -> list[dict]:
    """AdamW groups ``{"params", "lr", "weight_decay", "name"}`` of the trainable parameters, named
    ``<component>`` or ``<component>/no_decay``; empty groups are left out. ``no_decay``: names that never decay
    (tables trained row-wise: decay would move their frozen rows)."""
    lrs = {
        "backbone": cfg.backbone_lr if cfg.backbone_lr is not None else cfg.lr,
        "expert": cfg.expert_lr if cfg.expert_lr is not None else cfg.lr,
        "heads": cfg.heads_lr if cfg.heads_lr is not None else cfg.lr,
    }
    groups: dict[str, dict] = {}
    for name, p in named:
        if not p.requires_grad:
            continue
        component, decay = _group_of(name), _decays(name, p) and name not in no_decay
        key = component if decay else f"{component}/no_decay"
        g = groups.setdefault(
            key,
            {
                "name": key,
                "params": [],
                "lr": lrs[component],
                "weight_decay": cfg.weight_decay if decay else 0.0,
            },
        )
        g["params"].append(p)
    if not groups:
        raise ValueError(
            "no trainable parameters: everything is frozen (check model.backbone.freeze_* and LoRA)"
        )
    return list(groups.values())


def build_optimizer(
    named: Iterable[tuple[str, nn.Parameter]], cfg: OptimConfig, no_decay: Collection[str] = ()
) -> torch.optim.AdamW:
    """Torch's AdamW, fused where the parameters' device supports it (CUDA, and CPU since torch 2.4)."""
    groups = param_groups(named, cfg, no_decay)
    kwargs = {"betas": tuple(cfg.betas), "eps": cfg.eps}
    if cfg.fused:
        # torch checks the parameters' devices and dtypes only at the first step(), not here: checked up front
        unsupported = _without_fused_kernel(p for g in groups for p in g["params"])
        if unsupported is None:
            try:
                return torch.optim.AdamW(groups, fused=True, **kwargs)
            except (RuntimeError, TypeError) as e:  # e.g. a tensor subclass without a fused kernel
                unsupported = str(e)
        log.warning("fused AdamW unavailable here (%s): using the foreach implementation", unsupported)
    return torch.optim.AdamW(groups, **kwargs)


def _without_fused_kernel(params: Iterable[torch.Tensor]) -> str | None:
    """The first parameter's dtype/device that torch's fused AdamW has no kernel for, or None when all have one."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # torch moved its private helper: the constructor's own checks decide
        return None
    for p in params:
        if not (torch.is_floating_point(p) and p.device.type in devices):
            return f"a {p.dtype} parameter on {p.device.type}; fused kernels exist for floats on {sorted(devices)}"
    return None


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning-rate factor of optimizer step ``step`` (0-based): linear warmup over ``warmup_steps`` (the first
    step already gets ``1 / warmup_steps``), then constant or cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, cfg, total_steps))


def settings(optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """Each parameter group's hyperparameters (everything but its parameters), by group name: a freshly built
    optimizer's are the run config's (``optim.*``), to be put back by ``apply_settings`` after loading a checkpoint."""
    return {g["name"]: {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups}


def apply_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    fresh: dict[str, dict],
    cfg: OptimConfig,
    total_steps: int,
) -> None:
    """Put this run's hyperparameters (``fresh``: ``settings()`` of the optimizer as built from ``cfg``, before the
    checkpoint was loaded) back into a resumed optimizer and schedule.

    Loading a checkpoint restores every group's hyperparameters and the schedule's base rates as the run saved them,
    so a changed ``optim.lr`` (or ``*_lr``, ``weight_decay``, ``eps``, ``fused``) would be reported as applied and
    then ignored. Groups are matched by name (``<component>`` or ``<component>/no_decay``); each learning rate is
    its base rate times the schedule's factor at the step the run stopped after, exactly what the scheduler would
    have set, so an unchanged config resumes bit for bit."""
    factor = lr_multiplier(scheduler.last_epoch, cfg, total_steps)
    for i, group in enumerate(optimizer.param_groups):
        group.update(fresh[group["name"]])
        scheduler.base_lrs[i] = group["initial_lr"]
        group["lr"] = group["initial_lr"] * factor
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
