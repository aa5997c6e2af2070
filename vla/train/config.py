"""``TrainConfig``: everything ``vla train`` needs, as one frozen, validated dataclass tree.

Loaded from a preset under ``configs/train/`` (or a YAML path) plus dotted ``--set key=value`` overrides::

    load_train_config("debug", ["data.datasets=[data/sim_panda_reach]", "train.steps=50"])

``model`` and ``data`` may each be a preset *name* (``model: tiny_smolvlm`` -> ``configs/model/tiny_smolvlm.yaml``,
``data: droid`` -> ``configs/data/droid.yaml``) or a nested mapping; ``--set model=bench_smolvla`` swaps the
preset and later ``--set model.chunk_length=4`` edits it. The model is the one source of truth for the image
size: ``data.image_size`` follows ``model.backbone.image_size`` unless set explicitly (a data preset's own value
is ignored), and a mismatch is an error when training starts, never a second resize. ``data.chunk_length`` follows
``model.chunk_length`` when unset and may not be shorter.

``data.batch_size`` is per process and micro-step: the global batch is
``data.batch_size x world_size x train.grad_accum``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vla.config import (
    ConfigError,
    DataConfig,
    _check_keys,
    _merge,
    _require,
    config_to_dict,
    load_config,
    parse_overrides,
    read_preset,
)
from vla.models.config import ModelConfig
from vla.models.lora import LoraSettings

PRECISIONS = ("fp32", "bf16")
STRATEGIES = ("auto", "single", "ddp", "fsdp2")
COMPILE_MODES = ("auto", "always", "never")
AUTO_COMPILE_MIN_STEPS = 500  # train.compile=auto: shorter runs stay eager
AUTO_COMPILE_MARGIN = 0.05  # train.compile=auto keeps graphs at least this much faster than eager
SCHEDULES = ("cosine", "constant")


@dataclass(frozen=True)
class LoopConfig:
    """The loop: ``steps`` optimizer steps in total, a checkpoint every ``save_every`` steps (and at the end), the
    newest ``keep_last`` kept, ``grad_accum`` micro-batches per step, ``precision`` of the forward/backward
    (``bf16`` = bf16 autocast; trainable weights and optimizer state stay float32, and with ``frozen_bf16`` the
    frozen Linear/Conv weights are held in bf16, the values autocast would round them to at every call: same
    losses bit for bit, less memory and time; not under FSDP2), gradient-norm clipping (0 = off),
    validation loss every ``val_every`` steps (0 = off) over ``val_batches`` batches of ``val_split`` (or, with
    ``data.val_episodes=N``, of the episodes held out of training), and with
    ``val_at_start`` once before the first step of a fresh run (the baseline a fine-tuning curve starts from).
    ``compile``: run the frozen backbone parts (vla.models.backbone ``frozen_parts``: the vision tower with
    ``freeze_vision``, the language layers too when the whole backbone is frozen) as Inductor graphs with frozen
    weights, in eval mode (no dropout in a frozen part). ``auto`` times eager vs compiled on the first batch and
    keeps the graphs when they are ``AUTO_COMPILE_MARGIN`` faster (the fastest mode differs between CPU families
    and GPUs), for runs of at least ``AUTO_COMPILE_MIN_STEPS`` steps (the compile, tens of seconds on a CPU, would
    not pay back in a shorter one); a compile that fails leaves the run eager. ``always`` (a failure is an error) /
    ``never`` force it. The choice is kept in the checkpoint; a resumed run under ``auto`` takes it over (bitwise
    resume), an explicit ``always``/``never`` wins. Not under FSDP2. ``tf32``: on CUDA, float32 matmuls and
    convolutions (an fp32 run; the float32 parts of a bf16 run) use TF32 tensor cores (Ampere and newer), as
    LeRobot's trainer does; false keeps IEEE float32. The CPU's float32 math is never changed."""

    steps: int = 1000
    save_every: int = 500
    keep_last: int = 2
    seed: int = 0
    grad_accum: int = 1
    precision: str = "fp32"
    frozen_bf16: bool = True
    grad_clip: float = 1.0
    val_every: int = 0
    val_batches: int = 4
    val_split: str = "val"
    val_at_start: bool = False
    compile: str = "auto"
    tf32: bool = True

    def __post_init__(self) -> None:
        _require(self.steps >= 1, f"train.steps must be >= 1, got {self.steps}")
        # refused now, not at the first checkpoint past it
        _require(
            self.steps < 10**7,
            f"train.steps must be < 10000000 (checkpoints are step-XXXXXXX), got {self.steps}",
        )
        _require(self.save_every >= 1, f"train.save_every must be >= 1, got {self.save_every}")
        _require(self.keep_last >= 1, f"train.keep_last must be >= 1, got {self.keep_last}")
        _require(self.grad_accum >= 1, f"train.grad_accum must be >= 1, got {self.grad_accum}")
        _require(
            self.precision in PRECISIONS,
            f"train.precision must be one of {PRECISIONS}, got {self.precision!r}",
        )
        _require(
            self.compile in COMPILE_MODES,
            f"train.compile must be one of {COMPILE_MODES}, got {self.compile!r}",
        )
        _require(self.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 = off), got {self.grad_clip}")
        _require(self.val_every >= 0, f"train.val_every must be >= 0 (0 = off), got {self.val_every}")
        _require(
            not (self.val_at_start and self.val_every == 0),
            "train.val_at_start=true validates only when validation is on: set train.val_every (e.g. 500) too",
        )
        _require(self.val_batches >= 1, f"train.val_batches must be >= 1, got {self.val_batches}")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW (torch's fused kernel where the device has one) with linear warmup then cosine decay to
    ``min_lr_ratio x lr``. ``backbone_lr`` / ``expert_lr`` / ``heads_lr`` (heads and embodiment tokens) default to
    ``lr``. No weight decay on biases, norms and embeddings."""

    lr: float = 1e-4
    backbone_lr: float | None = None
    expert_lr: float | None = None
    heads_lr: float | None = None
    weight_decay: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    fused: bool = True

    def __post_init__(self) -> None:
        for name in ("lr", "backbone_lr", "expert_lr", "heads_lr"):
            v = getattr(self, name)
            _require(v is None or v >= 0, f"optim.{name} must be >= 0, got {v}")
        _require(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        _require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optim.betas must be two numbers in [0, 1), got {self.betas}",
        )
        _require(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(
            self.schedule in SCHEDULES, f"optim.schedule must be one of {SCHEDULES}, got {self.schedule!r}"
        )
        _require(
            0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
        )


@dataclass(frozen=True)
class CheckpointConfig:
    """Besides the newest ``train.keep_last`` checkpoints, keep every ``keep_every``-th step (0 = none)."""

    keep_every: int = 0

    def __post_init__(self) -> None:
        _require(self.keep_every >= 0, f"checkpoint.keep_every must be >= 0, got {self.keep_every}")


@dataclass(frozen=True)
class LoggingConfig:
    """Rank 0 logs every ``every`` steps: a progress line on the console, ``metrics.jsonl`` in the run folder
    (always), and Weights & Biases when ``wandb`` is true (offline unless you are logged in)."""

    every: int = 10
    wandb: bool = False
    wandb_project: str = "vla"
    progress: bool = True

    def __post_init__(self) -> None:
        _require(self.every >= 1, f"logging.every must be >= 1, got {self.every}")


@dataclass(frozen=True)
class DistributedConfig:
    """How the model is spread over processes. ``auto``: FSDP2 when launched with an accelerate FSDP config, DDP
    when several processes, else single. ``find_unused_parameters`` is off: every trainable parameter gets a
    gradient."""

    strategy: str = "auto"
    backend: str | None = None  # None = nccl on CUDA, gloo on CPU
    # how long a collective may wait for the slowest rank before the run fails: rank 0 alone writes the
    # consolidated model.safetensors (12 GB for the 3B preset) and fsyncs the checkpoint while the others wait at
    # a barrier, which on a slow shared filesystem outlasts NCCL's own default of 10 minutes
    timeout_minutes: float = 60.0

    def __post_init__(self) -> None:
        _require(
            self.strategy in STRATEGIES,
            f"distributed.strategy must be one of {STRATEGIES}, got {self.strategy!r}",
        )
        _require(
            self.timeout_minutes > 0,
            f"distributed.timeout_minutes must be > 0, got {self.timeout_minutes}",
        )


@dataclass(frozen=True)
class EMAConfig:
    """Exponential moving average of the trainable weights (0 = off). With EMA on, a checkpoint's top-level model
    (what serving and fine-tuning load) holds the EMA weights; the raw weights live in ``train_state/``."""

    decay: float = 0.0

    def __post_init__(self) -> None:
        _require(0 <= self.decay < 1, f"ema.decay must be in [0, 1) (0 = off), got {self.decay}")


FINETUNE_MODES = ("none", "lora", "full", "frozen_backbone")


@dataclass(frozen=True)
class RehearsalConfig:
    """Pretraining data replayed during fine-tuning so the base embodiments keep working: ``fraction`` of the
    samples come from ``mixture`` (a name from ``data_mixtures/`` or a YAML path, found under ``data_root``,
    default ``data.data_root``), the rest from ``data.datasets``. Its embodiments are normalized with the base
    checkpoint's own stats, and their validation losses are logged next to the new robot's."""

    mixture: str | None = None
    fraction: float = 0.2
    data_root: str | None = None

    def __post_init__(self) -> None:
        _require(
            0.0 < self.fraction < 1.0,
            f"finetune.rehearsal.fraction must be in (0, 1), got {self.fraction}",
        )


@dataclass(frozen=True)
class FinetuneConfig:
    """Fine-tuning a checkpoint (``vla finetune INIT``): ``mode`` ``none`` = pretraining from scratch; ``lora`` =
    peft LoRA on the backbone's language layers and the expert (``lora.*``) plus the fine-tuned embodiments' head
    slots and tokens, everything else frozen; ``frozen_backbone`` = the expert plus those slots; ``full`` =
    everything the model config leaves trainable. ``init`` is the checkpoint (set by ``vla finetune``)."""

    mode: str = "none"
    init: str | None = None
    lora: LoraSettings = field(default_factory=LoraSettings)
    rehearsal: RehearsalConfig = field(default_factory=RehearsalConfig)

    def __post_init__(self) -> None:
        _require(
            self.rehearsal.mixture is None or self.mode != "none",
            "finetune.rehearsal.mixture is for fine-tuning (`vla finetune INIT ...`); to pretrain on a mixture set "
            "data.mixture",
        )
        _require(
            self.mode in FINETUNE_MODES,
            f"finetune.mode must be one of {FINETUNE_MODES}, got {self.mode!r}",
        )
        _require(
            self.mode == "none" or bool(self.init),
            f"finetune.mode={self.mode!r} needs a checkpoint to start from: `vla finetune INIT ...`",
        )


@dataclass(frozen=True)
class TrainConfig:
    """One training (or fine-tuning) run."""

    data: DataConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)


