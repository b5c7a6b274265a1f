"""A repair's output reused when it was made from the same inputs (the repairs that run in one
go: RegMean, Surgery, AdaMerging; FeatCal resumes block by block instead).

After a repair has written its output folder, `remember` adds `REUSE_RECORD` to it (through the
guarded writer, so the folder's marker lists it): the repair's inputs as digests, and the record
the repair returned, and what the repair cost. `reusable` gives them back when the folder still verifies against
its markers, holds no file written into it since (refit heads), and the inputs asked for now
are the recorded ones: the repair, its options and run
settings (the device resolved to the GPU's name, or the CPU model and thread count), the base,
merged and expert folders' files, the calibration sets' files, the heads it fits to, and the
code (featcal_core's sources, library versions). Anything else runs the repair again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from featcal_core.io.markers import read_marker, verify_output
from featcal_core.io.outputs import write_json
from featcal_core.provenance.identity import code_identity, content_digest, device_identity
from featcal_core.repair.registry.base import Repair, RepairInputs

log = logging.getLogger(__name__)

#: the file beside a repair's output that names what it was made from
REUSE_RECORD = "repair_inputs.json"


def fingerprint(
    repair: Repair, inputs: RepairInputs, caller: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """What `repair` reads from `inputs`, as JSON values, with `caller`'s own (its code); None:
    a head it fits to cannot say what it reads, so the output is never reused. Tasks keep their
    order (the repairs sum over them in it)."""
    from featcal_core.evaluation.accuracy import _device

    heads = inputs.task_heads() if repair.needs_heads else None
    identities = None
    if heads is not None:
        identities = [[task, head.identity()] for task, head in heads.items()]
        if any(identity is None for _, identity in identities):
            return None
    settings = dataclasses.asdict(inputs.settings)
    settings["device"] = device_identity(_device(inputs.settings.device))
    return {
        "repair": repair.name,
        "options": {key: inputs.options[key] for key in sorted(inputs.options)},
        "settings": settings,
        "base": content_digest(inputs.base) if inputs.base is not None else None,
        "merged": content_digest(inputs.merged),
        "experts": [[t, content_digest(p)] for t, p in inputs.experts.items()],
        "calibration_sets": [[t, content_digest(p)] for t, p in inputs.calibration_sets.items()],
        "heads": identities,
        "code": code_identity(),
        "caller": caller,
    }


def _listed(out: Path) -> list[str]:
    """The files the marker of `out` lists, but REUSE_RECORD."""
    marker = read_marker(out) or {"files": {}}
    return sorted(name for name in marker["files"] if name != REUSE_RECORD)


def _verifies(out: Path) -> str | None:
    """None when `out` and every marked folder below it verify against their markers."""
    folders = [out, *sorted(p for p in out.rglob("*") if p.is_dir() and read_marker(p))]
    for folder in folders:
        problem = verify_output(folder)
        if problem is not None:
            return problem
    return None


def reusable(out: str | Path, wanted: dict[str, Any] | None) -> dict | None:
    """What REUSE_RECORD at `out` holds ({"record": the repair's record, "cost": {"seconds",
    "peak_rss_mb"} or None, ...}) when the output was made from `wanted` and verifies; else None
    (the reason logged)."""
    path = Path(out) / REUSE_RECORD
    if wanted is None or not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        inputs, files, _ = saved["inputs"], saved["files"], saved["record"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if json.loads(json.dumps(wanted)) != inputs:
        return None
    if _listed(Path(out)) != files:  # written into since (refit heads): the repair runs again
        return None
    problem = _verifies(Path(out))
    if problem is not None:
        log.warning("repair: %s does not verify (%s); repairing again", out, problem)
        return None
    return saved


def remember(
    out: str | Path,
    wanted: dict[str, Any] | None,
    record: dict,
    cost: dict[str, Any] | None = None,
) -> None:
    """Write REUSE_RECORD into the repair's output folder `out`, with what the repair cost
    (`cost`: {"seconds", "peak_rss_mb"}); nothing when `wanted` is None or the record is not
    plain JSON."""
    if wanted is None:
        return
    saved = {"inputs": wanted, "record": record, "files": _listed(Path(out)), "cost": cost}
    try:
        payload = json.loads(json.dumps(saved, allow_nan=False))
    except (TypeError, ValueError):
        return
    write_json(Path(out) / REUSE_RECORD, payload, "repair inputs record")
