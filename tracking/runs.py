"""MLflow tracking for the pipeline: one parent run per pipeline run, one nested run per step.

    uri = tracking_uri(params.tracking, project_root)          # store
    with parent_run(params, run_name=params.run.name, tags={"prefect.flow_run_id": id}):
        with step_run("calibrate"):
            record = calibrate(...)
        log_calibration_record(record)                          # log
        log_artifacts([report_path, plot_dir])

Where runs go: see featcal.tracking.store (MLFLOW_TRACKING_URI, else
`tracking.mlflow_tracking_uri`, else `<project_root>/mlruns`). Everything works offline. What is
logged to a run: featcal.tracking.log; MLflow's limits and batches: featcal.tracking.batches.

When `tracking.enabled` is false, `parent_run` yields None without touching MLflow, and `step_run`,
`log_calibration_record` and `log_artifacts` do nothing. They also do nothing outside a parent run
(e.g. in a Dask worker process), so pipeline steps can call them unconditionally.

`mlflow` is imported only when a run starts; MLFLOW_DISABLE_TELEMETRY is set to true (unless set)
when this module is imported, before MLflow can be.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from featcal.tracking.batches import MAX_TAG_VALUE, batch_metrics, batch_params, clean
from featcal.tracking.store import (
    artifact_root,
    ensure_experiment,
    git_commit,
    store_failure,
    tracking_uri,
)
from featcal_core.memory import peak_rss_bytes, reset_peak_rss
from featcal_core.params import Params, flatten

if TYPE_CHECKING:
    import mlflow

__all__ = ["parent_run", "run_target", "step_run"]

log = logging.getLogger(__name__)

_MIB = 1024 * 1024


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
    run_tags = clean(run_tags, MAX_TAG_VALUE)

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
            batch_params(mlflow.MlflowClient(uri), run.info.run_id, flatten(params))
            log.debug("MLflow run %s (experiment %s) at %s", run.info.run_id, experiment_id, uri)
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
    `peak_rss_mb`: this process's peak resident set during the step, MiB (the count restarts at
    the step's start where the OS allows it, featcal_core.memory.reset_peak_rss; the tag
    `featcal.peak_rss` says `step` or, elsewhere, `process` for the high-water mark so far), also
    when the step fails.
    """
    session = _session
    if session is None:
        yield None
        return
    import mlflow

    active = mlflow.active_run()
    parent_id = active.info.run_id if active is not None else session.parent_run_id
    own_peak = reset_peak_rss()
    step_tags = {"featcal.step": name, "featcal.peak_rss": "step" if own_peak else "process"}
    step_tags = clean({**step_tags, **(tags or {})}, MAX_TAG_VALUE)
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
                batch_metrics(mlflow.MlflowClient(session.uri), run.info.run_id, metrics)
            except Exception as exc:
                if not failed:
                    raise
                # a failing store is the command's own one line; anything else a warning
                level = logging.DEBUG if store_failure(exc) else logging.WARNING
                log.log(level, "could not log the metrics of failed step %r: %s", name, exc)
                log.debug("the metrics' failure", exc_info=True)


def run_target(run_id: str | None) -> tuple[_Session, str] | None:
    """(this process's parent-run session, `run_id` or the parent run's id); None without a
    parent run."""
    session = _session
    if session is None:
        return None
    return session, run_id or session.parent_run_id
