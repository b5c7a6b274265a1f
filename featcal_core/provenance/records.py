"""Every record file featcal writes and the layout of a results folder, named once.

    <results>/models.lock.json          LOCK: resolved models, commits, sha256 of every weight file
    <results>/calibration_sets/<task>/  the drawn calibration inputs (+ SET_RECORD)
    <results>/merged/                   the merged checkpoint (+ MERGE_RECORD)
    <results>/calibration/              per-block persisted states (the resume cache)
    <results>/calibrated/               the calibrated checkpoint (+ FEATCAL_RECORD)
    <results>/refit_heads/<model>/      head calibration (+ FITTED_ON)
    <results>/heads/                    zero-shot class-embedding caches
    <results>/evaluation_data/<task>/   a task's saved Hub evaluation split (+ EVALUATION_SOURCE)
    <results>/evaluation.json           EVALUATION: per task and model, accuracy and loss
    <results>/evaluation_datasets.json  EVALUATION_DATASETS: each task's evaluation dataset as
                                        evaluated (Hub id, config, split, commit; a folder's name)
    <results>/metrics.json              METRICS: the headline figures (a DVC metric)
    <results>/metrics_per_task.json     METRICS_PER_TASK: their per-task values (a DVC metric)
    <results>/provenance.json           PROVENANCE: git commit, MLflow and Prefect run ids
    reports/<run name>/                 the report (REPORTS_ROOT); as a DVC stage, with REPORT_CARD:
                                        the calibrated checkpoint's model card with its results

Every folder featcal writes also carries the guarded writer's marker (`io.outputs.MARKER`).
"""

from __future__ import annotations

from pathlib import Path

FEATCAL_RECORD = "featcal.json"
MERGE_RECORD = "merge.json"
SET_RECORD = "calibration_set.json"
LOCK = "models.lock.json"
EVALUATION = "evaluation.json"
EVALUATION_DATASETS = "evaluation_datasets.json"
METRICS = "metrics.json"
METRICS_PER_TASK = "metrics_per_task.json"
PROVENANCE = "provenance.json"
FITTED_ON = "fitted_on.json"
ZOO_MANIFEST = "zoo.json"
SELECTION = "selection.json"
#: where a saved Hub evaluation split came from: {"source", "identity", "commit"}
EVALUATION_SOURCE = "source.json"
#: the report stage's copy of the calibrated model card, with results (DVC stages only)
REPORT_CARD = "model_card.md"

#: every report goes below this folder (of the working directory)
REPORTS_ROOT = Path("reports")

#: the entries of a results folder: name -> what `results_layout` calls it
RESULTS_LAYOUT = {
    "lock": LOCK,
    "calibration_sets": "calibration_sets",
    "merged": "merged",
    "calibration": "calibration",
    "calibrated": "calibrated",
    "refit_heads": "refit_heads",
    "heads": "heads",
    "evaluation_data": "evaluation_data",
    "evaluation": EVALUATION,
    "evaluation_datasets": EVALUATION_DATASETS,
    "metrics": METRICS,
    "metrics_per_task": METRICS_PER_TASK,
    "provenance": PROVENANCE,
    "plots": "plots",
    "merges": "merges",  # featcal compare: one folder per distinct merge
    "variants": "variants",  # featcal compare: one results folder per variant
    "candidates": "candidates",  # select: one results folder per candidate
    "selection_sets": "selection_sets",  # held-out unlabeled inputs that score candidates
    "selection": SELECTION,  # select: the candidates' scores and the choice
}


def results_layout(results_dir: str | Path, run_name: str) -> dict[str, Path]:
    """{"root", "lock", "calibration_sets", ..., "report"}: the paths of one run's outputs."""
    root = Path(results_dir).expanduser()
    paths = {"root": root, **{key: root / name for key, name in RESULTS_LAYOUT.items()}}
    paths["report"] = REPORTS_ROOT / run_name
    return paths
