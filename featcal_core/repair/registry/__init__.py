"""The repair registry: every repair `featcal run`, `compare`, `select` and the single steps can
run on a merged model, one module each, listed in `_MODULES`:

    featcal.py      FeatCal (featcal_core.method): the block-by-block closed-form calibration
    regmean.py      RegMean over the block Linears
    surgery.py      Representation Surgery: one module per task on the features its head reads
    adamerging.py   layer-wise AdaMerging: merge coefficients learnt by entropy minimisation
    none.py         no repair: the merge is evaluated as it is

Each module declares `REPAIR = Repair(...)` (featcal_core.repair.registry.base): name, options
(defaults defined there once; the params schema's `repair:` section and each command's flags are
built from them), output, step and artifact names, and `run(inputs) -> record`. Importing this
package stays light (no torch): each `run` imports its algorithm on first use.

Adding a repair: one module here, its name in `_MODULES`, and its tests (docs/layout.md).
"""

from __future__ import annotations

import importlib

from featcal_core.errors import FeatCalError
from featcal_core.repair.registry.base import (
    CommandSpec,
    Option,
    Output,
    Repair,
    RepairInputs,
)

#: the built-in repairs, in the order the docs and help list them
_MODULES = ("featcal", "regmean", "surgery", "adamerging", "none")

REGISTRY: dict[str, Repair] = {}


def _load() -> None:
    if not all(name in REGISTRY for name in _MODULES):
        for module in _MODULES:
            register(importlib.import_module(f"{__name__}.{module}").REPAIR)


def register(repair: Repair) -> Repair:
    """Make `repair` available under its name (a name may be registered again only by an equal
    declaration); returns it."""
    known = REGISTRY.get(repair.name)
    if known is not None and known != repair:
        raise ValueError(f"repair name {repair.name!r} is taken; choose another name")
    REGISTRY[repair.name] = repair
    return repair


def unregister(name: str) -> None:
    """Remove a repair registered at run time (not a built-in one)."""
    if name in _MODULES:
        raise ValueError(f"{name!r} is a built-in repair")
    REGISTRY.pop(name, None)


def available() -> list[str]:
    """Every registered repair's name: the built-in ones in their order, then the others."""
    _load()
    return [*_MODULES, *(name for name in REGISTRY if name not in _MODULES)]


def get(name: str) -> Repair:
    """The repair registered as `name`; FeatCalError names the known ones."""
    _load()
    repair = REGISTRY.get(name)
    if repair is None:
        raise FeatCalError(
            f"unknown repair {name!r} (repair.method); available: {', '.join(available())}"
        )
    return repair


__all__ = [
    "REGISTRY",
    "CommandSpec",
    "Option",
    "Output",
    "Repair",
    "RepairInputs",
    "available",
    "get",
    "register",
    "unregister",
]
