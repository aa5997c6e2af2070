"""Typed, frozen dataclass configs; YAML presets under ``configs/``; dotted command-line overrides.

``load_config(DataConfig, "configs/data/bridge.yaml", ["batch_size=16", "augment.crop_scale=0.9"])`` merges the
preset with the overrides, rejects unknown names with "did you mean", decodes types with ``draccus`` and runs each
dataclass's ``__post_init__`` validation, whose errors name the field and the allowed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import draccus
import numpy as np
import yaml

from vla.paths import config_dir

C = TypeVar("C")


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key, the value and what is allowed."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class AugmentConfig:
    """Training-only image augmentation (never applied at evaluation/serving time).

    ``crop_scale``: random crop keeping this fraction of each side (1.0 = off), then resized back.
    ``brightness``/``contrast``/``saturation``: color-jitter strengths (0 = off), factors drawn in [1-s, 1+s];
    ``hue``: hue shift in [-hue, hue] (fraction of the color wheel, <= 0.5).
    """

    enabled: bool = False
    crop_scale: float = 0.9
    brightness: float = 0.2
    contrast: float = 0.2
    saturation: float = 0.2
    hue: float = 0.05

    def __post_init__(self) -> None:
        _require(
            0.1 <= self.crop_scale <= 1.0, f"augment.crop_scale must be in [0.1, 1], got {self.crop_scale}"
        )
        for name in ("brightness", "contrast", "saturation"):
            v = getattr(self, name)
            _require(0.0 <= v < 1.0, f"augment.{name} must be in [0, 1), got {v}")
        _require(0.0 <= self.hue <= 0.5, f"augment.hue must be in [0, 0.5], got {self.hue}")


@dataclass(frozen=True)
class StandardizeConfig:
    """Per-run standardization choices (see ``vla.data.standardize.StandardizeOptions``).

    ``drop_first``/``drop_last`` override the key map's defaults (None = keep them; e.g. ``drop_first=0`` keeps
    Bridge's all-zero first step as Octo does); ``language_choice`` is ``first_nonempty`` or ``random`` (DROID's
    three instructions); ``idle_filter`` applies openpi's DROID idle-frame rule; ``success_only`` keeps only
    episodes whose path says success.
    """

    drop_first: int | None = None
    drop_last: int | None = None
    language_choice: str = "first_nonempty"
    idle_filter: bool = False
    success_only: bool = False

    def __post_init__(self) -> None:
        _require(
            self.language_choice in ("first_nonempty", "random"),
            f"data.standardize.language_choice must be 'first_nonempty' or 'random', got {self.language_choice!r}",
        )
        for name in ("drop_first", "drop_last"):
            v = getattr(self, name)
            _require(v is None or v >= 0, f"data.standardize.{name} must be >= 0 or null, got {v}")


@dataclass(frozen=True)
class DataConfig:
    """What the loader reads and how it turns frames into training samples.

    Either ``datasets`` (paths) or ``mixture`` (a name from ``data_mixtures/`` or a YAML path, resolved under
    ``data_root``). ``obs_history`` is T_obs, ``chunk_length`` is H (0 = each embodiment's default);
    ``image_size`` is the (square) side images are resized to (0 = keep native sizes).
    """

    datasets: tuple[str, ...] = ()
    mixture: str | None = None
    data_root: str = "data"
    allow_missing: bool = False
    # load a dataset whose writing command was interrupted (the episodes written so far)
    allow_incomplete: bool = False
    balance_by_size: bool | None = None  # None = the mixture file's setting
    sim_fraction: float | None = (
        None  # share of samples from the mixture's `kind: sim` entries (None = weights)
    )
    split: str = "train"
    obs_history: int = 1
    chunk_length: int = 10
    image_size: int = 224
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    standardize: StandardizeConfig = field(default_factory=StandardizeConfig)
    batch_size: int = 8
    num_workers: int = 0
    shuffle: bool = True
    seed: int = 0
    on_bad_sample: str = "raise"
    # with on_bad_sample=skip: the share of an epoch's samples that may be skipped before the loader fails
    max_skipped_fraction: float = 0.01
    val_episodes: int = 0  # the last N episodes of each dataset's split: held out of training, validated on
    normalize: bool = True
    stats_path: str | None = None

    def __post_init__(self) -> None:
        _require(
            bool(self.datasets) != bool(self.mixture),
            "data: set exactly one of data.datasets or data.mixture",
        )
        _require(
            self.sim_fraction is None or 0.0 <= self.sim_fraction <= 1.0,
            f"data.sim_fraction must be in [0, 1] or null, got {self.sim_fraction}",
        )
        _require(
            self.sim_fraction is None or bool(self.mixture),
            "data.sim_fraction needs data.mixture (it splits a mixture's entries by kind: sim vs real)",
        )
        _require(
            self.val_episodes >= 0,
            f"data.val_episodes must be >= 0 (0 = none held out), got {self.val_episodes}",
        )
        _require(self.obs_history >= 1, f"data.obs_history must be >= 1, got {self.obs_history}")
        _require(
            self.chunk_length >= 0,
            f"data.chunk_length must be >= 0 (0 = embodiment default), got {self.chunk_length}",
        )
        _require(
            self.image_size == 0 or 16 <= self.image_size <= 2048,
            f"data.image_size must be 0 (keep each camera's size) or in [16, 2048], got {self.image_size}",
        )
        _require(self.batch_size >= 1, f"data.batch_size must be >= 1, got {self.batch_size}")
        _require(self.num_workers >= 0, f"data.num_workers must be >= 0, got {self.num_workers}")
        _require(
            self.on_bad_sample in ("raise", "skip"),
            f"data.on_bad_sample must be 'raise' or 'skip', got {self.on_bad_sample!r}",
        )
        _require(
            0.0 <= self.max_skipped_fraction <= 1.0,
            f"data.max_skipped_fraction must be in [0, 1], got {self.max_skipped_fraction}",
        )


#: The ``configs/<kind>/`` folder of each config class's named presets (``load_config``'s default ``kind``).
PRESET_KINDS: dict[type, str] = {DataConfig: "data"}


# ---- loading ---------------------------------------------------------------------------------------------
def resolve_preset(kind: str, name_or_path: str | Path) -> Path:
    """A YAML path as given, or ``configs/<kind>/<name>.yaml``; unknown names get "did you mean"."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        return p
    folder = config_dir() / kind
    cand = folder / f"{name_or_path}.yaml"
    if cand.is_file():
        return cand
    if not kind:
        raise ConfigError(
            f"{name_or_path!r} is neither a YAML file nor a preset name this loader knows the folder of: pass "
            f"kind= (the folder under {config_dir()}: {', '.join(sorted(PRESET_KINDS.values()))}, ...) or a path"
        )
    known = sorted(x.stem for x in folder.glob("*.yaml"))
    close = difflib.get_close_matches(str(name_or_path), known, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    listed = f"Known: {', '.join(known)}" if known else "There are no presets"
    raise ConfigError(f"Unknown {kind} preset {name_or_path!r}.{hint} {listed} (in {folder}).")


def read_preset(kind: str, name_or_path: str | Path, cls: type | None = None) -> dict[str, Any]:
    """The mapping a preset YAML holds (``resolve_preset``), with errors naming the file; with ``cls``, its keys are
    checked against that config class here, so an unknown key's error names the file it is in (a nested
    ``preset:`` key, which names a section's own preset, is left to the caller)."""
    path = resolve_preset(kind, name_or_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    if cls is not None:
        sections = {k: {**v} for k, v in data.items() if isinstance(v, dict)}
        for v in sections.values():
            v.pop("preset", None)
        try:
            _check_keys(cls, {**data, **sections})
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    return data


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["a.b=1", "--c=x"]`` -> nested dict ``{"a": {"b": 1}, "c": "x"}``; values parsed as YAML scalars/lists."""
    out: dict[str, Any] = {}
    for item in overrides:
        s = item[2:] if item.startswith("--") else item
        if "=" not in s:
            raise ConfigError(
                f"override {item!r} must look like key=value (e.g. batch_size=16 or augment.enabled=true)"
            )
        key, raw = s.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override of {part!r}")
        node[parts[-1]] = value
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _check_keys(cls: type, data: dict[str, Any], prefix: str = "") -> None:
    """Reject unknown keys (recursively into nested dataclasses) with "did you mean"."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k, v in data.items():
        if k not in names:
            close = [n for n in names if n.startswith(k)] or difflib.get_close_matches(
                k, names, n=3, cutoff=0.5
            )
            hint = f" Did you mean {', '.join(prefix + c for c in close)}?" if close else ""
            raise ConfigError(
                f"Unknown config key {prefix + k!r}.{hint} Allowed: {', '.join(prefix + n for n in names)}."
            )
        sub = hints.get(k)
        if sub is not None and not _fits(sub, v):
            raise ConfigError(
                f"{prefix}{k}: expected {_describe(sub)}, got {_as_yaml(v)}" + _QUOTE_HINT.get(type(v), "")
            )
        nested = next((a for a in (sub, *typing.get_args(sub)) if dataclasses.is_dataclass(a)), None)
        if nested is not None and isinstance(v, dict):
            _check_keys(nested, v, prefix=f"{prefix}{k}.")


def _as_yaml(v: Any) -> str:
    """A value as YAML writes it inline (``null``, ``true``, ``[1, 2]``); ``repr`` for what YAML cannot write (a
    value passed from Python)."""
    try:
        return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()
    except yaml.YAMLError:
        return repr(v)


#: config sections a preset name may stand for (``model: tiny_smolvlm``; ``load_train_config`` reads the preset)
NAMED_SECTIONS = frozenset({"DataConfig", "ModelConfig"})

#: why a value typed on a command line or in YAML may not be what it looks like
_QUOTE_HINT = {
    bool: " (YAML reads yes/no/on/off/true/false as booleans: quote the value to mean the word)",
    type(None): " (YAML reads null, ~ and an empty value as null)",
}


def _fits(tp: Any, v: Any) -> bool:
    """Whether a YAML-decoded value ``v`` can stand for a field of type hint ``tp`` (what draccus would decode, or
    refuse with an unhelpful message or a crash later: a null learning rate, a list for a step count, ``true`` for
    a count). Numbers may come as strings (PyYAML reads ``1e-4`` as a string); types not handled here pass."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin is typing.Union or isinstance(tp, types.UnionType):
        return any(_fits(a, v) for a in args)
    if tp is type(None):
        return v is None
    if v is None:
        return False
    if origin is typing.Literal:
        return v in args
    if dataclasses.is_dataclass(tp):
        return isinstance(v, dict | tp) or (isinstance(v, str) and tp.__name__ in NAMED_SECTIONS)
    if tp is bool:
        return isinstance(v, bool | np.bool_)
    if tp in (int, float):
        if isinstance(v, bool | np.bool_):
            return False
        if isinstance(v, str):
            try:
                tp(v)
            except ValueError:
                return False
            return True
        return isinstance(v, numbers.Integral) if tp is int else isinstance(v, numbers.Real)
    if tp is str:
        # a number for a name (wandb_project: 2024) is its text, as draccus decodes it; a Path from Python too
        return isinstance(v, str | os.PathLike) or (isinstance(v, numbers.Real) and not isinstance(v, bool))
    if origin in (tuple, list) or tp in (tuple, list):
        if isinstance(v, str) and _string_sequence(tp):
            return True  # one string for a list of them: _one_string_as_sequence makes it [v]
        if not isinstance(v, list | tuple):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(v) == len(args) and all(_fits(a, x) for a, x in zip(args, v, strict=True))
        return not args or all(_fits(args[0], x) for x in v)
    if origin is dict or tp is dict:
        return isinstance(v, dict)
    return True


def _describe(tp: Any) -> str:
    """A type hint in words, for ``_fits``'s refusals."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if dataclasses.is_dataclass(tp):
        named = " or a preset name" if tp.__name__ in NAMED_SECTIONS else ""
        return f"a mapping of {tp.__name__} settings{named}"
    if origin in (tuple, list) or tp in (tuple, list):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} ({', '.join(_describe(a) for a in args)})"
        plural = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}
        return f"a list of {plural.get(args[0]) or _describe(args[0])}" if args else "a list"
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, "a mapping" if origin is dict or tp is dict else getattr(tp, "__name__", str(tp)))


