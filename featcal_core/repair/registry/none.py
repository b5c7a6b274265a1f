"""No repair: the merged checkpoint is evaluated as it is."""

from __future__ import annotations

from featcal_core.repair.registry.base import Repair

REPAIR = Repair(
    name="none",
    summary="no repair: evaluate the merge as it is",
    output="none",
    step="",
    artifact="",
    run=None,
)
