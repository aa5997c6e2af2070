"""Per-dataset key maps: how one dataset's raw fields become the canonical frame. Entries are pure data.

A ``KeyMap`` names, for one dataset: its embodiment (``configs/embodiments/<name>.yaml``), camera slot -> raw
image key, the language key(s), control rate and action space, how the state and action vectors are assembled
from raw per-step arrays (a tuple of ``Part``s each, concatenated in the embodiment spec's field order), which
frames to drop, and optional named episode-level steps (e.g. Bridge's state-delta relabel). The named operations
live in ``conversions.py``; the mechanism that applies a map is ``vla.data.standardize``; a parametrized contract
test (tests/test_standardize.py) runs every registered entry on a fake episode built from its declared features.

Adding a dataset is one ``register(KeyMap(...))`` call in a module of this package (``oxe.py``/``oxe_franka.py``
for Open X-Embodiment, ``droid.py``; LeRobot datasets whose ``robot_type`` is a registered embodiment get a
generic map from ``lerobot.py`` with no entry at all). Raw keys are the reader's: RLDS step paths joined by
``/`` without ``steps/`` (``observation/state``), LeRobot feature names (``observation.state``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vla.registry import Registry
from vla.types import IMAGE_SLOTS

#: Gripper conversions (as OpenVLA's and Octo's OXE transforms do them: ``OXE_SOURCE``), applied to a 1-wide part over the whole episode:
#: ``none`` as stored; ``rel2abs`` relative +close/-open events -> absolute 1 = open; ``invert`` 1 - x;
#: ``clip`` clip(x, 0, 1); ``clip_invert`` 1 - clip(x, 0, 1); ``binarize`` Bridge's >0.95 / <0.05 rule with a
#: backward scan; ``const0``/``const1`` a constant (no raw key; also used for documented zero padding).
GRIPPER_CONVERSIONS: tuple[str, ...] = (
    "none",
    "rel2abs",
    "invert",
    "clip",
    "clip_invert",
    "binarize",
    "const0",
    "const1",
)
#: Every conversion a ``Part`` may name: the gripper ones plus ``quat_to_euler`` (4 dims xyzw -> 3 dims roll/pitch/yaw).
PART_CONVERSIONS: tuple[str, ...] = (*GRIPPER_CONVERSIONS, "quat_to_euler")
#: What the action vector means (documentation and a coarse check against the spec's action fields).
ACTION_SPACES: tuple[str, ...] = (
    "eef_delta",
    "eef_abs",
    "eef_xy_delta",
    "joint_pos",
    "joint_delta",
    "joint_vel",
)
#: Raw feature type strings: ``float32[7]``, ``float32`` (scalar per step), ``bool``, ``int32[512]``, ``string``;
#: prefix ``zlib:`` for a string feature holding zlib-compressed raw bytes (``zlib:float32[7]``, kuka).
#: The per-dataset OXE standardization both peers publish, cited by the OXE key maps' ``sources``.
OXE_SOURCE = (
    "openvla/openvla@c8f03f4 prismatic/vla/datasets/rlds/oxe/{configs,transforms}.py; octo-models/octo@241fb35 "
    "octo/data/oxe/{oxe_dataset_configs,oxe_standardization_transforms}.py"
)
#: Where ``rel2abs`` comes from (``vla.data.keymaps.conversions``).
REL2ABS_SOURCE = (
    "rel2abs_gripper_actions in openvla prismatic/vla/datasets/rlds/utils/data_utils.py (= Octo's)"
)
FEATURE_TYPE = re.compile(r"^(zlib:)?(float32|float64|int32|int64|bool|string)(?:\[(\d+)\])?$")


class KeyMapError(ValueError):
    """A key map is malformed or does not fit the dataset; the message names dataset, entry, key and the fix."""


@dataclass(frozen=True)
class Part:
    """One contiguous piece of a state or action vector, taken from one raw per-step array.

    ``key`` raw feature (None for constants); ``index`` which dims of the raw vector: None = all, an int = that one
    dim, a ``slice``; ``convert`` one of ``PART_CONVERSIONS``; ``width`` only for constants (``const0``/``const1``).
    """

    key: str | None
    index: int | slice | None = None
    convert: str = "none"
    width: int = 1

    @property
    def is_const(self) -> bool:
        return self.convert in ("const0", "const1")

    def out_width(self, raw_width: int) -> int:
        """Width this part contributes given the raw feature's per-step width (1 for scalars)."""
        if self.is_const:
            return self.width
        if self.index is None:
            n = raw_width
        elif isinstance(self.index, int):
            n = 1
        else:
            n = len(range(*self.index.indices(raw_width)))
        return 3 if self.convert == "quat_to_euler" else n

    def describe(self) -> str:
        if self.is_const:
            return f"{self.convert} x{self.width}"
        idx = "" if self.index is None else f"[{_fmt_index(self.index)}]"
        conv = "" if self.convert == "none" else f" ({self.convert})"
        return f"{self.key}{idx}{conv}"


