"""Packaging tells the truth: every dependency in pyproject.toml is imported by the package, and every third-party
module the package imports is a declared dependency (or an optional extra's)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _dist_name(requirement: str) -> str:
    """``"transformers>=5.25"`` -> ``"transformers"`` (normalised as PyPI does: lower case, ``-`` for ``_``/``.``)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def _imported_top_level_modules() -> set[str]:
    modules: set[str] = set()
    for path in (REPO_ROOT / "vla").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"vla", "__future__"}


def test_dependencies_are_imported_and_imports_are_dependencies() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    required = {_dist_name(r) for r in project["dependencies"]}
    extras = {_dist_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    module_to_dists = {m: {_dist_name(d) for d in ds} for m, ds in packages_distributions().items()}
    imported = _imported_top_level_modules()
    imported_dists = {d for m in imported for d in module_to_dists.get(m, ())}
    unused = required - imported_dists
    assert not unused, f"pyproject.toml lists {sorted(unused)} but no module of vla imports them: drop them"
    undeclared = {m for m in imported if not (module_to_dists.get(m, set()) & (required | extras))}
    assert not undeclared, (
        f"vla imports {sorted(undeclared)} that no pyproject.toml dependency or extra provides: declare them"
    )
