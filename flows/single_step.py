"""One pipeline step on its own (`featcal download`, `calib-set`, `merge --params`,
`calibrate --params`, `heads`, `evaluate`, `report`: the DVC stages' commands), tracked like a
step of `featcal run`: an MLflow run `<run.name>/<step>` in the params' experiment, with the same
params, the same lineage tags (lock digest, model references and digests, params digest) and
what the step's counterpart in the flow logs (the calibration record, accuracy and gap-closed
metrics, dataset inputs, the report and the calibrated model), under the run lock.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from featcal.flows.environment import project_root
from featcal.flows.selection import select_step
from featcal.flows.steps import Steps
from featcal_core.params import Params

log = logging.getLogger(__name__)

#: the MLflow step name of each Steps method, as in the flow
STEP_NAMES = {
    "download": "download-experts",
    "calibration_sets": "calibration-sets",
    "select": "select",
    "merge": "merge",
    "calibrate": "calibrate",
    "heads": "calibrate-heads",
    "evaluate": "evaluate",
    "report": "report",
}


def run_single_step(params: Params, step: str, what: str) -> Any:
    """Run `Steps.<step>` for validated `params` inside the run lock and an MLflow run; returns
    the step's result. `what` names the command for the lock's one-line refusal."""
    from featcal.flows.run_tags import lineage_tags, params_digest
    from featcal.tracking.runs import parent_run, step_run

    steps = Steps(params)
    if step == "calibrate":
        from featcal.flows.environment import configure

        configure()
    tags = {"featcal.single_step": STEP_NAMES[step], "params_digest": params_digest(params)}
    for variable, tag in (("DVC_STAGE", "dvc.stage"), ("DVC_EXP_NAME", "dvc.experiment")):
        if os.environ.get(variable):
            tags[tag] = os.environ[variable]
    with steps.session(what):
        name = f"{params.run.name}/{STEP_NAMES[step]}"
        with parent_run(params, run_name=name, tags=tags, project_root=project_root()):
            if step == "calibrate":
                steps.check_heads()
            with step_run(STEP_NAMES[step]):
                result = select_step(steps) if step == "select" else getattr(steps, step)()
            _log_outputs(steps, step, result)
            if steps.paths["lock"].is_file():
                from featcal.tracking.log import log_tags

                log_tags(lineage_tags(steps.lock()))
    log.info("%s: done (%s)", step, steps.paths["root"])
    return result


def _log_outputs(steps: Steps, step: str, result: Any) -> None:
    """What the flow logs after the same step."""
    from featcal.tracking.log import (
        log_artifacts,
        log_calibration_record,
        log_datasets,
        log_evaluation,
        log_model,
    )

    if step == "calibration_sets":
        log_datasets(
            {
                "name": f"calibration/{t}",
                "context": "calibration",
                "sha256": r["digest"],
                "path": steps.paths["calibration_sets"] / t,
            }
            for t, r in result.items()
        )
    elif step == "select":
        from featcal.tracking.log import log_selection

        log_selection(result)
    elif step == "calibrate" and steps.repair.blockwise:
        log_calibration_record(result)
    elif step == "evaluate":
        from featcal.tasks.evaluate import evaluation_inputs

        log_evaluation(result)
        log_datasets(evaluation_inputs(steps.params, str(steps.paths["root"])))
        if steps.repair.output != "none" and steps.paths["calibrated"].is_dir():
            log_model(
                steps.paths["calibrated"],
                artifact_path=steps.repair.artifact,
                weights=steps.params.tracking.log_model,
            )
    elif step == "report":
        log_artifacts(list(result.values()), artifact_path="report")
