"""Registry of merge methods, listed in `METHODS`: each method name and the module of this
package that defines it (a `MergeMethod` subclass decorated with `@register`). Adding a method
means adding one module and its line in `METHODS`.

    from featcal_core.merging import available, get
    from featcal_core.merging.run import merge_checkpoints
"""

from __future__ import annotations

import importlib
import typing

from featcal_core.errors import FeatCalError

if typing.TYPE_CHECKING:
    from featcal_core.merging.base import MergeMethod

#: every built-in merge method: its name and the module that defines it
METHODS: dict[str, str] = {
    "average": "average",
    "breadcrumbs": "breadcrumbs",
    "dare_task_arithmetic": "dare",
    "dare_ties": "dare",
    "iso_c": "iso",
    "iso_cts": "iso",
    "task_arithmetic": "task_arithmetic",
    "ties": "ties",
    "tsv_m": "tsv",
}

REGISTRY: dict[str, type[MergeMethod]] = {}


def register(cls: type[MergeMethod]) -> type[MergeMethod]:
    """Class decorator: make `cls` available under `cls.name`."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no `name`; set one before registering it")
    known = REGISTRY.get(cls.name)
    if known is not None and (known.__module__, known.__qualname__) != (
        cls.__module__,
        cls.__qualname__,
    ):
        raise ValueError(
            f"merge method name {cls.name!r} is taken by {known.__module__}.{known.__qualname__}"
        )
    REGISTRY[cls.name] = cls
    return cls


def _import_all() -> None:
    for module in sorted(set(METHODS.values())):
        importlib.import_module(f"{__name__}.{module}")


def available() -> list[str]:
    """Names of all registered merge methods, sorted."""
    _import_all()
    return sorted(REGISTRY)


def __getattr__(name: str):
    """`MergeMethod` on first use: its module imports torch, which `declared_names` (the command
    line's help) must not pay for."""
    if name == "MergeMethod":
        from featcal_core.merging.base import MergeMethod

        return MergeMethod
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def declared_names() -> list[str]:
    """The built-in methods' names (`METHODS`), without importing them (no torch): for the
    command line's `--method` choices and help; `available()` also holds methods registered at
    run time (a test keeps the built-in ones equal)."""
    return sorted(METHODS)


def get(name: str) -> MergeMethod:
    """A new instance of the method registered as `name`; FeatCalError lists the known names."""
    _import_all()
    cls = REGISTRY.get(name)
    if cls is None:
        raise FeatCalError(
            f"unknown merge method {name!r} (--method); available: {', '.join(available())}"
        )
    return cls()


__all__ = ["REGISTRY", "MergeMethod", "available", "declared_names", "get", "register"]
