"""One definition per reported figure (featcal_core/report/figures.py): the headline a run prints,
report.md, metrics.json, the MLflow run and the model card show the same normalized accuracy
average and gap closed under the same labels; a task whose expert scores 0 is left out of them
the same way everywhere, with the count of tasks used beside the figure, and never gives NaN."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import test_pipeline  # its write_params: the tiny CLIP pool of its end-to-end run
import yaml

from featcal.flows.summary import accuracy_table
from featcal_core.provenance.model_card import render_model_card
from featcal_core.report import write_report
from featcal_core.report.figures import (
    LABELS,
    headline_lines,
    headline_metrics,
    per_task_metrics,
    summary_figures,
)

NORMALIZED, GAP = LABELS["normalized"], LABELS["gap_closed"]


def _strict(text: str) -> dict:
    """JSON without NaN or infinities (json.loads accepts them by default)."""

    def refuse(constant):
        raise AssertionError(f"{constant} in strict JSON")

    return json.loads(text, parse_constant=refuse)


def _shown(text: str, row: str = "calibrated") -> dict[str, tuple[str, str]]:
    """{label: (value as shown, the tasks it is over)} of `row` in the headline lines of a text
    (a line of its own, or a markdown bullet)."""
    found = {}
    for line in text.splitlines():
        line = line.removeprefix("- ")
        for label in (NORMALIZED, GAP):
            match = re.match(rf"{re.escape(label)} \((over [^)]*)\): (.*)$", line)
            if match:
                value = re.search(rf"(?:^|, ){row} (—|-?\d+\.\d)", match.group(2))
                assert value is not None, line
                found[label] = (value.group(1), match.group(1))
    return found


def _as_shown(value: float | None, percent: bool) -> str:
    return "—" if value is None else f"{value * (100 if percent else 1):.1f}"


def _row(expert, merged, calibrated):
    def result(accuracy):
        return {"accuracy": accuracy, "loss": 1.0, "examples": 10}

    return {"expert": result(expert), "merged": result(merged), "calibrated": result(calibrated)}


def test_an_expert_at_zero_is_left_out_of_every_surface_the_same_way(tmp_path, monkeypatch):
    """beta's expert scores 0: normalized accuracy and gap closed are over alpha only, say so
    ("over 1 of 2 tasks; left out: beta, the expert scores 0") and are the same number on the
    printed table, report.md, metrics.json, the MLflow metrics and the model card; no NaN."""
    evaluation = {"alpha": _row(0.9, 0.5, 0.7), "beta": _row(0.0, 0.6, 0.8)}
    figures = summary_figures(evaluation)
    normalized, gap = figures.normalized["calibrated"], figures.gap_closed["calibrated"]
    assert normalized.value == pytest.approx(0.7 / 0.9) and gap.value == pytest.approx(50.0)
    assert (normalized.used, normalized.of) == (gap.used, gap.of) == (1, 2)
    assert normalized.left_out == gap.left_out == (("beta", "the expert scores 0"),)
    assert figures.accuracy["calibrated"].value == pytest.approx(0.75)  # every task has it
    over = "over 1 of 2 tasks; left out: beta, the expert scores 0"
    lines = headline_lines(figures)
    assert f"{NORMALIZED} ({over}): merged 55.6 %, calibrated 77.8 %" in lines
    assert f"{GAP} ({over}): calibrated 50.0 %" in lines

    metrics = _strict(json.dumps(headline_metrics(figures)))
    assert metrics["normalized_mean/calibrated"] == pytest.approx(0.7 / 0.9)
    assert metrics["gap_closed_mean/calibrated"] == pytest.approx(50.0)
    assert (
        metrics["normalized_mean_tasks/calibrated"] == metrics["gap_closed_mean_tasks/calibrated"]
    )
    assert metrics["normalized_mean_tasks/calibrated"] == 1 and metrics["tasks"] == 2
    per_task = _strict(json.dumps(per_task_metrics(figures)))
    assert per_task["beta"]["calibrated"] == {"accuracy": 0.8}  # no ratio to an expert at 0

    # the surfaces, each from the same figures
    printed = accuracy_table(evaluation)
    report = write_report(
        tmp_path / "report",
        run_name="zero",
        evaluation=evaluation,
        calibration=None,
        merge=None,
        lock=None,
    )["report.md"].read_text(encoding="utf-8")
    card = render_model_card(
        title="zero", recipe={"featcal": {"alpha": 0.3}}, inputs={}, evaluation=evaluation
    )
    expected = {NORMALIZED: ("77.8", over), GAP: ("50.0", over)}
    for name, text in (("printed", printed), ("report.md", report), ("card", card)):
        assert _shown(text) == expected, name
        assert "nan" not in text.lower(), name

    # the MLflow metrics: the same numbers as metrics.json, no NaN
    from featcal.tracking import log as tracking_log

    logged: dict[str, float] = {}
    monkeypatch.setattr(
        tracking_log, "run_target", lambda run_id: (type("S", (), {"uri": "sqlite://"}), "run")
    )
    monkeypatch.setattr(tracking_log, "batch_metrics", lambda c, r, m: logged.update(m))
    tracking_log.log_evaluation(evaluation)
    assert all(math.isfinite(v) for v in logged.values())
    assert {k: logged[k] for k in metrics} == pytest.approx(metrics)
    assert "normalized/beta/calibrated" not in logged and "gap_closed/beta/calibrated" not in logged

    # evaluation.json's own per-task ratio: null, not NaN
    from featcal.tasks.evaluate import _normalize

    row = _normalize("beta", {k: dict(v) for k, v in evaluation["beta"].items()})
    assert row["calibrated"]["normalized"] is None


def test_no_task_defines_a_figure_gives_no_value_and_says_why():
    """Every expert at 0: no normalized average or gap closed at all, the count 0 beside it."""
    figures = summary_figures({"alpha": _row(0.0, 0.5, 0.7)})
    metrics = _strict(json.dumps(headline_metrics(figures)))
    assert (
        "normalized_mean/calibrated" not in metrics and "gap_closed_mean/calibrated" not in metrics
    )
    assert (
        metrics["normalized_mean_tasks/calibrated"]
        == metrics["gap_closed_mean_tasks/calibrated"]
        == 0
    )
    assert f"{GAP} (over 0 of 1 task; left out: alpha, the expert scores 0): calibrated — " in (
        "\n".join(headline_lines(figures))
    )
    # the merged model at the expert on average: no gap to close, named as such
    flat = summary_figures({"alpha": _row(0.6, 0.7, 0.8), "beta": _row(0.8, 0.7, 0.75)})
    assert flat.gap_closed["calibrated"].value is None
    assert "no gap: merged matches or beats the experts on average" in "\n".join(
        headline_lines(flat)
    )


#: the data seed of each task: the experts score 42 % and 17 % and the merged model below them on
#: average, so the mean of the ratios (the normalized average) differs from the ratio of the
#: means and gap closed has a gap to measure
SEEDS = {"alpha": 2, "beta": 1}


def _bert_params(tmp_path):
    """params.yaml for test_pipeline's BERT pool: experts with their own (differing) heads, so
    the expert and merged accuracies differ; no head calibration."""
    base, experts = test_pipeline._bert_with_heads(tmp_path)
    params = {
        "run": {"name": "figures", "results_dir": str(tmp_path / "results")},
        "models": {"base": str(base), "experts": {t: str(p) for t, p in experts.items()}},
        "tasks": {
            task: {
                "calibration": {"path": str(data), "split": "train"},
                "evaluation": {"path": str(data), "split": "test"},
            }
            for task in experts
            for data in [test_pipeline._labelled_texts(tmp_path / f"text_{task}", SEEDS[task])]
        },
        "featcal": {"num_per_task": 12, "batch_size": 4},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def test_one_run_shows_one_headline_on_every_surface(tmp_path, prefect_api):
    """A real `featcal run` (test_pipeline's tiny BERT pool): the normalized accuracy average and the
    gap closed read from the printed summary, report.md, metrics.json, the MLflow run (SQLite
    store) and the calibrated checkpoint's model card are the same; metrics.json holds numbers
    only, its per-task detail is metrics_per_task.json, and `featcal lineage` verifies both."""
    params_path = _bert_params(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MLFLOW_TRACKING_URI": uri,
        "PREFECT_API_URL": prefect_api,
    }
    cmd = [sys.executable, "-m", "featcal_cli.main", "run", "--params", str(params_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = tmp_path / "results"

    metrics = _strict((results / "metrics.json").read_text())
    assert all(isinstance(v, int | float) for v in metrics.values()), metrics
    per_task = _strict((results / "metrics_per_task.json").read_text())
    assert set(per_task) == {"alpha", "beta"}
    evaluation = json.loads((results / "evaluation.json").read_text())
    assert metrics == pytest.approx(headline_metrics(summary_figures(evaluation)))
    normalized = metrics["normalized_mean/calibrated"]  # the experts score above 0
    gap = metrics["gap_closed_mean/calibrated"]  # the merged model is below the experts
    ratios = [per_task[t]["calibrated"]["normalized"] for t in per_task]
    assert normalized == pytest.approx(sum(ratios) / len(ratios))  # the mean of the ratios ...
    means = [metrics[f"accuracy_mean/{m}"] for m in ("calibrated", "expert")]
    assert abs(normalized - means[0] / means[1]) > 0.05  # ... not the ratio of the means
    expected = {
        NORMALIZED: (
            _as_shown(normalized, percent=True),
            f"over {metrics['normalized_mean_tasks/calibrated']} tasks",
        ),
        GAP: (
            _as_shown(gap, percent=False),
            f"over {metrics['gap_closed_mean_tasks/calibrated']} tasks",
        ),
    }

    import mlflow

    client = mlflow.MlflowClient(uri)
    run_id = json.loads((results / "provenance.json").read_text())["mlflow_run_id"]
    logged = client.get_run(run_id).data.metrics
    assert all(math.isfinite(v) for v in logged.values())
    for key, value in metrics.items():
        assert logged[key] == pytest.approx(value, rel=1e-12, abs=0), key

    surfaces = {
        "stdout": proc.stdout,
        "report.md": (tmp_path / "reports" / "figures" / "report.md").read_text(encoding="utf-8"),
        "model card": (results / "calibrated" / "README.md").read_text(encoding="utf-8"),
    }
    for name, text in surfaces.items():
        assert _shown(text) == expected, name

    # the per-task table's average row shows the same normalized average
    average = next(line for line in proc.stdout.splitlines() if line.startswith("average"))
    assert expected[NORMALIZED][0] in average.split()

    from featcal_core.io.markers import read_marker

    listed = read_marker(results)["files"]
    assert {"metrics.json", "metrics_per_task.json", "evaluation.json"} <= set(listed)
    lineage = subprocess.run(
        [
            sys.executable,
            "-m",
            "featcal_cli.main",
            "lineage",
            str(results / "calibrated"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert lineage.returncode == 0, lineage.stderr[-2000:]
    assert json.loads(lineage.stdout)["problems"] == []
