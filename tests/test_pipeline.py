"""`featcal run` end to end on tiny local checkpoints: real Prefect flow (on the tests' shared
local Prefect server; test_zoo runs the whole flow on Prefect's embedded server), real MLflow
SQLite store; download (local references) → calibration sets → merge → calibrate → evaluate →
report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import datasets
import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

import factories
from featcal_cli.main import main
from featcal_core.data.synthetic import WORDS


def _labelled_images(path, seed, rows=(20, 10)):
    rng = np.random.default_rng(seed)
    splits = {}
    for split, count in zip(("train", "test"), rows, strict=True):
        images = [
            Image.fromarray(rng.integers(0, 256, (36, 36, 3), dtype=np.uint8)) for _ in range(count)
        ]
        labels = [int(x) for x in rng.integers(0, 3, size=count)]
        data = datasets.Dataset.from_dict({"image": images, "label": labels})
        splits[split] = data.cast_column("image", datasets.Image())
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


def write_params(tmp_path):
    """params.yaml for the paper's layout in miniature: a full CLIPModel base, CLIPVisionModel
    experts in the transformers 4.x layout, zero-shot heads from the base's text tower."""
    base = factories.tiny_clip_model(tmp_path / "base")
    experts = factories.vision_experts(base, tmp_path, ("alpha", "beta"))
    params = {
        "run": {"name": "e2e", "results_dir": str(tmp_path / "results"), "seed": 1},
        "models": {"base": str(base), "experts": {t: str(p) for t, p in experts.items()}},
        "tasks": {
            task: {
                "calibration": {"path": str(data), "split": "train"},
                "evaluation": {"path": str(data), "split": "test"},
                "class_names": ["cat", "dog", "bird"],
                "templates": ["a photo of a {}.", "a {}."],
            }
            for i, task in enumerate(experts)
            for data in [_labelled_images(tmp_path / f"data_{task}", seed=i)]
        },
        "merge": {"method": "task_arithmetic", "hyperparameters": {"scale": 0.3}},
        "featcal": {"num_per_task": 8, "batch_size": 4},
    }
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump(params))
    return params_path


