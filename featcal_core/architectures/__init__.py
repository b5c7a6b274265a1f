"""Registry of model-family adapters. Adding a family means adding one module in this package
that defines an `Architecture` subclass decorated with `@register`; it is imported automatically.
A family whose specifics have a package of their own keeps its adapter there and is named in
`ELSEWHERE` (open_clip: featcal_core/open_clip/architecture.py).
`detect` imports every adapter, so an adapter imports heavy modeling code (transformers' model
modules, open_clip) inside the methods that use it, not at module level."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from featcal_core.architectures.base import Architecture
from featcal_core.errors import FeatCalError

REGISTRY: dict[str, type[Architecture]] = {}

#: adapter modules outside this package, imported with it
ELSEWHERE = ("featcal_core.open_clip.architecture",)


def register(cls: type[Architecture]) -> type[Architecture]:
    REGISTRY[cls.name] = cls
    return cls


def _import_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")
    for module in ELSEWHERE:
        importlib.import_module(module)


def detect(
    config: dict[str, Any], source: str = "config.json", pooling: str | None = None
) -> Architecture:
    """The adapter whose `matches` accepts `config`; a clear error lists the supported families."""
    _import_all()
    for cls in REGISTRY.values():
        if cls.matches(config):
            try:
                return cls(config, pooling=pooling)
            except FeatCalError as exc:  # name the file when the adapter's message does not
                if source in str(exc):
                    raise
                raise FeatCalError(f"{source}: {exc}") from exc
    found = config.get("architectures") or config.get("model_type")
    raise FeatCalError(
        f"{source}: unsupported architecture {found!r}; supported: {', '.join(sorted(REGISTRY))}"
    )


def get(name: str) -> type[Architecture]:
    """The adapter class registered as `name`."""
    _import_all()
    if name not in REGISTRY:
        raise FeatCalError(
            f"unknown architecture {name!r}; supported: {', '.join(sorted(REGISTRY))}"
        )
    return REGISTRY[name]


def supported() -> list[str]:
    _import_all()
    return sorted(REGISTRY)


__all__ = ["Architecture", "REGISTRY", "detect", "get", "register", "supported"]
