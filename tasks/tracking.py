"""MLflow tracking for the pipeline: one parent run per pipeline run, one nested run per step.

    uri = tracking_uri(params.tracking, project_root)
    with parent_run(params, run_name=params.run.name, tags={"prefect.flow_run_id": id}):
        with step_run("calibrate"):
            record = calibrate(...)
        log_calibration_record(record)
        log_artifacts([report_path, plot_dir])

Where runs go: the MLFLOW_TRACKING_URI environment variable, else `tracking.mlflow_tracking_uri`,
else the SQLite store `<project_root>/mlruns/mlflow.db` with artifacts in
`<project_root>/mlruns/artifacts`. Every path is made absolute, so processes started from other
working directories (Prefect workers, Dask) share one store. Everything works offline.

When `tracking.enabled` is false, `parent_run` yields None without touching MLflow, and `step_run`,
`log_calibration_record` and `log_artifacts` do nothing. They also do nothing outside a parent run
(e.g. in a Dask worker process), so pipeline steps can call them unconditionally.

`mlflow` is imported only when a run starts; MLFLOW_DISABLE_TELEMETRY is set to true (unless set)
when this module is imported, before MLflow can be.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from featcal_core.memory import peak_rss_bytes
from featcal_core.params import Params, TrackingSettings, flatten
from featcal_core.provenance.records import FEATCAL_RECORD

if TYPE_CHECKING:
    import mlflow

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

__all__ = [
    "RECORD_ARTIFACT",
    "artifact_root",
    "ensure_experiment",
    "git_commit",
    "log_artifacts",
    "log_calibration_record",
    "parent_run",
    "step_run",
    "tracking_uri",
]

log = logging.getLogger(__name__)

RECORD_ARTIFACT = FEATCAL_RECORD
STORE_DIR = "mlruns"  # under the project root: mlflow.db and artifacts/
_MIB = 1024 * 1024

# MLflow's limits (mlflow.utils.validation); fixed here so that importing stays light.
_MAX_PARAM_VALUE = 6000
_MAX_TAG_VALUE = 8000
_MAX_KEY = 250
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- ]")  # names MLflow accepts on every platform

# Backends that keep runs in a database; their default artifact root is ./mlruns relative to the
# working directory, so these get an absolute one. (http, databricks and file stores choose their own.)
_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


# ----------------------------------------------------------------------------------- locations


def tracking_uri(settings: TrackingSettings, project_root: Path) -> str:
    """The tracking URI: MLFLOW_TRACKING_URI, else `settings.mlflow_tracking_uri`, else the local
    SQLite store `sqlite:////<project_root>/mlruns/mlflow.db`.

    A relative SQLite path is made absolute: against the working directory for the environment
    variable (MLflow's own reading), against `project_root` for the settings (as params.yaml paths).
    """
    project_root = Path(project_root).expanduser().resolve()
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return _absolute_sqlite(env, Path.cwd())
    if settings.mlflow_tracking_uri:
        return _absolute_sqlite(settings.mlflow_tracking_uri.strip(), project_root)
    return _sqlite_uri(project_root / STORE_DIR / "mlflow.db")


def artifact_root(uri: str, project_root: Path) -> str | None:
    """Where new experiments keep their artifacts, as a file URI; None: the server or store decides.

    SQLite: `artifacts/` beside the database file (for the default store:
    `<project_root>/mlruns/artifacts`); other databases: `<project_root>/mlruns/artifacts`.
    """
    scheme = _scheme(uri)
    if scheme == "sqlite":
        db = _sqlite_path(uri)
        if db is not None:
            return (db.parent / "artifacts").as_uri()
    if scheme in _DATABASE_SCHEMES:
        return (Path(project_root).expanduser().resolve() / STORE_DIR / "artifacts").as_uri()
    return None


def ensure_experiment(name: str, uri: str, artifact_root: str | Path | None) -> str:
    """The id of experiment `name` in the store at `uri`, created with an absolute artifact
    location when missing (a deleted experiment of that name is restored)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    _make_sqlite_dir(uri)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = _location_uri(artifact_root)
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException as exc:  # created meanwhile by another process
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise exc from None
    if experiment.lifecycle_stage == "deleted":
        log.warning("MLflow experiment %r was deleted; restoring it", name)
        client.restore_experiment(experiment.experiment_id)
    return experiment.experiment_id


def git_commit(project_root: Path) -> tuple[str, bool | None]:
    """(HEAD commit, whether tracked files differ from it) for `project_root`; ("unknown", None)
    when it is not in a git work tree or git is unavailable."""
    try:
        head = _git(project_root, "rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    if not re.fullmatch(r"[0-9a-f]{40,64}", head):
        return "unknown", None
    try:
        dirty = bool(_git(project_root, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        dirty = None
    return head, dirty


# ----------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class _Session:
    uri: str
    experiment_id: str
    parent_run_id: str


_session: _Session | None = None  # the parent run of this process, while one is open
_session_lock = threading.Lock()


@contextmanager
def parent_run(
    params: Params,
    *,
    run_name: str | None = None,
    tags: Mapping[str, object] | None = None,
    project_root: Path | None = None,
) -> Iterator[mlflow.ActiveRun | None]:
    """Start the pipeline's parent run (yields the MLflow ActiveRun; None when tracking is off).

    Logs `flatten(params)` as params (long values truncated with a digest, never an error), the
    tags `git_commit` (also `mlflow.source.git.commit`; "unknown" outside git) and `git_dirty`,
    plus `tags` (e.g. lock-file hash, DVC hashes, model revisions, Prefect flow-run id; None
    values skipped). The store comes from `tracking_uri(params.tracking, project_root)`, the
    experiment from `params.tracking.experiment`. `project_root` defaults to the working
    directory. One parent run per process at a time. The run ends FAILED when the body raises.
    """
    global _session
    if not params.tracking.enabled:
        yield None
        return
    import mlflow

    root = Path(project_root if project_root is not None else Path.cwd()).expanduser().resolve()
    uri = tracking_uri(params.tracking, root)
    experiment_id = ensure_experiment(params.tracking.experiment, uri, artifact_root(uri, root))
    commit, dirty = git_commit(root)
    run_tags = {"git_commit": commit, "mlflow.source.git.commit": commit}
    if dirty is not None:
        run_tags["git_dirty"] = str(dirty).lower()
    run_tags.update({key: value for key, value in (tags or {}).items() if value is not None})
    run_tags = _clean(run_tags, _MAX_TAG_VALUE)

    with _session_lock:
        if _session is not None:
            raise RuntimeError(
                f"an MLflow parent run is already open in this process ({_session.parent_run_id})"
            )
        mlflow.set_tracking_uri(uri)
        run = mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=run_tags)
        _session = _Session(uri, experiment_id, run.info.run_id)
    try:
        with run:
            _log_params(mlflow.MlflowClient(uri), run.info.run_id, flatten(params))
            log.info("MLflow run %s (experiment %s) at %s", run.info.run_id, experiment_id, uri)
            yield run
    finally:
        with _session_lock:
            _session = None


@contextmanager
def step_run(
    name: str, *, tags: Mapping[str, object] | None = None
) -> Iterator[mlflow.ActiveRun | None]:
    """A nested run for one pipeline step (yields its ActiveRun; None without a parent run).

    Nested under this thread's active run (a step inside a step) or else the parent run, so
    steps may run in Prefect's worker threads. Records `duration_s` (wall time of the body) and
    `peak_rss_mb` (this process's peak resident set so far, MiB), also when the step fails.
    """
    session = _session
    if session is None:
        yield None
        return
    import mlflow

    active = mlflow.active_run()
    parent_id = active.info.run_id if active is not None else session.parent_run_id
    step_tags = _clean({"featcal.step": name, **(tags or {})}, _MAX_TAG_VALUE)
    with mlflow.start_run(
        experiment_id=session.experiment_id,
        run_name=name,
        nested=True,
        parent_run_id=parent_id,
        tags=step_tags,
    ) as run:
        started = time.perf_counter()
        failed = False
        try:
            yield run
        except BaseException:
            failed = True
            raise
        finally:
            metrics = {
                "duration_s": time.perf_counter() - started,
                "peak_rss_mb": peak_rss_bytes() / _MIB,
            }
            try:
                _log_metrics(mlflow.MlflowClient(session.uri), run.info.run_id, metrics)
            except Exception:
                if not failed:
                    raise
                log.warning("could not log the metrics of failed step %r", name, exc_info=True)


# -------------------------------------------------------------------------------------- logging


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
    target = _target(run_id)
    if target is None:
        return
    from mlflow import MlflowClient

    session, run = target
    client = MlflowClient(session.uri)
    now = _now_ms()
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
    _log_metric_steps(client, run, metrics, now)

    hyper = record.get("hyperparameters") or {}
    _log_params(client, run, {f"calibration.{key}": value for key, value in hyper.items()})
    tags = {
        "calibration.architecture": record.get("architecture"),
        "calibration.record_version": record.get("featcal_record_version"),
    }
    if record.get("inputs") is not None:
        tags["calibration.inputs_sha256"] = hashlib.sha256(
            json.dumps(record["inputs"], sort_keys=True, default=str).encode()
        ).hexdigest()
    _log_tags(client, run, {key: value for key, value in tags.items() if value is not None})
    client.log_text(run, json.dumps(record, indent=2, default=str) + "\n", RECORD_ARTIFACT)


def log_tags(tags: Mapping[str, object], *, run_id: str | None = None) -> None:
    """Tags on the parent run (or `run_id`); None values skipped; nothing without a parent run."""
    target = _target(run_id)
    if target is None:
        return
    from mlflow import MlflowClient

    session, run = target
    values = {key: value for key, value in tags.items() if value is not None}
    _log_tags(MlflowClient(session.uri), run, _clean(values, _MAX_TAG_VALUE))


def log_evaluation(table: Mapping[str, Mapping[str, Mapping[str, float]]], *, run_id=None) -> None:
    """Metrics `accuracy/<task>/<model>`, `loss/…`, `normalized/…` and, per model, the mean
    over tasks `accuracy_mean/<model>` and `normalized_mean/<model>`."""
    target = _target(run_id)
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
    _log_metrics(MlflowClient(session.uri), run, metrics)


def log_artifacts(
    paths: str | Path | Iterable[str | Path],
    *,
    artifact_path: str | None = None,
    run_id: str | None = None,
) -> None:
    """Log files and directories (reports, plots) to the parent run (or `run_id`) under
    `artifact_path`; a directory keeps its name and contents. Nothing without a parent run;
    a missing path raises FileNotFoundError."""
    target = _target(run_id)
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


# ------------------------------------------------------------------------------------- helpers


def _target(run_id: str | None) -> tuple[_Session, str] | None:
    session = _session
    if session is None:
        return None
    return session, run_id or session.parent_run_id


def _now_ms() -> int:
    return int(time.time() * 1000)


def _clean(values: Mapping[str, object], limit: int) -> dict[str, str]:
    """Keys MLflow accepts and string values within `limit` characters."""
    return {_key(key): _value(value, limit) for key, value in values.items()}


def _key(key: str) -> str:
    key = _BAD_KEY_CHARS.sub("_", str(key)).strip("/") or "_"
    key = re.sub(r"/+", "/", key)
    if len(key) > _MAX_KEY:
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        key = f"{key[: _MAX_KEY - 13]}~{digest}"
    return key


def _value(value: object, limit: int) -> str:
    """The value as text (None: "null"); longer than `limit`: cut, with its length and digest."""
    if value is None:
        text = "null"
    elif isinstance(value, str):
        text = value
    elif isinstance(value, (bool, int, float)):
        text = str(value)
    else:
        text = json.dumps(value, sort_keys=True, default=str)
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    suffix = f"...<{len(text)} chars, sha256 {digest}>"
    return text[: limit - len(suffix)] + suffix


def _log_params(client, run_id: str, params: Mapping[str, object]) -> None:
    from mlflow.entities import Param

    items = [Param(key, value) for key, value in _clean(params, _MAX_PARAM_VALUE).items()]
    for start in range(0, len(items), _PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[start : start + _PARAMS_PER_BATCH])


def _log_tags(client, run_id: str, tags: Mapping[str, object]) -> None:
    from mlflow.entities import RunTag

    items = [RunTag(key, value) for key, value in _clean(tags, _MAX_TAG_VALUE).items()]
    for start in range(0, len(items), _PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=items[start : start + _PARAMS_PER_BATCH])


def _log_metrics(client, run_id: str, metrics: Mapping[str, float]) -> None:
    _log_metric_steps(client, run_id, [(k, v, 0) for k, v in metrics.items()], _now_ms())


def _log_metric_steps(client, run_id: str, metrics: list[tuple[str, float, int]], now: int) -> None:
    from mlflow.entities import Metric

    items = [Metric(_key(key), float(value), now, step) for key, value, step in metrics]
    for start in range(0, len(items), _METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=items[start : start + _METRICS_PER_BATCH])


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout.strip()


def _scheme(uri: str) -> str:
    """The backend of a store URI: "sqlite", "postgresql" (for postgresql+psycopg2), "file", ..."""
    scheme = urlsplit(uri).scheme.lower()
    if len(scheme) <= 1:  # a plain path (or a Windows drive letter)
        return "file"
    return scheme.split("+", 1)[0]


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///path` URI; None for in-memory databases."""
    if _scheme(uri) != "sqlite" or not uri.lower().startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return Path(path)


def _sqlite_uri(path: Path) -> str:
    return f"sqlite:///{path.as_posix()}"  # absolute path: sqlite:////abs/path


def _absolute_sqlite(uri: str, base: Path) -> str:
    path = _sqlite_path(uri)
    if path is None or path.is_absolute():
        return uri
    query = uri.split("?", 1)[1] if "?" in uri else None
    absolute = _sqlite_uri((base / path).resolve())
    return f"{absolute}?{query}" if query else absolute


def _make_sqlite_dir(uri: str) -> None:
    path = _sqlite_path(uri)
    if path is not None:
        path.expanduser().parent.mkdir(parents=True, exist_ok=True)


def _location_uri(location: str | Path | None) -> str | None:
    if location is None:
        return None
    text = str(location)
    if "://" in text or text.startswith("file:"):
        return text
    return Path(text).expanduser().resolve().as_uri()
