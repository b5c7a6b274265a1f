"""Prefect task for the calibration-sets step: a thin wrapper over featcal_core.data.calibration_sets.

For every task in the params it draws `featcal.num_per_task` rows (seed `run.seed`) of the task's
calibration source and writes them to `<out_root>/<task>` (default out_root:
`<run.results_dir>/calibration_sets`). An existing set is replaced atomically; since the output is
deterministic, rebuilding an unchanged set gives byte-identical files (and the same digest).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from prefect import task

from featcal_core.data.calibration_sets import draw_calibration_set
from featcal_core.errors import FeatCalError
from featcal_core.params import Params

log = logging.getLogger(__name__)

DEFAULT_SUBDIR = "calibration_sets"


def calibration_sets_root(params: Params, out_root: str | Path | None = None) -> Path:
    """Where the sets go: `out_root`, or `<run.results_dir>/calibration_sets`."""
    return Path(out_root) if out_root is not None else Path(params.run.results_dir) / DEFAULT_SUBDIR


@task(name="calibration-sets")
def build_calibration_sets(
    params: Params,
    modality: str | Mapping[str, str],
    out_root: str | None = None,
    trust_remote_code: bool = False,
) -> dict[str, dict]:
    """Draw and save every task's calibration set; returns {task: record} (see RECORD_NAME).

    `modality` is "image" or "text" (the base model's architecture decides), or one per task.
    """
    root = calibration_sets_root(params, out_root)
    records: dict[str, dict] = {}
    for name, spec in params.tasks.items():
        if isinstance(modality, str):
            task_modality = modality
        elif name in modality:
            task_modality = modality[name]
        else:
            raise FeatCalError(
                f"tasks.{name}: no modality given for this task (have {sorted(modality)}); "
                "pass image or text for every task"
            )
        records[name] = draw_calibration_set(
            name,
            spec.calibration,
            spec.evaluation,
            root / name,
            params.featcal.num_per_task,
            params.run.seed,
            task_modality,
            trust_remote_code=trust_remote_code,
        )
    log.info("calibration sets: %d tasks under %s", len(records), root)
    return records
