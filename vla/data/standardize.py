"""Standardization: a dataset's ``KeyMap`` applied to raw episodes -> canonical ``StdEpisode`` / ``Frame``.

Per episode (all arrays over the episode's ``L`` raw frames, then the dropped frames removed):

1. read the declared raw keys (checked against the map's ``features``: missing key or wrong width is an error
   naming the dataset, the entry, the key and the keys that exist);
2. assemble ``state`` ``[L, S]`` and ``action`` ``[L, A]`` from the map's parts, applying the named conversions
   (gripper conversions scan the whole episode, as OpenVLA/Octo do);
3. run the map's named episode-level steps (``EPISODE_STEPS``, e.g. Bridge's state-delta relabel);
4. pick the prompt per frame (one language key, DROID's three alternatives, or Language-Table code points);
5. drop frames: the steps' own drops, ``drop_first``/``drop_last``, and (when enabled in ``StandardizeOptions``)
   openpi's DROID idle-frame filter and the success-only episode filter. Each dropped frame keeps its reason,
   which ``standardize_frame`` reports.

The output widths always equal the embodiment spec's ``state_dim``/``action_dim`` (checked here).
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vla.data.keymaps import KEYMAP_ORIGIN, KEYMAPS, KeyMap, KeyMapError, Part, parse_feature_type
from vla.data.keymaps.conversions import (
    EPISODE_STEPS,
    GRIPPER_FNS,
    EpisodeWork,
    binarize_gripper,
    openpi_idle_keep_mask,
    quat_to_euler,
    rel2abs_gripper,
    state_delta_relabel,
)
from vla.data.readers.base import DatasetFormatError, DatasetReader, RawEpisode
from vla.embodiments import get_embodiment
from vla.types import Frame

LANGUAGE_CHOICES = ("first_nonempty", "random")


class FrameDroppedError(LookupError):
    """The requested raw frame exists but the key map drops it (the message says why)."""


@dataclass(frozen=True)
class StandardizeOptions:
    """Per-run choices that are not part of a dataset's identity (so they live outside the key map).

    ``drop_first``/``drop_last`` override the map's defaults (e.g. ``drop_first=0`` keeps Bridge's first step
    as Octo does). ``language_choice`` for datasets with several instruction keys (DROID): ``first_nonempty``
    (deterministic) or ``random`` (one key per episode, seeded by ``seed``, dataset, split and episode).
    ``idle_filter`` applies openpi's DROID idle-frame rule and ``success_only`` keeps only episodes whose
    success key matches; both only affect maps that declare ``idle_key``/``success_key``.
    """

    drop_first: int | None = None
    drop_last: int | None = None
    language_choice: str = "first_nonempty"
    seed: int = 0
    idle_filter: bool = False
    success_only: bool = False

    def __post_init__(self) -> None:
        if self.language_choice not in LANGUAGE_CHOICES:
            raise ValueError(
                f"StandardizeOptions.language_choice must be one of {LANGUAGE_CHOICES}, got {self.language_choice!r}"
            )
        for name in ("drop_first", "drop_last"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"StandardizeOptions.{name} must be >= 0, got {v}")


@dataclass
class StdEpisode:
    """One standardized episode: ``T`` kept frames in the embodiment spec's field order.

    ``frames`` int64 ``[T]`` raw frame indices kept; ``state`` float32 ``[T, S]`` (``S == spec.state_dim``);
    ``action`` float32 ``[T, A]`` (``A == spec.action_dim``); ``prompt`` list of ``T`` strings; ``cameras`` slot ->
    raw image key (for ``reader.read_images``). ``metadata``: ``episode_metadata`` (as stored), ``keymap``,
    ``state_valid``/``action_valid`` (per-dim bool lists, False on padded dims), ``language_key``,
    ``num_raw_frames``, ``dropped`` (reason -> count) and ``drop_reasons`` (raw frame -> reason).
    """

    dataset: str
    split: str
    episode: int
    embodiment: str
    frames: np.ndarray
    state: np.ndarray
    action: np.ndarray
    prompt: list[str]
    cameras: dict[str, str]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.frames)


# ---- raw access -------------------------------------------------------------------------------------------------


def _where(km: KeyMap, name: str) -> str:
    return f"dataset {name!r} (key map entry {km.dataset!r} in {KEYMAP_ORIGIN.get(km.dataset, 'vla/data/keymaps/')})"


def _missing(km: KeyMap, name: str, role: str, key: str, available: list[str]) -> KeyMapError:
    return KeyMapError(
        f"{_where(km, name)}: {role} reads raw key {key!r}, which the dataset does not have. Keys in the dataset: "
        f"{sorted(available)}. Fix the entry (or check the dataset version against the one the entry targets)."
    )


class _RawArrays:
    """Decoded raw per-step arrays of one episode, checked against the key map's declared feature types."""

    def __init__(
        self, km: KeyMap, raw: RawEpisode, name: str, image_keys: list[str], where: str = ""
    ) -> None:
        self.km, self.raw, self.name, self.image_keys = km, raw, name, image_keys
        self.where = where or f"dataset {name!r} {raw.split} episode {raw.index}"
        self._cache: dict[str, Any] = {}

    def available(self) -> list[str]:
        return [*self.raw.steps, *self.image_keys]

    def get(self, key: str, role: str) -> Any:
        if key in self._cache:
            return self._cache[key]
        if key not in self.raw.steps:
            raise _missing(self.km, self.name, role, key, self.available())
        compressed, dtype, shape = parse_feature_type(self.km.features[key])
        value = self.raw.steps[key]
        if dtype == "string":
            out: Any = self._texts(key, value)
        else:
            if compressed and value.dtype == object:
                value = np.stack([np.frombuffer(zlib.decompress(_to_bytes(v)), dtype=dtype) for v in value])
            arr = np.asarray(value, dtype=np.float64 if dtype != "int32" else np.int64)
            width = shape[0] if shape else 1
            arr = arr.reshape(len(arr), -1) if arr.ndim != 2 else arr
            if arr.shape[1] != width:
                raise KeyMapError(
                    f"{_where(self.km, self.name)}: raw key {key!r} has per-step shape {list(np.shape(value)[1:])} "
                    f"but the entry declares {self.km.features[key]!r}. Fix the entry's features and parts."
                )
            out = arr
        self._cache[key] = out
        return out

    def _texts(self, key: str, values: Any) -> list[str]:
        """Per-step text of ``key``, decoded as strict UTF-8; equal neighbours share one ``str`` object, so an
        instruction repeated on every frame is held once however long it is."""
        out: list[str] = []
        for step, v in enumerate(values):
            if out and (v is values[step - 1] or v == values[step - 1]):
                out.append(out[-1])
                continue
            try:
                out.append(_to_text(v))
            except UnicodeDecodeError as e:
                raise DatasetFormatError(
                    f"{self.where} field {key!r} step {step}: not UTF-8 text ({e.reason} at byte {e.start}: "
                    f"{bytes(v)[max(0, e.start - 8) : e.start + 8]!r}); a prompt must be the dataset's own text. "
                    "Re-export the dataset with UTF-8 strings (or set data.on_bad_sample=skip)"
                ) from None
        return out


