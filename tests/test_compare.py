"""`featcal compare` end to end on tiny checkpoints: real Prefect flow (subflow per variant, on
the tests' shared server), real MLflow store. The download and calibration sets run once, each
distinct merge once, every variant's repair in its own subflow; the comparison report and one
MLflow child run per variant hold the numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from test_pipeline import write_params

VARIANTS = [
    {"name": "ta", "set": ["repair.method=none"]},
    {"name": "ta-featcal", "set": []},
    {"name": "ta-regmean", "set": ["repair.method=regmean"]},
    {"name": "ties-featcal", "set": ["merge.method=ties", "featcal.alpha=0.5"]},
    {"name": "ta-surgery", "set": ["repair.method=surgery", "repair.surgery_steps=30"]},
    {"name": "ta-adamerging", "set": ["repair.method=adamerging", "repair.adamerging_steps=5"]},
    {"name": "ta-featcal-n12", "set": ["featcal.num_per_task=12"]},  # the params say 8
    {"name": "ta-featcal-heads", "set": ["featcal.heads=true"]},  # + head calibration
    {"name": "ta-heads", "set": ["repair.method=none", "featcal.heads=true"]},
]


def _compare_params(tmp_path):
    path = write_params(tmp_path)
    params = yaml.safe_load(path.read_text())
    params["run"]["name"] = "cmp"
    params["compare"] = {"variants": VARIANTS}
    path.write_text(yaml.safe_dump(params))
    return path


def test_compare_shares_steps_and_reports_every_variant(tmp_path, prefect_api):
    params_path = _compare_params(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MLFLOW_TRACKING_URI": uri,
        "PREFECT_API_URL": prefect_api,
        # the evaluation store: a second compare of the same file evaluates nothing again
        "FEATCAL_EVALUATION_CACHE": str(tmp_path / "evaluations.sqlite"),
        # auto's bfloat16 outcome on any host (test_dvc forces the float32 one): the records of
        # two compares are equal byte for byte whichever way the machine decides
        "FEATCAL_CPU_BFLOAT16": "1",
    }
    cmd = [sys.executable, "-m", "featcal_cli.main", "compare", "--params", str(params_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "| `ties-featcal` |" in proc.stdout
        and "comparison:  reports/cmp-compare/compare.md" in proc.stdout
    )

    report = tmp_path / "reports" / "cmp-compare"
    record = json.loads((report / "compare.json").read_text())
    assert [v["name"] for v in record["variants"]] == [v["name"] for v in VARIANTS]
    assert len(record["merges"]) == 2  # task arithmetic (the params' own) and TIES
    assert (report / "accuracy_vs_cost.png").read_bytes()[:4] == b"\x89PNG"
    rows = {v["name"]: v for v in record["variants"]}
    evaluation = record["evaluation"]
    for task in ("alpha", "beta"):  # the merge-only variant is the reference merge's row
        merged = 100 * evaluation[task]["merged"]["accuracy"]
        assert rows["ta"]["tasks"][task]["accuracy"] == pytest.approx(merged)
        calibrated = 100 * evaluation[task]["ta-featcal"]["accuracy"]
        assert rows["ta-featcal"]["tasks"][task]["accuracy"] == pytest.approx(calibrated)
    assert rows["ta"]["repair"] == "none" and rows["ta-regmean"]["repair"] == "regmean"
    assert rows["ties-featcal"]["merge"]["method"] == "ties"
    for name in (
        "ta-featcal",
        "ta-regmean",
        "ties-featcal",
        "ta-surgery",
        "ta-adamerging",
        "ta-featcal-n12",
    ):
        assert rows[name]["cost"]["repair_seconds"] > 0 and rows[name]["cost"]["peak_rss_mb"] > 0
    results = tmp_path / "results"
    assert (results / "variants" / "ta-featcal" / "calibrated" / "featcal.json").is_file()
    assert (results / "variants" / "ta-regmean" / "calibrated" / "regmean.json").is_file()
    featcal = json.loads(
        (results / "variants" / "ties-featcal" / "calibrated" / "featcal.json").read_text()
    )
    assert featcal["hyperparameters"]["alpha"] == 0.5
    # the shared sets hold the largest count (12); the params' own 8 is a seeded sample of them
    shared = json.loads(
        (results / "calibration_sets" / "alpha" / "calibration_set.json").read_text()
    )
    assert shared["n_requested"] == shared["n_rows"] == 12
    for name, count in (("ta-featcal", 8), ("ties-featcal", 8), ("ta-featcal-n12", 12)):
        calibration = json.loads(
            (results / "variants" / name / "calibrated" / "featcal.json").read_text()
        )
        assert calibration["hyperparameters"]["num_per_task"] == count
        for used in calibration["inputs"]["calibration"].values():
            assert used["rows"] == 12 and len(used["indices"]) == count
    assert not (results / "variants" / "ta" / "calibrated").exists()
    surgery = json.loads(
        (results / "variants" / "ta-surgery" / "calibrated" / "alpha" / "surgery.json").read_text()
    )
    assert surgery["rank"] == 16 and rows["ta-surgery"]["repair"] == "surgery"
    assert "ta-surgery" in evaluation["alpha"]  # the merge under the task's module
    adamerging = json.loads(
        (results / "variants" / "ta-adamerging" / "calibrated" / "adamerging.json").read_text()
    )
    assert (
        adamerging["hyperparameters"]["steps"] == 5
        and rows["ta-adamerging"]["repair"] == "adamerging"
    )
    assert set(adamerging["coefficients"]) == {"alpha", "beta"}
    assert "ta-adamerging" in evaluation["alpha"] and "ta-adamerging" in evaluation["beta"]
    # head calibration, as `featcal run` does it: the variant's model under its refit heads
    # (the merge's, without a repair); not scored label-free (the scores read the tasks' heads)
    for name, model in (("ta-featcal-heads", "ta-featcal-heads"), ("ta-heads", "merged")):
        for task in ("alpha", "beta"):
            refit = evaluation[task][f"{model}_heads"]["accuracy"]
            assert rows[name]["tasks"][task]["accuracy"] == pytest.approx(100 * refit)
        assert rows[name].get("label_free") is None
    refit = results / "variants" / "ta-featcal-heads"
    assert (refit / "refit_heads" / "calibrated" / "alpha").is_dir()
    assert (refit / "calibrated" / "heads.safetensors").is_file()  # they travel with it
    assert (results / "variants" / "ta-heads" / "refit_heads" / "merged" / "beta").is_dir()
    assert not (results / "variants" / "ta-featcal" / "refit_heads").exists()
    # label-free scores of every other variant on held-out inputs, and how they rank against test
    for row in (r for r in rows.values() if not r["name"].endswith("heads")):
        scores = row["label_free"]
        assert 0 <= scores["agreement"] <= 100 and scores["drift"] >= 0
        assert scores["agreement"] == pytest.approx(
            sum(scores["tasks"][t]["agreement"] for t in ("alpha", "beta")) / 2
        )
    assert record["label_free"]["agreement"]["choice"] in rows
    assert "Spearman ρ" in (report / "compare.md").read_text()
    # `featcal lineage` verifies the comparison: traced through the results folder it names
    from featcal_core.provenance.lineage import check

    traced = check(report)
    assert traced["kind"] == "results" and traced["chain"]["results_dir"] == str(results.resolve())

    _check_prefect(prefect_api, record)
    _check_mlflow(uri, record)

    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    total = sum(len(row) for row in evaluation.values())
    assert (
        f"evaluation: {total} of {total} rows reused from the evaluation store" in again.stderr
    ), again.stderr[-4000:]
    reran = json.loads((report / "compare.json").read_text())
    assert reran["evaluation"] == evaluation
    for repair, variant in (
        ("regmean", "ta-regmean"),
        ("surgery", "ta-surgery"),
        ("adamerging", "ta-adamerging"),
    ):  # the one-go repairs: made from the same inputs, so reused
        out = results / "variants" / variant / "calibrated"
        assert f"{repair}: {out} was made from these inputs; reused (verified)" in again.stderr
        # its cost is what it cost when it ran (the first compare's, less its checks), not the
        # reuse's
        recorded = json.loads((out / "repair_inputs.json").read_text())["cost"]
        second = {v["name"]: v for v in reran["variants"]}[variant]["cost"]
        assert (
            recorded["seconds"]
            <= second["repair_seconds"]
            <= rows[variant]["cost"]["repair_seconds"]
        )
        assert second["peak_rss_mb"] >= recorded["peak_rss_mb"] > 0


def _check_prefect(api_url: str, record: dict) -> None:
    """One `merge` task run per distinct merge, one `featcal-variant` subflow per variant."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )
    from prefect.settings import PREFECT_API_URL, temporary_settings

    flow_run_id = record["prefect_flow_run_id"]
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        with get_client(sync_client=True) as client:
            tasks = client.read_task_runs(
                task_run_filter=TaskRunFilter(
                    flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id])
                )
            )
            subflows = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])
                )
            )
    merges = [t for t in tasks if t.name.startswith("merge")]
    assert len(merges) == len(record["merges"]) == 2, [t.name for t in tasks]
    assert sorted(f.name for f in subflows) == sorted(v["name"] for v in VARIANTS)


def _check_mlflow(uri: str, record: dict) -> None:
    import mlflow

    client = mlflow.MlflowClient(uri)
    parent = client.get_run(record["mlflow_run_id"])
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_name = {c.data.tags["mlflow.runName"]: c for c in children}
    for variant in record["variants"]:
        metrics = by_name[variant["name"]].data.metrics
        assert metrics["accuracy_mean"] == pytest.approx(variant["mean"]["accuracy"])
        assert metrics["total_seconds"] == pytest.approx(variant["cost"]["total_seconds"])
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "compare")}
    assert "compare/compare.md" in logged
