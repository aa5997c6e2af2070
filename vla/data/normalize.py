"""Strict validation of normalization stats and the invertible ``Normalizer``/``Unnormalizer`` pair.

The stats themselves (``NormStats`` per field vector, the versioned ``StatsFile`` keyed by embodiment and
``"<embodiment>@<dataset>"``) live in ``vla.data.norm_stats`` and are re-exported here. Stats are computed in one
streaming pass by ``vla.data.stats``; they travel inside every checkpoint so the Policy inverts exactly what the
loader applied.

Per-dim modes (``EmbodimentSpec.norm_modes``), for ``x`` float ``[..., D]``:

* ``quantile``  ``y = 2 (x - q01) / (q99 - q01) - 1``  (q01 -> -1, q99 -> +1)
* ``mean_std``  ``y = (x - mean) / std``
* ``min_max``   ``y = 2 (x - min) / (max - min) - 1``
* ``binary``    ``y = +1 if x > 0.5 else -1`` (raw grippers are standardized to 1 = open, 0 = closed);
  inverse ``x = 1 if y > 0 else 0``. Mapped to ±1 (not kept in {0, 1}) so it is centred like every other dim.
  NaN/inf stay non-finite in every mode (so the loader's finiteness check catches them).
* ``identity``  ``y = x`` (also every dim whose ``normalize_mask`` entry is False).

Decisions (the peers' choices: OpenVLA's BOUNDS_Q99 in openvla/openvla prismatic/vla/datasets/rlds/utils/
data_utils.py, openpi's quantile and z-score normalization in src/openpi/transforms.py):

* **No clipping by default** (``clip=None``), as openpi: the model is a continuous flow-matching head, and
  clipping would make the 2% of frames outside [q01, q99] non-invertible. ``clip=1.0`` gives OpenVLA's
  behaviour (needed for uniform action-token bins). The ``Unnormalizer`` never clips; safety clamps to the
  spec's limits are the server's job.
* **No epsilon** in the denominators (OpenVLA adds 1e-8, openpi 1e-6): degenerate dims are refused instead.
* **Constant dims** (``min == max``, or a whole range ``max - min`` below ``STATIC_TOL * max(1, |min|)``, 1e-4 in
  the field's units: 0.006° of a joint, 0.1 mm, a float32 gripper at 1 - 1e-8, the idle arm of a bimanual robot
  held by its servos within 1e-5 rad): scale 1 and centre ``min``, so the training data maps to 0 (exactly, or
  within ``STATIC_TOL``), like OpenVLA, which zeroes them, while staying invertible. Normalizing such a dim by its
  own spread would blow solver or sensor noise up to ±1.
* **Degenerate dims** (a dim that moves, but whose mode's scale is ~0, e.g. ``q99 == q01`` for a gripper that is
  closed in fewer than 1% of frames) and non-finite stats are errors naming the dim and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import numpy as np
import torch

from vla.data.norm_stats import (
    FIELDS,
    STATS_COMMAND,
    STATS_FORMAT_VERSION,
    NormStats,
    StatsError,
    StatsFile,
)
from vla.embodiments.spec import NORM_MODES, EmbodimentSpec

#: A mode's scale below ``DEGENERATE_TOL * max(1, |centre|)`` counts as ~0.
DEGENERATE_TOL = 1e-6
#: A dim whose whole range ``max - min`` is below ``STATIC_TOL * max(1, |min|)`` does not move (a constant).
STATIC_TOL = 1e-4


def _is_constant(s: NormStats, i: int) -> bool:
    """Dim ``i`` does not move (``STATIC_TOL``); exact constants included."""
    lo, hi = float(s.min[i]), float(s.max[i])
    return hi - lo <= STATIC_TOL * max(1.0, abs(lo))


ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)
_T = TypeVar("_T", bound="_FieldTransform")

__all__ = [
    "DEGENERATE_TOL",
    "FIELDS",
    "STATIC_TOL",
    "STATS_COMMAND",
    "STATS_FORMAT_VERSION",
    "NormStats",
    "Normalizer",
    "Problem",
    "StatsError",
    "StatsFile",
    "Unnormalizer",
    "field_problems",
    "make_normalize_fn",
    "validate_stats",
]


# ---- validation ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One defect of a stats entry: ``where`` is ``"<key>/<field>"``, ``dim`` the index (None = whole field)."""

    where: str
    dim: int | None
    dim_name: str
    message: str
    fix: str
    severity: str = "error"  # "error" (the Normalizer refuses) or "warning"

    def __str__(self) -> str:
        at = f"[{self.dim}] ({self.dim_name})" if self.dim is not None else ""
        return f"{self.severity}: '{self.where}'{at}: {self.message}. Fix: {self.fix}"


