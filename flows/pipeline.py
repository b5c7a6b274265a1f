"""`featcal run`: the pipeline as one Prefect flow, configured by params.yaml.

download-experts → calibration sets → merge → calibrate (one cached task per block, resumable)
→ evaluate → report, each step a nested MLflow run under one parent run per flow run. The steps and the
layout of what they write are in flows/steps.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

from flows.environment import PROJECT_ROOT, configure
from flows.params import Params, load_params
from flows.steps import Steps, write_json

log = logging.getLogger(__name__)


def run_pipeline(params: Params, project_root: Path = PROJECT_ROOT) -> dict:
    """Run the flow for validated `params`; returns a summary (paths, results, MLflow run id)."""
    configure()
    from prefect import flow
    from prefect.runtime import flow_run

    from featcal_core.resolve import lock_digest
    from tasks.tracking import (
        git_commit,
        log_artifacts,
        log_calibration_record,
        log_evaluation,
        parent_run,
        step_run,
    )

    steps = Steps(params, in_flow=True)

    @flow(name="featcal-run")
    def featcal_run() -> dict:
        summary: dict = {"paths": {k: str(v) for k, v in steps.paths.items()}}
        tags = {"prefect_flow_run_id": flow_run.get_id()}
        with parent_run(
            params, run_name=params.run.name, tags=tags, project_root=project_root
        ) as run:
            summary["mlflow_run_id"] = run.info.run_id if run is not None else None
            write_json(steps.paths["root"] / "provenance.json", {
                "git_commit": git_commit(project_root)[0],
                "mlflow_run_id": summary["mlflow_run_id"],
                "prefect_flow_run_id": tags["prefect_flow_run_id"],
                "params": params.run.name,
            })  # fmt: skip
            with step_run("download-experts"):
                summary["lock_digest"] = lock_digest(steps.download())
            with step_run("calibration-sets"):
                steps.calibration_sets()
            with step_run("merge"):
                steps.merge()
            if params.featcal.enabled:
                with step_run("calibrate"):
                    record = steps.calibrate()
                log_calibration_record(record)
                summary["calibration"] = {
                    "blocks": len(record["blocks"]),
                    "restored": sum(b["restored"] for b in record["blocks"]),
                    "wall_seconds": record["wall_seconds"],
                }
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

    return featcal_run()


def run_from_file(params_path: str | Path, overrides: list[str]) -> dict:
    """Load and validate params.yaml (before any heavy work), then run the flow."""
    params = load_params(params_path, overrides)
    return run_pipeline(params)