def _to_bytes(v: Any) -> bytes:
    # A reader hands UTF-8-decodable byte strings over as str; encoding back restores the exact bytes.
    return v.encode("utf-8") if isinstance(v, str) else bytes(v)


def _to_text(v: Any) -> str:
    """A stored string as ``str``: bytes are strict UTF-8 (``UnicodeDecodeError`` otherwise), never a repr."""
    if isinstance(v, bytes | bytearray | np.bytes_ | memoryview):
        return bytes(v).decode("utf-8")
    return str(v)


def _codepoints_to_text(row: np.ndarray) -> str:
    """Language-Table instruction: int32 Unicode code points, NUL-padded -> the text before the first NUL."""
    nul = np.flatnonzero(row == 0)
    return "".join(chr(int(c)) for c in row[: nul[0] if len(nul) else len(row)])


def _assemble(parts: tuple[Part, ...], arrays: _RawArrays, length: int, which: str) -> np.ndarray:
    """Concatenate the parts of the ``which`` vector -> float64 ``[L, width]``."""
    cols: list[np.ndarray] = []
    for i, p in enumerate(parts):
        if p.is_const:
            cols.append(np.full((length, p.width), 1.0 if p.convert == "const1" else 0.0))
            continue
        arr = arrays.get(p.key or "", f"{which} part {i} ({p.describe()})")
        if p.index is None:
            sel = arr
        elif isinstance(p.index, int):
            sel = arr[:, [p.index]]
        else:
            sel = arr[:, p.index]
        sel = sel.astype(np.float64)
        if p.convert == "quat_to_euler":
            sel = quat_to_euler(sel)
        elif p.convert != "none":
            sel = GRIPPER_FNS[p.convert](sel[:, 0])[:, None]
        cols.append(sel)
    return np.concatenate(cols, axis=1) if cols else np.zeros((length, 0))


