"""Named, weighted dataset mixtures (``data_mixtures/*.yaml``): the ``MIXTURES`` registry and ``resolve_mixture``.

A ``Mixture`` is data: a name, a citation and ``(dataset name, weight)`` entries (weights are per-transition
multipliers; with ``balance_by_size`` the sampling probability is ``weight x frames``, as Octo/OpenVLA's
``balance_weights``). ``resolve_mixture`` finds each dataset under one or more data roots (RLDS
``<root>/<name>/<version>/dataset_info.json``, newest version unless pinned, or ``<root>/<name>/dataset_info.json``;
LeRobot ``<root>/<name>/meta/info.json``) and builds the ``MixtureSampler`` (``vla.data.mixture_sampler``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from vla.data.mixture_sampler import MixtureError, MixtureSampler, mixture_weights
from vla.data.readers import rlds_version_dir
from vla.paths import mixture_dir
from vla.registry import Registry

log = logging.getLogger(__name__)

MIXTURE_FORMAT_VERSION = 1
KINDS = ("real", "sim")


@dataclass(frozen=True)
class MixtureEntry:
    """One dataset of a mixture. ``path`` (absolute or relative to the data root) overrides the lookup;
    ``version`` pins an RLDS version folder; ``aliases`` are other folder names of the same data."""

    name: str
    weight: float
    path: str | None = None
    split: str | None = None
    version: str | None = None
    kind: str = "real"
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Mixture:
    """A named weighted list of datasets (one ``data_mixtures/<name>.yaml``)."""

    name: str
    datasets: tuple[MixtureEntry, ...]
    description: str = ""
    source: str = ""
    balance_by_size: bool = True
    format_version: int = MIXTURE_FORMAT_VERSION
    path: Path | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "mixture") -> Mixture:
        if not isinstance(d, dict):
            raise MixtureError(f"{where}: expected a mapping, got {type(d).__name__}")
        allowed = {"format_version", "name", "description", "source", "balance_by_size", "datasets"}
        if set(d) - allowed:
            raise MixtureError(
                f"{where}: unknown key(s) {sorted(set(d) - allowed)}; allowed: {sorted(allowed)}"
            )
        if not d.get("name") or not d.get("datasets"):
            raise MixtureError(f"{where}: 'name' and a non-empty 'datasets' list are required")
        version = int(d.get("format_version", MIXTURE_FORMAT_VERSION))
        if version > MIXTURE_FORMAT_VERSION:
            raise MixtureError(f"{where}: format_version {version} is newer than this vla; upgrade vla")
        entries, known = [], set(MixtureEntry.__dataclass_fields__)
        for i, e in enumerate(d["datasets"]):
            at = f"{where}: datasets[{i}]"
            if not isinstance(e, dict) or set(e) - known or "name" not in e or "weight" not in e:
                raise MixtureError(
                    f"{at}: expected a mapping with 'name' and 'weight' (optional: {sorted(known)}), got {e!r}"
                )
            e = {**e, "aliases": tuple(e.get("aliases") or ()), "weight": float(e["weight"])}
            e.update({k: str(e[k]) for k in ("path", "split", "version") if e.get(k) is not None})
            entries.append(MixtureEntry(**e))
        m = cls(
            name=str(d["name"]),
            datasets=tuple(entries),
            description=str(d.get("description", "")),
            source=str(d.get("source", "")),
            balance_by_size=bool(d.get("balance_by_size", True)),
            format_version=version,
        )
        m.validate(where)
        return m

    def validate(self, where: str = "") -> None:
        where = where or f"mixture {self.name!r}"
        seen: set[str] = set()
        for e in self.datasets:
            if not (np.isfinite(e.weight) and e.weight > 0):
                raise MixtureError(
                    f"{where}: dataset {e.name!r} weight must be a finite number > 0, got {e.weight}"
                )
            if e.kind not in KINDS:
                raise MixtureError(f"{where}: dataset {e.name!r} kind must be one of {KINDS}, got {e.kind!r}")
            for n in (e.name, *e.aliases):
                if n in seen:
                    raise MixtureError(
                        f"{where}: dataset name {n!r} appears twice; each dataset may appear once"
                    )
                seen.add(n)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Mixture:
        path = Path(path)
        try:
            m = cls.from_dict(yaml.safe_load(path.read_text()), where=str(path))
        except yaml.YAMLError as e:
            raise MixtureError(f"{path}: not valid YAML: {e}") from e
        return dataclasses.replace(m, path=path)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.datasets]


MIXTURES: Registry[Mixture] = Registry(
    "mixture", hint="Add a YAML file under data_mixtures/ (see bridge.yaml)."
)


def _load_yaml_mixtures() -> None:
    for path in sorted(mixture_dir().glob("*.yaml")):
        m = Mixture.from_yaml(path)
        if m.name != path.stem:
            raise MixtureError(f"{path}: name {m.name!r} must equal the file name {path.stem!r}")
        MIXTURES.register(m.name, m)


MIXTURES.add_loader(_load_yaml_mixtures)


def get_mixture(name_or_path: str | Path) -> Mixture:
    """A registered mixture by name, or a mixture YAML file by path."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise MixtureError(f"{p}: no such mixture file")
        return Mixture.from_yaml(p)
    return MIXTURES.get(str(name_or_path))