#: keys whose change makes a checkpoint unusable for this run (checked on resume); everything else is compatible
INCOMPATIBLE = (
    "model",
    "data.datasets",
    "data.mixture",
    "data.data_root",
    "data.balance_by_size",
    "data.sim_fraction",
    "data.split",
    "data.obs_history",
    "data.chunk_length",
    "data.image_size",
    "data.standardize",
    "data.seed",
    "data.shuffle",
    "data.normalize",
    "data.stats_path",
    "data.val_episodes",
    "train.seed",
    "optim.betas",
    "finetune.mode",
    "finetune.init",
    "finetune.lora",
    "finetune.rehearsal",
)

#: keys under an ``INCOMPATIBLE`` prefix that change only memory or speed, not the computation's shapes: compatible
COMPATIBLE_INSIDE = ("model.backbone.gradient_checkpointing",)


def _section(name: str, value: Any, kind: str) -> dict[str, Any]:
    """A ``model``/``data`` value as a mapping: a preset name is replaced by its YAML, and a mapping with a
    ``preset`` key is that preset with the mapping's other keys merged over it."""
    if isinstance(value, str):
        value = {"preset": value}
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a preset name or a mapping, got {type(value).__name__}")
    value = dict(value)
    preset = value.pop("preset", None)
    if preset is None:
        return value
    loaded = read_preset(kind, preset, ModelConfig if kind == "model" else DataConfig)
    if kind == "data":  # the model decides the image size; only an explicit data.image_size competes with it
        loaded.pop("image_size", None)
    return _merge(loaded, value)


