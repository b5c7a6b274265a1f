"""What the pipeline logs to its MLflow runs: the calibration record, tags, the evaluation table,
artifacts. Each goes to the parent run (featcal.tracking.runs.parent_run) or the given `run_id`,
and does nothing without a parent run (e.g. in a Dask worker process).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from featcal.tracking.batches import (
    MAX_TAG_VALUE,
    batch_metric_steps,
    batch_metrics,
    batch_tags,
    clean,
    now_ms,
)
from featcal.tracking.mlflow_model import log_checkpoint_model, transformers_model_type
from featcal.tracking.runs import run_target
from featcal_core.provenance.records import FEATCAL_RECORD
from featcal_core.report.figures import headline_metrics, summary_figures

__all__ = [
    "RECORD_ARTIFACT",
    "log_artifacts",
    "log_calibration_record",
    "log_datasets",
    "log_evaluation",
    "log_metrics",
    "log_model",
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
    `peak_device_mb` when recorded). No params: the hyperparameters are the run's `featcal.*`
    params already (one value per param). Tags `calibration.precision` (the passes' dtype that
    ran, `featcal.precision: auto` resolved), `calibration.precision_requested`,
    `calibration.precision_reason`, `calibration.precision_execution` (native or emulated),
    `calibration.products_precision`,
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

    ran = record.get("hyperparameters") or {}
    tags = {
        "calibration.precision": ran.get("precision"),
        "calibration.precision_requested": ran.get("precision_requested"),
        "calibration.precision_reason": ran.get("precision_reason"),
        "calibration.precision_execution": ran.get("precision_execution"),
        "calibration.products_precision": ran.get("products_precision"),
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


def log_selection(record: Mapping[str, Any], *, run_id: str | None = None) -> None:
    """The select step's choice: tags `select.winner`, `select.score`, `select.why` and
    `select.set` (the winner's overrides); metrics `select/<score>/<candidate>` (mean over
    tasks) and `select/<score>/<candidate>/<task>`."""
    if record.get("winner") is None:
        return
    score = record["score"]
    log_tags(
        {
            "select.winner": record["winner"],
            "select.score": score,
            "select.why": record["why"],
            "select.set": "; ".join(record["set"]),
        },
        run_id=run_id,
    )
    metrics = {}
    for candidate in record["candidates"]:
        metrics[f"select/{score}/{candidate['name']}"] = candidate["mean"]
        for task, values in candidate["tasks"].items():
            metrics[f"select/{score}/{candidate['name']}/{task}"] = values[score]
    log_metrics(metrics, run_id=run_id)


def log_metrics(metrics: Mapping[str, float], *, run_id: str | None = None) -> None:
    """Metrics (name → value) on the parent run (or `run_id`); nothing without a parent run."""
    target = run_target(run_id)
    if target is None:
        return
    from mlflow import MlflowClient

    session, run = target
    batch_metrics(MlflowClient(session.uri), run, {k: float(v) for k, v in metrics.items()})


def log_evaluation(table: Mapping[str, Mapping[str, Mapping[str, Any]]], *, run_id=None) -> None:
    """Metrics per task and model: `accuracy/<task>/<model>`, `loss/…`, `stderr/…` (the
    accuracy's standard error, where lm-evaluation-harness gives one), `normalized/…` (accuracy
    ÷ the expert's; absent where the expert scores 0) and `gap_closed/<task>/<model>` (percent of
    the merged→expert accuracy gap closed, for every model other than the expert, the merged
    model and the base; absent where there is no gap). Then the headline, the same numbers as
    metrics.json (featcal_core.report.figures.headline_metrics): `tasks`, per model
    `accuracy_mean/<model>`, `normalized_mean/<model>`, `gap_closed_mean/<model>`, each with
    `<name>_tasks/<model>` (the tasks it is over), and `examples_min`. Never NaN: an undefined
    value is not logged."""
    target = run_target(run_id)
    if target is None:
        return
    from mlflow import MlflowClient

    session, run = target
    figures = summary_figures(table)
    metrics: dict[str, float] = {}
    for task_name, row in table.items():
        defined = figures.per_task.get(str(task_name), {})
        for model, result in row.items():
            values = dict(defined.get(str(model), {}))
            for name in ("loss", "stderr"):  # stderr: lm-eval's, of the accuracy
                found = result.get(name) if isinstance(result, Mapping) else None
                if isinstance(found, int | float) and math.isfinite(found):
                    values[name] = float(found)
            for name, value in values.items():
                metrics[f"{name}/{task_name}/{model}"] = value
    metrics.update({key: float(value) for key, value in headline_metrics(figures).items()})
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


def log_datasets(datasets: Iterable[Mapping[str, Any]], *, run_id: str | None = None) -> None:
    """Dataset inputs of the parent run (or `run_id`), as MLflow shows them under "Datasets": each
    a mapping with `name` (e.g. "calibration/mnist"), `context` ("calibration" | "evaluation"),
    `path` (its local folder) and `sha256` (of its files); the digest column holds the first 32
    hex digits (MLflow's limit is 36), the tag `sha256` the whole digest, `split` the split."""
    target = run_target(run_id)
    if target is None:
        return
    import warnings

    from mlflow import MlflowClient
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    session, run = target
    inputs = []
    for item in datasets:
        with warnings.catch_warnings():  # "can be interpreted in multiple ways": all local
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(Path(item["path"]).resolve().as_uri())
        dataset = MetaDataset(source, name=item["name"], digest=item["sha256"][:32])
        tags = {"mlflow.data.context": item["context"], "sha256": item["sha256"]}
        if item.get("split"):
            tags["split"] = str(item["split"])
        inputs.append(
            DatasetInput(
                dataset._to_mlflow_entity(), [InputTag(key, value) for key, value in tags.items()]
            )
        )
    if inputs:
        MlflowClient(session.uri).log_inputs(run, datasets=inputs)


#: with `tracking.log_model: auto`, a checkpoint whose weight files total more than this is logged
#: without its weights (the model card, config and records, and a reference to the folder)
MODEL_ARTIFACT_LIMIT = 256 * _MIB
#: weight files: left out of the MLflow copy when the weights are not logged
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")


def log_model(
    directory: str | Path,
    *,
    artifact_path: str = "model",
    weights: bool | str = "auto",
    run_id=None,
) -> bool:
    """Log a checkpoint folder to the parent run (or `run_id`) under the name `artifact_path`.
    `weights` (params `tracking.log_model`): True copies every file into the store; False only
    the files that are not weights (model card, config, records); "auto" the whole folder when
    its weight files total at most MODEL_ARTIFACT_LIMIT bytes, else as False.

    With the weights, a folder `from_pretrained` loads (featcal.tracking.mlflow_model) becomes
    an MLflow Model of the run (tags `model.format: mlflow_model`, `model.id`, `model.uri`:
    `models:/<id>`); any other folder (Surgery's task modules, an open_clip tower) is copied as
    the run's artifacts (`model.format: files`). Without the weights, the other files are the
    run's artifacts and the tags `model.logged: false`, `model.not_logged_because` and
    `model.reference` (the folder's absolute path) say where they are; the run's lineage tags
    name their digests either way. Returns whether the weights were logged."""
    target = run_target(run_id)
    if target is None:
        return False
    from mlflow import MlflowClient

    session, run = target
    client = MlflowClient(session.uri)
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    heavy = [p for p in files if p.suffix in _WEIGHT_SUFFIXES]
    size = sum(p.stat().st_size for p in heavy)
    if weights == "auto":
        weights = size <= MODEL_ARTIFACT_LIMIT
        because = f"weights {size / _MIB:.0f} MiB > {MODEL_ARTIFACT_LIMIT / _MIB:.0f} MiB (auto)"
    else:
        because = "tracking.log_model: false"
    if weights:
        tags = {"model.logged": "true", "model.artifact_path": artifact_path}
        model_type = transformers_model_type(directory)
        if model_type is not None:
            model_id = log_checkpoint_model(
                directory,
                name=artifact_path,
                run_id=run,
                experiment_id=session.experiment_id,
                model_type=model_type,
            )
            tags.update(
                {
                    "model.format": "mlflow_model",
                    "model.id": model_id,
                    "model.uri": f"models:/{model_id}",
                }
            )
        else:
            client.log_artifacts(run, str(directory), artifact_path)
            tags["model.format"] = "files"
        batch_tags(client, run, tags)
        return True
    for path in files:
        if path not in heavy:
            where = path.parent.relative_to(directory).as_posix()
            client.log_artifact(
                run, str(path), artifact_path if where == "." else f"{artifact_path}/{where}"
            )
    batch_tags(
        client,
        run,
        {
            "model.logged": "false",
            "model.not_logged_because": because,
            "model.artifact_path": artifact_path,
            "model.reference": str(directory.resolve()),
        },
    )
    return False
