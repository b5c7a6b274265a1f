"""What the pipeline logs to its MLflow runs: the calibration record, tags, the evaluation table,
artifacts. Each goes to the parent run (featcal.tasks.tracking.parent_run) or the given `run_id`,
and does nothing without a parent run (e.g. in a Dask worker process).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from featcal.tasks.tracking import run_target
from featcal.tasks.tracking_batches import (
    MAX_TAG_VALUE,
    batch_metric_steps,
    batch_metrics,
    batch_params,
    batch_tags,
    clean,
    now_ms,
)
from featcal_core.provenance.records import FEATCAL_RECORD

__all__ = [
    "RECORD_ARTIFACT",
    "log_artifacts",
    "log_calibration_record",
    "log_evaluation",
    "log_tags",
]

RECORD_ARTIFACT = FEATCAL_RECORD
_MIB = 1024 * 1024


def log_calibration_record(record: Mapping[str, Any], *, run_id: str | None = None) -> None:
    """Log a calibration record (featcal_core.method.calibration, `featcal.json`) to the parent run
    (or `run_id`); nothing without a parent run.

    Metrics: per block (step = block index) `drift_before/<task>`, `drift_after/<task>`, their
    means over tasks `drift_before_mean`, `drift_after_mean`, and `block_seconds`; once
    `calibrated_blocks`, `calibrated_blocks_restored`, `calibration_wall_s`, `peak_rss_mb` (and
    `peak_device_mb` when recorded). Params `calibration.<name>` for the hyperparameters; tags
    `calibration.architecture`, `calibration.record_version`, `calibration.inputs_sha256` (digest
    of the inputs section: weight and data digests, row indices). Artifact: `featcal.json`.
    """
    target = run_target(run_id)
    if target is None:
        return
    from mlflow import MlflowClient

    session, run = target
    client = MlflowClient(session.uri)
    now = now_ms()
    metrics: list[tuple[str, float, int]] = []
    blocks = list(record.get("blocks") or [])
    for position, block in enumerate(blocks):
        step = int(block.get("index", position))
        for which in ("drift_before", "drift_after"):
            drift = {
                task: float(value)
                for task, value in (block.get(which) or {}).items()
                if value is not None
            }
            metrics += [(f"{which}/{task}", value, step) for task, value in drift.items()]
            if drift:
                metrics.append((f"{which}_mean", sum(drift.values()) / len(drift), step))
        if block.get("seconds") is not None:
            metrics.append(("block_seconds", float(block["seconds"]), step))
    totals = {
        "calibrated_blocks": len(blocks),
        "calibrated_blocks_restored": sum(bool(block.get("restored")) for block in blocks),
    }
    if record.get("wall_seconds") is not None:
        totals["calibration_wall_s"] = float(record["wall_seconds"])
    if record.get("peak_rss_bytes") is not None:
        totals["peak_rss_mb"] = record["peak_rss_bytes"] / _MIB
    if record.get("peak_device_bytes"):
        totals["peak_device_mb"] = record["peak_device_bytes"] / _MIB
    metrics += [(key, float(value), 0) for key, value in totals.items()]
    batch_metric_steps(client, run, metrics, now)

    hyper = record.get("hyperparameters") or {}
    batch_params(client, run, {f"calibration.{key}": value for key, value in hyper.items()})
    tags = {
        "calibration.architecture": record.get("architecture"),
        "calibration.record_version": record.get("featcal_record_version"),
    }
    if record.get("inputs") is not None:
        tags["calibration.inputs_sha256"] = hashlib.sha256(
            json.dumps(record["inputs"], sort_keys=True, default=str).encode()
        ).hexdigest()
    batch_tags(client, run, {key: value for key, value in tags.items() if value is not None})
    client.log_text(run, json.dumps(record, indent=2, default=str) + "\n", RECORD_ARTIFACT)


def log_tags(tags: Mapping[str, object], *, run_id: str | None = None) -> None:
    """Tags on the parent run (or `run_id`); None values skipped; nothing without a parent run."""
    target = run_target(run_id)
    if target is None:
        return
    from mlflow import MlflowClient

    session, run = target
    values = {key: value for key, value in tags.items() if value is not None}
    batch_tags(MlflowClient(session.uri), run, clean(values, MAX_TAG_VALUE))


def log_evaluation(table: Mapping[str, Mapping[str, Mapping[str, float]]], *, run_id=None) -> None:
    """Metrics `accuracy/<task>/<model>`, `loss/…`, `normalized/…` and, per model, the mean
    over tasks `accuracy_mean/<model>` and `normalized_mean/<model>`."""
    target = run_target(run_id)
    if target is None:
        return
    from mlflow import MlflowClient

    session, run = target
    metrics: dict[str, float] = {}
    per_model: dict[str, list[tuple[float, float]]] = {}
    for task_name, row in table.items():
        for model, result in row.items():
            for name in ("accuracy", "loss", "normalized"):
                metrics[f"{name}/{task_name}/{model}"] = float(result[name])
            per_model.setdefault(model, []).append((result["accuracy"], result["normalized"]))
    for model, values in per_model.items():
        if len(values) == len(table):  # a model evaluated on every task
            metrics[f"accuracy_mean/{model}"] = sum(a for a, _ in values) / len(values)
            metrics[f"normalized_mean/{model}"] = sum(n for _, n in values) / len(values)
    batch_metrics(MlflowClient(session.uri), run, metrics)


def log_artifacts(
    paths: str | Path | Iterable[str | Path],
    *,
    artifact_path: str | None = None,
    run_id: str | None = None,
) -> None:
    """Log files and directories (reports, plots) to the parent run (or `run_id`) under
    `artifact_path`; a directory keeps its name and contents. Nothing without a parent run;
    a missing path raises FileNotFoundError."""
    target = run_target(run_id)
    if target is None:
        return
    from mlflow import MlflowClient

    session, run = target
    client = MlflowClient(session.uri)
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    for item in map(Path, items):
        if item.is_dir():
            where = f"{artifact_path}/{item.name}" if artifact_path else item.name
            client.log_artifacts(run, str(item), where)
        elif item.is_file():
            client.log_artifact(run, str(item), artifact_path)
        else:
            raise FileNotFoundError(f"artifact to log does not exist: {item}")
