"""`featcal run` of a tiny Llama merge and FeatCal whose evaluation goes through lm-evaluation-harness
on a local task: its numbers in evaluation.json, report.md, metrics.json, the MLflow run (a real
local store) and the model card are lm-eval's on the same checkpoints; `featcal check` names an
unknown lm-eval task before any work."""

from __future__ import annotations

import json

import datasets
import pytest
import yaml

import factories
from factories import TINY_LLAMA, lm_eval_tasks
from featcal_core.data.synthetic import build_pool
from featcal_core.evaluation.harness import HarnessRun, score_model

LABEL_WORDS = ["good", "bad", "fun"]


def _labelled(path, rows: list[dict]):
    """The task's evaluation source (featcal's params ask for one; lm-eval reads its own rows)."""
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=LABEL_WORDS)}
    )
    columns = {"text": [r["text"] for r in rows], "label": [r["label"] for r in rows]}
    test = datasets.Dataset.from_dict(columns, features=features)
    datasets.DatasetDict({"test": test}).save_to_disk(str(path))
    return path


def _params(tmp_path, harness: dict) -> tuple:
    pool = build_pool(tmp_path / "pool", "llama", TINY_LLAMA, ("alpha", "beta"))
    rows = lm_eval_tasks(tmp_path / "lm_tasks", LABEL_WORDS)
    evaluation = _labelled(tmp_path / "labelled", rows)
    params = {
        "run": {"name": "harness", "results_dir": str(tmp_path / "results")},
        "models": {"base": str(pool.base), "experts": {t: str(p) for t, p in pool.experts.items()}},
        "tasks": {
            task: {
                "calibration": {"path": str(pool.calib[task])},
                "evaluation": {"path": str(evaluation), "split": "test"},
            }
            for task in pool.experts
        },
        "featcal": {"num_per_task": 12, "batch_size": 4, "device": "cpu"},
        "evaluation": {"harness": {"include_path": str(tmp_path / "lm_tasks"), **harness}},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path, pool


def test_featcal_run_scores_with_lm_eval(tmp_path, prefect_api, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    path, pool = _params(tmp_path, {"tasks": ["toy_choice"], "batch_size": 5})
    proc = factories.run_featcal(tmp_path, path, prefect_api)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = tmp_path / "results"
    evaluation = json.loads((results / "evaluation.json").read_text())
    assert list(evaluation) == ["toy_choice"]
    row = evaluation["toy_choice"]
    assert list(row) == ["base", "expert", "merged", "calibrated"]
    assert {r["metric"] for r in row.values()} == {"acc"}
    assert {r["examples"] for r in row.values()} == {16}
    assert row["expert"]["expert_task"] in ("alpha", "beta")
    # the rows are lm-eval's numbers on the same checkpoints, with the same settings
    precision = row["calibrated"]["precision"]
    run = HarnessRun(
        tasks=("toy_choice",),
        batch_size=5,
        include_path=str(tmp_path / "lm_tasks"),
        precision=precision,
    )
    for name in ("calibrated", "merged"):
        again = score_model(results / name, pool.base, run)["toy_choice"]
        assert row[name]["accuracy"] == again["accuracy"]
        assert row[name]["stderr"] == again["stderr"]
    expert = row["expert"]
    assert row["expert"]["normalized"] == 1.0
    calibrated = row["calibrated"]["accuracy"]
    assert row["calibrated"]["normalized"] == pytest.approx(calibrated / expert["accuracy"])

    metrics = json.loads((results / "metrics.json").read_text())
    assert metrics["accuracy_mean/calibrated"] == calibrated
    assert metrics["tasks"] == 1 and metrics["examples_min"] == 16
    per_task = json.loads((results / "metrics_per_task.json").read_text())
    assert per_task["toy_choice"]["calibrated"]["accuracy"] == calibrated

    report = (tmp_path / "reports" / "harness" / "report.md").read_text()
    assert f"{100 * calibrated:.1f}" in report
    assert "scored by lm-eval 0.4." in report and "toy_choice acc (0-shot, 16 rows)" in report

    card = (results / "calibrated" / "README.md").read_text()
    assert "toy_choice" in card and f"{100 * calibrated:.1f}" in card

    import mlflow

    provenance = json.loads((results / "provenance.json").read_text())
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = provenance["mlflow_run_id"]
    logged = client.get_metric_history(run_id, "accuracy/toy_choice/calibrated")
    assert [m.value for m in logged] == [calibrated]
    stderr = client.get_metric_history(run_id, "stderr/toy_choice/calibrated")
    assert [m.value for m in stderr] == [pytest.approx(row["calibrated"]["stderr"])]
    assert client.get_run(run_id).data.metrics["accuracy_mean/calibrated"] == calibrated
    params = client.get_run(run_id).data.params
    assert params["evaluation.harness.tasks"] == '["toy_choice"]'


def test_check_names_an_unknown_lm_eval_task(tmp_path, capsys):
    """Before any work: a task lm-eval does not know (its registry and include_path searched)."""
    from featcal_cli.main import main

    path, _ = _params(tmp_path, {"tasks": ["toy_choice", "no_such_task"]})
    capsys.readouterr()
    assert main(["check", "--params", str(path)]) == 2
    errors = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("featcal: error:")
    ]
    assert len(errors) == 1, errors
    assert errors[0].startswith(
        "featcal: error: evaluation.harness.tasks: lm-eval knows no task 'no_such_task'"
    )
    assert not (tmp_path / "results").exists()
