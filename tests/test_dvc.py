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

import yaml
from test_pipeline import write_params

from featcal_core.params import dump, load_params

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
        "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }  # fmt: skip


def _sh(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, args
    return proc.stdout + proc.stderr


def test_dvc_repro_then_nothing_then_push_pull(tmp_path, prefect_api):
    repo = tmp_path / "repo"
    repo.mkdir()
    env = _env(tmp_path, prefect_api)
    draft = write_params(tmp_path)  # the tiny zero-shot CLIP setting of test_pipeline
    params = yaml.safe_load(draft.read_text())
    params["run"].update(name="dvc-test", results_dir="data/results")
    params["tracking"] = {"enabled": False}
    draft.write_text(yaml.safe_dump(params))
    (repo / "params.yaml").write_text(dump(load_params(draft)))  # every section, defaults filled
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    _sh(["git", "init", "-q"], repo, env)
    _sh(["dvc", "init", "-q"], repo, env)
    _sh(["dvc", "remote", "add", "-d", "store", str(tmp_path / "remote")], repo, env)

    first = _sh(["dvc", "repro"], repo, env)
    for stage in ("zoo", "download", "calib-set", "merge", "calibrate", "evaluate", "report"):
        assert f"Running stage '{stage}'" in first, first[-3000:]
    results = repo / "data" / "results"
    evaluation = json.loads((results / "evaluation.json").read_text())
    assert set(evaluation) == {"alpha", "beta"}
    assert (repo / "reports" / "dvc-test" / "report.html").is_file()
    assert (results / "calibrated" / "featcal.json").is_file()

    second = _sh(["dvc", "repro"], repo, env)
    assert "Running stage" not in second

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
    assert "Running stage" not in changed

    # compare runs: commit this one, change an evaluation-only value, re-run; only the
    # evaluation stages run again, and `dvc params diff` / `dvc metrics diff` show the change
    _sh(["git", "add", "-A"], repo, env)
    _sh(["git", "commit", "-qm", "first run"], repo, env)
    text = (repo / "params.yaml").read_text()
    assert "max_examples_per_task: null" in text
    (repo / "params.yaml").write_text(
        text.replace("max_examples_per_task: null", "max_examples_per_task: 4")
    )
    params_diff = _sh(["dvc", "params", "diff"], repo, env)
    assert "evaluation.max_examples_per_task" in params_diff and "4" in params_diff
    rerun = _sh(["dvc", "repro"], repo, env)
    assert "Running stage 'evaluate'" in rerun and "Running stage 'report'" in rerun
    for stage in ("zoo", "download", "calib-set", "merge", "calibrate"):
        assert f"Running stage '{stage}'" not in rerun
    metrics_diff = _sh(["dvc", "metrics", "diff", "--all"], repo, env)
    assert "alpha.expert.examples" in metrics_diff, metrics_diff
    assert "10" in metrics_diff and "4" in metrics_diff
