"""Embodiment specs and their registry; every ``configs/embodiments/*.yaml`` is registered by its ``name``."""

from __future__ import annotations

from pathlib import Path

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


def get_embodiment(name_or_path: str | Path) -> EmbodimentSpec:
    """A registered spec by name, or the spec in a YAML file (``--embodiment path/to/my_arm.yaml``, e.g. drafted
    from a dataset). A spec loaded from a file is registered under its ``name`` for the rest of the process, so a
    LeRobot dataset whose ``robot_type`` is that name maps to it like to any built-in robot."""
    text = str(name_or_path)
    if not text.endswith((".yaml", ".yml")) and not Path(text).is_file():
        return EMBODIMENTS.get(text)
    path = Path(text)
    if not path.is_file():
        raise FileNotFoundError(
            f"embodiment spec file {path} does not exist (pass a registered name or a YAML file)"
        )
    spec = EmbodimentSpec.from_yaml(path)
    if spec.name in EMBODIMENTS:
        known = EMBODIMENTS.get(spec.name)
        if known.to_dict() != spec.to_dict():
            raise SpecError(
                f"{path}: embodiment {spec.name!r} is already registered with a different spec; give the file's "
                "spec another name (its `name:` field)"
            )
        return known
    EMBODIMENTS.register(spec.name, spec)
    return spec


__all__ = ["EMBODIMENTS", "CameraSpec", "EmbodimentSpec", "FieldSpec", "SpecError", "get_embodiment"]
