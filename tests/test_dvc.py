"""The DVC stages (dvc.yaml) in a temporary git repository laid out as this one (its dvc.yaml,
.gitignore and params.yaml, on tiny models): `dvc repro` runs every stage, a second `dvc repro`
runs none, `dvc push` / `dvc pull` round-trip the checkpoints through a local remote, git versions
the metrics (`dvc metrics diff` reads HEAD, `dvc exp show` each experiment's), and the report stage
writes the calibrated model's card with its results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard
from test_pipeline import write_params

from featcal_cli.main import main
from featcal_core.io.outputs import verify_output
from featcal_core.params import load_params

ROOT = Path(__file__).resolve().parent.parent


def _env(tmp_path: Path, api_url: str) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "DVC_NO_ANALYTICS": "1",
        # auto's float32 outcome on any host (test_compare forces the bfloat16 one)
        "FEATCAL_CPU_BFLOAT16": "0",
        "DVC_SITE_CACHE_DIR": str(tmp_path / "dvc-site"),
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }


def _sh(args: list[str], cwd: Path, env: dict[str, str], stdout_only: bool = False) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, args
    return proc.stdout if stdout_only else proc.stdout + proc.stderr


def test_dvc_repro_then_nothing_then_push_pull(tmp_path, prefect_api, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    env = _env(tmp_path, prefect_api)
    # this repository's params.yaml (its results folder and run name, every section) on the tiny
    # zero-shot CLIP setting of test_pipeline: its models, tasks and calibration size, no head
    # calibration, no zoo to build, no candidates to choose among, no MLflow
    tiny = yaml.safe_load(write_params(tmp_path).read_text())
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params.update(zoo=None, select=None, models=tiny["models"], tasks=tiny["tasks"])
    params["featcal"].update(tiny["featcal"], heads=False)
    params["tracking"]["enabled"] = False
    draft = tmp_path / "draft.yaml"
    draft.write_text(yaml.safe_dump(params))
    results_dir = params["run"]["results_dir"]  # data/results/<run name>, as .gitignore expects
    metrics_file, per_task_file = (
        f"{results_dir}/metrics.json",
        f"{results_dir}/metrics_per_task.json",
    )
    # every section, defaults filled: what dvc.yaml's stages read (`featcal params export` in
    # the repository, run in this process: the stages below start `featcal` many times)
    monkeypatch.chdir(repo)
    assert main(["params", "export", "--params", str(draft)]) == 0
    assert load_params(repo / "params.yaml") == load_params(draft)
    for name in ("dvc.yaml", ".gitignore"):
        shutil.copy(ROOT / name, repo / name)
    _sh(["git", "init", "-q"], repo, env)
    _sh(["dvc", "init", "-q"], repo, env)
    _sh(["dvc", "remote", "add", "-d", "store", str(tmp_path / "remote")], repo, env)

    first = _sh(["dvc", "repro"], repo, env)
    for stage in STAGES:
        assert f"Running stage '{stage}'" in first, first[-3000:]
    assert (repo / "data" / "code" / "calibrate.sha256").is_file()
    results = repo / results_dir
    evaluation = json.loads((results / "evaluation.json").read_text())
    assert set(evaluation) == {"alpha", "beta"}
    report = repo / "reports" / params["run"]["name"]
    assert (report / "report.html").is_file()
    assert (results / "calibrated" / "featcal.json").is_file()
    # the calibrated model's card with its results: the report stage's model_card.md (the card
    # in calibrated/ is the calibrate stage's output, written before the evaluation)
    card = ModelCard.load(report / "model_card.md")
    scores = {(r.dataset_name, r.metric_name): r.metric_value for r in card.data.eval_results}
    for task, row in evaluation.items():
        assert scores[(task, "accuracy (calibrated)")] == pytest.approx(
            row["calibrated"]["accuracy"]
        )
    assert "## Evaluation results" in card.text
    assert "## Evaluation results" not in (results / "calibrated" / "README.md").read_text()
    assert verify_output(report) is None and verify_output(results / "calibrated") is None
    # git versions the records the stages write uncached, the metrics among them
    untracked = _sh(["git", "status", "--porcelain", "-uall"], repo, env, stdout_only=True)
    versioned = ("metrics.json", "metrics_per_task.json", "evaluation.json", "plots/accuracy.csv")
    for name in (*versioned, "evaluation_datasets.json"):
        assert f"?? {results_dir}/{name}" in untracked, untracked
    assert "?? data/code/calibrate.sha256" in untracked  # the code digests the stages depend on
    assert f"{results_dir}/merged" not in untracked and "reports/" not in untracked

    second = _sh(["dvc", "repro"], repo, env)
    assert _ran(second) == ["code"]  # always runs; its digests unchanged, so nothing else

    merged = (results / "merged" / "model.safetensors").read_bytes()
    _sh(["dvc", "push"], repo, env)
    shutil.rmtree(results / "merged")
    shutil.rmtree(results / "calibration_sets")
    shutil.rmtree(repo / "data" / "models" / "open_clip")  # open_clip imports (none here)
    shutil.rmtree(repo / ".dvc" / "cache")
    _sh(["dvc", "pull"], repo, env)
    assert (results / "merged" / "model.safetensors").read_bytes() == merged
    assert (results / "calibration_sets" / "alpha" / "calibration_set.json").is_file()
    assert (repo / "data" / "models" / "open_clip").is_dir()

    changed = _sh(["dvc", "repro", "--dry"], repo, env)  # nothing to do after the pull
    assert _ran(changed) == ["code"]

    # compare runs: commit this one, change an evaluation-only value, re-run; only the
    # evaluation stages run again, and `dvc params diff` / `dvc metrics diff` show the change
    _sh(["git", "add", "-A"], repo, env)
    _sh(["git", "commit", "-qm", "first run"], repo, env)

    # a colleague's clone: the DVC outputs only (from git the uncached ones, then `dvc pull`),
    # without featcal's root marker and run lock (no DVC output holds them): the results folder
    # is adopted because every entry matches dvc.lock; every stage then runs on it, and so does
    # `featcal run`
    _sh(["dvc", "push"], repo, env)
    clone = tmp_path / "clone"
    _sh(["git", "clone", "-q", str(repo), str(clone)], tmp_path, env)
    lock = yaml.safe_load((clone / "dvc.lock").read_text())
    outs = {clone / out["path"] for stage in lock["stages"].values() for out in stage["outs"]}
    for entry in (clone / results_dir).iterdir():  # what git holds of the DVC outs only
        if entry not in outs and entry.name != ".gitignore":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    _sh(["dvc", "pull"], clone, env)
    assert (clone / results_dir / "merged" / "model.safetensors").read_bytes() == merged
    # up to date as pulled: every output is in git or the DVC cache (the scratch the select and
    # calibrate stages keep between runs is no output), so only the always-run code stage runs
    status = _json_out(_sh(["dvc", "status", "--json"], clone, env, stdout_only=True))
    assert set(status) <= {"code"}, status
    dry = _sh(["dvc", "repro", "--dry"], clone, env)
    assert _ran(dry) == ["code"], dry[-3000:]
    forced = _sh(["dvc", "repro", "-f", "-s", "evaluate"], clone, env)  # a stage writes there
    assert _ran(forced) == ["evaluate"], forced[-3000:]
    _sh(["featcal", "run", "--params", "params.yaml"], clone, env)  # and so does every step
    pulled = json.loads((clone / results_dir / "evaluation.json").read_text())
    assert pulled == json.loads((results / "evaluation.json").read_text())
    text = (repo / "params.yaml").read_text()
    assert "max_examples_per_task: null" in text
    (repo / "params.yaml").write_text(
        text.replace("max_examples_per_task: null", "max_examples_per_task: 4")
    )
    params_diff = _sh(["dvc", "params", "diff"], repo, env)
    assert "evaluation.max_examples_per_task" in params_diff and "4" in params_diff
    rerun = _sh(["dvc", "repro"], repo, env)
    assert _ran(rerun) == ["code", "evaluate", "report"]
    metrics_diff = _sh(["dvc", "metrics", "diff", "--all"], repo, env)
    assert "failed to load" not in metrics_diff, metrics_diff  # HEAD's metrics, from git
    assert "examples_min" in metrics_diff, metrics_diff  # the headline says the cut
    cut = _json_out(_sh(["dvc", "metrics", "diff", "--json"], repo, env, stdout_only=True))
    assert cut[metrics_file]["examples_min"] == {"old": 10, "new": 4, "diff": -6}

    # the plots render from the report step's data
    plots = _json_out(_sh(["dvc", "plots", "show", "--json"], repo, env, stdout_only=True))
    plots = plots.get("data", plots)
    assert {"accuracy per task", "drift per block"} <= set(plots), str(plots)[:3000]
    accuracy = (results / "plots" / "accuracy.csv").read_text().splitlines()
    assert accuracy[0].startswith("task,") and len(accuracy) == 3
    drift = (results / "plots" / "drift.csv").read_text().splitlines()
    assert drift[0].startswith("block,drift_before_mean,drift_after_mean") and len(drift) == 3

    # an experiment: one FeatCal param changed reruns calibrate on (not the calibration sets,
    # which depend on featcal.num_per_task only), and `dvc exp show` lists it
    _sh(["git", "add", "-A"], repo, env)
    _sh(["git", "commit", "-qm", "second run"], repo, env)
    experiment = _sh(
        ["dvc", "exp", "run", "-S", "featcal.alpha=0.5", "-n", "alpha-half"], repo, env
    )
    # (select reruns on any featcal change; without select: its record stays the same)
    assert _ran(experiment) == ["code", "select", "calibrate", "evaluate", "report"]
    shown = _json_out(_sh(["dvc", "exp", "show", "--json"], repo, env, stdout_only=True))
    rows = _experiments(shown)  # the workspace, the commit it ran on and the experiment
    assert len(rows) == 3, shown
    for row in rows:  # each with its mean accuracy (`dvc exp show` prints "!" for one it lacks)
        found_metrics = row["data"].get("metrics", {}).get(metrics_file, {})
        assert 0.0 <= found_metrics.get("data", {}).get("accuracy_mean/calibrated", -1) <= 1.0, row
    found = [exp for exp in rows if exp.get("name") == "alpha-half"]
    assert found, shown
    data = found[0]["data"]
    assert data["params"]["params.yaml"]["data"]["featcal"]["alpha"] == 0.5
    metrics = data["metrics"][per_task_file]["data"]
    assert 0.0 <= metrics["alpha"]["calibrated"]["accuracy"] <= 1.0
    headline = data["metrics"][metrics_file]["data"]  # the headline figures
    tasks = metrics.values()
    mean = sum(row["calibrated"]["accuracy"] for row in tasks) / len(tasks)
    assert headline["accuracy_mean/calibrated"] == pytest.approx(mean)
    normalized = sum(row["calibrated"]["normalized"] for row in tasks) / len(tasks)
    assert headline["normalized_mean/calibrated"] == pytest.approx(normalized)
    assert headline["tasks"] == 2 and headline["normalized_mean_tasks/calibrated"] == 2
    assert f"{results_dir}/evaluation.json" not in data["metrics"]  # an out, not a metric
    # the experiment's commit holds its metrics (git versions them)
    committed = _sh(["git", "show", f"{found[0]['rev']}:{metrics_file}"], repo, env, True)
    assert json.loads(committed) == headline


STAGES = (
    "code",
    "zoo",
    "download",
    "calib-set",
    "select",
    "merge",
    "calibrate",
    "evaluate",
    "report",
)


def _ran(output: str) -> list[str]:
    """The stages a `dvc repro` / `dvc exp run` output says it ran, in pipeline order."""
    return [stage for stage in STAGES if f"Running stage '{stage}'" in output]


def _json_out(output: str):
    """The JSON document in a DVC command's output (which may log lines before it)."""
    start = min(i for i in (output.find("{"), output.find("[")) if i >= 0)
    return json.loads(output[start:])


def _experiments(shown) -> list[dict]:
    """Every experiment record in `dvc exp show --json`'s output (its shape differs by version)."""
    found = []

    def visit(node):
        if isinstance(node, dict):
            if "data" in node and isinstance(node["data"], dict) and "params" in node["data"]:
                found.append(node)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(shown)
    return found
