"""Package namespaces whose names are imported from their modules on first use (PEP 562).

A package that re-exports torch-heavy modules lists them here instead of importing them, so that importing one of
its light modules (a vocabulary, the loss catalogue) does not import torch::

    __getattr__, __dir__ = lazy_exports(__name__, {"aggregation": ("aggregate", "global_counts"), ...})
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Sequence

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a module of the package to the names it
    provides; a name is imported from its module the first time it is read, then kept in the package."""
    owner = {name: module for module, names in exports.items() for name in names}
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = owner.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(owner))

    return __getattr__, __dir__
