"""What an MLflow user sees of a run, through featcal.tracking into a real local SQLite store (the
test process's MLFLOW_TRACKING_URI, tests/conftest.py): only the params that are set, the
checkpoint as an MLflow Model that MLflow's own calls load, and a pointer to the store that runs
as printed."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from factories import TINY_BERT, TINY_CLIP, TINY_LLAMA
from featcal.flows.summary import markdown_summary, run_summary
from featcal.tracking.log import log_metrics, log_model
from featcal.tracking.runs import parent_run, step_run
from featcal.tracking.store import browse_command
from featcal_core.params import Params, load_params

#: what a param that is not set would read as
UNSET = {"None", "null", "", "{}", "[]"}


@pytest.fixture
def store(tmp_path_factory, monkeypatch) -> str:
    """The test process's store (created once per process; a new one costs a schema migration)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def make_params(tmp_path: Path) -> Params:
    """Params whose defaults leave many values null (tracking URI, pooling, ...)."""
    data = {
        "run": {"name": "mlflow-view"},
        "models": {"base": "./zoo/base", "experts": {"a": "./zoo/a", "b": "./zoo/b"}},
        "tasks": {
            task: {
                "calibration": {"path": f"./data/{task}", "split": "train"},
                "evaluation": {"path": f"./data/{task}", "split": "test"},
            }
            for task in ("a", "b")
        },
        "tracking": {"experiment": "featcal-mlflow-view"},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return load_params(path)


def test_only_the_params_that_are_set_are_logged(tmp_path, store):
    from mlflow import MlflowClient

    params = make_params(tmp_path)
    assert params.tracking.mlflow_tracking_uri is None and params.featcal.pooling is None
    with parent_run(params, run_name="params", project_root=tmp_path) as run:
        with step_run("merge") as step:
            pass
    client = MlflowClient(store)
    logged = client.get_run(run.info.run_id).data.params
    assert logged["featcal.alpha"] == str(params.featcal.alpha)
    assert logged["models.experts.a"] == "./zoo/a"
    assert logged["tasks.b.evaluation.split"] == "test"
    assert "tracking.mlflow_tracking_uri" not in logged and "featcal.pooling" not in logged
    assert not {key: value for key, value in logged.items() if value in UNSET}
    nested = client.get_run(step.info.run_id).data.params
    assert not {key: value for key, value in nested.items() if value in UNSET}


def _clip_vision(root: Path):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    model = CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP))
    return model, {"pixel_values": torch.randn(2, 3, 32, 32)}


def _clip(root: Path):
    from transformers import CLIPConfig, CLIPModel

    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=40,
        max_position_embeddings=16,
    )
    model = CLIPModel(CLIPConfig(vision_config=TINY_CLIP, text_config=text, projection_dim=16))
    inputs = {"input_ids": torch.randint(0, 40, (3, 7)), "pixel_values": torch.randn(2, 3, 32, 32)}
    return model, inputs


def _bert(root: Path):
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(vocab_size=40, num_labels=3, **TINY_BERT))
    ids = torch.randint(0, 40, (2, 9))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _t5_encoder(root: Path):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    ids = torch.randint(0, 40, (2, 9))
    return T5EncoderModel(config), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _llama(root: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, **TINY_LLAMA))
    return model, {"input_ids": torch.randint(0, 40, (2, 9))}


