"""``vla train ... --dry-run``: what a run would be, without data or weights — the model built on the meta device
(parameter counts), the global batch, and the training memory per GPU under DDP and FSDP2 computed from the
parameter counts (weights, gradients, AdamW moments, EMA; activations come on top and depend on batch, images
and gradient checkpointing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vla.train.config import TrainConfig

GIB = 2**30


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU of training state (no activations)."""

    strategy: str
    gpus: int
    weights: float
    grads: float
    optimizer: float
    ema: float
    # FSDP2: the two largest sharding units gathered (one computing, the next prefetched) and the largest unsharded
    # gradient before its reduce-scatter
    working_set: float
    # FSDP2 with train.grad_accum > 1: gradient sync is off for all but the last micro-batch, so every unit keeps
    # its whole unsharded float32 gradient until then
    accumulated_grads: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.weights + self.grads + self.optimizer + self.ema + self.working_set + self.accumulated_grads
        )

    def as_dict(self) -> dict[str, Any]:
        out = {k: round(v / GIB, 2) for k, v in vars(self).items() if isinstance(v, float)}
        return {"strategy": self.strategy, "gpus": self.gpus, **out, "total_gib": round(self.total / GIB, 2)}


def memory_plan(
    total: int,
    trainable: int,
    *,
    gpus: int,
    strategy: str,
    ema: bool,
    units: list[tuple[int, int]] | None = None,
    gathered_bytes: int = 4,
    grad_accum: int = 1,
    bf16_frozen: int = 0,
) -> MemoryPlan:
    """Training-state bytes per GPU: float32 master weights (4 B/param; under DDP 2 B for the ``bf16_frozen``
    frozen Linear/Conv parameters a bf16 run holds in bf16, ``train.frozen_bf16``), float32 gradients
    (4 B/trainable param; DDP keeps a second copy in its all-reduce buckets), AdamW's two float32 moments
    (8 B/trainable param), an optional float32 EMA copy (4 B/trainable param). FSDP2 (which holds nothing in bf16)
    divides all of it by the number of GPUs and adds the working set from ``units`` ((parameters, trainable) of each
    sharding unit, largest first): the two largest units gathered at once (one computing, the next prefetched) at
    ``gathered_bytes`` a parameter (2 in a bf16 run on CUDA: FSDP2's mixed precision gathers bf16) and the largest
    unsharded float32 gradient before its reduce-scatter; with ``grad_accum`` > 1 it also keeps every unsharded
    float32 gradient between micro-batches (4 B/trainable param, not divided)."""
    units = units or [(0, 0)]
    ema_bytes = 4.0 * trainable if ema else 0.0
    if strategy == "fsdp2":
        shard = 1.0 / gpus
        return MemoryPlan(
            "fsdp2",
            gpus,
            4.0 * total * shard,
            4.0 * trainable * shard,
            8.0 * trainable * shard,
            ema_bytes * shard,
            gathered_bytes * sum(n for n, _ in units[:2]) + 4.0 * max(t for _, t in units),
            4.0 * trainable if grad_accum > 1 else 0.0,
        )
    weights = 4.0 * total - 2.0 * bf16_frozen
    return MemoryPlan("ddp", gpus, weights, 8.0 * trainable, 8.0 * trainable, ema_bytes, 0.0)


def sharding_unit_sizes(model: Any) -> list[tuple[int, int]]:
    """(parameters, trainable parameters) of each FSDP2 unit of ``model`` (``vla.models.sharding.sharding_units``
    plus the root), largest first, counting each unit's own parameters only: what FSDP2 gathers at once (a nested
    unit gathers separately)."""
    from vla.models.sharding import sharding_units

    units = [*sharding_units(model), model]
    owner: dict[
        int, int
    ] = {}  # parameter -> the innermost unit holding it (units are listed innermost first)
    for i, unit in enumerate(units):
        for p in unit.parameters():
            owner.setdefault(id(p), i)
    sizes = [[0, 0] for _ in units]
    for p in model.parameters():
        sizes[owner[id(p)]][0] += p.numel()
        sizes[owner[id(p)]][1] += p.numel() if p.requires_grad else 0
    return sorted(((a, b) for a, b in sizes), reverse=True)


def mixture_embodiments(cfg: TrainConfig) -> list[str]:
    """The embodiments a run's data would bring, from the mixture's registered key maps (sim datasets by their
    robot's sim spec) — known without opening any dataset."""
    from vla.data.keymaps import KEYMAPS
    from vla.data.mixture import get_mixture
    from vla.embodiments import EMBODIMENTS

    if not cfg.data.mixture:
        return []
    names = set()
    for entry in get_mixture(cfg.data.mixture).datasets:
        if entry.name in KEYMAPS.names():
            names.add(KEYMAPS.get(entry.name).embodiment)
        elif entry.kind == "sim":  # sim_<robot>_<task>, as `vla sim generate` names them
            from vla.sim.tasks import TASKS

            task = next((t for t in TASKS.names() if entry.name.endswith(f"_{t}")), None)
            robot = entry.name.removeprefix("sim_").removesuffix(f"_{task}") if task else ""
            spec = f"sim_{robot}" if robot != "procedural" else "sim_procedural_6dof"
            if spec in EMBODIMENTS.names():
                names.add(spec)
    return sorted(names)


def dry_run(cfg: TrainConfig, embodiments: list[str], *, gpus: int = 8) -> dict[str, Any]:
    """The plan of ``cfg`` for ``embodiments`` on ``gpus`` GPUs per replica group (nothing is loaded)."""
    from vla.embodiments import get_embodiment
    from vla.models.meta import build_on_meta
    from vla.models.published import published_config

    try:
        hf_config = published_config(cfg.model.backbone.pretrained)
    except (KeyError, ValueError):
        hf_config = None  # a local folder, a tiny preset or a cached hub id: build_on_meta reads its config
    model = build_on_meta(cfg.model, [get_embodiment(n) for n in embodiments], hf_config=hf_config)
    counts = model.parameter_counts()
    units = sharding_unit_sizes(model)
    total, trainable = counts["all"]["total"], counts["all"]["trainable"]
    held = 0
    if cfg.train.precision == "bf16" and cfg.train.frozen_bf16:
        from vla.train.model_setup import holdable_in_bf16

        held = sum(p.numel() for m in holdable_in_bf16(model) for p in m.parameters(recurse=False))
    plans = [
        memory_plan(
            total,
            trainable,
            gpus=gpus,
            strategy=s,
            ema=cfg.ema.decay > 0,
            units=units,
            gathered_bytes=2 if cfg.train.precision == "bf16" else 4,
            grad_accum=cfg.train.grad_accum,
            bf16_frozen=held,
        )
        for s in ("ddp", "fsdp2")
    ]
    return {
        "model": cfg.model.backbone.pretrained,
        "embodiments": embodiments,
        "parameters": counts,
        "frozen_params_held_in_bf16": held,
        "largest_fsdp2_unit_params": units[0][0],
        "global_batch_per_gpu_count": {n: cfg.data.batch_size * n * cfg.train.grad_accum for n in (1, 8, 32)},
        "memory_per_gpu_gib": [p.as_dict() for p in plans],
        "strategy": cfg.distributed.strategy,
    }