def _fmt_index(index: int | slice) -> str:
    if isinstance(index, int):
        return str(index)
    return f"{'' if index.start is None else index.start}:{'' if index.stop is None else index.stop}"


def raw(key: str, index: int | slice | None = None, convert: str = "none") -> Part:
    """A part read from raw feature ``key`` (e.g. ``raw("observation/state", slice(0, 6))``)."""
    return Part(key, index, convert)


def zeros(width: int = 1) -> Part:
    """``width`` documented zero dims: padding where a dataset lacks a field (flagged invalid in the metadata)."""
    return Part(None, None, "const0", width)


def ones(width: int = 1) -> Part:
    """``width`` constant-one dims (e.g. a gripper that is always open)."""
    return Part(None, None, "const1", width)


def parse_feature_type(spec: str) -> tuple[bool, str, tuple[int, ...]]:
    """``"zlib:float32[7]"`` -> ``(True, "float32", (7,))``; ``"string"`` -> ``(False, "string", ())``."""
    m = FEATURE_TYPE.match(spec)
    if not m:
        raise KeyMapError(
            f"feature type {spec!r} is not understood; write e.g. 'float32[7]', 'float32', 'bool', 'int32[512]', "
            "'string' or 'zlib:float32[7]'"
        )
    return bool(m.group(1)), m.group(2), (int(m.group(3)),) if m.group(3) else ()


@dataclass(frozen=True)
class KeyMap:
    """How one dataset maps onto the canonical frame (see the module docstring). Validated on construction.

    ``features`` declares every raw per-step key the map reads with its per-step type (``FEATURE_TYPE``); the
    standardizer checks the dataset against it and the contract test builds fake episodes from it.
    ``drop_first``/``drop_last`` frames are dropped after every per-episode computation (gripper scans use the
    whole episode). ``steps`` are named episode-level steps from ``vla.data.keymaps.conversions.EPISODE_STEPS``.
    ``idle_key`` (a joint-velocity command key) enables openpi's DROID idle-frame filter and ``success_key`` (an
    episode-metadata key) the success-only filter; both run only when ``StandardizeOptions`` turns them on.
    """

    dataset: str
    embodiment: str
    cameras: dict[str, str]
    language: str | tuple[str, ...]
    control_hz: float
    action_space: str
    state: tuple[Part, ...]
    action: tuple[Part, ...]
    features: dict[str, str] = field(default_factory=dict)
    drop_first: int = 0
    drop_last: int = 0
    steps: tuple[str, ...] = ()
    idle_key: str | None = None
    success_key: str | None = None
    success_pattern: str = ".*success.*"
    aliases: tuple[str, ...] = ()
    notes: str = ""
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        where = f"key map {self.dataset!r}"
        if not self.dataset or not self.embodiment:
            raise KeyMapError(f"{where}: 'dataset' and 'embodiment' are required")
        if self.action_space not in ACTION_SPACES:
            raise KeyMapError(
                f"{where}.action_space must be one of {ACTION_SPACES}, got {self.action_space!r}"
            )
        if not self.control_hz > 0:
            raise KeyMapError(f"{where}.control_hz must be > 0, got {self.control_hz}")
        if self.drop_first < 0 or self.drop_last < 0:
            raise KeyMapError(
                f"{where}: drop_first/drop_last must be >= 0, got {self.drop_first}/{self.drop_last}"
            )
        for key, spec in self.features.items():
            try:
                parse_feature_type(spec)
            except KeyMapError as e:
                raise KeyMapError(f"{where}.features[{key!r}]: {e}") from None
        for slot in self.cameras:
            if slot not in IMAGE_SLOTS:
                raise KeyMapError(f"{where}.cameras: unknown slot {slot!r}; allowed: {IMAGE_SLOTS}")
        for key in self.language_keys:
            if key not in self.features:
                raise KeyMapError(f"{where}.language: key {key!r} is not declared in features")
            _, dtype, _ = parse_feature_type(self.features[key])
            if dtype not in ("string", "int32"):
                raise KeyMapError(
                    f"{where}.language: {key!r} must be 'string' or 'int32[N]' (NUL-padded Unicode code points)"
                )
        for which, parts in (("state", self.state), ("action", self.action)):
            for i, p in enumerate(parts):
                self._check_part(f"{where}.{which}[{i}]", p)
        if not self.action:
            raise KeyMapError(f"{where}.action must list at least one part")
        if self.idle_key is not None and self.idle_key not in self.features:
            raise KeyMapError(f"{where}.idle_key: key {self.idle_key!r} is not declared in features")

    def __hash__(self) -> int:  # the dict fields are unhashable; equal maps share dataset and embodiment
        return hash((self.dataset, self.embodiment))

    def _check_part(self, where: str, p: Part) -> None:
        if p.convert not in PART_CONVERSIONS:
            raise KeyMapError(f"{where}.convert must be one of {PART_CONVERSIONS}, got {p.convert!r}")
        if p.is_const:
            if p.key is not None or p.width < 1:
                raise KeyMapError(f"{where}: a {p.convert} part takes no key and a width >= 1")
            return
        if p.key is None or p.key not in self.features:
            raise KeyMapError(
                f"{where}: raw key {p.key!r} is not declared in features {sorted(self.features)}"
            )
        _, dtype, shape = parse_feature_type(self.features[p.key])
        if dtype == "string":
            raise KeyMapError(f"{where}: raw key {p.key!r} is text; state/action parts need numbers")
        width = shape[0] if shape else 1
        if isinstance(p.index, int) and not -width <= p.index < width:
            raise KeyMapError(f"{where}: index {p.index} out of range for {p.key!r} of width {width}")
        n = p.out_width(width)
        if n < 1:
            raise KeyMapError(f"{where}: {p.describe()} selects no dims of {p.key!r} (width {width})")
        if p.convert in GRIPPER_CONVERSIONS and p.convert != "none" and n != 1:
            raise KeyMapError(
                f"{where}: gripper conversion {p.convert!r} needs a 1-wide part, got {p.describe()}"
            )
        if p.convert == "quat_to_euler" and _selected(p, width) != 4:
            raise KeyMapError(f"{where}: quat_to_euler needs 4 dims (x, y, z, w), got {p.describe()}")

    @property
    def language_keys(self) -> tuple[str, ...]:
        return (self.language,) if isinstance(self.language, str) else tuple(self.language)

    def raw_width(self, key: str) -> int:
        """Declared per-step width of raw feature ``key`` (1 for scalars)."""
        _, _, shape = parse_feature_type(self.features[key])
        return shape[0] if shape else 1

    def width(self, which: str) -> int:
        """Output width of the ``"state"`` or ``"action"`` vector this map builds (from the declared features)."""
        parts = self.state if which == "state" else self.action
        return sum(p.out_width(1 if p.is_const else self.raw_width(p.key or "")) for p in parts)

    def valid_dims(self, which: str) -> list[bool]:
        """Per output dim: False on state dims the map pads with a constant (the dataset lacks them), else True.

        Constant *action* parts are real values (e.g. cable routing's gripper is always closed, 0), so they count
        as valid.
        """
        parts = self.state if which == "state" else self.action
        out: list[bool] = []
        for p in parts:
            n = p.out_width(1 if p.is_const else self.raw_width(p.key or ""))
            out += [not (p.is_const and which == "state")] * n
        return out

    def describe(self, which: str) -> str:
        parts = self.state if which == "state" else self.action
        return " ++ ".join(p.describe() for p in parts) or "(empty)"