def _read_preset(preset: str | Path | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(preset, dict):
        return dict(preset)
    return {} if preset is None else read_preset("train", preset, TrainConfig)


def load_finetune_config(
    preset: str | Path | dict[str, Any] | None, init: str | Path, overrides: list[str] | None = None
) -> TrainConfig:
    """``vla finetune``'s config: the preset (e.g. ``finetune_lora``) with the model section taken from the
    checkpoint ``init`` (a run, step or plain checkpoint folder: it defines the architecture) and
    ``finetune.init`` set to it."""
    import json

    from vla.models.run_dir import resolve_checkpoint

    root = resolve_checkpoint(init)
    config = root / "config.json"
    if not config.is_file():
        raise FileNotFoundError(
            f"{init}: no checkpoint there ({config} missing); pass a vla train run or step folder"
        )
    model = dict(json.loads(config.read_text())["model"])
    model["embodiments"] = []  # the table comes from the checkpoint plus the data
    raw = _read_preset(preset)
    raw["model"] = model
    raw.setdefault("finetune", {})["init"] = str(root)
    return load_train_config(raw, overrides)


def load_train_config(
    preset: str | Path | dict[str, Any] | None = None, overrides: list[str] | None = None
) -> TrainConfig:
    """A ``TrainConfig`` from a preset name under ``configs/train/``, a YAML path or a dict, plus dotted overrides
    (``model=NAME`` / ``data=NAME`` swap a whole section's preset before the other overrides apply)."""
    raw = _read_preset(preset)
    swaps = [o for o in overrides or [] if o.split("=", 1)[0].lstrip("-") in ("model", "data")]
    rest = [o for o in overrides or [] if o not in swaps]
    for item in swaps:
        key, value = item.lstrip("-").split("=", 1)
        raw[key] = value
    raw["model"] = _section("model", raw.get("model"), "model")
    raw["data"] = _section("data", raw.get("data"), "data")
    raw = _merge(raw, parse_overrides(rest))
    _check_keys(TrainConfig, raw)
    _fill_from_model(raw)
    model = load_config(ModelConfig, raw.pop("model"), kind="model")
    data = load_config(DataConfig, raw.pop("data"), kind="data")
    if 0 < data.chunk_length < model.chunk_length:
        raise ConfigError(
            f"data.chunk_length={data.chunk_length} is shorter than model.chunk_length={model.chunk_length}: the "
            "model would serve action steps it never trained on. Set data.chunk_length to "
            f"{model.chunk_length} (or 0 = each embodiment's default), or model.chunk_length={data.chunk_length}"
        )
    return load_config(TrainConfig, {**raw, "model": config_to_dict(model), "data": config_to_dict(data)})


def _fill_from_model(raw: dict[str, Any]) -> None:
    """``data.image_size`` / ``data.chunk_length`` follow the model when the data config leaves them unset."""
    model, data = raw["model"], raw["data"]
    size = (model.get("backbone") or {}).get("image_size")
    if "image_size" not in data and size:
        data["image_size"] = size
    if "chunk_length" not in data:
        data["chunk_length"] = model.get("chunk_length", ModelConfig.chunk_length)


def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The plain-dict form stored in run folders and checkpoints (``config.yaml``)."""
    return config_to_dict(cfg)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def diff_configs(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(incompatible, compatible) changes between two ``config_dict``s, each as ``key: old -> new``."""
    a, b = _flatten(old), _flatten(new)
    bad, ok = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key) or (key in PATH_KEYS and _same_folder(a.get(key), b.get(key))):
            continue
        line = f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
        if key not in a and _is_default(key, b[key]):
            # a setting newer than the run, at its default: the run ran without it, which the default keeps
            ok.append(f"{key}: not recorded by the run -> {b.get(key)!r}")
        elif key in COMPATIBLE_INSIDE:
            ok.append(line)
        elif any(key == p or key.startswith(p + ".") for p in INCOMPATIBLE):
            bad.append(line)
        else:
            ok.append(line)
    return bad, ok


