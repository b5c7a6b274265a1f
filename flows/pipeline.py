"""`featcal run`: the pipeline as one Prefect flow, configured by params.yaml.

download-experts → calibration sets → merge → calibrate (one cached task per block, resumable)
→ evaluate → report, each step a nested MLflow run under one parent run per flow run. The steps and the
layout of what they write are in flows/steps.py.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from featcal.flows.environment import configure
from featcal.flows.environment import project_root as working_project
from featcal.flows.steps import Steps
from featcal_core.io.outputs import write_json
from featcal_core.params import Params, load_params

log = logging.getLogger(__name__)


def run_pipeline(params: Params, project_root: Path | None = None) -> dict:
    """Run the flow for validated `params`; returns a summary (paths, results, MLflow run id).
    `project_root`: where the MLflow store goes and whose git commit is recorded (default: the
    working directory)."""
    project_root = working_project() if project_root is None else Path(project_root)
    configure()
    from prefect import flow
    from prefect.runtime import flow_run

    from featcal.tasks.tracking import parent_run, step_run
    from featcal.tasks.tracking_log import (
        log_artifacts,
        log_calibration_record,
        log_evaluation,
        log_tags,
    )
    from featcal.tasks.tracking_store import git_commit
    from featcal_core.provenance.lock import lock_digest

    steps = Steps(params, in_flow=True)

    @flow(name="featcal-run")
    def featcal_run() -> dict:
        summary: dict = {"paths": {k: str(v) for k, v in steps.paths.items()}}
        tags = {"prefect_flow_run_id": flow_run.get_id()}
        with parent_run(
            params, run_name=params.run.name, tags=tags, project_root=project_root
        ) as run:
            summary["mlflow_run_id"] = run.info.run_id if run is not None else None
            if run is not None:
                import mlflow

                summary["mlflow_uri"] = mlflow.get_tracking_uri()
            write_json(steps.paths["provenance"], {
                "git_commit": git_commit(project_root)[0],
                "mlflow_run_id": summary["mlflow_run_id"],
                "prefect_flow_run_id": tags["prefect_flow_run_id"],
                "params": params.run.name,
            })  # fmt: skip
            if params.zoo is not None:
                with step_run("zoo"):
                    manifest = steps.zoo()
                log_tags({
                    "zoo.fingerprint": manifest["fingerprint"],
                    **{f"zoo.skipped.{t}": r[:250] for t, r in manifest["skipped"].items()},
                })  # fmt: skip
            with step_run("download-experts"):
                lock = steps.download()
            summary["lock_digest"] = lock_digest(lock)
            log_tags(lineage_tags(lock))
            steps.check_heads()  # before any heavy work
            with step_run("calibration-sets"):
                sets = steps.calibration_sets()
            log_tags({f"calibration_set.{t}.sha256": r["digest"] for t, r in sets.items()})
            with step_run("merge"):
                steps.merge()
            log_tags({"merged.sha256": _checkpoint_digest(steps.paths["merged"])})
            if params.featcal.enabled:
                with step_run("calibrate"):
                    record = steps.calibrate()
                log_calibration_record(record)
                log_tags({"calibration.inputs_digest": record.get("inputs_digest")})
                summary["calibration"] = {
                    "blocks": len(record["blocks"]),
                    "restored": sum(b["restored"] for b in record["blocks"]),
                    "wall_seconds": record["wall_seconds"],
                }
            if params.featcal.heads:
                with step_run("calibrate-heads"):
                    steps.heads()
            if params.evaluation.enabled:
                with step_run("evaluate"):
                    table = steps.evaluate()
                log_evaluation(table)
                summary["evaluation"] = table
                with step_run("report"):
                    files = steps.report()
                log_artifacts(list(files.values()), artifact_path="report")
                summary["report"] = str(files["report.html"].resolve())
        return summary

    with steps.session():  # before Prefect starts the flow run: a second run stops in one line
        return featcal_run()


def _files_digest(files: dict[str, str]) -> str:
    """One sha256 over a {file: sha256} mapping."""
    text = "\n".join(f"{name} {digest}" for name, digest in sorted(files.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _checkpoint_digest(directory: Path) -> str:
    from featcal_core.io.checkpoint import Checkpoint, sha256_file

    paths = Checkpoint(directory, "checkpoint").weight_paths()
    return _files_digest({p.name: sha256_file(p) for p in paths})


def lineage_tags(lock: dict) -> dict[str, str | None]:
    """MLflow tags naming exactly which models a run used: references, commits, file digests."""
    tags: dict[str, str | None] = {"lock_digest": lock.get("lock_digest")}
    entries = {"base": lock["base"], **{f"expert.{t}": e for t, e in lock["experts"].items()}}
    for role, entry in entries.items():
        tags[f"{role}.reference"] = entry["reference"]
        tags[f"{role}.commit"] = entry.get("commit") or "local"
        tags[f"{role}.sha256"] = _files_digest(entry["files"])
    return tags


def run_from_file(params_path: str | Path, overrides: list[str]) -> dict:
    """Load and validate params.yaml (before any heavy work), then run the flow."""
    params = load_params(params_path, overrides)
    return run_pipeline(params)
