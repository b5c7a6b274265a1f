"""`featcal run`: the pipeline as one Prefect flow, configured by params.yaml.

download-experts → calibration sets → merge → calibrate (one cached task per block, resumable)
→ evaluate, each step a nested MLflow run under one parent run per flow run. The report step is not
part of the flow yet.

Everything the run writes goes below `run.results_dir` (default data/results):

    models.lock.json          resolved models, commits and sha256 of every weight file
    calibration_sets/<task>/  the drawn calibration inputs (with source row ids)
    merged/                   the merged checkpoint (+ merge.json)
    calibration/              per-block persisted states (the resume cache)
    calibrated/               the calibrated checkpoint (+ featcal.json)
    evaluation.json           per task and model: accuracy, loss, normalized accuracy
    heads/                    cached CLIP zero-shot class embeddings
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from flows.environment import PROJECT_ROOT, configure
from flows.params import Params, load_params

log = logging.getLogger(__name__)


def layout(params: Params) -> dict[str, Path]:
    root = Path(params.run.results_dir).expanduser()
    return {
        "root": root,
        "lock": root / "models.lock.json",
        "calibration_sets": root / "calibration_sets",
        "merged": root / "merged",
        "calibration": root / "calibration",
        "calibrated": root / "calibrated",
        "evaluation": root / "evaluation.json",
    }


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def run_pipeline(params: Params, project_root: Path = PROJECT_ROOT) -> dict:
    """Run the flow for validated `params`; returns a summary (paths, record, MLflow run id)."""
    configure()
    from prefect import flow
    from prefect.runtime import flow_run

    from featcal_core.architectures import REGISTRY
    from featcal_core.block import FeatCalParams
    from featcal_core.calibration import Settings
    from featcal_core.resolve import lock_digest, models_from_lock
    from flows.calibration import calibration_flow_fn, make_spec
    from tasks.calibration_sets import build_calibration_sets
    from tasks.download import download_models
    from tasks.evaluate import evaluate_models
    from tasks.merge import merge_task
    from tasks.tracking import log_calibration_record, log_evaluation, parent_run, step_run

    paths = layout(params)

    @flow(name="featcal-run")
    def featcal_run() -> dict:
        summary: dict = {"paths": {k: str(v) for k, v in paths.items()}}
        tags = {"prefect_flow_run_id": flow_run.get_id()}
        with parent_run(
            params, run_name=params.run.name, tags=tags, project_root=project_root
        ) as run:
            summary["mlflow_run_id"] = run.info.run_id if run is not None else None
            with step_run("download-experts"):
                lock = download_models(params.models, paths["lock"])
            base, experts = models_from_lock(lock)
            modality = REGISTRY[lock["architecture"]].modality
            with step_run("calibration-sets"):
                sets = build_calibration_sets(params, modality, str(paths["calibration_sets"]))
            expert_dirs = {task: str(model.path) for task, model in experts.items()}
            with step_run("merge"):
                merge_task(
                    str(base.path), expert_dirs, str(paths["merged"]),
                    params.merge.method, dict(params.merge.hyperparameters),
                )  # fmt: skip
            summary["lock_digest"] = lock_digest(lock)
            if params.featcal.enabled:
                featcal = params.featcal
                spec = make_spec(
                    base.path, paths["merged"], expert_dirs,
                    {task: record["path"] for task, record in sets.items()},
                    paths["calibration"],
                    FeatCalParams(featcal.alpha, featcal.rho, featcal.lam, featcal.eps),
                    Settings(featcal.num_per_task, featcal.batch_size, params.run.seed,
                             featcal.device, featcal.max_length, featcal.pooling),
                )  # fmt: skip
                with step_run("calibrate"):
                    record = calibration_flow_fn(spec, str(paths["calibrated"]), overwrite=True)
                log_calibration_record(record)
                summary["calibration"] = {
                    "blocks": len(record["blocks"]),
                    "restored": sum(b["restored"] for b in record["blocks"]),
                    "wall_seconds": record["wall_seconds"],
                }
            if params.evaluation.enabled:
                models = {"merged": str(paths["merged"])}
                if params.featcal.enabled:
                    models["calibrated"] = str(paths["calibrated"])
                with step_run("evaluate"):
                    table = evaluate_models(
                        params, str(base.path), expert_dirs, models, str(paths["root"])
                    )
                write_json(paths["evaluation"], table)
                log_evaluation(table)
                summary["evaluation"] = table
        return summary

    return featcal_run()


def run_from_file(params_path: str | Path, overrides: list[str]) -> dict:
    """Load and validate params.yaml (before any heavy work), then run the flow."""
    params = load_params(params_path, overrides)
    return run_pipeline(params)
