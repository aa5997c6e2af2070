"""A tiny typed name -> object registry with "did you mean" errors.

Policies, embodiments, dataset key maps and mixtures are all registered by name so that adding one is one
entry, and a contract test can iterate over every registered entry (``Registry.names()``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """Raised for unknown or duplicate names; ``str()`` is the full human-readable message."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it verbatim.
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Maps names to objects of one kind (``kind`` is used in error messages, e.g. "embodiment")."""

    def __init__(self, kind: str, hint: str = "") -> None:
        self.kind = kind
        self.hint = hint  # appended to "unknown name" errors, e.g. how to add an entry
        self._items: dict[str, T] = {}
        self._loaders: list[Callable[[], None]] = []

    def add_loader(self, loader: Callable[[], None]) -> None:
        """Register a callback that lazily populates the registry on first lookup (e.g. reads YAML files)."""
        self._loaders.append(loader)

    def _load(self) -> None:
        # A loader that fails (bad YAML, import error) is rolled back and kept, so every later lookup raises the
        # same clear error instead of silently using a half-filled registry.
        while self._loaders:
            before = set(self._items)
            try:
                self._loaders[0]()
            except BaseException:
                for name in set(self._items) - before:
                    del self._items[name]
                raise
            self._loaders.pop(0)

    def register(self, name: str, obj: T | None = None, *, overwrite: bool = False):
        """Register ``obj`` under ``name``; used as ``reg.register("x", obj)`` or as a decorator."""

        def _do(o: T) -> T:
            if not overwrite and name in self._items:
                raise RegistryError(
                    f"{self.kind} {name!r} is already registered; pass overwrite=True to replace it."
                )
            self._items[name] = o
            return o

        if obj is None:
            return _do
        return _do(obj)

    def get(self, name: str) -> T:
        self._load()
        if name in self._items:
            return self._items[name]
        close = difflib.get_close_matches(name, list(self._items), n=3, cutoff=0.5)
        msg = f"Unknown {self.kind} {name!r}."
        if close:
            msg += f" Did you mean {', '.join(repr(c) for c in close)}?"
        msg += f" Known: {', '.join(sorted(self._items)) or '(none)'}."
        if self.hint:
            msg += f" {self.hint}"
        raise RegistryError(msg)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._items

    def names(self) -> list[str]:
        self._load()
        return sorted(self._items)

    def items(self) -> Iterator[tuple[str, T]]:
        self._load()
        return iter(sorted(self._items.items()))

    def __len__(self) -> int:
        self._load()
        return len(self._items)
