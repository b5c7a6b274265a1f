"""Registry of merge methods. Adding a method means adding one module in this package that
defines a `MergeMethod` subclass decorated with `@register`; it is imported automatically.

    from featcal_core.merging import available, get
    from featcal_core.merging.run import merge_checkpoints
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import typing
from pathlib import Path

from featcal_core.errors import FeatCalError

if typing.TYPE_CHECKING:
    from featcal_core.merging.base import MergeMethod

REGISTRY: dict[str, type[MergeMethod]] = {}

#: modules of this package that define no method
_NOT_METHODS = {"base", "run", "selection"}


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
    for info in pkgutil.iter_modules(__path__):
        if info.name not in _NOT_METHODS:
            importlib.import_module(f"{__name__}.{info.name}")


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
    """The names `available()` returns, read from the method modules' source without importing
    them (no torch): each `@register` class's literal `name = "..."`. For the command line's
    `--method` choices and help; `available()` stays the authority (a test keeps them equal)."""
    names = set()
    for info in pkgutil.iter_modules(__path__):
        if info.name in _NOT_METHODS:
            continue
        tree = ast.parse(Path(__path__[0], f"{info.name}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(d, ast.Name) and d.id == "register" for d in node.decorator_list
            ):
                names.update(
                    item.value.value
                    for item in node.body
                    if isinstance(item, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "name" for t in item.targets)
                    and isinstance(item.value, ast.Constant)
                )
    return sorted(names)


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
