"""`featcal lineage`: show what produced a checkpoint, results directory or report, and verify it.

Usage: featcal lineage PATH [--json]

Follows the records (featcal.json → merge.json → base and experts → models.lock.json →
calibration sets) and checks every recorded sha256 and digest against the files on disk. Prints
the chain (as text, or as JSON with --json) and exits 0 when every input verifies; otherwise the
chain is printed all the same and a FeatCalError naming the first mismatching file follows (exit
status 2 through the CLI's handler).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from featcal_cli.arguments import Command


def add_arguments(lineage: argparse.ArgumentParser) -> None:
    lineage.add_argument(
        "path",
        metavar="PATH",
        help="a checkpoint directory (featcal.json or merge.json), a results directory or a "
        "report directory",
    )
    lineage.add_argument("--json", action="store_true", help="print the trace as JSON")


def _json_safe(value: Any) -> Any:
    """NaN and infinities (e.g. an undefined normalized accuracy) as null: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def run(args: argparse.Namespace) -> int:
    """Run `featcal lineage` for parsed arguments; FeatCalError propagates to the caller."""
    from featcal_core.provenance.lineage import check, trace
    from featcal_core.provenance.lineage_text import format_trace

    result = trace(args.path)
    if args.json:
        print(json.dumps(_json_safe(result), indent=2, ensure_ascii=False, allow_nan=False))
    else:
        print(format_trace(result))
    check(result)
    return 0


COMMANDS = (
    Command(
        "lineage",
        "show the records that produced a checkpoint and verify its inputs' sha256",
        add_arguments,
        run,
    ),
)
