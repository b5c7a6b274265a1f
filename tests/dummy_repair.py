"""A repair registered at run time, as a user's plugin would be: `copy` writes the merged
checkpoint unchanged plus copy.json. Imported by tests/test_repair_registry.py's subprocesses
before `featcal` runs; with FEATCAL_TEST_READS set, each `load_params` call (each read of a
params file) appends a line to that file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import featcal_core.params
from featcal_core.io.outputs import MARKER, guarded_directory
from featcal_core.repair.registry import Repair, RepairInputs, register


def run(inputs: RepairInputs) -> dict:
    merged = Path(inputs.merged)
    with guarded_directory(inputs.out, overwrite=inputs.overwrite, inputs=[merged]) as tmp:
        for path in merged.iterdir():  # the weights and the model's own files, not the records
            if path.is_file() and path.name not in (MARKER, "merge.json", "README.md"):
                shutil.copy2(path, tmp / path.name)
        record = {
            "method": "copy",
            "wall_seconds": 0.0,
            "peak_rss_bytes": 0,
            "tasks": sorted(inputs.experts),
        }
        (tmp / "copy.json").write_text(json.dumps(record))
    return record


REPAIR = register(
    Repair(
        name="copy",
        summary="copy the merge (a test plugin)",
        output="checkpoint",
        step="copy",
        artifact="calibrated_model",
        run=run,
    )
)


if os.environ.get("FEATCAL_TEST_READS"):
    _load = featcal_core.params.load_params

    def _counted(*args, **kwargs):
        with open(os.environ["FEATCAL_TEST_READS"], "a", encoding="utf-8") as reads:
            reads.write(f"{args[0]}\n")
        return _load(*args, **kwargs)

    featcal_core.params.load_params = _counted
