"""Embodiment specs and their registry; every ``configs/embodiments/*.yaml`` is registered by its ``name``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from vla.embodiments.spec import CameraSpec, EmbodimentSpec, FieldSpec, SpecError
from vla.paths import config_dir
from vla.registry import Registry

logger = logging.getLogger(__name__)

EMBODIMENTS: Registry[EmbodimentSpec] = Registry(
    "embodiment", hint="Add a YAML file under configs/embodiments/ (see configs/embodiments/README.md)."
)


def _load_yaml_specs() -> None:
    for path in sorted((config_dir() / "embodiments").glob("*.yaml")):
        spec = EmbodimentSpec.from_yaml(path)
        if spec.name != path.stem:
            raise SpecError(f"{path}: name {spec.name!r} must equal the file name {path.stem!r}")
        EMBODIMENTS.register(spec.name, spec)


EMBODIMENTS.add_loader(_load_yaml_specs)


def _contract(d: dict[str, Any]) -> dict[str, Any]:
    """A spec's ``to_dict`` without its prose: the spec's, its cameras' and its fields' ``description`` texts and
    its ``sources`` citations (``extra`` is kept whole: its keys are the user's). What is left decides how data and
    actions are read."""
    out = {k: v for k, v in d.items() if k not in ("description", "sources")}
    out["cameras"] = {
        name: {k: v for k, v in cam.items() if k != "description"}
        for name, cam in d.get("cameras", {}).items()
    }
    for part in ("state", "action"):
        out[part] = [{k: v for k, v in f.items() if k != "description"} for f in d.get(part, [])]
    return out


def register_embodiment(spec: EmbodimentSpec, *, where: str = "") -> EmbodimentSpec:
    """Make ``spec`` resolvable by its ``name`` for the rest of the process (``get_embodiment(spec.name)``, and a
    LeRobot dataset whose ``robot_type`` equals it). Registering an identical spec again is a no-op, and so is one
    that differs only in prose (descriptions, sources: e.g. a checkpoint saved before a built-in spec's text was
    edited), with a warning; a different spec under a registered name is refused (``where`` names its origin, e.g.
    the YAML file, in that error, with the first differing fields)."""
    if spec.name in EMBODIMENTS:
        known = EMBODIMENTS.get(spec.name)
        old, new = known.to_dict(), spec.to_dict()
        if old == new:
            return known
        a, b = _contract(old), _contract(new)
        if a != b:
            fields = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            raise SpecError(
                f"{where or 'spec'}: embodiment {spec.name!r} is already registered with a different spec "
                f"(differs in {fields}); give this spec another name (its `name:` field)"
            )
        logger.warning(
            "%s: embodiment %r differs from the registered spec only in its descriptions or sources; using the "
            "registered one",
            where or "spec",
            spec.name,
        )
        return known
    EMBODIMENTS.register(spec.name, spec)
    return spec


def get_embodiment(name_or_path: str | Path) -> EmbodimentSpec:
    """A registered spec by name, or the spec in a ``.yaml``/``.yml`` file (``--embodiment path/to/my_arm.yaml``,
    e.g. from ``vla embodiment draft``), registered under the ``name`` inside the file for the rest of the process
    (``register_embodiment``), so a LeRobot dataset whose ``robot_type`` is that name maps to it like to any
    built-in robot. A spec file must end in .yaml/.yml: a bare word is always a registered name."""
    text = str(name_or_path)
    if not text.endswith((".yaml", ".yml")):
        return EMBODIMENTS.get(text)
    path = Path(text)
    if not path.is_file():
        raise FileNotFoundError(
            f"embodiment spec file {path} does not exist: pass a registered name ({', '.join(EMBODIMENTS.names())}) "
            "or an existing spec YAML (draft one with `vla embodiment draft DATASET --name NAME --out NAME.yaml`)"
        )
    return register_embodiment(EmbodimentSpec.from_yaml(path), where=str(path))


__all__ = [
    "EMBODIMENTS",
    "CameraSpec",
    "EmbodimentSpec",
    "FieldSpec",
    "SpecError",
    "get_embodiment",
    "register_embodiment",
]
