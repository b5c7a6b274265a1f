"""What a record claims is what happened: a set drawn from fewer
rows than asked for (`select.holdout_per_task`, `featcal.num_per_task`) holds every row there
is, its record and the select step's `selection.json` give the count actually used beside the
one requested, the log warns once per task naming the task and both counts, and the printed
choice and the accuracy table say the counts their numbers are on.

Tiny synthetic data (tests/test_pipeline.py's `write_params`: 20 train rows per task, 8 of them
in the calibration set) and the select step with its merges, repairs and scores stubbed: only
the held-out draw and the record are real.
"""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
import yaml
from test_pipeline import write_params

import featcal.flows.selection as selection  # (imports Prefect, which sets up its logging, first)
from featcal.flows.steps import Steps
from featcal.flows.summary import accuracy_table, selection_summary
from featcal.flows.variants import merge_key
from featcal.tasks.calibration_sets import build_calibration_sets
from featcal.tasks.selection import build_selection_sets
from featcal_core.data.calibration_data import load_calibration_set
from featcal_core.params import load_params

TRAIN_ROWS, NUM_PER_TASK = 20, 8  # write_params: 20 train rows per task, featcal.num_per_task 8
LEFT = TRAIN_ROWS - NUM_PER_TASK


def _params(tmp_path, holdout):
    path = write_params(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["select"] = {
        "holdout_per_task": holdout,
        "candidates": [
            {"name": "plain", "set": ["repair.method=none"]},
            {"name": "featcal", "set": []},
        ],
    }
    path.write_text(yaml.safe_dump(data))
    return load_params(path)


def _warnings(caplog, needle: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and needle in r.getMessage()
    ]


def _select(params, monkeypatch):
    """The select step on `params` with the candidates' merges, repairs and scores stubbed (the
    held-out sets are drawn for real); returns (the record, selection.json as written)."""
    steps = Steps(params)
    build_calibration_sets.fn(params, "image", str(steps.paths["calibration_sets"]))

    def merges(steps, sources, step_run):
        return {
            merge_key(p.merge): {"path": "merged", "hyperparameters": {}, "seconds": 0.0}
            for _, p in sources
        }

    def scores(steps, variants, merges, costs, holdout, score="agreement"):
        sets = build_selection_sets.fn(
            params,
            "image",
            str(steps.paths["calibration_sets"]),
            str(steps.paths["selection_sets"]),
            holdout,
        )
        found = {
            name: {
                t: {"agreement": 50.0 + i, "drift": 0.1, "kl": 0.1, "examples": sets[t]["n_rows"]}
                for t in sets
            }
            for i, name in enumerate(variants)
        }
        return sets, found

    monkeypatch.setattr(selection, "run_merges", merges)
    monkeypatch.setattr(selection, "shared_steps", lambda *args: None)
    monkeypatch.setattr(selection, "check_scorable", lambda steps: None)  # no locked models here
    monkeypatch.setattr(selection, "repair", lambda steps: {"repair_seconds": 0.0})
    monkeypatch.setattr(selection, "score_held_out", scores)
    record = selection.select(steps, lambda *args, **kwargs: contextlib.nullcontext())
    return record, json.loads(steps.paths["selection"].read_text())


def test_holdout_larger_than_the_rows_left_is_recorded_warned_and_printed(
    tmp_path, caplog, monkeypatch
):
    """The issue's case: holdout_per_task 100 with 12 train rows left per task. Before: the log
    and selection.json said 100, each held-out set held 12, and nothing warned."""
    caplog.set_level(logging.INFO)
    record, written = _select(_params(tmp_path, 100), monkeypatch)
    assert written == record
    assert record["holdout_per_task"] == 100  # requested
    assert record["held_out"] == {"alpha": LEFT, "beta": LEFT}  # used
    for task in ("alpha", "beta"):
        held = json.loads(
            (tmp_path / "results" / "selection_sets" / task / "calibration_set.json").read_text()
        )
        assert (held["n_requested"], held["n_rows"]) == (100, LEFT)
        warned = _warnings(caplog, f"task {task!r}: select.holdout_per_task")
        assert warned == [
            f"task {task!r}: select.holdout_per_task is 100 but only {LEFT} of its "
            f"{TRAIN_ROWS} rows are left besides the calibration set "
            f"({held['source']}), so the set holds {LEFT} rows, not 100"
        ]
    counts = f"held-out unlabeled inputs alpha {LEFT}, beta {LEFT} (100 requested per task"
    assert counts in record["why"]
    assert any(counts in r.getMessage() for r in caplog.records)  # the step's log line
    printed = selection_summary(record)  # what `featcal run` prints, and the report's section
    assert f"score: agreement with the experts (%) on {counts}" in printed
    assert f"why: {record['why']}" in printed
    assert f"alpha (n={LEFT})" in printed and f"beta (n={LEFT})" in printed
    assert "100 held-out" not in printed


def test_holdout_that_fits_is_said_as_before(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    record, _ = _select(_params(tmp_path, 5), monkeypatch)
    assert record["held_out"] == {"alpha": 5, "beta": 5}
    assert not _warnings(caplog, "select.holdout_per_task")
    assert "requested" not in record["why"]
    printed = selection_summary(record)
    assert "on 5 held-out unlabeled inputs per task (label-free)" in printed
    assert "(n=" not in printed


def test_a_selection_record_without_held_out_counts_still_prints():
    """A selection.json written before `held_out` existed: the requested count, as it said."""
    from featcal_core.report.selection import selection_lines, selection_table

    record = {
        "winner": "a",
        "set": [],
        "score": "agreement",
        "higher_is_better": True,
        "holdout_per_task": 7,
        "why": "a: best",
        "ranking": ["a"],
        "candidates": [
            {
                "name": "a",
                "merge": {"method": "ties"},
                "repair": "none",
                "mean": 50.0,
                "tasks": {"t": {"agreement": 50.0}},
                "merge_seconds": 1.0,
                "repair_seconds": 1.0,
            }
        ],
    }
    assert "on 7 held-out unlabeled inputs per task" in selection_lines(record)[1]
    assert selection_table(record)[0][5] == "t"


def test_calibration_set_larger_than_the_source_is_recorded_and_warned(tmp_path, caplog):
    """featcal.num_per_task above the rows a task has: calibration_set.json records both counts
    and the log warns once per task (the calibration record's inputs already list the rows
    used: `rows` and `indices`)."""
    params = load_params(write_params(tmp_path), ["featcal.num_per_task=50"])
    caplog.set_level(logging.INFO)
    records = build_calibration_sets.fn(params, "image", str(tmp_path / "sets"))
    for task, record in records.items():
        assert (record["n_requested"], record["n_rows"]) == (50, TRAIN_ROWS)
        on_disk = json.loads((tmp_path / "sets" / task / "calibration_set.json").read_text())
        assert (on_disk["n_requested"], on_disk["n_rows"]) == (50, TRAIN_ROWS)
        assert _warnings(caplog, f"task {task!r}: featcal.num_per_task") == [
            f"task {task!r}: featcal.num_per_task is 50 but it has only {TRAIN_ROWS} rows "
            f"({record['source']}), so the set holds {TRAIN_ROWS} rows, not 50"
        ]
    # loading a set for more rows than it holds: said once, by the draw when the set's record
    # says it was drawn short for this count, else at the load (`featcal calibrate --calib`)
    caplog.clear()
    load_calibration_set("alpha", tmp_path / "sets" / "alpha", "image", 50, 1)
    assert not _warnings(caplog, "num_per_task")
    load_calibration_set("alpha", tmp_path / "sets" / "alpha", "image", 64, 1)
    assert _warnings(caplog, "num_per_task") == [
        f"task 'alpha': num_per_task is 64 but the calibration set {tmp_path / 'sets' / 'alpha'} "
        f"holds only {TRAIN_ROWS} rows; all {TRAIN_ROWS} are used (the record's calibration "
        "inputs list them)"
    ]


def _row(accuracy: float, examples: int) -> dict:
    return {"accuracy": accuracy, "loss": 1.0, "examples": examples, "normalized": 1.0}


@pytest.mark.parametrize(
    ("examples", "said"),
    [
        ({"mnist": 50, "svhn": 50}, "50 rows per task"),
        ({"mnist": 50, "svhn": 30}, "mnist 50, svhn 30 rows"),
    ],
)
def test_accuracy_table_and_report_say_the_rows_evaluated(tmp_path, examples, said):
    """evaluation.max_examples_per_task cuts each task's evaluation split: evaluation.json's
    `examples` records the rows used, and the printed table's header and the report say them."""
    from featcal_core.report import write_report

    evaluation = {
        task: {"expert": _row(0.9, n), "merged": _row(0.5, n), "calibrated": _row(0.7, n)}
        for task, n in examples.items()
    }
    assert accuracy_table(evaluation).splitlines()[0] == (
        f"accuracy (%) on the evaluation split ({said})"
    )
    paths = write_report(
        tmp_path / "report",
        run_name="r",
        evaluation=evaluation,
        calibration=None,
        merge=None,
        lock=None,
    )
    assert f"evaluated on {said} of the evaluation split" in paths["report.md"].read_text()
    assert f"evaluated on {said} of the evaluation split" in paths["report.html"].read_text()
