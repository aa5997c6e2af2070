"""``NormStats`` (per-dim statistics of one field vector) and ``StatsFile``, the versioned JSON that carries them.

A ``StatsFile`` is keyed by embodiment (``"widowx_bridge"``) and, for datasets whose conventions differ, by
embodiment and dataset (``"widowx_bridge@bridge_dataset"``); each key holds ``"state"`` and ``"action"``
``NormStats``. ``vla.data.stats`` computes them; ``vla.data.normalize`` validates them and builds the
``Normalizer``/``Unnormalizer`` pair from them. Old ``format_version``s stay loadable through ``_UPGRADES``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

import vla

STATS_FORMAT_VERSION = 1
FIELDS = ("state", "action")
STATS_COMMAND = "vla data stats <dataset>"
_STAT_KEYS = ("mean", "std", "min", "max", "q01", "q99")


class StatsError(ValueError):
    """Stats are missing, malformed, degenerate or from a newer vla; the message names the field and the fix."""


@dataclass
class NormStats:
    """Per-dim statistics of one field vector: each array is float64 ``[D]``; ``count`` frames were seen.

    ``num_nonfinite[d]`` counts NaN/inf values of dim ``d`` (excluded from the other statistics).
    ``std`` is the population standard deviation (ddof = 0).
    """

    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray
    q01: np.ndarray
    q99: np.ndarray
    count: int
    num_nonfinite: np.ndarray | None = None

    def __post_init__(self) -> None:
        for k in _STAT_KEYS:
            setattr(self, k, np.asarray(getattr(self, k), dtype=np.float64).reshape(-1))
        dims = {k: getattr(self, k).shape[0] for k in _STAT_KEYS}
        if len(set(dims.values())) != 1:
            raise StatsError(f"NormStats arrays must all have the same length, got {dims}")
        if self.num_nonfinite is None:
            self.num_nonfinite = np.zeros(self.dim, dtype=np.int64)
        self.num_nonfinite = np.asarray(self.num_nonfinite, dtype=np.int64).reshape(-1)
        self.count = int(self.count)

    @property
    def dim(self) -> int:
        return int(self.mean.shape[0])

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {k: [float(v) for v in getattr(self, k)] for k in _STAT_KEYS}
        d["count"] = self.count
        d["num_nonfinite"] = [int(v) for v in self.num_nonfinite]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "stats") -> NormStats:
        d = dict(d)
        for ours, theirs in (("q01", "p01"), ("q99", "p99")):  # Octo names its percentiles p01/p99
            if ours not in d and theirs in d:
                d[ours] = d[theirs]
        missing = [k for k in (*_STAT_KEYS, "count") if k not in d]
        if missing:
            raise StatsError(
                f"{where}: missing key(s) {missing}; expected {[*_STAT_KEYS, 'count']}. Recompute with '{STATS_COMMAND}'."
            )
        nan = lambda v: [math.nan if x is None else x for x in v]  # noqa: E731 - JSON null = NaN
        return cls(
            **{k: nan(d[k]) for k in _STAT_KEYS}, count=d["count"], num_nonfinite=d.get("num_nonfinite")
        )


@dataclass
class StatsFile:
    """Versioned container of ``NormStats``: ``stats[key][field]`` with key ``"<embodiment>"`` or
    ``"<embodiment>@<dataset>"`` and field ``"state"``/``"action"``; ``sources`` lists the datasets (name, path,
    episode and frame counts) the stats were computed from."""

    stats: dict[str, dict[str, NormStats]] = field(default_factory=dict)
    sources: list[dict[str, Any]] = field(default_factory=list)
    created_by: str = f"vla {vla.__version__}"
    created_at: str = ""
    format_version: int = STATS_FORMAT_VERSION
    path: Path | None = None  # where it was loaded from / saved to (for error messages)

    @staticmethod
    def key(embodiment: str, dataset: str | None = None) -> str:
        return f"{embodiment}@{dataset}" if dataset else embodiment

    def resolve_key(self, embodiment: str, field: str, dataset: str | None = None) -> str:
        """The key ``get`` reads: ``"<embodiment>@<dataset>"`` when present, else ``"<embodiment>"``."""
        dk = self.key(embodiment, dataset)
        return dk if dataset and field in self.stats.get(dk, {}) else embodiment

    def get(self, embodiment: str, field: str, dataset: str | None = None) -> NormStats:
        """Stats of ``embodiment``'s ``field``, preferring the dataset-specific key when ``dataset`` is given."""
        keys = [self.key(embodiment, dataset), embodiment] if dataset else [embodiment]
        for k in keys:
            if field in self.stats.get(k, {}):
                return self.stats[k][field]
        where = f" in {self.path}" if self.path else ""
        raise StatsError(
            f"No normalization stats for '{keys[0]}/{field}'{where} (have: {', '.join(sorted(self.stats)) or 'none'}). "
            f"Run '{STATS_COMMAND}' on the dataset(s) of embodiment {embodiment!r}."
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "created_by": self.created_by,
            "created_at": self.created_at or datetime.now(UTC).isoformat(timespec="seconds"),
            "sources": self.sources,
            "stats": {k: {f: s.to_dict() for f, s in v.items()} for k, v in sorted(self.stats.items())},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "stats") -> StatsFile:
        if not isinstance(d, dict):
            raise StatsError(
                f"{where}: not a vla stats file (a JSON {type(d).__name__}, not an object). "
                f"Recompute with '{STATS_COMMAND}'."
            )
        version = d.get("format_version")
        if not isinstance(version, int):
            raise StatsError(
                f"{where}: not a vla stats file (no integer 'format_version'). Recompute with '{STATS_COMMAND}'."
            )
        if version > STATS_FORMAT_VERSION:
            raise StatsError(
                f"{where}: format_version {version} is newer than this vla ({STATS_FORMAT_VERSION}); upgrade vla."
            )
        while version < STATS_FORMAT_VERSION:  # old files stay loadable: upgrade one version at a time
            d, version = _UPGRADES[version](d), version + 1
        stats = {
            k: {f: NormStats.from_dict(s, f"{where}: '{k}/{f}'") for f, s in v.items()}
            for k, v in d.get("stats", {}).items()
        }
        return cls(
            stats=stats,
            sources=list(d.get("sources", [])),
            created_by=str(d.get("created_by", "")),
            created_at=str(d.get("created_at", "")),
            format_version=STATS_FORMAT_VERSION,
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)  # atomic: a reader never sees half a file
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | Path) -> StatsFile:
        path = Path(path)
        if not path.is_file():
            raise StatsError(
                f"{path}: no such stats file. Run '{STATS_COMMAND}' (or pass --out to choose where)."
            )
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise StatsError(f"{path}: not valid JSON ({e}). Recompute with '{STATS_COMMAND}'.") from e
        sf = cls.from_dict(d, where=str(path))
        sf.path = path
        return sf


#: ``_UPGRADES[v]`` turns a format-``v`` dict into a format-``v+1`` dict (none yet: version 1 is the first).
_UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}
