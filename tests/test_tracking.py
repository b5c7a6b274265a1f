"""MLflow tracking helpers (featcal.tracking) against a local SQLite store in tmp_path."""

import json
import mmap
import re
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from featcal.tracking import log as tracking_log
from featcal.tracking import runs as tracking
from featcal.tracking.log import (
    log_artifacts,
    log_calibration_record,
    log_datasets,
    log_evaluation,
    log_model,
)
from featcal.tracking.runs import parent_run, step_run
from featcal.tracking.store import artifact_root, ensure_experiment, git_commit, tracking_uri
from featcal_core.params import Params, TrackingSettings, flatten, load_params

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("mnist", "svhn")


@pytest.fixture(autouse=True)
def _no_tracking_env(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def make_params(tmp_path: Path, **sections) -> Params:
    data = {
        "run": {"name": "demo"},
        "models": {
            "base": "openai/clip-vit-base-patch32",
            "experts": {task: f"./zoo/{task}" for task in TASKS},
        },
        "tasks": {
            task: {
                "calibration": {"hub": f"tanganke/{task}", "split": "train"},
                "evaluation": {"hub": f"tanganke/{task}", "split": "test"},
            }
            for task in TASKS
        },
        "tracking": {"experiment": "featcal-test"},
    }
    data.update(sections)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return load_params(path)


def fake_record(num_blocks: int = 3) -> dict:
    """A calibration record shaped like featcal_core.method.calibration's featcal.json."""
    digest = "0" * 64
    return {
        "featcal_record_version": 1,
        "architecture": "clip-vit",
        "hyperparameters": {
            "alpha": 0.25,
            "rho": 2.2,
            "lam": 0.05,
            "eps": 1e-8,
            "num_per_task": 4,
            "batch_size": 2,
            "seed": 0,
            "device": "cpu",
            "max_length": 128,
            "pooling": None,
            "pooled_position": 0,
        },
        "inputs": {
            "base": {"path": "/m/base", "sha256": {"model.safetensors": digest}},
            "merged": {"path": "/m/merged", "sha256": {"model.safetensors": digest}},
            "experts": {
                t: {"path": f"/m/{t}", "sha256": {"model.safetensors": digest}} for t in TASKS
            },
            "calibration": {
                t: {"path": f"/d/{t}", "sha256": digest, "rows": 10, "indices": [0, 3, 5, 7]}
                for t in TASKS
            },
        },
        "blocks": [
            {
                "index": i,
                "seconds": 0.5 + i,
                "restored": i == 0,
                "drift_before": {"mnist": 1.0 + i, "svhn": 3.0 + i},
                "drift_after": {"mnist": 0.1 * (i + 1), "svhn": 0.3 * (i + 1)},
            }
            for i in range(num_blocks)
        ],
        "wall_seconds": 12.5,
        "peak_rss_bytes": 300 * 1024 * 1024,
        "peak_device_bytes": 0,
    }


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


# ------------------------------------------------------------------------------------ locations


def test_tracking_uri_default_and_settings(tmp_path):
    default = tracking_uri(TrackingSettings(), tmp_path)
    assert default == f"sqlite:///{tmp_path.resolve()}/mlruns/mlflow.db"
    assert default.startswith("sqlite:////")
    assert artifact_root(default, tmp_path) == (tmp_path.resolve() / "mlruns/artifacts").as_uri()

    given = TrackingSettings(mlflow_tracking_uri="http://tracking.example:5000")
    assert tracking_uri(given, tmp_path) == "http://tracking.example:5000"
    assert artifact_root("http://tracking.example:5000", tmp_path) is None

    relative = TrackingSettings(mlflow_tracking_uri="sqlite:///store/runs.db")
    uri = tracking_uri(relative, tmp_path)
    assert uri == f"sqlite:///{tmp_path.resolve()}/store/runs.db"
    assert artifact_root(uri, tmp_path) == (tmp_path.resolve() / "store/artifacts").as_uri()


def test_env_var_wins(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    env_uri = f"sqlite:///{tmp_path.resolve()}/env/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env_uri)
    settings_uri = f"sqlite:///{tmp_path.resolve()}/settings/mlflow.db"
    params = make_params(
        tmp_path, tracking={"experiment": "e", "mlflow_tracking_uri": settings_uri}
    )
    assert tracking_uri(params.tracking, tmp_path) == env_uri

    with parent_run(params, run_name="env", project_root=tmp_path) as run:
        run_id = run.info.run_id
    client = MlflowClient(env_uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    experiment = client.get_experiment_by_name("e")
    assert experiment.artifact_location == (tmp_path.resolve() / "env/artifacts").as_uri()
    assert not (tmp_path / "settings").exists()
    assert not (tmp_path / "mlruns").exists()


def test_ensure_experiment_idempotent_and_restores(tmp_path):
    from mlflow import MlflowClient

    uri = tracking_uri(TrackingSettings(), tmp_path)
    location = tmp_path / "mlruns" / "artifacts"
    first = ensure_experiment("x", uri, location)
    assert ensure_experiment("x", uri, location) == first
    client = MlflowClient(uri)
    assert client.get_experiment(first).artifact_location == location.resolve().as_uri()
    client.delete_experiment(first)
    assert ensure_experiment("x", uri, location) == first
    assert client.get_experiment(first).lifecycle_stage == "active"


def test_git_commit():
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    commit, dirty = git_commit(ROOT)
    if done.returncode == 0:
        assert commit == done.stdout.strip()
        assert dirty in (True, False)
    else:
        assert (commit, dirty) == ("unknown", None)


# ----------------------------------------------------------------------------------------- runs


def test_parent_steps_and_record(tmp_path):
    from mlflow import MlflowClient

    params = make_params(tmp_path)
    long_prompt = "n" * 7000 + " {text}"  # a value longer than MLflow's 6000 characters
    task = next(iter(params.tasks))
    params = params.model_copy(
        update={
            "tasks": {
                **params.tasks,
                task: params.tasks[task].model_copy(update={"prompt": long_prompt}),
            }
        }
    )
    record = fake_record()
    report = tmp_path / "report.md"
    report.write_text("# report\n")
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "drift.txt").write_text("plot\n")
    tags = {
        "dvc.lock_sha256": "ab" * 32,
        "prefect.flow_run_id": "flow-run-1",
        "models.base.revision": "main",
        "long": "t" * 9000,
        "skipped": None,
    }

    with parent_run(params, run_name="pipeline", tags=tags, project_root=tmp_path) as run:
        parent_id = run.info.run_id
        with step_run("merge") as merge:
            merge_id = merge.info.run_id
        with step_run("calibrate") as calibrate:
            calibrate_id = calibrate.info.run_id
            log_calibration_record(record)
        in_thread = {}

        def worker():
            with step_run("evaluate") as step:
                in_thread["id"] = step.info.run_id

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        log_artifacts([report, plots])

    uri = tracking_uri(params.tracking, tmp_path)
    assert (tmp_path / "mlruns" / "mlflow.db").is_file()
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("featcal-test")
    assert experiment.artifact_location == (tmp_path.resolve() / "mlruns/artifacts").as_uri()
    assert len(client.search_runs([experiment.experiment_id])) == 4

    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    assert parent.info.run_name == "pipeline"
    flat = flatten(params)
    assert set(flat) <= set(parent.data.params)
    assert parent.data.params["featcal.alpha"] == "0.25"
    assert parent.data.params["models.experts.svhn"] == "./zoo/svhn"
    truncated = parent.data.params[f"tasks.{task}.prompt"]
    assert len(truncated) == 6000 and truncated.startswith("nnn") and "sha256" in truncated

    commit = parent.data.tags["git_commit"]
    assert commit == "unknown" or re.fullmatch(r"[0-9a-f]{40}", commit)
    assert parent.data.tags["mlflow.source.git.commit"] == commit
    assert parent.data.tags["dvc.lock_sha256"] == "ab" * 32
    assert parent.data.tags["prefect.flow_run_id"] == "flow-run-1"
    assert parent.data.tags["models.base.revision"] == "main"
    assert len(parent.data.tags["long"]) == 8000
    assert "skipped" not in parent.data.tags

    for step_id, name in (
        (merge_id, "merge"),
        (calibrate_id, "calibrate"),
        (in_thread["id"], "evaluate"),
    ):
        step = client.get_run(step_id)
        assert step.info.run_name == name
        assert step.info.status == "FINISHED"
        assert step.data.tags["mlflow.parentRunId"] == parent_id
        assert step.data.metrics["duration_s"] >= 0
        assert step.data.metrics["peak_rss_mb"] > 0

    # the record goes to the parent run
    for task in TASKS:
        before = history(client, parent_id, f"drift_before/{task}")
        after = history(client, parent_id, f"drift_after/{task}")
        assert before == [(b["index"], b["drift_before"][task]) for b in record["blocks"]]
        assert after == [
            (b["index"], pytest.approx(b["drift_after"][task])) for b in record["blocks"]
        ]
    assert history(client, parent_id, "drift_before_mean") == [(0, 2.0), (1, 3.0), (2, 4.0)]
    assert [s for s, _ in history(client, parent_id, "drift_after_mean")] == [0, 1, 2]
    assert history(client, parent_id, "block_seconds") == [(0, 0.5), (1, 1.5), (2, 2.5)]
    metrics = parent.data.metrics
    assert metrics["calibrated_blocks_restored"] == 1
    assert metrics["calibrated_blocks"] == 3
    assert metrics["calibration_wall_s"] == 12.5
    assert metrics["peak_rss_mb"] == 300
    assert not [key for key in parent.data.params if key.startswith("calibration.")]  # once
    assert parent.data.tags["calibration.architecture"] == "clip-vit"
    assert re.fullmatch(r"[0-9a-f]{64}", parent.data.tags["calibration.inputs_sha256"])

    artifacts = {a.path for a in client.list_artifacts(parent_id)}
    assert {"featcal.json", "report.md", "plots"} <= artifacts
    assert [a.path for a in client.list_artifacts(parent_id, "plots")] == ["plots/drift.txt"]
    local = client.download_artifacts(parent_id, "featcal.json", str(tmp_path / "down"))
    assert json.loads(Path(local).read_text()) == record
    assert Path(local).is_relative_to(tmp_path)


def test_step_peak_memory_is_the_steps_own(tmp_path):
    """Each step run's peak_rss_mb is the peak during that step, not the process's high-water
    mark: a step allocating 400 MB shows it, the small step after it does not."""
    from mlflow import MlflowClient

    from featcal_core.memory import reset_peak_rss

    if not reset_peak_rss():
        pytest.skip("this OS cannot restart the peak-RSS count")
    params = make_params(tmp_path)
    with parent_run(params, run_name="memory", project_root=tmp_path):
        with step_run("big") as big:
            # an anonymous mapping, unmapped on close: its pages surely leave the resident set
            # (heap memory may stay resident after it is freed, and the next step would count it)
            region = mmap.mmap(-1, 400 * 1024 * 1024)
            for offset in range(0, len(region), 4096):
                region[offset] = 1  # touch every page
            region.close()
        with step_run("small") as small:
            pass
    client = MlflowClient(tracking_uri(params.tracking, tmp_path))
    big_peak = client.get_run(big.info.run_id).data.metrics["peak_rss_mb"]
    small_run = client.get_run(small.info.run_id)
    assert small_run.data.tags["featcal.peak_rss"] == "step"
    assert big_peak - small_run.data.metrics["peak_rss_mb"] > 300


def test_gap_closed_datasets_and_model_are_logged(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    params = make_params(tmp_path)
    table = {
        "a": {
            "expert": _acc(0.9, 1.0),
            "merged": _acc(0.5, 0.5 / 0.9),
            "calibrated": _acc(0.7, 0.7 / 0.9),
        },
        "b": {"expert": _acc(0.8, 1.0), "merged": _acc(0.4, 0.5), "calibrated": _acc(0.4, 0.5)},
    }
    data = tmp_path / "calib_a"
    data.mkdir()
    (data / "rows.arrow").write_bytes(b"rows")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "README.md").write_text("card\n")
    with parent_run(params, run_name="results", project_root=tmp_path) as run:
        log_evaluation(table)
        log_datasets(
            [
                {
                    "name": "calibration/a",
                    "context": "calibration",
                    "path": data,
                    "sha256": "c" * 64,
                    "split": "train",
                }
            ]
        )
        assert log_model(model, artifact_path="calibrated_model")
    client = MlflowClient(tracking_uri(params.tracking, tmp_path))
    logged = client.get_run(run.info.run_id)
    metrics = logged.data.metrics
    assert metrics["gap_closed/a/calibrated"] == pytest.approx(50.0)
    assert metrics["gap_closed/b/calibrated"] == pytest.approx(0.0)
    assert metrics["gap_closed_mean/calibrated"] == pytest.approx(25.0)
    assert "gap_closed/a/merged" not in metrics and "gap_closed/a/expert" not in metrics
    (found,) = logged.inputs.dataset_inputs
    assert found.dataset.name == "calibration/a" and found.dataset.digest == "c" * 32
    assert data.resolve().as_uri() in found.dataset.source
    tags = {tag.key: tag.value for tag in found.tags}
    assert tags == {"mlflow.data.context": "calibration", "sha256": "c" * 64, "split": "train"}
    files = {a.path for a in client.list_artifacts(run.info.run_id, "calibrated_model")}
    assert files == {"calibrated_model/model.safetensors", "calibrated_model/README.md"}
    assert logged.data.tags["model.logged"] == "true"

    # tracking.log_model false (and auto above the limit): the card, a reference, no weights
    (model / "sub").mkdir()
    (model / "sub" / "config.json").write_text("{}")
    for weights, because in ((False, "tracking.log_model: false"), ("auto", "MiB (auto)")):
        if weights == "auto":
            monkeypatch.setattr(tracking_log, "MODEL_ARTIFACT_LIMIT", 6)  # 7 bytes of weights
        with parent_run(params, run_name=f"no-weights-{weights}", project_root=tmp_path) as run:
            assert not log_model(model, artifact_path="m", weights=weights)
        tags = client.get_run(run.info.run_id).data.tags
        assert tags["model.logged"] == "false" and because in tags["model.not_logged_because"]
        assert tags["model.reference"] == str(model.resolve())
        listed = {a.path for a in client.list_artifacts(run.info.run_id, "m")}
        assert listed == {"m/README.md", "m/sub"}, listed
        assert [a.path for a in client.list_artifacts(run.info.run_id, "m/sub")] == [
            "m/sub/config.json"
        ]


def _acc(accuracy, normalized):
    return {"accuracy": accuracy, "loss": 1.0, "examples": 10, "normalized": normalized}


def test_failures_are_recorded_and_release_the_parent(tmp_path):
    from mlflow import MlflowClient

    params = make_params(tmp_path)
    with pytest.raises(ValueError, match="boom"):
        with parent_run(params, run_name="failing", project_root=tmp_path) as run:
            parent_id = run.info.run_id
            with step_run("broken") as step:
                step_id = step.info.run_id
                raise ValueError("boom")
    assert tracking._session is None
    client = MlflowClient(tracking_uri(params.tracking, tmp_path))
    assert client.get_run(parent_id).info.status == "FAILED"
    failed = client.get_run(step_id)
    assert failed.info.status == "FAILED"
    assert "duration_s" in failed.data.metrics

    with parent_run(params, run_name="again", project_root=tmp_path) as run:  # not blocked
        with pytest.raises(RuntimeError, match="already open"):
            with parent_run(params, project_root=tmp_path):
                pass
        with pytest.raises(FileNotFoundError):
            log_artifacts(tmp_path / "missing.md")
    assert client.get_run(run.info.run_id).info.status == "FINISHED"


def test_disabled_tracking_logs_nothing(tmp_path):
    import mlflow

    params = make_params(tmp_path, tracking={"enabled": False})
    with parent_run(params, run_name="off", project_root=tmp_path) as run:
        assert run is None
        with step_run("merge") as step:
            assert step is None
            log_calibration_record(fake_record())
            log_artifacts([tmp_path / "missing.md"])
    assert mlflow.active_run() is None
    assert not (tmp_path / "mlruns").exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "params.yaml"]


def test_no_parent_run_is_a_no_op(tmp_path):
    with step_run("alone") as step:
        assert step is None
    log_calibration_record(fake_record())
    log_artifacts([tmp_path / "missing.md"])
    assert list(tmp_path.iterdir()) == []
