"""Embodiment specs and their registry; every ``configs/embodiments/*.yaml`` is registered by its ``name``."""

from __future__ import annotations

from vla.embodiments.spec import CameraSpec, EmbodimentSpec, FieldSpec, SpecError
from vla.paths import config_dir
from vla.registry import Registry

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


def get_embodiment(name: str) -> EmbodimentSpec:
    return EMBODIMENTS.get(name)


__all__ = ["EMBODIMENTS", "CameraSpec", "EmbodimentSpec", "FieldSpec", "SpecError", "get_embodiment"]
