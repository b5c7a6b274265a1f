"""The report's figures as small CSV tables, for tools that draw their own plots (`dvc plots show`
/ `dvc plots diff` read them through dvc.yaml's `plots:`).

- accuracy.csv: one row per task, columns `task` and one per evaluated model row (expert,
  merged, calibrated, calibrated_heads, ...), accuracy in percent (empty where not evaluated).
- drift.csv: one row per calibrated block (numbered from 0), columns `block`,
  `drift_before_mean`, `drift_after_mean` (means over tasks) and `drift_after/<task>` per task.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.io.outputs import write_file

__all__ = ["PLOT_FILES", "accuracy_csv", "drift_csv", "write_plot_data"]

PLOT_FILES = ("accuracy.csv", "drift.csv")


def _csv(header: list[str], rows: list[list[Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


def _number(value: Any, scale: float = 1.0) -> str:
    return "" if value is None else f"{scale * float(value):.6g}"


def accuracy_csv(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """accuracy.csv's text from an evaluation table {task: {model: {"accuracy", ...}}}."""
    models: list[str] = []
    for row in evaluation.values():
        models += [model for model in row if model not in models]
    rows = [[task] + [_number((row.get(m) or {}).get("accuracy"), 100.0) for m in models]
            for task, row in evaluation.items()]  # fmt: skip
    return _csv(["task", *models], rows)


def drift_csv(calibration: Mapping[str, Any]) -> str:
    """drift.csv's text from a calibration record (featcal.json)."""
    blocks = list(calibration.get("blocks") or [])
    tasks: list[str] = []
    for block in blocks:
        tasks += [t for t in (block.get("drift_after") or {}) if t not in tasks]
    rows = []
    for position, block in enumerate(blocks):
        before, after = block.get("drift_before") or {}, block.get("drift_after") or {}
        mean = [sum(d.values()) / len(d) if d else None for d in (before, after)]
        rows.append([block.get("index", position), *map(_number, mean),
                     *(_number(after.get(t)) for t in tasks)])  # fmt: skip
    return _csv(["block", "drift_before_mean", "drift_after_mean",
                 *(f"drift_after/{t}" for t in tasks)], rows)  # fmt: skip


def write_plot_data(
    folder: str | Path,
    evaluation: Mapping[str, Any],
    calibration: Mapping[str, Any] | None,
) -> dict[str, Path]:
    """Write accuracy.csv (and drift.csv when there is a calibration record) into `folder`, each
    atomically; returns {file name: path}."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = {"accuracy.csv": write_file(folder / "accuracy.csv", accuracy_csv(evaluation))}
    if calibration is not None:
        written["drift.csv"] = write_file(folder / "drift.csv", drift_csv(calibration))
    return written
