"""The `select` step (params `select:`, featcal_core.params.selection): every candidate merged
and repaired on the shared calibration sets, scored on held-out unlabeled inputs (or labelled
validation data), and the best one chosen; the run then merges, repairs, evaluates and reports
with the winner's settings.

Where things go, below `run.results_dir`: `selection_sets/<task>` (the held-out inputs),
`merges/<key>` (each distinct merge, once), `candidates/<name>` (each candidate's repair) and
`selection.json` (the record: the score, every candidate's per-task scores, mean and cost, the
ranking, the winner, its overrides and why). The record is keyed by the settings it was made
for (`selection_key`); the single steps and DVC stages apply the winner only while that key still
matches, and otherwise ask for `featcal select` again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from featcal.flows.selection_record import (
    FORMAT,
    candidate_overrides,
    candidate_params,
    check_candidates,
    ineligible,
    selection_key,
)
from featcal.flows.steps import Steps
from featcal.flows.variants import (
    evaluation_rows,
    merge_key,
    model_row,
    repair,
    run_merges,
    shared_steps,
)
from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import write_json
from featcal_core.params import Params
from featcal_core.params.repair import layered

log = logging.getLogger(__name__)


def exhausted_tasks(steps: Steps) -> dict[str, int]:
    """{task: its source's row count} for the tasks whose calibration set holds every row of its
    source, so that no row is left to hold out for the label-free scores."""
    from featcal_core.data.calibration_sets import RECORD_NAME

    found = {}
    for name, folder in steps.calibration_set_dirs().items():  # present and verified
        record = json.loads((Path(folder) / RECORD_NAME).read_text(encoding="utf-8"))
        if record["n_rows"] >= record["rows_available"]:
            found[name] = record["rows_available"]
    return found


def check_scorable(steps: Steps) -> None:
    """FeatCalError before any candidate runs when no candidate can be scored: a generating
    language model has no classification head to agree with (nor to take accuracy under)."""
    from featcal.tasks.selection import SCORELESS
    from featcal_core.evaluation.language_model import generation_kind

    if generation_kind(steps.models()[0]) is not None:
        raise FeatCalError(SCORELESS)


def score_held_out(
    steps: Steps,
    variants: dict[str, Params],
    merges: dict,
    costs: dict,
    holdout: int,
    score: str = "agreement",
) -> tuple[dict, dict]:
    """Draw `holdout` held-out inputs per task (selection_sets/) and score every variant there
    (tasks/selection.py); ({task: held-out set record}, {variant: {task: scores}})."""
    from featcal.tasks.selection import build_selection_sets, score_candidates
    from featcal_core.architectures import get

    params = steps.params
    modality = get(steps.lock()["architecture"]).modality
    sets = steps.call(
        build_selection_sets,
        params,
        modality,
        str(steps.paths["calibration_sets"]),
        str(steps.paths["selection_sets"]),
        holdout,
    )
    models, surgeries, _ = evaluation_rows(variants, merges, costs)
    # a variant under refit heads is not scored: the scores read the tasks' own heads
    scored = {
        name: surgeries.get(name) or (models[model_row(name, v, merges, costs)], None)
        for name, v in variants.items()
        if not costs[name].get("heads")
    }
    base, experts = steps.models()
    scores = steps.call(
        score_candidates,
        params,
        base,
        experts,
        scored,
        {t: str(steps.paths["selection_sets"] / t) for t in params.tasks},
        str(steps.paths["root"]),
        score,
    )
    return sets, scores


def select(steps: Steps, step_run) -> dict:
    """The select step for `steps` (its params' select:); writes and returns the record."""
    from featcal_core.evaluation.selection import choose
    from featcal_core.report.selection import held_out_text

    params = steps.params
    settings = params.select
    if settings is None:
        record = {
            "format": FORMAT,
            "key": None,
            "winner": None,
            "why": "no select: section; the params file's own settings run",
        }
        write_json(steps.paths["selection"], record)
        return record
    check_candidates(params)
    check_scorable(steps)
    exhausted = exhausted_tasks(steps)
    if exhausted:  # before any candidate runs: the held-out draw would find no row
        task, total = next(iter(exhausted.items()))
        raise FeatCalError(
            f"tasks.{task}.calibration: all {total} rows are in the calibration set, so none is "
            "left to hold out for select:'s scores; lower featcal.num_per_task or use a larger "
            "calibration source"
        )
    layers = {c.name: candidate_overrides(params, c) for c in settings.candidates}
    candidates = {name: candidate_params(params, name, sets) for name, (sets, _) in layers.items()}
    replaced = {name: dropped for name, (_, dropped) in layers.items() if dropped}
    if replaced:
        log.info(
            "select: --set %s applies to every candidate (it replaces %s)",
            " ".join(layered([], params.user_set)[0]),
            "; ".join(f"{name}'s {', '.join(d)}" for name, d in replaced.items()),
        )
    merges = run_merges(steps, [(None, p) for p in candidates.values()], step_run)
    costs = {}
    for name, candidate in candidates.items():
        merged = merges[merge_key(candidate.merge)]["path"]
        with step_run(f"candidate {name}", tags={"featcal.candidate": name}):
            costs[name] = repair(shared_steps(steps, candidate, merged))
    sets, scores = score_held_out(
        steps, candidates, merges, costs, settings.holdout_per_task, settings.score
    )
    barred = ineligible(params, candidates)  # a winner is one checkpoint, unless opted in
    choice = choose(scores, settings.score, barred)
    # what the scores were computed on: a task with fewer rows left than requested holds them all
    held_out = {t: r["n_rows"] for t, r in sets.items()}
    why = choice["why"]
    if settings.score != "validation" and any(
        n != settings.holdout_per_task for n in held_out.values()
    ):
        why += f"; scored on {held_out_text(held_out, settings.holdout_per_task)}"
    record = {
        "format": FORMAT,
        "key": selection_key(params),
        "score": settings.score,
        "higher_is_better": choice["higher_is_better"],
        "holdout_per_task": settings.holdout_per_task,  # requested; `held_out`: what was used
        "held_out": held_out,
        "selection_sets": {t: r["digest"] for t, r in sets.items()},
        "winner": choice["winner"],
        "set": layers[choice["winner"]][0],  # its own, then the user's --set (they win)
        "user_set": layered([], params.user_set)[0],
        "why": why,
        "ranking": choice["ranking"],
        "candidates": [
            {
                "name": name,
                "set": layers[name][0],
                "replaced_by_user_set": layers[name][1],
                "merge": {
                    "method": candidate.merge.method,
                    "hyperparameters": merges[merge_key(candidate.merge)]["hyperparameters"],
                },
                "repair": candidate.repair_method,
                "eligible": name not in barred,
                "mean": choice["means"][name],
                "tasks": scores[name],
                "merge_seconds": merges[merge_key(candidate.merge)]["seconds"],
                "repair_seconds": costs[name]["repair_seconds"],
            }
            for name, candidate in candidates.items()
        ],
    }
    write_json(steps.paths["selection"], record)
    log.info("select (%s): %s", settings.score, record["why"])
    return record


def select_step(steps: Steps) -> dict:
    """The select step for `steps`: score select:'s candidates, choose, write selection.json;
    from then on `steps` run the winner's params. A rerun chooses afresh from the params as
    asked for."""
    from featcal.tracking.runs import step_run

    steps.params, steps.selection = steps.requested, None
    record = select(steps, step_run)
    steps.apply_selection()
    return record
