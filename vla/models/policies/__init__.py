"""Policies, one per file, registered by name in ``POLICIES`` (``ModelConfig.policy`` selects one)."""

from __future__ import annotations

from vla.registry import Registry

POLICIES: Registry[type] = Registry("policy", hint="Add a module under vla/models/policies/ and register it.")


def _load_builtin() -> None:
    from vla.models.policies import flow_vla  # noqa: F401  (registers itself)


POLICIES.add_loader(_load_builtin)