#: settings holding a folder (or a list of them): the same folder written another way (relative, with a trailing
#: slash, through a symlink; runs started before vla resolved the fine-tune base recorded it as typed) is no change
PATH_KEYS = frozenset({"finetune.init", "data.datasets", "data.data_root", "data.stats_path", "data.mixture"})


def _same_folder(a: Any, b: Any) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_folder(x, y) for x, y in zip(a, b, strict=True))
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    # not on this machine (or a mixture's name): the same text up to a trailing slash or ./
    return os.path.normpath(pa) == os.path.normpath(pb)


def _is_default(key: str, value: Any) -> bool:
    """Whether ``value`` is the default of the ``TrainConfig`` field at dotted ``key`` (as ``config_dict`` writes
    it); False where the key names no field with a default (e.g. inside a mapping-valued field)."""
    import typing

    cls: Any = TrainConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return False
        f = fields[part]
        if i == len(parts) - 1:
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                return False
            return not dataclasses.is_dataclass(default) and _plain(default) == value
        cls = typing.get_type_hints(cls)[part]
    return False


def _plain(value: Any) -> Any:
    """A default as ``config_dict`` writes values (tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value


def replace(cfg: TrainConfig, **sections: Any) -> TrainConfig:
    """``cfg`` with whole sections replaced (``replace(cfg, model=new_model_cfg)``)."""
    return dataclasses.replace(cfg, **sections)
