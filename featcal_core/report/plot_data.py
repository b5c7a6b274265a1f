"""The report's figures (the series `accuracy_series` and `drift_series` draw) as small CSV
tables, for tools that draw their own plots (`dvc plots show`
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

from featcal_core.io.outputs import guarded_directory
from featcal_core.report.plots import accuracy_series, drift_series

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
    """accuracy.csv's text from an evaluation table: the accuracy plot's own series
    (`accuracy_series`), tasks as rows (its "average" group left out), rows as columns."""
    groups, series = accuracy_series(evaluation)
    tasks = [g for g in groups if g != "average"]
    rows = [[task] + [_number(series[m][i], 100.0) for m in series] for i, task in enumerate(tasks)]
    return _csv(["task", *series], rows)


def drift_csv(calibration: Mapping[str, Any]) -> str:
    """drift.csv's text from a calibration record: the drift plot's own series (`drift_series`)."""
    drift = drift_series(calibration)
    after = drift["after"]
    rows = [
        [
            block,
            _number(drift["mean_before"][i]),
            _number(drift["mean_after"][i]),
            *(_number(after[t][i]) for t in after),
        ]
        for i, block in enumerate(drift["blocks"])
    ]
    return _csv(
        ["block", "drift_before_mean", "drift_after_mean", *(f"drift_after/{t}" for t in after)],
        rows,
    )


def write_plot_data(
    folder: str | Path,
    evaluation: Mapping[str, Any],
    calibration: Mapping[str, Any] | None,
) -> dict[str, Path]:
    """Write `folder` (a marked output, replaced as a whole): accuracy.csv, and drift.csv when
    there is a calibration record; returns {file name: path}."""
    folder = Path(folder)
    texts = {"accuracy.csv": accuracy_csv(evaluation)}
    if calibration is not None:
        texts["drift.csv"] = drift_csv(calibration)
    with guarded_directory(folder, overwrite=True, flag="plots folder") as tmp:
        for name, text in texts.items():
            (tmp / name).write_text(text, encoding="utf-8")
    return {name: folder / name for name in texts}