FAMILIES = {
    "clip-vision-tower": _clip_vision,
    "clip": _clip,
    "bert": _bert,
    "t5-encoder": _t5_encoder,
    "llama-causal-lm": _llama,
}


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_is_an_mlflow_model_that_mlflow_loads(tmp_path, store, family):
    """The folder a repair writes, logged by `log_model`, is a LoggedModel of the run that
    `mlflow.pyfunc.load_model("models:/<id>")` (and `runs:/<run id>/<name>`) loads: its
    transformers model and its predictions equal the original's."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModelStatus

    torch.manual_seed(0)
    model, inputs = FAMILIES[family](tmp_path)
    model.eval().save_pretrained(tmp_path / "calibrated")
    (tmp_path / "calibrated" / "README.md").write_text("card\n", encoding="utf-8")
    with torch.no_grad():
        expected = model(**inputs)
    params = make_params(tmp_path)
    with parent_run(params, run_name=family, project_root=tmp_path) as run:
        log_metrics({"accuracy_mean/calibrated": 0.75})
        assert log_model(tmp_path / "calibrated", artifact_path="calibrated_model")
    run_id = run.info.run_id

    tags = MlflowClient(store).get_run(run_id).data.tags
    assert tags["model.logged"] == "true" and tags["model.format"] == "mlflow_model"
    (found,) = mlflow.search_logged_models(
        experiment_ids=[run.info.experiment_id],
        filter_string=f"source_run_id = '{run_id}'",
        output_format="list",
    )
    assert found.name == "calibrated_model" and tags["model.id"] == found.model_id
    assert tags["model.uri"] == f"models:/{found.model_id}"
    assert found.status == LoggedModelStatus.READY
    assert found.model_type == model.config.model_type
    assert found.metrics and {m.key: m.value for m in found.metrics} == {
        "accuracy_mean/calibrated": 0.75
    }
    assert found.params["featcal.alpha"] == str(params.featcal.alpha)
    assert not {key: value for key, value in found.params.items() if value in UNSET}

    folder = tmp_path / "calibrated"
    copy = Path(mlflow.artifacts.download_artifacts(tags["model.uri"], dst_path=tmp_path / "copy"))
    logged = copy / "artifacts" / folder.name  # among the model's artifacts, under its own name
    files = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    assert files and sorted(p.relative_to(logged) for p in logged.rglob("*")) == files
    for path in files:  # every file of the folder, unchanged
        if (folder / path).is_file():
            assert (logged / path).read_bytes() == (folder / path).read_bytes()

    uris = [tags["model.uri"]] + ([f"runs:/{run_id}/calibrated_model"] if family == "clip" else [])
    for uri in uris:
        loaded = mlflow.pyfunc.load_model(uri)
        assert type(loaded.unwrap_python_model().model) is type(model)
        predicted = loaded.predict({name: value.numpy() for name, value in inputs.items()})
        assert isinstance(predicted, dict)
        for name, value in expected.items():
            if isinstance(value, torch.Tensor):
                np.testing.assert_allclose(predicted[name], value.numpy(), rtol=1e-5, atol=1e-6)
        assert set(predicted) == {n for n, v in expected.items() if isinstance(v, torch.Tensor)}


def test_other_folders_and_unlogged_weights_are_no_mlflow_model(tmp_path, store):
    """A folder `from_pretrained` cannot load (Surgery's task modules: no config.json) is copied
    as the run's artifacts; with `tracking.log_model: false` no model is logged at all."""
    import mlflow
    from mlflow import MlflowClient

    modules = tmp_path / "surgery"
    (modules / "a").mkdir(parents=True)
    (modules / "a" / "surgery.safetensors").write_bytes(b"weights")
    (modules / "surgery.json").write_text("{}", encoding="utf-8")
    params = make_params(tmp_path)
    with parent_run(params, run_name="files", project_root=tmp_path) as files:
        assert log_model(modules, artifact_path="surgery_modules")
    torch.manual_seed(0)
    model, _ = _bert(tmp_path)
    model.save_pretrained(tmp_path / "bert")
    with parent_run(params, run_name="no-weights", project_root=tmp_path) as unlogged:
        assert not log_model(tmp_path / "bert", artifact_path="calibrated_model", weights=False)

    client = MlflowClient(store)
    assert client.get_run(files.info.run_id).data.tags["model.format"] == "files"
    listed = {a.path for a in client.list_artifacts(files.info.run_id, "surgery_modules")}
    assert listed == {"surgery_modules/a", "surgery_modules/surgery.json"}
    assert client.get_run(unlogged.info.run_id).data.tags["model.logged"] == "false"
    for run in (files, unlogged):
        assert not mlflow.search_logged_models(
            experiment_ids=[run.info.experiment_id],
            filter_string=f"source_run_id = '{run.info.run_id}'",
            output_format="list",
        )


def _printed_command(line: str) -> list[str]:
    """The words of the command in a printed `... (browse: <command>)` line."""
    assert line.endswith(")"), line
    return shlex.split(line[: -len(")")].split("(browse: ", 1)[1].strip("`"))


def test_the_printed_pointer_opens_the_runs_store_as_printed(tmp_path, store):
    """The last lines of `featcal run` name the MLflow UI command with the store's own URI; it
    parses as a shell command line, MLflow's `ui` command accepts its options, and the store it
    names holds the run."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.cli import cli

    with parent_run(make_params(tmp_path), run_name="pointer", project_root=tmp_path) as run:
        uri = mlflow.get_tracking_uri()
    summary = {
        "mlflow_run_id": run.info.run_id,
        "mlflow_uri": uri,
        "evaluation": {"a": {"expert": {"accuracy": 0.9}, "merged": {"accuracy": 0.5}}},
        "paths": {"root": "results"},
    }
    (line,) = [x for x in run_summary(summary).splitlines() if x.startswith("MLflow run:")]
    (markdown,) = [x for x in markdown_summary(summary).splitlines() if "MLflow run" in x]
    for words in (_printed_command(line), _printed_command(markdown)):
        assert words[:3] == ["mlflow", "ui", "--backend-store-uri"]
        options = cli.get_command(None, "ui").make_context("ui", words[2:]).params
        assert options["backend_store_uri"] == uri == store
        assert MlflowClient(words[3]).get_run(run.info.run_id).info.run_name == "pointer"

    spaced = "sqlite:////tmp/my runs/mlruns/mlflow.db?timeout=5"
    words = shlex.split(browse_command(spaced))
    assert words == ["mlflow", "ui", "--backend-store-uri", spaced, "--workers", "1"]
    assert browse_command("http://mlflow.example:5000") == "http://mlflow.example:5000"
    summary["mlflow_uri"] = "http://mlflow.example:5000"
    assert f"{run.info.run_id} (on http://mlflow.example:5000)" in run_summary(summary)