def _prompts(
    km: KeyMap, arrays: _RawArrays, raw: RawEpisode, opts: StandardizeOptions, name: str
) -> tuple[list[str], str]:
    """Per-frame prompts ``[L]`` and the language key used."""
    texts: dict[str, list[str]] = {}
    for key in km.language_keys:
        value = arrays.get(key, "language")
        if isinstance(value, list):
            stripped: dict[str, str] = {}  # one str per distinct prompt, not one copy per frame
            texts[key] = [stripped.get(t) or stripped.setdefault(t, t.strip()) for t in value]
        else:  # int32 code points [L, N]
            texts[key] = [_codepoints_to_text(row).strip() for row in value.astype(np.int64)]
    keys = list(texts)
    nonempty = [k for k in keys if any(texts[k])]
    if len(keys) == 1 or not nonempty:
        chosen = keys[0]
    elif opts.language_choice == "first_nonempty":
        chosen = nonempty[0]
    else:
        seed = zlib.crc32(f"{opts.seed}/{name}/{raw.split}/{raw.index}".encode())
        chosen = nonempty[int(np.random.default_rng(seed).integers(len(nonempty)))]
    return texts[chosen], chosen


def _metadata_value(raw: RawEpisode, key: str) -> Any:
    for k in (key, f"episode_metadata/{key}"):
        if k in raw.metadata:
            return raw.metadata[k]
    raise KeyError(key)


# ---- public API -------------------------------------------------------------------------------------------------


def keymap_for(reader: DatasetReader) -> KeyMap | None:
    """The key map for ``reader``: the registered entry for ``reader.name`` (aliases included), else a generic map
    for a LeRobot dataset whose ``robot_type`` is a registered embodiment with matching widths, else None."""
    if reader.name in KEYMAPS:
        return KEYMAPS.get(reader.name)
    from vla.data.keymaps.lerobot import generic_keymap

    return generic_keymap(reader)


def no_keymap_reason(reader: DatasetReader) -> str:
    """Why ``reader`` has no key map, naming what is missing (for errors): the unknown dataset name, and for a
    LeRobot dataset why the generic map does not apply (no ``robot_type``, an unregistered one, or a missing
    or mis-sized feature such as ``observation.state``)."""
    from vla.data.keymaps.lerobot import generic_keymap_reason

    generic = generic_keymap_reason(reader) if reader.format.startswith("lerobot") else ""
    if generic and reader.robot_type:  # the generic map is what this dataset is meant to use
        return f"the LeRobot generic map does not apply: {generic}."
    known = ""
    try:
        KEYMAPS.get(reader.name)
    except KeyError as e:
        known = str(e.args[0] if e.args else e)
    return f"{known} (LeRobot generic map: {generic}.)" if generic else known


def _require_keymap(reader: DatasetReader) -> KeyMap:
    km = keymap_for(reader)
    if km is not None:
        return km
    raise KeyMapError(
        f"{reader.path}: dataset {reader.name!r} has no key map, so its frames cannot be standardized. "
        f"{no_keymap_reason(reader)}"
    )


