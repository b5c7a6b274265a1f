"""The DVC stages (dvc.yaml) in a temporary git repository: `dvc repro` runs every stage, a second
`dvc repro` runs none, and `dvc push` / `dvc pull` round-trip the checkpoints through a local
remote."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_pipeline import write_params

from featcal_cli.main import main
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
    draft = write_params(tmp_path)  # the tiny zero-shot CLIP setting of test_pipeline
    params = yaml.safe_load(draft.read_text())
    params["run"].update(name="dvc-test", results_dir="data/results")
    params["tracking"] = {"enabled": False}
    draft.write_text(yaml.safe_dump(params))
    # every section, defaults filled: what dvc.yaml's stages read (`featcal params export` in
    # the repository, run in this process: the stages below start `featcal` many times)
    monkeypatch.chdir(repo)
    assert main(["params", "export", "--params", str(draft)]) == 0
    assert load_params(repo / "params.yaml") == load_params(draft)
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    _sh(["git", "init", "-q"], repo, env)
    _sh(["dvc", "init", "-q"], repo, env)
    _sh(["dvc", "remote", "add", "-d", "store", str(tmp_path / "remote")], repo, env)

    first = _sh(["dvc", "repro"], repo, env)
    for stage in STAGES:
        assert f"Running stage '{stage}'" in first, first[-3000:]
    assert (repo / "data" / "code" / "calibrate.sha256").is_file()
    results = repo / "data" / "results"
    evaluation = json.loads((results / "evaluation.json").read_text())
    assert set(evaluation) == {"alpha", "beta"}
    assert (repo / "reports" / "dvc-test" / "report.html").is_file()
    assert (results / "calibrated" / "featcal.json").is_file()

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
    for entry in (clone / "data" / "results").iterdir():  # what git holds of the DVC outs only
        if entry not in outs and entry.name != ".gitignore":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    _sh(["dvc", "pull"], clone, env)
    assert (clone / "data" / "results" / "merged" / "model.safetensors").read_bytes() == merged
    forced = _sh(["dvc", "repro", "-f", "-s", "evaluate"], clone, env)  # a stage writes there
    assert _ran(forced) == ["evaluate"], forced[-3000:]
    _sh(["featcal", "run", "--params", "params.yaml"], clone, env)  # and so does every step
    pulled = json.loads((clone / "data" / "results" / "evaluation.json").read_text())
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
    assert "examples_min" in metrics_diff, metrics_diff  # the headline says the cut
    assert "10" in metrics_diff and "4" in metrics_diff

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
    found = [exp for exp in _experiments(shown) if exp.get("name") == "alpha-half"]
    assert found, shown
    data = found[0]["data"]
    assert data["params"]["params.yaml"]["data"]["featcal"]["alpha"] == 0.5
    metrics = data["metrics"]["data/results/metrics_per_task.json"]["data"]
    assert 0.0 <= metrics["alpha"]["calibrated"]["accuracy"] <= 1.0
    headline = data["metrics"]["data/results/metrics.json"]["data"]  # the headline figures
    tasks = metrics.values()
    mean = sum(row["calibrated"]["accuracy"] for row in tasks) / len(tasks)
    assert headline["accuracy_mean/calibrated"] == pytest.approx(mean)
    normalized = sum(row["calibrated"]["normalized"] for row in tasks) / len(tasks)
    assert headline["normalized_mean/calibrated"] == pytest.approx(normalized)
    assert headline["tasks"] == 2 and headline["normalized_mean_tasks/calibrated"] == 2
    assert "data/results/evaluation.json" not in data["metrics"]  # an out, not a metric


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