def field_problems(
    stats: NormStats,
    modes: Sequence[str],
    where: str,
    dim_names: Sequence[str] | None = None,
    normalize_mask: Sequence[bool] | None = None,
) -> list[Problem]:
    """Problems of one field's stats for the given per-dim modes (``where`` like ``"widowx_bridge/action"``)."""
    names = list(dim_names) if dim_names is not None else [f"dim{i}" for i in range(len(modes))]
    out: list[Problem] = []

    def add(i: int | None, msg: str, fix: str, severity: str = "error") -> None:
        out.append(Problem(where, i, "" if i is None else names[i], msg, fix, severity))

    if stats.dim != len(modes):
        add(
            None,
            f"stats have {stats.dim} dims but the spec has {len(modes)}",
            f"spec changed: rerun '{STATS_COMMAND}'",
        )
        return out
    mask = [True] * len(modes) if normalize_mask is None else list(normalize_mask)
    for i, mode in enumerate(modes):
        if mode not in NORM_MODES:
            add(i, f"unknown normalization mode {mode!r}", f"use one of {NORM_MODES}")
            continue
        if stats.num_nonfinite[i]:
            msg = f"{stats.num_nonfinite[i]} non-finite (NaN/inf) values in the data"
            add(i, msg, "fix the dataset's key map or drop the broken episodes", "warning")
        if mode in ("identity", "binary") or not mask[i]:
            continue
        lo, hi, q01, q99, std = stats.min[i], stats.max[i], stats.q01[i], stats.q99[i], stats.std[i]
        needed = {"quantile": (q01, q99), "mean_std": (stats.mean[i], std), "min_max": ()}[mode]
        if stats.count == 0 or not all(math.isfinite(v) for v in (*needed, lo, hi)):
            msg = f"non-finite stats for mode {mode!r} (count {stats.count}, min {lo}, max {hi}, q01 {q01}, q99 {q99}, std {std})"
            add(i, msg, f"rerun '{STATS_COMMAND}' on valid data")
        elif not _is_constant(stats, i):  # constant dims map to 0 with unit scale (see the module docstring)
            centre, scale = _affine(mode, stats, i)
            if not scale > DEGENERATE_TOL * max(1.0, abs(centre)):
                what = {"quantile": f"q99 - q01 = {q99 - q01:.3g}", "mean_std": f"std = {std:.3g}"}
                msg = f"degenerate {mode!r} stats: {what.get(mode, f'max - min = {hi - lo:.3g}')} but the dim moves "
                other = "min_max" if mode == "quantile" else "quantile"
                fix = (
                    f"set normalization: {other} (or binary/identity for a gripper) for this field in "
                    f"configs/embodiments/<embodiment>.yaml, or recompute with more data ('{STATS_COMMAND}')"
                )
                add(i, msg + f"(min {lo:.6g}, max {hi:.6g})", fix)
    return out


def validate_stats(stats: StatsFile, spec: EmbodimentSpec, *, dataset: str | None = None) -> list[Problem]:
    """Every problem of the stats ``spec`` would be normalized with (missing fields included)."""
    out: list[Problem] = []
    for which in FIELDS:
        modes, names = spec.norm_modes(which), spec.state_names() if which == "state" else spec.action_names()
        try:
            st = stats.get(spec.name, which, dataset)
        except StatsError as e:
            where = f"{StatsFile.key(spec.name, dataset)}/{which}"
            out += (
                [Problem(where, None, "", str(e).split(". Run")[0], f"run '{STATS_COMMAND}'")]
                if modes
                else []
            )
            continue
        out += field_problems(st, modes, f"{stats.resolve_key(spec.name, which, dataset)}/{which}", names)
    return out