def _selected(p: Part, width: int) -> int:
    if p.index is None:
        return width
    if isinstance(p.index, int):
        return 1
    return len(range(*p.index.indices(width)))


KEYMAPS: Registry[KeyMap] = Registry(
    "dataset key map",
    hint="Add one KeyMap entry with register(...) in a module under vla/data/keymaps/ (see its __init__.py); "
    "a LeRobot dataset needs none when its info.json robot_type is a registered embodiment whose dims match.",
)
#: Module that registered each entry (named in error messages so the fix is one file away).
KEYMAP_ORIGIN: dict[str, str] = {}


def register(km: KeyMap, module: str = "") -> KeyMap:
    """Register ``km`` under its dataset name and every alias (e.g. ``bridge_orig`` for ``bridge_dataset``)."""
    for name in (km.dataset, *km.aliases):
        KEYMAPS.register(name, km)
        KEYMAP_ORIGIN[name] = module.replace(".", "/") + ".py" if module else "vla/data/keymaps/"
    return km


def _load_builtin() -> None:
    # Imported lazily: the entry modules import KeyMap/Part from here.
    from vla.data.keymaps import droid, oxe, oxe_franka  # noqa: F401


KEYMAPS.add_loader(_load_builtin)


def get_keymap(name: str) -> KeyMap:
    return KEYMAPS.get(name)


__all__ = [
    "ACTION_SPACES",
    "GRIPPER_CONVERSIONS",
    "KEYMAPS",
    "KEYMAP_ORIGIN",
    "PART_CONVERSIONS",
    "KeyMap",
    "KeyMapError",
    "Part",
    "get_keymap",
    "ones",
    "parse_feature_type",
    "raw",
    "register",
    "zeros",
]