def test_featcal_run_end_to_end(tmp_path, prefect_api, capsys):
    params_path = write_params(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MLFLOW_TRACKING_URI": uri,
        "PREFECT_API_URL": prefect_api,
    }
    cmd = [
        sys.executable,
        "-m",
        "featcal_cli.main",
        "run",
        "--params",
        str(params_path),
        "--set",
        "featcal.alpha=0.3",
        "--json",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    results = tmp_path / "results"

    lock = json.loads((results / "models.lock.json").read_text())
    assert set(lock["experts"]) == {"alpha", "beta"} and lock["architecture"] == "hf-clip-vision"
    calib = json.loads(
        (results / "calibration_sets" / "alpha" / "calibration_set.json").read_text()
    )
    assert calib["n_rows"] == 8 and len(calib["row_ids"]) == 8
    merge = json.loads((results / "merged" / "merge.json").read_text())
    assert merge["method"] == "task_arithmetic" and merge["hyperparameters"] == {"scale": 0.3}
    record = json.loads((results / "calibrated" / "featcal.json").read_text())
    assert record["hyperparameters"]["alpha"] == 0.3
    assert [b["index"] for b in record["blocks"]] == [0, 1]
    assert summary["calibration"]["blocks"] == 2
    evaluation = json.loads((results / "evaluation.json").read_text())
    assert evaluation == summary["evaluation"]
    for task in ("alpha", "beta"):
        row = evaluation[task]
        assert set(row) == {"base", "expert", "merged", "calibrated"}
        assert all(r["examples"] == 10 for r in row.values())
        assert row["expert"]["normalized"] == 1.0
        assert (
            abs(row["merged"]["normalized"] * row["expert"]["accuracy"] - row["merged"]["accuracy"])
            < 1e-9
        )
        # evaluation.precision null: the forwards follow featcal.precision's choice
        ran = record["hyperparameters"]["precision"]
        assert {r["precision"] for r in row.values()} == {ran}
    assert (results / "heads").is_dir()
    report = tmp_path / "reports" / "e2e"
    assert summary["report"] == str(report / "report.html")
    markdown = (report / "report.md").read_text()
    calibrated = evaluation["alpha"]["calibrated"]["accuracy"]
    assert f"{100 * calibrated:.1f}" in markdown
    assert f"evaluation forwards in {record['hyperparameters']['precision']}" in markdown
    assert (report / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (report / "drift.png").is_file()
    card = (results / "calibrated" / "README.md").read_text()
    assert "featcal" in card and "0.3" in card
    provenance = json.loads((results / "provenance.json").read_text())
    assert provenance["mlflow_run_id"] == summary["mlflow_run_id"]
    capsys.readouterr()
    assert main(["lineage", str(results / "calibrated"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["problems"] == []

    # an evaluation-only change recomputes no block
    again = subprocess.run(
        [*cmd, "--set", "evaluation.batch_size=3", "--set", "evaluation.precision=float32"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    rerun = json.loads(again.stdout[again.stdout.index("{") :])
    assert rerun["calibration"]["restored"] == rerun["calibration"]["blocks"] == 2
    assert {r["precision"] for row in rerun["evaluation"].values() for r in row.values()} == {
        "float32"
    }
    # same models and data, another batch size (and float32 where the first ran bfloat16)
    exact = record["hyperparameters"]["precision"] == "float32"
    for task, row in evaluation.items():
        for model, result in row.items():
            again_result = rerun["evaluation"][task][model]
            moved = abs(again_result["accuracy"] - result["accuracy"])
            assert moved == 0 if exact else moved <= 1 / 10  # one of the 10 rows
            tolerance = 1e-5 if exact else 2e-2
            assert abs(again_result["loss"] - result["loss"]) < tolerance * max(1.0, result["loss"])

    import mlflow

    client = mlflow.MlflowClient(uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["featcal.alpha"] == "0.3"
    assert run.data.tags["prefect_flow_run_id"]
    assert run.data.tags["lock_digest"] == lock["lock_digest"]
    assert run.data.tags["expert.alpha.commit"] == "local"
    assert len(run.data.tags["calibration_set.alpha.sha256"]) == 64
    assert len(run.data.tags["merged.sha256"]) == 64
    accuracy = client.get_metric_history(run.info.run_id, "accuracy/alpha/calibrated")
    assert accuracy[-1].value == evaluation["alpha"]["calibrated"]["accuracy"]
    history = client.get_metric_history(run.info.run_id, "drift_after/alpha")
    assert [m.step for m in history] == [0, 1]
    assert abs(history[-1].value - record["blocks"][-1]["drift_after"]["alpha"]) < 1e-9
    children = client.search_runs(
        [run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'"
    )
    assert {c.data.tags["mlflow.runName"] for c in children} >= {
        "download-experts",
        "calibration-sets",
        "merge",
        "calibrate",
        "evaluate",
        "report",
    }
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "report")}
    assert "report/report.html" in logged and "report/drift.png" in logged
    assert not [key for key in run.data.params if key.startswith("calibration.")]  # once each
    from featcal_core.report import gap_closed

    for task, row in evaluation.items():  # logged wherever the task has a gap to close
        accuracy = {k: row[k]["accuracy"] for k in ("merged", "calibrated", "expert")}
        expected = gap_closed(accuracy["merged"], accuracy["calibrated"], accuracy["expert"])
        logged = client.get_metric_history(run.info.run_id, f"gap_closed/{task}/calibrated")
        assert [m.value for m in logged] == ([] if expected is None else [pytest.approx(expected)])
    inputs = {
        (i.dataset.name, {t.key: t.value for t in i.tags}["mlflow.data.context"])
        for i in run.inputs.dataset_inputs
    }
    assert inputs == {
        ("calibration/alpha", "calibration"),
        ("calibration/beta", "calibration"),
        ("evaluation/alpha", "evaluation"),
        ("evaluation/beta", "evaluation"),
    }
    (model,) = client.search_logged_models(  # the calibrated checkpoint as an MLflow Model
        experiment_ids=[run.info.experiment_id],
        filter_string=f"source_run_id = '{run.info.run_id}'",
    )
    assert model.name == "calibrated_model" and run.data.tags["model.id"] == model.model_id
    files = {a.path for a in client.list_logged_model_artifacts(model.model_id, "artifacts")}
    assert files == {"artifacts/calibrated"}  # the results' calibrated/ folder
    checkpoint = mlflow.pyfunc.load_model(model.artifact_location).unwrap_python_model()
    assert checkpoint.model.config.model_type == "clip"  # the base's full CLIPModel
    assert run.data.tags["params_digest"] == provenance["params_digest"]
    _check_prefect_run(prefect_api, provenance, evaluation)


def _check_prefect_run(api_url: str, provenance: dict, evaluation: dict) -> None:
    """The flow run, as the Prefect UI shows it: named after run.name and the params digest,
    with featcal's log lines and a markdown artifact holding the result table."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.settings import PREFECT_API_URL, temporary_settings

    run_id = provenance["prefect_flow_run_id"]
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        with get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(run_id)
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            artifacts = client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
            )
    assert flow_run.name == f"e2e-{provenance['params_digest'][:8]}"
    messages = [entry.message for entry in logs]
    assert any(m.startswith("block ") for m in messages), messages[:20]
    (artifact,) = [a for a in artifacts if a.type == "markdown"]
    assert artifact.key == "featcal-e2e"
    calibrated = 100 * evaluation["alpha"]["calibrated"]["accuracy"]
    assert f"{calibrated:.1f}" in artifact.data and "report.html" in artifact.data


@pytest.mark.parametrize("repair", ["surgery", "regmean"])
def test_featcal_run_with_a_baseline_repair(tmp_path, prefect_api, repair):
    """repair.method surgery / regmean: `featcal run` repairs with the baseline instead of FeatCal,
    evaluates it as the `calibrated` row and logs it (surgery: the merged checkpoint under each
    task's module)."""
    params_path = write_params(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MLFLOW_TRACKING_URI": uri,
        "PREFECT_API_URL": prefect_api,
    }
    cmd = [
        sys.executable,
        "-m",
        "featcal_cli.main",
        "run",
        "--params",
        str(params_path),
        "--set",
        f"repair.method={repair}",
        "--set",
        "repair.surgery_steps=20",
        "--json",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert summary["repair"]["method"] == repair and "calibration" not in summary
    calibrated = tmp_path / "results" / "calibrated"
    record = {
        "surgery": calibrated / "alpha" / "surgery.json",
        "regmean": calibrated / "regmean.json",
    }[repair]
    assert record.is_file() and not (calibrated / "featcal.json").exists()
    for row in summary["evaluation"].values():
        assert {"expert", "merged", "calibrated"} <= set(row)
    import mlflow

    client = mlflow.MlflowClient(uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["repair.method"] == repair
    if repair == "surgery":  # task modules: the run's artifacts
        assert client.list_artifacts(run.info.run_id, "surgery_modules")
    else:  # a checkpoint: an MLflow Model of the run
        assert run.data.tags["model.format"] == "mlflow_model"
        assert client.get_logged_model(run.data.tags["model.id"]).source_run_id == run.info.run_id


def test_invalid_params_fail_before_any_work(tmp_path):
    params_path = tmp_path / "params.yaml"
    params_path.write_text("run: {name: x}\nmodels: {base: ./nowhere}\nbogus: 1\n")
    cmd = [sys.executable, "-m", "featcal_cli.main", "run", "--params", str(params_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("featcal: error: ") and "params.yaml" in last


def _bert_with_heads(tmp_path):
    """A BertModel base (with its tokenizer) and BertForSequenceClassification experts (bert.* +
    classifier.*): the layout of encoder experts with task heads."""
    from transformers import BertConfig, BertForSequenceClassification

    pool = factories.bert_zoo(tmp_path / "pool", tasks=("alpha", "beta"), delta=0.02)
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    config = BertConfig.from_pretrained(
        pool.base, num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()}
    )
    experts = {}
    for i, (task, path) in enumerate(pool.experts.items()):
        torch.manual_seed(10 + i)
        model = BertForSequenceClassification(config)
        tower = load_file(str(path / "model.safetensors"))
        missing = model.bert.load_state_dict(tower, strict=False).missing_keys
        assert not [k for k in missing if "pooler" not in k]
        model.save_pretrained(tmp_path / f"head_{task}")
        experts[task] = tmp_path / f"head_{task}"
    return pool.base, experts


def _labelled_texts(path, seed, rows=(24, 12), targets=False):
    rng = np.random.default_rng(seed)
    splits = {}
    for split, count in zip(("train", "test"), rows, strict=True):
        texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 9)))) for _ in range(count)]
        labels = [int(x) for x in rng.integers(0, 3, size=count)]
        columns = {"text": texts, "label": labels}
        if targets:  # text-to-text targets (the T5 decoder's teacher-forced input)
            columns["target"] = [["good", "bad", "fun"][y] for y in labels]
        splits[split] = datasets.Dataset.from_dict(columns)
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


def test_featcal_run_bert_with_task_heads(tmp_path, prefect_api):
    """BERT experts with their own classification heads: the merge takes the encoders (heads
    ignored), calibration runs on the encoder, evaluation uses each expert's head."""
    base, experts = _bert_with_heads(tmp_path)
    params = {
        "run": {"name": "bert", "results_dir": str(tmp_path / "results")},
        "models": {"base": str(base), "experts": {t: str(p) for t, p in experts.items()}},
        "tasks": {
            task: {
                "calibration": {"path": str(data), "split": "train"},
                "evaluation": {"path": str(data), "split": "test"},
            }
            for i, task in enumerate(experts)
            for data in [_labelled_texts(tmp_path / f"text_{task}", seed=i)]
        },
        "featcal": {"num_per_task": 12, "batch_size": 4, "heads": True, "head_lam": 0.1},
    }
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump(params))
    proc = factories.run_featcal(tmp_path, params_path, prefect_api)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = tmp_path / "results"
    merged = load_file(str(results / "merged" / "model.safetensors"))
    assert not any(k.startswith(("classifier", "bert.")) for k in merged)  # the base's layout
    record = json.loads((results / "calibrated" / "featcal.json").read_text())
    assert record["architecture"] == "hf-bert" and len(record["blocks"]) == 2
    evaluation = json.loads((results / "evaluation.json").read_text())
    for task in experts:
        row = evaluation[task]
        # no zero-shot head: no base row; head calibration adds the refit-head rows
        assert set(row) == {"expert", "merged", "calibrated", "merged_heads", "calibrated_heads"}
        assert all(r["examples"] == 12 for r in row.values())
        assert row["expert"]["normalized"] == 1.0
        # the refit head is the closed form on the calibration rows: it differs from the expert's
        refit = load_file(
            str(results / "refit_heads" / "calibrated" / task / "classifier.safetensors")
        )
        expert_head = load_file(str(experts[task] / "model.safetensors"))
        assert refit["weight"].shape == expert_head["classifier.weight"].shape
        assert not torch.equal(refit["weight"], expert_head["classifier.weight"])
    report = (tmp_path / "reports" / "bert" / "report.md").read_text()
    assert "Head calibration (beyond the paper)" in report
    # the calibrated model's refit heads travel with it, with the experts' label names, and the
    # checkpoint still verifies; its card loads them from there
    from featcal_core.evaluation.linear_head import load_linear_head
    from featcal_core.evaluation.task_heads import load_task_heads
    from featcal_core.io.outputs import verify_output

    calibrated = results / "calibrated"
    travelling = load_task_heads(calibrated)
    assert set(travelling) == set(experts) and verify_output(calibrated) is None
    for task, head in travelling.items():
        assert head.labels == ["negative", "neutral", "positive"]
        refit = load_linear_head(results / "refit_heads" / "calibrated" / task)
        assert torch.equal(head.weight, refit.weight) and refit.labels == head.labels
    assert (
        'heads = load_file(folder / "heads.safetensors")' in (calibrated / "README.md").read_text()
    )


LANGUAGE_MODELS = {
    "llama": (
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ),
        "hf-llama",
        2,
    ),
    "t5": (
        dict(d_model=16, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=8),
        "hf-t5",
        4,
    ),
}


@pytest.mark.parametrize("family", sorted(LANGUAGE_MODELS))
def test_featcal_run_language_model_scores_labels(tmp_path, prefect_api, family):
    """A Llama-layout causal LM and a T5 through the whole flow: calibrated by their adapters
    (T5: decoder teacher-forced on the sets' `target` column), evaluated by label scoring (base,
    experts, merged, calibrated), plus perplexity for the causal LM."""
    from featcal_core.data.synthetic import build_pool
    from featcal_core.evaluation.language_model import evaluate_lm_dataset

    config, arch, blocks = LANGUAGE_MODELS[family]
    pool = build_pool(tmp_path / "pool", family, config, ("alpha", "beta"))
    words, prompt = ["good", "bad", "fun"], "review: {text} verdict:"
    params = {
        "run": {"name": family, "results_dir": str(tmp_path / "results")},
        "models": {"base": str(pool.base), "experts": {t: str(p) for t, p in pool.experts.items()}},
        "tasks": {
            task: {
                "calibration": {"path": str(data), "split": "train"},
                "evaluation": {"path": str(data), "split": "test"},
                "label_words": words,
                "prompt": prompt,
            }
            for i, task in enumerate(pool.experts)
            for data in [_labelled_texts(tmp_path / f"text_{task}", seed=i, targets=True)]
        },
        "featcal": {"num_per_task": 12, "batch_size": 4},
    }
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump(params))
    proc = factories.run_featcal(tmp_path, params_path, prefect_api)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = tmp_path / "results"
    record = json.loads((results / "calibrated" / "featcal.json").read_text())
    assert record["architecture"] == arch and len(record["blocks"]) == blocks
    sets = datasets.load_from_disk(str(results / "calibration_sets" / "alpha"))
    assert "target" in sets.column_names  # kept for the T5 decoder
    evaluation = json.loads((results / "evaluation.json").read_text())
    for task in pool.experts:
        row = evaluation[task]
        assert set(row) == {"base", "expert", "merged", "calibrated"}
        assert all(r["examples"] == 12 for r in row.values())
        assert all(("perplexity" in r) == (family == "llama") for r in row.values())
        assert row["expert"]["normalized"] == 1.0
        # the step's numbers are the library's on the same checkpoint and rows
        again = evaluate_lm_dataset(
            results / "calibrated", pool.base, tmp_path / f"text_{task}", "test", words, prompt
        )
        assert row["calibrated"]["accuracy"] == again["accuracy"]
        assert row["calibrated"]["loss"] == pytest.approx(again["loss"], rel=1e-6)  # batching
    assert (tmp_path / "reports" / family / "report.md").is_file()