# ---- resolution -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResolvedDataset:
    """A mixture entry found on disk: ``path`` is what ``open_dataset`` takes; ``num_frames`` when the format
    records it cheaply (LeRobot ``total_frames``), else None (the loader counts)."""

    name: str
    path: Path
    format: str
    weight: float
    split: str | None = None
    kind: str = "real"
    num_frames: int | None = None


@dataclass
class ResolvedMixture:
    """The datasets of a mixture that exist under the data root(s); ``dropped`` lists the missing ones
    (only with ``allow_missing``) and ``message`` says what was dropped and the new weights."""

    mixture: Mixture
    datasets: list[ResolvedDataset]
    dropped: list[str] = field(default_factory=list)
    message: str = ""
    sim_fraction: float | None = None

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.datasets]

    def weights(self, sizes: Sequence[int] | None = None, balance_by_size: bool | None = None) -> np.ndarray:
        """Sampling probabilities float64 ``[N]`` (``sizes`` required when balancing by size)."""
        bal = self.mixture.balance_by_size if balance_by_size is None else balance_by_size
        probs = mixture_weights(
            [d.weight for d in self.datasets], sizes, balance_by_size=bal, names=self.names
        )
        if self.sim_fraction is None:
            return probs
        return split_by_kind(probs, [d.kind for d in self.datasets], self.sim_fraction, self.mixture.name)

    def sampler(
        self, sizes: Sequence[int], *, balance_by_size: bool | None = None, **kw: Any
    ) -> MixtureSampler:
        """A ``MixtureSampler`` over these datasets; ``sizes[i]`` = number of samples of dataset ``i``."""
        return MixtureSampler(self.names, self.weights(sizes, balance_by_size), sizes, **kw)


@dataclass
class RehearsalMixture(ResolvedMixture):
    """Fine-tuning data plus a pretraining mixture replayed at ``fraction`` of the samples (rehearsal).

    ``datasets`` = the ``num_new`` fine-tuning datasets first, then the rehearsal mixture's; the fine-tuning
    datasets share ``1 - fraction`` of the samples in proportion to their sizes, the mixture's entries share
    ``fraction`` by the mixture's own weights (and its ``balance_by_size``)."""

    num_new: int = 0
    fraction: float = 0.0

    def weights(self, sizes: Sequence[int] | None = None, balance_by_size: bool | None = None) -> np.ndarray:
        n = self.num_new
        if sizes is None:
            raise MixtureError("rehearsal weights need the number of samples of every dataset (sizes)")
        new = mixture_weights([1.0] * n, sizes[:n], balance_by_size=True, names=self.names[:n])
        old = ResolvedMixture(self.mixture, self.datasets[n:], sim_fraction=self.sim_fraction).weights(
            sizes[n:], balance_by_size
        )
        return np.concatenate([new * (1.0 - self.fraction), old * self.fraction])


def with_rehearsal(
    new: Sequence[ResolvedDataset], rehearsal: ResolvedMixture, fraction: float
) -> RehearsalMixture:
    """``new`` (the fine-tuning datasets) followed by ``rehearsal``'s datasets, sampled ``1 - fraction`` :
    ``fraction``. Dataset names must stay unique across both (the sampler tells them apart by name)."""
    if not 0.0 < fraction < 1.0:
        raise MixtureError(f"rehearsal fraction must be in (0, 1), got {fraction}")
    names = [d.name for d in new]
    clash = sorted(set(names) & set(rehearsal.names))
    if clash:
        raise MixtureError(
            f"rehearsal mixture {rehearsal.mixture.name!r} also holds the fine-tuning dataset(s) {clash}; "
            "drop them from data.datasets or pick another mixture"
        )
    return RehearsalMixture(
        rehearsal.mixture,
        [*new, *rehearsal.datasets],
        dropped=rehearsal.dropped,
        message=rehearsal.message,
        sim_fraction=rehearsal.sim_fraction,
        num_new=len(new),
        fraction=fraction,
    )