def _string_sequence(tp: Any) -> bool:
    """Whether the type hint ``tp`` is a sequence of strings of any length (``tuple[str, ...]``, ``list[str]``,
    optionally ``| None``)."""
    args = typing.get_args(tp)
    if type(None) in args:  # X | None
        return any(_string_sequence(a) for a in args if a is not type(None))
    origin = typing.get_origin(tp)
    if origin is tuple:
        return args == (str, Ellipsis)
    return origin is list and args == (str,)


def _one_string_as_sequence(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with a plain string given for a string-sequence field (recursively into nested dataclasses) turned
    into a one-element list: ``--set data.datasets=PATH`` or ``datasets: PATH`` in YAML means ``[PATH]``, where
    draccus would split it into single characters. An empty string stays an empty sequence."""
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for k, v in data.items():
        sub = hints.get(k)
        if isinstance(v, str) and _string_sequence(sub):
            out[k] = [v] if v else []
        elif isinstance(v, dict):
            sub = next((a for a in (sub, *typing.get_args(sub)) if dataclasses.is_dataclass(a)), None)
            if sub is not None:
                out[k] = _one_string_as_sequence(sub, v)
    return out


def load_config(
    cls: type[C],
    preset: str | Path | dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    *,
    kind: str = "",
) -> C:
    """Build a ``cls`` config from a preset (path, name under ``configs/<kind>/`` or dict) plus dotted overrides.
    ``kind`` defaults to the class's preset folder (``PRESET_KINDS``: ``DataConfig`` -> ``configs/data/``)."""
    kind = kind or PRESET_KINDS.get(cls, "")
    data: dict[str, Any] = {}
    if isinstance(preset, dict):
        # nested config objects given in a dict preset are turned back into plain dicts for decoding
        data = {k: draccus.encode(v) if dataclasses.is_dataclass(v) else v for k, v in preset.items()}
    elif preset is not None:
        data = read_preset(kind, preset, cls)
    data = _merge(data, parse_overrides(overrides or []))
    _check_keys(cls, data)
    data = _one_string_as_sequence(cls, data)
    try:
        return draccus.decode(cls, data)
    except ConfigError:
        raise
    except Exception as e:  # draccus wraps __post_init__ errors and type errors
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            nxt = cause.__cause__ or cause.__context__
            if isinstance(nxt, ConfigError):
                raise nxt from None
            cause = nxt
        raise ConfigError(f"invalid {cls.__name__}: {e}") from e


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-dict form of a config (for YAML dumps into checkpoints and run folders)."""
    return draccus.encode(cfg)
