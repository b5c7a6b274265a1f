"""Prefect tasks of the `select` step (featcal_core.params.selection): the held-out sets and the
candidates' scores.

`build_selection_sets` draws, per task, `select.holdout_per_task` rows of the task's unlabeled
calibration source that are not in its calibration set (`<results>/selection_sets/<task>`, the
calibration-set format and checks: never an evaluation row). `score_candidates` scores every
candidate's model on them against the task's expert under the task's evaluation head
(featcal_core.evaluation.agreement: agreement, drift), or on the task's labelled validation split
(`select.score: validation`: accuracy).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from featcal.tasks.evaluate import _evaluation_data, forward_precision, task_head
from featcal_core.data.calibration_sets import RECORD_NAME, draw_calibration_set
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.input_batches import InputBatches
from featcal_core.log_detail import DETAIL
from featcal_core.report.selection import held_out_text

log = logging.getLogger(__name__)

#: why no candidate of a generating language model can be scored
SCORELESS = (
    "select: causal language models have no classification head to agree with (they are "
    "evaluated by label continuation); remove select: and choose the settings by hand"
)


@task(name="selection-sets")
def build_selection_sets(
    params: Any, modality: str, calibration_root: str, out_root: str, holdout: int
) -> dict[str, dict]:
    """{task: record} of the held-out sets, `holdout` rows each, disjoint from the calibration
    sets under `calibration_root`; a task with fewer rows left holds them all (`n_rows` in its
    record, and a WARNING naming the task and both counts)."""
    records = {}
    for name, spec in params.tasks.items():
        record = Path(calibration_root) / name / RECORD_NAME
        drawn = json.loads(record.read_text(encoding="utf-8"))["row_ids"]
        records[name] = draw_calibration_set(
            name,
            spec.calibration,
            spec.evaluation,
            Path(out_root) / name,
            holdout,
            params.run.seed,
            modality,
            exclude=drawn,
            count_key="select.holdout_per_task",
        )
    counts = {task: record["n_rows"] for task, record in records.items()}
    log.info("selection sets: %s under %s", held_out_text(counts, holdout), out_root)
    return records


@task(name="score-candidates", cache_policy=NO_CACHE)
def score_candidates(
    params: Any,
    base: str,
    experts: dict[str, str],
    candidates: dict[str, tuple[str, str | None]],
    selection_sets: dict[str, str],
    results_dir: str,
    score: str = "agreement",
) -> dict[str, dict[str, dict[str, float]]]:
    """{candidate: {task: scores}} for each candidate (name -> (checkpoint, Surgery modules
    folder or None)). Label-free scores: {"agreement", "drift", "kl", "examples"}; with `score`
    validation: {"validation": accuracy in percent, "examples"}."""
    from featcal_core.evaluation.agreement import agreement_scores, head_outputs
    from featcal_core.evaluation.language_model import generation_kind
    from featcal_core.repair.surgery_module import SurgeryHead, load_surgery

    if generation_kind(base) is not None:
        raise FeatCalError(SCORELESS)
    root = Path(results_dir)
    device, batch = params.featcal.device, params.evaluation.batch_size
    chosen = forward_precision(params, base)  # evaluation.precision, else featcal.precision
    log.info("scoring forwards in %s (%s)", chosen.name, chosen.reason, extra=DETAIL)
    found: dict[str, dict[str, dict[str, float]]] = {name: {} for name in candidates}
    for task_name, spec in params.tasks.items():
        head, _ = task_head(task_name, spec, Path(base), Path(experts[task_name]), root)
        batches = InputBatches()  # the held-out rows preprocessed once for all candidates
        expert = None
        if score != "validation":
            expert = head_outputs(
                experts[task_name],
                head,
                selection_sets[task_name],
                batch_size=batch,
                device=device,
                batches=batches,
                precision=chosen.name,
            )
        for name, (checkpoint, surgery) in candidates.items():
            model_head = head
            if surgery is not None:
                model_head = SurgeryHead(head, load_surgery(Path(surgery) / task_name))
            if score == "validation":
                found[name][task_name] = _validation(
                    params, task_name, spec, checkpoint, model_head, root, chosen.name
                )
            else:
                outputs = head_outputs(
                    checkpoint,
                    model_head,
                    selection_sets[task_name],
                    batch_size=batch,
                    device=device,
                    batches=batches,
                    precision=chosen.name,
                )
                found[name][task_name] = agreement_scores(outputs, expert)
        log.info(
            "score %s: %s",
            task_name,
            ", ".join(f"{n} {_brief(s[task_name])}" for n, s in found.items()),
            extra=DETAIL,
        )
    return found


def _validation(params, task_name, spec, checkpoint, head, root: Path, precision: str):
    from featcal_core.evaluation.accuracy import evaluate

    source = spec.validation
    data, split = _evaluation_data(f"{task_name}-validation", source, root / "evaluation_data")
    result = evaluate(
        checkpoint,
        head,
        data,
        split,
        batch_size=params.evaluation.batch_size,
        max_examples=params.evaluation.max_examples_per_task,
        image_column=source.image_column,
        text_column=source.text_column,
        label_column=source.label_column,
        device=params.featcal.device,
        progress=False,
        precision=precision,
    )
    return {"validation": 100.0 * result["accuracy"], "examples": result["examples"]}


def _brief(scores: dict[str, float]) -> str:
    if "validation" in scores:
        return f"{scores['validation']:.1f}%"
    return f"{scores['agreement']:.1f}% / {scores['drift']:.3g} / {scores['kl']:.3g}"