def split_by_kind(probs: np.ndarray, kinds: Sequence[str], sim_fraction: float, name: str) -> np.ndarray:
    """``probs`` rescaled so the ``sim`` entries together have ``sim_fraction`` of the mass and the ``real`` ones
    the rest, each group keeping its internal proportions."""
    sim = np.array([k == "sim" for k in kinds])
    out = probs.astype(np.float64).copy()
    for group, share in ((sim, sim_fraction), (~sim, 1.0 - sim_fraction)):
        total = math.fsum(out[group])
        if share > 0 and total <= 0:
            which = "sim" if group is sim else "real"
            raise MixtureError(
                f"mixture {name!r}: data.sim_fraction={sim_fraction} asks for {which} samples but no {which} "
                "dataset of it was found; generate or download them, or change data.sim_fraction"
            )
        if total > 0:
            out[group] *= share / total
    return out


def _find(entry: MixtureEntry, roots: Sequence[Path]) -> tuple[tuple[Path, str] | None, list[str]]:
    """(dataset path, format) of ``entry`` under ``roots``, and every path looked at."""
    looked: list[str] = []
    if entry.path:
        bases = [Path(entry.path)] if Path(entry.path).is_absolute() else [r / entry.path for r in roots]
    else:
        bases = [r / n for r in roots for n in (entry.name, *entry.aliases)]
    for base in bases:
        if entry.version:
            candidates = [base / entry.version]
            looked.append(str(base / entry.version / "dataset_info.json"))
        else:
            newest = rlds_version_dir(base)
            candidates = [newest] if newest is not None else []
            looked.append(str(base / "<newest version>" / "dataset_info.json"))
        candidates.append(base)
        looked += [str(base / "dataset_info.json"), str(base / "meta" / "info.json")]
        for c in candidates:
            if (c / "dataset_info.json").is_file():
                return (c, "rlds"), looked
            if (c / "meta" / "info.json").is_file():
                return (c, "lerobot"), looked
    return None, looked


def _lerobot_frames(path: Path) -> int | None:
    try:
        return int(json.loads((path / "meta" / "info.json").read_text())["total_frames"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolve_mixture(
    name_or_path: str | Path | Mixture,
    data_root: str | Path | Sequence[str | Path],
    *,
    allow_missing: bool = False,
    sim_fraction: float | None = None,
) -> ResolvedMixture:
    """Find every dataset of a mixture under ``data_root`` (one folder or several, searched in order).

    Missing datasets are ONE error listing each and every path looked at; with ``allow_missing`` they are
    dropped, the weights renormalized over the rest, and a warning (also ``.message``) says so.
    """
    mix = name_or_path if isinstance(name_or_path, Mixture) else get_mixture(name_or_path)
    roots = [Path(data_root)] if isinstance(data_root, str | Path) else [Path(r) for r in data_root]
    found, missing = [], []
    for e in mix.datasets:
        hit, looked = _find(e, roots)
        if hit is None:
            missing.append((e, looked))
            continue
        path, fmt = hit
        frames = _lerobot_frames(path) if fmt == "lerobot" else None
        found.append(ResolvedDataset(e.name, path, fmt, e.weight, e.split, e.kind, frames))
    where = f"mixture {mix.name!r}" + (f" ({mix.path})" if mix.path else "")
    if missing and (not allow_missing or not found):
        lines = [f"  {e.name}: looked at\n      " + "\n      ".join(looked) for e, looked in missing]
        raise MixtureError(
            f"{where}: {len(missing)} of {len(mix.datasets)} dataset(s) not found under "
            f"{', '.join(map(str, roots))}:\n"
            + "\n".join(lines)
            + "\nDownload/convert them there, fix data_root, set "
            "'path:' in the mixture file"
            + ("" if not found else ", or pass allow_missing=True to train without them")
            + "."
        )
    out = ResolvedMixture(mix, found, dropped=[e.name for e, _ in missing], sim_fraction=sim_fraction)
    if missing:
        w = mixture_weights([d.weight for d in found])
        out.message = (
            f"{where}: dropped {len(missing)} missing dataset(s): {', '.join(out.dropped)}; nominal weights "
            "renormalized over the rest: " + ", ".join(f"{d.name}={p:.4f}" for d, p in zip(found, w))
        )
        log.warning(out.message)
    return out


__all__ = [
    "KINDS",
    "MIXTURES",
    "Mixture",
    "MixtureEntry",
    "MixtureError",
    "MixtureSampler",
    "RehearsalMixture",
    "ResolvedDataset",
    "ResolvedMixture",
    "get_mixture",
    "mixture_weights",
    "resolve_mixture",
    "with_rehearsal",
]