def standardize_episode(
    reader: DatasetReader,
    split: str,
    episode: int,
    keymap: KeyMap | None = None,
    *,
    raw: RawEpisode | None = None,
    options: StandardizeOptions | None = None,
) -> StdEpisode:
    """Apply ``keymap`` (default: ``keymap_for(reader)``) to one episode -> ``StdEpisode`` (see the module doc).

    ``raw`` skips re-reading the episode when the caller already has it.
    """
    km = keymap or _require_keymap(reader)
    opts = options or StandardizeOptions()
    name = reader.name
    raw = raw if raw is not None else reader.read_episode(split, episode)
    spec = get_embodiment(km.embodiment)
    length = raw.length
    arrays = _RawArrays(
        km, raw, name, reader.image_keys(), f"{reader.path} split {split!r} episode {episode}"
    )
    for slot, key in km.cameras.items():
        if key not in arrays.image_keys:
            raise _missing(km, name, f"camera slot {slot!r}", key, arrays.available())

    work = EpisodeWork(
        keymap=km,
        raw=raw,
        state=_assemble(km.state, arrays, length, "state"),
        action=_assemble(km.action, arrays, length, "action"),
        reasons=[""] * length,
    )
    for which, got, want in (
        ("state", work.state.shape[1], spec.state_dim),
        ("action", work.action.shape[1], spec.action_dim),
    ):
        if got != want:
            raise KeyMapError(
                f"{_where(km, name)}: builds a {got}-D {which} ({km.describe(which)}) but embodiment "
                f"{spec.name!r} has {which}_dim {want} ({', '.join(getattr(spec, f'{which}_names')())})."
            )
    for step in km.steps:
        if step not in EPISODE_STEPS:
            raise KeyMapError(
                f"{_where(km, name)}: unknown episode step {step!r}; known: {sorted(EPISODE_STEPS)}"
            )
        EPISODE_STEPS[step](work)
    prompt, language_key = _prompts(km, arrays, raw, opts, name)

    drop_first = km.drop_first if opts.drop_first is None else opts.drop_first
    drop_last = km.drop_last if opts.drop_last is None else opts.drop_last
    if drop_first:
        work.drop(
            slice(0, drop_first),
            f"first {drop_first} frame(s) dropped by the key map (drop_first; StandardizeOptions(drop_first=0) keeps them)",
        )
    if drop_last:
        work.drop(
            slice(max(length - drop_last, 0), None),
            f"last {drop_last} frame(s) dropped by the key map (drop_last)",
        )
    if opts.idle_filter and km.idle_key is not None:
        keep = openpi_idle_keep_mask(arrays.get(km.idle_key, "idle filter"))
        work.drop(np.flatnonzero(~keep), f"idle frame (openpi DROID filter on {km.idle_key!r})")
    if opts.success_only and km.success_key is not None:
        try:
            value = _to_text(_metadata_value(raw, km.success_key))
        except UnicodeDecodeError as e:
            raise DatasetFormatError(
                f"{arrays.where} episode metadata {km.success_key!r}: not UTF-8 text ({e}); re-export the dataset"
            ) from None
        except KeyError:
            raise _missing(
                km, name, "success filter (episode metadata)", km.success_key, list(raw.metadata)
            ) from None
        if not re.fullmatch(km.success_pattern, value):
            work.drop(
                slice(None),
                f"episode filtered out: {km.success_key}={value!r} does not match {km.success_pattern!r}",
            )

    frames = np.array([t for t, r in enumerate(work.reasons) if not r], dtype=np.int64)
    drop_reasons = {t: r for t, r in enumerate(work.reasons) if r}
    return StdEpisode(
        dataset=name,
        split=split,
        episode=episode,
        embodiment=km.embodiment,
        frames=frames,
        state=work.state[frames].astype(np.float32),
        action=work.action[frames].astype(np.float32),
        prompt=[prompt[t] for t in frames],
        cameras=dict(km.cameras),
        metadata={
            "episode_metadata": dict(raw.metadata),
            "keymap": km.dataset,
            "state_valid": km.valid_dims("state"),
            "action_valid": km.valid_dims("action"),
            "language_key": language_key,
            "num_raw_frames": length,
            "dropped": dict(Counter(drop_reasons.values())),
            "drop_reasons": drop_reasons,
        },
    )


def standardize_frame(
    reader: DatasetReader, split: str, episode: int, frame: int, *, options: StandardizeOptions | None = None
) -> Frame:
    """The canonical ``Frame`` at raw frame index ``frame`` (images decoded via ``reader.read_images``).

    Raises ``IndexError`` for a frame outside the episode and ``FrameDroppedError`` (a ``LookupError``) saying why
    when the key map drops that frame (e.g. Bridge's all-zero first step).
    """
    km = _require_keymap(reader)
    std = standardize_episode(reader, split, episode, km, options=options)
    n = std.metadata["num_raw_frames"]
    if not 0 <= frame < n:
        raise IndexError(
            f"{reader.path}: frame {frame} out of range for {split} episode {episode} ({n} frames)"
        )
    pos = int(np.searchsorted(std.frames, frame))
    if pos >= len(std.frames) or std.frames[pos] != frame:
        kept = f"kept frames: {len(std.frames)} of {n}" + (
            f" ({std.frames[0]}..{std.frames[-1]})" if len(std.frames) else ""
        )
        raise FrameDroppedError(
            f"{reader.name} {split} episode {episode} frame {frame} is dropped by key map {km.dataset!r}: "
            f"{std.metadata['drop_reasons'][frame]}; {kept}."
        )
    images = reader.read_images(split, episode, [frame], list(std.cameras.values()))
    return Frame(
        images={slot: np.asarray(images[key][0]) for slot, key in std.cameras.items()},
        state=std.state[pos],
        action=std.action[pos],
        prompt=std.prompt[pos],
        embodiment=std.embodiment,
        dataset=std.dataset,
        episode=episode,
        frame=frame,
        timestamp=frame / km.control_hz,
    )


__all__ = [
    "EPISODE_STEPS",
    "GRIPPER_FNS",
    "EpisodeWork",
    "FrameDroppedError",
    "KeyMap",
    "KeyMapError",
    "StandardizeOptions",
    "StdEpisode",
    "binarize_gripper",
    "keymap_for",
    "openpi_idle_keep_mask",
    "quat_to_euler",
    "rel2abs_gripper",
    "standardize_episode",
    "standardize_frame",
    "state_delta_relabel",
]