# ---- transforms -----------------------------------------------------------------------------------------------
def _affine(mode: str, s: NormStats, i: int) -> tuple[float, float]:
    """(centre, half-width) of dim ``i`` so that ``y = (x - centre) / half``."""
    if mode in ("quantile", "mean_std", "min_max") and _is_constant(s, i):
        return float(s.min[i]), 1.0
    if mode == "quantile":
        return float(s.q01[i] + s.q99[i]) / 2, float(s.q99[i] - s.q01[i]) / 2
    if mode == "mean_std":
        return float(s.mean[i]), float(s.std[i])
    if mode == "min_max":
        return float(s.min[i] + s.max[i]) / 2, float(s.max[i] - s.min[i]) / 2
    return 0.0, 1.0  # identity (binary is handled separately)


def _keep_nonfinite(value, x, where):  # numpy or torch
    """``value`` where ``x`` is finite, NaN elsewhere: a thresholded binary dim must not turn a NaN into -1 (or 0)
    silently, which would hide it from the loader's finiteness check."""
    return where(abs(x) < math.inf, value, math.nan)


class _FieldTransform:
    """Shared setup of the invertible pair: per-dim affine ``(centre, half)`` plus a binary-dim mask."""

    def __init__(
        self,
        stats: NormStats,
        modes: Sequence[str],
        *,
        name: str = "field",
        dim_names: Sequence[str] | None = None,
        normalize_mask: Sequence[bool] | None = None,
        clip: float | None = None,
    ) -> None:
        errors = [
            p for p in field_problems(stats, modes, name, dim_names, normalize_mask) if p.severity == "error"
        ]
        if errors:
            raise StatsError(f"Cannot normalize '{name}':\n  " + "\n  ".join(str(p) for p in errors))
        if clip is not None and not clip > 0:
            raise StatsError(f"clip must be > 0 or None, got {clip}")
        mask = [True] * len(modes) if normalize_mask is None else list(normalize_mask)
        self.stats, self.modes, self.name, self.clip = stats, list(modes), name, clip
        self.dim_names = list(dim_names) if dim_names is not None else None
        self.normalize_mask = np.asarray(mask, dtype=bool)
        ab = [_affine(m, stats, i) if k else (0.0, 1.0) for i, (m, k) in enumerate(zip(modes, mask))]
        self.centre = np.array([a for a, _ in ab], dtype=np.float64).reshape(-1)
        self.half = np.array([b for _, b in ab], dtype=np.float64).reshape(-1)
        self.binary = np.array([m == "binary" and k for m, k in zip(modes, mask)], dtype=bool)
        self.clipped = np.array(
            [k and m not in ("identity", "binary") for m, k in zip(modes, mask)], dtype=bool
        )
        # dims that do not move in the data (see the module docstring): the Unnormalizer keeps them in [min, max]
        const = [k and m in ("quantile", "mean_std", "min_max") and _is_constant(stats, i)
                 for i, (m, k) in enumerate(zip(modes, mask))]  # fmt: skip
        self.constant_lo = np.where(
            const, np.asarray(stats.min, np.float64).reshape(-1)[: len(modes)], -np.inf
        )
        self.constant_hi = np.where(
            const, np.asarray(stats.max, np.float64).reshape(-1)[: len(modes)], np.inf
        )
        self._torch_cache: dict[tuple[Any, Any], tuple[torch.Tensor, ...]] = {}

    @property
    def dim(self) -> int:
        return len(self.modes)

    @classmethod
    def from_spec(
        cls,
        stats: StatsFile,
        spec: EmbodimentSpec,
        field: str,
        *,
        dataset: str | None = None,
        clip: float | None = None,
        normalize_mask: Sequence[bool] | None = None,
    ) -> Self:
        """Build from a ``StatsFile`` and the spec's modes; ``field`` is "state" or "action"."""
        if field not in FIELDS:
            raise StatsError(f"field must be one of {FIELDS}, got {field!r}")
        names = spec.state_names() if field == "state" else spec.action_names()
        st, key = stats.get(spec.name, field, dataset), stats.resolve_key(spec.name, field, dataset)
        return cls(
            st,
            spec.norm_modes(field),
            name=f"{key}/{field}",
            dim_names=names,
            normalize_mask=normalize_mask,
            clip=clip,
        )

    def _params(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dt = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        k = (x.device, dt)
        if k not in self._torch_cache:
            self._torch_cache[k] = tuple(
                torch.as_tensor(a, device=x.device, dtype=dt if a.dtype != bool else torch.bool)
                for a in (self.centre, self.half, self.binary, self.clipped)
            )
        return self._torch_cache[k]

    def _check(self, x: np.ndarray | torch.Tensor) -> None:
        if x.shape[-1:] != (self.dim,):
            raise StatsError(f"'{self.name}': expected an array [..., {self.dim}], got shape {list(x.shape)}")

    def __call__(self, x: ArrayT) -> ArrayT:
        """Apply to a numpy array or torch tensor ``[..., D]``; returns the same type, dtype and shape."""
        self._check(x)
        if isinstance(x, torch.Tensor):
            c, h, b, k = self._params(x)
            y = self._apply(x.to(c.dtype), c, h, b, k, torch.where, torch.clamp)
            return y.to(x.dtype)
        xf = np.asarray(x, dtype=np.float64)
        y = self._apply(xf, self.centre, self.half, self.binary, self.clipped, np.where, np.clip)
        return y.astype(x.dtype if np.issubdtype(x.dtype, np.floating) else np.float32, copy=False)

    def _apply(self, x, c, h, b, k, where, clamp):  # numpy or torch: same code
        raise NotImplementedError

    def _twin(self, cls: type[_T]) -> _T:
        mask = self.normalize_mask.tolist()
        return cls(
            self.stats,
            self.modes,
            name=self.name,
            dim_names=self.dim_names,
            normalize_mask=mask,
            clip=self.clip,
        )


class Normalizer(_FieldTransform):
    """Raw units -> model units for one field (see the module docstring for modes, clipping and constants)."""

    def _apply(self, x, c, h, b, k, where, clamp):
        y = (x - c) / h
        if self.clip is not None:
            y = where(k, clamp(y, -self.clip, self.clip), y)
        return where(b, _keep_nonfinite(where(x > 0.5, 1.0, -1.0), x, where), y)

    def inverse(self) -> Unnormalizer:
        return self._twin(Unnormalizer)


class Unnormalizer(_FieldTransform):
    """Model units -> raw units for one field: the exact inverse of ``Normalizer`` (binary: ``y > 0`` -> 1).

    Dims that did not move in the data (constant within ``STATIC_TOL``, normalized with unit scale) are kept in
    their data range ``[min, max]``: with unit scale a model error of 0.05 would otherwise command 0.05 rad on a
    joint the data never moved (OpenVLA returns the constant)."""

    def __call__(self, x: ArrayT) -> ArrayT:
        y = super().__call__(x)
        if not np.isfinite(self.constant_lo).any():
            return y
        if isinstance(y, torch.Tensor):
            lo = torch.as_tensor(self.constant_lo, device=y.device, dtype=y.dtype)
            hi = torch.as_tensor(self.constant_hi, device=y.device, dtype=y.dtype)
            return torch.where(torch.isfinite(y), torch.minimum(torch.maximum(y, lo), hi), y)  # inf stays inf
        kept = np.clip(y, self.constant_lo, self.constant_hi)
        return np.where(np.isfinite(y), kept, y).astype(y.dtype, copy=False)

    def _apply(self, x, c, h, b, k, where, clamp):
        return where(b, _keep_nonfinite(where(x > 0, 1.0, 0.0), x, where), x * h + c)

    def inverse(self) -> Normalizer:
        return self._twin(Normalizer)


def make_normalize_fn(
    stats: StatsFile,
    specs: dict[str, EmbodimentSpec],
    *,
    clip: float | None = None,
    per_dataset: bool | Collection[str] = False,
) -> Callable[[str, str, str, np.ndarray], np.ndarray]:
    """The loader's ``normalize(embodiment, dataset, which, array)``: Normalizers built lazily and cached.

    Stats are per embodiment; ``per_dataset`` (True, or the names of the datasets whose conventions
    differ) uses the ``"<embodiment>@<dataset>"`` stats instead where the file has them.
    """
    cache: dict[tuple[str, str, str], Normalizer] = {}

    def normalize(embodiment: str, dataset: str, which: str, x: np.ndarray) -> np.ndarray:
        own = per_dataset is True or (not isinstance(per_dataset, bool) and dataset in per_dataset)
        k = (embodiment, dataset if own else "", which)
        if k not in cache:
            cache[k] = Normalizer.from_spec(stats, specs[embodiment], which, dataset=k[1] or None, clip=clip)
        return cache[k](x)

    return normalize
