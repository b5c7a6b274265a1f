"""`featcal run`: the pipeline as one Prefect flow, configured by params.yaml.

download-experts → calibration sets → (select: the best of select:'s candidates) → merge →
calibrate (one cached task per block, resumable) → evaluate → report, each step a nested MLflow
run under one parent run per flow run. The steps and the layout of what they write are in
flows/steps.py.

The flow is `featcal_run` at module level, so Prefect can deploy it from its entrypoint
(`prefect deploy featcal/flows/pipeline.py:featcal_run` in the installed package, or
`featcal_run.serve(...)`; `featcal serve` does the latter). Its flow runs are named
`<run.name>-<first 8 hex digits of the params digest>`; the logs of featcal's loggers reach the
Prefect API (flows.environment), and each run ends with a markdown artifact holding the result
table and where the report and the MLflow run are.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from featcal.flows.environment import command_api, configure
from featcal.flows.environment import project_root as working_project
from featcal.flows.progress import run_progress
from featcal.flows.run_tags import checkpoint_digest, flow_params, lineage_tags, params_digest
from featcal.flows.selection import select_step
from featcal.flows.selection_record import check_candidates
from featcal.flows.steps import Steps
from featcal_core.io import failpoints
from featcal_core.io.outputs import write_json
from featcal_core.params import Params, load_params
from featcal_core.repair.registry import get as get_repair

configure()  # before prefect is imported
from prefect import flow  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402

log = logging.getLogger(__name__)

#: the flow's name in Prefect (deployments: `featcal-run/<deployment>`)
FLOW_NAME = "featcal-run"


def flow_run_name() -> str:
    """`<run.name>-<params digest prefix>` for the flow run being started."""
    params = flow_params(flow_run.parameters)
    return f"{params.run.name}-{params_digest(params)[:8]}"


@flow(name=FLOW_NAME, flow_run_name=flow_run_name)
def featcal_run(
    params_path: str = "params.yaml",
    overrides: list[str] | None = None,
    params: Any = None,
) -> dict:
    """The whole pipeline for the params file `params_path` (relative paths: from the working
    directory) with `--set`-style `overrides`; returns a summary (paths, results, MLflow run id).
    `params`: those params as the caller already validated them, a `Params` (the file is then
    not read again; typed Any, since Prefect builds its parameter model from the annotations
    without this module's names); a scheduled run of a deployment reads the file at each run.
    """
    params = flow_params({"params_path": params_path, "overrides": overrides, "params": params})
    steps = Steps(params, in_flow=True)
    with steps.session():  # re-entrant: `run_pipeline` took it before the flow started
        summary = _pipeline(params, steps, working_project())
    _result_artifact(params, summary)
    return summary


def run_pipeline(
    params_path: str | Path, overrides: list[str] | None = None, params: Params | None = None
) -> dict:
    """Validate params.yaml (before any heavy work; `params`: already validated by the caller,
    from `params_path` and `overrides`), take the run lock (a second run on the same results
    stops in one line, before Prefect starts a flow run or a server), then run `featcal_run`
    (`FEATCAL_FAILPOINT=locked:run` stops it in between). The file is read once."""
    if params is None:
        params = load_params(params_path, overrides or [])
    check_candidates(params)
    with Steps(params).session():
        failpoints.hit("locked", "run")
        with command_api():  # Prefect's API for the flow (this command's own server by default)
            return featcal_run(str(Path(params_path).resolve()), list(overrides or []), params)


def _pipeline(params: Params, steps: Steps, project_root: Path) -> dict:
    from featcal.tasks.evaluate import evaluation_inputs
    from featcal.tracking.log import (
        log_artifacts,
        log_calibration_record,
        log_datasets,
        log_evaluation,
        log_model,
        log_selection,
        log_tags,
    )
    from featcal.tracking.runs import parent_run, step_run
    from featcal.tracking.store import git_commit
    from featcal_core.provenance.lock import lock_digest

    summary: dict = {"name": params.run.name, "paths": {k: str(v) for k, v in steps.paths.items()}}
    digest = params_digest(params)
    tags = {"prefect_flow_run_id": flow_run.get_id(), "params_digest": digest}
    with (
        run_progress(_step_names(params)) as display,
        parent_run(params, run_name=params.run.name, tags=tags, project_root=project_root) as run,
    ):
        summary["mlflow_run_id"] = run.info.run_id if run is not None else None
        if run is not None:
            import mlflow

            summary["mlflow_uri"] = mlflow.get_tracking_uri()
        write_json(
            steps.paths["provenance"],
            {
                "git_commit": git_commit(project_root)[0],
                "mlflow_run_id": summary["mlflow_run_id"],
                "prefect_flow_run_id": tags["prefect_flow_run_id"],
                "params": params.run.name,
                "params_digest": digest,
            },
        )
        if params.zoo is not None:
            with step_run("zoo"), display.step("zoo"):
                manifest = steps.zoo()
            log_tags(
                {
                    "zoo.fingerprint": manifest["fingerprint"],
                    **{f"zoo.skipped.{t}": r[:250] for t, r in manifest["skipped"].items()},
                }
            )
        with step_run("download-experts"), display.step("download-experts"):
            lock = steps.download()
        summary["lock_digest"] = lock_digest(lock)
        log_tags(lineage_tags(lock))
        steps.check_heads()  # before any heavy work
        with step_run("calibration-sets"), display.step("calibration-sets"):
            sets = steps.calibration_sets()
        log_tags({f"calibration_set.{t}.sha256": r["digest"] for t, r in sets.items()})
        log_datasets(
            {
                "name": f"calibration/{t}",
                "context": "calibration",
                "sha256": r["digest"],
                "path": steps.paths["calibration_sets"] / t,
            }
            for t, r in sets.items()
        )
        if params.select is not None:
            with step_run("select"), display.step("select"):
                summary["selection"] = select_step(steps)
            log_selection(summary["selection"])
            params = steps.params  # the winner's, from here on
        with step_run("merge"), display.step("merge"):
            steps.merge()
        log_tags({"merged.sha256": checkpoint_digest(steps.paths["merged"])})
        repair = steps.repair
        if repair.blockwise:
            with step_run(repair.step), display.step(repair.step):
                record = steps.calibrate()
            log_calibration_record(record)
            log_tags({"calibration.inputs_digest": record.get("inputs_digest")})
            summary["calibration"] = {
                "blocks": len(record["blocks"]),
                "restored": sum(b["restored"] for b in record["blocks"]),
                "wall_seconds": record["wall_seconds"],
            }
        elif repair.run is not None:
            with step_run(repair.step), display.step(repair.step):
                record = steps.calibrate()
            summary["repair"] = {"method": repair.name, "wall_seconds": record.get("wall_seconds")}
        log_tags({"repair.method": params.repair_method})
        if params.featcal.heads:
            with step_run("calibrate-heads"), display.step("calibrate-heads"):
                steps.heads()
        if params.evaluation.enabled:
            with step_run("evaluate"), display.step("evaluate"):
                table = steps.evaluate()
            log_evaluation(table)
            log_datasets(evaluation_inputs(steps.params, str(steps.paths["root"])))
            summary["evaluation"] = table
            with step_run("report"), display.step("report"):
                files = steps.report()
            log_artifacts(list(files.values()), artifact_path="report")
            summary["report"] = str(files["report.html"].resolve())
        if repair.output != "none":  # with its model card (rewritten after evaluation)
            log_model(
                steps.paths["calibrated"],
                artifact_path=repair.artifact,
                weights=params.tracking.log_model,
            )
    return summary


def _step_names(params: Params) -> list[str]:
    """The steps this run will show in its progress display, in order."""
    names = ["zoo"] if params.zoo is not None else []
    names += ["download-experts", "calibration-sets"]
    names += ["select"] if params.select is not None else []
    names += ["merge"]
    repair = get_repair(params.repair_method)
    names += [repair.step] if repair.run is not None else []
    names += ["calibrate-heads"] if params.featcal.heads else []
    names += ["evaluate", "report"] if params.evaluation.enabled else []
    return names


def _result_artifact(params: Params, summary: dict) -> None:
    """A markdown artifact on the flow run: the result table and where the record is."""
    from prefect.artifacts import create_markdown_artifact

    from featcal.flows.summary import markdown_summary

    key = "featcal-" + "".join(c if c.isalnum() else "-" for c in params.run.name.lower())
    create_markdown_artifact(
        markdown=markdown_summary(summary),
        key=key[:100].strip("-") or "featcal-run",
        description=f"featcal run {params.run.name}: results and where the full record is",
    )
