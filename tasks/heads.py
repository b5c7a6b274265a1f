"""Prefect task "calibrate-heads": head calibration (beyond the paper) for the merged and the
calibrated model. For every task, the task's head (the one evaluation uses: the expert's own
classifier, or the CLIP zero-shot class embeddings) is refit in closed form on the task's
calibration inputs (the same rows FeatCal used; no labels) so that, on the evaluated tower, it
reproduces the expert's logits. Written as `<results>/refit_heads/<model>/<task>/classifier.*`
(featcal_core.evaluation.linear_head format); the evaluate step scores "<model>_heads" rows with them.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from featcal.tasks.evaluate import forward_precision, task_head
from featcal_core.data.calibration_data import load_calibration_set
from featcal_core.evaluation.linear_head import save_linear_head
from featcal_core.io.outputs import guarded_directory
from featcal_core.log_detail import DETAIL
from featcal_core.method.head_calibration import calibrate_head
from featcal_core.provenance.records import FITTED_ON

log = logging.getLogger(__name__)


@task(name="calibrate-heads", cache_policy=NO_CACHE)
def calibrate_heads(
    params: Any,
    base: str,
    experts: dict[str, str],
    models: dict[str, str],
    calibration_sets: dict[str, str],
    results_dir: str,
) -> dict[str, dict[str, str]]:
    """{model name: {task: refit head folder}} for each of `models` (name -> checkpoint)."""
    root = Path(results_dir)
    featcal = params.featcal
    out: dict[str, dict[str, str]] = {name: {} for name in models}
    chosen = forward_precision(params, base, featcal.precision)  # the feature pass's dtype
    log.info("head calibration forwards in %s (%s)", chosen.name, chosen.reason, extra=DETAIL)
    inputs = (base, *experts.values(), *models.values(), *calibration_sets.values())
    with ExitStack() as stack:  # one guarded folder per model: refit_heads/<model>/<task>/
        folders = {
            name: stack.enter_context(
                guarded_directory(
                    root / "refit_heads" / name,
                    overwrite=True,
                    inputs=inputs,
                    flag=f"refit heads of {name}",
                )
            )
            for name in models
        }
        for task_name, spec in params.tasks.items():
            head, zero_shot = task_head(task_name, spec, Path(base), Path(experts[task_name]), root)
            features = "clip_image_embeds" if zero_shot else "pooler_output"
            rows = load_calibration_set(
                task_name,
                calibration_sets[task_name],
                head.modality,
                featcal.num_per_task,
                params.run.seed,
            ).rows
            labels = head.labels  # the expert's class names (id2label), or the zero-shot names
            for name, directory in models.items():
                weight, bias = calibrate_head(
                    head,
                    experts[task_name],
                    directory,
                    rows,
                    lam=featcal.head_lam,
                    batch_size=featcal.batch_size,
                    device=featcal.device,
                    precision=chosen.name,
                )
                save_linear_head(folders[name] / task_name, weight, bias, labels, features=features)
                out[name][task_name] = str(root / "refit_heads" / name / task_name)
            log.info(
                "calibrate-heads %s: %d inputs, models %s",
                task_name,
                len(rows),
                list(models),
                extra=DETAIL,
            )
        for name, directory in models.items():  # what the heads were fit on (stale-head check)
            record = {
                "model": directory,
                "weights": weight_digests(directory),
                **chosen.record(),
            }
            (folders[name] / FITTED_ON).write_text(json.dumps(record, indent=2) + "\n")
    return out


def weight_digests(directory: str | Path) -> dict[str, str]:
    """{weight file name: sha256} of a checkpoint."""
    from featcal_core.io.checkpoint import Checkpoint, sha256_file

    return {p.name: sha256_file(p) for p in Checkpoint(directory, "checkpoint").weight_paths()}
